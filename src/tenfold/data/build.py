"""`build_data`: config -> tokenizer -> records -> packed train / val rows (or a row stream)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tenfold.data import hf_datasets, sources
from tenfold.data.bundle import DataBundle
from tenfold.data.examples import ExampleRows, PackStats, example_rows
from tenfold.data.packing import pack_sequences, split_train_val
from tenfold.data.records import FINETUNE_FORMATS, RecordSource, detect_format, record_text
from tenfold.data.sidecar import read_sidecar
from tenfold.data.streaming_build import stream_bundle
from tenfold.data.tokenizer import IdTokenizer, build_bpe, load_named_tokenizer, resolve_tokenizer
from tenfold.errors import UserError


def build_data(data_cfg, seq_len: int, seed: int, model_vocab_size: int | None = None,
               hf_pretrained: str | None = None) -> DataBundle:
    """Build the training data from a `tenfold.config.DataSection`.

    `seed` is accepted for interface stability but unused: the split is a contiguous tail and
    sample order belongs to the loader. `model_vocab_size`, when given, is checked against the
    data (ids of a `.bin` file, or the tokenizer's vocabulary) so that an id past the embedding
    table is a clear error, not an index error on the first step. `hf_pretrained`: the model
    folder whose own tokenizer is the default."""
    del seed
    if seq_len <= 0:
        raise UserError(f"data.seq_len must be a positive integer, got {seq_len}")
    tokenizer = resolve_tokenizer(data_cfg, hf_pretrained)
    given = tokenizer if data_cfg.tokenizer is not None or hf_pretrained else None  # not the default bytes
    _check_vocab(given, model_vocab_size, data_cfg)
    source, fmt = open_source(data_cfg)
    if fmt == "bin":
        if data_cfg.tokenizer == "bpe":
            raise UserError("data.tokenizer=bpe is trained on text; a .bin file is already token ids")
        return _bin_bundle(source.files, data_cfg, seq_len, model_vocab_size, given)
    _check_vocab(tokenizer, model_vocab_size, data_cfg)
    if tokenizer is None and (data_cfg.streaming or fmt in FINETUNE_FORMATS):
        raise UserError(f"data.tokenizer=bpe is trained on the whole text at once; data.format={fmt}"
                        f"{' with data.streaming' if data_cfg.streaming else ''} needs a fixed tokenizer: "
                        "byte, or --tokenizer PATH (a tokenizer.json or tokenizer folder)")
    if data_cfg.streaming:
        return stream_bundle(source, fmt, tokenizer, data_cfg, seq_len)
    if fmt in FINETUNE_FORMATS:
        return _examples_bundle(source, fmt, tokenizer, data_cfg, seq_len)
    tokens, tokenizer = _text_tokens(_documents(source, data_cfg), data_cfg, tokenizer)
    _check_vocab(tokenizer, model_vocab_size, data_cfg)
    train, val = split_train_val(pack_sequences(tokens, seq_len, source.name), data_cfg.val_fraction, source.name)
    return DataBundle(train, val, tokenizer.vocab_size, tokenizer, source.name, len(tokens), seq_len, fmt)


def _check_vocab(tokenizer, model_vocab_size: int | None, data_cfg) -> None:
    if tokenizer is None or model_vocab_size is None or tokenizer.vocab_size <= model_vocab_size:
        return
    fix = ("a smaller data.bpe_vocab_size" if tokenizer.name == "bpe"
           else "the model's own tokenizer, or a model whose embedding is large enough")
    raise UserError(
        f"data.tokenizer={data_cfg.tokenizer or tokenizer.name} has {tokenizer.vocab_size} tokens but the model's "
        f"embedding has {model_vocab_size} rows (model.vocab_size, or vocab_size in the Hugging Face config.json); "
        f"use {fix}"
    )


def open_source(data_cfg) -> tuple[RecordSource, str]:
    """Where the records are and which format they have (`data.format`, or detected)."""
    path, fmt = data_cfg.path, data_cfg.format
    if path is None:
        return RecordSource("text", "python-stdlib", files=sources.default_corpus_files()), _text_format(fmt)
    if path.startswith(hf_datasets.HF_PREFIX) or hf_datasets.is_saved_dataset(Path(path).expanduser()):
        source = hf_datasets.open_dataset(path, None, data_cfg.split, data_cfg.streaming)
        return source, _record_format(source, fmt, data_cfg)
    files = sources.list_data_files(path)
    if hf_datasets.builder_of(files) and fmt != "text":
        source = hf_datasets.open_dataset(path, files, data_cfg.split, data_cfg.streaming)
        return source, _record_format(source, fmt, data_cfg)
    kind = sources.resolve_format(files, "auto" if fmt in FINETUNE_FORMATS else fmt)
    name = str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} files)"
    if kind == "bin" or fmt == "text" or sources.all_text(files):
        return RecordSource("text", name, files=files), "bin" if kind == "bin" else "text"
    if kind == "mixed" and fmt == "auto":
        if data_cfg.streaming:
            raise UserError("data.streaming reads one kind of file; data.path mixes text and JSONL files")
        return RecordSource("mixed", name, files=files), "text"
    source = RecordSource("jsonl", name, files=files)
    return source, _record_format(source, fmt, data_cfg)


def _text_format(fmt: str) -> str:
    if fmt not in ("auto", "text"):
        raise UserError(f"data.format={fmt} needs data.path (the default corpus is plain text)")
    return "text"


def _record_format(source: RecordSource, fmt: str, data_cfg) -> str:
    if fmt == "auto":
        return detect_format(source.first_record()[1], source.name, data_cfg.jsonl_field)
    return "jsonl" if fmt == "text" else fmt


def _documents(source: RecordSource, data_cfg) -> sources.TextCorpus:
    """The in-memory text path: every document (bytes), up to data.max_bytes in all."""
    if data_cfg.path is None:
        return sources.read_default_corpus(data_cfg.max_bytes)
    if source.kind != "dataset":
        return sources.read_text_corpus(source.files, source.kind, data_cfg.jsonl_field, data_cfg.max_bytes)
    docs, total = [], 0
    for i, record in source.records():
        doc = record_text(record, data_cfg.jsonl_field, f"{source.name} record {i}")
        doc = doc.encode("utf-8") if isinstance(doc, str) else doc
        if data_cfg.max_bytes is not None and total + len(doc) >= data_cfg.max_bytes:
            docs.append(doc[: data_cfg.max_bytes - total])
            total = data_cfg.max_bytes
            break
        docs.append(doc)
        total += len(doc)
    if not docs:
        raise UserError(f"data.path: {source.name} holds no records")
    return sources.TextCorpus(docs, source.name, total)


def _text_tokens(corpus: sources.TextCorpus, data_cfg, tokenizer):
    if tokenizer is None:  # bpe: trained on this corpus
        tokenizer, tokens = build_bpe(corpus.documents, data_cfg.bpe_vocab_size)
        return tokens, tokenizer
    return tokenizer.encode_documents(corpus.documents), tokenizer


def _examples_bundle(source: RecordSource, fmt: str, tokenizer, data_cfg, seq_len: int) -> DataBundle:
    """Fine-tuning records -> ExampleRows, the last ceil(N * val_fraction) rows held out."""
    stats = PackStats()
    rows = [row for row, _ in example_rows(source, fmt, tokenizer, seq_len + 1, data_cfg.packing, stats=stats)]
    if not rows:
        raise UserError(f"{source.name}: no example has a target token within seq_len + 1 = {seq_len + 1} ids "
                        "(every prompt is longer); use a longer --seq-len")
    train, val = split_train_val(ExampleRows.stack(rows), data_cfg.val_fraction, source.name)
    return DataBundle(train, val, tokenizer.vocab_size, tokenizer, source.name, stats.target_tokens, seq_len,
                      fmt, pack_stats=stats, packing=data_cfg.packing)


def _bin_bundle(files, data_cfg, seq_len: int, model_vocab_size: int | None, given) -> DataBundle:
    """Pre-tokenized ids. `given`: a tokenizer the run names (--tokenizer, --hf-pretrained), or None."""
    sidecar = read_sidecar(files[0]) if len(files) == 1 else {}
    dtype = data_cfg.bin_dtype or sidecar.get("dtype", "uint16")
    tokens = sources.read_bin_tokens(files, dtype, data_cfg.max_bytes)
    source = str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} .bin files)"
    limit = model_vocab_size if model_vocab_size is not None else np.iinfo(tokens.dtype).max + 1
    largest = sources.check_token_ids(tokens, limit, source)
    tokenizer = _bin_tokenizer(sidecar.get("tokenizer") or {}, given, source)
    vocab = model_vocab_size if model_vocab_size is not None else max(largest + 1, getattr(tokenizer, "vocab_size", 0))
    tokenizer = tokenizer if tokenizer is not None else IdTokenizer(vocab)
    train, val = split_train_val(pack_sequences(tokens, seq_len, source), data_cfg.val_fraction, source)
    return DataBundle(train, val, vocab, tokenizer, f"{source} ({dtype})", len(tokens), seq_len, "bin")


def _bin_tokenizer(made_with: dict, given, source: str):
    """The tokenizer a `data prepare` FILE.json names; a tokenizer the run names must be that one."""
    if not made_with:
        return given
    if given is None:
        return load_named_tokenizer(made_with)
    if given.describe().get("sha256") != made_with.get("sha256"):
        raise UserError(
            f"{source} was prepared with the tokenizer {made_with.get('name')} but this run's tokenizer is "
            f"{given.name}; pass --tokenizer {made_with.get('name')}, or prepare the data again")
    return given
