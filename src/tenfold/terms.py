"""The words the planner and the engine share, defined once.

`tenfold plan` predicts the run that `tenfold train` does, so both must read a recompute
policy, a batch triplet, a pipeline schedule and a precision name the same way. Each of those
is defined here and nowhere else: the planner counts the recomputed blocks with
`RecomputePolicy.checkpointed_blocks`, and the engine wraps exactly those blocks.

No torch here: the planner runs on a laptop without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tenfold import host
from tenfold.errors import UserError

# Label of a position without a target (padding, a fine-tuning prompt): no loss, not counted.
IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index

# --------------------------------------------------------------------------- precision

PRECISIONS = ("fp32", "bf16", "fp16")
# torch attribute names of each precision (torch.float32, ...), for the modules that import torch.
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}


def element_bytes(precision: str) -> float:
    """Bytes of one activation or gathered-parameter element when computing in `precision`
    (fp32, or the 16-bit autocast dtype): the one figure the planner's memory and time terms use."""
    return float(BYTES_PER_ELEMENT[precision])


def check_precision(name: str) -> str:
    if name not in PRECISIONS:
        raise UserError(f"invalid precision {name!r}; allowed: {', '.join(PRECISIONS)}")
    return name


# `precision.dtype = "auto"` (the default) picks one of PRECISIONS by where the run computes.
PRECISION_CHOICES = ("auto", *PRECISIONS)
DEFAULT_PRECISION = "auto"  # precision.dtype unset: `resolve_precision` picks for the device
def resolve_precision(name: str, on_cpu: bool, fp8: bool = False) -> str:
    """`auto` -> bf16 on a GPU, on a CPU with bf16 matrix instructions and under FP8 (whose
    matmuls run inside bf16 autocast), fp32 on other CPUs; any other name as given."""
    if name == "auto":
        return "bf16" if fp8 or host.bf16_pays(on_cpu) else "fp32"
    return check_precision(name)


# --------------------------------------------------------------------------- recompute

RECOMPUTE_FORMS = (
    "none, full, every:N, segments:K, selective, selective:attention, selective:mlp, op, offload "
    "(N, K positive integers)"
)
# Policies that wrap whole blocks in torch.utils.checkpoint (the others keep every block's
# forward: selective recomputes a part of each block, offload recomputes nothing).
BLOCK_POLICIES = ("full", "every", "segments")


@dataclass(frozen=True)
class RecomputePolicy:
    """A parsed `--ac` / `[recompute] policy`.

    none          keep every activation
    full          checkpoint every block (only block inputs are kept)
    every:N       checkpoint one block in N: blocks N-1, 2N-1, ... (torchtitan's layer AC,
                  `selective_ac_option="N"`)
    segments:K    K runs of consecutive blocks, sizes differing by at most one, the first runs
                  taking the extra blocks; every run but the last is checkpointed as one unit
                  (`torch.utils.checkpoint.checkpoint_sequential`: the last segment's backward
                  starts right after its forward, so checkpointing it would save nothing)
    selective     = selective:attention, recompute the parameter-free attention core
                  softmax(QK^T)V (Korthikanti et al. 2022, "Reducing Activation Recomputation
                  in Large Transformer Models", section 4.3); selective:mlp recomputes the MLP
    op            per-op selective (torchtitan's `selective_ac_option="op"`): every block runs
                  under one checkpoint that keeps the outputs of its 1st, 3rd, 5th, ... matmul,
                  of attention (SDPA) and of reduce-scatters, and recomputes everything else
                  (for tenfold's GPT: `op_saved_tensors`)
    offload       keep every activation, in pinned host memory
    """

    kind: str  # "none" | "full" | "every" | "segments" | "selective" | "op" | "offload"
    n: int = 0  # N of every:N, K of segments:K
    target: str = ""  # "attention" | "mlp" for selective

    def __str__(self) -> str:
        if self.kind in ("every", "segments"):
            return f"{self.kind}:{self.n}"
        if self.kind == "selective":
            return f"selective:{self.target}"
        return self.kind

    @property
    def text(self) -> str:
        return str(self)

    @property
    def wraps_blocks(self) -> bool:
        return self.kind in BLOCK_POLICIES

    def checkpointed_blocks(self, n_blocks: int) -> list[list[int]]:
        """Groups of block indices run as one checkpointed unit: `full` on 3 -> [[0], [1], [2]];
        `every:2` on 4 -> [[1], [3]]; `segments:2` on 5 -> [[0, 1, 2]]. `op` checkpoints every
        block as `full` does, but its recompute runs only the ops whose outputs it did not keep."""
        if self.kind in ("full", "op"):
            return [[i] for i in range(n_blocks)]
        if self.kind == "every":
            return [[i] for i in range(n_blocks) if (i + 1) % self.n == 0]
        if self.kind == "segments":
            return [seg for seg in split_segments(n_blocks, self.n)[:-1] if seg]
        return []

    def recomputed_blocks(self, n_blocks: int) -> list[int]:
        """Indices of the blocks whose forward runs twice."""
        return [i for group in self.checkpointed_blocks(n_blocks) for i in group]


