"""One typed config for a training run: TOML file + DeepSpeed JSON + CLI flags + `--set`.

Precedence, lowest first: built-in defaults < `--config FILE.toml` < `--deepspeed ds.json`
< CLI flags < `--set section.key=value`. Every problem becomes a `UserError` naming the
field and what is allowed (exit 2 in the CLI), before anything is started or written.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from tenfold.errors import UserError
from tenfold.lr_schedule import validate_schedule_params
from tenfold.models.presets import ModelConfig, get_preset
from tenfold.choices import allowed_of, default_of
from tenfold.terms import parse_recompute

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tomli backport, same API (a dependency there)
    import tomli as tomllib  # type: ignore[no-redef]


class _Section(BaseModel):
    # allow_inf_nan=False: `lr = inf` would start a run that dies (or trains on) later
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _typed_strictly(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic's lax mode reads `zero_stage = true` as 1, `tensorboard = 1` as true,
        `steps = "2"` and `steps = 2.0` as 2: here a boolean is not a number, a number is not a
        boolean, a string is not a number, a float is not an integer, and no name or path is ""."""
        kinds = _scalar_kinds(cls.model_fields[info.field_name].annotation)
        numeric = bool(kinds & {int, float}) and str not in kinds
        if isinstance(value, bool) and numeric and bool not in kinds:
            raise ValueError("expected a number, not true/false")
        if isinstance(value, str) and numeric:
            raise ValueError("expected a number, not a string (write it without quotes)")
        if isinstance(value, float) and int in kinds and float not in kinds:
            raise ValueError("expected an integer, not a decimal number")
        if isinstance(value, list) and list[int] in kinds and any(isinstance(x, bool) for x in value):
            raise ValueError("expected integers, not true/false")
        if isinstance(value, list) and list[int] in kinds and not all(isinstance(x, int) for x in value):
            raise ValueError("expected a list of integers")
        if bool in kinds and value is not None and not isinstance(value, bool):
            raise ValueError("expected true or false")
        if isinstance(value, str) and str in kinds and not value.strip():
            raise ValueError("must not be empty")
        return value


def _scalar_kinds(annotation: Any) -> set:
    """{int}, {float, NoneType}, {bool}, ... for a field's annotation (unions unpacked)."""
    args = typing.get_args(annotation)
    return set(args) if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else {annotation}


class ModelSection(_Section):
    name: str = "tiny"
    # Optional overrides of the preset's shape (None keeps the preset's value).
    n_layers: int | None = None
    d_model: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    d_ff: int | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    mlp: Literal["swiglu", "gelu"] | None = None
    norm: Literal["rmsnorm", "layernorm"] | None = None
    pos: Literal["rope", "learned"] | None = None
    bias: bool | None = None
    tie_embeddings: bool | None = None
    n_experts: int | None = Field(None, ge=0)
    experts_per_token: int | None = Field(None, gt=0)
    d_expert: int | None = Field(None, gt=0)
    n_shared_experts: int | None = Field(None, ge=0)
    router_aux_loss_coef: float | None = Field(None, ge=0)
    router_bias_rate: float | None = Field(None, ge=0)
    router_norm_topk: bool | None = None
    capacity_factor: float | None = Field(None, ge=0)
    # Any model (tenfold.models.adapter / hf): a Hugging Face config.json (random init) or a
    # local folder with config.json + safetensors; `blocks` names the repeated block class.
    hf_config: str | None = None
    hf_pretrained: str | None = None
    blocks: str | None = None

    def build(self) -> ModelConfig:
        if self.hf_config or self.hf_pretrained:  # the HF shape, as the planner reads it
            from tenfold.models.hf_config import model_from_hf_config

            shape_keys = self.model_dump(exclude={"name", "hf_config", "hf_pretrained", "blocks"}, exclude_none=True)
            if shape_keys:
                raise UserError(
                    f"model.{', model.'.join(shape_keys)} cannot be combined with model.hf_config/hf_pretrained: "
                    "the Hugging Face config.json defines the shape; edit that file instead"
                )

            path = Path(self.hf_pretrained or self.hf_config)
            try:
                folder = path.is_dir()
            except (OSError, ValueError) as e:  # a name too long, a NUL byte
                raise UserError(f"model.hf_config/hf_pretrained {str(path)[:80]!r}: {getattr(e, 'strerror', None) or e}") from None
            flag = "--hf-pretrained" if self.hf_pretrained else "--hf-config"  # the option the user typed
            return model_from_hf_config(str(path / "config.json" if folder else path), flag)
        overrides = self.model_dump(exclude={"name", "hf_config", "hf_pretrained", "blocks"})
        return get_preset(self.name).with_overrides(**overrides)


