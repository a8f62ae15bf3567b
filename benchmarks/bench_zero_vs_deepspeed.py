"""tenfold ZeRO (DDP / ZeroRedundancyOptimizer / FSDP2) vs DeepSpeed ZeRO, same model, data
and settings, 2 ranks under torchrun (gloo on CPU, NCCL on GPU): tokens/s and per-rank peak
memory for each stage, as ratios tenfold / DeepSpeed measured in one run.

    pip install -e '.[bench]'            # DeepSpeed (optional; the benchmark says so if absent)
    python benchmarks/bench_zero_vs_deepspeed.py [--stages 0 1 2 3] [--steps 12]

Both engines train tenfold's GPT (same init, same seed), AdamW with the same two parameter
groups (tenfold.techniques.optimizer.param_groups) and hyper-parameters, gradient clipping 1.0, fp32,
each rank taking its slice of the same global batches. DeepSpeed runs with its own defaults
for the knobs we do not set (bucket sizes, overlap_comm, persistence threshold), tenfold with
its own: "the same config" is the DeepSpeed JSON's keys, as a user would pass them.

Throughput: both engines are built in the SAME two processes and their steps alternate
(tenfold, DeepSpeed, DeepSpeed, tenfold, ...), so a shared machine's drifting load slows both
alike; steady-state step time = median after `--warmup` steps, the slowest rank's -> tokens/s
of the whole job. Memory (one engine per launch): peak memory = the process's peak resident set (VmHWM, reset after imports) minus
its resident set at that moment, i.e. what building the model + engine + training added. On
CPU the RSS is the only measure that sees both engines' allocations (DeepSpeed's flat buffers
included); it also counts allocator slack, identically for both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = {"n_layers": 4, "d_model": 512, "n_heads": 8, "d_ff": 1408, "max_seq_len": 128}


# --------------------------------------------------------------------------- rank side


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); return that RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _rss_bytes("VmRSS")


def _tokens(args) -> "np.ndarray":
    import numpy as np

    rows = args.global_batch * (args.steps + args.warmup + 1)
    starts = np.random.default_rng(0).integers(0, 200, size=(rows, 1))
    return ((starts + 3 * np.arange(args.seq + 1)) % 256).astype(np.int64)


def _gpt(args):
    import torch

    from tenfold.models.gpt import GPT
    from tenfold.models.presets import get_preset

    torch.manual_seed(7)
    return GPT(get_preset("tiny").with_overrides(**MODEL))


def run_tenfold(args, data) -> list[float]:
    step = tenfold_stepper(args, data)
    return [step() for _ in range(args.steps + args.warmup)]


def tenfold_stepper(args, data):
    """A function that runs one tenfold training step and returns its time."""
    from tenfold.engine.trainer import Trainer

    cfg = {
        "model": {"name": "tiny", **MODEL},
        "data": {"seq_len": args.seq, "val_fraction": 0.0},
        "train": {"steps": args.steps + args.warmup, "micro_batch": args.micro, "grad_accum": 1,
                  "lr": 1e-3, "warmup_steps": 0, "eval_every": 0, "seed": 7, "grad_clip": 1.0},
        "precision": {"dtype": "fp32"},
        "parallel": {"zero_stage": args.stage},
        "log": {"out": args.tmp, "progress": False, "tensorboard": False},
        "checkpoint": {"final": False},
    }
    t = Trainer(cfg, dataset=data)
    t.setup()

    def step() -> float:
        mbs = t.loader.next_step()
        t0 = time.perf_counter()
        t.train_step(mbs)
        return time.perf_counter() - t0

    return step


def run_deepspeed(args, data) -> list[float]:
    step = deepspeed_stepper(args, data)
    return [step() for _ in range(args.steps + args.warmup)]


def deepspeed_stepper(args, data):
    """A function that runs one DeepSpeed training step and returns its time."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from tenfold.techniques.optimizer import param_groups

    model = _gpt(args)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.stage}, "gradient_clipping": 1.0,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = torch.from_numpy(data)
    counter = iter(range(10**9))

    def step() -> float:
        i = next(counter)
        rows = batch[i * args.global_batch:(i + 1) * args.global_batch]
        mine = rows[rank * args.micro:(rank + 1) * args.micro]
        t0 = time.perf_counter()
        logits = engine(mine[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), mine[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - t0

    return step


def rank_main(args) -> None:
    import torch  # noqa: F401  (imports before the RSS baseline)

    import tenfold.engine.trainer  # noqa: F401

    import deepspeed  # noqa: F401,F811  (both modes import it: the same RSS baseline)
    import torch.distributed as dist

    data = _tokens(args)
    base = _reset_peak_rss()
    if args.engine == "interleaved":
        # Both engines in the same processes, steps alternating: a machine whose load drifts
        # (shared CI boxes) slows both alike. Throughput only: the RSS would mix the two.
        steppers = {"tenfold": tenfold_stepper(args, data), "deepspeed": deepspeed_stepper(args, data)}
        times: dict[str, list[float]] = {"tenfold": [], "deepspeed": []}
        for i in range(args.steps + args.warmup):
            for name in (("tenfold", "deepspeed") if i % 2 == 0 else ("deepspeed", "tenfold")):
                times[name].append(steppers[name]())
        result = {f"{k}_step_s": statistics.median(v[args.warmup:]) for k, v in times.items()}
    else:
        times_one = run_tenfold(args, data) if args.engine == "tenfold" else run_deepspeed(args, data)
        result = {"step_s": statistics.median(times_one[args.warmup:]), "peak_rss_bytes": _rss_bytes("VmHWM") - base}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, result)
    if dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps(out))