def split_segments(n_blocks: int, k: int) -> list[list[int]]:
    """range(n_blocks) cut into min(k, n_blocks) runs of consecutive indices whose sizes differ
    by at most one, the first runs taking the extra block."""
    k = max(1, min(k, n_blocks))
    base, extra = divmod(n_blocks, k)
    out, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


class OpSaved(NamedTuple):
    """One tensor `--ac op` keeps per block of tenfold's GPT until that block's backward."""

    name: str
    per_token: float  # elements per token on one rank
    fp32: bool  # always 4 bytes per element; otherwise the compute dtype's (2 under autocast, 4 in fp32)


def op_saved_tensors(model, tp: int = 1, sequence_parallel: bool = False) -> tuple[OpSaved, ...]:
    """What per-op selective recompute (`op`) keeps of one block of tenfold's GPT
    (models/gpt.py), per token: the outputs of the 1st, 3rd, 5th and 7th of its matmuls, which
    run in the order wq, wk, wv, wo, w1, (w3,) w2, and of attention; under sequence
    parallelism also the two reduce-scatters. `model` is a ModelConfig. Besides these the
    checkpoint keeps the block's input, as `full` does (the fp32 residual stream: 4 x d_model
    bytes per token, divided by tp under sequence parallelism).

    Under tensor parallelism each rank keeps its shard of the column-split outputs, and the
    row-split w2's full-width partial sum (the matmul output before its all-reduce or
    reduce-scatter)."""
    h, kv, f, a = model.d_model, model.kv_heads * model.head_dim, model.active_ffn_dim, model.n_heads
    out = [
        OpSaved("wq output", h / tp, False),  # matmul 1
        OpSaved("wv output", kv / tp, False),  # matmul 3
        OpSaved("attention output", h / tp, False),
        OpSaved("attention logsumexp", a / tp, True),
        OpSaved("w1 output", f / tp, False),  # matmul 5
    ]
    if model.mlp == "swiglu":  # 7 matmuls: w2 is the 7th (a GELU MLP's w2 is the 6th, recomputed)
        out.append(OpSaved("w2 output", float(h), False))
    if tp > 1 and sequence_parallel:
        out += [OpSaved("wo reduce-scatter output", h / tp, False), OpSaved("w2 reduce-scatter output", h / tp, False)]
    return tuple(out)


def _bad_policy(text: str, why: str = "") -> UserError:
    extra = f" ({why})" if why else ""
    return UserError(f"invalid recompute policy (--ac) {text!r}{extra}; allowed: {RECOMPUTE_FORMS}")


