"""Tensor and sequence parallelism on PyTorch's DTensor (`parallelize_module`).

The Megatron-LM split (Shoeybi et al. 2019, section 3): in every block the query, key, value
and MLP up/gate projections are split by output column (`ColwiseParallel`: each tp rank
computes whole heads and a slice of the MLP's hidden units), the attention output and MLP
down projections by input row (`RowwiseParallel`), so a block needs one collective after
attention and one after the MLP, forward and backward. With sequence parallelism
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4.2.2) the norms and the residual stream between those collectives are split by
sequence position instead of replicated (`SequenceParallel` norms; the all-reduce becomes a
reduce-scatter, and an all-gather runs before the next column split), which divides their
activations by tp at the same communication volume.

The vocabulary is split too: the token embedding by rows (`VocabParallelEmbedding`, Megatron-LM's
VocabParallelEmbedding: each rank looks up the tokens of its own rows, zeroes the others', and
the partial outputs are summed by the same reduce-scatter or all-reduce as torch's
`RowwiseParallel`; its backward makes only this rank's rows of the weight's gradient, where
DTensor's embedding backward makes the whole (V, d) matrix on every rank and this rank then keeps
its rows) and the output projection by columns with its logits left sharded on the
vocabulary (`use_local_output=False`), and the cross-entropy runs under
`torch.distributed.tensor.parallel.loss_parallel`, so the (b, s, V) logits never exist whole on
one rank. `loss_context` enters it around forward + backward, as its documentation asks.

Plans, one per model family, keyed by module FQN (torchtitan's `apply_tp` for Llama 3 is the
model for the tenfold one):
  tenfold's GPT          tok_emb / pos_emb / layers.N.{norm1, attn.wq/wk/wv/wo, norm2, mlp.w1/w2/w3} / norm / output
  Hugging Face Llama,    model.embed_tokens / model.layers.N.{input_layernorm, self_attn.q/k/v/o_proj,
  Qwen2, Mistral         post_attention_layernorm, mlp.gate/up/down_proj} / model.norm / lm_head
  a user's module        the `tp_plan` given to `Trainer` ({FQN pattern: ParallelStyle})

Every parameter of a tenfold or Hugging Face model must be covered by the plan (split, or a
norm that stays replicated): a module the plan does not know is a UserError naming it, so a
model is never silently half-split. RoPE and GQA need nothing special: the attention code
views the projections as (..., -1, head_dim), so each rank sees its own whole heads and the
query-to-KV head ratio is unchanged (tenfold.terms.check_tp_split requires tp to divide both).

Hugging Face models compute the position ids and the causal mask from the embedding output's
length, so there the embedding's output stays replicated (an all-reduce) and the first block's
input is cut by sequence position locally (`PrepareModuleInput`, no communication); the rest
is the same as for tenfold's GPT.
"""

from __future__ import annotations

import contextlib
import types
from functools import partial
from typing import Any, ContextManager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel, loss_parallel,
    parallelize_module,
)

from tenfold.errors import UserError
from tenfold.models.moe import MoE
from tenfold.models.specs import spec_for

TP_FLAG = "parallel.tp_degree (--tp)"
KNOWN_MODELS = ("tenfold's GPT and Hugging Face Llama, Qwen2 or Mistral models (q/k/v/o_proj, gate/up/down_proj, "
                "embed_tokens, lm_head)")


# --------------------------------------------------------------------------- the vocabulary-parallel embedding


