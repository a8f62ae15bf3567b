"""Weights & Biases logging (`--wandb`, `log.wandb = true`): optional, imported only when asked.

Needs the `wandb` package (`pip install 'tenfold[wandb]'`). W&B's own environment variables
apply: `WANDB_MODE=offline` logs without a network into OUT/wandb/offline-run-*/ (upload it
later with `wandb sync OUT/wandb/offline-run-*`), `WANDB_API_KEY`, `WANDB_ENTITY`, ...

Each attempt of a run is one W&B run, grouped under the output folder's name; a resumed
attempt is named after the step it resumed from. W&B failing to start (no network, no API
key) does not stop training: the run says why in one line and goes on without it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

from tenfold.errors import UserError


def check_available(wanted: bool) -> None:
    """Called before anything is built or written: the package must be importable."""
    if wanted and not _installed():
        raise UserError(
            "log.wandb (--wandb) needs the wandb package: pip install 'tenfold[wandb]' "
            "(or drop --wandb; metrics.jsonl and TensorBoard are written either way)"
        )


def _installed() -> bool:
    try:
        return importlib.util.find_spec("wandb") is not None
    except ValueError:  # already in sys.modules without a spec (a stand-in): importable
        return True


class WandbRun:
    """The sink MetricsWriter calls: `log(scalars, step)`, `summary(dict)`, `finish()`."""

    def __init__(self, run):
        self.run = run

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def summary(self, figures: dict) -> None:
        self.run.summary.update(figures)

    def finish(self) -> None:
        self.run.finish()

    @property
    def folder(self) -> Path:
        """The run's local folder (OUT/wandb/run-* or offline-run-*)."""
        return Path(self.run.dir).parent


def start(log_section, config: dict, out_dir: Path, start_step: int, say: Callable[[str], None]) -> WandbRun | None:
    """Start the W&B run of this attempt (main rank only), or None after saying why not."""
    import wandb

    name = log_section.wandb_name or out_dir.resolve().name
    if start_step > 0:
        name = f"{name} (resumed at step {start_step})"
    try:
        run = wandb.init(project=log_section.wandb_project, name=name, group=out_dir.resolve().name,
                         # absolute: given a relative folder, an offline run's files were written under
                         # another folder (the repository's, for a run started in a temporary one)
                         dir=str(out_dir.resolve()), config=config)
    except Exception as e:  # noqa: BLE001 - W&B is a side channel: training goes on without it
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        say(f"wandb: not started ({first}); training goes on without it (WANDB_MODE=offline logs without a network)")
        return None
    return WandbRun(run)
