"""`tenfold export`: one consolidated safetensors file (+ the model config as JSON) from a
sharded DCP checkpoint: the recipe's `stage3_gather_16bit_weights_on_model_save`, done offline.

Consolidation runs on ONE process and needs no model object: the checkpoint's own `.metadata`
(read with the allow-list unpickler) gives every weight's full shape and dtype, empty tensors of
those shapes are allocated, and `dcp.load` fills them from however many shard files the
training ranks wrote (DCP does the resharding). So a 2-rank ZeRO-3 or pipeline checkpoint
exports the same as a one-process one. Only `model.*` entries are read: the optimizer state
(2/3 of a checkpoint under AdamW) is never loaded.

Output, every path named from `--out NAME.safetensors`: NAME.safetensors (weights cast to
--dtype, keys = the model's parameter names, a tied embedding once as `tok_emb.weight`, loadable
with `safetensors.torch.load_file` + `model.load_state_dict`), NAME.config.json (the `ModelConfig` fields + dtype, step and source)
and, when the run saved its tokenizer, NAME.tokenizer/ (no fixed-name `tokenizer/` beside it that
could be another run's). A Hugging Face model's export is the folder `--out` names. Nothing that
exists is replaced without `--overwrite`; files are written to a temporary name and renamed, so
a failed export leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tenfold.config import build_config
from tenfold.data.hf_tokenizer import copy_tokenizer_files
from tenfold.engine.outputs import adapter_export
from tenfold.engine.parallel import distributed as d
from tenfold.engine.outputs.checkpoint import layout as lay
from tenfold.engine.outputs.checkpoint.reader import SafeLoadPlanner, SafeReader, inner_error, read_safe_metadata
from tenfold.engine.outputs.folder import check_checkpoint_path, check_out_path, check_output_file
from tenfold.engine.outputs.safe_files import Folder
from tenfold.errors import UserError
from tenfold.models.hf import export_checkpoint_to_hf, ties_word_embeddings, write_hf_folder
from tenfold.techniques.precision import DTYPES  # the one name -> torch dtype table

MODEL_PREFIX = "model."


def config_path_for(out: Path) -> Path:
    """model.safetensors -> model.config.json (beside it)."""
    return out.with_name(out.name.removesuffix(".safetensors") + ".config.json")


def tokenizer_path_for(out: Path, ckpt: Path) -> Path | None:
    """model.safetensors -> model.tokenizer/ beside it; None in the run's own folder, where the
    run's `tokenizer/` is beside it already."""
    if out.parent.resolve() == default_out(ckpt).parent.resolve():
        return None
    return out.with_name(out.name.removesuffix(".safetensors") + ".tokenizer")


def default_out(ckpt: Path) -> Path:
    """OUT/checkpoints/step_N -> OUT/model.safetensors."""
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return run_dir / "model.safetensors"