class VocabParallelEmbedding(ParallelStyle):
    """An `nn.Embedding` split by rows over the tp ranks (weight Shard(0)), its output handed on
    in `output_layout` (Shard(1): sequence shards, a reduce-scatter; Replicate(): an all-reduce)
    as a local tensor. Same forward as `RowwiseParallel` on an embedding; its backward keeps to
    this rank's rows (module docstring)."""

    def __init__(self, output_layout: Placement):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise UserError(f"{TP_FLAG}: the vocabulary-parallel split takes an nn.Embedding, not {type(module).__name__}")
        module.register_parameter("weight", nn.Parameter(
            distribute_tensor(module.weight.data, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
            requires_grad=module.weight.requires_grad))
        module.forward = types.MethodType(partial(_vocab_parallel_lookup, output_layout=self.output_layout), module)
        return module


def _vocab_parallel_lookup(module: nn.Embedding, ids: torch.Tensor, output_layout: Placement) -> torch.Tensor:
    """This rank's rows of the embedding for `ids` (zeros for the ids of other ranks' rows),
    summed over the tp ranks into `output_layout`."""
    weight = module.weight
    local = weight.to_local()
    mesh = weight.device_mesh
    start = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())  # Shard(0) splits rows as torch.chunk does
    ids = ids.to_local() if isinstance(ids, DTensor) else ids
    elsewhere = (ids < start) | (ids >= start + local.shape[0])
    pad = module.padding_idx
    local_pad = pad - start if pad is not None and start <= pad < start + local.shape[0] else None
    out = F.embedding((ids - start).masked_fill(elsewhere, 0), local, padding_idx=local_pad)
    out = out.masked_fill(elsewhere.unsqueeze(-1), 0.0)
    partial_sum = DTensor.from_local(out, mesh, [Partial()], run_check=False)
    return partial_sum.redistribute(placements=[output_layout]).to_local()


# --------------------------------------------------------------------------- plans


def _vocab_output(sequence_parallel: bool):
    """Output projection: columns (= vocabulary) split, logits left sharded for loss_parallel."""
    return ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                           output_layouts=Shard(-1), use_local_output=False)


def _block_plan(prefix: str, names: dict[str, str], sequence_parallel: bool, swiglu: bool,
                attn_input_by_keyword: str | None = None) -> dict:
    """One transformer block: `names` maps the roles (norm1, attn, q, k, v, o, norm2, mlp, up,
    gate, down) to the block's own submodule names. `attn_input_by_keyword`: the keyword the
    block passes its attention input by (Hugging Face: hidden_states), None: by position."""
    seq = Shard(1) if sequence_parallel else Replicate()
    p = lambda role: f"{prefix}.{names[role]}"  # noqa: E731
    plan: dict[str, Any] = {
        p("q"): ColwiseParallel(), p("k"): ColwiseParallel(), p("v"): ColwiseParallel(),
        p("o"): RowwiseParallel(output_layouts=seq),
        p("up"): ColwiseParallel(), p("down"): RowwiseParallel(output_layouts=seq),
        # Attention and MLP take their input as ONE replicated DTensor (all-gathered from the
        # sequence shards under SP): q/k/v (up/gate) then share it, and backward reduces their
        # summed input gradient once, not once per projection.
        p("attn"): _replicated_input(seq, attn_input_by_keyword, n_args=3),  # tenfold: (x, cos, sin)
        p("mlp"): _replicated_input(seq),
        # the norms see (b, s/tp, d) under SP; otherwise they stay replicated (covered, not split)
        p("norm1"): SequenceParallel() if sequence_parallel else None,
        p("norm2"): SequenceParallel() if sequence_parallel else None,
    }
    if swiglu:
        plan[p("gate")] = ColwiseParallel()
    return plan


def _replicated_input(layout, keyword: str | None = None, n_args: int = 1):
    """The module's first input (or its `keyword` input) made a replicated DTensor; any other
    positional inputs (tenfold's RoPE tables) are left alone."""
    if keyword is not None:
        return PrepareModuleInput(input_kwarg_layouts={keyword: layout},
                                  desired_input_kwarg_layouts={keyword: Replicate()})
    rest = (None,) * (n_args - 1)
    return PrepareModuleInput(input_layouts=(layout, *rest), desired_input_layouts=(Replicate(), *rest))


