"""What the user chooses: precision, batch, recompute, ZeRO, offload, TP/PP. One dataclass,
validated against the model and fleet in `resolve()` (all errors are `UserError`s)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


from tenfold.errors import UserError
from tenfold.terms import (
    PIPELINE_SCHEDULES, PRECISIONS, RecomputePolicy, check_tp_heads, parse_recompute, resolve_batch,
    tp_choices, virtual_stages_for,
)

__all__ = ["Strategy", "Resolved", "resolve", "tp_choices"]

OFFLOADS = ("none", "optimizer", "optimizer+params")
STYLES = ("megatron", "tenfold")


@dataclass(frozen=True)
class Strategy:
    """How to train. `dp` is derived: gpus / (tp * pp)."""

    precision: str = "bf16"
    micro_batch: int | None = None  # None: tenfold.terms.resolve_batch's rule, as `tenfold train`
    grad_accum: int | None = None
    global_batch: int | None = None  # sequences per optimizer step, all ranks
    seq_len: int | None = None  # None: the model's max_seq_len
    ac: str = "none"
    zero: int = 0
    offload: str = "none"
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    virtual_stages: int | None = None  # None: tenfold.terms.virtual_stages_for's default
    flash_attention: bool = True
    sequence_parallel: bool = False
    tokens: float | None = None
    achieved_tflops: float | None = None  # per-GPU hardware FLOP/s in TFLOP/s (Narayanan's X)
    # Mixed precision bookkeeping. True: 16-bit params/grads + fp32 master copy (ZeRO paper,
    # DeepSpeed, Megatron). False: fp32 params under torch.amp autocast (tenfold's engine).
    master_weights: bool = True
    grads_fp32: bool = False  # Megatron's fp32 "main grads" (bf16 default there)
    fp32_grad_copy: bool = False  # Megatron fp16: an fp32 copy of the grads for the optimizer
    overlap_comm: bool = True  # DP gradient reduction overlapped with backward
    dropout: bool = False  # the model applies dropout (GPT-2/3, Megatron); tenfold's model has none
    # "tenfold" (default): eager PyTorch + autocast as tenfold and plain PyTorch train, incl. the
    # fp32 log-probabilities and their gradient (8 b s V bytes); "megatron": Megatron's fused
    # kernels, 16-bit residual, one fp32 logits copy (Korthikanti et al. 2022).
    activation_style: str = "tenfold"

    @property
    def policy(self) -> RecomputePolicy:
        return parse_recompute(self.ac)

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **kw) -> "Strategy":
        return replace(self, **kw)


@dataclass(frozen=True)
class Resolved:
    """A strategy checked against a fleet, with the derived quantities."""

    s: Strategy
    gpus: int
    dp: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    policy: RecomputePolicy
    v: int  # virtual stages actually used (1 unless interleaved)


def _positive(name: str, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise UserError(f"--{name} must be a positive integer, got {value!r}")


def resolve(s: Strategy, gpus: int, n_layers: int | None, n_heads: int | None, max_seq_len: int | None,
            n_kv_heads: int | None = None) -> Resolved:
    """Check every field and derive dp, grad_accum, global batch (DeepSpeed's triplet rule)."""
    if s.precision not in PRECISIONS:
        raise UserError(f"--precision {s.precision!r}; allowed: {', '.join(PRECISIONS)}")
    if s.offload not in OFFLOADS:
        raise UserError(f"--offload {s.offload!r}; allowed: {', '.join(OFFLOADS)}")
    if s.pp_schedule not in PIPELINE_SCHEDULES:
        raise UserError(f"--pp-schedule {s.pp_schedule!r}; allowed: {', '.join(PIPELINE_SCHEDULES)}")
    if s.activation_style not in STYLES:
        raise UserError(f"activation_style {s.activation_style!r}; allowed: {', '.join(STYLES)}")
    if s.zero not in (0, 1, 2, 3):
        raise UserError(f"--zero {s.zero!r}; allowed: 0, 1, 2, 3")
    for name in ("gpus", "tp", "pp", "micro_batch", "virtual_stages"):
        _positive(name.replace("_", "-"), gpus if name == "gpus" else getattr(s, name))
    _positive("grad-accum", s.grad_accum)
    _positive("global-batch", s.global_batch)
    _positive("seq-len", s.seq_len)
    policy = parse_recompute(s.ac)
    if s.offload != "none" and s.zero == 0:
        raise UserError(f"--offload {s.offload} needs --zero 1, 2 or 3 (ZeRO-Offload partitions what it moves)")
    if s.offload == "optimizer+params" and s.zero != 3:
        raise UserError("--offload optimizer+params needs --zero 3 (only stage 3 partitions parameters)")
    if n_heads is not None:
        check_tp_heads(s.tp, n_heads, n_kv_heads)  # the rule `tenfold train` applies too
    if gpus % (s.tp * s.pp):
        raise UserError(f"--gpus {gpus} must be a multiple of --tp x --pp = {s.tp * s.pp}")
    dp = gpus // (s.tp * s.pp)
    if n_layers is not None and s.pp > n_layers:
        raise UserError(f"--pp {s.pp} exceeds the number of layers ({n_layers})")
    if s.sequence_parallel and s.tp == 1:
        raise UserError("--sequence-parallel needs --tp > 1")
    v = virtual_stages_for(s.pp_schedule, s.virtual_stages) if s.pp > 1 else 1
    if v > 1 and n_layers is not None and n_layers % (s.pp * v):
        raise UserError(
            f"--virtual-stages {v}: layers ({n_layers}) must divide evenly into pp x virtual stages = {s.pp * v}"
        )
    seq_len = s.seq_len or max_seq_len
    if seq_len is None:
        seq_len = 2048
    micro, accum, glob = resolve_batch(s.micro_batch, s.grad_accum, s.global_batch, dp)
    if v > 1 and accum % s.pp:
        raise UserError(
            f"--pp-schedule interleaved needs the number of micro-batches ({accum}) to be a multiple of --pp ({s.pp})"
        )
    return Resolved(s, gpus, dp, micro, accum, glob, seq_len, policy, v)
