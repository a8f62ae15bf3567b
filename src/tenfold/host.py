"""What this machine is, as tenfold's choices need it: its CPU's flags (/proc/cpuinfo), whether
`tenfold train` computes on its CPU, and the folder where measured machine constants are kept.
torch-free: the planner and the command line read it without loading torch."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

# x86 flags (/proc/cpuinfo) of bf16 matrix instructions, which torch's CPU bf16 GEMMs (oneDNN)
# use. Without them bf16 matmuls run through conversions: a `tiny` training step measured 11x
# slower in bf16 than in fp32 on a 2-core AVX2 EPYC (docs/precision.md).
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_field(name: str, cpuinfo: Path = CPUINFO) -> str | None:
    """The value of the first `name : value` line of /proc/cpuinfo; None where the file (not
    Linux) or the line is missing."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


@functools.lru_cache(maxsize=4)
def cpu_has_bf16_matmul(cpuinfo: Path = CPUINFO) -> bool:
    """Whether this machine's CPU has bf16 matrix instructions (CPU_BF16_FLAGS in the `flags`
    line of /proc/cpuinfo; False where that file does not exist)."""
    flags = (cpuinfo_field("flags", cpuinfo) or "").split()
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def bf16_pays(on_cpu: bool) -> bool:
    """Whether bf16 matmuls are fast where the run computes: on a GPU, and on a CPU with bf16
    matrix instructions. The one rule behind `auto`, the ladder's mixed rung and tune's trials."""
    return not on_cpu or cpu_has_bf16_matmul()


def local_device_is_cpu() -> bool:
    """Whether `tenfold train` on this machine computes on its CPU: torch's own answer (no CUDA
    device) where torch is loaded; else, torch-free, whether no GPU device node exists."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return not torch.cuda.is_available()
    return not any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/kfd"))


def cache_dir() -> Path:
    """Where measured machine constants are kept: $TENFOLD_CACHE_DIR, else ~/.cache/tenfold."""
    return Path(os.environ.get("TENFOLD_CACHE_DIR") or Path.home() / ".cache" / "tenfold")
