"""Per-step metrics: OUT/metrics.jsonl, TensorBoard events and (when asked) Weights & Biases.

Only the main rank writes (shared files come from rank 0). The JSONL schema (one object per
logged optimizer step) is an interface others rely on: at least step, loss, lr, grad_norm,
tokens_per_s, mfu, loss_scale, skipped, peak_mem_bytes.

A resumed run continues the same files: rows after the checkpoint's step (written by the
attempt that was interrupted) are dropped from metrics.jsonl, and TensorBoard is told to
purge its events from that step on (`SummaryWriter(purge_step=...)`), so no step appears
twice in either.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path

import torch

REQUIRED_KEYS = (
    "step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "loss_scale", "skipped", "peak_mem_bytes",
)

# metrics.jsonl key -> TensorBoard / W&B tag. One tag per quantity: the validation loss is
# written once, as `val/loss` by `log_eval` (the row's val_loss is not repeated under train/).
STEP_TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "loss_scale": "train/loss_scale",
    "skipped": "train/skipped_steps", "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s", "peak_mem_bytes": "memory/peak_bytes",
}
VAL_LOSS_TAG = "val/loss"
# summary.json `final` figures with no per-step tag of their own, logged once under final/.
FINAL_KEYS = ("tokens_per_s", "tokens_per_s_overall", "warmup_steps", "warmup_s", "mfu", "wall_s")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank so far: the CUDA allocator's high-water mark on GPU; on CPU
    the process's resident-set high-water mark (getrusage, KiB on Linux). The per-category
    tensor-level breakdown of one step is in summary.json (engine/memory.py)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _finite_or_none(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def keep_rows_up_to(path: Path, step: int) -> None:
    """Drop the rows of metrics.jsonl after `step` (atomically; a torn last line goes too)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


class MetricsWriter:
    """Writes metrics.jsonl, TensorBoard scalars and W&B rows; a no-op on non-main ranks.

    `start_step`: the step a resumed run continues from (0 for a fresh run). `wandb`: an
    object with `log(dict, step)` and `finish()` (engine/wandb_log.py), or None."""

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool, start_step: int = 0, wandb=None):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = wandb
        self.paths: dict[str, tuple[Path, str]] = {}  # name -> (path, what it holds)
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        jsonl = out_dir / "metrics.jsonl"
        if start_step > 0:
            keep_rows_up_to(jsonl, start_step)
        elif jsonl.exists():
            jsonl.unlink()  # a fresh run in a used folder: its own rows only
        self._jsonl = open(jsonl, "a", buffering=1)
        self.paths["metrics"] = (jsonl, "one JSON row per logged step")
        if tensorboard:
            self._tb = _tensorboard_writer(out_dir / "tensorboard", start_step)
            if self._tb is not None:
                self.paths["tensorboard"] = (out_dir / "tensorboard", "TensorBoard events")
        if wandb is not None:
            self.paths["wandb"] = (wandb.folder, "Weights & Biases run")

    def log_step(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: _finite_or_none(v) for k, v in record.items()}
        self._jsonl.write(json.dumps(clean) + "\n")
        scalars = {tag: record[key] for key, tag in STEP_TAGS.items() if _number(record.get(key))}
        step = record["step"]
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step)

    def log_eval(self, step: int, val_loss: float) -> None:
        if not self.enabled:
            return
        if self._tb is not None:
            self._tb.add_scalar(VAL_LOSS_TAG, val_loss, step)
        if self._wandb is not None:
            self._wandb.log({VAL_LOSS_TAG: val_loss}, step)

    def log_final(self, figures: dict) -> None:
        """The run's final figures (steady-state tokens/s, warm-up, MFU): TensorBoard scalars
        under final/ at the last step, the W&B run summary."""
        if not self.enabled:
            return
        numbers = {k: figures[k] for k in FINAL_KEYS if _number(figures.get(k))}
        step = int(figures.get("steps", 0))
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(f"final/{key}", value, step)
        if self._wandb is not None:
            self._wandb.summary({f"final/{k}": v for k, v in numbers.items()})

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl = self._tb = self._wandb = None
        self.enabled = False


def _tensorboard_writer(folder: Path, start_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is a dependency; tolerate a stripped install
        return None
    # purge_step: TensorBoard hides events of an earlier run in this folder from this step on
    # (all of them for a fresh run, those after the checkpoint for a resumed one).
    return SummaryWriter(log_dir=str(folder), purge_step=start_step + 1)
