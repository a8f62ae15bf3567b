"""DeepSpeed's JSON config -> one `build_config` layer (DESIGN: "the seed's words are the
vocabulary"). Keys, defaults and meanings follow DeepSpeed's code (engine.md §2).

`load_deepspeed_json(path)` returns `(layer, unsupported)`: `layer` is a dict in tenfold's
sections (model/data/train/precision/recompute/parallel/checkpoint/log) and `unsupported`
names every key tenfold does not honour (`"fp16.auto_cast=true"`, `"wandb"`, ...); the CLI
prints them in ONE warning, never silently. A key whose value only restates what tenfold
does anyway (e.g. `bf16.check_grad_overflow: true`, `zero_optimization.reduce_scatter:
true`) is accepted quietly. `"auto"` values (Hugging Face's convention) and `null` mean "not given".

Mapping decisions (documented in docs/precision.md):
* precision: `fp16.enabled` -> fp16, `bf16.enabled` (alias `bfloat16`) -> bf16, and a
  DeepSpeed config that enables neither means fp32, as it does in DeepSpeed.
* optimizer: `Adam`/`AdamW` (any case) -> AdamW; DeepSpeed's Adam is decoupled by default
  (`adam_w_mode: true`). Missing params take DeepSpeed's constructor defaults (lr 1e-3,
  betas (0.9, 0.999), eps 1e-8, weight_decay 0), not tenfold's.
* scheduler: `type`/`params` -> train.schedule/schedule_params, validated here; a given
  `warmup_max_lr` also becomes train.lr (the peak lr shown in metrics) when the optimizer
  gives none; WarmupDecayLR's DeepSpeed default `warmup_max_lr = 0.001` is made explicit.
* activation_checkpointing: DeepSpeed only configures the checkpoint function the model
  calls. `cpu_checkpointing: true` -> recompute.policy "offload"; `number_checkpoints: K`
  -> "segments:K" (K checkpointed segments; DeepSpeed uses K to size its contiguous
  buffers, one per checkpoint). Neither given: the recompute policy is left as it is.
* `pipeline.activation_checkpoint_interval: N > 0` -> recompute.policy "every:N".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from tenfold.errors import UserError

class _Reader:
    """Walks one JSON object, converting values and recording unsupported keys."""

    def __init__(self, path: Path, unsupported: list[str]):
        self.path = path
        self.unsupported = unsupported

    def bad(self, key: str, value: Any, allowed: str) -> UserError:
        return UserError(f"invalid value {value!r} for DeepSpeed key {key!r} in {self.path}: {allowed}")

    def as_bool(self, key: str, v: Any) -> bool:
        if not isinstance(v, bool):
            raise self.bad(key, v, "expected true or false")
        return v

    def as_number(self, key: str, v: Any, minimum: float | None = None) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.bad(key, v, "expected a finite number")
        if minimum is not None and v < minimum:
            raise self.bad(key, v, f"expected a number >= {minimum:g}")
        return v

    def as_int(self, key: str, v: Any, minimum: int | None = None) -> int:
        # DeepSpeed configs often write integers as 1e4 / 5e8 (JSON floats)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer():
            raise self.bad(key, v, "expected an integer")
        if minimum is not None and v < minimum:
            raise self.bad(key, v, f"expected an integer >= {minimum}")
        return int(v)

    def section(self, key: str, v: Any) -> dict:
        if not isinstance(v, dict):
            raise self.bad(key, v, "expected a JSON object")
        return v

    def keep_if(self, key: str, v: Any, accepted: Any) -> None:
        """A key tenfold has no knob for: fine when it says what tenfold does anyway."""
        if v != accepted:
            self.unsupported.append(f"{key}={json.dumps(v)}")


def _put(layer: dict, dotted: str, value: Any) -> None:
    section, key = dotted.split(".")
    layer.setdefault(section, {})[key] = value


def _is_auto(v: Any) -> bool:
    """`"auto"` (Hugging Face's placeholder) or JSON null: the key is treated as not given."""
    return v is None or (isinstance(v, str) and v.lower() == "auto")


# --------------------------------------------------------------------------- sections


def _read_fp16(r: _Reader, sec: dict, layer: dict) -> bool:
    enabled = False
    for k, v in sec.items():
        key = f"fp16.{k}"
        if _is_auto(v):
            continue
        if k == "enabled":
            enabled = r.as_bool(key, v)
        elif k == "loss_scale":
            _put(layer, "precision.loss_scale", float(r.as_number(key, v, 0)))
        elif k == "initial_scale_power":
            _put(layer, "precision.initial_scale_power", r.as_int(key, v, 0))
        elif k == "loss_scale_window":
            _put(layer, "precision.loss_scale_window", r.as_int(key, v, 1))
        elif k == "hysteresis":
            _put(layer, "precision.hysteresis", r.as_int(key, v, 1))
        elif k == "consecutive_hysteresis":
            _put(layer, "precision.consecutive_hysteresis", r.as_bool(key, v))
        elif k == "min_loss_scale":
            min_scale = float(r.as_number(key, v))
            if min_scale <= 0:
                raise r.bad(key, v, "expected a number > 0")
            _put(layer, "precision.min_loss_scale", min_scale)
        elif k in ("auto_cast", "fp16_master_weights_and_grads"):
            r.keep_if(key, v, False)
        else:
            r.unsupported.append(key)
    return enabled


def _read_bf16(r: _Reader, name: str, sec: dict) -> bool:
    enabled = False
    for k, v in sec.items():
        key = f"{name}.{k}"
        if _is_auto(v):
            continue
        if k == "enabled":
            enabled = r.as_bool(key, v)
        elif k == "check_grad_overflow":
            r.keep_if(key, v, True)  # tenfold never applies a non-finite step (train.on_nan: stop|skip)
        elif k in ("immediate_grad_update", "bf16_master_weights_and_grads", "bf16_optimizer_states"):
            r.keep_if(key, v, False)  # tenfold keeps fp32 master weights and optimizer states
        else:
            r.unsupported.append(key)
    return enabled


_ZERO_KEEP = {  # zero_optimization keys with no PyTorch knob, accepted at these values
    "reduce_scatter": True, "allgather_partitions": True, "load_from_fp32_weights": True,
    "ignore_unused_parameters": True, "round_robin_gradients": False, "cpu_offload": False,
    "cpu_offload_param": False, "elastic_checkpoint": False,
}


def _read_zero(r: _Reader, sec: dict, layer: dict) -> None:
    for k, v in sec.items():
        key = f"zero_optimization.{k}"
        if _is_auto(v):
            continue
        if k == "stage":
            stage = r.as_int(key, v, 0)
            if stage > 3:
                raise r.bad(key, v, "expected 0, 1, 2 or 3")
            _put(layer, "parallel.zero_stage", stage)
        elif k == "stage3_param_persistence_threshold":
            _put(layer, "parallel.param_persistence_threshold", r.as_int(key, v, 0))
        elif k == "reduce_bucket_size":
            _put(layer, "parallel.reduce_bucket_size", r.as_int(key, v, 1))
        elif k in ("overlap_comm", "contiguous_gradients"):
            _put(layer, f"parallel.{k}", r.as_bool(key, v))
        elif k in ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"):
            _put(layer, "checkpoint.export_16bit", r.as_bool(key, v))
        elif k in ("offload_optimizer", "offload_param"):
            device = r.section(key, v).get("device", "none") if v is not None else "none"
            if device != "none":
                r.unsupported.append(f"{key}.device={json.dumps(device)}")
        elif k in _ZERO_KEEP:
            r.keep_if(key, v, _ZERO_KEEP[k])
        else:
            r.unsupported.append(key)


def _read_optimizer(r: _Reader, sec: dict, layer: dict) -> None:
    kind = sec.get("type")
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        raise r.bad("optimizer.type", kind, "tenfold trains with AdamW; allowed: Adam, AdamW")
    for k in sec:
        if k not in ("type", "params"):
            r.unsupported.append(f"optimizer.{k}")
    params = r.section("optimizer.params", sec.get("params", {}))
    if "max_grad_norm" in params:  # DeepSpeed raises here too
        raise r.bad("optimizer.params.max_grad_norm", params["max_grad_norm"], "use gradient_clipping instead")
    # DeepSpeed builds the optimizer from these params alone, so its constructor defaults
    # apply (engine.py `_configure_basic_optimizer`): FusedAdam lr 1e-3, betas (0.9, 0.999),
    # eps 1e-8, weight_decay 0; with torch_adam torch.optim.AdamW, whose weight_decay is 0.01.
    torch_adam = params.get("torch_adam", False) is True
    values = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01 if torch_adam else 0.0}
    # "Adam" is decoupled (AdamW) unless adam_w_mode is false; "AdamW" always is
    decoupled = kind.lower() == "adamw" or params.get("adam_w_mode", True) is not False
    for k, v in params.items():
        key = f"optimizer.params.{k}"
        if _is_auto(v):
            continue
        if k in ("lr", "eps", "weight_decay"):
            values[k] = float(r.as_number(key, v, 0))
        elif k == "betas":
            if not (isinstance(v, list) and len(v) == 2):
                raise r.bad(key, v, "expected [beta1, beta2]")
            values[k] = [float(r.as_number(key, b, 0)) for b in v]
        elif k in ("torch_adam", "adam_w_mode"):
            r.as_bool(key, v)  # implementation choice / handled by `decoupled`
        elif k in ("bias_correction", "fp32_optimizer_states"):
            r.keep_if(key, v, True)
        elif k == "amsgrad":
            r.keep_if(key, v, False)
        else:
            r.unsupported.append(key)
    if not decoupled and values["weight_decay"] > 0:
        r.unsupported.append("optimizer.params.adam_w_mode=false (tenfold decays decoupled, as AdamW)")
    for k in ("lr", "eps", "weight_decay"):
        _put(layer, f"train.{k}", values[k])
    _put(layer, "train.beta1", values["betas"][0])
    _put(layer, "train.beta2", values["betas"][1])


