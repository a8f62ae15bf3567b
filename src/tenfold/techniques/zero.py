"""ZeRO stages 0-3 (Rajbhandari et al. 2020) on PyTorch's own sharding engines.

    stage 0  DDP                                 every rank holds everything; grads all-reduced
    stage 1  DDP + ZeroRedundancyOptimizer       optimizer states 1/N; grads and params full
    stage 2  FSDP2 fully_shard(reshard_after_forward=False)   optimizer states + grads 1/N
    stage 3  FSDP2 fully_shard(reshard_after_forward=True)    + params 1/N between uses

Why these engines (PyTorch's own, as torchtitan uses them):
  * Stage 1 is DDP + `ZeroRedundancyOptimizer`, not FSDP2 with resharding switched off: at the
    optimizer step ZeRO-1 holds FULL gradients and 1/N of the optimizer states. FSDP2 always
    reduce-scatters at the last micro-batch, which leaves 1/N gradients at the step (that is
    ZeRO-2's memory), so FSDP2 cannot show ZeRO-1.
  * Stage 2/3 are FSDP2, one unit per transformer block plus the root (torchtitan's
    `apply_fsdp`), applied AFTER recompute wrapping so each unit is a (recomputed) block and the
    re-gather for recompute happens inside the block (torchtitan's `apply_ac` before `apply_fsdp`).
  * FSDP2 reshards after backward in both stages, so at the optimizer step the parameters are
    1/N at stage 2 as well; the stages differ between forward and backward (stage 2 keeps the
    gathered block, stage 3 frees it and re-gathers it in backward). docs/zero.md has the table.

Loss normalization: the trainer backpropagates `local_loss_sum / global_tokens * dp_size`
and both DDP and FSDP2 AVERAGE gradients over the dp group, so the reduced gradient is exactly
the single-process gradient of the global-token mean. We never call FSDP2's
`set_gradient_divide_factor` (gloo has no PREMUL_SUM, and the average is what we want).

Mixed precision: with `param_dtype` (bf16/fp16), FSDP2's `MixedPrecisionPolicy(param_dtype,
reduce_dtype)` all-gathers 16-bit copies of the fp32 sharded master weights. Stages 0/1 keep
fp32 params and rely on autocast (precision.py).

Reduction dtype (`parallel.reduce_dtype`, DeepSpeed's `communication_data_type`): fp32 by
default, as torchtitan and Megatron reduce. bf16 halves the bytes of every gradient collective
and rounds each partial sum to bf16 (DeepSpeed's default for bf16 models): FSDP2's
`reduce_dtype` at stages 2/3 and under `replicate`, PyTorch's `bf16_compress_hook` on DDP at
stages 0/1 (`reduce_dtype_of`, `_ddp_reduce_hook`).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as torch_dist
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from tenfold.errors import TenfoldNote, UserError
from tenfold.techniques.expert_parallel import expert_params, split_expert_modules
from tenfold.techniques.nf4 import is_nf4
from tenfold.techniques.offload import host_optimizer, offload_policy, offloads, offloads_optimizer_only, optimizer_device
from tenfold.techniques.optimizer import adamw_kwargs, allocate_states, build_optimizer, clip_grad_norm as _clip, param_groups
from tenfold.techniques.tied_embeddings import uncounted_in_norm
from tenfold.terms import CPU_UNIT_BUCKET, ZERO_STAGES, runs_on_fsdp2, zero_runs_as

if TYPE_CHECKING:
    from tenfold.config import TrainSection


class ZeroChoices(Protocol):
    """The run's data-parallel choices this module reads (tenfold.run.ResolvedRun has them)."""

    @property
    def zero_stage(self) -> int: ...
    @property
    def offload(self) -> str: ...
    @property
    def reduce_dtype(self) -> str: ...
    @property
    def reduce_bucket_size(self) -> int | None: ...
    @property
    def param_persistence_threshold(self) -> int: ...
    @property
    def contiguous_gradients(self) -> bool: ...
    @property
    def overlap_comm(self) -> bool | None: ...


