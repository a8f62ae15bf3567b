"""`tenfold tune`: which run comes next (pure), the trial's settings and failure reasons, the
resumable state, bad options; and one real tune on a shrunken `tiny` on 2 ranks, shared by the
tests at the end: within its budget and one run, all outputs written, a candidate over the memory
limit recorded and skipped, best.toml trains, the calibrated hardware file is what `tenfold plan`
uses, and a second run on the same folder runs no finished trial again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tenfold.cli import main
from tenfold.errors import UserError
from tenfold.tune import choose
from tenfold.tune.choose import Outlook
from tenfold.tune.state import Trial, fingerprint, load
from tenfold.tune.trial import Run, classify_failure, trial_steps


def _trial(tid: str, key: str, rates: list[float | None], baseline: bool = False) -> Trial:
    t = Trial(tid, key, key, baseline, {}, f"/x/{tid}", 100.0, None)
    for i, r in enumerate(rates, start=1):
        t.runs.append(Run(i, "measured" if r else "oom", None if r else "out of memory", "", 4, tokens_per_s=r))
    return t


# --------------------------------------------------------------------------- the choice


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_bf16_trials_on_a_cpu_only_where_it_has_bf16_matrix_instructions(monkeypatch, fast_bf16):
    from tenfold import host
    from tenfold.tune import setup

    monkeypatch.setattr(host, "cpu_has_bf16_matmul", lambda: fast_bf16)
    tried, bf16_runs = setup._precisions("cpu")
    assert tried == (["fp32", "bf16"] if fast_bf16 else ["fp32"])  # never fp16 on a CPU
    assert bf16_runs  # a user's own bf16 baseline still runs in bf16 (torch's CPU autocast)


def test_the_baseline_runs_first_whatever_the_planner_says():
    a = choose.next_action("base", [], [Outlook("fast", 1e6, 0.1)], None)
    assert (a.kind, a.key, a.round) == ("baseline", "base", 1)


def test_explore_the_most_optimistic_and_prune_what_cannot_win():
    trials = [_trial("t1", "base", [100.0], baseline=True)]
    outlooks = [Outlook("sure", 110.0, 0.01), Outlook("unsure", 90.0, 0.5), Outlook("hopeless", 50.0, 0.1)]
    a = choose.next_action("base", trials, outlooks, None)
    assert (a.kind, a.key) == ("explore", "unsure")  # 90 x e^0.75 = 190 > 110 x e^0.015
    assert [o.key for o in choose.promising(outlooks, {"base": trials[0]}, 100.0)] == ["unsure", "sure"]
    trials.append(_trial("t2", "unsure", [95.0]))
    trials.append(_trial("t3", "sure", [120.0]))
    # best measured 120: hopeless's optimistic 50 x e^0.15 = 58 cannot change the answer
    a = choose.next_action("base", trials, [outlooks[2]], None)
    assert a.kind == "confirm"


def test_failed_trials_rule_out_their_layout_and_what_needs_more_memory():
    shapes = {"il4": choose.Shape((0, 2, "interleaved", 1), 100.0), "il2": choose.Shape((0, 2, "interleaved", 1), 90.0),
              "1f1b": choose.Shape((0, 2, "1f1b", 1), 90.0), "big": choose.Shape((3, 1, None, 1), 500.0),
              "huge": choose.Shape((2, 1, None, 1), 900.0), "small": choose.Shape((3, 1, None, 1), 50.0)}
    failed, oom = _trial("t2", "il4", [None]), _trial("t3", "big", [None])
    failed.runs[0].status = "failed"
    out = choose.ruled_out([failed, oom], shapes)
    assert out == {"il2": "the same layout failed in t2", "huge": "predicted to need at least the memory t3 ran out of"}
    timed_out = _trial("t4", "1f1b", [None])
    timed_out.runs[0].status = "timeout"
    assert choose.ruled_out([timed_out], shapes) == {}  # a timeout says nothing about the others
    outlooks = [Outlook("il2", 1e6, 0.1, out["il2"]), Outlook("small", 10.0, 0.1)]
    assert [o.key for o in choose.promising(outlooks, {}, 5.0)] == ["small"]


def test_max_trials_ends_exploring():
    trials = [_trial("t1", "base", [100.0], baseline=True), _trial("t2", "a", [120.0])]
    a = choose.next_action("base", trials, [Outlook("b", 500.0, 0.1)], explored_cap=1)
    assert a.kind == "confirm"


def test_confirmation_halves_the_field_then_stops():
    trials = [_trial(f"t{i}", f"k{i}", [100.0 + i]) for i in range(1, 9)]  # 8 measured once
    ran = []
    while (a := choose.confirmation(trials)) is not None:
        t = next(t for t in trials if t.key == a.key)
        assert a.round == len(t.runs) + 1
        t.runs.append(Run(a.round, "measured", None, "", 4, tokens_per_s=t.tokens_per_s))
        ran.append((a.key, a.round))
    # round 2: the best 4 run again; round 3: the best 2 of those
    assert ran == [("k8", 2), ("k7", 2), ("k6", 2), ("k5", 2), ("k8", 3), ("k7", 3)]
    assert choose.confirmation([_trial("t1", "only", [100.0])]) is None  # nothing to compare with


def test_a_trial_counts_its_best_run_and_failed_trials_its_reason():
    t = _trial("t1", "k", [100.0, 130.0, None])
    assert t.tokens_per_s == 130.0 and t.status == "measured"
    bad = _trial("t2", "k2", [None])
    assert bad.status == "oom" and bad.reason == "out of memory" and bad.tokens_per_s is None


def test_each_peak_is_labelled_for_what_it_measured():
    """A pipeline trial on a CPU has the process's peak RSS (464.1 MiB) where the others have
    one step's tracked tensors: it is marked RSS, not shown as if it compared with the planner's
    47.5 MiB."""
    from tenfold.tune.markdown import PEAK_NOTE, TRIAL_HEADER, trial_rows
    from tenfold.tune.progress import run_line

    mib = 2**20
    tracked, rss = _trial("t1", "zero", [1000.0], baseline=True), _trial("t2", "pp", [900.0])
    tracked.runs[0].peak_bytes_per_rank, tracked.runs[0].peak_source = [int(30 * mib)], "tensor tracker (one step)"
    rss.runs[0].peak_bytes_per_rank = [int(464.1 * mib), int(400 * mib)]
    rss.runs[0].peak_source = "process peak RSS (no per-category measurement in summary.json)"
    rss.predicted_peak_bytes = tracked.predicted_peak_bytes = 47.5 * mib
    doc = {"trials": [tracked.to_dict(), rss.to_dict()]}
    peaks = [row[-1] for row in trial_rows(doc)]
    assert peaks == ["30.0 (47.5)", "464.1 RSS (47.5)"]
    assert TRIAL_HEADER[-1] == "peak MiB/rank: tracked tensors (planner)"
    assert "peak 30.0 MiB/rank, tracked tensors |" in run_line(tracked, tracked.runs[0], None)
    assert "peak RSS 464.1 MiB/rank (process) |" in run_line(rss, rss.runs[0], None)
    assert "`RSS`: the process's peak resident set" in PEAK_NOTE


# --------------------------------------------------------------------------- trials


def test_trial_steps_fill_the_window_after_warmup_and_the_memory_step():
    assert trial_steps(step_s=10.0, window_s=20.0) == 4  # 2 + 2 measured
    assert trial_steps(step_s=1.0, window_s=20.0) == 22
    assert trial_steps(step_s=100.0, window_s=20.0) == 4  # at least two measured steps
    assert trial_steps(step_s=1e-6, window_s=20.0) == 200  # capped


@pytest.mark.parametrize("reason, status", [
    ("timed out after 120 s", "timeout"),
    ("exit status 1: tenfold: rank 0 failed first: exit status 1: CUDA out of memory. Tried to allocate", "oom"),
    ("exit status 1: RuntimeError: [enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory", "oom"),
    ("exit status 1: tenfold: rank 1 failed first: killed by SIGKILL", "oom"),
    ("exit status 2: tenfold: error: parallel.pp_degree 3 must divide", "failed"),
])
def test_failures_are_classified(reason, status):
    assert classify_failure(reason) == (status, reason)


def test_a_tune_folder_belongs_to_one_setup(tmp_path):
    from tenfold.config import build_config
    from tenfold.tune.state import save

    cfg = build_config({"model": {"name": "tiny"}, "train": {"micro_batch": 4}})
    other_strategy = build_config({"model": {"name": "tiny"}, "train": {"micro_batch": 2}, "parallel": {"zero_stage": 3}})
    key = fingerprint(cfg, 2, "cpu", 16, 256)
    assert key == fingerprint(other_strategy, 2, "cpu", 16, 256)  # what a tune varies is not the setup
    t = _trial("t1", "k", [100.0])
    t.runs.append(Run(2, "running", None, "", 4))  # interrupted: runs again
    save(tmp_path / "tune.json", {"setup": key, "trials": [t.to_dict()]})
    back = load(tmp_path / "tune.json", key)
    assert [r.round for r in back[0].runs] == [1] and back[0].tokens_per_s == 100.0
    with pytest.raises(UserError, match="another setup .*nproc"):
        load(tmp_path / "tune.json", fingerprint(cfg, 4, "cpu", 16, 256))
    (tmp_path / "tune.json").write_text("{not json")
    with pytest.raises(UserError, match="not a tune.json"):
        load(tmp_path / "tune.json", key)


@pytest.mark.parametrize("flags, message", [
    (["--budget", "0"], "--budget must be a positive number"),
    (["--fixed", "precision,colour"], "unknown knob"),
    (["--margin", "0.95"], "--margin must be in"),
    (["--memory-limit", "lots"], "--memory-limit 'lots' is not a size"),
    (["--max-trials", "1.5"], "--max-trials must be a positive integer"),
])
def test_bad_options_exit_2_with_one_line(flags, message, capsys, tmp_path):
    assert main(["tune", "--out", str(tmp_path / "t"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists()  # nothing written


def test_a_stopped_run_leaves_no_rank_behind(tmp_path):
    """torchrun starts each rank in a session of its own, outside the run's process group: a run
    that is stopped (a timeout, Ctrl-C) must stop them too, even when they ignore SIGTERM and
    outlive the launcher."""
    from tenfold.ladder.measure import _alive, _descendants, _stop_group

    rank = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    launcher = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True)
    deadline = time.time() + 30
    while not _descendants(proc.pid) and time.time() < deadline:
        time.sleep(0.1)
    family = _descendants(proc.pid)
    assert family, "the rank did not start"
    _stop_group(proc)
    assert proc.poll() is not None
    assert not [pid for pid in family if _alive(pid)]


# --------------------------------------------------------------------------- one real tune


SHAPE = ["--set", "model.n_layers=2", "--set", "model.d_model=64", "--set", "model.n_heads=4", "--set", "model.d_ff=128",
         "--set", "model.max_seq_len=64", "--seq-len", "64", "--set", "data.max_bytes=300000"]
# The baseline: micro-batch 32 x 2 ranks under ZeRO-3. At 12 MiB per rank (margin 0.1) the planner
# lets in ZeRO-2/3 candidates up to micro-batch 16 (about 10 MiB predicted); the baseline needs about
# 18 MiB (measured and predicted), so its trial runs and is recorded as out of memory.
BASELINE = ["--nproc", "2", "--micro-batch", "32", "--global-batch", "64", "--zero", "3", "--precision", "fp32"]
BUDGET_S = 70.0


def _tune(out: Path, *extra: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "tenfold", "tune", *SHAPE, *BASELINE, "--memory-limit", "12MiB", "--window", "1",
           "--out", str(out), *extra]
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, COLUMNS="200"))
    return r, time.perf_counter() - start


def _busy_machine(monkeypatch, outcome, start_s: float = 0.0):
    """A tune whose runs take `outcome(trial_key, is_baseline)` = (status, seconds): each run
    advances the tune's clock by its seconds; measured runs get the planner's rate. `start_s`:
    the clock when the loop starts (imports, the search and the first fit take time too)."""
    from tenfold.tune import runner
    from tenfold.tune.trial import Run as TrialRun

    clock = [start_s]
    monkeypatch.setattr(runner.Tune, "elapsed", property(lambda self: clock[0]))
    started = []

    def fake_run_trial(c, folder, round_, steps, timeout_s, limit_bytes, on_step=None):
        status, seconds = outcome(c.key, c.baseline)
        started.append((c.key, clock[0]))
        clock[0] += seconds
        rate = c.prior.tokens_per_s if status == "measured" else None
        reason = {"oom": "out of memory: rank 0 peaked at 18.0 MiB, over the 12.0 MiB limit per rank",
                  "timeout": "timed out after 120 s; give it more time with --trial-timeout SECONDS"}.get(status)
        return TrialRun(round_, status, reason, str(folder / f"run_{round_}"), steps, tokens_per_s=rate,
                        steady_s=seconds / 2 if rate else None, process_s=seconds, peak_bytes_per_rank=[2**20])

    monkeypatch.setattr(runner, "run_trial", fake_run_trial)
    return started


def test_a_baseline_that_takes_the_whole_budget_still_leaves_a_measured_trial(tmp_path, capsys, monkeypatch):
    """Busy machine: the baseline (over the memory limit on purpose) runs 100 s of a 70 s budget;
    the tune goes on past the budget until one trial is measured, then stops, exit 0."""
    started = _busy_machine(monkeypatch, lambda key, baseline: ("oom", 100.0) if baseline else ("measured", 10.0))
    out = tmp_path / "t"
    assert main(["tune", *SHAPE, *BASELINE, "--memory-limit", "12MiB", "--window", "1", "--budget", "70",
                 "--no-progress", "--out", str(out)]) == 0
    doc = json.loads((out / "tune.json").read_text())
    assert [t["status"] for t in doc["trials"]] == ["oom", "measured"] and len(started) == 2
    assert started[1][1] == 100.0  # started past the budget: nothing had been measured
    assert doc["stop_reason"].startswith("budget spent") and (out / "best.toml").is_file()
    assert "tenfold: error" not in capsys.readouterr().err


def test_a_sessions_first_run_starts_even_when_the_search_took_the_budget(tmp_path, monkeypatch):
    """`--budget 1` on a folder with finished trials: the search and the first fit take longer
    than the budget on a busy machine, and the one run the session promises still starts."""
    out = tmp_path / "t"
    argv = ["tune", *SHAPE, *BASELINE, "--memory-limit", "12MiB", "--window", "1", "--no-progress", "--out", str(out)]
    _busy_machine(monkeypatch, lambda key, baseline: ("oom", 10.0) if baseline else ("measured", 10.0))
    assert main([*argv, "--budget", "30"]) == 0
    first = sum(len(t["runs"]) for t in json.loads((out / "tune.json").read_text())["trials"])
    started = _busy_machine(monkeypatch, lambda key, baseline: ("measured", 10.0), start_s=5.0)
    assert main([*argv, "--budget", "1"]) == 0
    assert len(started) == 1
    assert sum(len(t["runs"]) for t in json.loads((out / "tune.json").read_text())["trials"]) == first + 1


def test_a_tune_that_measures_nothing_says_why_in_one_line(tmp_path, capsys, monkeypatch):
    from tenfold.tune.runner import RUNS_PAST_BUDGET

    started = _busy_machine(monkeypatch, lambda key, baseline: ("oom", 100.0) if baseline else ("timeout", 120.0))
    out = tmp_path / "t"
    assert main(["tune", *SHAPE, *BASELINE, "--memory-limit", "12MiB", "--window", "1", "--budget", "70",
                 "--no-progress", "--out", str(out)]) == 1
    assert len(started) == 1 + RUNS_PAST_BUDGET  # bounded: not every candidate on a machine this slow
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tenfold: error: no trial was measured (budget spent: "), err
    assert "t1 [" in err[0] and "oom (out of memory" in err[0] and "timeout (timed out after 120 s" in err[0]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "t"
    r, wall = _tune(out, "--budget", str(BUDGET_S))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r, wall, json.loads((out / "tune.json").read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_tune_ends_within_its_budget_and_one_run(tuned):
    out, r, wall, doc = tuned
    runs = sorted((run for t in doc["trials"] for run in t["runs"]), key=lambda run: run["started"])
    assert len(runs) >= 2
    longest = max(run["process_s"] for run in runs)
    # past the budget only while nothing is measured: on a busy machine the deliberately-oom
    # baseline can take all of it, and the tune still ends with the first measured trial
    first = next(i for i, run in enumerate(runs) if run["status"] == "measured")
    until_measured = sum(run["process_s"] for run in runs[:first + 1])
    limit = max(BUDGET_S, until_measured)
    assert doc["elapsed_s"] <= limit + longest + 15  # + the refits between runs
    assert wall <= limit + longest + 90  # + imports, the search and the reports
    assert "budget spent" in doc["stop_reason"] or "nothing left" in doc["stop_reason"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_tune_writes_its_outputs_and_one_line_per_run(tuned):
    out, r, wall, doc = tuned
    for name in ("tune.json", "tune.md", "tune.png", "best.toml", "hardware.toml"):
        assert (out / name).is_file(), name
    assert (out / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trial = doc["trials"][1]
    for key in ("knobs", "tokens_per_s", "peak_bytes_per_rank", "predicted_before", "predicted_after", "status"):
        assert key in trial
    assert len(trial["peak_bytes_per_rank"]) == 2  # every rank's measured peak
    ids = [t["id"] for t in doc["trials"]]
    lines = [ln for ln in r.stdout.splitlines() if ln.split(" ")[0] in ids and " run " in ln and "]: " in ln]
    assert len(lines) == 2 * sum(len(t["runs"]) for t in doc["trials"])  # a line as each run starts and ends
    md = (out / "tune.md").read_text()
    assert "## Trials, fastest first" in md and "## Calibration" in md
    c = doc["candidates"]
    assert not c["baseline_fits"] and c["fitting"] > c["tried"] == len(doc["trials"]) - 1 >= 1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_candidate_over_the_memory_limit_is_recorded_and_skipped(tuned):
    out, r, wall, doc = tuned
    base = doc["trials"][0]
    assert base["baseline"] and base["status"] == "oom" and "12.0 MiB limit per rank" in base["reason"]
    assert max(base["runs"][0]["peak_bytes_per_rank"]) > 12 * 2**20
    assert any(t["status"] == "measured" for t in doc["trials"][1:])  # the tune went on
    assert doc["best"]["trial"] != base["id"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_best_toml_trains_and_the_calibrated_machine_is_what_plan_uses(tuned, tmp_path):
    out, r, wall, doc = tuned
    best = next(t for t in doc["trials"] if t["id"] == doc["best"]["trial"])
    run = subprocess.run([sys.executable, "-m", "tenfold", "train", "--config", str(out / "best.toml"), "--steps", "2",
                          "--out", str(tmp_path / "run"), "--no-progress"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["hardware"]["world_size"] == 2
    assert summary["batch"]["micro_batch"] == best["knobs"]["micro_batch"]
    assert summary["batch"]["global_batch"] == 64
    plan = subprocess.run([sys.executable, "-m", "tenfold", "plan", "--config", str(out / "best.toml"), "--hardware-file",
                           str(out / "hardware.toml"), "--json"], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    got = json.loads(plan.stdout)
    assert got["hardware"] == "cpu-tuned"
    assert got["tokens_per_s"] == pytest.approx(best["predicted_after"], rel=1e-9)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_run_on_the_same_folder_runs_no_finished_trial_again(tuned):
    out, r, wall, doc = tuned
    before = {(t["key"], run["round"]): run for t in doc["trials"] for run in t["runs"]}
    stamps = {p: p.stat().st_mtime_ns for p in (out / "trials").rglob("summary.json")}
    r2, _ = _tune(out, "--budget", "1")  # the first run of a session always starts: exactly one
    assert r2.returncode == 0, r2.stderr[-2000:]
    doc2 = json.loads((out / "tune.json").read_text())
    after = {(t["key"], run["round"]): run for t in doc2["trials"] for run in t["runs"]}
    assert {k: after[k] for k in before} == before  # every finished run kept as it was
    new = set(after) - set(before)
    assert len(new) == 1
    assert all(p.stat().st_mtime_ns == m for p, m in stamps.items())  # and its files untouched
    assert f"{len(doc['trials'])} trial(s) already in" in r2.stdout