def _read_scheduler(r: _Reader, sec: dict, layer: dict) -> None:
    from tenfold.engine.schedule import DEEPSPEED, validate_schedule_params

    kind = sec.get("type")
    if kind not in DEEPSPEED:
        raise r.bad("scheduler.type", kind, f"allowed: {', '.join(DEEPSPEED)}")
    for k in sec:
        if k not in ("type", "params"):
            r.unsupported.append(f"scheduler.{k}")
    params = {k: v for k, v in r.section("scheduler.params", sec.get("params", {})).items() if not _is_auto(v)}
    if kind == "WarmupDecayLR" and "warmup_max_lr" not in params:
        params["warmup_max_lr"] = 0.001  # DeepSpeed's default for WarmupDecayLR, made explicit
    validate_schedule_params(kind, params, total_steps=1)  # same messages as build_scheduler
    _put(layer, "train.schedule", kind)
    _put(layer, "train.schedule_params", params)
    if params.get("warmup_max_lr") is not None and "lr" not in layer.get("train", {}):
        _put(layer, "train.lr", float(params["warmup_max_lr"]))


def _read_activation_checkpointing(r: _Reader, sec: dict, layer: dict) -> None:
    offload, number = False, None
    for k, v in sec.items():
        key = f"activation_checkpointing.{k}"
        if _is_auto(v):
            continue
        if k == "cpu_checkpointing":
            offload = r.as_bool(key, v)
        elif k == "number_checkpoints":
            number = None if v is None else r.as_int(key, v, 1)
        elif k in ("partition_activations", "contiguous_memory_optimization",
                   "synchronize_checkpoint_boundary", "profile"):
            r.keep_if(key, v, False)
        else:
            r.unsupported.append(key)
    if offload:
        _put(layer, "recompute.policy", "offload")
        if number is not None:
            r.unsupported.append(f"activation_checkpointing.number_checkpoints={number} (with cpu_checkpointing)")
    elif number is not None:
        _put(layer, "recompute.policy", f"segments:{number}")


