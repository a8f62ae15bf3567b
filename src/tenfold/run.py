"""A run resolved once: the model, the number of processes and the user's choices turned into
the values every part of tenfold reads (batch triplet, sequence length, mesh sizes, pipeline
split, recompute policy, ZeRO stage as it runs). `tenfold train` builds from it, `tenfold plan`
prices it, `tenfold tune` and `tenfold plan --emit` write it back as a config: one resolver,
one set of names.

`resolve` is the resolver; `resolve_run(cfg, world_size)` reads a config into it, and
`ResolvedRun.with_(...)` derives another layout of the same run (the planner's search, the
tune's candidates, the ladder's rungs) through the same rules. Every run is checked against the
engine's capability table (tenfold.capabilities) as it is resolved, so train and plan refuse
the same runs with the same message.

No torch here: `tenfold plan` resolves runs without it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from tenfold import capabilities
from tenfold.choices import BY_NAME, RUN_CHOICES
from tenfold.errors import UserError
from tenfold.layout import Layout, build_layout, check_degree_values
from tenfold.lora_terms import LORA_BASES, LoraSpec, check_targets, lora_spec
from tenfold.models.presets import ModelConfig, param_count
from tenfold.host import local_device_is_cpu
from tenfold.terms import (
    MULTI_STAGE_SCHEDULES, PRECISION_CHOICES, BatchTriplet,
    RecomputePolicy, check_tp_split, num_stages, parse_recompute, resolve_batch, resolve_precision,
    stage_layer_counts, virtual_stages_for, zero_runs_as,
)

ACTIVATION_STYLES = ("tenfold", "megatron")


@dataclass(frozen=True)
class Stack:
    """How the training software keeps its tensors, as the planner prices it. The defaults are
    tenfold's engine; other values describe another stack (DeepSpeed's or Megatron's
    bookkeeping, a model with dropout) so that published runs can be priced, and such a run is
    one `tenfold train` does not do (tenfold.capabilities)."""

    # True: 16-bit params/grads + an fp32 master copy (ZeRO paper, DeepSpeed, Megatron).
    # False: fp32 params under torch.amp autocast (tenfold's engine).
    master_weights: bool = False
    grads_fp32: bool = False  # Megatron's fp32 "main grads"
    fp32_grad_copy: bool = False  # Megatron fp16: an fp32 copy of the grads for the optimizer
    overlap_comm: bool = True  # data-parallel reduction overlapped with backward
    dropout: bool = False  # the model applies dropout (GPT-2/3, Megatron); tenfold's has none
    flash_attention: bool = True  # no s^2 attention tensors
    # "tenfold": eager PyTorch + autocast (fp32 residual stream, fp32 log-probabilities and
    # their gradient); "megatron": fused kernels, 16-bit residual (Korthikanti et al. 2022).
    activation_style: str = "tenfold"

    def departures(self) -> list[str]:
        """`key=value` for every choice that differs from tenfold's engine."""
        return [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) != f.default]


ENGINE_STACK = Stack()