def parse_recompute(text: str | RecomputePolicy | None) -> RecomputePolicy:
    """`none | full | every:N | segments:K | selective[:attention|:mlp] | op | offload` (case and
    surrounding spaces ignored; None means none)."""
    if isinstance(text, RecomputePolicy):
        return text
    if text is None:
        return RecomputePolicy("none")
    if not isinstance(text, str):
        raise _bad_policy(repr(text), "not a string")
    raw = text.strip().lower()
    if raw in ("none", "full", "op", "offload"):
        return RecomputePolicy(raw)
    if raw in ("selective", "selective:attention"):
        return RecomputePolicy("selective", target="attention")
    if raw == "selective:mlp":
        return RecomputePolicy("selective", target="mlp")
    head, sep, arg = raw.partition(":")
    if sep and head in ("every", "segments"):
        if not arg.isdigit() or int(arg) <= 0:
            raise _bad_policy(text, f"{head}: needs a positive integer, got {arg!r}")
        return RecomputePolicy(head, n=int(arg))
    raise _bad_policy(text)


# --------------------------------------------------------------------------- batch

DEFAULT_MICRO_BATCH = 8  # sequences per micro-batch per rank when neither it nor the global batch is given


class BatchTriplet(NamedTuple):
    micro_batch: int  # sequences per micro-batch per data-parallel rank
    grad_accum: int  # micro-batches per optimizer step
    global_batch: int  # sequences per optimizer step, all ranks: micro x accum x dp


