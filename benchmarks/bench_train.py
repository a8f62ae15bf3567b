"""tenfold train vs a plain hand-written PyTorch loop: same model, data, precision, optimizer.

Measures tokens/s of both in this one run (alternating repeats, so drift on a shared machine
hits both) and prints the ratio tenfold / plain per precision (target >= 0.98), plus the MFU
that `tiny` and `small` reach here (model FLOPs 6N + 12*L*s*d per token, the CPU's measured
GEMM peak for the dtype; tenfold/models/presets.py::flops_per_token, engine/observe/peak.py).

    python benchmarks/bench_train.py [--model tiny] [--steps 30] [--repeats 3] [--precisions fp32,bf16]
    python benchmarks/bench_train.py --model small --micro-batch 8 --seq-len 256 --precisions bf16   # the MFU figure

Throughput is tokens over the wall time of steps warmup+1..N, loop overheads included
(data loading, logging, metrics for tenfold; data slicing for the plain loop).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from tenfold.config import build_config
from tenfold.data import GlobalBatchLoader, build_data
from tenfold.engine.observe.peak import cpu_peak_flops
from tenfold.engine.loop.trainer import Trainer
from tenfold.models.gpt import GPT
from tenfold.models.presets import flops_per_token, get_preset

WARMUP = 3


SEQ_LEN: int | None = None  # --seq-len (None: the model's context)


def config(model: str, precision: str, steps: int, micro_batch: int, out: str) -> dict:
    return {
        "model": {"name": model},
        "data": {"seq_len": SEQ_LEN},
        "precision": {"dtype": precision},
        "train": {"steps": steps, "micro_batch": micro_batch, "grad_accum": 1, "eval_every": 0, "eval_batches": 1,
                  "warmup_steps": 2},
        "log": {"out": out, "progress": False, "tensorboard": False},
        "checkpoint": {"final": False},
    }


def run_tenfold(model: str, precision: str, steps: int, micro_batch: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        Trainer(build_config(config(model, precision, steps, micro_batch, out))).fit()
        records = [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    t0, t1 = records[WARMUP - 1]["elapsed_s"], records[-1]["elapsed_s"]
    tokens = records[-1]["tokens"] - records[WARMUP - 1]["tokens"]
    return tokens / (t1 - t0)


def run_plain(model: str, precision: str, steps: int, micro_batch: int) -> float:
    """The loop a user would write by hand (nanoGPT style)."""
    cfg = build_config(config(model, precision, steps, micro_batch, "/tmp/unused"))
    seq_len = cfg.seq_len()
    data = build_data(cfg.data, seq_len, cfg.train.seed)
    loader = GlobalBatchLoader(data.train, micro_batch, micro_batch, 1, seed=cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    net = GPT(cfg.model.build())
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    stamps = []
    for _ in range(steps):
        batch = loader.next_step()[0]
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            logits = net(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)  # the same host sync tenfold does to log the loss
        stamps.append(time.perf_counter())
    return micro_batch * seq_len * (steps - WARMUP) / (stamps[-1] - stamps[WARMUP - 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context)")
    ap.add_argument("--precisions", default="fp32,bf16")
    args = ap.parse_args()
    global SEQ_LEN
    SEQ_LEN = args.seq_len
    mc = get_preset(args.model)
    seq = args.seq_len or mc.max_seq_len
    fpt = flops_per_token(mc, seq)
    print(f"# {platform.node()} | {platform.processor() or platform.machine()} | torch {torch.__version__} | "
          f"threads {torch.get_num_threads()} | {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# model {args.model}, micro-batch {args.micro_batch} x seq {seq}, {args.steps} steps "
          f"(first {WARMUP} excluded), {args.repeats} alternating repeats, best of each; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| precision | plain tok/s | tenfold tok/s | ratio tenfold/plain (target >= 0.98) | per repeat | tenfold MFU |")
    print("|---|---|---|---|---|---|")
    for precision in args.precisions.split(","):
        plain, ours = [], []
        for i in range(args.repeats):  # plain, tenfold, tenfold, plain, ...: linear drift hits both alike
            order = (run_plain, run_tenfold) if i % 2 == 0 else (run_tenfold, run_plain)
            for run in order:
                (plain if run is run_plain else ours).append(run(args.model, precision, args.steps, args.micro_batch))
        best_plain, best_ours = max(plain), max(ours)
        mfu = fpt * best_ours / cpu_peak_flops(precision)
        each = ", ".join(f"{o / p:.3f}" for o, p in zip(ours, plain))
        print(f"| {precision} | {best_plain:,.0f} | {best_ours:,.0f} | {best_ours / best_plain:.3f} | {each} | {mfu:.1%} |")


if __name__ == "__main__":
    os.environ.setdefault("TENFOLD_BENCH", "1")
    main()
