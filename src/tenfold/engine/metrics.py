"""Per-step metrics: OUT/metrics.jsonl, TensorBoard events, a live rich progress bar.

Only the main rank writes (DESIGN.md: shared files come from rank 0). The JSONL schema
(one object per optimizer step) is an interface others rely on: at least step, loss, lr,
grad_norm, tokens_per_s, mfu, loss_scale, skipped, peak_mem_bytes.
"""

from __future__ import annotations

import json
import math
import resource
import stat
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
    """Writes metrics.jsonl and TensorBoard scalars; a no-op on non-main ranks.

    Neither is reached through a link planted in OUT (`safe_files.Folder`: metrics.jsonl is
    opened with O_NOFOLLOW, a link at `tensorboard` is refused). `resumed_at`: the step a
    resumed run continues from; TensorBoard hides the old events after it (`purge_step`)."""

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool, resumed_at: int | None = None):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        from tenfold.engine.safe_files import Folder

        out_dir.mkdir(parents=True, exist_ok=True)
        with Folder(out_dir, follow=True) as folder:
            self._jsonl = folder.open_append("metrics.jsonl")
            if tensorboard:
                self._tb = _tensorboard_writer(folder, resumed_at)

    def log_step(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: _finite_or_none(v) for k, v in record.items()}
        self._jsonl.write(json.dumps(clean) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"train/{key}", value, step)

    def log_eval(self, step: int, val_loss: float) -> None:
        if self.enabled and self._tb is not None:
            self._tb.add_scalar("val/loss", val_loss, step)

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _tensorboard_writer(folder, resumed_at: int | None):
    """A SummaryWriter on OUT/tensorboard, a real folder (created here, never through a link)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is a dependency; tolerate a stripped install
        return None
    from tenfold.engine.safe_files import UnsafeFileError

    st = folder.lstat("tensorboard")
    if st is None:
        folder.mkdir("tensorboard")
    elif not stat.S_ISDIR(st.st_mode):
        raise UnsafeFileError(f"{folder.path / 'tensorboard'} is not a folder; tenfold does not follow links in a run folder")
    purge = None if resumed_at is None else resumed_at + 1
    return SummaryWriter(log_dir=str(folder.path / "tensorboard"), purge_step=purge)


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
