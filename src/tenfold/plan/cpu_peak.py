"""This machine's measured GEMM peak, as the planner reads it (the MFU denominator on a CPU).

`tenfold.engine.observe.peak` measures it (with torch) and keeps it in `cpu_peak.json` in the cache
folder (`tenfold.host.cache_dir`: $TENFOLD_CACHE_DIR, else ~/.cache/tenfold). An entry's key
names what the figure depends on: the CPU model and core count, the torch version and the
thread count it was measured with (`cache_key`); when one of them changes, so does the key,
and the figure is measured again. Each entry holds one figure per dtype, measured only when a
run or a plan needs that dtype.

The planner never imports torch: where the cache has no figure for the dtype a plan prices,
`measured_peak` runs `python -m tenfold.engine.observe.peak --dtype D --threads N` in a subprocess,
whose measurement takes a bounded time (a few seconds) however busy the machine is.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tenfold.errors import UserError
from tenfold.host import cache_dir, cpuinfo_field

# Cache entries measured another way are measured again (the key carries it too).
METHOD = "bounded-mm-linear-v3"
MEASURED_DTYPES = ("fp32", "bf16", "fp16")
MAX_CACHE_BYTES = 2**20
# The subprocess imports torch (seconds on a busy machine) and measures for at most
# tenfold.engine.observe.peak.BUDGET_S; this only guards against a child that never answers.
SUBPROCESS_TIMEOUT_S = 60


def cpu_model_name() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def cache_path() -> Path:
    return cache_dir() / "cpu_peak.json"


def torch_version() -> str:
    """torch's version as installed, read without importing torch."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def cache_key(threads: int) -> str:
    """The entry of a figure measured with `threads` threads on this machine and torch."""
    return f"{cpu_model_name()}|cores={os.cpu_count() or 1}|torch={torch_version()}|threads={threads}|{METHOD}"


def without_stale(cache: dict) -> dict:
    """`cache` without this machine's entries from another core count, torch version or method:
    figures no key reads again."""
    machine = f"{cpu_model_name()}|"
    current = cache_key(0).rsplit("|threads=", 1)[0] + "|threads="
    return {k: v for k, v in cache.items()
            if not k.startswith(machine) or (k.startswith(current) and k.endswith(f"|{METHOD}"))}


def read_cache(path: Path | None = None) -> dict:
    """The cache file's entries; {} where it is missing, unreadable or not a cache."""
    from tenfold.textfiles import read_text

    try:
        cache = json.loads(read_text(path or cache_path(), "peak cache", MAX_CACHE_BYTES))
    except (UserError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def cached_peak(dtype: str, threads: int, cache: dict | None = None) -> float | None:
    """The cached FLOP/s for `dtype` at `threads` threads, or None where none is cached."""
    entry = (read_cache() if cache is None else cache).get(cache_key(threads))
    value = entry.get(dtype) if isinstance(entry, dict) else None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def machine_threads() -> int:
    """The planner's figure is the whole machine's: measured with a thread per core, and shared
    by the ranks that run on it (tenfold.plan.step_time.compute_share)."""
    return os.cpu_count() or 1


def measured_peak(dtype: str) -> float:
    """The machine's FLOP/s for `dtype`: cached, else measured now in a subprocess (bounded)."""
    threads = machine_threads()
    cached = cached_peak(dtype, threads)
    if cached is not None:
        return cached
    if torch_version() == "none":
        raise UserError(f"--gpu cpu: this CPU's {dtype} peak is measured with torch, which is not "
                        "installed here; install torch, or name a GPU from the catalog (--gpu a100-80gb), "
                        "or give the rate (--achieved-tflops)")
    cmd = [sys.executable, "-m", "tenfold.engine.observe.peak", "--dtype", dtype, "--threads", str(threads)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=True)
        return float(json.loads(out.stdout.strip().splitlines()[-1])[dtype])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError, TypeError) as exc:
        raise UserError(f"--gpu cpu: could not measure this CPU's {dtype} peak with "
                        f"`python -m tenfold.engine.observe.peak --dtype {dtype}` ({exc})") from None
