"""`tenfold train --nproc N`: the same command under torchrun on this machine.

    tenfold train --nproc 2 --zero 3 ...
 == python -m torch.distributed.run --standalone --nproc-per-node 2 -m tenfold train --zero 3 ... --set parallel.nproc=2

The ranks see torchrun's environment (RANK, WORLD_SIZE, ...), so they do not launch again;
`--nproc N` reaches them as `--set parallel.nproc=N` (see `rank_argv`).
torchrun's elastic agent runs in this process (`torch.distributed.run.run`, exactly what the
`torchrun` script calls) so that we can read its failure report: when a rank raises or is
killed, the agent stops the other ranks (SIGTERM, bounded by its monitor interval) and we
print which rank failed and why, and exit non-zero: 2 when the first failure was a user error
(every rank validates its config: an inconsistent batch triplet exits 2 as on one process),
else 1. Multi-node runs use torchrun directly with its own rendezvous flags (docs/zero.md).

The rank named first is the one that really failed first, by time of death, not the one that
noticed first: when rank 1 is killed, rank 0's collective fails a moment later with
"Connection reset by peer", and torchelastic's own choice (smallest whole-second timestamp,
ties to the lower rank) then names rank 0 about one run in sixteen. `first_failure` orders
failures that report a lost or stalled peer, and ranks stopped with SIGTERM by the agent
after the first failure, behind every other failure.

Signals: SIGTERM or SIGINT to this launcher means what it means to one process: the ranks
save at the next step boundary and exit 0, and so does the launcher. The agent is told to
leave those two signals to us (torchrun's `--signals-to-handle`); our handler creates a stop
file whose path the ranks get in `TENFOLD_STOP_FILE` (`distributed.stop_requested`, read at
every step boundary beside the ranks' own SIGTERM flag). A second signal stops the ranks at
once, through the agent (SIGTERM, then SIGKILL after its grace period), exit 128 + signal.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

USER_ERROR_EXIT = 2
# Set for the ranks `run_under_torchrun` starts: a rank's one-line error goes to the launcher
# (torchelastic's per-rank error file), which prints it once, not once per rank.
LAUNCHED_ENV = "TENFOLD_LAUNCHED"
# Messages of a rank whose collective failed because a peer was gone or stalled (gloo, NCCL,
# the c10d store, tenfold's watchdog): that rank noticed the failure, it did not cause it.
PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
             "remote process exited", "socket timeout", "timed out", "watchdog:")


def rank_argv(argv: list[str], nproc: int) -> list[str]:
    """`argv` with `--nproc N` written as `--set parallel.nproc=N`: torchrun's own parser
    rejects `--nproc` anywhere in its command line as an ambiguous abbreviation of its
    `--nproc-per-node`, and the ranks still record the run as it was asked for."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--nproc" and i + 1 < len(argv):
            i += 2
            continue
        if a.startswith("--nproc="):
            i += 1
            continue
        out.append(a)
        i += 1
    return out + ["--set", f"parallel.nproc={nproc}"]


def torchrun_argv(argv: list[str], nproc: int) -> list[str]:
    """torchrun's arguments for running `tenfold <argv>` on `nproc` local ranks. SIGTERM and
    SIGINT are ours (`_StopOnSignal`), the agent keeps its handling of SIGHUP and SIGQUIT."""
    return ["--standalone", "--nproc-per-node", str(nproc), "--signals-to-handle", "SIGHUP,SIGQUIT",
            "-m", "tenfold", *rank_argv(argv, nproc)]


