"""`tenfold data prepare IN --out FILE.bin [--tokenizer ...]`: tokenize once, train many times.

Writes the ids of every document of IN, exactly as a run tokenizes them on the fly, into
FILE.bin (uint16 when the vocabulary fits, else uint32; nanoGPT's flat layout, memory-mapped by
`tenfold train --data FILE.bin`) and FILE.json beside it: the dtype, the counts, and the
tokenizer, which a later run loads (or checks its own `--tokenizer` against). Documents are
read and encoded one at a time, so IN may be larger than memory. Both files are written under
temporary names and renamed at the end: an interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from tenfold.config import DataSection
from tenfold.data.build import open_source
from tenfold.data.records import FINETUNE_FORMATS, record_text
from tenfold.data.sidecar import SIDECAR_FORMAT, sidecar_path
from tenfold.data.tokenizer import resolve_tokenizer
from tenfold.errors import UserError
from tenfold.out_paths import check_output_file

FLUSH_IDS = 1 << 20  # ids buffered in memory before a write


def prepare(source_path: str, out: str | Path, tokenizer: str | None = None, data_format: str = "auto",
            jsonl_field: str = "text", split: str = "train", progress: bool = True, overwrite: bool = False) -> dict:
    """Tokenize `source_path` into `out` (see the module docstring); returns FILE.json's content.
    An existing FILE.bin or FILE.json is replaced only with `overwrite`."""
    out = _checked_out(Path(out), overwrite)
    cfg = DataSection(path=source_path, format=data_format, tokenizer=tokenizer, jsonl_field=jsonl_field,
                      split=split, streaming=True)
    tok = resolve_tokenizer(cfg)
    if tok is None:
        raise UserError("data prepare needs a fixed tokenizer: byte, or --tokenizer PATH (bpe is trained per run)")
    source, fmt = open_source(cfg)
    if fmt == "bin":
        raise UserError(f"data prepare: {source_path} is already token ids (.bin)")
    if fmt in FINETUNE_FORMATS:
        raise UserError(f"data prepare writes plain token streams; {fmt} records keep their loss masks, so "
                        "train on them directly (tenfold train --data ...)")
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    counts = _write_ids(source, tok, cfg.jsonl_field, out, dtype, progress)
    info = {"format": SIDECAR_FORMAT, "dtype": np.dtype(dtype).name, "source": source.name,
            "data_format": fmt, **counts, "tokenizer": tok.describe()}
    tmp, ids = sidecar_path(out).with_name(f".{sidecar_path(out).name}.tmp"), out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(json.dumps(info, indent=1) + "\n")
        os.replace(ids, out)
        os.replace(tmp, sidecar_path(out))
    except OSError as e:
        _remove_quietly(tmp, ids)
        raise UserError(f"data prepare --out {out}: cannot write it ({e.strerror or e})") from None
    return {**info, "out": str(out)}


def _checked_out(out: Path, overwrite: bool) -> Path:
    """--out before any work: a .bin in a folder that can be written, and without --overwrite
    neither FILE.bin nor FILE.json already there (a run's data, or someone's JSON, is not replaced
    silently)."""
    if out.suffix != ".bin":
        raise UserError(f"data prepare --out {out}: the output must be a .bin file")
    check_output_file(out, flag="data prepare --out", example="corpus.bin")
    if not overwrite:
        there = [str(p) for p in (out, sidecar_path(out)) if os.path.lexists(p)]
        if there:
            verb = "exist" if len(there) > 1 else "exists"
            raise UserError(f"data prepare --out {out}: {' and '.join(there)} already {verb}; pass --overwrite to "
                            "replace, or choose another --out")
    return out


def _remove_quietly(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink(missing_ok=True)
        except OSError:  # a read-only file system refuses the clean-up too
            pass


def _write_ids(source, tok, jsonl_field: str, out: Path, dtype, show: bool) -> dict:
    """Every document's ids, appended to OUT's temporary file; {"documents", "tokens"}."""
    tmp = out.with_name(f".{out.name}.tmp")
    buf: list[int] = []
    docs = tokens = 0
    first = None
    bar = _progress(show, _total(source))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fh = open(tmp, "wb")
    except OSError as e:
        raise UserError(f"data prepare --out {out}: cannot write it ({e.strerror or e})") from None
    try:
        with fh, bar:
            task = bar.add_task("tokenize", total=_total(source), ids="0 ids")
            for i, record in source.records():
                first = i if first is None else first
                buf += tok.document_ids(record_text(record, jsonl_field, f"{source.name} record {i}"), int(i != first))
                docs += 1
                if len(buf) >= FLUSH_IDS:
                    tokens += _flush(buf, fh, dtype)
                bar.update(task, advance=1, ids=f"{tokens + len(buf):,} ids")
            tokens += _flush(buf, fh, dtype)
    except BaseException:
        _remove_quietly(tmp)
        raise
    if tokens == 0:
        tmp.unlink(missing_ok=True)
        raise UserError(f"data prepare: {source.name} holds no text")
    return {"documents": docs, "tokens": tokens}


def _flush(buf: list[int], fh, dtype) -> int:
    n = len(buf)
    np.asarray(buf, dtype=dtype).tofile(fh)
    buf.clear()
    return n


def _total(source) -> int | None:
    """Records to read, when cheap to know: files of text, lines of JSONL, rows of a dataset."""
    if source.kind == "text":
        return len(source.files)
    if source.kind == "jsonl":
        return sum(sum(1 for line in open(f, "rb") if line.strip()) for f in source.files)
    try:
        return len(source.dataset)
    except TypeError:  # a streamed dataset has no length
        return None


def _progress(show: bool, total: int | None):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = [TextColumn("[bold]data prepare[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[ids]}")]
    if total:
        columns.append(TimeRemainingColumn())
    return Progress(*columns, disable=not show, transient=False)


# --------------------------------------------------------------------------- CLI


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="prepare data: tokenize once into a memory-mapped .bin",
                              description="Data tools. `tenfold data prepare IN --out FILE.bin` tokenizes once.")
    sub = p.add_subparsers(dest="data_command", metavar="{prepare}")
    q = sub.add_parser("prepare", help="tokenize IN into FILE.bin (+ FILE.json) for repeated runs",
                       description=__doc__.splitlines()[0])
    q.add_argument("input", metavar="IN", help="a text / JSONL file or folder, parquet / arrow / JSON files, "
                   "a datasets save_to_disk folder, or hf:NAME[:CONFIG] from the local cache")
    q.add_argument("--out", required=True, metavar="FILE.bin", help="the token file; FILE.json is written beside it")
    q.add_argument("--tokenizer", help="byte (default) or a tokenizer.json / Hugging Face tokenizer folder")
    q.add_argument("--data-format", default="auto", choices=["auto", "text", "jsonl"], help="record shape (default: detected)")
    q.add_argument("--jsonl-field", default="text", help="the field holding the text (default 'text')")
    q.add_argument("--split", default="train", help="the split of a Hugging Face dataset (default train)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing FILE.bin / FILE.json (refused without it)")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=run)
    p.set_defaults(func=lambda args: p.error("choose a data command: prepare"))


def run(args: argparse.Namespace) -> int:
    info = prepare(args.input, args.out, args.tokenizer, args.data_format, args.jsonl_field, args.split,
                   progress=not args.no_progress, overwrite=args.overwrite)
    print(f"tenfold data prepare: {info['documents']:,} documents -> {info['tokens']:,} ids ({info['dtype']}) "
          f"in {info['out']}; tokenizer {info['tokenizer']['name']}; wrote {sidecar_path(info['out'])}")
    return 0
