"""Per-step metrics: OUT/metrics.jsonl, TensorBoard events and (when asked) Weights & Biases.

Only the main rank writes (shared files come from rank 0). The JSONL schema (one object per
logged optimizer step) is an interface others rely on: at least step, loss, lr, grad_norm,
tokens_per_s, mfu, loss_scale, skipped, peak_mem_bytes.

A resumed run continues the same files: rows after the checkpoint's step (written by the
attempt that was interrupted, and a last line cut short by a kill) are dropped from
metrics.jsonl, and TensorBoard is told to purge its events from that step on
(`SummaryWriter(purge_step=...)`), so no step appears twice in either.

Neither is reached through a symbolic link planted in OUT (`safe_files.Folder`): metrics.jsonl
is read, cut and opened relative to OUT's descriptor with O_NOFOLLOW, and `tensorboard` must
be a real folder (created here when missing).
"""

from __future__ import annotations

import json
import math
import resource
import stat
import sys
from pathlib import Path

import torch

from tenfold.engine.outputs.safe_files import Folder, UnsafeFileError

MAX_METRICS_BYTES = 1 << 34  # read whole to cut on resume; more is not a metrics file
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
    tensor-level breakdown of one step is in summary.json (engine/memory/measure.py)."""
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


def keep_rows_up_to(folder, step: int, name: str = "metrics.jsonl") -> int:
    """Drop the rows of `name` (in a `safe_files.Folder`) after `step`, atomically; a torn last
    line goes too (a line that is not a row elsewhere is kept; at step 0 everything goes).
    Returns how many lines went."""
    if folder.lstat(name) is None:
        return 0
    lines = folder.read_bytes(name, MAX_METRICS_BYTES).splitlines(keepends=True)
    kept = [line for i, line in enumerate(lines) if step > 0 and _keep_row(line, step, last=i == len(lines) - 1)]
    if len(kept) != len(lines):
        folder.write_atomic(name, b"".join(kept))
    return len(lines) - len(kept)


def _keep_row(line: bytes, step: int, last: bool) -> bool:
    try:
        row = json.loads(line)
    except ValueError:
        return not last and line.strip() != b""
    row_step = row.get("step") if isinstance(row, dict) else None
    return not isinstance(row_step, int) or row_step <= step


class MetricsWriter:
    """Writes metrics.jsonl, TensorBoard scalars and W&B rows; a no-op on non-main ranks.

    `start_step`: the step a resumed run continues from (0 for a fresh run, whose file starts
    empty). `dropped_rows`: how many rows that cut removed. `wandb`: an object with
    `log(dict, step)` and `finish()` (engine/observe/wandb_log.py), or None."""

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool, start_step: int = 0, wandb=None):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = wandb
        self.paths: dict[str, tuple[Path, str]] = {}  # name -> (path, what it holds)
        self.dropped_rows = 0
        if not enabled:
            return

        out_dir.mkdir(parents=True, exist_ok=True)
        with Folder(out_dir, follow=True) as folder:
            self.dropped_rows = keep_rows_up_to(folder, start_step)
            self._jsonl = folder.open_append("metrics.jsonl")
            self.paths["metrics"] = (out_dir / "metrics.jsonl", "one JSON row per logged step")
            if tensorboard:
                self._tb = _tensorboard_writer(folder, start_step)
                if self._tb is not None:
                    self.paths["tensorboard"] = (out_dir / "tensorboard", "TensorBoard events")
        if wandb is not None:
            self.paths["wandb"] = (wandb.folder, "Weights & Biases run")

    def log_step(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: _finite_or_none(v) for k, v in record.items()}
        self._jsonl.write(json.dumps(clean) + "\n")
        self._jsonl.flush()
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

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

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


def _tensorboard_writer(folder, start_step: int):
    """A SummaryWriter on OUT/tensorboard, a real folder (created here, never through a link)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is a dependency; tolerate a stripped install
        return None

    st = folder.lstat("tensorboard")
    if st is None:
        folder.mkdir("tensorboard")
    elif not stat.S_ISDIR(st.st_mode):
        raise UnsafeFileError(f"{folder.path / 'tensorboard'} is not a folder; tenfold does not follow links in a run folder")
    # purge_step: TensorBoard hides events of an earlier run in this folder from this step on
    # (all of them for a fresh run, those after the checkpoint for a resumed one).
    return SummaryWriter(log_dir=str(folder.path / "tensorboard"), purge_step=start_step + 1)
