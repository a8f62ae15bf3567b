"""A plain training loop for checkpoint tests: tenfold's GPT, AdamW, the project's LR schedule,
the DeepSpeed-style dynamic loss scaler with a short window so its scale moves, and the
resumable GlobalBatchLoader, with all three RNGs (torch, numpy, python) in the gradient, so a
resume that forgot any piece of state gives a different curve. Imported by the checkpoint and
export tests (and by their child processes) as `import plain_loop as t`."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as torch_dist

from tenfold.config import TrainSection, build_config
from tenfold.data import GlobalBatchLoader
from tenfold.engine.outputs import checkpoint as ck
from tenfold.engine.loop.schedule import build_scheduler
from tenfold.models.gpt import GPT
from tenfold.models.loss import token_loss_sum
from tenfold.terms import IGNORE_INDEX
from tenfold.techniques.precision import DynamicLossScaler

MODEL = {"name": "tiny", "n_layers": 2, "d_model": 32, "n_heads": 2, "d_ff": 64, "vocab_size": 64, "max_seq_len": 16}
CFG = build_config({"model": MODEL})
MC = CFG.model_config_resolved()
SEQ, GLOBAL_BATCH, STEPS = 16, 4, 6



def dataset() -> np.ndarray:
    return np.random.default_rng(0).integers(0, MC.vocab_size, size=(64, SEQ + 1))


def make_run(rank: int = 0, world: int = 1, zero: int = 0, noise: bool = True) -> SimpleNamespace:
    """Model, optimizer, schedule, scaler, loader and counters of a plain training run.
    world > 1 needs an initialised process group; zero=3 shards with FSDP2 `fully_shard`
    per block + root, zero=1 is DDP + ZeroRedundancyOptimizer, zero=0 plain DDP."""
    torch.manual_seed(0)
    model = GPT(MC)
    if world > 1 and zero == 3:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if world > 1 and zero == 1:  # ZeRO-1: each rank holds the AdamW states of ~1/N of the tensors
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    sched = build_scheduler(opt, TrainSection(steps=STEPS, warmup_steps=2, schedule="cosine"), STEPS)
    scaler = DynamicLossScaler(init_scale=2.0**4, scale_window=2)
    loader = GlobalBatchLoader(dataset(), GLOBAL_BATCH, GLOBAL_BATCH // world, 1, rank, world, seed=0)
    # Every rank draws from its own streams, as a real run's dropout would.
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)
    return SimpleNamespace(model=model, optimizer=opt, scheduler=sched, scaler=scaler, loader=loader,
                           state={"step": 0, "tokens": 0}, cfg=CFG, noise=noise, world=world)


def train_step(run: SimpleNamespace) -> dict:
    (mb,) = run.loader.next_step()
    labels = mb["labels"]
    if run.noise:  # token dropout drawn from the torch, numpy and python RNG streams
        labels = labels.clone()
        labels[torch.rand(labels.shape) < 0.2] = IGNORE_INDEX
        labels[0, np.random.randint(SEQ)] = IGNORE_INDEX
        labels[-1, random.randrange(SEQ)] = IGNORE_INDEX
    loss_sum = token_loss_sum(run.model(mb["input_ids"]), labels)
    global_tokens = GLOBAL_BATCH * SEQ
    loss = loss_sum * (run.world / global_tokens)  # DDP/FSDP average over ranks
    run.scaler.scale_loss(loss).backward()
    params = [p for p in run.model.parameters()]
    run.scaler.unscale_grads_(params)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scaler.update(False)
    total = loss_sum.detach().double()
    if torch_dist.is_initialized():
        torch_dist.all_reduce(total)
    run.state["step"] += 1
    run.state["tokens"] += global_tokens
    return {"step": run.state["step"], "loss": float(total) / global_tokens,
            "lr": run.optimizer.param_groups[0]["lr"], "scale": run.scaler.scale}


def train(run: SimpleNamespace, until: int, manager: ck.CheckpointManager | None = None) -> list[dict]:
    out = []
    while run.state["step"] < until:
        out.append(train_step(run))
        if manager is not None:
            manager.after_step(run.state["step"], last=run.state["step"] == until)
    if manager is not None:
        manager.close()
    return out


def states(run: SimpleNamespace) -> dict:
    """The run's parts as the manager's `states` (what engine/loop/fit.checkpoint_states builds)."""
    return ck.training_states(run.model, run.optimizer, scheduler=run.scheduler, scaler=run.scaler,
                              loader=run.loader, counters=run.state)


def manager(out: Path, run: SimpleNamespace, every: int = 3, resume: str | None = None, **kw) -> ck.CheckpointManager:
    messages: list[str] = kw.pop("messages", [])
    return ck.CheckpointManager(out, states(run), config=run.cfg, every=every, resume=resume,
                                log=messages.append, **kw)


def fresh_run_with_checkpoints(out: Path, until: int, **kw) -> SimpleNamespace:
    run = make_run()
    train(run, until, manager(out, run, **kw))
    return run