@dataclass(frozen=True)
class ResolvedRun:
    model: ModelConfig | None  # the configured shape; None: only a parameter count (tenfold plan --params)
    params: float  # parameters of the model
    dims: Layout  # ranks of each mesh dimension (tenfold.layout): pp x dp x cp x tp processes
    batch: BatchTriplet
    seq_len: int
    precision: str  # `auto` resolved; the engine may fall back to fp32 where bf16 autocast is missing
    recompute: RecomputePolicy
    zero_stage: int  # as configured (`zero_runs_as` is what runs)
    pp_schedule: str
    virtual_stages: int  # stages per pipeline rank (1 unless the schedule interleaves)
    stage_layers: tuple[int, ...]  # blocks per pipeline stage, pp x virtual_stages entries (one without pp)
    sequence_parallel: bool = False  # norms and the residual stream split by sequence over the tp ranks
    offload: str = "none"  # ZeRO-Offload: tenfold.terms.OFFLOADS
    reduce_dtype: str = "fp32"  # the data-parallel gradient collectives' dtype (tenfold.terms.REDUCE_DTYPES)
    shard_group: int | None = None  # dp ranks that shard together (HSDP); None: every dp rank
    pp_split_given: bool = False  # stage_layers came from parallel.pp_split, not the default rule
    model_kind: str = "tenfold"  # tenfold.capabilities.MODEL_KINDS
    hf_model_type: str = ""  # a Hugging Face model's config.json model_type
    compile: bool = False
    fp8: bool = False  # float8 matmuls in the blocks (precision.fp8), on top of `precision`
    lora: LoraSpec | None = None  # low-rank adapters on a frozen base (tenfold.lora_terms); None: every weight trains
    stack: Stack = ENGINE_STACK
    fp8_emulate: bool = False  # float8 matmuls emulated in higher precision (precision.fp8_emulate; testing on any device)
    # DeepSpeed's zero_optimization knobs, mapped onto DDP and FSDP2 (techniques/zero.py, docs/zero.md)
    reduce_bucket_size: int | None = None  # elements per gradient bucket; None: the engine's own
    param_persistence_threshold: int = 100_000  # stage3_param_persistence_threshold
    contiguous_gradients: bool = True
    overlap_comm: bool | None = None

    # ------------------------------------------------------------------ derived values
    @property
    def world_size(self) -> int:
        """Processes (GPUs): pp x dp x cp x tp."""
        return self.dims.world_size

    @property
    def pp(self) -> int:
        """Pipeline ranks."""
        return self.dims.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks."""
        return self.dims.dp

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks: each layer's matrices split over them."""
        return self.dims.tp

    @property
    def cp(self) -> int:
        """Context-parallel ranks: each sequence split over them (techniques/context_parallel.py)."""
        return self.dims.cp

    @property
    def ep(self) -> int:
        """Expert-parallel ranks: each MoE layer's experts split over them, a split of the dp ranks."""
        return self.dims.ep

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
    def local_seq_len(self) -> int:
        """Tokens of each sequence one rank holds: seq_len / cp (context parallelism)."""
        return self.seq_len // self.cp

    @property
    def grad_ranks(self) -> int:
        """Ranks that hold the same parameters and reduce their gradients together: dp x cp
        (tenfold.layout.Layout.grad_ranks)."""
        return self.dims.grad_ranks

    @property
    def shard_size(self) -> int:
        """Ranks a ZeRO-2/3 state is split over: the shard group (x cp) under hybrid sharding,
        else dp x cp."""
        return self.shard_group * self.cp if self.shard_group else self.grad_ranks

    @property
    def replicas(self) -> int:
        """Copies of each shard: dp / shard group under hybrid sharding, else 1."""
        return self.grad_ranks // self.shard_size if self.grad_ranks % self.shard_size == 0 else 1

    @property
    def zero_runs_as(self) -> int:
        """The stage whose memory and traffic the engine really has (tenfold.terms.zero_runs_as)."""
        return zero_runs_as(self.zero_stage, self.tp, self.grad_ranks, self.offload)

    @property
    def n_stages(self) -> int:
        return len(self.stage_layers)

    def rank_layers(self, pp_rank: int) -> int:
        """Blocks held by one pipeline rank (looped placement: stages r, r + pp, ...)."""
        return sum(self.stage_layers[pp_rank::self.pp])

    def busiest_ranks(self) -> list[int]:
        """The pipeline ranks that can bound a step or hold the most: the first (embedding, the
        most micro-batches in flight), the second (the most in flight of the ranks that receive
        both each micro-batch's input and its output's gradient: torch.distributed.pipelining
        keeps a buffer of each per micro-batch), the last (output layer and loss), and the one
        with the most blocks."""
        most = max(range(self.pp), key=self.rank_layers)
        return sorted({0, min(1, self.pp - 1), self.pp - 1, most})

    def rank_stage_layers(self, pp_rank: int) -> tuple[int, ...]:
        """Blocks of each stage module one pipeline rank holds (recompute wraps each on its own)."""
        return self.stage_layers[pp_rank::self.pp]

    def batch_summary(self) -> dict:
        """The batch as a run reports it (summary.json's `batch`, `tenfold plan --json`'s `run.batch`)."""
        return {"micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "global_batch": self.global_batch,
                "seq_len": self.seq_len}

    def layout(self) -> dict:
        """The run's layout with the names every output uses (`tenfold plan --json`'s `strategy`)."""
        return {
            "world_size": self.world_size, "pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp,
            "precision": self.precision, "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
            "global_batch": self.global_batch, "seq_len": self.seq_len, "recompute": str(self.recompute),
            "zero_stage": self.zero_stage, "zero_runs_as": self.zero_runs_as, "shard_group": self.shard_group,
            "offload": self.offload, "reduce_dtype": self.reduce_dtype, "ep": self.ep,
            "pp_schedule": self.pp_schedule, "virtual_stages": self.virtual_stages,
            "stage_layers": list(self.stage_layers), "sequence_parallel": self.sequence_parallel,
            "lora": asdict(self.lora) if self.lora else None, "stack": asdict(self.stack),
        }

    def layout_line(self) -> str:
        """`pp 2 x dp 4 x tp 1; ZeRO-3; recompute full; ...`: the layout in one line, saying where
        the engine runs one strategy as another."""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        parts = [f"{self.world_size} = pp {self.pp} x dp {self.dp}{cp} x tp {self.tp}", zero_text(self)]
        parts.append(f"recompute {self.recompute}")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        if self.reduce_dtype != "fp32" and self.dp > 1:
            parts.append(f"gradients reduced in {self.reduce_dtype}")
        if self.pp > 1:
            split = "/".join(map(str, self.stage_layers))
            parts.append(f"schedule {self.pp_schedule}, {self.virtual_stages} stage(s) per rank, blocks per stage {split}")
        if self.sequence_parallel:
            parts.append("sequence parallel")
        if self.ep > 1:
            parts.append(f"experts over ep {self.ep} (of the dp ranks)")
        if self.lora:
            parts.append(self.lora.text())
        return "; ".join(parts)

    # ------------------------------------------------------------------ other layouts
    def with_(self, check: bool = True, **changes) -> "ResolvedRun":
        """The same model, processes and global batch with other choices, resolved by the same
        rules (`resolve`). A new micro-batch keeps the global batch (accumulation follows); a
        new number of stages drops a given `pp_split`."""
        unknown = sorted(set(changes) - set(CHOICES) - {"world_size"})
        if unknown:
            raise TypeError(f"unknown run choice(s): {', '.join(unknown)}")
        now = self.choices()
        if "micro_batch" in changes or {"pp", "tp", "cp", "world_size"} & set(changes):
            now["grad_accum"] = None
        if changes.get("pp_schedule", self.pp_schedule) not in MULTI_STAGE_SCHEDULES:
            now["virtual_stages"] = None
        merged = {**now, **changes}
        if merged.get("pp_split") is not None:
            pp, sched = merged["pp"], merged["pp_schedule"]
            v = virtual_stages_for(sched, merged["virtual_stages"]) if pp > 1 else 1
            if num_stages(pp, sched, v) != len(merged["pp_split"]):
                merged["pp_split"] = None
        world = merged.pop("world_size", self.world_size)
        return resolve(self.model, world, params=self.params, check=check, **merged)

    def choices(self) -> dict:
        """The choices `resolve` would rebuild this run from."""
        return {**{name: getattr(self, name) for name in CHOICES if name != "pp_split"},
                "pp_split": self.stage_layers if self.pp_split_given else None}

    def with_seq_len(self, seq_len: int) -> "ResolvedRun":
        """The same run on sequences of another length (a user's own packed dataset)."""
        return replace(self, seq_len=check_context_split(check_sequence_split(seq_len, self.tp, self.sequence_parallel),
                                                         self.cp))


