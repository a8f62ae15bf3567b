"""Run one rung as `python -m tenfold train ... --out DIR/rung_k_name` and read what it wrote.

A subprocess per rung: multi-process rungs go through the same `--nproc` launcher a user
would use, every rung starts from a cold process (no allocator or kernel cache carried over
from the rung before), and a rung that fails or hangs is reported without stopping the ladder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from tenfold.ladder.predict import Prediction
from tenfold.ladder.rungs import RungSpec

LOG_NAME = "ladder_rung.log"
WARMUP_STEPS = 1  # the first step pays for first-touch allocation and kernel selection


@dataclass
class RungResult:
    index: int
    name: str
    title: str
    status: str  # measured | skipped | failed
    reason: str | None
    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    out_dir: str | None = None
    command: list[str] | None = None
    tokens: int | None = None
    steps: int | None = None
    tokens_per_s: float | None = None  # steady state: optimizer steps after the first (best of the runs)
    tokens_per_s_runs: list[float] = field(default_factory=list)  # every run's figure, with --repeats > 1
    wall_tokens_per_s: float | None = None  # tokens / the trainer's whole loop (incl. eval, warm-up)
    wall_s: float | None = None  # the trainer's loop for the budget
    process_s: float | None = None  # the subprocess, start to exit (imports, data, launch)
    time_for_budget_s: float | None = None  # budget tokens / tokens_per_s
    mfu: float | None = None
    peak_mem_bytes: int | None = None
    memory: dict[str, Any] = field(default_factory=dict)  # measured, by category (per rank)
    memory_source: str | None = None
    memory_per_rank: list[dict] = field(default_factory=list)  # every rank's measured step (several ranks)
    load_avg: list[float] | None = None  # the machine's 1-minute load average before and after the rung
    cpu_s: float | None = None  # CPU seconds of the rung's processes (all ranks, start-up included)
    val_loss: float | None = None
    loss: float | None = None
    first_loss: float | None = None
    predicted_tokens_per_s: float | None = None
    predicted_peak_bytes: float | None = None
    predicted_memory: dict[str, Any] = field(default_factory=dict)
    prediction_error: str | None = None
    speedup_vs_previous: float | None = None
    speedup_vs_baseline: float | None = None
    time_multiplier: float | None = None  # time for the budget / the previous measured rung's
    cumulative_multiplier: float | None = None  # ... / the baseline's

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def train_command(spec: RungSpec, out_dir: Path, user_set_args: list[str]) -> list[str]:
    """The rung's `tenfold train` command line (user --set items first: the rung's own
    settings must win over them)."""
    cmd = [sys.executable, "-m", "tenfold", "train", "--out", str(out_dir), "--no-progress"]
    if spec.nproc > 1:
        cmd += ["--nproc", str(spec.nproc)]
    return cmd + list(user_set_args) + spec.set_args()


def run_rung(spec: RungSpec, out_dir: Path, user_set_args: list[str], prediction: Prediction,
             timeout_s: float, on_step: Callable[[int], None] | None = None) -> RungResult:
    result = RungResult(spec.index, spec.name, spec.title, "skipped", spec.skip, spec.knobs, list(spec.notes))
    _attach_prediction(result, prediction)
    if spec.skip is not None:  # the config it would have had is not this machine's concern
        result.notes = []
        if result.prediction_error:
            result.prediction_error = None
        return result
    return measure_command(result, train_command(spec, out_dir, user_set_args), out_dir, timeout_s, on_step)


def measure_command(result: RungResult, cmd: list[str], out_dir: Path, timeout_s: float,
                    on_step: Callable[[int], None] | None = None, more_time: str = "--timeout SECONDS") -> RungResult:
    """Run the `tenfold train` command `cmd` writing into `out_dir` (emptied first) and fill
    `result` with what it measured, or with why it failed (`tenfold tune` measures its trials
    with this too). `more_time`: the flag that gives a run more time, named when one times out."""
    if out_dir.exists():  # metrics.jsonl is appended to: a previous run's must go first
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    result.out_dir, result.command = str(out_dir), cmd
    load_before = _load_avg()
    cpu_before = _children_cpu_s()
    rc, elapsed, tail = _run(cmd, out_dir, timeout_s, on_step)
    result.cpu_s = round(_children_cpu_s() - cpu_before, 2)
    result.process_s = elapsed
    # other work on the machine slows a run: say how busy it was (1-minute load vs cores)
    result.load_avg = None if load_before is None else [load_before, _load_avg()]
    summary_path = out_dir / "summary.json"
    if rc != 0 or not summary_path.is_file():
        result.status = "failed"
        result.reason = (timeout_reason(timeout_s, result.load_avg, more_time) if rc is None
                         else f"exit status {rc}: {tail}" if tail else f"exit status {rc}")
        return result
    _read_outputs(result, summary_path, out_dir / "metrics.jsonl")
    result.status, result.reason = "measured", None
    return result


BUSY_LOAD_PER_CORE = 1.0  # more runnable processes than cores: every process waits for a core


def timeout_reason(timeout_s: float, load_avg: list[float] | None, more_time: str) -> str:
    """`timed out after N s`, whether the machine was busy meanwhile (its 1-minute load average
    per core above 1 before or after the run), and the flag that gives more time."""
    cores = os.cpu_count() or 1
    load = max(load_avg) if load_avg else None
    busy = (f"; the machine was busy (load average {load:.1f} on {cores} cores), which slows every run"
            if load is not None and load / cores > BUSY_LOAD_PER_CORE else "")
    return f"timed out after {timeout_s:.0f} s{busy}; give it more time with {more_time}"


def add_repeat(result: RungResult, again: RungResult) -> None:
    """Fold a repeated run of the same rung into `result`: its tokens/s joins
    `tokens_per_s_runs` and the rung counts its best run. Other work on a shared machine only
    ever slows a run, so the best of a few is the estimate of the undisturbed speed (the rule
    `engine/observe/peak.py` uses for the GEMM peak); every rung, the baseline included, gets the same
    number of runs. Memory, losses and the command stay those of the first run (same config)."""
    if result.status != "measured" or not result.tokens_per_s:
        return
    if not result.tokens_per_s_runs:
        result.tokens_per_s_runs = [result.tokens_per_s]
    if again.status != "measured" or not again.tokens_per_s:
        result.notes.append(f"run {len(result.tokens_per_s_runs) + 1} {again.status}: {again.reason}")
        return
    result.tokens_per_s_runs.append(again.tokens_per_s)
    best = max(result.tokens_per_s_runs)
    if result.mfu:
        result.mfu *= best / result.tokens_per_s
    result.tokens_per_s = best
    if result.tokens:
        result.time_for_budget_s = result.tokens / best


def _children_cpu_s() -> float:
    """User + system CPU of the waited-for descendants (torchrun's ranks included: torchrun
    waits for them, we wait for torchrun)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _load_avg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _attach_prediction(result: RungResult, p: Prediction) -> None:
    result.predicted_tokens_per_s = p.tokens_per_s
    result.predicted_peak_bytes = p.peak_bytes
    result.predicted_memory = dict(p.memory)
    result.prediction_error = p.error