def gpt_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """tenfold's GPT (tenfold.models.gpt): torchtitan's Llama 3 plan under tenfold's names."""
    seq = Shard(1) if sequence_parallel else Replicate()
    names = {"norm1": "norm1", "attn": "attn", "q": "attn.wq", "k": "attn.wk", "v": "attn.wv", "o": "attn.wo",
             "norm2": "norm2", "mlp": "mlp", "up": "mlp.w1", "gate": "mlp.w3", "down": "mlp.w2"}
    swiglu = model.cfg.mlp == "swiglu"
    plan: dict[str, Any] = {}
    # A pipeline stage (tenfold.techniques.pipeline.GPTStage) holds only some of these.
    if getattr(model, "tok_emb", None) is not None:
        plan["tok_emb"] = VocabParallelEmbedding(seq)
    if getattr(model, "pos_emb", None) is not None:  # GPT.embed looks positions up as (1, s)
        plan["pos_emb"] = VocabParallelEmbedding(seq)
    for key in model.layers:
        block = _block_plan(f"layers.{key}", names, sequence_parallel, swiglu)
        if isinstance(model.layers[key].mlp, MoE):
            # a mixture-of-experts layer is not split by tp: every tp rank holds the router, the
            # shared experts and its ep share of the routed experts, and (no sequence
            # parallelism: checked by tenfold.capabilities) routes the same tokens as the others
            block = {k: v for k, v in block.items() if not k.startswith(f"layers.{key}.mlp")}
            block[f"layers.{key}.mlp"] = None  # covered, not split
        plan.update(block)
    if getattr(model, "norm", None) is not None:
        plan["norm"] = SequenceParallel() if sequence_parallel else None
    if getattr(model, "output", None) is not None:
        plan["output"] = _vocab_output(sequence_parallel)
    return plan


def hf_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """Hugging Face Llama-family causal LMs, by their module names (the names of transformers'
    own `base_model_tp_plan` for these models), or a pipeline stage of one (`HFStage`, which
    holds some of these modules under the same names)."""
    base, layers = _hf_parts(model)
    inner = getattr(model, base)
    # A stage computes positions and masks from its position_ids (techniques/pipeline_hf.py) and
    # may start at any block: its embedding, like tenfold's, hands on sequence shards itself.
    staged = isinstance(layers, nn.ModuleDict)
    seq = Shard(1) if sequence_parallel else Replicate()
    names = {"norm1": "input_layernorm", "attn": "self_attn", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
             "v": "self_attn.v_proj", "o": "self_attn.o_proj", "norm2": "post_attention_layernorm", "mlp": "mlp",
             "up": "mlp.up_proj", "gate": "mlp.gate_proj", "down": "mlp.down_proj"}
    plan: dict[str, Any] = {}
    if getattr(inner, "embed_tokens", None) is not None:
        # the full model computes position ids and the causal mask from the embedding output's length: keep it whole
        plan[f"{base}.embed_tokens"] = VocabParallelEmbedding(seq if staged else Replicate())
    for key in (layers.keys() if staged else range(len(layers))):
        plan.update(_block_plan(f"{base}.layers.{key}", names, sequence_parallel, swiglu=True,
                                attn_input_by_keyword="hidden_states"))
    if sequence_parallel and not staged:
        # the first block cuts its replicated input by sequence position (a local slice)
        plan[f"{base}.layers.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                      use_local_output=True)
    if getattr(inner, "norm", None) is not None:  # under SP lm_head slices its input
        plan[f"{base}.norm"] = SequenceParallel(use_local_output=True) if sequence_parallel else None
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = _vocab_output(sequence_parallel)
    return plan


def _hf_parts(model: nn.Module) -> tuple[str, nn.ModuleList | nn.ModuleDict]:
    """(FQN of the base model, its decoder layers): `model.layers` under `base_model_prefix`."""
    base = getattr(model, "base_model_prefix", "model") or "model"
    inner = getattr(model, base, None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)) or not hasattr(model, "lm_head"):
        raise _unmapped(model, f"{base}.layers" if inner is not None else base)
    return base, layers


def _unmapped(model: nn.Module, module: str, why: str = "not found") -> UserError:
    return UserError(
        f"{TP_FLAG}: cannot split {type(model).__name__}: module {module} {why}. Tensor parallelism knows "
        f"{KNOWN_MODELS}; for another model pass Trainer(tp_plan={{FQN: ParallelStyle}}) or use --tp 1"
    )