# The user's choices `resolve` takes (keyword names), with their defaults: the table's, and the
# planner's training stack.
CHOICES = {**{c.name: c.default for c in RUN_CHOICES}, "stack": ENGINE_STACK}


def zero_text(run: ResolvedRun) -> str:
    """`ZeRO-3`, `ZeRO-3 in shard groups of 8`, or how a stage runs where the engine maps it
    onto another."""
    if run.shard_group:
        return f"ZeRO-{run.zero_stage} in shard groups of {run.shard_group}"
    if run.zero_runs_as == run.zero_stage:
        return f"ZeRO-{run.zero_stage}"
    if run.dp <= 1:
        return f"ZeRO-{run.zero_stage} (one data-parallel rank: nothing to shard, runs as ZeRO-0)"
    return (f"ZeRO-{run.zero_stage} (runs as ZeRO-{run.zero_runs_as} on FSDP2 under tensor parallelism: "
            "gradients 1/dp at the optimizer step)")


# --------------------------------------------------------------------------- the resolver


def resolve(model: ModelConfig | None, world_size: int, *, params: float | None = None, check: bool = True,
            own_model: bool = False, on_cpu: bool = False, **choices) -> ResolvedRun:
    """Check the choices against each other, the model and the processes, derive every shared
    value, and refuse (UserError) a run the engine cannot do. `check=False`: do not refuse for
    the engine (tenfold plan prices such a run and says why train would refuse it); a run that
    cannot exist at all is always refused. `own_model`: the model is the user's own module
    (Python API), so the configured shape says nothing about its heads. `on_cpu`: the run
    computes on a CPU, which decides what precision `auto` is (tenfold.terms.resolve_precision)."""
    unknown = sorted(set(choices) - set(CHOICES))
    if unknown:
        raise TypeError(f"unknown run choice(s): {', '.join(unknown)}")
    c = {**CHOICES, **choices}
    _check_choices(world_size, c)
    pp, tp, cp = c["pp"], c["tp"], c["cp"]
    if c["lora"] is not None and model is not None and not own_model:
        check_targets(c["lora"], c["model_kind"], c["hf_model_type"], model.mlp)
    if model is not None and tp > 1 and not own_model:
        check_tp_split(tp, model.n_heads, model.kv_heads, model.vocab_size, flag="parallel.tp_degree (--tp)")
    check_expert_parallel(c["ep"], model)
    dims = build_layout(world_size, pp, tp, c["shard_group"], cp=cp, ep=c["ep"])
    dp = dims.dp
    sequence_parallel = sequence_parallel_for(tp, c["sequence_parallel"])
    shard_group = None if c["shard_group"] in (None, dp) else c["shard_group"]  # one group of every dp rank: plain ZeRO
    seq_len = check_context_split(check_sequence_split(_seq_len(model, c["seq_len"]), tp, sequence_parallel), cp)
    v = virtual_stages_for(c["pp_schedule"], c["virtual_stages"]) if pp > 1 else 1
    n_layers = model.n_layers if model is not None else pp * v
    stages = num_stages(pp, c["pp_schedule"], v) if pp > 1 else 1
    run = ResolvedRun(
        model=model, params=float(params if params is not None else param_count(model)), dims=dims,
        batch=resolve_batch(c["micro_batch"], c["grad_accum"], c["global_batch"], dp, pp,
                            rounds_of_pp=c["pp_schedule"] in MULTI_STAGE_SCHEDULES),
        seq_len=seq_len, precision=resolve_precision(c["precision"], on_cpu, c["fp8"]), recompute=parse_recompute(c["recompute"]),
        zero_stage=c["zero_stage"], pp_schedule=c["pp_schedule"], virtual_stages=v,
        stage_layers=stage_layer_counts(n_layers, stages, c["pp_split"] if pp > 1 else None),
        sequence_parallel=sequence_parallel, offload=c["offload"], shard_group=shard_group,
        reduce_dtype=c["reduce_dtype"],
        pp_split_given=pp > 1 and c["pp_split"] is not None, model_kind=c["model_kind"],
        hf_model_type=c["hf_model_type"], compile=c["compile"], fp8=c["fp8"], lora=c["lora"], stack=c["stack"],
        fp8_emulate=c["fp8_emulate"], reduce_bucket_size=c["reduce_bucket_size"],
        param_persistence_threshold=c["param_persistence_threshold"],
        contiguous_gradients=c["contiguous_gradients"], overlap_comm=c["overlap_comm"],
    )
    if check:
        capabilities.check(run)
    return run


