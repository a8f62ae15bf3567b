"""Signals, the per-step watchdog and the first failure of a `--nproc` job (engine/parallel/launch.py,
engine/observe/watchdog.py), through the real CLI under torchrun's agent on gloo:

* SIGTERM to the launcher, or to one rank, saves at the next step boundary and ends every
  process with exit status 0, as docs/checkpoints.md promises (the launcher does not exit 143);
* a rank stopped with SIGSTOP (during a step or a checkpoint save) makes rank 0 stop within
  seconds (watchdog 4 x the median step, at least 5 s), naming rank 1, with summary.json saying why and which checkpoint to resume
  from (rank 0 does not wait out the 120 s collective timeout);
* the rank named as failing first is the one that died, not the one whose collective noticed:
  the ordering is checked on torchelastic's own failure objects with the timestamps of a
  recorded failing run (rank 0 "killed by SIGTERM: ... Connection reset by peer" one second before the
  agent saw rank 1's SIGKILL);
* the watchdog itself, in-process with a dict for a store: fires past its bound and not
  before, names the silent rank, and says so when every peer is alive.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import RUN_FLAGS, TENFOLD, child_pids, rank_of

SLOW_FLAGS = ["--nproc", "2", "--steps", "100000", "--micro-batch", "1", *RUN_FLAGS]


def _start(out: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="2000")
    return subprocess.Popen(TENFOLD + [*SLOW_FLAGS, "--out", str(out), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _rows(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line)["step"] for line in text.splitlines() if line.endswith("}")]


def _wait_for_steps(proc: subprocess.Popen, out: Path, n: int, within: float = 120) -> None:
    deadline = time.time() + within
    while len(_rows(out)) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"fewer than {n} steps within {within} s"
        time.sleep(0.2)


def _rank_pid(proc: subprocess.Popen, rank: int) -> int:
    return next(p for p in child_pids(proc.pid) if rank_of(p) == rank)


def _running(pid: int) -> bool:
    """Not exited (a zombie has exited; its parent has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _saved_at_the_last_step(out: Path) -> int:
    from tenfold.engine.outputs import checkpoint as ck

    rows = _rows(out)
    assert rows == list(range(1, len(rows) + 1))  # every step once
    assert ck.read_latest(out / "checkpoints") == out / "checkpoints" / f"step_{rows[-1]}"
    assert ck.verify_checkpoint(out / "checkpoints" / f"step_{rows[-1]}", collective=False)["step"] == rows[-1]
    return rows[-1]


linux_only = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the rank processes through /proc (Linux)")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_every_process_exits_0(tmp_path):
    out = tmp_path / "run"
    proc = _start(out)
    try:
        _wait_for_steps(proc, out, 3)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "tenfold: stopped on SIGTERM: every rank saved at the step boundary and exited" in stderr
    assert "failed" not in stderr
    _saved_at_the_last_step(out)


@pytest.mark.multiprocess
@pytest.mark.slow
@linux_only
def test_sigterm_to_one_rank_saves_and_every_process_exits_0(tmp_path):
    out = tmp_path / "run"
    proc = _start(out)
    try:
        _wait_for_steps(proc, out, 3)
        os.kill(_rank_pid(proc, 1), signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    step = _saved_at_the_last_step(out)
    assert f"checkpoint: preempted; saved step {step}, exiting" in stdout


@pytest.mark.multiprocess
@pytest.mark.slow
@linux_only
def test_a_stopped_rank_stops_the_job_through_the_watchdog(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, "--checkpoint-every", "2", "--watchdog", "4", "--set", "parallel.watchdog_min_s=5")
    try:
        _wait_for_steps(proc, out, 6)
        rank0, rank1 = _rank_pid(proc, 0), _rank_pid(proc, 1)
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.time()
        while _running(rank0):
            assert time.time() - stopped_at < 60, "rank 0 still waiting 60 s after its peer stopped"
            time.sleep(0.1)
        took = time.time() - stopped_at
        os.kill(rank1, signal.SIGKILL)  # what the agent does after its 30 s grace period
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 20, took  # 5 s bound + 3 s heartbeat check, far from the 120 s collective timeout
    assert proc.returncode == 1
    lines = [line for line in stderr.splitlines() if line.startswith("tenfold: rank")]
    assert lines[0] == "tenfold: rank 1 failed first: killed by SIGKILL", stderr[-3000:]
    assert "rank 1 stopped responding (no heartbeat for 3 s); stopping" in lines[1] and "watchdog: " in lines[1]
    stopped = json.loads((out / "summary.json").read_text())["stopped"]
    assert "rank 1 stopped responding" in stopped["reason"]
    from tenfold.engine.outputs import checkpoint as ck

    assert stopped["resume_from"] == str(ck.read_latest(out / "checkpoints"))
    assert _rows(out) == list(range(1, stopped["at_step"]))  # every finished step, once


# --------------------------------------------------------------------------- the first failure


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None = None, timestamp: int = 0):
    """torchelastic's own ProcessFailure, with an error file as a rank's excepthook writes it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error_{rank}.json"
    if message is not None:
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": "", "timestamp": str(timestamp)}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def test_the_rank_that_died_is_named_before_the_one_that_noticed(tmp_path, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from tenfold.engine.parallel.launch import report_failure

    noticed = int(time.time()) - 1  # rank 0's collective failed; the agent reaped rank 1 a second later
    failures = {
        0: _failure(tmp_path, 0, -signal.SIGTERM, "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:6053: "
                    "Connection reset by peer", noticed),
        1: _failure(tmp_path, 1, -signal.SIGKILL),
    }
    error = ChildFailedError("tenfold", failures)
    assert error.get_first_failure()[0] == 0  # torchelastic's choice: the smaller timestamp
    assert report_failure(error) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "tenfold: rank 1 failed first: killed by SIGKILL"
    assert lines[1].startswith("tenfold: rank 0: killed by SIGTERM: RuntimeError:") and "Connection reset by peer" in lines[1]


def test_first_failure_orders_cause_then_time_then_rank(tmp_path):
    from tenfold.engine.parallel.launch import first_failure

    t = int(time.time())
    own = _failure(tmp_path, 3, 1, "ValueError: a bug", t + 5)
    stopped_by_agent = _failure(tmp_path, 0, -signal.SIGTERM)
    noticed = _failure(tmp_path, 1, 1, "RunError: watchdog: step 9 has run 31 s; rank 3 stopped responding", t)
    assert first_failure({0: stopped_by_agent, 1: noticed, 3: own}) == 3
    assert first_failure({0: stopped_by_agent, 1: noticed}) == 0
    same = {2: _failure(tmp_path, 2, -signal.SIGKILL), 5: _failure(tmp_path, 5, -signal.SIGKILL)}
    for failure in same.values():
        failure.timestamp = t
    assert first_failure(same) == 2  # a tie: the lower rank, every time


# --------------------------------------------------------------------------- the watchdog in-process


class _Store:
    """The two c10d Store calls the watchdog makes, on a dict."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.data[key] = value.encode()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self.lock:
            return [self.data[k] for k in keys]


def _watchdog(store: _Store, stalls: list, exits: list, **kw):
    from tenfold.engine.observe.watchdog import StepWatchdog

    kw = {"factor": 4.0, "min_s": 0.3, "rank": 0, "world": 3, "heartbeat_s": 0.05, **kw}
    return StepWatchdog(store=store, on_stall=stalls.append, exit=exits.append, **kw)


def _timed_steps(dog, n: int, seconds: float = 0.01) -> None:
    for step in range(1, n + 1):
        dog.step_started(step)
        dog.step_finished(seconds)


def _wait(exits: list, within: float) -> float:
    t0 = time.monotonic()
    while not exits and time.monotonic() - t0 < within:
        time.sleep(0.01)
    return time.monotonic() - t0


def _beating(store: _Store, rank: int, stop: threading.Event) -> threading.Thread:
    def beat():
        n = 0
        while not stop.wait(0.02):
            n += 1
            store.set(f"tenfold/heartbeat/{rank}", str(n))

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


def test_the_watchdog_fires_past_its_bound_naming_the_silent_rank(capsys):
    store, stalls, exits, stop = _Store(), [], [], threading.Event()
    store.set("tenfold/heartbeat/2", "7")  # rank 2 beat once and then stopped
    _beating(store, 1, stop)
    dog = _watchdog(store, stalls, exits)
    dog.start()
    try:
        _timed_steps(dog, 4)  # the first step is warm-up: 3 samples, armed
        assert dog.bound_s() == pytest.approx(0.3)  # max(4 x 0.01 s, min_s)
        dog.step_started(5)
        took = _wait(exits, within=5)
    finally:
        stop.set()
        dog.close()
    assert exits == [1] and 0.3 < took < 2.0, took
    assert stalls[0].startswith("watchdog: step 5 has run ") and "parallel.watchdog 4 x the median step 0.01 s" in stalls[0]
    assert stalls[0].endswith("rank 2 stopped responding (no heartbeat for 0.15 s); stopping"), stalls[0]
    assert "tenfold: run stopped: watchdog: step 5" in capsys.readouterr().err


def test_the_watchdog_waits_for_slow_steps_within_its_bound_and_before_it_is_armed():
    store, stalls, exits = _Store(), [], []
    dog = _watchdog(store, stalls, exits, min_s=0.4)
    dog.start()
    try:
        dog.step_started(1)  # warm-up and the first timed steps: not armed, however long
        time.sleep(0.6)
        dog.step_finished(0.6)
        _timed_steps(dog, 3, seconds=0.05)
        dog.step_started(5)
        time.sleep(0.25)  # under the bound, max(4 x 0.05, 0.4) = 0.4 s
        dog.step_finished(0.25)
        time.sleep(0.3)  # no step running: nothing to time
    finally:
        dog.close()
    assert exits == [] and stalls == []


def test_the_watchdog_says_so_when_every_peer_is_alive():
    store, stalls, exits, stop = _Store(), [], [], threading.Event()
    for rank in (1, 2):
        _beating(store, rank, stop)
    dog = _watchdog(store, stalls, exits)
    dog.start()
    try:
        _timed_steps(dog, 4)
        dog.step_started(5)
        _wait(exits, within=5)
    finally:
        stop.set()
        dog.close()
    assert exits == [1]
    assert stalls[0].endswith("every other rank is alive: a collective is stuck or rank 0 is slow; stopping")


def test_between_steps_the_watchdog_waits_while_peers_are_alive_and_fires_when_one_stops():
    """Evaluation and checkpoint saves may take long: past the bound only a silent peer fires it."""
    store, stalls, exits, stop_1, stop_2 = _Store(), [], [], threading.Event(), threading.Event()
    _beating(store, 1, stop_1)
    _beating(store, 2, stop_2)
    dog = _watchdog(store, stalls, exits)
    dog.start()
    try:
        _timed_steps(dog, 4)  # step 4 finished: a long "save" follows
        time.sleep(1.0)  # > 3 x the 0.3 s bound, every peer beating
        assert exits == []
        stop_2.set()  # rank 2 stops during the save
        took = _wait(exits, within=5)
    finally:
        stop_1.set()
        dog.close()
    assert exits == [1] and took < 1.0, took
    assert stalls[0].startswith("watchdog: after step 4 (evaluation or a checkpoint save) this rank waited ")
    assert stalls[0].endswith("rank 2 stopped responding (no heartbeat for 0.15 s); stopping"), stalls[0]
