"""Peak dense matmul FLOP/s of this CPU, the denominator of MFU on a CPU.

On a GPU the catalog's datasheet peak is used (tenfold.plan.hardware). A CPU has no datasheet
figure, so it is measured and cached (tenfold.plan.cpu_peak: the file, and a key naming the
CPU model and core count, the torch version and the thread count; a change of any of them
measures again).

What is measured, and when:

* Only the dtype a run trains in, with the thread count the run computes with (a rank of a
  run started with `--nproc N` has its share of the cores), never a 16-bit format that has no
  fast matmul kernels on this CPU (`fast_kernels`): such a run reports no MFU and says why.
* In a bounded time (`measure_peak`): square GEMMs of n = 512, 1024, 2048 through `torch.mm`
  and `F.linear` (the call a model's Linear layers make; on some CPUs the two reach different
  kernels), one untimed warm-up then `REPEATS` timed calls each, the best rate kept. Sizes stop
  growing where one GEMM would take over `MAX_GEMM_S`, and the whole measurement stops at
  `BUDGET_S`, so a busy machine (other processes on the cores) can lower the figure but not
  stretch the time: a few seconds at most.
* Never before a run's first step: `tenfold train` starts with the cached figure, or none
  ("MFU not measured yet"), and measures at the end, after its timings are taken (no
  throughput figure includes it); the next run starts with it. `tenfold plan --gpu cpu`
  measures the dtype it prices in a subprocess (`python -m tenfold.engine.observe.peak`), the planner
  itself never importing torch; `--dry-run` needs no peak at all.

A figure cannot stay wrong for long: each entry keeps the load it was measured at and the
highest figure measured; one measured on a busy machine (load above 0.5 per core) is measured
again the first time the machine is quiet, and a run whose model FLOP/s beat the cached peak
marks it to be measured again (`note_exceeded`). Only one process measures at a time (a lock
beside the cache): the ranks of one run wait for the first, a few seconds at most.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from typing import Callable

from tenfold.plan.cpu_peak import MEASURED_DTYPES, cache_key, cache_path, read_cache, without_stale
from tenfold.host import cpu_has_bf16_matmul, cpuinfo_field

SIZES = (512, 1024, 2048)
REPEATS = 3  # timed calls per size and call, after one warm-up
MAX_GEMM_S = 0.5  # no size whose one GEMM would take longer than this
BUDGET_S = 2.0  # the measurement stops here, however busy the machine
BUSY = 0.5  # load average per core above which a measured peak is re-measured when quieter
# x86 flags of fp16 matrix instructions (oneDNN's fp16 GEMMs: AVX512-FP16, AMX-FP16); the bf16
# ones are tenfold.host.CPU_BF16_FLAGS.
CPU_FP16_FLAGS = ("avx512_fp16", "amx_fp16")
NOT_MEASURED = ("MFU not measured yet: this CPU's GEMM peak is measured at the end of the run (a few seconds, "
                "outside its timings) and cached for the next")


def fast_kernels(dtype_name: str) -> bool:
    """Whether this CPU has matrix instructions for `dtype_name` (fp32 always). Without them a
    16-bit GEMM runs through conversions or a scalar path at a few GFLOP/s: an MFU against that
    would measure the slow path, not the machine."""
    if dtype_name == "bf16":
        return cpu_has_bf16_matmul()
    if dtype_name == "fp16":
        return any(flag in (cpuinfo_field("flags") or "").split() for flag in CPU_FP16_FLAGS)
    return True


def _gemms(dtype_name: str, n: int) -> list[Callable[[], object]]:
    import torch
    import torch.nn.functional as F

    from tenfold.techniques.precision import DTYPES as TORCH_DTYPES

    dtype = TORCH_DTYPES[dtype_name]
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return [lambda: torch.mm(a, b), lambda: F.linear(a, b)]


def measure_peak(dtype_name: str, budget_s: float = BUDGET_S, gemms=_gemms, clock=time.perf_counter) -> float:
    """The best GEMM FLOP/s of `REPEATS` timed calls per size and call (module docstring),
    stopped at `budget_s` (after at least one timed call)."""
    deadline = clock() + budget_s
    best = 0.0
    for n in SIZES:
        flops = 2.0 * n**3
        if best and flops / best > MAX_GEMM_S:
            break  # e.g. a 2048 GEMM on a few slow cores
        for fn in gemms(dtype_name, n):
            fn()  # warm-up: thread pool, kernel selection
            for _ in range(REPEATS):
                if best and clock() >= deadline:
                    return best
                start = clock()
                fn()
                best = max(best, flops / max(clock() - start, 1e-9))
    return best


@contextlib.contextmanager
def _threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _write_cache(cache: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home still gets a measured figure, just not cached


def load_per_core() -> float:
    """The 1-minute load average per CPU core: above BUSY, other work shares the cores and a
    measured peak comes out low."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # pragma: no cover - no load average on this platform
        return 0.0


