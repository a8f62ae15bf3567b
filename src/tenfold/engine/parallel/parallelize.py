"""The one place where the techniques are applied to a model, in a fixed order.

Order (torchtitan's `parallelize_llama`): low-rank adapters -> pipeline split -> model
converters (NF4 base, float8 Linears: techniques/converters.py) -> tensor parallelism -> context-parallel attention -> activation recompute -> torch.compile per block ->
ZeRO/FSDP wrapping, on one ("pp", "dp", "tp") device mesh. Expert parallelism (MoE experts split
over ep of the dp ranks, techniques/expert_parallel.py) comes after tensor parallelism and before
the ZeRO wrappers, which skip the split experts. Adapters are a model conversion
(PEFT's LoRA layers around the targeted Linears, the rest frozen in the compute dtype:
techniques/lora.py) made on the whole model on every rank, so that their random init draws what
one process draws, whatever the layout. The pipeline split comes next because each stage
splits and shards only what it owns; QLoRA's NF4 quantization of the frozen Linears
(techniques/nf4.py) is then done per stage, on what the stage keeps. Float8 conversion swaps modules (Linear -> Float8Linear) and so comes
before every wrapper, as torchtitan converts the model before `parallelize_llama` runs: FSDP2
then all-gathers the float8 weights its own way (techniques/fp8.py).
Tensor parallelism comes before recompute so that a recomputed block re-runs its own tp
collectives, and before FSDP2, which then shards the tp-split DTensor parameters over the dp
axis (2-D parameters). Recompute must wrap blocks before FSDP2's `fully_shard` takes them over
(so that unsharded parameters are re-gathered inside the recomputed forward). Compile comes
after both (the compiled block traces the checkpoint call; tp with compile is refused in
capabilities.py) and before FSDP2, whose hooks then run eagerly around the compiled forward
(techniques/compile.py). Mixed precision is not a wrapper: autocast is entered in the step
(techniques/precision.py), and under FSDP2 the ZeRO module passes a MixedPrecisionPolicy.

`check_techniques` runs first: every technique the run asks for must fit the model.
Everything is read from the resolved run (tenfold.run); its `config` only for the knobs the run
does not carry (float8 emulation, DeepSpeed's bucket and persistence settings for the ZeRO wrappers).
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
import torch.nn as nn

from tenfold.capabilities import pipeline_model_problem
from tenfold.engine.parallel.distributed import DistInfo, embedding_group
from tenfold.errors import UserError
from tenfold.models.adapter import ModelAdapter
from tenfold.run import ResolvedRun
from tenfold.techniques import context_parallel, expert_parallel, fp8, lora, recompute, zero
from tenfold.techniques.converters import converters_for
from tenfold.techniques import tensor_parallel as tp
from tenfold.techniques.compile import apply_compile, check_supported as check_compile_supported
from tenfold.techniques.pipeline import PipelineSplit, split_for_rank
from tenfold.techniques.pipeline_runner import build_pipelined_model
from tenfold.techniques.tied_embeddings import TiedEmbedding


def parallelize(
    model: nn.Module, run: ResolvedRun, dist: DistInfo, blocks: list[nn.Module] | None = None,
    param_dtype: torch.dtype | None = None, kind: str = "tenfold", tp_plan: dict | None = None,
    on_lora=None,
) -> nn.Module:
    """`blocks`: the model's repeated blocks (tenfold.models.adapter), recomputed and sharded
    one by one; None: tenfold's GPT `model.layers`. `param_dtype`: the 16-bit compute dtype
    (None for fp32); FSDP2 (ZeRO-2/3) then gathers parameters in it and reduces in fp32, over
    fp32 sharded master weights (MixedPrecisionPolicy). `kind`: the adapter's model kind, which
    picks the tensor-parallel plan; `tp_plan`: a user's own plan instead. `on_lora`: called with
    the adapters' summary (techniques.lora.LoraSummary) once they are on."""
    if run.compile:  # before any work: no C++ compiler (CPU) or Triton (GPU), no run
        check_compile_supported(dist.device.type)
    if run.fp8:  # before any work too: a device without float8 matmuls, no torchao
        fp8.check_supported(dist.device, run.fp8_emulate)
    if dist.tp_size > 1:
        _broadcast_from_rank0(model)  # the tp ranks split one model: it must be the same everywhere
    if run.lora is not None:  # adapters on the whole model, the base frozen in the compute dtype
        adapted = lora.apply_lora(model, run.lora, blocks if blocks is not None else recompute.find_blocks(model),
                                  param_dtype)
        if on_lora is not None:
            on_lora(adapted)
    if dist.pp_size > 1:  # split first; each stage then gets TP + recompute + ZeRO alone
        split = split_for_rank(model, run, dist, param_dtype)  # stage modules, each with its own blocks
        tied = _tie_stages(split, dist)  # tied embeddings: the last stage's copy = the first stage's
        parts = [_apply_techniques(part, run, dist, part.blocks, param_dtype, kind, tp_plan) for part in split.modules]
        return build_pipelined_model(split, parts, run, dist, param_dtype, tied)
    return _apply_techniques(model, run, dist, blocks, param_dtype, kind, tp_plan)


