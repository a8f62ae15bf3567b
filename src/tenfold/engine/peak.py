"""Peak dense matmul FLOP/s of this machine, the denominator of MFU.

On a GPU the catalog's datasheet peak is used (tenfold.plan.hardware). A CPU has no
datasheet figure, so we measure it and cache it per CPU model in ~/.cache/tenfold/cpu_peak.json
(override with TENFOLD_CACHE_DIR). The figure is the whole machine's: measured with every core,
and shared by the ranks that run on it, so `tenfold train` with N local ranks divides it by N
per rank and `tenfold plan --gpu cpu` prices N ranks against the same figure.

A load cannot lower the figure for long: each entry keeps the load it was measured at and the
highest figure ever measured; one measured on a busy machine (load above 0.5 per core) is
measured again the first time the machine is quiet, and a run whose model FLOP/s beat the
cached peak marks it to be measured again at the next start (`note_exceeded`). Only one process
measures at a time (a lock beside the cache): the ranks of one run wait for the first.

How a peak is measured (`sweep_peak`): square GEMMs of growing size n = 256, 512, 1024, 2048,
each through both `torch.mm` and `F.linear` (the call a model's Linear layers make; on some
CPUs the two reach different kernels), best of five short windows. The size grows until the
rate stops rising by more than 5% (the peak is reached) or one more size would take over a
second per GEMM. A GEMM too small to fill the machine under-states the peak, and an MFU
against it comes out above 100%.

A 16-bit format whose peak is below half the fp32 peak has no fast matmul kernels here (its
GEMMs run through a conversion or a scalar fallback): `mfu_peak` then returns no peak and a
sentence saying so, and the run reports no MFU instead of one measured against a slow path.

`python -m tenfold.engine.peak` measures and prints the figures as JSON; the planner calls it
in a subprocess so that the planner itself never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from tenfold.terms import PRECISIONS as DTYPES
from tenfold.terms import cache_dir

SIZES = (256, 512, 1024, 2048)
SETTLED = 1.05  # a size that gains less than 5% over the previous one: the peak is reached
MAX_GEMM_S = 1.0  # do not try a size whose one GEMM would take longer than this
SLOW_FRACTION = 0.5  # a 16-bit peak below half of fp32's: no fast kernels for that format
METHOD = "sweep-mm-linear-v2"  # cache entries measured another way are measured again
BUSY = 0.5  # load average per core above which a measured peak is re-measured when quieter


def cache_path() -> Path:
    return cache_dir() / "cpu_peak.json"


def cpu_key() -> str:
    """The cache entry of this machine: its CPU model, all its cores (the planner reads the same
    entry, tenfold.plan.hardware)."""
    from tenfold.plan.hardware import cpu_model_name  # torch-free, shared with the planner

    return f"{cpu_model_name()}|threads={os.cpu_count() or 1}"


@contextlib.contextmanager
def _all_cores():
    """The machine's peak is measured with every core, whatever this process's thread count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _rate(fn, flops: float, seconds: float) -> float:
    """FLOP/s of `fn`, best of five windows of at least `seconds` and two calls each: a
    peak is what the machine does when not disturbed."""
    fn()  # warm-up: thread pool, kernel selection
    best = 0.0
    for _ in range(5):
        iters, start = 0, time.perf_counter()
        while True:
            fn()
            iters += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds and iters >= 2:
                break
        best = max(best, flops * iters / elapsed)
    return best


def _gemm_rate(dtype_name: str, n: int, seconds: float) -> float:
    import torch
    import torch.nn.functional as F

    from tenfold.techniques.precision import DTYPES as TORCH_DTYPES

    dtype = TORCH_DTYPES[dtype_name]
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    flops = 2.0 * n**3
    return max(_rate(lambda: torch.mm(a, b), flops, seconds), _rate(lambda: F.linear(a, b), flops, seconds))


def sweep_peak(dtype_name: str, seconds: float = 0.2, sizes=SIZES, rate=_gemm_rate) -> float:
    """The highest GEMM FLOP/s over growing sizes (module docstring); `rate(dtype, n, s)`."""
    best = 0.0
    for n in sizes:
        if best and 2.0 * n**3 / best > MAX_GEMM_S:
            break  # e.g. fp16 without fast kernels: a 2048 GEMM would take seconds
        r = rate(dtype_name, n, seconds)
        settled = best > 0 and r < best * SETTLED
        best = max(best, r)
        if settled:
            break
    return best


