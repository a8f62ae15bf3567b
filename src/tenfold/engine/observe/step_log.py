"""What a run shows on its console per step (main rank only).

On a terminal: a live rich progress bar (loss, tokens/s, MFU, elapsed, ETA). When stdout is not
a terminal (SLURM logs, nohup, CI) or with `--no-progress`: one plain line every `log.log_every`
steps (`--log-every N`, default 1) and at the last step, flushed as it is written:

    step 12/200 | loss 3.4567 | lr 2.00e-03 | 1,234 tok/s | MFU 12.3% | peak RSS 623.30 MiB | 0.52 s/step | eta 1m38s

The memory figure is the process's so far (metrics.jsonl `peak_mem_bytes`), labelled for what it
is: `peak RSS` on a CPU, the resident set's high-water mark (every byte the process holds:
tensors, the libraries, allocator caches, the data); `peak allocated` on CUDA, the caching
allocator's high-water mark of tensor memory. The summary's per-category figures are another
quantity, the tracked tensors of one step (engine/memory/measure.py), the one the planner predicts.

On a terminal, `--log-every N` with N > 1 keeps such a line every N steps above the bar too.
The ETA is the remaining steps times the recent wall time per step (evaluation and checkpoint
saves included).
"""

from __future__ import annotations

from collections import deque

RECENT = 20  # steps the ETA averages over


def process_peak_label(device_type: str) -> str:
    """What `metrics.peak_memory_bytes` measures on this device type, as the step line names it."""
    return "peak allocated" if device_type == "cuda" else "peak RSS"


def fmt_duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def plain_line(row: dict, total_steps: int, eta_s: float | None, peak_label: str = "peak RSS") -> str:
    """One step as one line (module docstring)."""
    from tenfold.plan.for_run import fmt_bytes  # torch-free, the units every report uses

    parts = [f"step {row['step']}/{total_steps}", f"loss {row['loss']:.4f}", f"lr {row['lr']:.2e}",
             f"{row['tokens_per_s']:,.0f} tok/s"]
    if row.get("mfu") is not None:
        parts.append(f"MFU {row['mfu']:.1%}")
    if row.get("peak_mem_bytes"):
        parts.append(f"{peak_label} {fmt_bytes(row['peak_mem_bytes'])}")
    parts.append(f"{row['step_time_s']:.2f} s/step")
    if row.get("val_loss") is not None:
        parts.append(f"val loss {row['val_loss']:.4f}")
    if row.get("loss_scale") not in (None, 1.0):  # fp16's dynamic loss scale
        parts.append(f"loss scale {row['loss_scale']:g}")
    if row.get("skipped"):
        parts.append(f"{row['skipped']} skipped")
    if eta_s is not None:
        parts.append(f"eta {fmt_duration(eta_s)}")
    return " | ".join(parts)


class StepLog:
    """The live bar and/or the plain lines of one run. `console`: a rich Console (None on
    other ranks: then nothing is shown)."""

    def __init__(self, console, total_steps: int, start_step: int, every: int, progress: bool,
                 peak_label: str = "peak RSS"):
        self.console, self.total, self.every, self.peak_label = console, total_steps, every, peak_label
        self.bar = None
        self.lines = False
        self._recent: deque = deque(maxlen=RECENT + 1)  # (step, elapsed_s)
        self._recent.append((start_step, 0.0))
        if console is None:
            return
        if progress and console.is_terminal:
            self.bar = _progress_bar(console)
            self._task = self.bar.add_task("train", total=total_steps, completed=start_step, stats="")
        self.lines = self.bar is None or every > 1

    def start(self) -> None:
        if self.bar is not None:
            self.bar.start()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()

    def eta_s(self, step: int) -> float | None:
        (s0, e0), (s1, e1) = self._recent[0], self._recent[-1]
        return None if s1 <= s0 else (self.total - step) * (e1 - e0) / (s1 - s0)

    def update(self, row: dict) -> None:
        step = row["step"]
        self._recent.append((step, row["elapsed_s"]))
        if self.bar is not None:
            mfu = row.get("mfu")
            stats = f"loss {row['loss']:.4f}  {row['tokens_per_s']:,.0f} tok/s" + (f"  MFU {mfu:.1%}" if mfu else "")
            self.bar.update(self._task, completed=step, stats=stats)
        if self.lines and (step % self.every == 0 or step == self.total):
            self.console.print(plain_line(row, self.total, self.eta_s(step), self.peak_label), markup=False, highlight=False,
                               soft_wrap=True)
            self.console.file.flush()  # a log file or pipe sees the line now, not at exit


def _progress_bar(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        console=console, transient=False,
    )
