"""`build_data`: config -> tokens -> packed train / val sequences, with the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tenfold.data import sources
from tenfold.data.packing import pack_sequences, split_train_val
from tenfold.data.tokenizer import ByteTokenizer, IdTokenizer, build_bpe
from tenfold.errors import UserError


@dataclass
class DataBundle:
    """Packed sequences ([N, seq_len + 1] integer arrays, possibly memmap views) and how they
    were made. `train` and `val` never share a token."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer: Any  # encode(str) -> list[int], decode(ids) -> str
    source: str
    num_tokens: int
    seq_len: int

    def describe(self) -> str:
        return (
            f"{self.source} | {self.num_tokens:,} tokens | {len(self.train):,} train + "
            f"{len(self.val):,} val sequences of {self.seq_len}+1 | tokenizer "
            f"{self.tokenizer.name} (vocab {self.vocab_size})"
        )


def build_data(data_cfg, seq_len: int, seed: int, model_vocab_size: int | None = None) -> DataBundle:
    """Build the training data from a `tenfold.config.DataSection`.

    `seed` is accepted for interface stability but unused: the split is a contiguous tail and
    sample order belongs to `GlobalBatchLoader`. `model_vocab_size`, when given, is checked
    against the data (ids of a `.bin` file, or the tokenizer's vocabulary) so that an id past
    the embedding table is a clear error, not an index error on the first step."""
    del seed
    if seq_len <= 0:
        raise UserError(f"data.seq_len must be a positive integer, got {seq_len}")
    if data_cfg.path is None:
        tokens, tokenizer, source = _text_tokens(sources.read_default_corpus(data_cfg.max_bytes), data_cfg)
    else:
        files = sources.list_data_files(data_cfg.path)
        fmt = sources.resolve_format(files, data_cfg.format)
        if fmt == "bin":
            tokens, tokenizer, source = _bin_tokens(files, data_cfg, model_vocab_size)
        else:
            corpus = sources.read_text_corpus(files, fmt, data_cfg.jsonl_field, data_cfg.max_bytes)
            tokens, tokenizer, source = _text_tokens(corpus, data_cfg)
    if model_vocab_size is not None and tokenizer.vocab_size > model_vocab_size:
        raise UserError(
            f"data.tokenizer={data_cfg.tokenizer} has {tokenizer.vocab_size} tokens but the model's "
            f"vocabulary (model.vocab_size) is {model_vocab_size}; set model.vocab_size="
            f"{tokenizer.vocab_size} or a smaller data.bpe_vocab_size"
        )
    train, val = split_train_val(pack_sequences(tokens, seq_len, source), data_cfg.val_fraction, source)
    return DataBundle(train, val, tokenizer.vocab_size, tokenizer, source, len(tokens), seq_len)


def _text_tokens(corpus: sources.TextCorpus, data_cfg):
    if data_cfg.tokenizer == "bpe":
        tokenizer, tokens = build_bpe(corpus.documents, data_cfg.bpe_vocab_size)
    else:
        tokenizer = ByteTokenizer()
        tokens = tokenizer.encode_documents(corpus.documents)
    return tokens, tokenizer, corpus.source


def _bin_tokens(files, data_cfg, model_vocab_size: int | None):
    tokens = sources.read_bin_tokens(files, data_cfg.bin_dtype, data_cfg.max_bytes)
    source = str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} .bin files)"
    limit = model_vocab_size if model_vocab_size is not None else np.iinfo(tokens.dtype).max + 1
    largest = sources.check_token_ids(tokens, limit, source)
    vocab = model_vocab_size if model_vocab_size is not None else largest + 1
    return tokens, IdTokenizer(vocab), f"{source} ({data_cfg.bin_dtype})"
