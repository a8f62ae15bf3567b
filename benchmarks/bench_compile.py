"""`--compile` against eager: steady-state tokens/s and compile time, interleaved repeats.

Each run is a fresh `tenfold train` process (torch.compile's cache lives in the process, so a
second compile in one process would cost nothing), alternating eager, compiled, eager,
compiled..., so drift on a shared machine hits both. tokens/s is the summary's steady-state
rate, which leaves out the warm-up and the seconds spent compiling (reported on their own).

    python benchmarks/bench_compile.py                       # small, bf16, micro 8, seq 256
    python benchmarks/bench_compile.py --model tiny --precision fp32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(model: str, precision: str, micro: int, seq: int, steps: int, compiled: bool, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tenfold", "train", "--model", model, "--precision", precision,
           "--micro-batch", str(micro), "--seq-len", str(seq), "--steps", str(steps), "--no-progress",
           "--set", "data.val_fraction=0", "--set", "checkpoint.final=false", "--set", "log.tensorboard=false",
           "--out", str(out), "--compile" if compiled else "--no-compile"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    f = json.loads((out / "summary.json").read_text())["final"]
    return {"tokens_per_s": f["tokens_per_s"], "compile_s": f["compile_s"] or 0.0, "warmup_s": f["warmup_s"],
            "mfu": f["mfu"], "process_s": time.perf_counter() - t0}


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The run of the MFU figure in docs/benchmarks.md: small, bf16, micro-batch 8, sequence 256."""
    p.add_argument("--model", default="small")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    load = os.getloadavg()[0]
    print(f"# {a.model} {a.precision} micro {a.micro_batch} seq {a.seq_len}, {a.steps} steps, {a.repeats} interleaved "
          f"repeats; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, load {load:.2f} at start")
    results: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for compiled in (False, True):
                r = run(a.model, a.precision, a.micro_batch, a.seq_len, a.steps, compiled, Path(tmp) / f"{i}-{compiled}")
                results[compiled].append(r)
                print(f"repeat {i + 1} {'compiled' if compiled else 'eager   '}: {r['tokens_per_s']:,.0f} tok/s steady, "
                      f"MFU {format(r['mfu'], '.1%') if r['mfu'] else 'n/a'}, compile {r['compile_s']:.1f} s, warm-up {r['warmup_s']:.1f} s, "
                      f"process {r['process_s']:.0f} s, load {os.getloadavg()[0]:.2f}", flush=True)
    ratios = [c["tokens_per_s"] / e["tokens_per_s"] for e, c in zip(results[False], results[True])]
    print(f"compiled / eager steady tokens/s per repeat: {', '.join(f'{r:.3f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.3f}); compile time median "
          f"{statistics.median(r['compile_s'] for r in results[True]):.1f} s; load {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