def check_expert_parallel(ep: int, model: ModelConfig | None) -> None:
    """The ep degree's rules on the model: expert parallelism needs a mixture-of-experts model,
    and every MoE layer's experts split evenly over the ep ranks. (That ep divides the dp ranks
    is the layout's rule: tenfold.layout.build_layout.)"""
    if ep == 1 or model is None:
        return
    flag = f"{BY_NAME['ep'].key} ({BY_NAME['ep'].flag}) {ep}"
    if not model.is_moe:
        raise UserError(f"{flag} needs a mixture-of-experts model: model.n_experts > 0 (--model tiny-moe, "
                        "mixtral-8x7b, ...) or a Hugging Face config of model_type mixtral, qwen2_moe or qwen3_moe")
    if model.n_experts % ep:
        allowed = ", ".join(str(d) for d in range(1, model.n_experts + 1) if model.n_experts % d == 0)
        raise UserError(f"{flag} must divide model.n_experts ({model.n_experts}); allowed: {allowed}")


def _check_choices(world_size: int, c: dict) -> None:
    """The values each choice may take, whoever gives them (config, flags, the planner's search)."""
    check_degree_values(world_size, pp=c["pp"], tp=c["tp"], cp=c["cp"], ep=c["ep"])
    if c["precision"] not in PRECISION_CHOICES:
        raise UserError(f"precision {c['precision']!r}; allowed: {', '.join(PRECISION_CHOICES)}")
    for name in ("zero_stage", "pp_schedule", "offload", "reduce_dtype"):  # the table's allowed values
        row, v = BY_NAME[name], c[name]
        if v not in row.allowed or isinstance(v, bool):
            raise UserError(f"{row.key} ({row.flag}) {v!r}; allowed: {', '.join(map(str, row.allowed))}")
    if c["stack"].activation_style not in ACTIVATION_STYLES:
        raise UserError(f"activation_style {c['stack'].activation_style!r}; allowed: {', '.join(ACTIVATION_STYLES)}")
    if c["lora"] is not None and (not isinstance(c["lora"], LoraSpec) or c["lora"].rank < 1
                                  or c["lora"].base not in LORA_BASES):
        raise UserError(f"lora must be a tenfold.lora_terms.LoraSpec with rank >= 1 and base in {LORA_BASES}, "
                        f"got {c['lora']!r}")
    if c["seq_len"] is not None and (isinstance(c["seq_len"], bool) or not isinstance(c["seq_len"], int)
                                     or c["seq_len"] < 1):
        raise UserError(f"--seq-len must be a positive integer, got {c['seq_len']!r}")


