"""The shape of a training run, resolved from its config alone, without torch.

`tenfold train --dry-run` checks the whole config and prints what the run would be, in
well under a second, with nothing built, read or written: the process mesh (pipeline
stages x data-parallel ranks), the batch triplet (DeepSpeed's rule over the data-parallel
size), the precision, the model's shape and size, the recompute policy, and the planner's
per-rank memory prediction. What needs the data, the model's modules or the device is
checked when the run starts: the data file's contents, a tokenizer's vocabulary against the
model's, whether a Hugging Face model's blocks allow the techniques, and bf16 support (a
device without it trains in fp32).

`planner_strategy` and `memory_by_category` are also what the engine's predicted-vs-measured
memory (`engine/memory.py`) and the ladder use, so a dry run predicts what training reports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tenfold.models.presets import ModelConfig

# The planner's pipeline schedules; zero-bubble runs are costed as 1F1B, whose activation
# memory they share (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3).
_PLAN_SCHEDULES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zero-bubble": "1f1b"}
_MEMORY_ROWS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "total_bytes")


def planner_strategy(config, dist_info=None, dtype: str | None = None, seq_len: int | None = None):
    """The planner's `Strategy` for a resolved `TenfoldConfig` as tenfold's engine runs it:
    fp32 parameters under torch.amp (no 16-bit master split), tenfold's own activation style
    (eager PyTorch, fp32 residual stream, dropout-free, SDPA without an s^2 term)."""
    from tenfold.config import resolve_batch
    from tenfold.plan.strategy import Strategy

    dp = getattr(dist_info, "dp_size", 1) or 1
    micro, accum, glob = resolve_batch(config.train.micro_batch, config.train.grad_accum, config.train.global_batch, dp)
    par = config.parallel
    return Strategy(
        precision=dtype or config.precision.dtype, micro_batch=micro, grad_accum=accum, global_batch=glob,
        seq_len=seq_len or config.seq_len(), ac=str(config.recompute.policy), zero=par.zero_stage, pp=par.pp_degree,
        pp_schedule=_PLAN_SCHEDULES.get(par.pp_schedule, "1f1b"), virtual_stages=par.virtual_stages,
        master_weights=False, dropout=False, flash_attention=True, activation_style="tenfold",
    )


def memory_by_category(m: Any) -> dict[str, int]:
    """The planner's per-rank `MemoryBreakdown` under the engine's measured keys.

    activations_bytes includes the autocast 16-bit weight copies (a tensor tracker sees them
    as activations: created in forward, saved for backward); peak_bytes is the planner's
    allocated total (model states + activations + communication buffers, no allocator
    reserve or CUDA context, which no tensor tracker sees)."""
    act = (m.activations_bytes or 0.0) + (m.autocast_weight_copies_bytes or 0.0)
    out = {
        "params_bytes": m.params_bytes, "grads_bytes": m.grads_bytes, "optimizer_bytes": m.optimizer_bytes,
        "activations_bytes": act, "buffers_bytes": 0, "other_bytes": m.comm_buffers_bytes,
        "peak_bytes": m.peak_bytes,
    }
    out["total_bytes"] = out["params_bytes"] + out["grads_bytes"] + out["optimizer_bytes"] + act
    return {k: int(round(v)) for k, v in out.items()}


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class RunShape:
    world_size: int
    pp: int
    dp: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    model: ModelConfig
    params: float
    predicted: dict[str, int]  # memory per rank, memory_by_category's keys


def world_size(cfg) -> int:
    """The processes this run has: torchrun's WORLD_SIZE when launched by it, else --nproc."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return cfg.parallel.nproc


def resolve_run_shape(cfg) -> RunShape:
    """Everything about the run that the config alone decides (UserError if it cannot run)."""
    from tenfold.config import resolve_batch
    from tenfold.engine.launch import preflight
    from tenfold.plan.api import predict_memory
    from tenfold.plan.shape import shape_of
    from tenfold.techniques.recompute import parse_policy

    world = world_size(cfg)
    preflight(cfg, world)  # pp divides the processes, the batch triplet, the pipeline's limits
    pp = cfg.parallel.pp_degree
    micro, accum, glob = resolve_batch(cfg.train.micro_batch, cfg.train.grad_accum, cfg.train.global_batch, world // pp)
    seq_len = cfg.seq_len()
    parse_policy(cfg.recompute.policy)  # the engine's grammar
    model = cfg.model_config_resolved()
    mesh = _Mesh(world // pp)
    memory = predict_memory(model, "cpu", world, planner_strategy(cfg, mesh, seq_len=seq_len))
    return RunShape(world, pp, world // pp, micro, accum, glob, seq_len, model, shape_of(model).params,
                    memory_by_category(memory))


@dataclass(frozen=True)
class _Mesh:
    dp_size: int


def describe(cfg, shape: RunShape) -> list[str]:
    """The dry run's report, one line per aspect."""
    m, c = shape.model, cfg
    name = c.model.hf_pretrained or c.model.hf_config or c.model.name
    p = shape.predicted
    tokens = shape.global_batch * shape.seq_len
    return [
        "tenfold train --dry-run: the config is valid; nothing was built, read or written",
        f"  model      {name}: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, vocab {m.vocab_size}, "
        f"context {m.max_seq_len} ({shape.params / 1e6:,.2f}M params)",
        f"  precision  {c.precision.dtype}" + (" (fp32 where the device has no bf16)" if c.precision.dtype == "bf16" else ""),
        f"  batch      {shape.global_batch} = {shape.micro_batch} x {shape.grad_accum} x dp {shape.dp} sequences of "
        f"{shape.seq_len} tokens ({tokens:,} tokens per step), {c.train.steps} steps",
        f"  processes  {shape.world_size} = pp {shape.pp} x dp {shape.dp}; ZeRO {c.parallel.zero_stage}; "
        f"recompute {c.recompute.policy}",
        "  memory     per rank, predicted (planner): "
        + " | ".join(f"{k.removesuffix('_bytes')} {fmt_bytes(p[k])}" for k in _MEMORY_ROWS)
        + f" | peak {fmt_bytes(p['peak_bytes'])}",
        f"  output     {c.log.out}",
    ]


def dry_run(cfg) -> int:
    """`tenfold train --dry-run`: print the resolved run; exit status 0."""
    for line in describe(cfg, resolve_run_shape(cfg)):
        print(line)
    return 0