@contextlib.contextmanager
def _measuring_alone():
    """One measuring process at a time: a rank that waits reads what the first one cached."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 - held for the block
    except OSError:
        yield
        return
    import fcntl

    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def cpu_key(threads: int | None = None) -> str:
    """The cache entry of figures measured here with `threads` threads (default: this process's)."""
    return cache_key(threads or _torch_threads())


def cpu_peak_flops(dtype_name: str, threads: int | None = None, measure: bool = True) -> float | None:
    """Measured dense GEMM FLOP/s of this CPU for `dtype_name` with `threads` threads (default:
    this process's), cached. `measure=False`: the cached figure or None, never a measurement.

    A figure measured while the machine was busy (load above BUSY per core) is measured again
    the first time it is quiet, one a run has beaten (`note_exceeded`) at the next measuring
    call; the higher figure is kept. A machine that stays busy measures nothing again."""
    if dtype_name not in MEASURED_DTYPES:
        raise ValueError(f"dtype must be one of {MEASURED_DTYPES}, got {dtype_name!r}")
    threads = threads or _torch_threads()
    key = cpu_key(threads)
    entry = read_cache().get(key, {})
    if not _wants_measuring(entry, dtype_name) or not measure:
        return float(entry[dtype_name]) if dtype_name in entry else None
    with _measuring_alone():
        cache = read_cache()  # another process may have measured while this one waited
        entry = cache.get(key, {})
        if _wants_measuring(entry, dtype_name):
            with _threads(threads):
                measured = measure_peak(dtype_name)
            entry[dtype_name] = max(measured, float(entry.get(dtype_name, 0.0)))
            entry.setdefault("load_per_core", {})[dtype_name] = round(load_per_core(), 2)
            exceeded = entry.setdefault("exceeded", {})
            if exceeded.get(dtype_name, 0.0) <= entry[dtype_name]:
                exceeded.pop(dtype_name, None)
            cache[key] = entry
            _write_cache(without_stale(cache))
    return float(entry[dtype_name])


def _wants_measuring(entry: dict, dtype_name: str) -> bool:
    if dtype_name not in entry:
        return True
    if dtype_name in entry.get("exceeded", {}):  # a run did more than this figure allows
        return True
    busy_then = entry.get("load_per_core", {}).get(dtype_name, BUSY + 1) > BUSY
    return busy_then and load_per_core() <= BUSY  # busy then, quiet now: once


def rank_share(ranks: int, threads: int) -> float:
    """The part of a figure measured with `threads` threads that one of `ranks` processes on
    this machine gets: all of it while their threads fit the cores, less when they share them."""
    return min(1.0, (os.cpu_count() or 1) / (ranks * threads))


def note_exceeded(dtype_name: str, achieved_per_rank: float, ranks: int = 1) -> None:
    """A run's model FLOP/s per rank were above its peak: the cached figure is too low (measured
    while something else ran). Mark it to be measured again."""
    threads = _torch_threads()
    achieved = achieved_per_rank / rank_share(ranks, threads)  # as the cached figure counts
    key = cpu_key(threads)
    with _measuring_alone():
        cache = read_cache()
        entry = cache.get(key)
        if not isinstance(entry, dict) or float(entry.get(dtype_name, 0.0)) >= achieved:
            return
        entry.setdefault("exceeded", {})[dtype_name] = float(achieved)
        _write_cache(cache)


def mfu_peak(dtype_name: str, ranks: int = 1, measure: bool = True) -> tuple[float | None, str | None]:
    """(peak FLOP/s for MFU of one of `ranks` processes on this CPU, None) or (None, why no MFU is
    reported). `measure=False` (a run's start): the cached figure, never a measurement."""
    if not fast_kernels(dtype_name):
        flags = CPU_FP16_FLAGS if dtype_name == "fp16" else ("avx512_bf16", "amx_bf16")
        return None, (f"{dtype_name} matmuls have no fast kernels on this CPU (no {' or '.join(flags)} "
                      "instructions); bf16 or fp32 train faster here")
    threads = _torch_threads()
    peak = cpu_peak_flops(dtype_name, threads, measure=measure)
    if peak is None:
        return None, NOT_MEASURED
    return peak * rank_share(ranks, threads), None


def peak_source(device_type: str = "cpu") -> str:
    """Where a run's MFU peak comes from, as the run reports it."""
    if device_type != "cpu":
        return "the GPU's datasheet dense peak (tenfold.plan.hardware catalog)"
    return (f"this CPU's measured GEMM peak ({_torch_threads()} threads per rank, "
            f"of {os.cpu_count() or 1} cores), cached in {cache_path()}")


def main(argv: list[str] | None = None) -> None:
    """`python -m tenfold.engine.observe.peak [--dtype D ...] [--threads N]`: the figures as JSON."""
    p = argparse.ArgumentParser(prog="python -m tenfold.engine.observe.peak", description=__doc__.splitlines()[0])
    p.add_argument("--dtype", action="append", choices=MEASURED_DTYPES, help="repeatable (default: fp32 and bf16)")
    p.add_argument("--threads", type=int, help="threads to measure with (default: torch's, one per core)")
    args = p.parse_args(argv)
    print(json.dumps({d: cpu_peak_flops(d, args.threads) for d in args.dtype or ("fp32", "bf16")}))


if __name__ == "__main__":
    main()
