"""ZeRO-Offload (Ren et al. 2021): model states in host memory, the optimizer step on the CPU.
ZeRO-2/3 only (the sharded states are FSDP2's); docs/zero.md has the table.

What each `parallel.offload` value runs:

    none              everything on the device
    optimizer         DeepSpeed's `offload_optimizer`: the parameters (this rank's fp32 shards)
                      and their gradients stay on the device; AdamW's two moments live on the
                      host and AdamW updates there (`HostAdamW`): per step the gradient and
                      parameter shards go down, the updated shard comes back up
    optimizer+params  DeepSpeed's `offload_param` (ZeRO-3): FSDP2's `CPUOffloadPolicy`, the
                      fp32 parameter shards, their gradients and the AdamW states on the host;
                      each all-gather copies the shard up, each reduce-scatter the gradient down

tenfold trains fp32 parameters under autocast (FSDP2 casts the fp32 shard to the compute
dtype at each all-gather), so the parameters `optimizer` keeps on the device are fp32 shards,
4 bytes per parameter / N where DeepSpeed keeps a 16-bit copy (2 bytes) beside an fp32 master
on the host; the fp32 shard is the master here, and the device holds no second copy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy
from torch.distributed.tensor import DTensor

from tenfold.errors import UserError
from tenfold.terms import OFFLOADS



def offload_policy(parallel_cfg: Any, device: torch.device):
    """FSDP2's offload policy for `parallel.offload`: CPUOffloadPolicy for `optimizer+params`
    only (`optimizer` keeps the parameters on the device; `HostAdamW` moves the optimizer).
    Pinned host memory (asynchronous copies) only where there is a CUDA device to copy to."""

    if _value(parallel_cfg) not in OFFLOADS:
        raise UserError(f"parallel.offload must be one of {', '.join(OFFLOADS)}, got {parallel_cfg.offload!r}")
    if _value(parallel_cfg) != "optimizer+params":
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def offloads(parallel_cfg: Any) -> bool:
    return _value(parallel_cfg) != "none"


def offloads_optimizer_only(parallel_cfg: Any) -> bool:
    """`optimizer`: the parameters stay on the device, the optimizer is a `HostAdamW`."""
    return _value(parallel_cfg) == "optimizer"


def optimizer_device(parallel_cfg: Any, device: torch.device) -> torch.device:
    """Where the parameters the optimizer updates live: the host under `optimizer+params`
    (FSDP2 keeps the shards there), else the device. (`optimizer`'s states are on the host
    whatever this says: `HostAdamW`.)"""
    return torch.device("cpu") if _value(parallel_cfg) == "optimizer+params" else device


def offloaded(model: nn.Module) -> bool:
    """True when FSDP2 holds this model's sharded parameters under CPUOffloadPolicy (the
    policy really applied, read back from FSDP2's own per-parameter state)."""

    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    params = [fp for st in states if st._fsdp_param_group for fp in st._fsdp_param_group.fsdp_params]
    return bool(params) and all(fp.offload_to_cpu for fp in params)


def _value(parallel_cfg: Any) -> str:
    return getattr(parallel_cfg, "offload", "none")


