"""What `tenfold train` can run, written down once.

`tenfold plan --search` ranks only the strategies this table allows (`--include-unsupported`
adds the others, each with the reason it cannot run), and the engine checks every run against
the same table before it starts (`tenfold.run.resolve_run`), so what the planner recommends is
what train accepts, and what train refuses is refused for the reason written here.

The pipeline schedules' rules live here too: the planner needs them to skip a layout the
schedule cannot run, and must not import torch to get them.

No torch here: the planner reads this module on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenfold.errors import UserError
from tenfold.layout import shard_group_problem
from tenfold.lora_terms import nf4_shards, nf4_unshardable
from tenfold.models.hf_config import MOE_FAMILIES
from tenfold.models.specs import SPECS, spec_for  # torch-free
from tenfold.terms import MULTI_STAGE_SCHEDULES, OFFLOADS, PIPELINE_SCHEDULES, PRECISIONS, ZERO_STAGES

# Model kinds: tenfold's own GPT (a preset or a shape), a Hugging Face causal LM through the
# adapter (tenfold.models.hf), or a user's own module (Python API only).
MODEL_KINDS = tuple(SPECS)  # "tenfold", "hf", "user"


@dataclass(frozen=True)
class Capabilities:
    zero_stages: tuple[int, ...]
    pipeline_schedules: tuple[str, ...]
    recompute: tuple[str, ...]  # RecomputePolicy kinds
    precisions: tuple[str, ...]
    tensor_parallel: bool
    tensor_parallel_hf_types: tuple[str, ...]  # Hugging Face model_types with a built-in tensor-parallel plan
    offload: tuple[str, ...]  # ZeRO-Offload of optimizer states / parameters to host memory
    offload_zero_stages: tuple[int, ...]  # the stages an offload runs with (FSDP2's sharded states)
    hybrid_shard: bool  # HSDP: ZeRO-2/3 shard inside groups of dp ranks, replicate across them
    pipeline_models: tuple[str, ...]  # model kinds the pipeline split can cut
    pipeline_hf_types: tuple[str, ...]  # Hugging Face model_types the pipeline split can cut
    attention_core_models: tuple[str, ...]  # model kinds with a module selective:attention can wrap
    compile: bool  # torch.compile per transformer block (train.compile)
    compile_with_tp: bool  # ... of tensor-parallel (DTensor) blocks
    fp8_precisions: tuple[str, ...]  # precision.dtype values --fp8 runs on top of (float8 matmuls, torchao)
    fp8_with_tp: bool  # --fp8 with tensor parallelism
    lora_bases: tuple[str, ...]  # frozen bases under low-rank adapters (--lora, --qlora)
    lora_with_tp: bool  # adapters under tensor parallelism
    lora_with_fp8: bool  # adapters on float8 Linears
    lora_recompute: tuple[str, ...]  # recompute policies adapters run with
    nf4_offload: bool  # QLoRA's NF4 base with ZeRO-Offload
    context_parallel_models: tuple[str, ...] = ("tenfold", "hf")  # model kinds --cp splits (a cp attention)
    context_parallel_hf_types: tuple[str, ...] = ("llama",)  # Hugging Face model_types --cp splits
    context_parallel_with_compile: bool = False  # --cp with torch.compile


ENGINE = Capabilities(
    zero_stages=ZERO_STAGES,  # DDP, ZeroRedundancyOptimizer, FSDP2 (techniques/zero.py)
    pipeline_schedules=PIPELINE_SCHEDULES,  # torch.distributed.pipelining (techniques/pipeline.py)
    recompute=("none", "full", "every", "segments", "selective", "op", "offload"),
    precisions=PRECISIONS,
    # DTensor plans (techniques/tensor_parallel.py): tenfold's GPT, these Hugging Face families
    # by their module names (q/k/v/o_proj, gate/up/down_proj, embed_tokens, lm_head)
    tensor_parallel=True,
    tensor_parallel_hf_types=("llama", "mistral", "qwen2"),
    # techniques/offload.py: "optimizer" (DeepSpeed's offload_optimizer) keeps FSDP2's parameter
    # shards on the device and AdamW's states and step on the host (HostAdamW);
    # "optimizer+params" (offload_param, ZeRO-3 only) is FSDP2's CPUOffloadPolicy.
    offload=OFFLOADS,
    offload_zero_stages=(2, 3),
    # FSDP2 on a 2-D (replicate, shard) device mesh (techniques/zero.py, parallel.shard_group_size)
    hybrid_shard=True,
    # The split cuts by module name (tenfold.pipeline_layout.STAGE_NAMES): tenfold's GPT (tok_emb,
    # layers.N, norm, output) and these Hugging Face families (model.embed_tokens, model.layers.N,
    # model.norm, lm_head; techniques/pipeline_hf.py rebuilds their rotary tables and causal masks).
    pipeline_models=("tenfold", "hf"),
    pipeline_hf_types=("llama", "mistral", "qwen2"),
    # selective:attention wraps `block.attn.core`; Hugging Face blocks compute attention in a function.
    attention_core_models=("tenfold",),
    # Every model kind, with recompute, ZeRO and pipeline stages: each block is compiled after
    # recompute, before ZeRO (techniques/compile.py); a block dynamo cannot trace whole is
    # split, not refused.
    compile=True,
    # Compiled tp blocks fail in backward on torch 2.13 (DTensor's redistribute backward gets a
    # plain tensor from the compiled graph: "'Tensor' object has no attribute '_local_tensor'").
    compile_with_tp=False,
    # torchao's float8 training recipe, as torchtitan runs it: float8 matmuls inside bf16 autocast
    # over fp32 master weights (techniques/fp8.py). fp32 would keep every other op and the
    # embedding/head in fp32, which no published float8 recipe does; fp16 would stack a loss
    # scale on float8's own per-tensor scales (e5m2 gradients), which torchao does not support.
    fp8_precisions=("bf16",),
    # Float8Linears under tensor parallelism need torchao's float8 parallel styles
    # (Float8ColwiseParallel, ...), which tenfold's tensor-parallel plans do not use.
    fp8_with_tp=False,
    # PEFT's LoRA layers over a frozen base (techniques/lora.py), the base in the compute dtype or
    # in torchao's NF4 (techniques/nf4.py); ZeRO 0-3, pipelines, recompute, compile, HSDP and
    # offload wrap the converted model as they wrap any other.
    lora_bases=("compute", "nf4"),
    # The tensor-parallel plans split q/k/v/o and the MLP's Linears; an adapted Linear is PEFT's
    # wrapper around one, which needs its own styles (A beside a row-split weight split by rows,
    # B beside a column-split one by columns) that tenfold's plans do not have.
    lora_with_tp=False,
    # torchao's float8 conversion swaps nn.Linear for Float8Linear; PEFT adapts nn.Linear only.
    lora_with_fp8=False,
    # `op` keeps the outputs of a block's 1st, 3rd, 5th and 7th matmul; adapters add two matmuls
    # per adapted Linear, so the list would keep the wrong tensors.
    lora_recompute=("none", "full", "every", "segments", "selective", "offload"),
    # FSDP2's CPUOffloadPolicy all-gathers from a host copy whose output torchao's NF4Tensor does
    # not rebuild (`fsdp_post_all_gather`: "not enough values to unpack", torch 2.13, torchao 0.18).
    nf4_offload=False,
)


def problems(run, caps: Capabilities = ENGINE) -> list[str]:
    """Every reason `tenfold train` cannot do `run` (a tenfold.run.ResolvedRun); empty: it can."""
    out = _technique_problems(run, caps)
    cannot_split = pipeline_model_problem(run.pp, run.model_kind, run.hf_model_type, caps)
    if cannot_split:
        out.append(cannot_split)
    elif run.pp > 1 and run.pp_schedule in caps.pipeline_schedules:
        try:
            validate_pipeline(pp_size=run.pp, schedule=run.pp_schedule, n_microbatches=run.grad_accum,
                              dp_size=run.grad_ranks, zero_stage=run.zero_stage)
        except UserError as e:
            out.append(str(e))
    out += expert_parallel_problems(run) + moe_tensor_parallel_problems(run)
    departures = run.stack.departures()
    if departures:
        out.append(f"priced as another training stack ({', '.join(departures)}); tenfold train runs its own "
                   "(fp32 parameters under autocast, no dropout, flash attention, overlapped reduction)")
    return out


def expert_parallel_problems(run) -> list[str]:
    """What expert parallelism (parallel.ep_degree > 1) does not combine with in tenfold train."""
    if run.ep <= 1:
        return []
    flag = f"parallel.ep_degree (--ep) {run.ep}"
    out = []
    spec = spec_for(run.model_kind)
    if not (spec.own_moe_blocks or (spec.hugging_face and run.hf_model_type in MOE_FAMILIES)):
        what = f"Hugging Face model_type {run.hf_model_type!r}" if spec.hugging_face else f"{spec.label} model"
        out.append(f"{flag}: expert parallelism runs tenfold's MoE blocks (--model tiny-moe, mixtral-8x7b, ...) and "
                   f"the Hugging Face model_types {', '.join(MOE_FAMILIES)} (--hf-config / --hf-pretrained); "
                   f"a {what} trains with --ep 1")
    # beside a pipeline or tensor parallelism: tenfold's MoE blocks under ZeRO-0 or 3 (tests/test_expert_parallel.py);
    # both at once: moe_tensor_parallel_problems; a Hugging Face model under --pp: pipeline_model_problem
    if run.pp > 1 or run.tp > 1:
        other = " and ".join(f for f, n in (("--pp", run.pp), ("--tp", run.tp)) if n > 1)
        needs = []
        if run.tp > 1 and not spec.own_moe_blocks:
            needs.append(f"tenfold's MoE blocks (got a {spec.label} model"
                         f"{f' of model_type {run.hf_model_type!r}' if spec.hugging_face else ''})")
        if run.pp > 1 and run.pp_schedule != "1f1b":
            needs.append(f"--pp-schedule 1f1b (got {run.pp_schedule})")
        if run.zero_stage not in (0, 3):
            needs.append(f"--zero 0 or 3 (got {run.zero_stage})")
        if needs:
            out.append(f"{flag} with {other} needs {', '.join(needs)}")
    others = {"--zero 1": run.zero_stage == 1, "--offload": run.offload != "none",
              "--shard-group": bool(run.shard_group), "--lora/--qlora": run.lora is not None, "--fp8": run.fp8,
              "--compile": run.compile}
    refused = [name for name, on in others.items() if on]
    if refused:
        out.append(f"{flag} does not combine with {', '.join(refused)} in tenfold train; "
                   "it runs with --zero 0, 2 or 3 and any --ac (--zero 0 or 3 beside --pp or --tp)")
    return out


def moe_tensor_parallel_problems(run) -> list[str]:
    """Tensor parallelism on tenfold's MoE models: attention and the dense layers split over the
    tp ranks, each MoE layer whole on every tp rank (its routed experts split by --ep, if any),
    which therefore must see the same tokens: no sequence parallelism; no pipeline beside it."""
    if run.tp <= 1 or not spec_for(run.model_kind).own_moe_blocks or run.model is None or not run.model.is_moe:
        return []
    out = []
    if run.sequence_parallel:
        out.append(f"parallel.tp_degree (--tp) {run.tp} on a mixture-of-experts model runs each MoE layer whole on "
                   "every tp rank, on the same tokens: pass --no-sequence-parallel")
    if run.pp > 1:
        out.append(f"parallel.tp_degree (--tp) {run.tp} on a mixture-of-experts model runs without --pp "
                   f"(got --pp {run.pp})")
    return out


def pipeline_model_problem(pp: int, kind: str, hf_model_type: str = "", caps: Capabilities = ENGINE) -> str | None:
    """Why a model of `kind` (a Hugging Face one of `hf_model_type`) cannot be split into `pp`
    pipeline stages; None if it can."""
    if pp <= 1:
        return None
    allowed = (f"tenfold's GPT and Hugging Face model_types {', '.join(caps.pipeline_hf_types)} "
               "(model.embed_tokens, model.layers.N, model.norm, lm_head)")
    if spec_for(kind).hugging_face and kind in caps.pipeline_models and hf_model_type not in caps.pipeline_hf_types:
        return (f"parallel.pp_degree {pp} (--pp): the pipeline split cuts {allowed}; Hugging Face model_type "
                f"{hf_model_type or '(none)'!r} cannot be split. Use --pp 1 with --zero 0-3 and --ac")
    if kind not in caps.pipeline_models:
        return (f"parallel.pp_degree {pp} (--pp): the pipeline split cuts {allowed}; a {spec_for(kind).label} "
                "model cannot be split. Use --pp 1 with --zero 0-3 and --ac")
    return None


def _technique_problems(run, caps: Capabilities) -> list[str]:
    out = []
    if run.zero_stage not in caps.zero_stages:
        out.append(f"ZeRO stage {run.zero_stage}: tenfold train runs stages {', '.join(map(str, caps.zero_stages))}")
    if run.pp > 1 and run.pp_schedule not in caps.pipeline_schedules:
        out.append(f"pipeline schedule {run.pp_schedule!r}: tenfold train runs {', '.join(caps.pipeline_schedules)}")
    policy = run.recompute
    if policy.kind not in caps.recompute:
        out.append(f"recompute policy {policy.text!r}: tenfold train runs {', '.join(caps.recompute)}")
    if policy.kind == "selective" and policy.target == "attention" and run.model_kind not in caps.attention_core_models:
        out.append(
            "recompute.policy selective:attention (--ac) needs tenfold's attention core module (attn.core); "
            f"a {spec_for(run.model_kind).label} model's blocks compute attention in a function: use selective:mlp, full, "
            "every:N or segments:K"
        )
    if run.compile and run.tp > 1 and not caps.compile_with_tp:
        out.append(f"train.compile (--compile) with tensor parallelism (tp {run.tp}): tenfold train does not "
                   "compile tensor-parallel blocks; run --tp 1 with --compile, or --tp without --compile")
    if run.precision not in caps.precisions:
        out.append(f"precision {run.precision!r}: tenfold train runs {', '.join(caps.precisions)}")
    out += _fp8_problems(run, caps) + _lora_problems(run, caps)
    if run.tp > 1 and not caps.tensor_parallel:
        out.append(f"tensor parallelism (tp {run.tp}): tenfold train has no tensor parallelism")
    elif run.tp > 1 and spec_for(run.model_kind).hugging_face and run.hf_model_type not in caps.tensor_parallel_hf_types:
        out.append(
            f"parallel.tp_degree (--tp) {run.tp}: Hugging Face model_type {run.hf_model_type!r} has no "
            f"tensor-parallel plan; built in: {', '.join(caps.tensor_parallel_hf_types)} (and tenfold's own "
            "models); use --tp 1, or train it through the Python API with Trainer(tp_plan={FQN: ParallelStyle})"
        )
    return out + _sharding_problems(run, caps) + _context_parallel_problems(run, caps)


def _sharding_problems(run, caps: Capabilities) -> list[str]:
    """Hybrid sharding and offload: both are FSDP2 options, so both need ZeRO-2/3."""
    out = []
    n = run.shard_group
    if n is not None and not caps.hybrid_shard:
        out.append(f"parallel.shard_group_size {n} (--shard-group): tenfold train has no hybrid sharding")
    elif n is not None:
        if run.zero_stage not in (2, 3):
            out.append(f"parallel.shard_group_size {n} (--shard-group): hybrid sharding (FSDP2 on a (replicate, "
                       f"shard) mesh) needs --zero 2 or 3, got {run.zero_stage}")
        problem = shard_group_problem(run.dp, n)
        if problem:
            out.append(problem)
    off = run.offload
    if off not in caps.offload:
        out.append(f"parallel.offload {off!r} (--offload): tenfold train runs {', '.join(caps.offload)}")
    elif off != "none" and run.zero_stage not in caps.offload_zero_stages:
        out.append(f"parallel.offload {off!r} (--offload) offloads FSDP2's sharded states: needs --zero "
                   f"{' or '.join(map(str, caps.offload_zero_stages))}, got {run.zero_stage}")
    elif off == "optimizer+params" and run.zero_stage != 3:
        out.append("parallel.offload 'optimizer+params' (--offload) needs --zero 3 (only stage 3 partitions parameters); "
                   "use --offload optimizer with --zero 2")
    return out


def _context_parallel_problems(run, caps: Capabilities) -> list[str]:
    """Context parallelism swaps the blocks' attention for one across the cp ranks
    (techniques/context_parallel.py): models with a cp attention, eager blocks. Pipeline stages
    run it too (each cp rank's micro-batches are cut before the schedule, engine/loop/step.py)."""
    cp = getattr(run, "cp", 1)
    if cp <= 1:
        return []
    out = []
    if run.model_kind not in caps.context_parallel_models:
        names = " and ".join(spec_for(k).label for k in caps.context_parallel_models)
        out.append(f"parallel.cp_degree {cp} (--cp): context parallelism runs {names} models, not a "
                   f"{spec_for(run.model_kind).label} one; use --cp 1")
    elif spec_for(run.model_kind).hugging_face and run.hf_model_type not in caps.context_parallel_hf_types:
        out.append(f"parallel.cp_degree {cp} (--cp): Hugging Face model_type {run.hf_model_type!r} has no cp attention; "
                   f"built in: {', '.join(caps.context_parallel_hf_types)} (and tenfold's own models); use --cp 1")
    if run.compile and not caps.context_parallel_with_compile:
        out.append(f"parallel.cp_degree {cp} (--cp) with train.compile (--compile): the cp attention's collectives "
                   "run eagerly; drop --compile or use --cp 1")
    return out


def _fp8_problems(run, caps: Capabilities) -> list[str]:
    if not run.fp8:
        return []
    out = []
    if run.precision not in caps.fp8_precisions:
        out.append(f"precision.fp8 (--fp8) runs float8 matmuls inside {' or '.join(caps.fp8_precisions)} autocast "
                   f"(torchao's float8 training recipe), not with precision {run.precision!r}: use --precision "
                   f"{caps.fp8_precisions[0]} --fp8")
    if run.tp > 1 and not caps.fp8_with_tp:
        out.append(f"precision.fp8 (--fp8) with tensor parallelism (tp {run.tp}): float8 layers need torchao's float8 "
                   "tensor-parallel styles, which tenfold's plans do not use; run --fp8 with --tp 1 (ZeRO and --pp "
                   "compose with it)")
    return out


def _lora_problems(run, caps: Capabilities) -> list[str]:
    lora = run.lora
    if lora is None:
        return []
    out = []
    flag = "--qlora" if lora.base == "nf4" else "--lora"
    if lora.base not in caps.lora_bases:
        out.append(f"lora.base {lora.base!r}: tenfold train runs {', '.join(caps.lora_bases)}")
    if run.tp > 1 and not caps.lora_with_tp:
        out.append(f"lora.rank ({flag}) with tensor parallelism (tp {run.tp}): tenfold's tensor-parallel plans do not "
                   "split adapters; shard the frozen base with --zero 3 instead (FSDP2 shards base and adapters)")
    if run.fp8 and not caps.lora_with_fp8:
        out.append(f"lora.rank ({flag}) with precision.fp8 (--fp8): PEFT's adapters wrap nn.Linear, not torchao's "
                   "Float8Linear; train adapters without --fp8")
    known_shape = run.model is not None and spec_for(run.model_kind).architecture_known
    cut = nf4_unshardable(run.model, lora, nf4_shards(run)) if known_shape else []
    if cut:
        out.append(f"lora.base nf4 (--qlora) under ZeRO-2/3 over {nf4_shards(run)} ranks: FSDP2 would cut the "
                   f"{', '.join(cut)} weights inside NF4's 64 x 256-value groups; use fewer ranks per shard group "
                   "(--shard-group) or --zero 0/1")
    if lora.base == "nf4" and run.offload != "none" and not caps.nf4_offload:
        out.append(f"lora.base nf4 (--qlora) with parallel.offload {run.offload!r} (--offload): FSDP2's CPU offload "
                   "cannot gather torchao's NF4 weights; offload a 16-bit base (--lora) or keep the NF4 base on the device")
    if run.recompute.kind not in caps.lora_recompute:
        out.append(f"lora.rank ({flag}) with recompute.policy {run.recompute.text!r} (--ac): the per-op save list "
                   f"counts the base's matmuls, adapters add their own; use one of {', '.join(caps.lora_recompute)}")
    return out


def check(run, caps: Capabilities = ENGINE) -> None:
    """Refuse, as one line, a run `tenfold train` cannot do."""
    found = problems(run, caps)
    if found:
        raise UserError("; ".join(found))


# --------------------------------------------------------------------------- pipeline rules


def validate_pipeline(*, pp_size: int, schedule: str, n_microbatches: int, dp_size: int = 1,
                      zero_stage: int = 0) -> None:
    """What a pipelined run needs from torch.distributed.pipelining's schedules, as a UserError
    (exit 2) naming the field, the value and what is allowed. (The split itself, stages against
    layers and a given `pp_split`, is checked when the run is resolved: tenfold.terms.) Tied
    embeddings pipeline: the first and the last stage each keep a copy whose gradients are summed
    (techniques/tied_embeddings.py)."""
    if pp_size == 1:
        return
    _check_microbatches(schedule, pp_size, n_microbatches, dp_size, zero_stage)


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
    # `dp_size`: the ranks that reduce gradients together, dp x cp under context parallelism.
    if schedule == "zero-bubble" and dp_size > 1 and zero_stage <= 1:
        raise UserError(
            f"the zero-bubble schedule with data parallelism needs parallel.zero_stage 2 or 3 "
            f"(FSDP2), got {zero_stage} (DDP over {dp_size} ranks, dp x cp); use --zero 2/3 or --pp-schedule interleaved"
        )
