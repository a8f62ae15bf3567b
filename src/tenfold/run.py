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
from tenfold.terms import BatchTriplet, RecomputePolicy, parse_recompute, resolve_batch, virtual_stages_for


@dataclass(frozen=True)
class ResolvedRun:
    config: TenfoldConfig
    world_size: int
    pp: int  # pipeline stages (ranks along the pipeline axis)
    dp: int  # data-parallel ranks: world_size / pp
    batch: BatchTriplet
    seq_len: int
    precision: str  # as configured; the engine may fall back to fp32 on a device without bf16
    model: ModelConfig  # the configured shape (a user's own module brings its own)
    recompute: RecomputePolicy
    zero_stage: int
    pp_schedule: str
    virtual_stages: int  # stages per pipeline rank (1 unless the schedule interleaves)

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
        )

    def batch_summary(self) -> dict:
        """The batch as a run reports it (summary.json's `batch`, `tenfold plan --json`'s `run.batch`)."""
        return {"micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "global_batch": self.global_batch,
                "seq_len": self.seq_len}

    def with_seq_len(self, seq_len: int) -> "ResolvedRun":
        """The same run on sequences of another length (a user's own packed dataset)."""
        return replace(self, seq_len=seq_len)


def model_kind(cfg: TenfoldConfig) -> str:
    """The configured model's kind (tenfold.capabilities.MODEL_KINDS): tenfold's GPT, or a
    Hugging Face model."""
    return "hf" if cfg.model.hf_config or cfg.model.hf_pretrained else "tenfold"


def resolve_run(cfg: TenfoldConfig, world_size: int, check: bool = True) -> ResolvedRun:
    """Check what depends on the number of processes, derive every shared value, and refuse
    (UserError) a run the engine cannot do. `check=False`: do not refuse it (`tenfold plan`
    prices such a run and says why train would refuse it)."""
    if isinstance(world_size, bool) or world_size < 1:
        raise UserError(f"the number of processes must be a positive integer, got {world_size!r}")
    par = cfg.parallel
    pp = par.pp_degree
    if world_size % pp:
        raise UserError(f"parallel.pp_degree (--pp) {pp} must divide the number of processes ({world_size})")
    dp = world_size // pp
    run = ResolvedRun(
        config=cfg, world_size=world_size, pp=pp, dp=dp,
        batch=resolve_batch(cfg.train.micro_batch, cfg.train.grad_accum, cfg.train.global_batch, dp),
        seq_len=cfg.seq_len(), precision=cfg.precision.dtype, model=cfg.model.build(),
        recompute=parse_recompute(cfg.recompute.policy), zero_stage=par.zero_stage,
        pp_schedule=par.pp_schedule,
        virtual_stages=virtual_stages_for(par.pp_schedule, par.virtual_stages) if pp > 1 else 1,
    )
    if check:
        capabilities.check(run.layout)
    return run
