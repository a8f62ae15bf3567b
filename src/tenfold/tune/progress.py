"""What a tune says while it runs: a progress bar over the budget (on a terminal, unless
--no-progress) and one line per run, always (a log file or CI output gets the lines alone)."""

from __future__ import annotations

import sys

from tenfold.tune.choose import Action, Outlook
from tenfold.tune.state import Trial
from tenfold.tune.trial import Run


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def run_line(trial: Trial, run: Run, outlook: Outlook | None) -> str:
    """`t3 bf16 | 8x1x dp 2 | ...: 7,234 tok/s (planner 6,100; calibrated 7,050) | peak 120 MiB/rank, tracked
    tensors | 41 s` (`peak RSS` where the tensor tracker could not follow the run)"""
    head = f"{trial.id} run {run.round} [{trial.name}]"
    if run.status != "measured":
        return f"{head}: {run.status}: {run.reason}"
    planned = f"planner {trial.predicted_before:,.0f}" + (f", calibrated {outlook.tokens_per_s:,.0f}" if outlook else "")
    peak = max(run.peak_bytes_per_rank) if run.peak_bytes_per_rank else None
    which = "peak RSS {}/rank (process)" if "RSS" in (run.peak_source or "") else "peak {}/rank, tracked tensors"
    return (f"{head}: {run.tokens_per_s:,.0f} tok/s ({planned}) | {which.format(_mib(peak))} | "
            f"{run.process_s or 0:,.0f} s (warm-up {run.warmup_s or 0:,.1f} s, start-up {run.startup_s or 0:,.1f} s)")


class TuneLog:
    def __init__(self, budget_s: float, show_bar: bool):
        from rich.console import Console

        self.console = Console(width=None if sys.stdout.isatty() else 200, highlight=False, soft_wrap=True)
        self.progress = None
        if show_bar and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn

            self.progress = Progress(TextColumn("[bold]tune[/]"), BarColumn(),
                                     TextColumn("{task.completed:,.0f} / {task.total:,.0f} s"),
                                     TextColumn("{task.fields[detail]}"), console=self.console, transient=True)
            self.task = self.progress.add_task("tune", total=budget_s, detail="")
            self.progress.start()

    def say(self, text: str) -> None:
        self.console.print(text, markup=False)

    def start_run(self, trial: Trial, action: Action, steps: int, expected_s: float) -> None:
        self.say(f"{trial.id} run {action.round} [{trial.name}]: {action.kind}, {action.why}; "
                 f"{steps} steps, ~{expected_s:,.0f} s")
        self._detail(f"{trial.id} run {action.round}: starting")

    def tick(self, elapsed_s: float, steps_done: int, steps: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=min(elapsed_s, self.progress.tasks[0].total or elapsed_s),
                                 detail=f"step {steps_done}/{steps}")

    def end_run(self, trial: Trial, run: Run, outlook: Outlook | None) -> None:
        self.say(run_line(trial, run, outlook))

    def finish_loop(self, why: str) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.say(f"stopped: {why}")

    def _detail(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, detail=text)
