"""Tensor parallelism on this machine: tp=2 vs dp=2 on the same 2 processes, and the bytes the
tp collectives move per step, measured vs the planner's.

With the same global batch of --global-batch sequences per step:
  tp=2 (dp=1): every layer's matrices split over both processes (sequence parallel unless
               --no-sp), both see the whole batch;
  dp=2 (tp=1): DDP (ZeRO-0), each process half of the batch.
Both run through `tenfold.engine.trainer.Trainer` (the real step, loss normalisation, clipping,
AdamW) on random tokens, in one 2-process gloo job (torch.multiprocessing, 1 thread per rank),
the layouts interleaved --repeats times; the best tokens/s of each layout is reported (the
least disturbed by other jobs on a shared machine), with every repeat in --json.

    python benchmarks/bench_tp.py [--model tiny] [--seq-len 128] [--global-batch 8] [--steps 6]
                                  [--repeats 3] [--precision fp32] [--no-sp] [--json out.json]

tokens/s: tokens per step over the median step time of steps WARMUP+1..N. Bytes: one further
step of the tp=2 run under `tenfold.engine.comm_bytes.CollectiveBytes` (ring bytes per rank on
the tp group) beside `Plan.tp_bytes_per_step` for the same run (tenfold.plan.tp_traffic).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from two_ranks import join_as_rank, run_on_two_ranks

WARMUP = 2


def trainer_config(args, tp: int) -> dict:
    return {
        "model": {"name": args.model},
        "data": {"seq_len": args.seq_len},
        "precision": {"dtype": args.precision},
        "train": {"steps": args.steps + 1, "micro_batch": args.global_batch // (2 // tp), "grad_accum": 1,
                  "eval_every": 0, "eval_batches": 1, "warmup_steps": 2, "seed": 7},
        "parallel": {"tp_degree": tp, "sequence_parallel": (not args.no_sp) if tp > 1 else None, "nproc": 2},
        "log": {"out": tempfile.gettempdir(), "progress": False, "tensorboard": False},
    }


def run_one(args, tp: int, data: np.ndarray) -> dict:
    """`--steps` timed steps, then (tp=2) one step under the byte counter."""
    from tenfold.engine.comm_bytes import CollectiveBytes
    from tenfold.engine.trainer import Trainer

    t = Trainer(trainer_config(args, tp), dataset=data)
    t.setup()
    times, losses = [], []
    for _ in range(args.steps):
        batches = t.loader.next_step()
        t0 = time.perf_counter()
        losses.append(t.train_step(batches).loss)
        times.append(time.perf_counter() - t0)
    row = {"tp": tp, "dp": 2 // tp, "losses": losses, "step_s": times,
           "tokens_per_s": t.parts.run.tokens_per_step / float(np.median(times[WARMUP:]))}
    if tp > 1:
        from tenfold.plan.for_run import predict_run

        batches = t.loader.next_step()
        with CollectiveBytes() as counter:
            t.train_step(batches)
        row["bytes_measured"] = counter.ring_bytes(t.dist.mesh["tp"].get_group().group_name)
        row["bytes_by_kind"] = counter.by_kind(t.dist.mesh["tp"].get_group().group_name)
        row["bytes_planned"] = predict_run(t.parts.run, "cpu").tp_bytes_per_step
    return row


def worker(rank: int, port: int, args, result_file: str) -> None:
    from tenfold.models.presets import get_preset

    join_as_rank(rank, port, threads=1)
    rows_needed = (args.steps + 2) * args.global_batch + 64
    data = np.random.default_rng(0).integers(0, get_preset(args.model).vocab_size,
                                             size=(rows_needed, args.seq_len + 1), dtype=np.int64)
    rows = []
    for repeat in range(args.repeats):
        for tp in (2, 1) if repeat % 2 == 0 else (1, 2):  # interleaved: drift hits both layouts
            rows.append({**run_one(args, tp, data), "repeat": repeat})
    if rank == 0:
        Path(result_file).write_text(json.dumps(rows))
    from tenfold.engine.distributed import shutdown

    shutdown()


def report(args, rows: list[dict]) -> None:
    best = {tp: max((r for r in rows if r["tp"] == tp), key=lambda r: r["tokens_per_s"]) for tp in (2, 1)}
    tp2, dp2 = best[2], best[1]
    same = max(abs(x - y) / abs(y) for x, y in zip(tp2["losses"], dp2["losses"]))
    print(f"\n{args.model}, seq {args.seq_len}, global batch {args.global_batch}, {args.precision}, "
          f"{'no SP' if args.no_sp else 'SP'}, {args.steps} steps x {args.repeats} repeats; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"tokens/s, best of {args.repeats}: tp=2 {tp2['tokens_per_s']:,.0f} | dp=2 {dp2['tokens_per_s']:,.0f} | "
          f"tp/dp {tp2['tokens_per_s'] / dp2['tokens_per_s']:.2f}")
    print("every repeat (tp=2, dp=2): " + ", ".join(
        f"{a['tokens_per_s']:,.0f} / {b['tokens_per_s']:,.0f}" for a, b in
        zip([r for r in rows if r["tp"] == 2], [r for r in rows if r["tp"] == 1])))
    print(f"tp collectives per step per rank: measured {tp2['bytes_measured']:,.0f} B, planned "
          f"{tp2['bytes_planned']:,.0f} B; by kind {tp2['bytes_by_kind']}")
    print(f"loss curves tp=2 vs dp=2: max relative difference {same:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--no-sp", action="store_true", help="tensor parallelism without sequence parallelism")
    p.add_argument("--json", help="also write every repeat's rows here")
    args = p.parse_args()
    if args.global_batch % 2 or args.steps <= WARMUP:
        p.error(f"--global-batch must be even (dp=2 halves it) and --steps > {WARMUP}")
    rows = run_on_two_ranks(worker, args)
    report(args, rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