class DataParallelRanks(Protocol):
    """This rank's place in the layout (tenfold.engine.parallel.distributed.DistInfo has it)."""

    @property
    def device(self) -> torch.device: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def pp_size(self) -> int: ...
    @property
    def is_main(self) -> bool: ...
    @property
    def mesh(self) -> Any: ...  # torch DeviceMesh ("pp", "dp", "tp"), None on one process
    @property
    def hybrid_mesh(self) -> Any: ...  # ("dp_replicate", "dp_shard") under hybrid sharding, else None
    @property
    def ep_mesh(self) -> Any: ...  # ("dp_mod_ep", "ep") under expert parallelism, else None
    @property
    def engine_device_type(self) -> str: ...  # the device type the engine's choices follow ("cuda", "cpu")


ENGINES = {
    0: "DDP",
    1: "DDP + ZeroRedundancyOptimizer",
    2: "FSDP2 fully_shard(reshard_after_forward=False)",
    3: "FSDP2 fully_shard(reshard_after_forward=True)",
}
# Under tensor parallelism the parameters are DTensors, which DDP and ZeroRedundancyOptimizer
# do not take; the stages run on what PyTorch offers for DTensor parameters (docs/zero.md).
ENGINES_TP = {
    0: "replicate (FSDP2's replicated data parallel)",
    1: "FSDP2 fully_shard(reshard_after_forward=False), gradients reduced once per step",
    2: ENGINES[2],
    3: ENGINES[3],
}
_STAGE_ATTR = "_tenfold_zero_stage"
_HYBRID_ATTR = "_tenfold_hybrid_shard"


# --------------------------------------------------------------------------- wrapping


def apply_zero(
    model: nn.Module, choices: ZeroChoices, dist: DataParallelRanks, param_dtype: torch.dtype | None = None,
    blocks: list[nn.Module] | None = None,
) -> nn.Module:
    """Wrap `model` for ZeRO stage `choices.zero_stage` (the run's) over `dist`'s data-parallel group.

    `blocks`: the FSDP2 units of stages 2/3, one per repeated block (the model adapter finds
    them for any model, tenfold.models.adapter); default `model.layers` (tenfold's GPT).

    One data-parallel rank: there is nothing to shard or reduce, the model is returned as is
    for every stage (a single-process run is the reference the stages are tested against),
    unless it offloads (ZeRO-Offload's single-GPU case: FSDP2 on a mesh of one rank).
    """

    stage = int(choices.zero_stage)
    if stage not in ZERO_STAGES:
        raise UserError(f"parallel.zero_stage must be one of {', '.join(map(str, ZERO_STAGES))}, got {stage}")
    if dist.dp_size <= 1 and not (offloads(choices) and dist.mesh is not None):
        return model
    _warn_unmapped_knobs(choices, stage, dist)
    tp, off = dist.tp_size, choices.offload
    runs_as = zero_runs_as(stage, tp, dist.dp_size, off)  # the rule the planner prices too
    if not runs_on_fsdp2(stage, tp, dist.dp_size, off):
        wrapped = _wrap_ddp(model, choices, dist)  # DDP broadcasts rank 0's weights itself
    else:
        _broadcast_from_dp_rank0(model, dist)
        if runs_as == 0:
            wrapped = _wrap_replicate(model, choices, dist, param_dtype, blocks)
        else:  # ZeRO-1 under TP runs as stage 2 on FSDP2, reducing once per step (grad_sync)
            wrapped = _wrap_fsdp2(model, choices, dist, runs_as, param_dtype, blocks)
    setattr(wrapped, _STAGE_ATTR, stage)
    return wrapped


