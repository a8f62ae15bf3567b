"""One trial: a candidate trained for a short measured window by `tenfold train` in a subprocess
(the same launcher a user runs, `--nproc` ranks under torchrun), measured as the ladder measures
its rungs (tenfold.ladder.measure: steady-state tokens/s after the warm-up step, memory per rank
from the tensor tracker, a time limit, the failure's one-line reason).

Each trial writes the config it trains to `config.toml` in its folder: the candidate's config
with the trial's own settings (no evaluation during the run, no checkpoints, no TensorBoard, a
few MB of text data) written in; `--steps` and `--out` come on the command line, recorded in
tune.json.
"""

from __future__ import annotations

import datetime as _dt
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tenfold.config import build_config, config_toml
from tenfold.tune.candidates import Candidate

MIN_STEADY_STEPS = 2  # measured steps after the warm-up step and the step measured for memory
MAX_STEPS = 200
TRIAL_DATA_BYTES = 3_000_000  # text read per trial (the ladder's --quick): speed does not depend on the text
OOM_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory", "memoryerror", "killed by sigkill")


@dataclass
class Run:
    """One run of a trial (a trial runs again in the confirmation rounds)."""

    round: int
    status: str  # measured | oom | failed | timeout
    reason: str | None
    out_dir: str
    steps: int
    tokens_per_s: float | None = None  # steady state
    warmup_s: float | None = None  # the first step (allocation, kernel selection); not in the rate
    startup_s: float | None = None  # process start to the first step (imports, launch, data, model)
    steady_s: float | None = None  # the measured window
    process_s: float | None = None  # the whole subprocess
    peak_bytes_per_rank: list[int] = field(default_factory=list)
    peak_source: str | None = None  # the tensor tracker / CUDA allocator, or the process's peak RSS
    load_avg: list[float] | None = None
    started: str | None = None  # UTC, ISO 8601: the runs' order across trials and sessions

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def trial_steps(step_s: float, window_s: float) -> int:
    """Warm-up step + the step measured for memory + enough steps to fill the window."""
    steady = max(MIN_STEADY_STEPS, math.ceil(window_s / max(step_s, 1e-6)))
    return min(MAX_STEPS, 2 + steady)


def trial_config(c: Candidate):
    """The candidate's config with the trial's own settings (steps and --out come on the command line)."""
    d = c.config.model_dump(mode="json")
    d["train"].update(eval_every=0, eval_batches=1)
    d["log"].update(tensorboard=False, progress=False)
    d["checkpoint"].update(every=0, resume=None, async_save=False)
    if "final" in d["checkpoint"]:  # a measurement, not a model to keep
        d["checkpoint"]["final"] = False
    data = d["data"]
    if not data["streaming"]:
        need = 16 * c.run.global_batch * (c.run.seq_len + 1) * 4
        data["max_bytes"] = min(data["max_bytes"] or 2**62, max(TRIAL_DATA_BYTES, need))
    return build_config(d)


def run_trial(c: Candidate, folder: Path, round_: int, steps: int, timeout_s: float, limit_bytes: float,
              on_step: Callable[[int], None] | None = None) -> Run:
    """Train `c` for `steps`: `folder/config.toml` (written here), output in `folder/run_<round>`."""
    from tenfold.ladder.measure import RungResult, measure_command

    folder.mkdir(parents=True, exist_ok=True)
    config_file = folder / "config.toml"
    config_file.write_text(config_toml(trial_config(c)))
    out = folder / f"run_{round_}"
    cmd = [sys.executable, "-m", "tenfold", "train", "--config", str(config_file), "--out", str(out),
           "--steps", str(steps), "--no-progress"]
    result = RungResult(round_, c.key, c.name, "pending", None, c.knobs)
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    run = _as_run(measure_command(result, cmd, out, timeout_s, on_step, more_time="--trial-timeout SECONDS"),
                  round_, steps, limit_bytes)
    run.started = started
    return run


def _as_run(m, round_: int, steps: int, limit_bytes: float) -> Run:
    from tenfold.ladder.measure import read_metrics

    run = Run(round_, "measured", None, str(m.out_dir), steps, process_s=m.process_s, load_avg=m.load_avg)
    if m.status != "measured":
        run.status, run.reason = classify_failure(m.reason or "")
        return run
    run.tokens_per_s = m.tokens_per_s
    ranks = m.memory_per_rank or ([m.memory] if m.memory else [])
    run.peak_bytes_per_rank = [int(r["peak_bytes"]) for r in ranks if isinstance(r.get("peak_bytes"), (int, float))]
    run.peak_source = m.memory_source
    _timing(run, read_metrics(Path(m.out_dir) / "metrics.jsonl"), m.wall_s)
    if "RSS" in (m.memory_source or ""):  # not the quantity the limit is about: the runtime's libraries count too
        return run
    over = [(i, b) for i, b in enumerate(run.peak_bytes_per_rank) if b > limit_bytes]
    if over:
        rank, peak = max(over, key=lambda t: t[1])
        run.status = "oom"
        run.reason = (f"out of memory: rank {rank} peaked at {peak / 2**20:,.1f} MiB, over the "
                      f"{limit_bytes / 2**20:,.1f} MiB limit per rank")
    return run


def _timing(run: Run, records: list[dict], wall_s: float | None) -> None:
    """Warm-up = the first step; startup = what the process spent before its first step."""
    timed = sorted((r for r in records if isinstance(r.get("elapsed_s"), (int, float))), key=lambda r: r.get("step", 0))
    if not timed:
        return
    run.warmup_s = timed[0].get("step_time_s")
    run.steady_s = timed[-1]["elapsed_s"] - timed[0]["elapsed_s"]
    if run.process_s is not None and wall_s is not None:
        run.startup_s = max(0.0, run.process_s - wall_s)


def classify_failure(reason: str) -> tuple[str, str]:
    """(status, reason) of a run that did not finish: timeout, oom or failed."""
    text = reason.lower()
    if text.startswith("timed out"):
        return "timeout", reason
    if any(w in text for w in OOM_WORDS):
        return "oom", reason
    return "failed", reason
