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
"""

from __future__ import annotations

import os
import sys
from typing import Any

USER_ERROR_EXIT = 2


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
    """torchrun's arguments for running `tenfold <argv>` on `nproc` local ranks."""
    return ["--standalone", "--nproc-per-node", str(nproc), "-m", "tenfold", *rank_argv(argv, nproc)]


def _threads_per_rank(nproc: int) -> int:
    """Split the cores between the ranks (torchrun's default is 1 thread, with a warning)."""
    return max(1, (os.cpu_count() or 1) // nproc)


def preflight(cfg: Any, nproc: int) -> None:
    """What can be checked before any process starts (UserError -> exit 2): the run resolved
    on `nproc` processes (batch triplet, pp x tp dividing the world, tp dividing the heads, and
    what the engine can run: the capability table and the pipeline's rules, tenfold.capabilities)."""
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
        preflight(cfg, nproc)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("OMP_NUM_THREADS", str(_threads_per_rank(nproc)))
    try:
        run(parse_args(torchrun_argv(argv, nproc)))
    except ChildFailedError as e:
        return report_failure(e)
    except SignalException as e:  # Ctrl-C / SIGTERM to us: the agent has stopped the ranks
        print(f"tenfold: interrupted by {e.sigval.name}; all ranks stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


def report_failure(error: Any, stream=None) -> int:
    """Print one line per failed rank, the first failure first; return the exit status."""
    stream = stream or sys.stderr
    first_rank, first = error.get_first_failure()
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
    message = str(message)
    if not message or message.startswith("To enable traceback") or message.startswith("Signal "):
        return how
    return f"{how}: {message.strip().splitlines()[-1]}"