def dp_group(dist: DataParallelRanks):
    """The data-parallel process group (None: the default group)."""
    return dist.mesh["dp"].get_group() if dist.mesh is not None else None


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies the module in place)."""

    return model.module if isinstance(model, DistributedDataParallel) else model


@torch.no_grad()
def _broadcast_from_dp_rank0(model: nn.Module, dist: DataParallelRanks) -> None:
    """Every dp rank starts from dp-rank 0's weights. DDP does this itself; FSDP2 keeps each
    rank's own slice of its local tensor, so differently initialised ranks would silently
    assemble a model that no rank ever had."""
    group = dp_group(dist)
    src = torch_dist.get_global_rank(group, 0) if group is not None else 0
    split_experts = {id(p) for p in expert_params(model)}  # ep ranks hold different experts
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in split_experts:
            continue
        # a tensor-parallel DTensor: its local part (the dp peers hold the same part)
        local = t.to_local() if hasattr(t, "to_local") else t.data
        if is_nf4(local):  # QLoRA's frozen 4-bit base: every rank checked it built the same (engine/loop/lora_run.py)
            continue
        torch_dist.broadcast(local, src=src, group=group)


def _wrap_ddp(model: nn.Module, choices: ZeroChoices, dist: DataParallelRanks) -> nn.Module:
    kwargs: dict[str, Any] = {
        "process_group": dp_group(dist),
        # DeepSpeed's contiguous_gradients: gradients live in DDP's contiguous buckets.
        "gradient_as_bucket_view": bool(choices.contiguous_gradients),
    }
    if choices.reduce_bucket_size:
        # DeepSpeed counts elements, DDP megabytes of the gradient dtype (fp32 here).
        kwargs["bucket_cap_mb"] = choices.reduce_bucket_size * 4 / 2**20
    if dist.device.type == "cuda":
        kwargs["device_ids"] = [dist.device.index]
    # QLoRA's 4-bit weights cannot be broadcast; every rank checked it built the same base
    # and expert-parallel experts differ between ranks: their gradients are reduced on their own
    split_experts = {id(p) for p in expert_params(model)}
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, [name for name, p in model.named_parameters() if is_nf4(p) or id(p) in split_experts])
    ddp = DistributedDataParallel(model, **kwargs)
    _ddp_reduce_hook(ddp, choices, dist)
    return ddp


TORCH_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the torch dtype of each tenfold.terms.REDUCE_DTYPES


def reduce_dtype_of(choices: ZeroChoices) -> torch.dtype:
    """The dtype data-parallel gradients are reduced in (`parallel.reduce_dtype`)."""
    return TORCH_REDUCE_DTYPES[choices.reduce_dtype]


def _ddp_reduce_hook(ddp: nn.Module, choices: ZeroChoices, dist: DataParallelRanks) -> None:
    """bf16 reduction on DDP (ZeRO-0/1) through DDP's communication-hook API; fp32 keeps DDP's
    own all-reduce (no hook)."""
    if reduce_dtype_of(choices) == torch.float32:
        return
    ddp.register_comm_hook(dp_group(dist), bf16_reduce_hook)


def bf16_reduce_hook(process_group, bucket):
    """PyTorch's `bf16_compress_hook` (torch.distributed.algorithms.ddp_comm_hooks.default_hooks),
    which DDP refuses to register without NCCL or XCCL although gloo reduces bf16 too: cast the
    fp32 bucket to bf16, divide by the group size, all-reduce, copy the sum back into the fp32
    bucket in place. (No annotations: DDP compares them with `dist.GradBucket` objects, and
    this module's are strings.)"""
    group = process_group if process_group is not None else torch_dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return torch_dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def _wrap_fsdp2(model: nn.Module, choices: ZeroChoices, dist: DataParallelRanks, stage: int, param_dtype, blocks=None) -> nn.Module:
    mesh = shard_mesh(dist)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype_of(choices))
    offload = offload_policy(choices, dist.device)
    threshold = int(choices.param_persistence_threshold)
    if blocks is None:
        blocks = list(model.layers.values()) if hasattr(model, "layers") else []
    # expert-parallel experts: units of their own over the ranks holding the same experts, made
    # first so the block units leave them to those (fully_shard skips managed submodules); the
    # blocks' sizes (bucket, persistence threshold) count the parameters they shard themselves.
    for experts in split_expert_modules(model):
        fully_shard(experts, mesh=dist.ep_mesh["dp_mod_ep"], mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=_reshard_after_forward(stage, _numel(experts), threshold),
                    shard_placement_fn=_expert_placement(experts, dist.ep_mesh["dp_mod_ep"].size()))
    skip = frozenset(map(id, expert_params(model)))  # fully_shard replaced them: their ids now
    units = fsdp_units(blocks, stage, unit_bucket(choices, dist.engine_device_type), skip)
    backward_next = _backward_follows_forward(len(units), dist)
    for unit, next_ in zip(units, backward_next):
        reshard = _reshard_after_forward(stage, sum(_numel(b, skip) for b in unit), threshold) and not next_
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard)
    block_params = {id(p) for b in blocks for p in b.parameters()}
    root_numel = sum(p.numel() for p in model.parameters() if id(p) not in block_params)
    reshard = _reshard_after_forward(stage, root_numel, threshold) and not backward_next[-1]
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    setattr(model, _HYBRID_ATTR, mesh.ndim == 2)
    if dist.engine_device_type == "cpu":
        _gather_ahead_on_cpu(model)
    return model