def _run(cmd: list[str], out_dir: Path, timeout_s: float, on_step) -> tuple[int | None, float, str]:
    """Run `cmd` in its own process group (so a timeout stops its torchrun ranks too);
    report finished steps from metrics.jsonl while it runs."""
    log_path = out_dir / LOG_NAME
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        rc: int | None = None
        try:
            while True:
                try:
                    rc = proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if on_step is not None:
                    on_step(_count_lines(out_dir / "metrics.jsonl"))
                if time.perf_counter() - start > timeout_s:
                    _stop_group(proc)
                    rc = None
                    break
        except BaseException:  # Ctrl-C / SIGTERM of the ladder: its rung (and ranks) go too
            _stop_group(proc)
            raise
    elapsed = time.perf_counter() - start
    return rc, elapsed, _error_line(log_path)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the run's process group and the ranks torchrun started (each in a session of its
    own, so outside that group), then SIGKILL what is left; return once all of them are gone."""
    ranks = _descendants(proc.pid)
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for kill, target in ((os.killpg, proc.pid), *((os.kill, pid) for pid in ranks)):
            try:
                kill(target, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.perf_counter() + wait
        while time.perf_counter() < deadline:
            if proc.poll() is not None and not any(_alive(pid) for pid in ranks):
                return
            time.sleep(0.1)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _error_line(log_path: Path) -> str:
    """The most telling line of a failed rung's output: tenfold's own one-line error if any."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    # a rank's own error comes as "[rank N] tenfold: error: ..." under torchrun; the launcher's
    # summary ("tenfold: rank 0 failed first: exit status 1") only says which rank failed
    own = [re.sub(r"^\[rank \d+\] ", "", ln) for ln in lines]
    for prefix in ("tenfold: error:", "tenfold: run stopped:", "tenfold: rank"):
        hits = [ln for ln in own if ln.startswith(prefix)]
        if hits:
            return hits[0][:400]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors[-1] if errors else lines[-1] if lines else "")[:400]


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a rank killed mid-line; the complete lines still count
    return out


