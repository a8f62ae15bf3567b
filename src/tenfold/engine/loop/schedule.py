"""Learning-rate schedules: tenfold's own (warmup + cosine / linear / constant) and
DeepSpeed's `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR` with their parameter names,
defaults and formulas (`deepspeed/runtime/lr_schedules.py`).

Step convention: the trainer calls `scheduler.step()` once after every optimizer step that
was taken (never after a step skipped for overflow). Optimizer step s (0-based) runs with
`get_last_lr()` computed for s.

* tenfold schedules, with W = train.warmup_steps, T = total steps, r = train.min_lr_ratio:
  warmup `lr * (s+1)/(W+1)` for s < W (nanoGPT), then with progress
  p = (s - W) / max(1, T - 1 - W) clamped to [0, 1] (so the last step reaches the floor):
  cosine `lr * (r + (1-r) * (1 + cos(pi p))/2)`, linear `lr * (r + (1-r) * (1-p))`,
  constant `lr`.
* DeepSpeed schedules are constructed at `last_batch_iteration = -1` and stepped after each
  optimizer step, so DeepSpeed's optimizer step s runs with `last_batch_iteration = s - 1`:
  step 0 gets the "not started" lr (WarmupLR/WarmupDecayLR: warmup_min_lr; WarmupCosineLR:
  0), step 1 gets iteration 0, and so on. tenfold reproduces that exactly.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.optim.lr_scheduler import LRScheduler

from tenfold.errors import UserError
from tenfold.lr_schedule import NATIVE, validate_schedule_params


class FormulaLR(LRScheduler):
    """An `LRScheduler` whose lr at step s is `formula(s, base_lr)` (absolute, not a factor,
    so DeepSpeed's absolute `warmup_min_lr`/`warmup_max_lr` come out exact).

    `state_dict()` holds only numbers (JSON-safe); the formula comes from the config.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, formula: Callable[[int, float], float], name: str):
        self.formula = formula
        self.name = name
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [self.formula(self.last_epoch, base) for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs),
            "_step_count": self._step_count, "_last_lr": list(self._last_lr),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("name") != self.name:
            raise UserError(
                f"checkpoint holds a {state_dict.get('name')!r} lr schedule but this run uses "
                f"{self.name!r}; resume with the same train.schedule"
            )
        self.last_epoch = int(state_dict["last_epoch"])
        self.base_lrs = self._per_group(state_dict["base_lrs"])
        self._step_count = int(state_dict["_step_count"])
        self._last_lr = self._per_group(state_dict["_last_lr"])
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


    def _per_group(self, saved: list) -> list[float]:
        """Saved per-group values for this optimizer's groups. The groups are split by device
        mesh (techniques/optimizer.param_groups), so another layout (tp, ep) has another number
        of them; every group runs the one schedule, so one saved value serves them all."""
        values = [float(x) for x in saved]
        groups = len(self.optimizer.param_groups)
        if len(values) == groups:
            return values
        if values and len(set(values)) == 1:
            return values[:1] * groups
        raise UserError(f"the checkpoint's lr schedule has {len(values)} differing parameter-group rates "
                        f"and this run has {groups} groups; resume with the same optimizer groups")


# --------------------------------------------------------------------------- formulas


def native_lr(kind: str, step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if kind == "constant":
        return lr
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - 1 - warmup)))
    decay = (1 + math.cos(math.pi * progress)) / 2 if kind == "cosine" else 1.0 - progress
    return lr * (min_ratio + (1 - min_ratio) * decay)


def _warmup_gamma(it: int, warmup_num_steps: int, warmup_type: str) -> float:
    """DeepSpeed `_get_gamma` during warmup: log(it+1)/log(W) or it/W."""
    if warmup_type == "log":
        return math.log(it + 1) / math.log(warmup_num_steps)
    return it / warmup_num_steps


def deepspeed_lr(kind: str, it: int, optimizer_lr: float, p: dict[str, Any]) -> float:
    """The lr DeepSpeed's scheduler `kind` sets at `last_batch_iteration = it` (it >= -1)."""
    w = max(2, p["warmup_num_steps"])  # DeepSpeed clamps to >= 2 (log(1) = 0 otherwise)
    if kind == "WarmupCosineLR":
        if it < 0:
            return 0.0
        if it < w:
            ratio = _warmup_gamma(it, w, p["warmup_type"])
            ratio = p["warmup_min_ratio"] + ratio * (1.0 - p["warmup_min_ratio"])
        else:
            progress = min(1.0, (it - w + 1) / max(1, p["total_num_steps"] - w))
            ratio = (1 + math.cos(math.pi * progress)) / 2
            ratio = max(0.0, p["cos_min_ratio"] + (1.0 - p["cos_min_ratio"]) * ratio)
        return optimizer_lr * ratio
    lo = p["warmup_min_lr"]
    hi = optimizer_lr if p["warmup_max_lr"] is None else p["warmup_max_lr"]
    if it < 0:
        return lo
    if it < w:
        gamma = _warmup_gamma(it, w, p["warmup_type"])
    elif kind == "WarmupDecayLR":
        gamma = max(0.0, (p["total_num_steps"] - it) / max(1.0, p["total_num_steps"] - w))
    else:
        gamma = 1.0
    return lo + (hi - lo) * gamma


# --------------------------------------------------------------------------- build


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg: Any, total_steps: int) -> FormulaLR:
    """The schedule named by `train_cfg.schedule`, for `total_steps` optimizer steps."""
    schedule = train_cfg.schedule
    params = validate_schedule_params(schedule, dict(train_cfg.schedule_params or {}), total_steps)
    if schedule in NATIVE:
        warmup, ratio = train_cfg.warmup_steps, train_cfg.min_lr_ratio

        def formula(step: int, base_lr: float) -> float:
            return native_lr(schedule, step, base_lr, warmup, total_steps, ratio)

    else:

        def formula(step: int, base_lr: float) -> float:
            return deepspeed_lr(schedule, step - 1, base_lr, params)

    return FormulaLR(optimizer, formula, schedule)