# --------------------------------------------------------------------------- the host optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class HostAdamW(torch.optim.AdamW):
    """AdamW over parameters on the device whose states live, and whose update runs, in host
    memory: DeepSpeed's `offload_optimizer` (ZeRO-Offload, Ren et al. 2021 §4: the optimizer
    states and the update on the CPU, the parameters on the GPU).

    Each parameter has a host twin: a buffer of its local shard (a DTensor on the parameter's
    mesh and placements, so the AdamW states built on it are sharded DTensors too, which
    torch.distributed.checkpoint saves and reshards as any FSDP2 optimizer's) with a gradient
    buffer. `step` copies every shard and its gradient into the twins, runs torch's own AdamW
    (an inner `torch.optim.AdamW` over the twins, the same update as without offload) and
    copies the updated shards back. The states are shared dict objects: `self.state[param]`
    is the inner optimizer's `state[twin]`, so `state_dict`, `load_state_dict`, the LR
    schedule (read from this optimizer's groups at each step) and checkpoints see one
    optimizer keyed by the model's own parameters.

    Host memory per local parameter: the two fp32 moments, the parameter and gradient buffers
    (16 bytes for fp32 parameters); pinned where there is a CUDA device (asynchronous copies)."""

    def __init__(self, params, *, pin_memory: bool = False, **kwargs: Any) -> None:
        kwargs.pop("fused", None)  # the fused kernel is the device's; the host runs foreach
        kwargs.setdefault("foreach", True)
        super().__init__(params, **kwargs)
        self.pin_memory = pin_memory
        self._twins = {p: self._host_like(p) for g in self.param_groups for p in g["params"]}
        self._grad_buffers = {twin: self._host_like(p) for p, twin in self._twins.items()}
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [self._twins[p] for p in g["params"]]}
                        for g in self.param_groups]
        self.inner = torch.optim.AdamW(inner_groups)
        self.register_load_state_dict_post_hook(HostAdamW._states_to_host)

    def _host_like(self, p: torch.Tensor) -> torch.Tensor:
        """A host buffer of `p`'s local shard, a DTensor on `p`'s mesh and placements if `p` is one."""
        local = _local(p)
        host = torch.zeros(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.pin_memory)
        if isinstance(p, DTensor):
            return DTensor.from_local(host, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                      run_check=False)
        return host

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("HostAdamW.step takes no closure")
        pairs = [(p, self._twins[p]) for g in self.param_groups for p in g["params"]]
        for p, twin in pairs:  # down: this rank's shard and its gradient
            if p.grad is None:
                twin.grad = None
                continue
            _local(twin).copy_(_local(p).detach(), non_blocking=True)
            twin.grad = self._grad_buffers[twin]
            _local(twin.grad).copy_(_local(p.grad), non_blocking=True)
        _wait_for_copies(pairs)
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in group.items() if k != "params"})  # the LR schedule's values
        self.inner.step()
        for p, twin in pairs:  # up: the updated shard; the states stay on the host
            if twin.grad is not None:
                self.state[p] = self.inner.state[twin]
                _local(p).copy_(_local(twin), non_blocking=True)
            twin.grad = None
        return None

    def host_bytes(self) -> int:
        """Bytes this optimizer holds in host memory: the states and the twins' buffers."""
        tensors = [v for s in self.inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        tensors += list(self._twins.values()) + list(self._grad_buffers.values())
        return sum(_local(t).numel() * t.element_size() for t in tensors)

    def _states_to_host(self) -> None:
        """After `load_state_dict` (which puts each state on its parameter's device): the
        states back into host memory, shared with the inner optimizer again."""
        for p, twin in self._twins.items():
            state = self.state.get(p)
            if not state:
                continue
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = _on_host(value, self.pin_memory)
            self.inner.state[twin] = state


def _on_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    local = _local(t)
    if local.device.type == "cpu":
        return t
    host = local.to("cpu").pin_memory() if pin else local.to("cpu")
    return (DTensor.from_local(host, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False)
            if isinstance(t, DTensor) else host)


def _wait_for_copies(pairs) -> None:
    """The device-to-host copies are asynchronous on CUDA: the host update reads their
    results, so it waits for the device's stream first."""
    devices = {_local(p).device for p, _ in pairs if _local(p).device.type == "cuda"}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def host_optimizer(param_groups: list[dict], adamw_kwargs: dict, device: torch.device) -> HostAdamW:
    """`HostAdamW` over `param_groups` with the run's AdamW settings; pinned buffers where the
    parameters are on a CUDA device."""
    return HostAdamW(param_groups, pin_memory=device.type == "cuda", **adamw_kwargs)
