"""What `tenfold train` can run, written down once.

`tenfold plan --search` ranks only the strategies this table allows (`--include-unsupported`
adds the others, each with the reason it cannot run), and the engine checks every run against
the same table before it starts (`tenfold.run.resolve_run`), so what the planner recommends is
what train accepts, and what train refuses is refused for the reason written here.

The pipeline's rules live here too (they were the engine's own checks): the planner needs them
to skip a layout the schedule cannot run, and must not import torch to get them.

No torch here: the planner reads this module on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tenfold.errors import UserError
from tenfold.models.presets import ModelConfig
from tenfold.terms import MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES, PRECISIONS, RecomputePolicy

# Model kinds: tenfold's own GPT (a preset or a shape), a Hugging Face causal LM through the
# adapter (tenfold.models.hf), or a user's own module (Python API only).
MODEL_KINDS = ("tenfold", "hf", "user")
_KIND_NAMES = {"tenfold": "tenfold GPT", "hf": "Hugging Face", "user": "user's own"}


@dataclass(frozen=True)
class Capabilities:
    zero_stages: tuple[int, ...]
    pipeline_schedules: tuple[str, ...]
    recompute: tuple[str, ...]  # RecomputePolicy kinds
    precisions: tuple[str, ...]
    tensor_parallel: bool
    tensor_parallel_hf_types: tuple[str, ...]  # Hugging Face model_types with a built-in tensor-parallel plan
    offload: tuple[str, ...]  # ZeRO-Offload of optimizer states / parameters to host memory
    pipeline_models: tuple[str, ...]  # model kinds the pipeline split can cut
    attention_core_models: tuple[str, ...]  # model kinds with a module selective:attention can wrap
    compile: bool  # torch.compile per transformer block (train.compile)
    compile_with_tp: bool  # ... of tensor-parallel (DTensor) blocks


ENGINE = Capabilities(
    zero_stages=(0, 1, 2, 3),  # DDP, ZeroRedundancyOptimizer, FSDP2 (techniques/zero.py)
    pipeline_schedules=PIPELINE_SCHEDULES,  # torch.distributed.pipelining (techniques/pipeline.py)
    recompute=("none", "full", "every", "segments", "selective", "op", "offload"),
    precisions=PRECISIONS,
    # DTensor plans (techniques/tensor_parallel.py): tenfold's GPT, these Hugging Face families
    # by their module names (q/k/v/o_proj, gate/up/down_proj, embed_tokens, lm_head)
    tensor_parallel=True,
    tensor_parallel_hf_types=("llama", "mistral", "qwen2"),
    offload=("none",),
    # The split cuts tenfold's GPT by parameter name (tok_emb, layers.N, norm, output).
    pipeline_models=("tenfold",),
    # selective:attention wraps `block.attn.core`; Hugging Face blocks compute attention in a function.
    attention_core_models=("tenfold",),
    # Every model kind, with recompute, ZeRO and pipeline stages: each block is compiled after
    # recompute, before ZeRO (techniques/compile.py); a block dynamo cannot trace whole is
    # split, not refused.
    compile=True,
    # Compiled tp blocks fail in backward on torch 2.13 (DTensor's redistribute backward gets a
    # plain tensor from the compiled graph: "'Tensor' object has no attribute '_local_tensor'").
    compile_with_tp=False,
)


@dataclass(frozen=True)
class Layout:
    """A run as the table judges it: the model, the process layout and the techniques."""

    model: ModelConfig
    world_size: int
    pp: int
    zero: int
    recompute: RecomputePolicy
    precision: str
    micro_batches: int  # per optimizer step (the pipeline schedule's m)
    schedule: str = "1f1b"
    virtual_stages: int = 1
    tp: int = 1
    offload: str = "none"
    model_kind: str = "tenfold"
    pp_split: tuple[int, ...] | None = None
    hf_model_type: str = ""  # a Hugging Face model's config.json model_type
    compile: bool = False  # train.compile


def problems(layout: Layout, caps: Capabilities = ENGINE) -> list[str]:
    """Every reason `tenfold train` cannot run `layout` (empty: it can)."""
    out = _technique_problems(layout, caps)
    if layout.pp > 1 and layout.model_kind not in caps.pipeline_models:
        out.append(
            f"parallel.pp_degree {layout.pp} (--pp): the pipeline split cuts tenfold's GPT by parameter "
            f"name (tok_emb, layers.N, norm, output); a {_KIND_NAMES[layout.model_kind]} model cannot be split. "
            "Use --pp 1 with --zero 0-3 and --ac"
        )
    elif layout.schedule in caps.pipeline_schedules:
        try:
            validate_pipeline(
                n_layers=layout.model.n_layers, world_size=layout.world_size // layout.tp, pp_size=layout.pp,
                schedule=layout.schedule, virtual_stages=layout.virtual_stages, n_microbatches=layout.micro_batches,
                pp_split=layout.pp_split, tie_embeddings=layout.model.tie_embeddings, zero_stage=layout.zero,
            )
        except UserError as e:
            out.append(str(e))
    return out


def _technique_problems(layout: Layout, caps: Capabilities) -> list[str]:
    out = []
    if layout.zero not in caps.zero_stages:
        out.append(f"ZeRO stage {layout.zero}: tenfold train runs stages {', '.join(map(str, caps.zero_stages))}")
    if layout.pp > 1 and layout.schedule not in caps.pipeline_schedules:
        out.append(f"pipeline schedule {layout.schedule!r}: tenfold train runs {', '.join(caps.pipeline_schedules)}")
    policy = layout.recompute
    if policy.kind not in caps.recompute:
        out.append(f"recompute policy {policy.text!r}: tenfold train runs {', '.join(caps.recompute)}")
    if policy.kind == "selective" and policy.target == "attention" and layout.model_kind not in caps.attention_core_models:
        out.append(
            "recompute.policy selective:attention (--ac) needs tenfold's attention core module (attn.core); "
            f"a {_KIND_NAMES[layout.model_kind]} model's blocks compute attention in a function: use selective:mlp, full, "
            "every:N or segments:K"
        )
    if layout.compile and layout.tp > 1 and not caps.compile_with_tp:
        out.append(f"train.compile (--compile) with tensor parallelism (tp {layout.tp}): tenfold train does not "
                   "compile tensor-parallel blocks; run --tp 1 with --compile, or --tp without --compile")
    if layout.precision not in caps.precisions:
        out.append(f"precision {layout.precision!r}: tenfold train runs {', '.join(caps.precisions)}")
    if layout.tp > 1 and not caps.tensor_parallel:
        out.append(f"tensor parallelism (tp {layout.tp}): tenfold train has no tensor parallelism")
    elif layout.tp > 1 and layout.model_kind == "hf" and layout.hf_model_type not in caps.tensor_parallel_hf_types:
        out.append(
            f"parallel.tp_degree (--tp) {layout.tp}: Hugging Face model_type {layout.hf_model_type!r} has no "
            f"tensor-parallel plan; built in: {', '.join(caps.tensor_parallel_hf_types)} (and tenfold's own "
            "models); use --tp 1, or train it through the Python API with Trainer(tp_plan={FQN: ParallelStyle})"
        )
    if layout.offload not in caps.offload:
        out.append(f"offload {layout.offload!r}: tenfold train keeps optimizer states and parameters on the device")
    return out


def check(layout: Layout, caps: Capabilities = ENGINE) -> None:
    """Refuse, as one line, a run `tenfold train` cannot do."""
    found = problems(layout, caps)
    if found:
        raise UserError("; ".join(found))


# --------------------------------------------------------------------------- pipeline rules


def num_stages(pp_size: int, schedule: str, virtual_stages: int) -> int:
    """Total pipeline stages: P for single-stage schedules, P*V for interleaved ones."""
    return pp_size * (virtual_stages if schedule in MULTI_STAGE_SCHEDULES else 1)


def validate_pipeline(
    *,
    n_layers: int,
    world_size: int,
    pp_size: int,
    schedule: str,
    virtual_stages: int,
    n_microbatches: int,
    pp_split: Sequence[int] | None = None,
    tie_embeddings: bool = False,
    zero_stage: int = 0,
) -> None:
    """Every way a pipeline config can be wrong, as a `UserError` (exit 2) naming the field,
    the value and what is allowed, before any process group or model is touched."""
    if schedule not in PIPELINE_SCHEDULES:
        raise UserError(
            f"parallel.pp_schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}"
        )
    check_pp_degree(pp_size, world_size)
    if virtual_stages < 1:
        raise UserError(f"parallel.virtual_stages must be >= 1, got {virtual_stages}")
    if virtual_stages > 1 and schedule not in MULTI_STAGE_SCHEDULES:
        raise UserError(
            f"parallel.virtual_stages={virtual_stages} needs an interleaved schedule "
            f"({' or '.join(MULTI_STAGE_SCHEDULES)}); parallel.pp_schedule is {schedule!r}"
        )
    if pp_size == 1:
        return
    if tie_embeddings:
        raise UserError(
            "model.tie_embeddings=true cannot be pipelined: the embedding (first stage) and the "
            "output head (last stage) would share one weight across ranks; set "
            "model.tie_embeddings=false or use --pp 1"
        )
    stages = num_stages(pp_size, schedule, virtual_stages)
    if stages > n_layers:
        raise UserError(
            f"{stages} pipeline stages (parallel.pp_degree={pp_size} x virtual_stages="
            f"{virtual_stages if schedule in MULTI_STAGE_SCHEDULES else 1}) is more than the "
            f"model's {n_layers} layers; use fewer stages"
        )
    if pp_split is not None:
        check_manual_split(pp_split, stages, n_layers)
    _check_microbatches(schedule, pp_size, n_microbatches, world_size // pp_size, zero_stage)


def _check_microbatches(schedule: str, pp_size: int, n_microbatches: int, dp_size: int, zero_stage: int) -> None:
    # Every stage must see every micro-batch at least once per step, otherwise the
    # schedule deadlocks or idles (torch's Schedule1F1B raises for m < P itself).
    if n_microbatches < pp_size:
        raise UserError(
            f"pipeline needs at least as many micro-batches per step as stages: "
            f"train.grad_accum={n_microbatches} < parallel.pp_degree={pp_size}; "
            f"raise --grad-accum to >= {pp_size}"
        )
    # The interleaved schedules run in rounds of P micro-batches (torch: m % rounds == 0,
    # rounds = m // P); we ask for the simpler sufficient rule m % P == 0.
    if schedule in MULTI_STAGE_SCHEDULES and n_microbatches % pp_size:
        raise UserError(
            f"the {schedule} schedule needs train.grad_accum ({n_microbatches}) to be a multiple "
            f"of parallel.pp_degree ({pp_size})"
        )
    # Zero-bubble computes weight gradients in separate W passes after the input-gradient
    # pass that DDP's reducer takes as the last backward: DDP all-reduces before the last
    # W passes have accumulated (measured: the loss drifts 5e-3 from one process by step 2
    # on tiny, torch 2.13). FSDP2 reduces in the schedule's explicit REDUCE_GRAD action.
    if schedule == "zero-bubble" and dp_size > 1 and zero_stage <= 1:
        raise UserError(
            f"the zero-bubble schedule with data parallelism needs parallel.zero_stage 2 or 3 "
            f"(FSDP2), got {zero_stage} (DDP); use --zero 2/3 or --pp-schedule interleaved"
        )


def check_pp_degree(pp_size: int, world_size: int) -> None:
    if pp_size < 1:
        raise UserError(f"parallel.pp_degree must be >= 1, got {pp_size}")
    if world_size % pp_size:
        raise UserError(
            f"parallel.pp_degree ({pp_size}) must divide the number of processes ({world_size}); "
            f"world = pp x dp, so use --pp in {divisors(world_size)} or change --nproc"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_manual_split(pp_split: Sequence[int], stages: int, n_layers: int) -> None:
    if len(pp_split) != stages:
        raise UserError(
            f"parallel.pp_split has {len(pp_split)} entries but there are {stages} stages; "
            f"give one block count per stage"
        )
    if any(n < 0 for n in pp_split) or sum(pp_split) != n_layers:
        raise UserError(
            f"parallel.pp_split {list(pp_split)} must be non-negative block counts summing to "
            f"model.n_layers ({n_layers})"
        )
    if any(n == 0 for n in pp_split[1:-1]):
        raise UserError(
            f"parallel.pp_split {list(pp_split)}: a middle stage with no blocks would do no "
            f"work; only the first (embedding) and last (head) stage may have 0 blocks"
        )
