"""Data: default corpus (the Python standard library), text / JSONL / `.bin` files, Hugging Face
`datasets`, prompt/completion and chat fine-tuning records; byte, BPE or a model's own
tokenizer; packing, a validation split, and the resumable split-independent loaders (in memory,
or streamed for corpora larger than memory).

    bundle = build_data(cfg.data, seq_len, seed, model_vocab_size=..., hf_pretrained=...)
    loader = make_loader(bundle, global_batch, micro_batch, grad_accum, dp_rank, dp_size, seed)
    micro_batches = loader.next_step()          # grad_accum dicts of input_ids / labels
    for batch in iter_eval(bundle.val, batch_size, max_batches): ...

See docs/data.md.
"""

from tenfold.data.build import build_data
from tenfold.data.bundle import DataBundle
from tenfold.data.loader import GlobalBatchLoader, iter_eval, to_batch
from tenfold.data.stream import StreamingLoader, make_loader
from tenfold.terms import IGNORE_INDEX
from tenfold.data.tokenizer import BPETokenizer, ByteTokenizer, IdTokenizer

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "DataBundle",
    "GlobalBatchLoader",
    "IGNORE_INDEX",
    "IdTokenizer",
    "StreamingLoader",
    "build_data",
    "iter_eval",
    "make_loader",
    "to_batch",
]