def _threads_per_rank(nproc: int) -> int:
    """Split the cores between the ranks (torchrun's default is 1 thread, with a warning)."""
    return max(1, (os.cpu_count() or 1) // nproc)


def preflight(cfg: Any, nproc: int) -> None:
    """What can be checked before any process starts (UserError -> exit 2): the run resolved
    on `nproc` processes (batch triplet, pp x tp dividing the world, tp dividing the heads, and
    what the engine can run: the capability table and the pipeline's rules, tenfold.capabilities).
    Torch-free and touching no file: `--dry-run` runs it too."""
    from tenfold.errors import UserError
    from tenfold.run import resolve_run

    if nproc % cfg.parallel.pp_degree:
        raise UserError(f"parallel.pp_degree ({cfg.parallel.pp_degree}) must divide --nproc ({nproc})")
    resolve_run(cfg, nproc)


def run_under_torchrun(argv: list[str], nproc: int, cfg: Any = None) -> int:
    """Run `tenfold <argv>` on `nproc` local ranks; return the job's exit status."""
    from tenfold.errors import UserError

    if nproc < 1:
        raise UserError(f"--nproc must be a positive integer, got {nproc}")
    if cfg is not None:
        from tenfold.engine.outputs.folder import RunFolder

        preflight(cfg, nproc)
        RunFolder.check(cfg)  # --out, --resume, an earlier run in --out: said once, not once per rank
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("OMP_NUM_THREADS", str(_threads_per_rank(nproc)))
    with _StopOnSignal() as stop, _quiet_agent(debug="--debug" in argv):
        try:
            run(parse_args(torchrun_argv(argv, nproc)))
        except ChildFailedError as e:
            return report_failure(e)
        except SignalException as e:  # a second Ctrl-C / SIGTERM: the agent has stopped the ranks
            print(f"tenfold: interrupted by {e.sigval.name}; all ranks stopped", file=sys.stderr)
            return 128 + int(e.sigval)
        if stop.received is not None:
            print(f"tenfold: stopped on {stop.received.name}: every rank saved at the step boundary and exited; "
                  "continue with --resume auto", file=sys.stderr)
    return 0


class _quiet_agent:
    """torchelastic's agent logs each failure too (`E1203 ... failed (exitcode: 2) local_rank:
    0 ...`, `W1203 ... Sending process ... closing signal SIGTERM`): `report_failure` says it in
    tenfold's words, so those records are kept back while the ranks run (--debug shows them)."""

    def __init__(self, debug: bool):
        self.debug, self.levels = debug, {}

    def __enter__(self) -> "_quiet_agent":
        import logging

        if not self.debug:
            for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
                if name.startswith("torch.distributed.elastic"):
                    logger = logging.getLogger(name)
                    self.levels[logger] = logger.level
                    logger.setLevel(logging.CRITICAL)
        return self

    def __exit__(self, *exc: Any) -> None:
        for logger, level in self.levels.items():
            logger.setLevel(level)


class _StopOnSignal:
    """While the ranks run: the first SIGTERM/SIGINT creates the stop file (the ranks save at
    the next step boundary and exit 0); a second one raises torchelastic's SignalException
    inside the agent, which stops the ranks at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self) -> "_StopOnSignal":
        import tempfile

        from tenfold.engine.parallel.distributed import STOP_FILE_ENV

        self.folder = tempfile.mkdtemp(prefix="tenfold-launch-")
        self.path = os.path.join(self.folder, "stop")
        self.received: signal.Signals | None = None
        self._env_before = {name: os.environ.get(name) for name in (STOP_FILE_ENV, LAUNCHED_ENV)}
        os.environ[STOP_FILE_ENV] = self.path  # the ranks inherit the agent's environment
        os.environ[LAUNCHED_ENV] = "1"
        self._old = {}
        for sig in self.SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread (an embedding program): signals stay its own
                break
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        sig = signal.Signals(signum)
        if self.received is not None:
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        self.received = sig
        with open(self.path, "w"):
            pass
        print(f"tenfold: {sig.name}: the ranks save at the next step boundary and stop "
              f"(send it again to stop them at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        import shutil

        from tenfold.engine.parallel.distributed import STOP_FILE_ENV

        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        for name, before in self._env_before.items():
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before
        shutil.rmtree(self.folder, ignore_errors=True)


def _noticed_not_caused(failure: Any) -> int:
    """0: a failure of its own (an exception, a kill by anything but the agent's SIGTERM);
    1: stopped with SIGTERM (what the agent sends the others after a failure); 2: a rank whose
    message says a peer was lost or stalled."""
    if any(needle in _describe(failure).lower() for needle in PEER_LOST):
        return 2
    return 1 if failure.exitcode == -signal.SIGTERM else 0


def first_failure(failures: dict) -> int:
    """The rank that failed first by cause, then by time (torchelastic's timestamps are whole
    seconds, so ties are common), then by rank: the same answer on every run."""
    return min(failures, key=lambda r: (_noticed_not_caused(failures[r]), failures[r].timestamp, r))


def told_the_launcher(line: str) -> bool:
    """In a rank `--nproc` started: write `line` (`tenfold: error: ...`) into torchelastic's error
    file for this rank instead of onto stderr, where every rank would print it; True if done."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not (path and os.environ.get(LAUNCHED_ENV)):
        return False
    record = {"message": {"message": line, "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        return False
    return True


def _own_line(failure: Any) -> str:
    """The `tenfold: ...` line a rank handed over (`told_the_launcher`), or ""."""
    message = getattr(failure, "message", "") or ""
    if isinstance(message, dict):
        message = message.get("message", "")
    return message if isinstance(message, str) and message.startswith("tenfold: ") else ""


def report_failure(error: Any, stream=None) -> int:
    """When every rank that failed of its own said the same line (the same refusal or the same
    stop on every rank), that line once, as one process prints it; else one line per failed
    rank, the first failure first. Returns the exit status."""
    stream = stream or sys.stderr
    first_rank = first_failure(error.failures)
    first = error.failures[first_rank]
    said = {line for line in map(_own_line, error.failures.values()) if line}
    if said and said == {_own_line(first)}:
        print(_own_line(first), file=stream)
        return USER_ERROR_EXIT if first.exitcode == USER_ERROR_EXIT else 1
    print(f"tenfold: rank {first_rank} failed first: {_describe(first)}", file=stream)
    for rank, failure in sorted(error.failures.items()):
        if rank != first_rank:
            print(f"tenfold: rank {rank}: {_describe(failure)}", file=stream)
    return USER_ERROR_EXIT if first.exitcode == USER_ERROR_EXIT else 1


def _describe(failure: Any) -> str:
    if failure.exitcode < 0:
        how = f"killed by {failure.signal_name()}"
    else:
        how = f"exit status {failure.exitcode}"
    message = getattr(failure, "message", "") or ""
    if isinstance(message, dict):  # torchelastic's error file: {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    message = str(message).removeprefix("tenfold: ")
    if not message or message.startswith("To enable traceback") or message.startswith("Signal "):
        return how
    return f"{how}: {message.strip().splitlines()[-1]}"