def _expert_placement(experts: nn.Module, replicas: int):
    """How FSDP2 shards an experts module's (E/ep, ., .) local weights over `replicas` ranks: on
    the expert dimension (its default, Shard(0)) while each rank gets whole experts, on the next
    one when there are fewer local experts than ranks (dim 0 would leave ranks empty and pad;
    torchtitan's rule for its experts)."""
    local_experts = min(p.to_local().shape[0] if hasattr(p, "to_local") else p.shape[0] for p in experts.parameters())
    return None if local_experts % replicas == 0 else (lambda _param: Shard(1))


def experts_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards (and averages the gradients of) the expert-parallel experts."""
    return any(isinstance(m, FSDPModule) for m in split_expert_modules(unwrap(model)))


def shard_mesh(dist: DataParallelRanks):
    """The mesh FSDP2 shards over. Plain ZeRO-2/3: the 1-D "dp" mesh, every dp rank holds
    1/dp. Hybrid sharding (`parallel.shard_group_size` N < dp): the 2-D ("dp_replicate",
    "dp_shard") mesh, which `fully_shard` reads as HSDP: parameters are DTensors placed
    (Replicate(), Shard(0)), each rank holds 1/N, all-gathers and reduce-scatters run inside
    its group of N, and each group's reduced gradient shard is all-reduced across the dp/N
    groups (PyTorch FSDP2's HSDP; DeepSpeed's MiCS, Zhang et al. 2022, shards the same way).
    The average over all dp ranks is kept: FSDP2 divides by N in the reduce-scatter and by
    dp/N in the all-reduce."""
    hybrid = dist.hybrid_mesh
    return hybrid if hybrid is not None else dist.mesh["dp"]


def _gather_ahead_on_cpu(model: nn.Module) -> None:
    """On CPU FSDP2's all-gathers block the step: without device streams its pre-forward and
    pre-backward unshards wait for gloo before the unit computes, and its prefetches are issued
    the same blocking way. FSDP2's own switch `_set_unshard_async_op(True)` issues them as
    async gloo work instead (it documents that forward overlap then needs explicit
    prefetching): each unit then prefetches the next one in forward
    (`set_modules_to_forward_prefetch`), FSDP2's implicit backward prefetch gathers the unit
    below while this one runs its backward, and a rank that is ahead posts its gather and
    computes instead of waiting for the other. Same collectives, same order, same numerics."""

    units, seen = [], set()
    for module in model.modules():  # the root first, then the blocks in forward order
        if isinstance(module, FSDPModule) and id(module._get_fsdp_state()) not in seen:
            seen.add(id(module._get_fsdp_state()))
            units.append(module)
    for unit, next_unit in zip(units, units[1:]):
        unit.set_modules_to_forward_prefetch([next_unit])
    for unit in units:
        unit._set_unshard_async_op(True)


def _backward_follows_forward(n_units: int, dist: DataParallelRanks) -> list[bool]:
    """Per block unit, then the root (last entry): whether its backward starts right after its
    forward ends, so that freeing its parameters after forward would only re-gather them at
    once. Without pipelining that is the last block and the root (embedding + head, whose
    head runs last in forward and first in backward): FSDP2 keeps its root gathered for that
    reason when left to choose (`fully_shard`'s root heuristic), torchtitan its last block
    (`apply_fsdp`). Under pipelining other micro-batches' forwards run in between."""
    if dist.pp_size > 1:
        return [False] * (n_units + 1)
    return [i == n_units - 1 for i in range(n_units)] + [True]




def unit_bucket(choices: ZeroChoices, device_type: str) -> int | None:
    """ZeRO-2's FSDP2 unit size in parameters (None: one unit per block).

    DeepSpeed ZeRO-2 reduces gradients in buckets of `reduce_bucket_size` elements; FSDP2
    reduce-scatters one unit per collective, so the bucket maps to consecutive blocks grouped
    into one unit. Unset, it depends on whether a collective can overlap compute: on CUDA
    FSDP2 reduce-scatters each block on its own stream while the blocks below run their
    backward, so one unit per block (torchtitan's `apply_fsdp`); on CPU (gloo) FSDP2's
    collectives block the step, and each one is a round trip that waits for the slower rank,
    so blocks are grouped up to torch DDP's default bucket, 25 MiB of fp32 gradients
    (DeepSpeed's own default, 5e8 elements, would make one unit of a small model and hold all
    its unsharded gradients at once: +100 MiB per rank on the 20M-parameter benchmark model,
    docs/benchmarks.md). Grouping costs ZeRO-2 no parameter memory (it keeps every gathered
    unit from forward to backward anyway); a group's unsharded gradients wait for its one
    reduce-scatter, as DeepSpeed's wait in its bucket."""
    if choices.reduce_bucket_size:
        return int(choices.reduce_bucket_size)
    return None if device_type == "cuda" else CPU_UNIT_BUCKET


def fsdp_units(blocks: list[nn.Module], stage: int, bucket: int | None,
               skip: frozenset[int] = frozenset()) -> list[list[nn.Module]]:
    """The FSDP2 units (lists of consecutive blocks) below the root. ZeRO-3 shards block by
    block (what it frees between uses is one block); ZeRO-2 groups consecutive blocks while
    their parameters fit `bucket` (at least one block per unit). `skip`: ids of parameters FSDP2
    leaves alone (not counted)."""
    if stage != 2 or bucket is None:
        return [[b] for b in blocks]
    units: list[list[nn.Module]] = []
    size = 0
    for block in blocks:
        n = _numel(block, skip)
        if units and size + n <= bucket:
            units[-1].append(block)
            size += n
        else:
            units.append([block])
            size = n
    return units


def _wrap_replicate(model: nn.Module, choices: ZeroChoices, dist: DataParallelRanks, param_dtype, blocks=None) -> nn.Module:
    """Replicated data parallelism for tensor-parallel (DTensor) parameters, which DDP does
    not take: PyTorch's `replicate` built on FSDP2's machinery (every dp rank keeps whole
    parameters and gradients; gradients are all-reduced), one unit per block + the root as
    for FSDP2, so each block's all-reduce overlaps the backward of the blocks below it."""

    mesh = dist.mesh["dp"]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype_of(choices))
    ignored = set(expert_params(model)) or None  # split by expert parallelism, reduced by it
    if blocks is None:
        blocks = list(model.layers.values()) if hasattr(model, "layers") else []
    for block in blocks:
        replicate(block, mesh=mesh, mp_policy=mp, ignored_params=ignored)
    replicate(model, mesh=mesh, mp_policy=mp, ignored_params=ignored)
    return model