def _read_pipeline(r: _Reader, sec: dict, layer: dict) -> None:
    for k, v in sec.items():
        key = f"pipeline.{k}"
        if k == "activation_checkpoint_interval":
            n = r.as_int(key, v, 0)
            if n > 0:
                _put(layer, "recompute.policy", f"every:{n}")
        else:
            r.unsupported.append(key)


def _read_tensorboard(r: _Reader, sec: dict, layer: dict) -> None:
    for k, v in sec.items():
        if k == "enabled":
            _put(layer, "log.tensorboard", r.as_bool(f"tensorboard.{k}", v))
        else:
            r.unsupported.append(f"tensorboard.{k}")


# --------------------------------------------------------------------------- top level

_TOP_SCALARS: dict[str, tuple[str, Callable[[_Reader, str, Any], Any]]] = {
    "train_batch_size": ("train.global_batch", lambda r, k, v: r.as_int(k, v, 1)),
    "train_micro_batch_size_per_gpu": ("train.micro_batch", lambda r, k, v: r.as_int(k, v, 1)),
    "gradient_accumulation_steps": ("train.grad_accum", lambda r, k, v: r.as_int(k, v, 1)),
    "gradient_clipping": ("train.grad_clip", lambda r, k, v: float(r.as_number(k, v, 0))),
    "steps_per_print": ("log.log_every", lambda r, k, v: r.as_int(k, v, 1)),
}
_TOP_KEEP = {  # top-level keys accepted at these values (what tenfold does anyway)
    "wall_clock_breakdown": False, "prescale_gradients": False, "gradient_predivide_factor": 1.0,
    "zero_allow_untested_optimizer": False, "memory_breakdown": False, "dump_state": False,
    "sparse_gradients": False, "disable_allgather": False,
}


