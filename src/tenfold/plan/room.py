"""Whether a run fits where it starts: the planner's per-rank memory prediction against the
memory each rank has. `tenfold train` refuses a run that does not fit before it builds
anything (a model too large for the machine is one line, not minutes of allocation and an
out-of-memory kill), and `tenfold train --dry-run` prints the same verdict.

What a rank has: on a GPU, the device's memory (the engine reads it through torch and hands it
in); on a CPU, this machine's memory shared by its local ranks. The machine's memory is
MemTotal (/proc/meminfo), or the container's limit where the process runs under a lower one
(cgroup v2 memory.max, v1 memory.limit_in_bytes): a fixed figure, not what other processes
happen to leave free, so the verdict does not change with what else runs. Offloaded states
(ZeRO-Offload) live in host memory: every local rank's share of them must fit it too.

A prediction is a model, not a measurement (docs/planner.md): `train.fit_check = false`
(`--no-fit-check`) starts a run the planner says does not fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tenfold.errors import UserError
from tenfold.plan.api import MemoryBreakdown
from tenfold.plan.for_run import fmt_bytes

FLAG = "--no-fit-check"
MEMINFO = Path("/proc/meminfo")
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def _first_int(path: Path) -> int | None:
    try:
        with path.open() as f:  # procfs / cgroupfs files: a few bytes, never a regular file's size
            text = f.read(4096)
    except OSError:
        return None
    for word in text.split():
        if word.isdigit():
            return int(word)
    return None


def host_memory() -> tuple[float, str]:
    """(bytes, where the figure comes from) of this machine's memory for tenfold's processes."""
    total, source = None, "MemTotal"
    try:
        with MEMINFO.open() as f:
            for line in f.read(65536).splitlines():
                if line.startswith("MemTotal:"):
                    total = float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if total is None:
        total, source = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "physical pages"
    for path in CGROUP_LIMITS:
        limit = _first_int(path)  # "max" (no limit) reads as None
        if limit is not None and limit < total:
            total, source = float(limit), "the container's memory limit"
    return total, source


@dataclass(frozen=True)
class Room:
    """The memory a run's ranks have on the machine it starts on."""

    local_ranks: int
    device_bytes: float | None = None  # one GPU's memory; None: the ranks compute on the CPU
    device_name: str = "GPU"
    host: tuple[float, str] | None = None  # (bytes, source); None: this machine's (`host_memory`)


def verdict(m: MemoryBreakdown, room: Room) -> tuple[bool, str]:
    """(fits, one sentence naming the prediction and the memory each rank has)."""
    host, source = room.host or host_memory()
    ranks = room.local_ranks
    shared = f", shared by {ranks} local ranks" if ranks > 1 else ""
    if room.device_bytes is None:
        need, have = m.total_bytes + m.cpu_bytes, host / ranks
        return need <= have, (f"{fmt_bytes(need)} per rank predicted (planner: with buffers and allocator reserve), "
                              f"{fmt_bytes(have)} per rank available "
                              f"({fmt_bytes(host)} of host memory, {source}{shared})")
    text = (f"{fmt_bytes(m.total_bytes)} per rank predicted (planner: with buffers, allocator reserve and CUDA context), "
            f"{fmt_bytes(room.device_bytes)} on each "
            f"{room.device_name}")
    fits = m.total_bytes <= room.device_bytes
    if m.cpu_bytes:
        offloaded = m.cpu_bytes * ranks
        text += f"; offloaded {fmt_bytes(offloaded)} in host memory of {fmt_bytes(host)} ({source}{shared})"
        fits = fits and offloaded <= host
    return fits, text


def fit_line(m: MemoryBreakdown, room: Room) -> str:
    """`--dry-run`'s line: `fits here: ...` or `does not fit here: ...`."""
    fits, text = verdict(m, room)
    return ("fits here: " if fits else "does not fit here: ") + text + ("" if fits else f"; {FLAG} starts it anyway")


def refuse_unless_fits(m: MemoryBreakdown, room: Room) -> None:
    """UserError (exit 2, one line) for a run the planner says cannot fit here."""
    fits, text = verdict(m, room)
    if not fits:
        raise UserError(f"this run does not fit here: {text}; use a smaller model, micro-batch or sequence, more "
                        f"ranks, ZeRO, recompute or offload (tenfold plan --search finds one), or pass {FLAG} to "
                        "start it anyway")