def _seq_len(model: ModelConfig | None, requested: int | None) -> int:
    if model is None:
        return requested or 2048
    seq = requested or model.max_seq_len
    if seq > model.max_seq_len and model.pos == "learned":
        raise UserError(f"--seq-len {seq} exceeds the model's learned positions ({model.max_seq_len})")
    return seq


def resolve_run(cfg, world_size: int, check: bool = True, own_model: bool = False,
                on_cpu: bool | None = None) -> ResolvedRun:
    """`cfg` (a TenfoldConfig) on `world_size` processes: the run `tenfold train` does, on a CPU
    or not as `on_cpu` says (None: as train would run on this machine)."""
    return resolve(cfg.model.build(), world_size, check=check, own_model=own_model,
                   on_cpu=local_device_is_cpu() if on_cpu is None else on_cpu, **choices_from_config(cfg))


def choices_from_config(cfg) -> dict:
    """A config's choices under the resolver's names (tenfold.choices: each row's config key)."""
    derived = {
        "seq_len": cfg.seq_len(), "pp_split": tuple(cfg.parallel.pp_split) if cfg.parallel.pp_split else None,
        "model_kind": model_kind(cfg), "hf_model_type": hf_model_type(cfg), "lora": lora_spec(cfg.lora),
    }
    return {c.name: derived[c.name] if c.name in derived else _config_value(cfg, c.key) for c in RUN_CHOICES}


