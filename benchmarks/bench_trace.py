"""`tenfold plan --trace` at the seed's scale: how long tracing one optimizer step of a large run
takes on this machine, and how far the plan is from the trace.

Each case runs `tenfold plan ... --trace --json` as a user types it (one process per traced
pipeline stage, two at a time) and reports the wall time, the CPU time of the children, and per
memory term the planned and traced bytes of the stage the plan describes:

  * GPT-3 175B on 1,024 ranks as the recipe lays it out: 8 pipeline stages x tp 8 x dp 16,
    ZeRO-2, full recompute, micro-batches of 4 (24 per step; the vocabulary padded to
    50,304 splits over tp);
  * Llama 2 70B on 64 ranks: pp 4 x dp 4 x tp 4, ZeRO-3 with hybrid sharding (groups of 2);
  * Llama 3 405B on 16,384 ranks: pp 16 x dp 128 x tp 8, ZeRO-3, full recompute (the paper's
    shape, section 3.1: 126 layers, width 16,384, 128 heads, 8 KV heads, FFN 53,248, vocab 128,256).

The target is each case under three minutes of wall time on 2 cores.

    python benchmarks/bench_trace.py [--only NAME] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CASES = {
    "gpt3-175b x1024": ["--model", "gpt3-175b", "--gpus", "1024", "--pp", "8", "--tp", "8", "--zero", "2", "--ac", "full",
                        "--seq-len", "2048", "--micro-batch", "4", "--global-batch", "1536", "--gpu", "a100-80gb"],
    "llama2-70b x64": ["--model", "llama-70b", "--gpus", "64", "--pp", "4", "--tp", "4", "--zero", "3",
                       "--shard-group", "2", "--ac", "full", "--seq-len", "4096", "--micro-batch", "1",
                       "--global-batch", "32", "--gpu", "h100-sxm"],
    "llama3-405b x16384": ["--layers", "126", "--hidden", "16384", "--heads", "128", "--kv-heads", "8", "--ffn", "53248",
                           "--vocab", "128256", "--gpus", "16384", "--pp", "16", "--tp", "8", "--zero", "3", "--ac", "full",
                           "--seq-len", "8192", "--micro-batch", "1", "--global-batch", "2048", "--gpu", "h100-sxm"],
}


def run_case(flags: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tenfold", "plan", *flags, "--trace", "--json"],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1:], "wall_s": round(wall, 1)}
    trace = json.loads(proc.stdout)["trace"]
    return {"wall_s": round(wall, 1), "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "stage": trace["stage"], "stages_traced": [s["stage"] for s in trace["stages"]],
            "memory": {k.removesuffix("_bytes"): v for k, v in trace["memory"].items()}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=list(CASES))
    p.add_argument("--json")
    a = p.parse_args()
    results = {}
    for name, flags in CASES.items():
        if a.only and name != a.only:
            continue
        results[name] = r = run_case(flags)
        print(f"{name}: {json.dumps({k: v for k, v in r.items() if k != 'memory'})}", flush=True)
        for term, row in r.get("memory", {}).items():
            gib = lambda v: "-" if v is None else f"{v / 2**30:8.2f} GiB"  # noqa: E731
            print(f"  {term:16s} planned {gib(row['planned'])}  traced {gib(row['traced'])}  {row['diff_percent']}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