def resolve_batch(micro: int | None, accum: int | None, global_batch: int | None, dp: int,
                  pp: int = 1, rounds_of_pp: bool = False) -> BatchTriplet:
    """`global = micro x accum x dp` (DeepSpeed's `train_batch_size = train_micro_batch_size_per_gpu
    x gradient_accumulation_steps x world size`): any two give the third. Fewer than two: the
    micro-batch defaults to 8 sequences, or with only the global batch given, to the largest
    divisor of global / dp up to 8, and accumulation makes up the rest; no accumulation when
    nothing but the micro-batch is given. Under a pipeline of `pp` stages the derived micro-batch
    leaves at least `pp` micro-batches per step (a multiple of `pp` with `rounds_of_pp`, as the
    interleaved schedules run them) where the global batch allows it."""
    for name, v in (("micro_batch", micro), ("grad_accum", accum), ("global_batch", global_batch)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise UserError(f"{_flag(name)} must be a positive integer, got {v!r}")
    if global_batch is None:
        micro = micro or DEFAULT_MICRO_BATCH
        accum = accum or 1
        return BatchTriplet(micro, accum, micro * accum * dp)
    if micro is None and accum is None:
        micro = _default_micro_batch(_exact_quotient(global_batch, dp, "the data-parallel size"), pp, rounds_of_pp)
    if micro is None:
        micro = _exact_quotient(global_batch, accum * dp, f"--grad-accum x data-parallel size = {accum} x {dp}")
    elif accum is None:
        accum = _exact_quotient(global_batch, micro * dp, f"--micro-batch x data-parallel size = {micro} x {dp}")
    if global_batch != micro * accum * dp:
        raise UserError(
            f"{_flag('global_batch')} {global_batch} must equal --micro-batch x --grad-accum x data-parallel size "
            f"= {micro} x {accum} x {dp} = {micro * accum * dp}; give two of the three and tenfold derives the third"
        )
    return BatchTriplet(micro, accum, global_batch)


def _default_micro_batch(per_rank: int, pp: int, rounds_of_pp: bool) -> int:
    """The largest divisor of the per-rank batch up to 8, preferring one that gives a pipeline
    of `pp` stages the micro-batches its schedule needs (else the pipeline check names them)."""
    divisors = [d for d in range(1, min(DEFAULT_MICRO_BATCH, per_rank) + 1) if per_rank % d == 0]
    feeds = [d for d in divisors if per_rank // d >= pp and not (rounds_of_pp and (per_rank // d) % pp)]
    return max(feeds or divisors)


def _exact_quotient(total: int, divisor: int, what: str) -> int:
    if total % divisor:
        raise UserError(f"{_flag('global_batch')} {total} must be a multiple of {what} = {divisor}")
    return total // divisor


def _flag(key: str) -> str:
    """`global_batch` -> `--global-batch (train.global_batch)`: errors name both spellings."""
    return f"--{key.replace('_', '-')} (train.{key})"


# --------------------------------------------------------------------------- pipeline

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
# Schedules that give each rank several (virtual) stages: torch.distributed.pipelining's
# ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble.
MULTI_STAGE_SCHEDULES = ("interleaved", "zero-bubble")
DEFAULT_PIPELINE_SCHEDULE = "1f1b"


def check_schedule(name: str) -> str:
    if name not in PIPELINE_SCHEDULES:
        raise UserError(f"invalid pipeline schedule {name!r}; allowed: {', '.join(PIPELINE_SCHEDULES)}")
    return name


def num_stages(pp_size: int, schedule: str, virtual_stages: int) -> int:
    """Total pipeline stages: P for single-stage schedules, P*V for interleaved ones."""
    return pp_size * (virtual_stages if schedule in MULTI_STAGE_SCHEDULES else 1)


def layer_counts(n_layers: int, stages: int, input_weight: int = 1, output_weight: int = 1) -> list[int]:
    """Blocks per stage with the embedding and the head weighted as `input_weight` and
    `output_weight` layers (torchtitan `generate_llm_fqn_per_model_part`): the
    L + w_in + w_out "effective layers" are cut into equal parts, earlier stages taking
    the remainder, and the first/last stage give up w_in/w_out of their share."""
    if stages == 1:
        return [n_layers]
    effective = n_layers + input_weight + output_weight
    per_stage, extra = divmod(effective, stages)
    if per_stage < max(input_weight, output_weight):
        raise UserError(
            f"cannot split {n_layers} layers into {stages} stages with the embedding and head "
            f"weighted as layers; use fewer stages or --pp-split"
        )
    counts, left = [], n_layers
    for s in range(stages):
        share = per_stage + (1 if s < extra else 0)
        if s == 0:
            share -= input_weight
        if s == stages - 1:
            share -= output_weight
        take = min(share, left) if s < stages - 1 else left
        counts.append(take)
        left -= take
    return counts


def check_manual_split(pp_split, stages: int, n_layers: int) -> None:
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


def stage_layer_counts(n_layers: int, stages: int, pp_split=None) -> tuple[int, ...]:
    """Blocks per pipeline stage: `pp_split` when given (checked), else `layer_counts`. The
    engine cuts the model by this list and the planner prices each rank's share of it."""
    if stages > n_layers and stages > 1:
        raise UserError(
            f"{stages} pipeline stages is more than the model's {n_layers} layers; use fewer stages "
            "(parallel.pp_degree x virtual_stages)"
        )
    if pp_split is not None:
        check_manual_split(pp_split, stages, n_layers)
        return tuple(pp_split)
    return tuple(layer_counts(n_layers, stages))


def local_stage_ids(pp_rank: int, pp_size: int, n_stages: int) -> list[int]:
    """Looped placement: rank r runs stages r, r+P, ... (Megatron's interleaving)."""
    return list(range(pp_rank, n_stages, pp_size))


def virtual_stages_for(schedule: str, requested: int | None) -> int:
    """Stages per rank: 1 for single-stage schedules; for interleaved ones the requested number,
    2 when none is given (the least that interleaves)."""
    if schedule not in MULTI_STAGE_SCHEDULES:
        if requested not in (None, 1):
            raise UserError(
                f"parallel.virtual_stages={requested} needs an interleaved schedule "
                f"({' or '.join(MULTI_STAGE_SCHEDULES)}); parallel.pp_schedule is {schedule!r}"
            )
        return 1
    if requested is not None and (isinstance(requested, bool) or requested < 1):
        raise UserError(f"virtual_stages must be a positive integer, got {requested!r}")
    return requested or 2


# --------------------------------------------------------------------------- ZeRO

ZERO_STAGES = (0, 1, 2, 3)  # Rajbhandari et al. 2020: P_os (1), P_os+g (2), P_os+g+p (3)
# ZeRO-Offload (Ren et al. 2021): what lives in host memory. "optimizer": optimizer states and
# master weights (and the optimizer step runs on the host); "optimizer+params": parameters too.
OFFLOADS = ("none", "optimizer", "optimizer+params")
REDUCE_DTYPES = ("fp32", "bf16")  # parallel.reduce_dtype: the dtype data-parallel gradients are reduced in
# torch DDP's default gradient bucket (DistributedDataParallel bucket_cap_mb=25): what DDP holds in
# flight, and the unit size ZeRO-2 groups blocks to on CPU (techniques/zero.py unit_bucket)
DDP_BUCKET_BYTES = 25 * 2**20
# ZeRO-2's FSDP2 unit on a CPU (gloo): blocks grouped up to torch DDP's default bucket, in fp32 gradient
# elements (tenfold.techniques.zero.unit_bucket)
CPU_UNIT_BUCKET = DDP_BUCKET_BYTES // 4


def zero_runs_as(zero_stage: int, tp: int, dp: int, offload: str = "none") -> int:
    """The ZeRO stage whose memory and traffic a run really has. Under tensor parallelism the
    parameters are DTensors, which DDP and ZeroRedundancyOptimizer do not take, so ZeRO-1 runs
    on FSDP2 like stage 2 (reducing once per step): its gradients are 1/N at the optimizer
    step too. With one data-parallel rank nothing is sharded at any stage, unless it offloads
    (FSDP2 on a mesh of one rank moves the states to the host: ZeRO-Offload's one-GPU case)."""
    if dp <= 1 and offload == "none":
        return 0
    return 2 if zero_stage == 1 and tp > 1 else zero_stage


def runs_on_fsdp2(zero_stage: int, tp: int, dp: int, offload: str = "none") -> bool:
    """Whether the engine wraps the model with FSDP2's machinery (ZeRO-2/3; every stage under
    tensor parallelism, `replicate` at ZeRO-0), whose MixedPrecisionPolicy runs the forward on
    16-bit copies of the parameters: the embedding's output and so the residual stream, the
    pipeline's boundary tensors and the checkpointed block inputs are 16-bit. DDP (ZeRO-0/1
    without TP) and one data-parallel rank keep fp32 parameters under autocast."""
    wrapped = dp > 1 or offload != "none"
    return wrapped and (zero_runs_as(zero_stage, tp, dp, offload) >= 2 or tp > 1)


# --------------------------------------------------------------------------- tensor parallelism


def tp_choices(n_heads: int, n_kv_heads: int | None = None, vocab_size: int | None = None) -> list[int]:
    """Tensor-parallel sizes that split the query heads, the key/value heads and the vocabulary
    evenly: the column split of q/k/v gives each rank whole heads (Megatron-LM, Shoeybi et al.
    2019 section 3), GQA's key/value heads are split, not copied, and the embedding and output
    layer are split by token (tenfold.techniques.tensor_parallel). `vocab_size` None: a model
    whose vocabulary is not split (a user's own module)."""
    kv = n_kv_heads or n_heads
    return [t for t in range(1, n_heads + 1) if n_heads % t == 0 and kv % t == 0 and (not vocab_size or vocab_size % t == 0)]


def check_tp_split(tp: int, n_heads: int, n_kv_heads: int | None = None, vocab_size: int | None = None,
                   flag: str = "--tp") -> None:
    """The one rule `tenfold train` and `tenfold plan` apply to a tensor-parallel degree: it
    must divide the query heads, the key/value heads (Megatron refuses the same) and the
    vocabulary (the engine splits the embedding's rows and the output's columns)."""
    kv = n_kv_heads or n_heads
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise UserError(f"{flag} must be a positive integer, got {tp!r}")
    allowed = ", ".join(str(t) for t in tp_choices(n_heads, kv, vocab_size))
    if n_heads % tp or kv % tp:
        heads = f"the {n_heads} query heads" + (f" and the {kv} key/value heads" if kv != n_heads else "")
        raise UserError(f"{flag} {tp} must divide {heads} (each rank computes whole heads); allowed: {allowed}")
    if vocab_size and vocab_size % tp:
        raise UserError(f"{flag} {tp} must divide the vocabulary of {vocab_size} tokens (the embedding and the output "
                        f"layer are split by token; pad model.vocab_size to a multiple of {tp}); allowed: {allowed}")
