"""A per-step watchdog for multi-process runs: a rank that stops making progress stops the job
in bounded time, with the stalled rank named, instead of every peer waiting out the collective
timeout (max(120 s, 20 x the first step)) with nothing said.

Each rank runs one daemon thread that
* beats: every `heartbeat_s` it increments a counter under `tenfold/heartbeat/<rank>` in the
  job's c10d store (torchrun's TCPStore), so that the others can tell a rank that is alive
  but waiting in a collective from one that does not run at all (SIGSTOP, a hung host);
* watches this rank's loop. Once a few steps have been timed (the first, with its warm-up, is
  not counted) the bound is `max(factor x median step, min_s)`. A step that runs past it fires
  the watchdog. Between steps (evaluation, a checkpoint save: legitimately long) time alone
  does not: past the bound, the peers' counters are compared every `SILENT_BEATS x heartbeat_s`, and the
  watchdog fires only when a peer's has stopped moving.

When a step overruns, the thread reads the peers' counters twice, `SILENT_BEATS x heartbeat_s` apart
(each read bounded: the store's host may itself be stopped), and names the ranks whose
counter did not move. It then calls `on_stall(message)` (the trainer keeps what it can: metrics flushed,
`summary.json` with the reason and the last complete checkpoint), prints the message, records
it in torchelastic's error file and ends the process with exit status 1. A thread cannot
interrupt a gloo collective (`_abort_process_group` does not reach into gloo's blocking
waits, tested with torch 2.13), so the process ends from the thread, once everything worth
keeping is on disk.

The step loop calls `step_started()` / `step_finished(seconds)` around each optimizer step;
what runs between two such calls is the "between steps" phase above.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

KEY = "tenfold/heartbeat/{rank}"
WARMUP_STEPS = 1  # not timed: lazy init, allocator warm-up, first-step compilation
MIN_SAMPLES = 3  # steps timed before the watchdog arms
SILENT_BEATS = 3  # a peer is stalled when its counter stays still this many heartbeats (a rank
# busy in C code that holds the GIL, a large json.dumps say, can miss one or two)
STORE_READ_S = 5.0  # one bounded read of the peers' counters


class StepWatchdog:
    """See the module docstring. `store`: a c10d Store (set / multi_get); `exit`: how the
    process ends (os._exit; tests pass their own)."""

    def __init__(self, factor: float, min_s: float, rank: int, world: int, store: Any,
                 on_stall: Callable[[str], None], heartbeat_s: float = 1.0, exit: Callable[[int], None] = os._exit):
        self.factor, self.min_s, self.rank, self.world = factor, min_s, rank, world
        self.store, self.on_stall, self.heartbeat_s, self._exit = store, on_stall, heartbeat_s, exit
        self._times: deque = deque(maxlen=100)
        self._seen = 0
        self._step: int | None = None
        self._started_at: float | None = None  # when the current phase began (None: not in the loop yet)
        self._in_step = False
        self._last_read: tuple[float, list] | None = None  # between steps: (when, the peers' counters)
        self._beats = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: str | None = None

    # ------------------------------------------------------------------ the loop's side

    def start(self) -> None:
        self._beat()  # every rank's key exists before anyone can read it
        self._thread = threading.Thread(target=self._run, name="tenfold-watchdog", daemon=True)
        self._thread.start()

    def step_started(self, step: int) -> None:
        with self._lock:
            self._step, self._started_at, self._in_step = step, time.monotonic(), True

    def step_finished(self, seconds: float) -> None:
        """The step is done; what follows until the next one (evaluation, saves) is timed too."""
        with self._lock:
            self._started_at, self._in_step, self._last_read = time.monotonic(), False, None
            self._seen += 1
            if self._seen > WARMUP_STEPS:
                self._times.append(seconds)

    def bound_s(self) -> float | None:
        """How long a step may run before the watchdog fires (None: not armed yet)."""
        with self._lock:
            if len(self._times) < MIN_SAMPLES:
                return None
            return max(self.factor * statistics.median(self._times), self.min_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=SILENT_BEATS * self.heartbeat_s + STORE_READ_S)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._beat()
            overdue = self._overdue()
            if overdue is None:
                continue
            step, ran, bound, in_step = overdue
            if in_step:
                return self._fire(self._step_message(step, ran, bound) + self._who_stalled())
            silent = self._silent_since_last_read()
            if silent:
                return self._fire(f"watchdog: after step {step} (evaluation or a checkpoint save) this rank waited "
                                  f"{ran:.1f} s, past {bound:.1f} s, and {self._silent(silent)}")

    def _beat(self) -> None:
        self._beats += 1
        try:
            self.store.set(KEY.format(rank=self.rank), str(self._beats))
        except Exception:  # noqa: BLE001 - a store that does not answer is judged when we fire
            pass

    def _overdue(self) -> tuple[int, float, float, bool] | None:
        """(step, seconds in this phase, bound, in a step) once the phase has run past the bound."""
        bound = self.bound_s()
        with self._lock:
            started, step, in_step = self._started_at, self._step, self._in_step
        if bound is None or started is None:
            return None
        ran = time.monotonic() - started
        return (step, ran, bound, in_step) if ran > bound else None

    def _step_message(self, step: int, ran: float, bound: float) -> str:
        median = statistics.median(self._times)
        return (f"watchdog: step {step} has run {ran:.1f} s, past {bound:.1f} s "
                f"(parallel.watchdog {self.factor:g} x the median step {median:.2f} s, at least "
                f"parallel.watchdog_min_s {self.min_s:g} s); ")

    def _fire(self, message: str) -> None:
        self.fired = message
        try:
            self.on_stall(message)
        except Exception as e:  # noqa: BLE001 - the stop must happen even if saving fails
            message += f" (saving what could be saved failed: {e})"
        _report(message)
        self._exit(1)

    def _who_stalled(self) -> str:
        first = self._read_counters()
        for _ in range(SILENT_BEATS):  # still beating: the peers that fire now must not take us for stalled
            time.sleep(self.heartbeat_s)
            self._beat()
        second = self._read_counters()
        if first is None or second is None:
            return "the job's store does not answer (its host, the launcher or rank 0, may be stopped); stopping"
        stalled = [r for r in range(self.world) if r != self.rank and first[r] == second[r]]
        if stalled:
            return self._silent(stalled)
        return f"every other rank is alive: a collective is stuck or rank {self.rank} is slow; stopping"

    def _silent(self, ranks: list[int]) -> str:
        silence = SILENT_BEATS * self.heartbeat_s
        return f"rank {', '.join(map(str, ranks))} stopped responding (no heartbeat for {silence:g} s); stopping"

    def _silent_since_last_read(self) -> list[int]:
        """Between steps: the peers whose counter has not moved since the read SILENT_BEATS ago."""
        now, last = time.monotonic(), self._last_read
        if last is not None and now - last[0] < SILENT_BEATS * self.heartbeat_s:
            return []
        counters = self._read_counters()
        if counters is None:  # the store's host stopped: said by the next step's overrun, if any
            return []
        self._last_read = (now, counters)
        if last is None:
            return []
        return [r for r in range(self.world) if r != self.rank and last[1][r] == counters[r]]

    def _read_counters(self) -> list[bytes] | None:
        """Every rank's counter, or None when the store does not answer within STORE_READ_S."""
        keys = [KEY.format(rank=r) for r in range(self.world)]
        box: list = []
        reader = threading.Thread(target=lambda: box.append(self.store.multi_get(keys)), daemon=True)
        reader.start()
        reader.join(STORE_READ_S)
        return box[0] if box else None


def _report(message: str) -> None:
    """One line on stderr and the same message in torchelastic's error file (the launcher's
    failure summary reads it)."""
    print(f"tenfold: run stopped: {message}", file=sys.stderr, flush=True)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            from tenfold.errors import RunError

            ErrorHandler().record_exception(RunError(message))
        except Exception:  # noqa: BLE001 - reporting must not keep a stuck process alive
            pass
    sys.stdout.flush()


def start_watchdog(cfg: Any, info: Any, on_stall: Callable[[str], None]) -> StepWatchdog | None:
    """The run's watchdog (None on one process or with parallel.watchdog = 0)."""
    if info.world_size < 2 or cfg.parallel.watchdog <= 0:
        return None
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    dog = StepWatchdog(cfg.parallel.watchdog, cfg.parallel.watchdog_min_s, info.rank, info.world_size, store, on_stall)
    dog.start()
    return dog
