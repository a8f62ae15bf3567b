"""DeepSpeed's JSON config -> one `build_config` layer.

tenfold speaks DeepSpeed's vocabulary: a DeepSpeed config is read as it is. `KEYS` below is
the whole translation, one row per DeepSpeed key: the tenfold key it sets and the converter
that checks its value with DeepSpeed's meaning, or, for a key tenfold has no knob for, the
value at which it only restates what tenfold does anyway and is accepted quietly
(`bf16.check_grad_overflow: true`). Keys outside the table, and no-knob keys at any other
value, are collected as `unsupported`; the CLI names them all in one warning, never
silently. `"auto"` (Hugging Face's placeholder) and `null` mean "not given".

Where one DeepSpeed section means something only as a whole, a finishing function reads
its rows together (`SECTIONS`):
* precision: `fp16.enabled` -> fp16, `bf16.enabled` (alias `bfloat16`) -> bf16; a config
  that enables neither trains in fp32, as DeepSpeed does.
* optimizer: `Adam`/`AdamW` (any case) -> AdamW. DeepSpeed builds the optimizer from its
  `params` alone (`DeepSpeedEngine._configure_basic_optimizer`), so what they omit takes the
  constructor's defaults: FusedAdam's lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0;
  with `torch_adam: true`, torch.optim.AdamW's weight_decay 0.01 (torch.optim.Adam's 0 when
  `adam_w_mode` is false). `Adam` decays decoupled unless `adam_w_mode: false`; that L2 form
  is not available in tenfold and is reported when it would decay anything.
* scheduler: `type`/`params` -> train.schedule/schedule_params, validated here; a given
  `warmup_max_lr` also becomes train.lr (the peak lr shown in metrics) when the optimizer
  gives none; WarmupDecayLR's DeepSpeed default `warmup_max_lr = 0.001` is made explicit.
* activation_checkpointing: DeepSpeed only configures the checkpoint function the model
  calls. `cpu_checkpointing: true` -> recompute.policy "offload"; `number_checkpoints: K`
  -> "segments:K" (K checkpointed segments; DeepSpeed sizes its contiguous buffers by K).
* `pipeline.activation_checkpoint_interval: N > 0` -> recompute.policy "every:N".
* zero_optimization: `offload_param` / `offload_optimizer` with device cpu (or the older
  `cpu_offload_param` / `cpu_offload`) -> parallel.offload "optimizer+params" / "optimizer";
  device nvme is refused. `mics_shard_size: N` -> parallel.shard_group_size N (hybrid
  sharding); `zero_hpz_partition_size: N` too, with a notice: ZeRO++ hpZ shards gradients and
  optimizer states over every rank, tenfold's hybrid sharding within the group.
Reading the file (comments, trailing commas, Python's True/False/None) is
`tenfold.deepspeed_text`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from tenfold.errors import UserError
from tenfold.lr_schedule import DEEPSPEED, validate_schedule_params

_NO_KNOB = object()  # Key.quiet_at for keys that do have a tenfold knob


class _Reader:
    """The file being translated, and the keys found unsupported so far."""

    def __init__(self, path: Path):
        self.path = path
        self.unsupported: list[str] = []
        self.notes: list[str] = []  # keys read with a meaning that differs from DeepSpeed's, one line each

    def bad(self, key: str, value: Any, allowed: str) -> UserError:
        return UserError(f"invalid value {value!r} for DeepSpeed key {key!r} in {self.path}: {allowed}")

    def section(self, key: str, v: Any) -> dict:
        if not isinstance(v, dict):
            raise self.bad(key, v, "expected a JSON object")
        return v


Convert = Callable[[_Reader, str, Any], Any]


@dataclass(frozen=True)
class Key:
    """One DeepSpeed key. `target`: the tenfold `section.key` its converted value sets (None:
    its section's finishing function reads it). `quiet_at`: for a key with no tenfold knob,
    the value that restates tenfold's behaviour; any other value is reported unsupported."""

    target: str | None = None
    convert: Convert | None = None
    quiet_at: Any = _NO_KNOB


# --------------------------------------------------------------------------- converters


def flag(r: _Reader, key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise r.bad(key, v, "expected true or false")
    return v


def number(minimum: float | None = None, *, positive: bool = False) -> Convert:
    def convert(r: _Reader, key: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise r.bad(key, v, "expected a finite number")
        if positive and v <= 0:
            raise r.bad(key, v, "expected a number > 0")
        if minimum is not None and v < minimum:
            raise r.bad(key, v, f"expected a number >= {minimum:g}")
        return float(v)

    return convert


def integer(minimum: int | None = None, maximum: int | None = None) -> Convert:
    def convert(r: _Reader, key: str, v: Any) -> int:
        # DeepSpeed configs often write integers as 1e4 / 5e8 (JSON floats)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not float(v).is_integer():
            raise r.bad(key, v, "expected an integer")
        if maximum is not None and not (minimum or 0) <= v <= maximum:
            choices = [str(i) for i in range(minimum or 0, maximum + 1)]
            raise r.bad(key, v, f"expected {', '.join(choices[:-1])} or {choices[-1]}")
        if minimum is not None and v < minimum:
            raise r.bad(key, v, f"expected an integer >= {minimum}")
        return int(v)

    return convert


# Keys of DeepSpeed's offload_optimizer / offload_param objects that configure only its NVMe
# swapper or its own CPU Adam, and so mean nothing for tenfold's CPU offload.
_OFFLOAD_QUIET = ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline", "pipeline_read",
                  "pipeline_write")


def _offload_device(r: _Reader, key: str, v: Any) -> bool:
    """ZeRO-Offload (`device`: none | cpu | nvme) -> True when it offloads to host memory. tenfold
    offloads to host memory only: NVMe (ZeRO-Infinity) is refused. `pin_memory: false` and a
    partial `ratio` are reported: tenfold pins on CUDA and offloads every shard."""
    section = r.section(key, v)
    device = section.get("device", "none")
    if device in (None, "none"):
        return False
    if device != "cpu":
        raise r.bad(f"{key}.device", device, "tenfold offloads to host memory; "
                    "allowed: none, cpu (NVMe offload is not available)")
    for k, value in section.items():
        quiet = k in ("device", *_OFFLOAD_QUIET) or (k == "pin_memory" and value is True) or (k == "ratio" and value == 1)
        if not quiet and not _is_auto(value):
            r.unsupported.append(f"{key}.{k}={json.dumps(value)}")
    return True


def _disabled_below(limit: int, minimum: int | None = None) -> Convert:
    """An integer for which DeepSpeed's values below `limit` (its defaults -1 and 1) mean off;
    `minimum`: the lowest value DeepSpeed's own config accepts."""
    def convert(r: _Reader, key: str, v: Any) -> int | None:
        n = integer(minimum)(r, key, v)
        return n if n >= limit else None

    return convert


def _communication_dtype(r: _Reader, key: str, v: Any) -> str | None:
    """DeepSpeed's `communication_data_type` (deepspeed/runtime/config.py: fp32, fp16 or bf16,
    any case) -> parallel.reduce_dtype. fp16 reduction is DeepSpeed's, not tenfold's: reported,
    and tenfold reduces in fp32."""
    value = v.lower() if isinstance(v, str) else v
    if value in ("fp32", "bf16"):
        return value
    if value == "fp16":
        r.unsupported.append(f"{key}={json.dumps(v)} (tenfold reduces in fp32 or bf16)")
        return None
    raise r.bad(key, v, "allowed: fp32, bf16 (fp16 is reported and reduced in fp32)")


def _optimizer_type(r: _Reader, key: str, v: Any) -> str:
    if not isinstance(v, str) or v.lower() not in ("adam", "adamw"):
        raise r.bad(key, v, "tenfold trains with AdamW; allowed: Adam, AdamW")
    return v.lower()


def _betas(r: _Reader, key: str, v: Any) -> list[float]:
    if not (isinstance(v, list) and len(v) == 2):
        raise r.bad(key, v, "expected [beta1, beta2]")
    return [number(0)(r, key, b) for b in v]


def _refused(allowed: str) -> Convert:
    def convert(r: _Reader, key: str, v: Any) -> None:
        raise r.bad(key, v, allowed)

    return convert


def _scheduler_type(r: _Reader, key: str, v: Any) -> str:
    if v not in DEEPSPEED:
        raise r.bad(key, v, f"allowed: {', '.join(DEEPSPEED)}")
    return v


def _interval(r: _Reader, key: str, v: Any) -> str | None:
    n = integer(0)(r, key, v)
    return f"every:{n}" if n > 0 else None


def _the_object(r: _Reader, key: str, v: Any) -> dict:
    return r.section(key, v)


# --------------------------------------------------------------------------- the table

KEYS: dict[str, Key] = {
    # batch triplet, clipping, logging
    "train_batch_size": Key("train.global_batch", integer(1)),
    "train_micro_batch_size_per_gpu": Key("train.micro_batch", integer(1)),
    "gradient_accumulation_steps": Key("train.grad_accum", integer(1)),
    "gradient_clipping": Key("train.grad_clip", number(0)),
    "steps_per_print": Key("log.log_every", integer(1)),
    "wall_clock_breakdown": Key(quiet_at=False),
    "prescale_gradients": Key(quiet_at=False),
    "gradient_predivide_factor": Key(quiet_at=1.0),
    "zero_allow_untested_optimizer": Key(quiet_at=False),
    "memory_breakdown": Key(quiet_at=False),
    "dump_state": Key(quiet_at=False),
    "sparse_gradients": Key(quiet_at=False),
    "disable_allgather": Key(quiet_at=False),
    "communication_data_type": Key("parallel.reduce_dtype", _communication_dtype),
    # fp16 and its dynamic loss scaler (same names in [precision])
    "fp16.enabled": Key(None, flag),
    "fp16.loss_scale": Key("precision.loss_scale", number(0)),
    "fp16.initial_scale_power": Key("precision.initial_scale_power", integer(0)),
    "fp16.loss_scale_window": Key("precision.loss_scale_window", integer(1)),
    "fp16.hysteresis": Key("precision.hysteresis", integer(1)),
    "fp16.consecutive_hysteresis": Key("precision.consecutive_hysteresis", flag),
    "fp16.min_loss_scale": Key("precision.min_loss_scale", number(positive=True)),
    "fp16.auto_cast": Key(quiet_at=False),
    "fp16.fp16_master_weights_and_grads": Key(quiet_at=False),
    # bf16 (alias bfloat16): tenfold never applies a non-finite step (train.on_nan) and keeps
    # fp32 master weights and optimizer states
    "bf16.enabled": Key(None, flag),
    "bf16.check_grad_overflow": Key(quiet_at=True),
    "bf16.immediate_grad_update": Key(quiet_at=False),
    "bf16.bf16_master_weights_and_grads": Key(quiet_at=False),
    "bf16.bf16_optimizer_states": Key(quiet_at=False),
    # ZeRO
    "zero_optimization.stage": Key("parallel.zero_stage", integer(0, 3)),
    "zero_optimization.stage3_param_persistence_threshold": Key("parallel.param_persistence_threshold", integer(0)),
    "zero_optimization.reduce_bucket_size": Key("parallel.reduce_bucket_size", integer(1)),
    "zero_optimization.overlap_comm": Key("parallel.overlap_comm", flag),
    "zero_optimization.contiguous_gradients": Key("parallel.contiguous_gradients", flag),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": Key("checkpoint.export_16bit", flag),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": Key("checkpoint.export_16bit", flag),
    "zero_optimization.offload_optimizer": Key(None, _offload_device),
    "zero_optimization.offload_param": Key(None, _offload_device),
    # hybrid sharding: MiCS shards inside groups of N ranks and replicates across them, as
    # parallel.shard_group_size does (-1: off); ZeRO++ hpZ (1: off) is read the same way, with a note
    "zero_optimization.mics_shard_size": Key("parallel.shard_group_size", _disabled_below(1)),
    "zero_optimization.mics_hierarchical_params_gather": Key(quiet_at=False),
    # DeepSpeedZeroConfig: zero_hpz_partition_size = Field(1, ge=0)
    "zero_optimization.zero_hpz_partition_size": Key(None, _disabled_below(2, minimum=0)),
    "zero_optimization.reduce_scatter": Key(quiet_at=True),
    "zero_optimization.allgather_partitions": Key(quiet_at=True),
    "zero_optimization.load_from_fp32_weights": Key(quiet_at=True),
    "zero_optimization.ignore_unused_parameters": Key(quiet_at=True),
    "zero_optimization.round_robin_gradients": Key(quiet_at=False),
    "zero_optimization.cpu_offload": Key(None, flag),  # DeepSpeed's older spelling of offload_optimizer cpu
    "zero_optimization.cpu_offload_param": Key(None, flag),  # ... and of offload_param cpu
    "zero_optimization.elastic_checkpoint": Key(quiet_at=False),
    # optimizer: values checked here, defaults and decay form in _finish_optimizer
    "optimizer.type": Key(None, _optimizer_type),
    "optimizer.params.lr": Key("train.lr", number(0)),
    "optimizer.params.eps": Key("train.eps", number(0)),
    "optimizer.params.weight_decay": Key("train.weight_decay", number(0)),
    "optimizer.params.betas": Key(None, _betas),
    "optimizer.params.torch_adam": Key(None, flag),
    "optimizer.params.adam_w_mode": Key(None, flag),
    "optimizer.params.max_grad_norm": Key(None, _refused("use gradient_clipping instead")),  # DeepSpeed raises too
    "optimizer.params.bias_correction": Key(quiet_at=True),
    "optimizer.params.fp32_optimizer_states": Key(quiet_at=True),
    "optimizer.params.amsgrad": Key(quiet_at=False),
    # scheduler: validated in _finish_scheduler
    "scheduler.type": Key(None, _scheduler_type),
    "scheduler.params": Key(None, _the_object),
    # activation checkpointing: combined in _finish_activation_checkpointing
    "activation_checkpointing.cpu_checkpointing": Key(None, flag),
    "activation_checkpointing.number_checkpoints": Key(None, integer(1)),
    "activation_checkpointing.partition_activations": Key(quiet_at=False),
    "activation_checkpointing.contiguous_memory_optimization": Key(quiet_at=False),
    "activation_checkpointing.synchronize_checkpoint_boundary": Key(quiet_at=False),
    "activation_checkpointing.profile": Key(quiet_at=False),
    "pipeline.activation_checkpoint_interval": Key("recompute.policy", _interval),
    "tensorboard.enabled": Key("log.tensorboard", flag),
}
ALIASES = {"bfloat16": "bf16"}  # DeepSpeed accepts both spellings of the bf16 section


# --------------------------------------------------------------------------- sections


def _finish_optimizer(r: _Reader, seen: dict, layer: dict) -> None:
    if "optimizer.type" not in seen:
        raise r.bad("optimizer.type", None, "tenfold trains with AdamW; allowed: Adam, AdamW")
    torch_adam = seen.get("optimizer.params.torch_adam", False)
    # "Optimizer name of Adam forces AdamW logic unless adam_w_mode is explicitly set"
    # (DeepSpeed's engine); adam_w_mode defaults to true
    decoupled = seen["optimizer.type"] == "adamw" or seen.get("optimizer.params.adam_w_mode", True)
    train = layer.setdefault("train", {})
    # torch.optim.AdamW defaults weight_decay to 0.01, torch.optim.Adam and FusedAdam to 0
    defaults = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.01 if torch_adam and decoupled else 0.0}
    for k, v in defaults.items():
        train.setdefault(k, v)
    train["beta1"], train["beta2"] = seen.get("optimizer.params.betas", [0.9, 0.999])
    if not decoupled and train["weight_decay"] > 0:
        r.unsupported.append("optimizer.params.adam_w_mode=false (tenfold decays decoupled, as AdamW)")


def _finish_scheduler(r: _Reader, seen: dict, layer: dict) -> None:
    kind = seen.get("scheduler.type")
    if kind is None:
        kind = _scheduler_type(r, "scheduler.type", None)
    params = {k: v for k, v in seen.get("scheduler.params", {}).items() if not _is_auto(v)}
    if kind == "WarmupDecayLR" and "warmup_max_lr" not in params:
        params["warmup_max_lr"] = 0.001  # DeepSpeed's default for WarmupDecayLR, made explicit
    validate_schedule_params(kind, params, total_steps=1)  # same messages as build_scheduler
    _put(layer, "train.schedule", kind)
    _put(layer, "train.schedule_params", params)
    if params.get("warmup_max_lr") is not None and "lr" not in layer.get("train", {}):
        _put(layer, "train.lr", float(params["warmup_max_lr"]))


def _finish_activation_checkpointing(r: _Reader, seen: dict, layer: dict) -> None:
    number = seen.get("activation_checkpointing.number_checkpoints")
    if seen.get("activation_checkpointing.cpu_checkpointing", False):
        _put(layer, "recompute.policy", "offload")
        if number is not None:
            r.unsupported.append(f"activation_checkpointing.number_checkpoints={number} (with cpu_checkpointing)")
    elif number is not None:
        _put(layer, "recompute.policy", f"segments:{number}")


def _finish_zero(r: _Reader, seen: dict, layer: dict) -> None:
    """Offload: offload_optimizer -> "optimizer" (Adam's states and update on the host, the
    parameters on the device, as DeepSpeed runs it); offload_param (ZeRO-3) -> "optimizer+params",
    with or without offload_optimizer (FSDP2's CPUOffloadPolicy moves the parameter shards and so
    the optimizer states built on them: techniques/offload.py). hpZ -> the shard group."""
    z = "zero_optimization."
    if seen.get(z + "offload_param") or seen.get(z + "cpu_offload_param"):
        _put(layer, "parallel.offload", "optimizer+params")
    elif seen.get(z + "offload_optimizer") or seen.get(z + "cpu_offload"):
        _put(layer, "parallel.offload", "optimizer")
    hpz = seen.get(z + "zero_hpz_partition_size")
    if hpz is None:
        return
    mics = layer.get("parallel", {}).get("shard_group_size")
    if mics is not None and mics != hpz:
        raise UserError(f"{r.path}: zero_optimization.mics_shard_size ({mics}) and zero_hpz_partition_size ({hpz}) "
                        "both set tenfold's shard group (parallel.shard_group_size); give one")
    _put(layer, "parallel.shard_group_size", hpz)
    r.notes.append(
        f"{r.path}: zero_optimization.zero_hpz_partition_size={hpz} is read as hybrid sharding "
        f"(parallel.shard_group_size={hpz}, DeepSpeed's mics_shard_size): gradients and optimizer states are "
        f"sharded within groups of {hpz} ranks too, not over every rank as ZeRO++ hpZ does (more memory per rank)"
    )


def _finish_precision(r: _Reader, seen: dict, layer: dict) -> None:
    fp16, bf16 = seen.get("fp16.enabled", False), seen.get("bf16.enabled", False)
    if fp16 and bf16:
        raise UserError(f"{r.path}: fp16 and bf16 cannot both be enabled (DeepSpeed rejects this too)")
    # DeepSpeed trains in fp32 unless fp16 or bf16 is enabled
    _put(layer, "precision.dtype", "fp16" if fp16 else "bf16" if bf16 else "fp32")


# Sections (objects) of a DeepSpeed config and what finishes each once its keys are read.
# The scheduler and the precision are finished after the whole file (`translate`): the
# scheduler may take the optimizer's lr, and fp16/bf16 are two sections.
SECTIONS: dict[str, Callable[[_Reader, dict, dict], None] | None] = {
    "fp16": None, "bf16": None, "zero_optimization": _finish_zero, "optimizer": _finish_optimizer,
    "optimizer.params": None, "scheduler": None,
    "activation_checkpointing": _finish_activation_checkpointing, "pipeline": None, "tensorboard": None,
}


# --------------------------------------------------------------------------- the walk


def _put(layer: dict, dotted: str, value: Any) -> None:
    section, key = dotted.split(".")
    layer.setdefault(section, {})[key] = value


def _is_auto(v: Any) -> bool:
    """`"auto"` (Hugging Face's placeholder) or JSON null: the key is treated as not given."""
    return v is None or (isinstance(v, str) and v.lower() == "auto")


def _canonical(dotted: str) -> str:
    head, _, rest = dotted.partition(".")
    return ALIASES.get(head, head) + (f".{rest}" if rest else "")


def _apply(r: _Reader, name: str, key: Key, v: Any, seen: dict, layer: dict) -> None:
    """One DeepSpeed value, `name` as the user spelled it: reported, recorded and/or set."""
    if key.quiet_at is not _NO_KNOB:
        if v != key.quiet_at:
            r.unsupported.append(f"{name}={json.dumps(v)}")
        return
    value = key.convert(r, name, v) if key.convert else v
    seen[_canonical(name)] = value
    if key.target is not None and value is not None:
        _put(layer, key.target, value)


def _walk(r: _Reader, obj: dict, prefix: str, seen: dict, layer: dict) -> None:
    for k, v in obj.items():
        name = f"{prefix}{k}"
        canonical = _canonical(name)
        if _is_auto(v):
            continue
        if canonical in SECTIONS:
            _walk(r, r.section(name, v), name + ".", seen, layer)
            seen[canonical] = True
            finish = SECTIONS[canonical]
            if finish is not None:
                finish(r, seen, layer)
        elif canonical in KEYS:
            _apply(r, name, KEYS[canonical], v, seen, layer)
        else:
            r.unsupported.append(name)


def translate(config: dict, path: str | Path = "<config>") -> tuple[dict, list[str]]:
    """A parsed DeepSpeed config -> (config layer for `build_config`, unsupported keys)."""
    layer, r = _translate(config, path)
    return layer, r.unsupported


def _translate(config: dict, path: str | Path) -> tuple[dict, _Reader]:
    r = _Reader(Path(path))
    seen: dict[str, Any] = {}
    layer: dict = {}
    _walk(r, config, "", seen, layer)
    if "scheduler" in seen:
        _finish_scheduler(r, seen, layer)
    _finish_precision(r, seen, layer)
    return layer, r


class DeepSpeedConfig(NamedTuple):
    layer: dict  # tenfold's sections, for `build_config`
    unsupported: list[str]  # keys tenfold does not honour, as the user wrote them
    notices: list[str]  # what was read leniently (Python's True/False/None) or with another meaning, one line each


def load_deepspeed_json(path: str | Path) -> DeepSpeedConfig:
    """Read a DeepSpeed config file as DeepSpeed does (`tenfold.deepspeed_text`), and translate it."""
    from tenfold.deepspeed_text import read_deepspeed_text

    config, notices = read_deepspeed_text(Path(path))
    layer, r = _translate(config, path)
    return DeepSpeedConfig(layer, r.unsupported, [*notices, *r.notes])


def unsupported_warning(path: str | Path, unsupported: list[str]) -> str | None:
    """The one warning line the CLI prints for the keys tenfold ignores (None if none)."""
    if not unsupported:
        return None
    return f"{path}: DeepSpeed keys not supported by tenfold (ignored): {', '.join(unsupported)}"
