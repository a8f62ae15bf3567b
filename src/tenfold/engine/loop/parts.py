"""Set-up of a training run: config -> resolved run -> processes, precision, data, model (every
technique applied in engine/parallel/parallelize.py), optimizer and LR schedule, loader. Writes nothing
to disk; the same parts serve `Trainer.fit`, `--memory-report` and the benchmarks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn

from tenfold.config import TenfoldConfig, TrainSection
from tenfold.data import build_data as build_bundle
from tenfold.data import make_loader  # in memory, or streamed (data.streaming)
from tenfold.data.arrays import bundle_from_array
from tenfold.engine.preview import dry_run as run_shape
from tenfold.engine.parallel.distributed import DistInfo, join_layout, launched_by_torchrun, tighten_timeouts_after_first_step
from tenfold.engine.loop import lora_run
from tenfold.engine.memory.host_malloc import tune_malloc
from tenfold.engine.loop.lora_run import LoraRun
from tenfold.engine.parallel.parallelize import check_techniques, check_tensor_parallel, parallelize
from tenfold.engine.loop.schedule import build_scheduler
from tenfold.engine.parallel.torchrun_env import local_world_size
from tenfold.engine.observe.wandb_log import check_available
from tenfold.errors import UserError
from tenfold.models.adapter import ModelAdapter, adapt
from tenfold.models.gpt import GPT
from tenfold.models.hf import build_hf_model
from tenfold.run import ResolvedRun, resolve_run
from tenfold.techniques import zero
from tenfold.techniques.converters import converters_for
from tenfold.techniques.precision import Precision, build_precision

TP_SEED_OFFSET = 2718  # Megatron-LM's model-parallel seed offset (megatron/core/tensor_parallel/random.py)


@dataclass
class Parts:
    """What one optimizer step and the loop around it work on."""

    run: ResolvedRun
    dist: DistInfo
    precision: Precision
    data: Any  # a DataBundle (tenfold.data) or a user's bundle with train/val
    adapter: ModelAdapter
    model: nn.Module  # wrapped by the techniques (parallelize)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: Any
    train: TrainSection  # steps, clipping, the non-finite rule, evaluation: the loop's settings, not the layout's
    lora: LoraRun | None = None  # a LoRA run's base identity and adapters (engine/loop/lora_run.py)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_tensor_parallel_ranks(seed: int, dist: DistInfo) -> None:
    """After the model is built (the same weights on every rank): give each tp rank its own
    torch random stream, so that dropout inside a tensor-parallel region (attention
    probabilities of this rank's heads) draws masks independent of the other ranks' heads, as
    Megatron-LM's model-parallel RNG does. Outside those regions, under sequence parallelism,
    activations are DTensors and torch's DTensor random ops draw each shard's part of one
    global mask. Data order does not use torch's stream (tenfold.data keeps its own)."""
    if dist.tp_size > 1:
        torch.manual_seed(seed + TP_SEED_OFFSET + dist.tp_rank)


def build_parts(cfg: TenfoldConfig, user_model: nn.Module | None = None, user_dataset: Any = None,
                loss_fn: Callable | None = None, tp_plan: dict | None = None) -> Parts:
    """Validate everything and build the run's parts, in this order: the run (resolved and
    checked), processes, precision, data, model, optimizer, loader."""
    world = run_shape.world_size(cfg) if launched_by_torchrun() else 1  # checks a multi-node plan's size
    run = resolve_run(cfg, world, own_model=user_model is not None)
    check_available(cfg.log.wandb)
    dist = join_layout(run.dims, cfg.parallel.timeout_s, offload=run.offload != "none")
    precision = build_precision(run.precision, cfg.precision, dist.device)
    check_fit(run, dist, precision, user_model, cfg.train.fit_check)  # before the data and the model take any memory
    if dist.device.type == "cpu":  # before the model and data take their memory
        tune_malloc()
    data = build_data(run, cfg, user_dataset, own_model=user_model is not None)
    if user_dataset is not None:  # a user's packed rows set the sequence length
        run = run.with_seq_len(int(np.asarray(data.train[:1]).shape[1]) - 1)
    seed_everything(cfg.train.seed)
    model, adapter, lora = build_model(new_model(run, cfg, user_model), run, cfg.model.blocks, dist, precision, data, loss_fn,
                                       tp_plan)
    seed_tensor_parallel_ranks(cfg.train.seed, dist)
    optimizer, scheduler = build_optimizer(model, run, cfg.train, cfg.parallel.timeout_s, dist)
    loader = make_loader(data, run.global_batch, run.micro_batch, run.grad_accum,
                         dp_rank=dist.data_rank, dp_size=dist.data_size, seed=cfg.train.seed)
    return Parts(run, dist, precision, data, adapter, model, optimizer, scheduler, loader, cfg.train, lora)


def check_fit(run: ResolvedRun, dist: DistInfo, precision: Precision, user_model: nn.Module | None,
              fit_check: bool = True) -> None:
    """The planner's per-rank memory against what this rank has (tenfold.plan.room: host memory
    shared by the local ranks, or the GPU's), for the precision the device really runs and a
    user's own module's parameter count; a run that cannot fit is refused (UserError).
    `fit_check`: train.fit_check (False: no check)."""
    if not fit_check:
        return
    from tenfold.engine.memory.measure import planner_hardware_name
    from tenfold.plan.for_run import predict_run_memory
    from tenfold.plan.room import Room, refuse_unless_fits

    params = float(sum(p.numel() for p in user_model.parameters())) if user_model is not None else None
    local = local_world_size()
    room = Room(local) if dist.device.type != "cuda" else Room(
        local, float(torch.cuda.get_device_properties(dist.device).total_memory), torch.cuda.get_device_name(dist.device))
    refuse_unless_fits(predict_run_memory(run, planner_hardware_name(dist.device), precision.name, params), room)


def build_data(run: ResolvedRun, cfg: TenfoldConfig, user_dataset: Any, own_model: bool):
    """tenfold's data pipeline (config `data`), or a user's bundle or packed rows."""
    if user_dataset is None:
        bundle = build_bundle(cfg.data, run.seq_len, cfg.train.seed, model_vocab_size=run.model.vocab_size,
                              hf_pretrained=cfg.model.hf_pretrained)
    elif hasattr(user_dataset, "train") and hasattr(user_dataset, "val"):
        bundle = user_dataset
    else:
        bundle = bundle_from_array(user_dataset, cfg.data.val_fraction)
    vocab = run.model.vocab_size
    if not own_model and bundle.vocab_size > vocab:
        raise UserError(
            f"the tokenizer has {bundle.vocab_size} tokens but model.vocab_size is {vocab}; "
            f"set --set model.vocab_size={bundle.vocab_size} or use a smaller tokenizer"
        )
    return bundle


def new_model(run: ResolvedRun, cfg: TenfoldConfig, user_model: nn.Module | None) -> nn.Module:
    """The user's module, a Hugging Face causal LM through transformers, or tenfold's GPT."""
    if user_model is not None:
        return user_model
    m = cfg.model
    if m.hf_config or m.hf_pretrained:
        return build_hf_model(m.hf_config, m.hf_pretrained)
    return GPT(run.model)


def build_model(model: nn.Module, run: ResolvedRun, blocks_path: str | None, dist: DistInfo, precision: Precision, data: Any,
                loss_fn: Callable | None, tp_plan: dict | None) -> tuple[nn.Module, ModelAdapter, LoraRun | None]:
    """The model on this rank's device, its adapter (blocks, FLOPs, loss), then every
    technique applied in the one composition point. A LoRA run's base is identified first, as
    built (engine/loop/lora_run.py). `blocks_path`: model.blocks, where the repeated blocks are (None: found)."""
    model = model.to(dist.device)
    adapter = adapt(model, run.seq_len, blocks_path, loss_fn)
    check_techniques(adapter, run)
    check_tensor_parallel(model, adapter, run, tp_plan)
    if hasattr(data, "fit_to_model"):  # packed examples: position_ids where the model masks by them
        data.fit_to_model(model, adapter.kind, dist.device)
    lora = lora_run.prepare(model, run, dist)
    wrapped = parallelize(model, run, dist, blocks=adapter.blocks, param_dtype=precision.compute_dtype,
                          kind=adapter.kind, tp_plan=tp_plan, on_lora=lambda s: lora_run.adapted(lora, adapter, s))
    return wrapped, adapter, lora


def build_optimizer(model: nn.Module, run: ResolvedRun, train: TrainSection, timeout_s: float,
                    dist: DistInfo) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW (ZeroRedundancyOptimizer at ZeRO-1) and the LR schedule over the run's steps."""
    optimizer = zero.build_optimizer_for(model, train, run, dist)
    for converter in converters_for(run, dist.device, dist.dp_size):  # e.g. --fp8 under FSDP2: scales in one all-reduce
        converter.after_optimizer_built(optimizer, model)
    tighten_timeouts_after_first_step(optimizer, timeout_s, dist)
    return optimizer, build_scheduler(optimizer, train, train.steps)
