"""Mixed precision (Micikevicius et al. 2018): autocast policy, fp32 master weights, loss scaling.

Design (the "fp32 master weights" recipe, Micikevicius et al. 2018, as torch.amp does it):

* Parameters, gradients and optimizer states stay **fp32**. `torch.autocast` casts each
  op's inputs to bf16/fp16 on the fly (matmuls, SDPA), and autocast's own op lists keep the
  numerically sensitive ops (softmax, norms, losses) in fp32. So there is no separate fp16
  copy of the weights to keep in sync: the fp32 parameter *is* the master weight, and the
  optimizer updates it in fp32. (Under FSDP2 the ZeRO code uses `MixedPrecisionPolicy`
  instead, with fp32 sharded master weights; the loss scaler below is the same.)
* fp16 has a narrow range (max 65504, smallest normal 6e-5), so small gradients underflow.
  The loss is multiplied by a scale before backward and the gradients divided by it
  after; `DynamicLossScaler` moves the scale exactly as DeepSpeed's does
  (`deepspeed/runtime/fp16/loss_scaler.py`).
* bf16 has fp32's exponent range, so it needs no scaler: it gets a no-op scaler (scale 1),
  as DeepSpeed's `CreateLossScaler` does. Non-finite gradients still skip the step (as
  DeepSpeed's `bf16.check_grad_overflow=true`, its default since PR #8035).

Order inside one optimizer step (`finish_step`, the part after the last backward; the
trainer runs exactly this function):

    for each micro-batch: scaler.scale_loss(loss).backward()
    scaler.unscale_grads_(params)                 # true gradients, before clipping
    fp16: overflow = grads_have_inf_or_nan(params) (one all-reduce(MAX): a global decision)
    bf16/fp32: non-finite = the (globally reduced) loss or the gradient norm is inf/NaN
    if so:   zero grads; skip optimizer.step AND scheduler.step; fp16: scaler.update(True)
             and DeepSpeed's "OVERFLOW! Skipping step" line; bf16/fp32: stop (train.on_nan=stop)
             or skip (on_nan=skip)
    else:    norm = clip (pre-clip norm reported); optimizer.step(); scheduler.step();
             scaler.update(False)

The decision is global (all ranks skip together), so every rank's scale, step count and LR
stay identical.
"""

from __future__ import annotations

import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable

import torch
import torch.distributed as dist

from tenfold.errors import RunError, TenfoldNote, UserError
from tenfold.terms import TORCH_DTYPE_NAMES, check_precision

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, attr) for name, attr in TORCH_DTYPE_NAMES.items()}

_warned_fp16_on_cpu = False


# --------------------------------------------------------------------------- dtype policy


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 autocast works on `device` (CUDA: Ampere or newer; CPU: torch's CPU autocast)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return torch.amp.is_autocast_available(device.type)


def resolve_dtype(name: str, device: torch.device) -> str:
    """Validate `precision.dtype` and adapt it to the device.

    bf16 falls back to fp32 (with a warning) where bf16 autocast is unsupported. fp16 on a
    CPU is allowed but warned about once per process: CPUs have no fast fp16 matmul kernels
    (measured on this 2-core EPYC, docs/precision.md: a 512x512 matmul 8-40x slower than fp32,
    a `tiny` training step 3-7x slower).
    """
    global _warned_fp16_on_cpu
    check_precision(name)
    if name == "bf16" and not bf16_supported(device):
        warnings.warn(f"bf16 autocast is not supported on {device}; training in fp32", TenfoldNote, stacklevel=2)
        return "fp32"
    if name == "fp16" and device.type == "cpu" and not _warned_fp16_on_cpu:
        _warned_fp16_on_cpu = True
        warnings.warn(
            "fp16 on a CPU is very slow (no fast fp16 matmul kernels; 3-40x "
            "slower than fp32, see docs/precision.md); use --precision bf16 or fp32 on CPUs",
            TenfoldNote, stacklevel=2,
        )
    return name


def autocast_context(dtype_name: str, device: torch.device) -> ContextManager:
    """Context for the forward pass (and loss): autocast for bf16/fp16, nothing for fp32.

    Backward needs no context: autograd runs each op's backward in the dtype its forward used.
    """
    if check_precision(dtype_name) == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype_name])


# --------------------------------------------------------------------------- gradients


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a tensor: DTensor (FSDP2 shards) -> its local shard."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _local_grads(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [_local(p.grad) for p in params if p.grad is not None]


