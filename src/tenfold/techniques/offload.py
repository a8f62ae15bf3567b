"""ZeRO-Offload (Ren et al. 2021): the sharded model states in host memory, the optimizer step
on the CPU, through FSDP2's `CPUOffloadPolicy` (techniques/zero.py applies it to every
FSDP2 unit; docs/zero.md has the table).

What each `parallel.offload` value runs (ZeRO-2/3 only: the policy is FSDP2's):

    none              everything on the device
    optimizer         CPUOffloadPolicy: fp32 sharded parameters (FSDP2's master weights), their
                      sharded gradients and the AdamW states on the host; AdamW steps there
    optimizer+params  the same policy, ZeRO-3 only (DeepSpeed's offload_param)

DeepSpeed's offload_optimizer keeps the 16-bit parameter shard on the device; FSDP2 keeps no
such copy (it casts the fp32 shard to the compute dtype at each all-gather), so both values
leave the device only what is gathered (ZeRO-2: whole parameters from forward to backward,
ZeRO-3: one unit at a time) and move, per all-gather, the rank's fp32 shard host-to-device,
per reduce-scatter (every micro-batch), its fp32 gradient shard device-to-host.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

from tenfold.errors import UserError

OFFLOADS = ("none", "optimizer", "optimizer+params")


def offload_policy(parallel_cfg: Any, device: torch.device):
    """FSDP2's offload policy for `parallel.offload` (the module docstring says what each value
    runs). Pinned host memory (asynchronous copies) only where there is a CUDA device to copy
    to: pinning needs one."""

    if _value(parallel_cfg) not in OFFLOADS:
        raise UserError(f"parallel.offload must be one of {', '.join(OFFLOADS)}, got {parallel_cfg.offload!r}")
    if _value(parallel_cfg) == "none":
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def offloads(parallel_cfg: Any) -> bool:
    return _value(parallel_cfg) != "none"


def optimizer_device(parallel_cfg: Any, device: torch.device) -> torch.device:
    """Where the optimizer's parameters (and so its states and step) live."""
    return torch.device("cpu") if offloads(parallel_cfg) else device


def offloaded(model: nn.Module) -> bool:
    """True when FSDP2 holds this model's sharded parameters under CPUOffloadPolicy (the
    policy really applied, read back from FSDP2's own per-parameter state)."""

    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    params = [fp for st in states if st._fsdp_param_group for fp in st._fsdp_param_group.fsdp_params]
    return bool(params) and all(fp.offload_to_cpu for fp in params)


def _value(parallel_cfg: Any) -> str:
    return getattr(parallel_cfg, "offload", "none")
