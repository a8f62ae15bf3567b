"""A tune's options, checked before anything runs (bad input: one line, exit status 2)."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from tenfold.config import TenfoldConfig
from tenfold.errors import UserError
from tenfold.plan.hardware import Hardware
from tenfold.tune.candidates import KNOBS
from tenfold.host import bf16_pays
from tenfold.terms import resolve_precision

DEFAULT_OUT = "runs/tune"
DEFAULT_BUDGET_S = 600.0
DEFAULT_WINDOW_S = 20.0
DEFAULT_MARGIN = 0.1


@dataclass
class TuneSetup:
    cfg: TenfoldConfig  # the user's configuration: the baseline, and what every candidate starts from
    nproc: int
    device: str  # cpu | cuda
    precisions: list[str]  # what the candidates may use: the precisions this device runs fast
    baseline_precision: str  # the user's, as the engine runs it here (bf16 falls back to fp32 without it)
    hardware: Hardware  # the planner's machine before calibration
    limit_bytes: float  # memory per rank a trial may peak at
    margin: float  # candidates are predicted to need at most (1 - margin) x limit
    fixed: set[str]
    window_s: float  # the measured part of a trial
    trial_timeout_s: float | None
    max_trials: int | None
    budget_s: float
    out: Path
    command: str


def _positive(flag: str, value, kind=float):
    if value is None:
        return None
    if not math.isfinite(value) or value <= 0 or (kind is int and int(value) != value):
        raise UserError(f"{flag} must be a positive {'integer' if kind is int else 'number'}, got {value}")
    return kind(value)


def parse_fixed(text: str | None) -> set[str]:
    names = {t.strip().replace("-", "_") for t in (text or "").split(",") if t.strip()}
    bad = sorted(names - set(KNOBS))
    if bad:
        raise UserError(f"--fixed {text!r}: unknown knob(s) {', '.join(bad)}; allowed: {', '.join(KNOBS)}")
    return names


def _out_dir(text: str | None) -> Path:
    out = Path(text or DEFAULT_OUT)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")
    return out


def _user_config(args: argparse.Namespace) -> TenfoldConfig:
    """The run the user describes with train's flags (`--out` is the tune's own folder here)."""
    from tenfold.run_args import config_from_args

    return config_from_args(argparse.Namespace(**{**vars(args), "out": None}))


def _precisions(device: str) -> tuple[list[str], bool]:
    """(precisions to try, bf16 supported). A CPU has no fast fp16 matmul kernels (tenfold train
    warns about fp16 there), so fp16 is tried on GPUs only, and bf16 on a CPU only where it has
    bf16 matrix instructions (elsewhere its bf16 matmuls run through conversions, many times
    slower than fp32: a trial there spends the budget on a known loser)."""
    import torch

    from tenfold.techniques.precision import bf16_supported

    bf16 = bf16_supported(torch.device(device))
    try_bf16 = bf16 and bf16_pays(on_cpu=device == "cpu")
    return ["fp32", *(["bf16"] if try_bf16 else []), *(["fp16"] if device == "cuda" else [])], bf16


def _prior_hardware(args: argparse.Namespace, device: str, nproc: int) -> Hardware:
    import torch

    from tenfold.engine.memory.measure import planner_hardware_name
    from tenfold.plan.hardware import get_hardware, load_hardware_toml

    hw = load_hardware_toml(args.hardware_file) if args.hardware_file else get_hardware(
        planner_hardware_name(torch.device(device)))
    # every trial's ranks run on this machine: one node, whose cores (on a CPU) they share
    return replace(hw, gpus_per_node=max(hw.gpus_per_node, nproc))


def _limit(args: argparse.Namespace, hw: Hardware, nproc: int) -> float:
    from tenfold.ladder import parse_bytes

    if args.memory_limit:
        return float(parse_bytes(args.memory_limit, "--memory-limit"))
    return hw.memory_bytes / nproc if hw.shared_compute else hw.memory_bytes


def prepare(args: argparse.Namespace) -> TuneSetup:
    from tenfold.ladder.machine import device_type

    budget = _positive("--budget", args.budget) or DEFAULT_BUDGET_S
    margin = DEFAULT_MARGIN if args.margin is None else args.margin
    if not 0 <= margin < 0.9:
        raise UserError(f"--margin must be in [0, 0.9), got {margin}")
    cfg = _user_config(args)
    nproc = cfg.parallel.nproc
    device = device_type()
    precisions, bf16 = _precisions(device)
    hw = _prior_hardware(args, device, nproc)
    configured = resolve_precision(cfg.precision.dtype, device == "cpu", cfg.precision.fp8)
    return TuneSetup(
        cfg=cfg, nproc=nproc, device=device, precisions=precisions,
        baseline_precision="fp32" if configured == "bf16" and not bf16 else configured,
        hardware=hw, limit_bytes=_limit(args, hw, nproc), margin=margin, fixed=parse_fixed(args.fixed),
        window_s=_positive("--window", args.window) or DEFAULT_WINDOW_S,
        trial_timeout_s=_positive("--trial-timeout", args.trial_timeout),
        max_trials=_positive("--max-trials", args.max_trials, int), budget_s=budget, out=_out_dir(args.out),
        command="tenfold " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "tenfold tune",
    )