class DataSection(_Section):
    path: str | None = None  # None: the running Python's standard library sources; hf:NAME = a cached dataset
    format: Literal["auto", "text", "jsonl", "bin", "prompt-completion", "chat"] = "auto"
    # byte | bpe | a tokenizer.json or tokenizer folder; None: byte, or the --hf-pretrained folder's own
    tokenizer: str | None = Field(None, min_length=1)
    bpe_vocab_size: int = Field(4096, gt=256)
    jsonl_field: str = "text"
    bin_dtype: Literal["uint16", "uint32"] | None = None  # None: from `data prepare`'s FILE.json, else uint16
    split: str = "train"  # the split of a Hugging Face dataset
    streaming: bool = False  # read lazily (corpora larger than memory); exact resume
    shuffle_block: int = Field(1024, gt=0)  # streaming: rows shuffled together
    packing: bool = True  # fine-tuning formats: several whole examples per row
    seq_len: int | None = Field(None, gt=0)  # None: the model's max_seq_len
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    max_bytes: int | None = Field(None, gt=0)  # cap on corpus size read (None = all)


class TrainSection(_Section):
    steps: int = Field(200, gt=0)
    micro_batch: int | None = Field(None, gt=0)  # None: tenfold.terms.resolve_batch's default
    grad_accum: int | None = Field(None, gt=0)
    global_batch: int | None = Field(None, gt=0)  # sequences per optimizer step, all ranks
    lr: float = Field(2e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    warmup_steps: int = Field(10, ge=0)
    schedule: Literal[
        "cosine", "linear", "constant", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"
    ] = "cosine"
    schedule_params: dict[str, Any] = Field(default_factory=dict)  # DeepSpeed scheduler params
    weight_decay: float = Field(0.1, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0.0)  # 0 disables clipping (DeepSpeed semantics)
    seed: int = 1337
    eval_every: int = Field(50, ge=0)  # 0: only at the end
    eval_batches: int = Field(4, gt=0)
    on_nan: Literal["stop", "skip"] = "stop"
    # torch.compile each transformer block (techniques/compile.py). Off by default: on a 2-core
    # CPU it measured 1.02-1.12x eager on `small` and costs 25-45 s of compile time per process,
    # more than short runs gain (docs/compile.md).
    compile: bool = default_of("compile")  # type: ignore[assignment]
    # Refuse a run whose predicted memory per rank exceeds what the rank has, before anything is
    # built (tenfold.plan.room); false (--no-fit-check) starts it anyway.
    fit_check: bool = True

    @model_validator(mode="after")
    def _schedule_params_fit_the_schedule(self) -> "TrainSection":
        validate_schedule_params(self.schedule, self.schedule_params, self.steps)  # UserError naming them
        return self


class PrecisionSection(_Section):
    # auto: bf16 on GPUs and on CPUs with bf16 matrix instructions, else fp32 (terms.resolve_precision)
    dtype: Literal[allowed_of("precision")] = default_of("precision")  # type: ignore[valid-type]
    # Float8 matmuls in the transformer blocks' Linears (torchao), the rest in `dtype` (bf16):
    # a switch on top of bf16, not a dtype (techniques/fp8.py, docs/precision.md).
    fp8: bool = default_of("fp8")  # type: ignore[assignment]
    # FP8 on a device without float8 matmuls (a CPU, CUDA < 8.9): the numerics, slowly; for tests.
    fp8_emulate: bool = default_of("fp8_emulate")  # type: ignore[assignment]
    # fp16 dynamic loss scaling, DeepSpeed's keys and defaults (deepspeed/runtime/config.py).
    loss_scale: float = Field(0.0, ge=0.0)  # 0 = dynamic, > 0 = static scale
    initial_scale_power: int = Field(16, ge=0, le=63)
    loss_scale_window: int = Field(1000, gt=0)
    hysteresis: int = Field(2, gt=0)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0)
    raise_error_at_min_scale: bool = True  # DeepSpeed: an overflow at min_loss_scale ends the run

    @field_validator("dtype", mode="before")
    @classmethod
    def _fp8_is_a_switch(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() in ("fp8", "float8"):
            raise ValueError("FP8 is not a dtype here: pass --fp8 (precision.fp8 = true), which runs the "
                             "transformer blocks' matmuls in float8 and everything else in bf16")
        return v

    @model_validator(mode="after")
    def _emulate_needs_fp8(self) -> "PrecisionSection":
        if self.fp8_emulate and not self.fp8:
            raise UserError("precision.fp8_emulate (--fp8-emulate) emulates FP8 matmuls: it needs precision.fp8 (--fp8)")
        return self


class RecomputeSection(_Section):
    policy: str = default_of("recompute")  # type: ignore[assignment]  # tenfold.terms.RECOMPUTE_FORMS

    @field_validator("policy")
    @classmethod
    def _policy_parses(cls, v: str) -> str:
        return str(parse_recompute(v))


class ParallelSection(_Section):
    zero_stage: int = Field(default_of("zero_stage"), ge=min(allowed_of("zero_stage")), le=max(allowed_of("zero_stage")))
    nproc: int = Field(1, gt=0)  # processes per node: `tenfold train --nproc N` starts N local ranks
    # nodes the run spans (torchrun --nnodes on each); the run has nnodes x nproc processes
    nnodes: int = Field(1, gt=0)
    pp_degree: int = Field(default_of("pp"), gt=0)
    ep_degree: int = Field(default_of("ep"), gt=0)  # expert parallelism: MoE experts split over ep of the dp ranks
    tp_degree: int = Field(default_of("tp"), gt=0)  # tensor parallelism: each layer's matrices split over tp ranks
    sequence_parallel: bool | None = None  # None: on when tp_degree > 1 (tenfold.run.sequence_parallel_for)
    # context parallelism: each sequence split over cp ranks (techniques/context_parallel.py)
    cp_degree: int = Field(default_of("cp"), gt=0)
    pp_schedule: Literal[allowed_of("pp_schedule")] = default_of("pp_schedule")  # type: ignore[valid-type]
    virtual_stages: int | None = Field(None, gt=0)  # None: 2 for interleaved schedules, else 1
    pp_split: list[int] | None = None
    # Hybrid sharding (HSDP; DeepSpeed MiCS): ZeRO-2/3 shard inside groups of this many
    # data-parallel ranks and replicate across the groups. None: one group of every dp rank.
    shard_group_size: int | None = Field(None, gt=0)
    # ZeRO-Offload (tenfold.terms.OFFLOADS, techniques/offload.py, docs/zero.md): "optimizer" puts AdamW's
    # states and step in host memory; "optimizer+params" (ZeRO-3) the sharded parameters and gradients too
    offload: Literal[allowed_of("offload")] = default_of("offload")  # type: ignore[valid-type]
    param_persistence_threshold: int = Field(default_of("param_persistence_threshold"), ge=0)  # stage3_param_persistence_threshold
    reduce_bucket_size: int | None = None
    overlap_comm: bool | None = None
    contiguous_gradients: bool = default_of("contiguous_gradients")  # type: ignore[assignment]
    # The dtype data-parallel gradients are reduced in (DeepSpeed's communication_data_type).
    # fp32 (torchtitan's and Megatron's default): every partial sum exact to fp32. bf16: half
    # the bytes, each partial sum rounded to 8 mantissa bits (docs/precision.md).
    reduce_dtype: Literal[allowed_of("reduce_dtype")] = default_of("reduce_dtype")  # type: ignore[valid-type]
    timeout_s: float = Field(600.0, gt=0)
    # A rank whose step runs past max(watchdog x median step, watchdog_min_s) stops the job
    # (engine/observe/watchdog.py); 0 turns the watchdog off. Multi-process runs only.
    watchdog: float = Field(10.0, ge=0)
    watchdog_min_s: float = Field(30.0, gt=0)


class CheckpointSection(_Section):
    every: int = Field(0, ge=0)  # 0 = no periodic checkpoints
    keep_last: int | None = Field(None, gt=0)
    resume: str | None = None  # "auto" or a checkpoint path
    final: bool = True  # a checkpoint at the last step (resume and `tenfold export` start from it)
    export_16bit: bool = False  # stage3_gather_16bit_weights_on_model_save
    async_save: bool = False  # dcp.async_save: write in a background thread, finalise at a later step


class LoraSection(_Section):
    """Low-rank adapters (techniques/lora.py, docs/lora.md): rank 0 trains every weight."""

    rank: int = Field(0, ge=0)  # --lora RANK
    alpha: float | None = Field(None, gt=0)  # None: 2 x rank (torchtune's recipes: alpha 16 at rank 8)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # on the adapters' input (PEFT's lora_dropout)
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"], min_length=1)
    base: Literal["compute", "nf4"] = "compute"  # the frozen base: compute dtype, or NF4 (QLoRA, --qlora)

    @model_validator(mode="after")
    def _needs_a_rank(self) -> "LoraSection":
        defaults = LoraSection.model_construct()
        changed = [k for k in ("alpha", "dropout", "target_modules", "base") if getattr(self, k) != getattr(defaults, k)]
        if not self.rank and changed:
            raise UserError(f"{', '.join('lora.' + k for k in changed)} set but lora.rank is 0 (LoRA off): "
                            "pass --lora RANK (or --qlora RANK)")
        return self


class LogSection(_Section):
    out: str = "runs/tenfold"
    overwrite: bool = False  # replace an earlier run in `out` (engine/outputs/folder.py)
    log_every: int = Field(1, gt=0)  # metrics rows and plain console lines every N steps
    tensorboard: bool = True
    progress: bool = True  # the live bar on a terminal (plain lines otherwise)
    wandb: bool = False  # Weights & Biases (the wandb package: tenfold[wandb])
    wandb_project: str = "tenfold"
    wandb_name: str | None = None  # None: the output folder's name


class TenfoldConfig(_Section):
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    train: TrainSection = Field(default_factory=TrainSection)
    precision: PrecisionSection = Field(default_factory=PrecisionSection)
    recompute: RecomputeSection = Field(default_factory=RecomputeSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    log: LogSection = Field(default_factory=LogSection)

    @field_validator("model")
    @classmethod
    def _model_builds(cls, v: ModelSection) -> ModelSection:
        v.build()  # raises UserError on unknown preset / bad shape
        return v

    def model_config_resolved(self) -> ModelConfig:
        return self.model.build()

    def seq_len(self) -> int:
        mc = self.model.build()
        s = self.data.seq_len or mc.max_seq_len
        if s > mc.max_seq_len:
            raise UserError(
                f"data.seq_len ({s}) is above the model's context model.max_seq_len "
                f"({mc.max_seq_len}); use --seq-len <= {mc.max_seq_len} or set model.max_seq_len"
            )
        return s

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


# --------------------------------------------------------------------------- loading


def _format_validation_error(err: ValidationError, within: tuple = ()) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in (*within, *first["loc"]))
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        section = first["loc"][0] if len(first["loc"]) > 1 else None
        allowed = _allowed_keys(section)
        return f"unknown config key {loc!r}; allowed: {', '.join(allowed)}"
    return f"invalid value {first.get('input')!r} for {loc}: {msg.removeprefix('Value error, ')}"


def check_layer(layer: dict, source: str | None = None) -> None:
    """Each value of one layer (a config file, a DeepSpeed JSON, the flags, one --set) checked on
    its own against its key's type and range, so that a bad value is refused where it is written
    even when a later layer overrides it (`steps = "2"` in a file beside `--steps 3`). Rules over
    several keys, and unknown keys, are checked once the layers are merged (`build_config`)."""
    for section, values in layer.items():
        field = TenfoldConfig.model_fields.get(section) if isinstance(section, str) else None
        if field is None or not isinstance(values, dict):
            continue
        model = field.annotation
        for key, value in values.items():
            if key not in model.model_fields:  # type: ignore[union-attr]
                continue
            try:
                model.model_validate({key: value})  # type: ignore[union-attr]
            except ValidationError as e:
                if e.errors()[0]["loc"][:1] == (key,):  # not a rule over several keys
                    text = _format_validation_error(e, within=(section,))
                    raise UserError(f"{source}: {text}" if source else text) from None
            except UserError:
                pass  # a rule over several keys (e.g. fp8_emulate needs fp8): checked on the merged config


def _allowed_keys(section: str | int | None) -> list[str]:
    if section is None or section not in TenfoldConfig.model_fields:
        return list(TenfoldConfig.model_fields)
    ann = TenfoldConfig.model_fields[str(section)].annotation
    return list(ann.model_fields)  # type: ignore[union-attr]


def deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "schedule_params":
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_set_item(item: str) -> dict:
    """`section.key=value` -> {"section": {"key": value}}; value parsed as TOML, else a string."""
    if "=" not in item:
        raise UserError(f"--set expects section.key=value, got {item!r}")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise UserError(f"--set expects section.key=value (e.g. train.lr=3e-4), got {item!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return {parts[0]: {parts[1]: value}}


def load_toml(path: str | Path) -> dict:
    from tenfold.textfiles import read_text

    text = read_text(path, "config file")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"malformed TOML in {path}: {e}") from None


def build_config(*layers: dict, sources: tuple[str | None, ...] = ()) -> TenfoldConfig:
    """Merge dict layers (lowest precedence first) and validate into a `TenfoldConfig`; each
    layer's values are checked on their own first (`check_layer`; `sources` names the layers in
    its messages)."""
    merged: dict = {}
    for i, layer in enumerate(layers):
        if layer:
            check_layer(layer, sources[i] if i < len(sources) else None)
            merged = deep_merge(merged, layer)
    try:
        cfg = TenfoldConfig.model_validate(merged)
    except ValidationError as e:
        raise UserError(_format_validation_error(e)) from None
    cfg.seq_len()  # context check
    return cfg


# --------------------------------------------------------------------------- writing


def toml_literal(value: Any) -> str:
    """`value` as a TOML value (`--set section.key=<this>` reads it back): 3, 0.0003, "text",
    [1, 3], true, {"key" = 1}."""
    import json

    import tomli_w

    if isinstance(value, dict):  # inline table (tomli_w writes dicts as [sections])
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_literal(v)}" for k, v in value.items()) + "}"
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def config_toml(cfg: TenfoldConfig, always: dict[str, tuple[str, ...]] | None = None) -> str:
    """`cfg` as a TOML file that `load_toml` + `build_config` read back to the same config: the
    values that differ from the defaults, and the keys of `always` (section -> keys) even at
    their default, so that a reader sees them."""
    import tomli_w

    data = cfg.model_dump(mode="json", exclude_defaults=True)
    full = cfg.model_dump(mode="json")
    for section, keys in (always or {}).items():
        for key in keys:
            if full[section][key] is not None:
                data.setdefault(section, {})[key] = full[section][key]
    return tomli_w.dumps({s: data[s] for s in TenfoldConfig.model_fields if s in data})
