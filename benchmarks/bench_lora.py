"""Full fine-tuning vs LoRA vs QLoRA on this machine: memory by category (measured by the
tensor tracker and predicted by the planner), steady-state tokens/s, and the ratios against
the full run measured in the same invocation.

    python benchmarks/bench_lora.py                          # small, bf16, micro-batch 8 x 256 tokens
    python benchmarks/bench_lora.py --model tiny --steps 20 --ac full

Each row is one `tenfold train` process (--steps steps, memory measured at step 2):
  params/grads/optim/act MiB   measured by the tracker (summary.json memory.measured)
  plan diff                    (measured - predicted) / predicted of the sum p+g+o+a
  tok/s                        steady-state tokens/s (summary.json final.tokens_per_s)
  x full                       the row's memory sum and tokens/s over the full run's
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROWS = {"full": [], "lora": ["--lora", "8"], "qlora": ["--qlora", "8"], "lora q,v": ["--lora", "8", "--lora-targets", "wq,wv"]}
MIB = 2**20


def run(name: str, flags: list[str], args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tenfold", "train", "--model", args.model, "--steps", str(args.steps),
           "--precision", args.precision, "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
           "--ac", args.ac, "--no-progress", "--set", "train.eval_every=0", "--no-final-checkpoint",
           "--set", "log.tensorboard=false", "--out", str(out / name.replace(",", "").replace(" ", "-")), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if proc.returncode:
        sys.exit(f"{name}: {proc.stderr[-2000:]}")
    summary = json.loads((out / name.replace(",", "").replace(" ", "-") / "summary.json").read_text())
    measured = summary["memory"]["measured"]
    return {"name": name, "measured": measured, "diff": summary["memory"]["diff_percent"]["total_bytes"],
            "tokens_per_s": summary["final"]["tokens_per_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ac", default="none")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(name, flags, args, Path(tmp)) for name, flags in ROWS.items()]
    full = rows[0]
    total = lambda r: r["measured"]["total_bytes"]  # noqa: E731
    print(f"{args.model}, {args.precision}, micro-batch {args.micro_batch} x {args.seq_len} tokens, --ac {args.ac}, "
          f"{args.steps} steps, {args.threads} threads")
    print(f"{'run':10} {'params':>8} {'grads':>8} {'optim':>8} {'act':>8} {'sum MiB':>8} {'plan diff':>9} "
          f"{'tok/s':>8} {'mem x full':>10} {'tok/s x full':>12}")
    for r in rows:
        m = r["measured"]
        print(f"{r['name']:10} {m['params_bytes'] / MIB:8.2f} {m['grads_bytes'] / MIB:8.2f} "
              f"{m['optimizer_bytes'] / MIB:8.2f} {m['activations_bytes'] / MIB:8.2f} {total(r) / MIB:8.2f} "
              f"{r['diff']:+8.1f}% {r['tokens_per_s']:8.0f} {total(r) / total(full):10.2f} "
              f"{r['tokens_per_s'] / full['tokens_per_s']:12.2f}")


if __name__ == "__main__":
    main()