def plan_for(model: nn.Module, kind: str, sequence_parallel: bool, user_plan: dict | None = None) -> dict[str, Any]:
    """The plan for a model of `kind` (tenfold.models.adapter: "tenfold" | "hf" | "user")."""
    if user_plan is not None:
        return dict(user_plan)
    spec = spec_for(kind)
    if spec.builtin_tp_plan:
        return (hf_plan if spec.hugging_face else gpt_plan)(model, sequence_parallel)
    raise UserError(
        f"{TP_FLAG}: {type(model).__name__} is the user's own module and has no tensor-parallel plan; "
        "pass Trainer(model, tp_plan={'layers.*.attn.wq': ColwiseParallel(), ...}) or use --tp 1"
    )


# --------------------------------------------------------------------------- checks


def check_plan(model: nn.Module, plan: dict[str, Any], tp: int) -> None:
    """Before anything is split: every module the plan names exists, every split dimension
    divides by tp, and every parameter is covered (split, or a norm kept replicated)."""
    modules = dict(model.named_modules())
    for fqn, style in plan.items():
        module = modules.get(fqn)
        if module is None:
            raise _unmapped(model, fqn)
        _check_divisible(model, fqn, module, style, tp)
    covered = tuple(f"{fqn}." for fqn, style in plan.items() if not isinstance(style, PrepareModuleInput))
    for name, _ in model.named_parameters():
        if not name.startswith(covered):
            raise _unmapped(model, name.rsplit(".", 1)[0], "has parameters the plan does not split or replicate")


def _check_divisible(model: nn.Module, fqn: str, module: nn.Module, style: Any, tp: int) -> None:
    if isinstance(module, nn.Linear) and isinstance(style, (ColwiseParallel, RowwiseParallel)):
        size, what = ((module.out_features, "output features") if isinstance(style, ColwiseParallel)
                      else (module.in_features, "input features"))
        if size % tp:
            raise UserError(f"{TP_FLAG} {tp}: {type(model).__name__}.{fqn} has {size} {what}, not divisible by {tp}")


# --------------------------------------------------------------------------- applying


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, plan: dict[str, Any]) -> nn.Module:
    """Split `model` in place over `tp_mesh` (a 1-D DeviceMesh). Entries whose style is None
    are modules the plan keeps replicated."""
    shared = _shared_parameters(model)
    parallelize_module(model, tp_mesh, {fqn: style for fqn, style in plan.items() if style is not None})
    _retie(model, shared)
    return model


def _shared_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module FQN, parameter name) holding one Parameter: tied embeddings."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((fqn, name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(model: nn.Module, shared: list[list[tuple[str, str]]]) -> None:
    """parallelize_module gives each module its own DTensor copy of a shared weight; share one
    again. Tied embeddings split alike: the embedding's rows and the output's columns are both
    dim 0 of the (V, d) matrix. A weight the styles split differently cannot stay tied."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for group in shared:
        params = [getattr(modules[fqn], name) for fqn, name in group]
        layouts = {(str(getattr(p, "device_mesh", None)), tuple(getattr(p, "placements", ()))) for p in params}
        if len(layouts) > 1:
            where = ", ".join(f"{fqn}.{name}" for fqn, name in group)
            raise UserError(f"{TP_FLAG}: the tied weights {where} would be split differently; untie them or use --tp 1")
        for fqn, name in group[1:]:
            setattr(modules[fqn], name, params[0])


def loss_context(tp: int) -> ContextManager:
    """`loss_parallel()` when the logits are split over the vocabulary (forward AND backward
    must run inside it); a no-op without tensor parallelism."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def settle_gradients(params: list[nn.Parameter]) -> None:
    """Give each tensor-parallel gradient its parameter's layout, once per step before the
    optimizer. Autograd leaves a sequence-parallel norm's weight gradient Partial (each tp rank
    summed only its own sequence positions; Megatron-LM all-reduces these layer-norm gradients
    over the tp group too). Under FSDP2 the reduce-scatter does this itself; then every layout
    already matches."""
    for p in params:
        grad = p.grad
        if grad is not None and hasattr(grad, "placements") and hasattr(p, "placements"):
            if grad.placements != p.placements and grad.device_mesh == p.device_mesh:
                p.grad = grad.redistribute(p.device_mesh, p.placements)
