"""The C allocator's settings for training on a CPU: keep freed memory for reuse.

A training step allocates and frees the same large buffers every step (activations, gradients,
FSDP2's all-gather and reduce-scatter buffers, optimizer temporaries). glibc's malloc, left at
its defaults, serves blocks above a threshold (128 KiB, rising to at most 32 MiB as blocks are
freed) with their own `mmap` and gives them back with `munmap` on `free`, and it returns the
free top of its heap to the kernel once that exceeds twice the threshold. Each returned page
is faulted in (and zeroed) again the next time it is used. On the virtual machine these
numbers were measured on, a first touch costs 25-60 us per 4 KiB page, and a `small` bf16
step faulted in 100-500 MiB again on some steady-state steps and 1 GiB over its first two
steps (docs/benchmarks.md, "Warm-up").

So on a CPU device, `tune_malloc()` sets, through glibc's `mallopt` (glibc manual, "Malloc
Tunable Parameters"; the same advice as PyTorch's CPU performance tuning guide, which
recommends an allocator that keeps and reuses freed memory, e.g. jemalloc or tcmalloc):

  M_MMAP_THRESHOLD = 32 MiB  blocks below it come from the heap and are reused when freed
                             (glibc's own ceiling for its rising threshold, DEFAULT_MMAP_
                             THRESHOLD_MAX, set from the start instead of reached step by step)
  M_TRIM_THRESHOLD = 2 GiB   the free top of the heap stays mapped for the next step

Blocks above 32 MiB are still mapped and unmapped per use, as glibc does by default. The
resident set then stays near its high-water mark between steps instead of shrinking and
growing back. The price: a freed block can be split by a later small allocation and the heap
grow past it, so the high-water mark can rise by a few MiB to a few tens of MiB (measured:
+13 MiB on `small`, docs/benchmarks.md).
Nothing is changed on other C libraries (musl, macOS) or when TENFOLD_MALLOC=default is set.
The setting is process-wide and lasts until the process exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt's value is a C int: its largest
ENV = "TENFOLD_MALLOC"

_applied: dict | None = None


def _glibc():
    """glibc's handle, or None on another C library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return None
    if not version.startswith("glibc"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def tune_malloc() -> dict | None:
    """Apply the settings above once per process; returns them, or None when not applied."""
    global _applied
    if _applied is not None:
        return _applied
    if os.environ.get(ENV, "").strip().lower() == "default":
        return None
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    settings = {"M_MMAP_THRESHOLD": (M_MMAP_THRESHOLD, MMAP_THRESHOLD), "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, TRIM_THRESHOLD)}
    applied = {}
    for name, (param, value) in settings.items():
        if libc.mallopt(param, value) == 1:
            applied[name] = value
    _applied = applied or None
    return _applied