def _numel(module: nn.Module, skip: frozenset[int] = frozenset()) -> int:
    return sum(p.numel() for p in module.parameters() if id(p) not in skip)


def _reshard_after_forward(stage: int, unit_numel: int, persistence_threshold: int) -> bool:
    """Stage 3 frees a unit's gathered parameters after its forward; stage 2 keeps them to the
    backward. DeepSpeed's `stage3_param_persistence_threshold`: a unit with at most that many
    elements stays gathered from forward to backward (FSDP2 gathers a whole unit in one
    collective, so DeepSpeed's per-parameter latency saving maps to units; docs/zero.md)."""
    return stage == 3 and unit_numel > persistence_threshold


def _warn_unmapped_knobs(choices: ZeroChoices, stage: int, dist: DataParallelRanks) -> None:
    """Name, in one warning, the DeepSpeed knobs that have no PyTorch counterpart here."""
    unmapped = []
    tensor_parallel = dist.tp_size > 1
    fsdp = stage >= 2 or tensor_parallel  # FSDP2's machinery, also under `replicate`
    if choices.reduce_bucket_size and (stage == 3 or (tensor_parallel and stage == 0)):
        unmapped.append("reduce_bucket_size (FSDP2 at ZeRO-3 and `replicate` reduce one unit = one block per collective)")
    if fsdp and not choices.contiguous_gradients:
        unmapped.append("contiguous_gradients=false (FSDP2 always reduce-scatters into one flat buffer)")
    if choices.overlap_comm is False:
        unmapped.append("overlap_comm=false (DDP and FSDP2 always overlap communication with backward)")
    if unmapped and dist.is_main:
        engine = (ENGINES_TP if tensor_parallel else ENGINES)[stage]
        warnings.warn(
            f"ZeRO-{stage} on {engine}: DeepSpeed settings without a PyTorch knob, "
            f"ignored: {'; '.join(unmapped)}", TenfoldNote, stacklevel=3,
        )


