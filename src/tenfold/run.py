"""A run resolved once: the config plus the number of processes, turned into the values every
part of tenfold reads (batch triplet, sequence length, model shape, mesh sizes, recompute
policy, pipeline schedule). The trainer, the launcher and the planner's view of a training
run all start from `resolve_run`, so none of them derives these values a second time.

Every run is checked against the engine's capability table (tenfold.capabilities) as it is
resolved, so `tenfold train` and `tenfold plan` refuse the same runs with the same message.

No torch here: `tenfold plan` resolves the same run without it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tenfold import capabilities
from tenfold.config import TenfoldConfig
from tenfold.errors import UserError
from tenfold.models.presets import ModelConfig
from tenfold.terms import (
    BatchTriplet, RecomputePolicy, check_tp_heads, parse_recompute, resolve_batch, virtual_stages_for,
)


@dataclass(frozen=True)
class ResolvedRun:
    config: TenfoldConfig
    world_size: int
    pp: int  # pipeline stages (ranks along the pipeline axis)
    dp: int  # data-parallel ranks: world_size / (pp x tp)
    batch: BatchTriplet
    seq_len: int
    precision: str  # as configured; the engine may fall back to fp32 on a device without bf16
    model: ModelConfig  # the configured shape (a user's own module brings its own)
    recompute: RecomputePolicy
    zero_stage: int
    pp_schedule: str
    virtual_stages: int  # stages per pipeline rank (1 unless the schedule interleaves)
    tp: int = 1  # tensor-parallel ranks: each layer's matrices split over them
    sequence_parallel: bool = False  # norms and the residual stream split by sequence over the tp ranks

    @property
    def micro_batch(self) -> int:
        return self.batch.micro_batch

    @property
    def grad_accum(self) -> int:
        return self.batch.grad_accum

    @property
    def global_batch(self) -> int:
        return self.batch.global_batch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def model_kind(self) -> str:
        return model_kind(self.config)

    @property
    def layout(self) -> capabilities.Layout:
        """The run as the capability table judges it."""
        split = self.config.parallel.pp_split
        return capabilities.Layout(
            model=self.model, world_size=self.world_size, pp=self.pp, zero=self.zero_stage, recompute=self.recompute,
            precision=self.precision, micro_batches=self.grad_accum, schedule=self.pp_schedule,
            virtual_stages=self.virtual_stages, model_kind=self.model_kind, pp_split=tuple(split) if split else None,
            tp=self.tp, hf_model_type=hf_model_type(self.config) if self.tp > 1 else "",
            compile=self.config.train.compile, fp8=self.config.precision.fp8,
        )

    def batch_summary(self) -> dict:
        """The batch as a run reports it (summary.json's `batch`, `tenfold plan --json`'s `run.batch`)."""
        return {"micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "global_batch": self.global_batch,
                "seq_len": self.seq_len}

    def with_seq_len(self, seq_len: int) -> "ResolvedRun":
        """The same run on sequences of another length (a user's own packed dataset)."""
        return replace(self, seq_len=check_sequence_split(seq_len, self.tp, self.sequence_parallel))


def model_kind(cfg: TenfoldConfig) -> str:
    """The configured model's kind (tenfold.capabilities.MODEL_KINDS): tenfold's GPT, or a
    Hugging Face model."""
    return "hf" if cfg.model.hf_config or cfg.model.hf_pretrained else "tenfold"


def resolve_run(cfg: TenfoldConfig, world_size: int, check: bool = True, own_model: bool = False) -> ResolvedRun:
    """Check what depends on the number of processes, derive every shared value, and refuse
    (UserError) a run the engine cannot do. `check=False`: do not refuse it (`tenfold plan`
    prices such a run and says why train would refuse it). `own_model`: the model is the
    user's own module (Python API), so the configured shape says nothing about its heads; its
    tensor-parallel plan is checked when it is applied."""
    if isinstance(world_size, bool) or world_size < 1:
        raise UserError(f"the number of processes must be a positive integer, got {world_size!r}")
    par = cfg.parallel
    pp, tp = par.pp_degree, par.tp_degree
    model = cfg.model.build()
    if tp > 1 and not own_model:
        check_tp_heads(tp, model.n_heads, model.kv_heads, flag="parallel.tp_degree (--tp)")
    if world_size % (pp * tp):
        raise UserError(
            f"parallel.pp_degree (--pp) {pp} x parallel.tp_degree (--tp) {tp} = {pp * tp} must divide "
            f"the number of processes ({world_size}); world = pp x dp x tp"
        )
    dp = world_size // (pp * tp)
    sequence_parallel = sequence_parallel_for(tp, par.sequence_parallel)
    seq_len = check_sequence_split(cfg.seq_len(), tp, sequence_parallel)
    run = ResolvedRun(
        config=cfg, world_size=world_size, pp=pp, dp=dp,
        batch=resolve_batch(cfg.train.micro_batch, cfg.train.grad_accum, cfg.train.global_batch, dp),
        seq_len=seq_len, precision=cfg.precision.dtype, model=model,
        recompute=parse_recompute(cfg.recompute.policy), zero_stage=par.zero_stage,
        pp_schedule=par.pp_schedule,
        virtual_stages=virtual_stages_for(par.pp_schedule, par.virtual_stages) if pp > 1 else 1,
        tp=tp, sequence_parallel=sequence_parallel,
    )
    if check:
        capabilities.check(run.layout)
    return run


def sequence_parallel_for(tp: int, requested: bool | None) -> bool:
    """Sequence parallelism is on by default with tensor parallelism (it only replaces each
    all-reduce by a reduce-scatter + all-gather of the same volume, and divides the norms'
    activations by tp: Korthikanti et al. 2022, section 4.2.2); it needs tp > 1."""
    if requested and tp == 1:
        raise UserError("parallel.sequence_parallel (--sequence-parallel) needs parallel.tp_degree (--tp) > 1")
    return tp > 1 if requested is None else bool(requested)


def check_sequence_split(seq_len: int, tp: int, sequence_parallel: bool) -> int:
    """Sequence parallelism cuts every sequence into tp equal parts."""
    if sequence_parallel and seq_len % tp:
        raise UserError(
            f"sequence parallelism splits each sequence over the {tp} tp ranks: the sequence length "
            f"({seq_len}, --seq-len) must be a multiple of parallel.tp_degree (--tp) {tp}; or pass --no-sequence-parallel"
        )
    return seq_len


def hf_model_type(cfg: TenfoldConfig) -> str:
    """A Hugging Face model's config.json `model_type` ("" for tenfold's own models)."""
    path = cfg.model.hf_pretrained or cfg.model.hf_config
    if not path:
        return ""
    from pathlib import Path

    from tenfold.models.hf_config import hf_model_type as read_model_type

    p = Path(path)
    return read_model_type(str(p / "config.json" if p.is_dir() else p))
