"""Learning-rate schedule names and DeepSpeed's scheduler parameters: their names, code
defaults and validation (`deepspeed/runtime/lr_schedules.py`). Torch-free, so that the
config, the DeepSpeed reader and `tenfold train --dry-run` check them before anything is
built; the formulas and the torch scheduler are `tenfold.engine.loop.schedule`.
"""

from __future__ import annotations

import math
from typing import Any

from tenfold.errors import UserError

NATIVE = ("cosine", "linear", "constant")
DEEPSPEED = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

# DeepSpeed's parameters and code defaults. None = "the optimizer's lr" (WarmupLR's
# warmup_max_lr) or "tenfold's total steps" (total_num_steps; required in DeepSpeed).
DEEPSPEED_PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {
        "total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000, "warmup_type": "log",
    },
    "WarmupCosineLR": {
        "total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001, "warmup_type": "log",
    },
}
WARMUP_TYPES = ("log", "linear")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return _is_number(v) and float(v).is_integer()


def validate_schedule_params(schedule: str, params: dict[str, Any], total_steps: int | None) -> dict[str, Any]:
    """Check `train.schedule_params` for `schedule`; return them with defaults filled in.

    Raises `UserError` naming unknown or invalid parameters and the allowed ones.
    """
    if schedule in NATIVE:
        if params:
            raise UserError(
                f"train.schedule_params {sorted(params)} are not used by schedule {schedule!r} "
                "(it takes train.warmup_steps and train.min_lr_ratio); schedule_params are for "
                f"{', '.join(DEEPSPEED)}"
            )
        return {}
    if schedule not in DEEPSPEED:
        raise UserError(f"invalid train.schedule {schedule!r}; allowed: {', '.join(NATIVE + DEEPSPEED)}")
    defaults = DEEPSPEED_PARAMS[schedule]
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise UserError(
            f"unknown train.schedule_params {unknown} for {schedule}; allowed: {', '.join(defaults)}"
        )
    p = {**defaults, **params}
    if p.get("total_num_steps", 0) is None:
        p["total_num_steps"] = total_steps
    bad = _invalid_params(p)
    if bad:
        raise UserError(f"invalid train.schedule_params for {schedule}: {'; '.join(bad)}")
    p["warmup_num_steps"] = int(p["warmup_num_steps"])
    if "total_num_steps" in p:
        p["total_num_steps"] = int(p["total_num_steps"])
    return p


def _invalid_params(p: dict[str, Any]) -> list[str]:
    bad = []
    if not (_is_int(p["warmup_num_steps"]) and p["warmup_num_steps"] > 0):
        bad.append(f"warmup_num_steps={p['warmup_num_steps']!r} (a positive integer)")
    if p["warmup_type"] not in WARMUP_TYPES:
        bad.append(f"warmup_type={p['warmup_type']!r} (one of {', '.join(WARMUP_TYPES)})")
    if "total_num_steps" in p and not (_is_int(p["total_num_steps"]) and p["total_num_steps"] > 0):
        bad.append(f"total_num_steps={p['total_num_steps']!r} (a positive integer)")
    for key in ("warmup_min_lr", "warmup_max_lr"):
        if key in p and p[key] is not None and not (_is_number(p[key]) and p[key] >= 0):
            bad.append(f"{key}={p[key]!r} (a number >= 0; lists per param group are not supported)")
    for key in ("warmup_min_ratio", "cos_min_ratio"):
        if key in p and not (_is_number(p[key]) and 0 <= p[key] <= 1):
            bad.append(f"{key}={p[key]!r} (a number in [0, 1])")
    return bad