# --------------------------------------------------------------------------- optimizer


def build_optimizer_for(model: nn.Module, train_cfg: TrainSection, choices: ZeroChoices, dist: DataParallelRanks) -> torch.optim.Optimizer:
    """The AdamW of `tenfold.techniques.optimizer` over the (wrapped) model; at ZeRO-1 with more than
    one dp rank, the same optimizer inside `ZeroRedundancyOptimizer`, which gives each rank
    the states of ~1/N of the parameters (whole tensors, largest first, greedy) and broadcasts
    the updated parameters after each step. `--offload optimizer`: the same AdamW with its states
    and its update in host memory (techniques/offload.HostAdamW)."""

    if offloads_optimizer_only(choices):  # the states and the update on the host (HostAdamW)
        groups = param_groups(unwrap(model), train_cfg.weight_decay)
        optimizer = host_optimizer(groups, adamw_kwargs(train_cfg, torch.device("cpu")), dist.device)
    else:
        optimizer = build_optimizer(unwrap(model), train_cfg, optimizer_device(choices, dist.device))
    if zero_runs_as(int(choices.zero_stage), dist.tp_size, dist.dp_size, choices.offload) == 1:
        optimizer = _zero_redundancy(optimizer, dist)
    allocate_states(local_optimizer(optimizer))  # this rank's states only, no collective
    return optimizer


