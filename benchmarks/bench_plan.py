"""How fast the planner answers (targets: `tenfold plan` well under a second, `--search`
under 2 s for GPT-3 175B on 1024 A100s), and how its time model compares with Narayanan et
al. 2021 Table 1 (the calibration set). Run: python benchmarks/bench_plan.py

Each timing is a fresh Python process (what a user waits for, imports included), the median
of 5 runs; the baseline in the same run is `python -c pass` (interpreter start-up alone).
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass (baseline)": [sys.executable, "-c", "pass"],
    "plan --params 7.5e9 --zero 3 --json": [sys.executable, "-m", "tenfold.plan.cli", "--params", "7.5e9", "--gpus", "64",
                                            "--zero", "3", "--precision", "fp16", "--json"],
    "plan --model gpt3-175b (rich tables)": [sys.executable, "-m", "tenfold.plan.cli", "--model", "gpt3-175b", "--gpus", "1024",
                                             "--tp", "8", "--pp", "16", "--global-batch", "1536", "--ac", "full", "--tokens", "300e9"],
    "plan --ladder": [sys.executable, "-m", "tenfold.plan.cli", "--ladder"],
    # --include-unsupported: every layout is priced (tenfold train runs none of them for GPT-3 175B here)
    "plan --search gpt3-175b 1024 A100": [sys.executable, "-m", "tenfold.plan.cli", "--search", "--model", "gpt3-175b",
                                          "--gpu", "a100-80gb", "--gpus", "1024", "--global-batch", "1536",
                                          "--include-unsupported"],
}


def timed(cmd: list[str], repeats: int = 5) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (user + sys of the child: what the command
    costs on an otherwise idle machine, robust to other load)."""
    walls, cpus = [], []
    for _ in range(repeats):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        walls.append(time.perf_counter() - t)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, Python {platform.python_version()}")
    base = None
    for name, cmd in COMMANDS.items():
        wall, cpu = timed(cmd)
        base = base or cpu
        print(f"{name:42s} wall {wall:6.3f} s  cpu {cpu:6.3f} s  ({cpu / base:4.1f}x the interpreter's cpu)")
    from tenfold.plan.calibration import main as calibration

    print("\nNarayanan et al. 2021 Table 1, TFLOP/s per GPU (Eq. 3 convention):")
    calibration()


if __name__ == "__main__":
    main()