# --------------------------------------------------------------------------- driver


def launch(engine: str, stage: int, args, tmp: str) -> dict | None:
    out = Path(tmp) / f"{engine}-{stage}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           __file__, "--rank-side", "--engine", engine, "--stage", str(stage), "--json", str(out),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--micro", str(args.micro),
           "--seq", str(args.seq), "--tmp", tmp]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"{engine} stage {stage} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    ranks = json.loads(out.read_text())
    tokens = args.global_batch * args.seq
    if engine == "interleaved":  # the job runs at the slowest rank's pace
        return {e: tokens / max(r[f"{e}_step_s"] for r in ranks) for e in ("tenfold", "deepspeed")}
    return {"tokens_per_s": tokens / max(r["step_s"] for r in ranks),
            "peak_bytes_per_rank": max(r["peak_rss_bytes"] for r in ranks)}


def driver(args) -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        sys.exit("DeepSpeed is not installed: pip install -e '.[bench]' (or pip install deepspeed)")
    import torch

    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
          f"deepspeed {deepspeed.__version__}, {args.nproc} ranks, {os.cpu_count()} CPU cores, "
          f"model {MODEL}, seq {args.seq}, micro {args.micro}/rank, fp32, {args.steps} timed steps")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_throughput:
            print("\ntokens/s, both engines in the same 2 processes, steps alternating:\n")
            print("| stage | tenfold tok/s | DeepSpeed tok/s | tenfold / DeepSpeed |")
            print("|---|---|---|---|")
            for stage in args.stages:
                for _ in range(args.repeats):
                    got = launch("interleaved", stage, args, tmp)
                    if got is None:
                        print(f"| {stage} | failed | failed | - |")
                        continue
                    print(f"| {stage} | {got['tenfold']:,.0f} | {got['deepspeed']:,.0f} | "
                          f"{got['tenfold'] / got['deepspeed']:.2f}x |", flush=True)
        if not args.skip_memory:
            print("\nper-rank peak memory (RSS added by model + engine + training), one engine per launch:\n")
            print("| stage | tenfold MiB/rank | DeepSpeed MiB/rank | tenfold / DeepSpeed | (tok/s alone: tenfold, DeepSpeed) |")
            print("|---|---|---|---|---|")
            for stage in args.stages:
                t, d = launch("tenfold", stage, args, tmp), launch("deepspeed", stage, args, tmp)
                if t is None or d is None:
                    print(f"| {stage} | {'failed' if t is None else ''} | {'failed' if d is None else ''} | - | - |")
                    continue
                print(f"| {stage} | {t['peak_bytes_per_rank'] / 2**20:,.0f} | {d['peak_bytes_per_rank'] / 2**20:,.0f} | "
                      f"{t['peak_bytes_per_rank'] / d['peak_bytes_per_rank']:.2f}x | "
                      f"{t['tokens_per_s']:,.0f}, {d['tokens_per_s']:,.0f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="interleaved throughput launches per stage")
    p.add_argument("--skip-throughput", action="store_true", help="only the per-rank memory launches")
    p.add_argument("--skip-memory", action="store_true", help="only the interleaved throughput launches")
    p.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=["tenfold", "deepspeed", "interleaved"], help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    args.global_batch = args.micro * world
    rank_main(args) if args.rank_side else driver(args)


if __name__ == "__main__":
    main()