def _config_value(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def config_for_run(base, run: ResolvedRun):
    """`base` (a TenfoldConfig) with `run`'s layout written in: what `tenfold plan --emit` and a
    tune's candidates hold. Values train derives itself (accumulation, sequence parallelism on
    with tp, the default split) are left to it."""
    from tenfold.config import build_config

    if run.stack != ENGINE_STACK:
        raise UserError(f"this run is priced as another training stack ({', '.join(run.stack.departures())}); "
                        "tenfold train runs only its own")
    d = base.model_dump(mode="json")
    multi_stage = run.pp_schedule in MULTI_STAGE_SCHEDULES and run.pp > 1
    written = {
        "grad_accum": None, "recompute": str(run.recompute), "fp8_emulate": run.fp8 and run.fp8_emulate,
        "virtual_stages": run.virtual_stages if multi_stage else None,
        "sequence_parallel": None if run.sequence_parallel == (run.tp > 1) else run.sequence_parallel,
        "pp_split": list(run.stage_layers) if run.pp_split_given else None,
    }
    for c in RUN_CHOICES:
        if c.key == "lora":
            d["lora"] = lora_section(run.lora, d["lora"])
        elif c.key:
            section, name = c.key.split(".")
            d[section][name] = written[c.name] if c.name in written else getattr(run, c.name)
    return build_config(d)


def lora_section(spec: LoraSpec | None, section: dict) -> dict:
    """The config's `[lora]` table for a run's adapters (rank 0: off)."""
    if spec is None:
        return {"rank": 0}
    return {**section, "rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout,
            "target_modules": list(spec.targets), "base": spec.base}


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


def check_context_split(seq_len: int, cp: int) -> int:
    """Context parallelism cuts every sequence into 2 x cp equal chunks (two per cp rank, for
    the causal mask's load balance: techniques/context_parallel.py)."""
    if cp > 1 and seq_len % (2 * cp):
        raise UserError(
            f"context parallelism cuts each sequence into 2 x parallel.cp_degree (--cp {cp}) = {2 * cp} equal chunks: "
            f"the sequence length ({seq_len}, --seq-len) must be a multiple of {2 * cp}"
        )
    return seq_len


def model_kind(cfg) -> str:
    """The configured model's kind (tenfold.capabilities.MODEL_KINDS): tenfold's GPT, or a
    Hugging Face model."""
    return "hf" if cfg.model.hf_config or cfg.model.hf_pretrained else "tenfold"


def hf_model_type(cfg) -> str:
    """A Hugging Face model's config.json `model_type` ("" for tenfold's own models)."""
    path = cfg.model.hf_pretrained or cfg.model.hf_config
    if not path:
        return ""
    from pathlib import Path

    from tenfold.models.hf_config import hf_model_type as read_model_type

    p = Path(path)
    return read_model_type(str(p / "config.json" if p.is_dir() else p))