def _apply_techniques(model: nn.Module, run: ResolvedRun, dist: DistInfo, blocks, param_dtype, kind: str,
                      tp_plan: dict | None) -> nn.Module:
    for converter in converters_for(run, dist.device, dist.dp_size):  # module swaps, before every wrapper
        converter.convert(model, blocks if blocks is not None else recompute.find_blocks(model))
    if dist.tp_size > 1:
        tp.apply_tensor_parallel(model, dist.mesh["tp"], tp.plan_for(model, kind, run.sequence_parallel, tp_plan))
    if dist.cp_size > 1:  # before recompute, which then re-runs the cp attention's all-gather
        context_parallel.apply_context_parallel(model, blocks if blocks is not None else recompute.find_blocks(model),
                                                dist.cp_group, dist.cp_size, dist.cp_rank)
    if dist.ep_size > 1:  # experts split before the dp wrappers, which then leave them alone
        expert_parallel.apply_expert_parallel(model, dist.ep_mesh["ep"])
    if run.recompute.kind != "none":
        recompute.apply_recompute(model, run.recompute, blocks=blocks)
    if run.compile:
        apply_compile(model, blocks=blocks)
    return zero.apply_zero(model, run, dist, param_dtype=param_dtype, blocks=blocks)


def _tie_stages(split: PipelineSplit, dist: DistInfo) -> TiedEmbedding | None:
    """Tied embeddings across pipeline stages (techniques/tied_embeddings.py): the embedding
    group of this rank, and the last stage's copy set to the first stage's values over it, on
    plain tensors before tensor parallelism and ZeRO split them. Every rank knows of the tie
    (the split saw every stage); a middle pipeline rank holds no copy."""
    if split.tied is None:
        return None
    tied = TiedEmbedding(split.tied, local=split.tied_local)
    if tied.local:
        tied.group, first_stage_rank = embedding_group(dist)
        tied.broadcast_initial(split.modules, src=first_stage_rank)
    return tied


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    """Every rank starts from global rank 0's weights (before any split: plain tensors)."""
    for t in list(model.parameters()) + list(model.buffers()):
        torch_dist.broadcast(t.data, src=0)


# --------------------------------------------------------------------------- technique checks


def check_techniques(adapter: ModelAdapter, run: ResolvedRun) -> None:
    """Every technique the run asks for can be applied to this model, else a UserError
    (exit 2) naming what is possible. Runs before anything is wrapped."""
    policy = run.recompute
    if policy.kind != "none":
        adapter.require_blocks(f"recompute.policy {str(policy)!r} (--ac)")
    if policy.kind == "selective":
        _check_selective(adapter, policy.target)
    if run.zero_stage == 3:
        # ZeRO-3 gathers one unit at a time; without blocks the whole model is one unit and
        # the full parameters are gathered at once: no ZeRO-3 saving. (ZeRO-2 with the root as
        # its only unit still shards gradients and optimizer states, so it is allowed.)
        # Checked on one process too: the error is about the model, not the launch.
        adapter.require_blocks("parallel.zero_stage 3 (--zero 3, FSDP2 one unit per block)")
    if run.fp8:  # the blocks' Linears run in float8; the first and last layers, outside them, do not
        adapter.require_blocks("precision.fp8 (--fp8, float8 matmuls in the blocks)")
    if run.pp > 1:
        problem = pipeline_model_problem(run.pp, adapter.kind, adapter.hf_model_type)
        if problem:
            raise UserError(f"{problem} ({adapter.describe()})")


def _check_selective(adapter: ModelAdapter, target: str) -> None:
    """selective:mlp recomputes `block.mlp` (tenfold, Llama, GPT-2 blocks all have one);
    selective:attention needs a parameter-free attention core module (`block.attn.core`,
    tenfold's Block). Hugging Face blocks compute attention in a function, not a module."""
    block = adapter.blocks[0]
    if target == "mlp" and isinstance(getattr(block, "mlp", None), nn.Module):
        return
    attn = getattr(block, "attn", None)
    if target == "attention" and isinstance(getattr(attn, "core", None), nn.Module):
        return
    possible = ["full", "every:N", "segments:K"]
    if isinstance(getattr(block, "mlp", None), nn.Module):
        possible.insert(0, "selective:mlp")
    what = "a parameter-free attention core module `attn.core`" if target == "attention" else "an `mlp` submodule"
    raise UserError(
        f"recompute.policy selective:{target} (--ac) needs blocks with {what}; "
        f"{adapter.block_class} has none. Possible for this model: {', '.join(possible)}"
    )


def check_tensor_parallel(model: nn.Module, adapter: ModelAdapter, run: ResolvedRun, tp_plan: dict | None) -> None:
    """Under --tp N: the model has a plan (built in, or the user's) and the plan fits the model
    (every module it names exists, every split dimension divides by N, every parameter is
    covered). Runs on the whole, unsplit model. (tenfold.run checked the heads and that
    sequence parallelism can cut the sequences.)"""
    if run.tp <= 1:
        if tp_plan is not None:
            raise UserError("a tensor-parallel plan (tp_plan) was given but parallel.tp_degree (--tp) is 1")
        return
    plan = tp.plan_for(model, adapter.kind, run.sequence_parallel, tp_plan)
    if tp_plan is None:  # a user's plan may use patterns and keep modules replicated on purpose
        tp.check_plan(model, plan, run.tp)