def _read_top(r: _Reader, cfg: dict, layer: dict) -> None:
    fp16 = bf16 = False
    for k, v in cfg.items():
        if _is_auto(v):
            continue
        if k in _TOP_SCALARS:
            target, convert = _TOP_SCALARS[k]
            _put(layer, target, convert(r, k, v))
        elif k == "fp16":
            fp16 = _read_fp16(r, r.section(k, v), layer)
        elif k in ("bf16", "bfloat16"):
            bf16 = _read_bf16(r, k, r.section(k, v))
        elif k == "zero_optimization":
            _read_zero(r, r.section(k, v), layer)
        elif k == "optimizer":
            _read_optimizer(r, r.section(k, v), layer)
        elif k == "scheduler":
            continue  # after the optimizer: it may need the optimizer's lr
        elif k == "activation_checkpointing":
            _read_activation_checkpointing(r, r.section(k, v), layer)
        elif k == "pipeline":
            _read_pipeline(r, r.section(k, v), layer)
        elif k == "tensorboard":
            _read_tensorboard(r, r.section(k, v), layer)
        elif k in _TOP_KEEP:
            r.keep_if(k, v, _TOP_KEEP[k])
        else:
            r.unsupported.append(k)
    if "scheduler" in cfg and not _is_auto(cfg["scheduler"]):
        _read_scheduler(r, r.section("scheduler", cfg["scheduler"]), layer)
    if fp16 and bf16:
        raise UserError(f"{r.path}: fp16 and bf16 cannot both be enabled (DeepSpeed rejects this too)")
    # DeepSpeed trains in fp32 unless fp16 or bf16 is enabled
    _put(layer, "precision.dtype", "fp16" if fp16 else "bf16" if bf16 else "fp32")


def load_deepspeed_json(path: str | Path) -> tuple[dict, list[str]]:
    """Read a DeepSpeed JSON config: (config layer for `build_config`, unsupported keys)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"DeepSpeed config file not found: {p}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"malformed JSON in {p}: line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"DeepSpeed config {p} is not UTF-8 text: {e}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"DeepSpeed config {p} must be a JSON object {{...}}, got a {type(cfg).__name__}")
    unsupported: list[str] = []
    layer: dict = {}
    _read_top(_Reader(p, unsupported), cfg, layer)
    return layer, unsupported


def unsupported_warning(path: str | Path, unsupported: list[str]) -> str | None:
    """The one warning line the CLI prints for the keys tenfold ignores (None if none)."""
    if not unsupported:
        return None
    return f"{path}: DeepSpeed keys not supported by tenfold (ignored): {', '.join(unsupported)}"