def _zero_redundancy(optimizer: torch.optim.Optimizer, dist: DataParallelRanks) -> torch.optim.Optimizer:
    # Only the constructor's own keywords: AdamW's `defaults` also carry internal entries
    # (e.g. `decoupled_weight_decay`) its __init__ does not accept.
    accepted = set(inspect.signature(type(optimizer).__init__).parameters) - {"self", "params"}
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [{k: v for k, v in g.items() if k == "params" or k in accepted} for g in optimizer.param_groups]
    # parameters_as_bucket_view: each rank's parameters live in one flat bucket, so the
    # broadcast of the updated parameters after the step is one collective per rank instead of
    # one per parameter tensor (torch's ZeroRedundancyOptimizer docs; DeepSpeed ZeRO-1 also
    # all-gathers flat partitions). On gloo every collective is a round trip between ranks.
    return ZeroRedundancyOptimizer(
        groups, optimizer_class=type(optimizer), process_group=dp_group(dist),
        parameters_as_bucket_view=True, **defaults,
    )


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states (ZeroRedundancyOptimizer keeps its shard in
    `.optim`; others hold their own)."""
    inner = getattr(optimizer, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


# --------------------------------------------------------------------------- the step


def zero_stage_of(model: nn.Module) -> int | None:
    """The stage `apply_zero` wrapped `model` with (None: not wrapped, one dp rank)."""
    return getattr(model, _STAGE_ATTR, None)


def grad_sync(model: nn.Module, enabled: bool):
    """Context for one micro-step's forward + backward; `enabled`: the last micro-step.

    Stages 0/1 (DDP): `no_sync()` on non-boundary micro-steps, so gradients accumulate
    locally and are all-reduced once, on the last micro-batch. Stages 2/3 (FSDP2):
    reduce-scatter on EVERY micro-step and accumulate the 1/N shards; this keeps only 1/N of
    the gradients alive between micro-steps (the reason for ZeRO-2), as torchtitan and
    DeepSpeed ZeRO-2/3 do (Rajbhandari et al. 2020, section 5.2). Stage 2 also keeps its gathered
    parameters from one micro-step to the next and reshards them only after the last backward
    (`_keep_gathered`)."""
    stage = zero_stage_of(model)
    if getattr(model, _HYBRID_ATTR, False):
        return _hybrid_accumulate(model, stage, last=enabled)
    if stage == 2:
        return _keep_gathered(model, last=enabled)
    if enabled or stage is None or stage >= 2:
        return contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):  # replicate / FSDP2 (tensor parallelism)
        return _fsdp_no_sync(model)
    return model.no_sync()


@contextlib.contextmanager
def _keep_gathered(model: nn.Module, last: bool):
    """ZeRO-2 holds whole 16-bit parameters through the step (DeepSpeed keeps them whole all
    the time); FSDP2 would reshard after each backward and all-gather again in the next
    micro-step's forward. FSDP2's `set_reshard_after_backward(False)` on the micro-steps
    before the last skips those re-gathers (its documented use: gradient accumulation), so
    a step all-gathers each unit once whatever the accumulation. The optimizer step still
    sees 1/N parameters: the last micro-step reshards."""
    model.set_reshard_after_backward(last)
    try:
        yield
    finally:
        model.set_reshard_after_backward(True)


@contextlib.contextmanager
def _hybrid_accumulate(model: nn.Module, stage: int, last: bool):
    """Hybrid sharding: every micro-step reduce-scatters inside the shard group (1/N of the
    gradients stay alive, as ZeRO-2/3 want), but only the last one all-reduces across the
    groups: FSDP2's `set_requires_all_reduce(False)` accumulates the group-reduced shards
    and all-reduces their sum once per step, so the inter-group links (the slow, inter-node
    ones) carry one gradient shard per step whatever the accumulation."""
    with _keep_gathered(model, last) if stage == 2 else contextlib.nullcontext():
        model.set_requires_all_reduce(last)
        try:
            yield
        finally:
            model.set_requires_all_reduce(True)


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    """DDP's no_sync for FSDP2-based wrappers: accumulate whole gradients locally and reduce
    them on the last micro-batch (DeepSpeed ZeRO-1 also reduces at the accumulation boundary)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm(model: nn.Module, max_norm: float, extra_groups=()) -> float:
    """Clip to the GLOBAL gradient norm (over all shards) and return the pre-clip norm.

    FSDP2 gradients are DTensors sharded on dim 0: the norm of the local shards is a Partial
    DTensor whose `full_tensor()` all-reduces the squares (tenfold.techniques.optimizer.clip_grad_norm).
    DDP gradients are already full on every rank. `max_norm == 0` only measures. A tied
    embedding's copy on the last pipeline stage is clipped but counted once, on the first stage."""

    return _clip([p for p in model.parameters() if p.grad is not None], max_norm, extra_groups=extra_groups,
                 uncounted=uncounted_in_norm(model))


# --------------------------------------------------------------------------- inspection


def local_numel(t: torch.Tensor) -> int:
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's own parameters, gradients and optimizer states right now (local
    shards of DTensors; ZeroRedundancyOptimizer's local states). Tests use it to check the
    1/N claims independently of the memory tracker."""
    params = [p for p in model.parameters()]
    opt = local_optimizer(optimizer)
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    nbytes = lambda ts: sum(local_numel(t) * t.element_size() for t in ts)  # noqa: E731
    return {
        "params_bytes": nbytes(params),
        "grads_bytes": nbytes([p.grad for p in params if p.grad is not None]),
        "optimizer_bytes": nbytes(states),
    }
