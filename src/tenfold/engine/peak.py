"""Peak dense matmul FLOP/s of this machine, the denominator of MFU.

On a GPU the catalog's datasheet peak is used (tenfold.plan.hardware). A CPU has no
datasheet figure, so we measure a large square GEMM once per (CPU model, dtype, threads)
and cache it in ~/.cache/tenfold/cpu_peak.json (override with TENFOLD_CACHE_DIR).
`python -m tenfold.engine.peak` measures and prints the figures as JSON; the planner calls it
in a subprocess so that the planner itself never imports torch.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tenfold.terms import PRECISIONS as DTYPES
from tenfold.terms import cache_dir


def cache_path() -> Path:
    return cache_dir() / "cpu_peak.json"


def cpu_key() -> str:
    import torch

    from tenfold.plan.hardware import cpu_model_name  # torch-free, shared with the planner

    return f"{cpu_model_name()}|threads={torch.get_num_threads()}"


def _measure(dtype_name: str, n: int, seconds: float = 0.3) -> float:
    import torch

    from tenfold.techniques.precision import DTYPES as TORCH_DTYPES

    dtype = TORCH_DTYPES[dtype_name]
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up: thread pool, kernel selection
    best = 0.0
    for _ in range(3):  # best of three windows: a peak is what the machine can do when not disturbed
        iters, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            iters += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds and iters >= 2:
                break
        best = max(best, 2.0 * n**3 * iters / elapsed)
    return best


def cpu_peak_flops(dtype_name: str) -> float:
    """Measured dense GEMM FLOP/s for `dtype_name` on this CPU (cached per machine)."""
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype_name!r}")
    path, key = cache_path(), cpu_key()
    cache: dict = {}
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key, {})
    if dtype_name not in entry:
        # fp16 GEMMs can be ~100x slower than fp32 on CPUs without fp16 units: keep it small.
        entry[dtype_name] = _measure(dtype_name, 256 if dtype_name == "fp16" else 1024)
        cache[key] = entry
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home still gets a measured figure, just not cached
    return float(entry[dtype_name])


def main() -> None:
    print(json.dumps({d: cpu_peak_flops(d) for d in DTYPES}))


if __name__ == "__main__":
    main()