def grads_have_inf_or_nan(
    params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None = None
) -> bool:
    """True if any gradient element on ANY rank of `group` is inf or NaN.

    One flag per device on the device (max |g| over all local grads: inf/NaN propagate through
    max, and unlike a sum or 2-norm a finite value cannot overflow it), then one
    all_reduce(MAX) when torch.distributed is initialized, then one host sync (`.item()`).
    So one rank's overflow skips the step on every rank and the scalers stay identical.
    """
    grads = _local_grads(params)
    device = grads[0].device if grads else torch.device("cpu")
    flag = torch.zeros((), dtype=torch.float32, device=device)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            by_device.setdefault(g.device, []).append(g)
    for dev_grads in by_device.values():
        maxabs = torch.stack(torch._foreach_norm(dev_grads, math.inf)).max()
        flag = torch.maximum(flag, (~torch.isfinite(maxabs)).float().to(device))
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend(group) == "nccl" and flag.device.type != "cuda":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


# --------------------------------------------------------------------------- loss scalers


class LossScaleAtMinimumError(RunError, RuntimeError):
    """fp16 keeps overflowing at `min_loss_scale` (DeepSpeed raises here too, §2.9 note 3)."""


class LossScaler:
    """Static loss scale (DeepSpeed's `LossScaler`): scale 1.0 is the no-op for bf16/fp32.

    `update()` never changes the scale; an overflow still skips the step (counted).
    """

    dynamic = False

    def __init__(self, scale: float = 1.0):
        self.cur_scale = float(scale)
        self.skipped_steps = 0
        self.last_message: str | None = None

    @property
    def scale(self) -> float:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.cur_scale == 1.0 else loss * self.cur_scale

    def unscale_grads_(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Divide every gradient by the scale, in place (DTensor grads through their shard)."""
        if self.cur_scale == 1.0:
            return
        grads = _local_grads(params)
        if grads:
            torch._foreach_div_(grads, self.cur_scale)

    def update(self, overflow: bool) -> None:
        self.last_message = None
        if overflow:
            self.skipped_steps += 1
            self.last_message = f"OVERFLOW! Skipping step. Loss scale: {self.cur_scale:g} (static)"

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "static", "cur_scale": self.cur_scale, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_kind(state)
        self.cur_scale = float(state["cur_scale"])
        self.skipped_steps = int(state["skipped_steps"])

    def _check_kind(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()["kind"]
        if state.get("kind") != mine:
            raise UserError(
                f"checkpoint holds a {state.get('kind')!r} loss scaler but this run uses a {mine!r} "
                "one; resume with the same precision settings"
            )


class DynamicLossScaler(LossScaler):
    """DeepSpeed's `DynamicLossScaler`, line for line (deepspeed/runtime/fp16/loss_scaler.py).

    init_scale = 2**initial_scale_power; on overflow: if hysteresis is used up, halve the scale
    (never below `min_scale`; already at `min_scale` -> raise, as DeepSpeed does by default),
    else use up one unit of hysteresis. After `scale_window` clean iterations since the last
    overflow: double the scale (and refill hysteresis). With `consecutive_hysteresis`,
    every clean iteration refills hysteresis, so only *consecutive* overflows shrink the scale.
    """

    dynamic = True
    scale_factor = 2.0  # hard-coded in DeepSpeed

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 2,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ):
        if scale_window <= 0 or min_scale <= 0 or delayed_shift <= 0 or init_scale <= 0:
            raise UserError(
                "fp16 dynamic loss scaling needs loss_scale_window > 0, min_loss_scale > 0, "
                f"hysteresis > 0 (got {scale_window}, {min_scale}, {delayed_shift})"
            )
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.cur_hysteresis = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)

    def update(self, overflow: bool) -> None:
        self.last_message = None
        if overflow:
            self.skipped_steps += 1
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"Current loss scale already at minimum ({self.min_scale:g}) - cannot decrease "
                        "scale anymore: fp16 gradients keep overflowing. Try precision=bf16, a lower "
                        "lr, or a lower precision.min_loss_scale."
                    )
                new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                self.last_message = (
                    f"OVERFLOW! Skipping step. Attempted loss scale: {self.cur_scale:g}, "
                    f"reducing to {new_scale:g}"
                )
                self.cur_scale = new_scale
            else:
                self.last_message = (
                    f"OVERFLOW! Skipping step. Attempted loss scale: {self.cur_scale:g}, but "
                    f"hysteresis is {self.cur_hysteresis}. Reducing hysteresis to {self.cur_hysteresis - 1}"
                )
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "dynamic",
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_kind(state)
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.skipped_steps = int(state["skipped_steps"])


def build_loss_scaler(precision_section: Any, dtype_name: str) -> LossScaler:
    """DeepSpeed's `CreateLossScaler`: dynamic only for fp16 with `loss_scale == 0`;
    fp16 with `loss_scale > 0` gets that static scale; bf16/fp32 get the no-op (scale 1).

    `dtype_name` is the resolved dtype (after `resolve_dtype`), the rest comes from the
    `[precision]` section (DeepSpeed's `fp16` keys).
    """
    if dtype_name != "fp16":
        return LossScaler(1.0)
    p = precision_section
    if p.loss_scale > 0:
        return LossScaler(p.loss_scale)
    return DynamicLossScaler(
        init_scale=2.0 ** p.initial_scale_power,
        scale_window=p.loss_scale_window,
        min_scale=p.min_loss_scale,
        delayed_shift=p.hysteresis,
        consecutive_hysteresis=p.consecutive_hysteresis,
        raise_error_at_min_scale=p.raise_error_at_min_scale,
    )


# --------------------------------------------------------------------------- the run's precision


@dataclass
class Precision:
    """The run's precision on its device: what autocast computes in, the loss scaler, and
    which rule decides that a step is skipped. Built once by `build_precision`; nothing else
    compares precision strings."""

    name: str  # "fp32" | "bf16" | "fp16", after the device fallback of resolve_dtype
    device: torch.device
    scaler: LossScaler

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The 16-bit dtype matmuls run in; None for fp32."""
        return None if self.name == "fp32" else DTYPES[self.name]

    @property
    def checks_gradients(self) -> bool:
        """fp16 reads every gradient for inf/NaN each step (overflow is expected now and then);
        bf16/fp32 only look at the loss and the gradient norm, which they compute anyway."""
        return self.name == "fp16"

    def autocast(self) -> ContextManager:
        return autocast_context(self.name, self.device)


def build_precision(dtype: str, precision_section: Any, device: torch.device) -> Precision:
    """The run's precision: `dtype` as resolved (ResolvedRun.precision, never `auto`), the loss
    scaler's settings from the config's [precision]."""
    name = resolve_dtype(dtype, device)
    return Precision(name, device, build_loss_scaler(precision_section, name))


# --------------------------------------------------------------------------- the step tail


@dataclass
class StepResult:
    loss: float  # mean token loss of the global batch
    grad_norm: float  # pre-clip global norm of the unscaled gradients; NaN when skipped
    skipped: bool  # no optimizer or scheduler step happened
    target_tokens: int  # tokens the loss was averaged over (all ranks)
    loss_scale: float  # the scale this step's backward used
    message: str | None = None  # why the step was skipped (DeepSpeed's "OVERFLOW! ..." for fp16)
    expert_load: list[list[int]] | None = None  # MoE: the step's assignments per expert, per MoE block


@dataclass(frozen=True)
class Update:
    """What the step tail updates and by which rules: the optimizer and its LR schedule (None:
    none), the run's precision (its loss scaler), `clip(max_norm)` clipping to the global gradient
    norm over every shard and stage and returning the pre-clip norm (max_norm 0: measure only),
    and `on_nan`, what a non-finite loss does in bf16/fp32 ("stop" or "skip")."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: Precision
    clip: Callable[[float], float]
    max_norm: float
    on_nan: str = "stop"


def finish_step(update: Update, params: list[torch.nn.Parameter], loss: float, target_tokens: int,
                step: int = 0) -> StepResult:
    """Everything after the last micro-batch's backward, in the order of the module docstring.

    `loss` is the global mean loss (the same on every rank); `step`: the number of the optimizer
    step being taken (1-based), for the messages.
    """
    optimizer, scheduler, precision = update.optimizer, update.scheduler, update.precision
    scaler = precision.scaler
    used_scale = scaler.scale
    scaler.unscale_grads_(params)
    if precision.checks_gradients:
        non_finite = grads_have_inf_or_nan(params)  # one vote over all ranks
    else:
        non_finite = not math.isfinite(loss)
    norm = float("nan") if non_finite else update.clip(update.max_norm)
    if non_finite or not math.isfinite(norm):
        message = _skip(optimizer, precision, loss, update.on_nan, step)
        return StepResult(loss, float("nan"), True, target_tokens, used_scale, message)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    scaler.update(False)
    return StepResult(loss, norm, False, target_tokens, used_scale)


def _skip(optimizer: torch.optim.Optimizer, precision: Precision, loss: float, on_nan: str, step: int) -> str:
    """Leave weights, optimizer states and LR schedule untouched. fp16: an overflow is expected
    now and then, the scaler backs off (and may give up at its minimum). bf16/fp32: a
    non-finite loss or norm means the run diverged: stop, unless train.on_nan is skip."""
    optimizer.zero_grad(set_to_none=True)
    if precision.checks_gradients:
        precision.scaler.update(True)  # may raise LossScaleAtMinimumError
        return precision.scaler.last_message or "OVERFLOW! Skipping step"
    if on_nan == "stop":
        raise RunError(
            f"non-finite loss or gradients at step {step} (loss={loss}); the weights were not updated. Lower "
            "train.lr, use --precision fp32, or pass --set train.on_nan=skip to skip such steps"
        )
    return f"non-finite loss or gradients at step {step} (loss={loss}): step skipped (train.on_nan=skip)"
