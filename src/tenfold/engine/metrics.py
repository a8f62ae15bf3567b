"""Per-step metrics: OUT/metrics.jsonl, TensorBoard events, a live rich progress bar.

Only the main rank writes (DESIGN.md: shared files come from rank 0). The JSONL schema
(one object per optimizer step) is an interface others rely on: at least step, loss, lr,
grad_norm, tokens_per_s, mfu, loss_scale, skipped, peak_mem_bytes.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

REQUIRED_KEYS = (
    "step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "loss_scale", "skipped", "peak_mem_bytes",
)


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


class MetricsWriter:
    """Writes metrics.jsonl and TensorBoard scalars; a no-op on non-main ranks."""

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(out_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
            except ImportError:  # tensorboard is a dependency; tolerate a stripped install
                self._tb = None

    def log_step(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: _finite_or_none(v) for k, v in record.items()}
        self._jsonl.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"train/{key}", value, step)

    def log_eval(self, step: int, val_loss: float) -> None:
        if self.enabled and self._tb is not None:
            self._tb.add_scalar("val/loss", val_loss, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def make_progress(enabled: bool):
    """A rich progress bar with ETA and live figures (None when disabled)."""
    if not enabled:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        transient=False,
    )
