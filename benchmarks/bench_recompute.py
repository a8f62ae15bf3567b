"""Activation recompute: time overhead and activation memory of each policy vs `none`.

One run, one model, one batch; every policy is timed in interleaved rounds (so drift on a
shared machine hits all policies alike) and measured once with the tensor tracker
(tenfold.engine.memory.measure.measure_step_memory). Printed next to the published claims:
the recipe (+30% time for "one checkpoint every 12 layers", +40% for "every 24") and
Korthikanti et al. 2022 (full recompute +33-39%, selective +2-7%).

    python benchmarks/bench_recompute.py                       # small, fp32, micro-batch 8, seq 512
    python benchmarks/bench_recompute.py --micro-batch 16 --rounds 3 --json out.json

Time = one optimizer step (forward + backward + AdamW) on this machine's CPU threads.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from tenfold.engine.memory.measure import fmt_bytes, measure_step_memory
from tenfold.models.gpt import GPT
from tenfold.models.presets import get_preset
from tenfold.techniques.recompute import apply_recompute

POLICIES = ["none", "selective:attention", "selective:mlp", "every:2", "segments:4", "segments:8", "full"]
# What each policy is compared with (sources in docs/recompute.md). The recipe's "one checkpoint
# every 12 (24) layers" of a 96-layer model keeps 96/12 = 8 (96/24 = 4) segment boundaries:
# on `small` (8 layers) the same cut is segments:8 (segments:4).
CLAIMS = {
    "full": "Korthikanti: +33-39% (full, GPT 22B-1T on A100)",
    "selective:attention": "Korthikanti: +2-7% (selective)",
    "segments:8": "seed: +30% ('every 12 layers' of 96 = 8 segments)",
    "segments:4": "seed: +40% ('every 24 layers' of 96 = 4 segments)",
}


def build(preset: str, policy: str, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(get_preset(preset))
    apply_recompute(model, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def make_step(model, opt, batch: torch.Tensor, dtype: str):
    def run_step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per policy (interleaved)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--cpu-time", action="store_true",
                    help="time steps by this process's CPU time, not wall-clock (a shared machine: "
                         "with one thread, other processes' load then barely moves the ratios)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    policies = args.policies.split(",")
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, get_preset(args.model).vocab_size, (args.micro_batch, args.seq_len + 1), generator=g)

    runs = {}
    for p in policies:  # build all, warm up (creates optimizer states), measure memory once
        model, opt = build(args.model, p)
        step = make_step(model, opt, batch, args.dtype)
        step()
        runs[p] = {"step": step, "mem": measure_step_memory(model, opt, step), "times": []}
    for _ in range(args.rounds):
        for p in policies:
            w0, c0 = time.perf_counter(), time.process_time()
            runs[p]["step"]()
            runs[p]["times"].append(time.process_time() - c0 if args.cpu_time else time.perf_counter() - w0)

    base_t = statistics.median(runs["none"]["times"]) if "none" in runs else None
    base_a = runs["none"]["mem"]["activations_bytes"] if "none" in runs else None
    print(f"{args.model} {args.dtype} micro-batch {args.micro_batch} x seq {args.seq_len}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{'CPU' if args.cpu_time else 'wall-clock'} time, median of {args.rounds}")
    print(f"{'policy':<20} {'step s':>8} {'time':>8} {'activations':>12} {'act':>7} {'peak':>11}  claim")
    rows = []
    for p in policies:
        t = statistics.median(runs[p]["times"])
        m = runs[p]["mem"]
        row = {"policy": p, "step_s": t, "time_vs_none": t / base_t if base_t else None,
               "activations_bytes": m["activations_bytes"], "peak_bytes": m["peak_bytes"],
               "activations_vs_none": m["activations_bytes"] / base_a if base_a else None,
               "times": runs[p]["times"], "claim": CLAIMS.get(p, "")}
        rows.append(row)
        print(f"{p:<20} {t:8.2f} {100 * (row['time_vs_none'] - 1):+7.1f}% {fmt_bytes(m['activations_bytes']):>12} "
              f"{100 * row['activations_vs_none']:6.1f}% {fmt_bytes(m['peak_bytes']):>11}  {row['claim']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