def steady_tokens_per_s(records: list[dict], tokens_per_step: int) -> float | None:
    """Tokens / wall time of the optimizer steps after the warm-up.

    The wall time is the trainer's `elapsed_s` between the end of the warm-up step and the
    end of the last step: everything the loop does for those steps counts (data, logging,
    the step itself), not only `step_time_s`. A step that carried a memory measurement (the
    tensor tracker slows the step it watches) is counted at the median step time instead.
    Without `elapsed_s`, the summed `step_time_s` of the same steps."""
    timed = sorted((r for r in records if isinstance(r.get("step_time_s"), (int, float)) and r["step_time_s"] > 0),
                   key=lambda r: r.get("step", 0))
    steady = [r for r in timed if r.get("step", 0) > WARMUP_STEPS]
    if not steady:  # one step only: it is all there is
        total = sum(r["step_time_s"] for r in timed)
        return tokens_per_step * len(timed) / total if total > 0 else None
    plain = sorted(r["step_time_s"] for r in steady if not r.get("memory_measured"))
    median = plain[len(plain) // 2] if plain else None
    excess = sum(r["step_time_s"] - median for r in steady if r.get("memory_measured") and median is not None)
    warm = [r for r in timed if r.get("step", 0) <= WARMUP_STEPS]
    if warm and all(isinstance(r.get("elapsed_s"), (int, float)) for r in (warm[-1], steady[-1])):
        total = steady[-1]["elapsed_s"] - warm[-1]["elapsed_s"] - excess
    else:
        total = sum(r["step_time_s"] for r in steady) - excess
    return tokens_per_step * len(steady) / total if total > 0 else None


def _read_outputs(result: RungResult, summary_path: Path, metrics_path: Path) -> None:
    summary = json.loads(summary_path.read_text())
    final, batch = summary.get("final", {}), summary.get("batch", {})
    tokens_per_step = int(batch.get("global_batch", 0)) * int(batch.get("seq_len", 0))
    result.tokens, result.steps = final.get("tokens"), final.get("steps")
    result.wall_s = final.get("wall_s")
    result.wall_tokens_per_s = final.get("tokens_per_s_overall", final.get("tokens_per_s"))
    result.val_loss, result.loss, result.first_loss = final.get("val_loss"), final.get("loss"), final.get("first_loss")
    records = read_metrics(metrics_path)
    measured_step = (summary.get("memory") or {}).get("measured_step")
    for r in records:  # the step the tensor tracker watched runs slower: not a steady step
        if measured_step is not None and r.get("step") == measured_step:
            r["memory_measured"] = True
    result.tokens_per_s = steady_tokens_per_s(records, tokens_per_step) or result.wall_tokens_per_s
    peak_flops = (summary.get("hardware") or {}).get("peak_flops_per_device")
    fpt = (summary.get("model") or {}).get("flops_per_token")
    world = (summary.get("hardware") or {}).get("world_size") or 1
    if peak_flops and fpt and result.tokens_per_s:
        result.mfu = fpt * result.tokens_per_s / (peak_flops * world)
    if result.tokens and result.tokens_per_s:
        result.time_for_budget_s = result.tokens / result.tokens_per_s
    _read_memory(result, summary.get("memory") or {}, records)


def _read_memory(result: RungResult, memory: dict, records: list[dict]) -> None:
    """Measured memory by category from summary.json (`memory.measured`, engine/memory/measure.py;
    with several ranks `memory.measured_per_rank`, and the most loaded rank is the one shown:
    pipeline stages differ); without it, the process's peak resident set (not by category)."""
    per_rank = memory.get("measured_per_rank")
    if isinstance(per_rank, list) and per_rank:
        result.memory_per_rank = [x if isinstance(x, dict) else {"peak_bytes": x} for x in per_rank]
    ranks = [r for r in result.memory_per_rank if isinstance(r.get("peak_bytes"), (int, float))]
    measured = memory.get("measured")
    if ranks and "activations_bytes" in ranks[0]:
        worst = max(range(len(ranks)), key=lambda i: ranks[i]["peak_bytes"])
        measured = ranks[worst]
        source = f"tensor tracker (one step), rank {worst} of {len(ranks)}, the most loaded"
    else:
        source = "tensor tracker (one step)"
    if isinstance(measured, dict) and measured.get("peak_bytes"):
        result.memory = dict(measured)
        result.memory_source = source
        result.peak_mem_bytes = int(measured["peak_bytes"])
        return
    rss = memory.get("peak_mem_bytes") or max((r.get("peak_mem_bytes") or 0 for r in records), default=0)
    if ranks:
        rss = max(r["peak_bytes"] for r in ranks)  # the most loaded rank
    if rss:
        result.memory = {"peak_bytes": int(rss)}
        result.memory_source = "process peak RSS (no per-category measurement in summary.json)"
        result.peak_mem_bytes = int(rss)