def _read_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
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
def _measuring_alone(path: Path):
    """One measuring process at a time: a rank that waits reads what the first one cached."""
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


def cpu_peak_flops(dtype_name: str) -> float:
    """Measured dense GEMM FLOP/s of the whole machine for `dtype_name` (cached per CPU model).

    A peak measured while the machine was busy is low, and every MFU against it too high, for
    as long as it stays cached. So each entry records the load it was measured at and keeps the
    highest figure measured; one measured busy is measured again the first time the machine is
    quiet (load at most BUSY per core), and one a run has beaten (`note_exceeded`) at the next
    start. A machine that stays busy measures nothing again otherwise: each process of a run
    re-measuring would slow every run it is part of."""
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype_name!r}")
    path, key = cache_path(), cpu_key()
    entry = _read_cache(path).get(key, {})
    if not _wants_measuring(entry, dtype_name):
        return float(entry[dtype_name])
    with _measuring_alone(path):
        cache = _read_cache(path)  # another process may have measured while this one waited
        entry = cache.get(key, {})
        if entry.get("method") != METHOD:  # measured by an older rule: redo all
            entry = {"method": METHOD}
        if _wants_measuring(entry, dtype_name):
            with _all_cores():
                measured = sweep_peak(dtype_name)
            entry[dtype_name] = max(measured, float(entry.get(dtype_name, 0.0)))
            entry.setdefault("load_per_core", {})[dtype_name] = round(load_per_core(), 2)
            exceeded = entry.setdefault("exceeded", {})
            if exceeded.get(dtype_name, 0.0) <= entry[dtype_name]:
                exceeded.pop(dtype_name, None)
            cache[key] = entry
            _write_cache(path, cache)
    return float(entry[dtype_name])


def _wants_measuring(entry: dict, dtype_name: str) -> bool:
    if entry.get("method") != METHOD or dtype_name not in entry:
        return True
    if dtype_name in entry.get("exceeded", {}):  # a run did more than this figure allows
        return True
    busy_then = entry.get("load_per_core", {}).get(dtype_name, BUSY + 1) > BUSY  # no load: predates the rule
    return busy_then and load_per_core() <= BUSY  # busy then, quiet now: once


def note_exceeded(dtype_name: str, achieved_flops: float) -> None:
    """A run's model FLOP/s on this machine were above the cached peak: the figure is too low
    (measured while something else ran). Mark it to be measured again at the next start."""
    path, key = cache_path(), cpu_key()
    with _measuring_alone(path):
        cache = _read_cache(path)
        entry = cache.get(key)
        if not isinstance(entry, dict) or float(entry.get(dtype_name, 0.0)) >= achieved_flops:
            return
        entry.setdefault("exceeded", {})[dtype_name] = float(achieved_flops)
        _write_cache(path, cache)


def mfu_peak(dtype_name: str, ranks: int = 1) -> tuple[float | None, str | None]:
    """(peak FLOP/s for MFU of one of `ranks` processes sharing this CPU, None) or (None, why no
    MFU is reported)."""
    peak = cpu_peak_flops(dtype_name)
    if dtype_name == "fp32":
        return peak / ranks, None
    fp32 = cpu_peak_flops("fp32")
    if peak < SLOW_FRACTION * fp32:
        return None, (
            f"{dtype_name} matmuls have no fast kernels on this CPU ({peak / 1e9:,.1f} GFLOP/s against "
            f"{fp32 / 1e9:,.1f} in fp32); bf16 or fp32 train faster here"
        )
    return peak / ranks, None


def peak_source(device_type: str = "cpu") -> str:
    """Where a run's MFU peak comes from, as the run reports it."""
    if device_type != "cpu":
        return "the GPU's datasheet dense peak (tenfold.plan.hardware catalog)"
    return (f"this machine's measured GEMM peak (all {os.cpu_count() or 1} cores, shared by its ranks), "
            f"cached in {cache_path()}")


def main() -> None:
    print(json.dumps({d: cpu_peak_flops(d) for d in DTYPES}))


if __name__ == "__main__":
    main()