def consolidated_model_state(ckpt: Path, listed: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Every `model.*` tensor of a DCP checkpoint, full-size, on CPU, in the saved dtype.
    `listed`: the manifest's file names (storage files must be among them)."""
    metadata = read_safe_metadata(ckpt, listed)
    shapes = {
        fqn[len(MODEL_PREFIX):]: meta
        for fqn, meta in metadata.state_dict_metadata.items()
        if fqn.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    if not shapes:
        raise lay.CheckpointError(f"checkpoint {ckpt} holds no model weights (no 'model.*' entries in .metadata)")
    state = {"model": {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in shapes.items()}}
    try:
        with warnings.catch_warnings():  # "torch.distributed is not initialized": one process is the point
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeReader(ckpt, listed), planner=SafeLoadPlanner(), no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        raise lay.CheckpointError(f"cannot read the weights of checkpoint {ckpt}: {d.first_line(inner_error(e))}") from None
    return state["model"]


# A tied model's (embedding, head) names: the head is the embedding, exported once under its name.
TIED_NAMES = {"tenfold": ("tok_emb.weight", "output.weight"), "hf": ("model.embed_tokens.weight", "lm_head.weight")}


def one_tied_weight(weights: dict[str, torch.Tensor], tied: bool, kind: str, ckpt: Path) -> dict[str, torch.Tensor]:
    """A tied model's weights with the tied matrix once, under the embedding's name (as Hugging
    Face's save_pretrained writes it; GPT.load_state_dict and from_pretrained tie the head back).
    A checkpoint holds it under both names: one Parameter's two names on one process, the first
    and the last pipeline stage's copies under pipelining, which training keeps equal; copies
    that differ are a damaged checkpoint, not something to choose from."""
    embedding, head = TIED_NAMES[kind]
    if not tied or head not in weights or embedding not in weights:
        return weights
    copy = weights.pop(head)
    if not torch.equal(copy, weights[embedding]):
        raise lay.CheckpointError(
            f"checkpoint {ckpt}: the tied weights {embedding} and {head} differ (max "
            f"{(copy - weights[embedding]).abs().max().item():.3g}); the model ties them, so they must be equal")
    return weights


def saved_model_section(ckpt: Path) -> dict:
    """The `[model]` section of the checkpoint's config.json."""
    saved = lay.read_json(ckpt / lay.CONFIG_FILE)
    model = saved.get("model", {}) if isinstance(saved, dict) else None
    if not isinstance(model, dict):
        raise lay.CheckpointError(f"malformed checkpoint file {ckpt / lay.CONFIG_FILE}: no [model] section")
    return model


def model_config_of(ckpt: Path) -> dict:
    """The checkpoint's resolved model shape (preset + overrides) as a plain dict."""

    saved = saved_model_section(ckpt)
    try:
        mc = build_config({"model": saved}).model_config_resolved()
    except UserError as e:
        raise lay.CheckpointError(f"checkpoint config {ckpt / lay.CONFIG_FILE} is not valid: {e}") from None
    return {"name": saved.get("name"), **mc.to_dict()}


def write_safetensors(weights: dict[str, torch.Tensor], out: Path, dtype: str, info: dict) -> tuple[Path, Path]:
    """Cast, write OUT.safetensors and OUT.config.json atomically; return both paths."""

    torch_dtype = DTYPES[dtype]
    # A tied head is written once, as tok_emb.weight (one_tied_weight): no storage is shared.
    tensors = {k: v.detach().to("cpu", torch_dtype).contiguous() for k, v in sorted(weights.items())}
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg_path = config_path_for(out)
    meta = {"format": "pt", "tenfold": json.dumps(info, sort_keys=True)}
    tmp_out, tmp_cfg = f".{out.name}.tmp", f".{cfg_path.name}.tmp"
    with Folder(out.parent, follow=True) as folder:
        try:
            for tmp in (tmp_out, tmp_cfg):  # a stale scratch file, or a link planted there: the entry itself
                folder.remove(tmp)
            folder.create(tmp_out, b"")  # O_EXCL | O_NOFOLLOW: safetensors writes this new file, no link
            save_file(tensors, str(out.parent / tmp_out), metadata=meta)
            folder.create(tmp_cfg, (json.dumps(info, indent=1, sort_keys=True) + "\n").encode())
            folder.rename(tmp_out, out.name)
            folder.rename(tmp_cfg, cfg_path.name)
        except OSError as e:
            for tmp in (tmp_out, tmp_cfg):
                folder.remove(tmp)
            raise UserError(f"export: cannot write {out}: {e.strerror or e}") from None
    return out, cfg_path


def export_checkpoint(source: str | Path, out: str | Path | None = None, dtype: str = "bf16",
                      overwrite: bool = False, tokenizer: bool = True, merge: bool = False) -> dict:
    """Consolidate `source` (a checkpoint, or a run directory: its newest complete checkpoint)
    into safetensors. One process; returns a summary dict. `overwrite`: replace what exists at
    the paths `out` names; `tokenizer`: copy the run's tokenizer beside the weights. A LoRA run's
    checkpoint gives its adapters as a PEFT folder, or with `merge` the merged model
    (engine/outputs/adapter_export.py)."""
    if dtype not in DTYPES:
        raise UserError(f"export --dtype {dtype!r} is not supported; allowed: {', '.join(sorted(DTYPES))}")

    check_checkpoint_path(source, "export")
    ckpt = lay.resolve_checkpoint_path(source)
    try:  # --out checked before the work (hashing every file): the model's kind says file or folder
        _checked_out(ckpt, out, saved_model_section(ckpt), overwrite, merge)
    except lay.CheckpointError:
        pass  # a bad config.json is reported below, after the manifest's own checks
    manifest = lay.verify_checkpoint(ckpt, collective=False)
    listed = set(manifest["files"])
    saved_model = saved_model_section(ckpt)
    out_path = _checked_out(ckpt, out, saved_model, overwrite, merge)  # its bytes are verified now
    saved = lay.read_json(ckpt / lay.CONFIG_FILE)
    if adapter_export.is_lora_run(saved) or merge:
        return _export_lora(ckpt, saved, out_path, dtype, merge, listed, manifest["step"], tokenizer)
    if saved_model.get("hf_config") or saved_model.get("hf_pretrained"):  # [any model] -> save_pretrained folder

        out_dir = out_path
        info = {"dtype": dtype, "step": manifest["step"], "source": str(ckpt)}
        tied = ties_word_embeddings(saved_model.get("hf_pretrained") or saved_model.get("hf_config"))
        weights = one_tied_weight(consolidated_model_state(ckpt, listed), tied, "hf", ckpt)
        summary = export_checkpoint_to_hf(weights, saved_model, out_dir, info)
        return {**summary, "tokenizer": _copy_run_tokenizer(ckpt, out_dir) if tokenizer else None}
    model_cfg = model_config_of(ckpt)
    weights = one_tied_weight(consolidated_model_state(ckpt, listed), model_cfg["tie_embeddings"], "tenfold", ckpt)
    info = {
        "format": "tenfold-gpt", "model": model_cfg, "dtype": dtype, "step": manifest["step"],
        "source": str(ckpt), "num_params": int(sum(v.numel() for v in weights.values())),
    }
    st_path, cfg_path = write_safetensors(weights, out_path, dtype, info)
    beside = tokenizer_path_for(out_path, ckpt) or default_out(ckpt).parent / "tokenizer"
    copied = _copy_run_tokenizer(ckpt, beside, overwrite) if tokenizer else None
    return {**info, "safetensors": str(st_path), "config": str(cfg_path), "bytes": st_path.stat().st_size,
            "tokenizer": copied}


def _export_lora(ckpt: Path, saved: dict, out: Path, dtype: str, merge: bool, listed: set, step: int,
                 tokenizer: bool) -> dict:
    """A LoRA run's adapters (a PEFT folder), or merged into its base with `merge`."""
    adapter_export.check_merge_allowed(adapter_export.is_lora_run(saved), merge)
    cfg = build_config(saved)
    weights = adapter_export.adapter_weights(consolidated_model_state(ckpt, listed), ckpt)
    info = {"dtype": dtype, "step": step, "source": str(ckpt)}
    if not merge:
        return {**info, **adapter_export.write_adapters(weights, cfg, out, dtype), "bytes": _bytes_under(out), "tokenizer": None}
    record = lay.load_trainer_state(ckpt).get("lora") or {}
    model = adapter_export.merged_model(weights, cfg, record, ckpt)
    if cfg.model.hf_config or cfg.model.hf_pretrained:
        folder, n_params = write_hf_folder(model.state_dict(), model.config, out, dtype)
        return {**info, "format": "hf-save_pretrained", "merged": True, "num_params": n_params, "safetensors": str(folder),
                "config": str(folder / "config.json"), "bytes": _bytes_under(folder),
                "tokenizer": _copy_run_tokenizer(ckpt, folder) if tokenizer else None}
    model_cfg = model_config_of(ckpt)
    weights = one_tied_weight(dict(model.state_dict()), model_cfg["tie_embeddings"], "tenfold", ckpt)
    info.update(format="tenfold-gpt", model=model_cfg, merged=True, num_params=int(sum(v.numel() for v in weights.values())))
    st_path, cfg_path = write_safetensors(weights, out, dtype, info)
    return {**info, "safetensors": str(st_path), "config": str(cfg_path), "bytes": st_path.stat().st_size,
            "tokenizer": None}


def _bytes_under(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def _checked_out(ckpt: Path, out: str | Path | None, saved_model: dict, overwrite: bool, merge: bool = False) -> Path:
    """Where the export goes (one line if it cannot be written, or if it would replace something
    without --overwrite): a Hugging Face model's is a folder, a LoRA run's adapters too."""

    lora_run = adapter_export.is_lora_run(lay.read_json(ckpt / lay.CONFIG_FILE))
    if lora_run and not merge:
        folder = Path(out) if out is not None else default_out(ckpt).with_name(adapter_export.ADAPTER_FOLDER)
        checked = check_out_path(folder, flag="export --out")
        there = [str(folder)] if folder.is_dir() and any(folder.iterdir()) else []
    elif saved_model.get("hf_config") or saved_model.get("hf_pretrained"):
        folder = Path(out).with_suffix("") if out is not None else default_out(ckpt).with_name("hf")
        checked = check_out_path(folder, flag="export --out")
        there = [str(folder)] if folder.is_dir() and any(folder.iterdir()) else []
    else:
        checked = check_output_file(Path(out) if out is not None else default_out(ckpt))
        names = (checked, config_path_for(checked), tokenizer_path_for(checked, ckpt))
        there = [str(p) for p in names if p is not None and os.path.lexists(p)]
    if there and not overwrite:
        raise UserError(f"export --out {checked}: {', '.join(there)} already {'exist' if len(there) > 1 else 'exists'}; "
                        "pass --overwrite to replace, or choose another --out")
    return checked


def _copy_run_tokenizer(ckpt: Path, out_dir: Path, replace: bool = False) -> str | None:
    """The run's OUT/tokenizer (saved by `tenfold train`) copied to `out_dir` (`replace`: an
    earlier copy there goes first, so no stale file of another tokenizer stays beside it)."""

    source = default_out(ckpt).parent / "tokenizer"
    if replace and out_dir.is_dir() and not out_dir.is_symlink() and source.resolve() != out_dir.resolve():
        shutil.rmtree(out_dir)
    copied = copy_tokenizer_files(source, out_dir)
    return str(copied) if copied else None


def export_after_training(out_dir: str | Path, ckpt: Path, precision: str, log=print) -> dict | None:
    """`checkpoint.export_16bit` (DeepSpeed's stage3_gather_16bit_weights_on_model_save):
    the final checkpoint -> OUT/model.safetensors in the run's 16-bit dtype (fp16 runs keep
    fp16, everything else bf16). Collective: rank 0 writes, and a failure there is a failure
    on every rank. Returns the export summary on rank 0, None elsewhere."""
    dtype = "fp16" if precision == "fp16" else "bf16"

    def export() -> dict | None:
        if d.rank_now() != 0:
            return None
        # the run's own file (replaced on every such export); its tokenizer is OUT/tokenizer already
        summary = export_checkpoint(ckpt, Path(out_dir) / "model.safetensors", dtype, overwrite=True, tokenizer=False)
        log(f"export: {summary['safetensors']} ({dtype}, {summary['bytes'] / 2**20:.1f} MiB) + {summary['config']}")
        return summary

    return d.on_every_rank(export)


# --------------------------------------------------------------------------- CLI


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a checkpoint's weights as one safetensors file (+ model config)",
        description="Consolidate a (sharded) DCP checkpoint into one safetensors file plus "
                    "NAME.config.json, on one process (DeepSpeed's stage3_gather_16bit_weights_on_model_save).",
    )
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                   help="a checkpoint directory (OUT/checkpoints/step_N) or a run directory (its newest complete checkpoint)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of the exported weights (default bf16)")
    p.add_argument("--out", help="output NAME.safetensors (default OUT/model.safetensors); the config goes to NAME.config.json "
                   "and the run's tokenizer to NAME.tokenizer/ beside it (a Hugging Face model: the folder NAME)")
    p.add_argument("--overwrite", action="store_true", help="replace what exists at those paths (refused without it)")
    p.add_argument("--merge", action="store_true", help="a LoRA run: merge the adapters into the base it was trained "
                   "on (rebuilt and checked by sha256) and write the merged model (default: the adapters as a PEFT "
                   "folder, OUT/adapter)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    summary = export_checkpoint(args.source, args.out, args.dtype, overwrite=args.overwrite, merge=args.merge)
    print(
        f"tenfold export: step {summary['step']} of {summary['source']} -> {summary['safetensors']} "
        f"({summary['num_params'] / 1e6:.2f}M params, {summary['dtype']}, {summary['bytes'] / 2**20:.1f} MiB); "
        f"config {summary['config']}" + (f"; tokenizer {summary['tokenizer']}" if summary.get("tokenizer") else "")
    )
    return 0
