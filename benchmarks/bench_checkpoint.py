"""Checkpoint cost: save / load time and bytes written, sync vs async, 1 and 2 ranks, and the
overhead per training step of `--checkpoint-every N`.

    python benchmarks/bench_checkpoint.py                       # small, 1 and 2 ranks, every 100
    python benchmarks/bench_checkpoint.py --model tiny --nproc 1 --every 50

For each world size (2 ranks = FSDP2 ZeRO-3 over gloo, every rank writes its shard):
  step_s        median time of one training step (AdamW, fp32, --micro-batch x --seq-len)
  save_s        synchronous save (DCP write + side files + sha256 manifest + rename + latest)
  async_block_s time the loop is blocked by an async save (staging copy); async_total_s until
                the background write is finalised
  verify_s      manifest check (size + sha256 of every file), part of load_s
  load_s        resume: verify + DCP load (resharding plan) + set_state_dict + JSON state
  MiB           bytes on disk (model + AdamW states + JSON), from the manifest
  overhead      save_s / (every * step_s): the share of wall time spent saving at that interval
                (async: async_block_s / (every * step_s))
Ratios are against the same run's own step time, so the machine's speed cancels out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp


def _run_parts(model_name: str, rank: int, world: int, seq_len: int, micro_batch: int) -> SimpleNamespace:
    from tenfold.config import TrainSection, build_config
    from tenfold.engine.loop.schedule import build_scheduler
    from tenfold.models.gpt import GPT

    cfg = build_config({"model": {"name": model_name}, "data": {"seq_len": seq_len}})
    torch.manual_seed(0)
    model = GPT(cfg.model_config_resolved())
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = build_scheduler(opt, TrainSection(steps=1000), 1000)
    vocab = cfg.model_config_resolved().vocab_size
    return SimpleNamespace(model=model, optimizer=opt, scheduler=sched, scaler=None, loader=None,
                           state={"step": 0}, cfg=cfg, vocab=vocab, seq_len=seq_len, micro_batch=micro_batch)


def _step(run: SimpleNamespace) -> float:
    t0 = time.perf_counter()
    ids = torch.randint(0, run.vocab, (run.micro_batch, run.seq_len + 1))
    logits = run.model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.state["step"] += 1
    return time.perf_counter() - t0


def _barrier() -> None:
    if torch_dist.is_initialized():
        torch_dist.barrier()


def measure(model_name: str, rank: int, world: int, out: Path, steps: int, seq_len: int, micro_batch: int) -> dict:
    from tenfold.engine.outputs import checkpoint as ck
    from tenfold.models.presets import param_count

    quiet = lambda msg: None  # noqa: E731

    def states(r: SimpleNamespace) -> dict:
        return ck.training_states(r.model, r.optimizer, scheduler=r.scheduler, counters=r.state)

    run = _run_parts(model_name, rank, world, seq_len, micro_batch)
    step_times = [_step(run) for _ in range(steps)]
    _barrier()
    sync = ck.CheckpointManager(out / "sync", states(run), config=run.cfg, log=quiet)
    t0 = time.perf_counter()
    result = sync.save(run.state["step"])
    save_s = time.perf_counter() - t0
    asyn = ck.CheckpointManager(out / "async", states(run), config=run.cfg, async_save=True, log=quiet)
    _barrier()
    t0 = time.perf_counter()
    asyn.save(run.state["step"])
    block_s = time.perf_counter() - t0
    extra_step = _step(run)  # training goes on while the background thread writes
    asyn.wait()
    async_total_s = time.perf_counter() - t0
    ckpt = out / "sync" / "checkpoints" / f"step_{steps}"
    _barrier()
    t0 = time.perf_counter()
    ck.verify_checkpoint(ckpt)
    verify_s = time.perf_counter() - t0
    fresh = _run_parts(model_name, rank, world, seq_len, micro_batch)
    _step(fresh)  # optimizer states exist, as in a resumed run's set-up
    _barrier()
    t0 = time.perf_counter()
    ck.CheckpointManager(out / "sync", states(fresh), config=fresh.cfg, resume=str(ckpt), log=quiet).resume()
    load_s = time.perf_counter() - t0
    return {
        "model": model_name, "world_size": world, "params": param_count(run.cfg.model_config_resolved()),
        "step_s": statistics.median(step_times[1:] or step_times), "save_s": save_s,
        "async_block_s": block_s, "async_total_s": async_total_s, "step_during_async_s": extra_step,
        "verify_s": verify_s, "load_s": load_s, "bytes": result.bytes_written,
    }


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch_dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = measure(args.model, rank, world, Path(tmp), args.steps, args.seq_len, args.micro_batch)
    finally:
        torch_dist.destroy_process_group()
    if rank == 0:
        (Path(tmp) / "result.json").write_text(json.dumps(res))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, args: argparse.Namespace) -> dict:
    tmp = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    try:
        if world == 1:
            return measure(args.model, 0, 1, Path(tmp), args.steps, args.seq_len, args.micro_batch)
        mp.start_processes(_worker, args=(world, _free_port(), args, tmp), nprocs=world, start_method="spawn")
        return json.loads((Path(tmp) / "result.json").read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=3, help="training steps before the save (step time = median)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--every", type=int, default=100, help="checkpoint interval for the overhead column")
    p.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [run_world(w, args) for w in args.nproc]
    for r in rows:
        r["overhead_sync"] = r["save_s"] / (args.every * r["step_s"])
        r["overhead_async"] = r["async_block_s"] / (args.every * r["step_s"])
        r["save_MiB_per_s"] = r["bytes"] / 2**20 / r["save_s"]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"model {args.model}, micro-batch {args.micro_batch} x seq {args.seq_len}, fp32 AdamW, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, every {args.every} steps")
    head = ("ranks", "MiB", "step_s", "save_s", "MiB/s", "async_block_s", "async_total_s", "verify_s", "load_s",
            f"overhead@{args.every} sync", "async")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join([
            str(r["world_size"]), f"{r['bytes'] / 2**20:.1f}", f"{r['step_s']:.3f}", f"{r['save_s']:.3f}",
            f"{r['save_MiB_per_s']:.0f}", f"{r['async_block_s']:.3f}", f"{r['async_total_s']:.3f}",
            f"{r['verify_s']:.3f}", f"{r['load_s']:.3f}", f"{r['overhead_sync']:.2%}", f"{r['overhead_async']:.2%}",
        ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
