"""Pipeline parallelism on this machine: pp=2 vs dp=2 on the same 2 processes, and the
measured pipeline bubble vs the planner's (P-1)/m.

For each m in --ms, with the same global batch of m x micro-batch sequences per step:
  pp=2 (dp=1): one pipeline of 2 stages, m micro-batches per step (--schedule, default 1f1b);
  dp=2 (pp=1): DDP (ZeRO-0) on both processes, m/2 micro-batches per rank per step.
Both run through `tenfold.engine.loop.trainer.Trainer` (the real step, loss normalisation, clipping,
AdamW) on random tokens, in one 2-process gloo job (torch.multiprocessing, 1 thread per rank).

    python benchmarks/bench_pipeline.py [--model tiny] [--seq-len 128] [--micro-batch 1]
                                        [--steps 6] [--ms 2,4,8,16] [--schedule 1f1b]

tokens/s: tokens per step over the median step time of steps WARMUP+1..N (metrics.jsonl
step_time_s; the median resists spikes from other jobs on a shared machine), the first steps
(allocator warm-up) left out. Measured bubble: per pp rank,
1 - (time inside its stage's forward/backward) / (schedule step wall time), mean over steps
2..N (techniques/pipeline.py `_StageTimer`); predicted: (P-1)/m (Narayanan et al. 2021).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch
from two_ranks import join_as_rank, run_on_two_ranks

WARMUP = 2


def trainer_config(args, pp: int, grad_accum: int, out: str) -> dict:
    return {
        "model": {"name": args.model},
        "data": {"seq_len": args.seq_len},
        "precision": {"dtype": "fp32"},
        "train": {"steps": args.steps, "micro_batch": args.micro_batch, "grad_accum": grad_accum,
                  "eval_every": 0, "eval_batches": 1, "warmup_steps": 2, "seed": 7},
        "parallel": {"pp_degree": pp, "pp_schedule": args.schedule, "nproc": 2},
        "log": {"out": out, "progress": False, "tensorboard": False},
        "checkpoint": {"final": False},
    }


def random_tokens(args, vocab: int) -> np.ndarray:
    rows = args.steps * max(args.ms) * args.micro_batch + 64  # + a validation tail
    return np.random.default_rng(0).integers(0, vocab, size=(rows, args.seq_len + 1), dtype=np.int64)


def run_one(args, pp: int, m: int, data: np.ndarray) -> dict | None:
    from tenfold.engine.loop.trainer import Trainer

    grad_accum = m if pp == 2 else m // 2
    with tempfile.TemporaryDirectory() as out:
        out = _same_dir_on_all_ranks(out)
        with contextlib.redirect_stdout(io.StringIO()):  # the trainer's own summary tables
            summary = Trainer(trainer_config(args, pp, grad_accum, out), dataset=data).fit()
        if int(os.environ["RANK"]) != 0:
            return None
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    # Median over the steady steps: robust to a spike of another job on a shared machine.
    tokens_per_step = records[0]["tokens"]
    step_s = float(np.median([r["step_time_s"] for r in records[WARMUP:]]))
    row = {"pp": pp, "dp": 2 // pp, "m": m, "tokens_per_s": tokens_per_step / step_s,
           "losses": summary["losses"]}
    if pp == 2:
        row.update(bubble_predicted=summary["pipeline"]["bubble_predicted"],
                   bubble_measured=summary["pipeline"]["bubble_measured_per_pp_rank"])
    return row


def _same_dir_on_all_ranks(path: str) -> str:
    """Rank 0's temporary directory, so rank 0 (the writer) reads what it wrote."""
    import torch.distributed as dist

    box = [path]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def worker(rank: int, port: int, args, result_file: str) -> None:
    from tenfold.models.presets import get_preset

    join_as_rank(rank, port, threads=max(1, (os.cpu_count() or 2) // 2))
    data = random_tokens(args, get_preset(args.model).vocab_size)
    rows = []
    for m in args.ms:
        for pp in (2, 1):  # alternate, so drift on a shared machine hits both
            rows.append(run_one(args, pp, m, data))
    if rank == 0:
        Path(result_file).write_text(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ms", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8, 16])
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    if any(m % 2 for m in args.ms):
        p.error("--ms must be even (dp=2 splits the m micro-batches over 2 ranks)")
    rows = [r for r in run_on_two_ranks(worker, args) if r]
    print(f"\n{args.model}, seq {args.seq_len}, micro-batch {args.micro_batch}, {args.steps} steps, "
          f"schedule {args.schedule}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}")
    print(f"{'m':>3} {'pp=2 tok/s':>11} {'dp=2 tok/s':>11} {'pp/dp':>6} {'bubble pred':>11} "
          f"{'measured rank0':>14} {'measured rank1':>14} {'same loss':>9}")
    for m in args.ms:
        a = next(r for r in rows if r["m"] == m and r["pp"] == 2)
        b = next(r for r in rows if r["m"] == m and r["pp"] == 1)
        same = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))
        print(f"{m:>3} {a['tokens_per_s']:>11.0f} {b['tokens_per_s']:>11.0f} "
              f"{a['tokens_per_s'] / b['tokens_per_s']:>6.2f} {a['bubble_predicted']:>11.3f} "
              f"{a['bubble_measured'][0]:>14.3f} {a['bubble_measured'][1]:>14.3f} {same:>9.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
