"""Process-group setup: one process or many under torchrun; gloo on CPU, NCCL on GPU.

Minimal first version (single process and env:// under torchrun); the ZeRO work extends it
(device meshes for dp x pp, failure handling, timeouts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    dp_size: int = 1
    dp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    mesh: object | None = None  # torch DeviceMesh ("pp", "dp") when world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def initialized(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(pp_size: int = 1, timeout_s: float = 600.0) -> DistInfo:
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return DistInfo(device=pick_device(0))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(local_rank)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    dp_size = world // pp_size
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (pp_size, dp_size), mesh_dim_names=("pp", "dp"))
    return DistInfo(
        rank=rank, world_size=world, local_rank=local_rank, device=device,
        dp_size=dp_size, dp_rank=mesh["dp"].get_local_rank(),
        pp_size=pp_size, pp_rank=mesh["pp"].get_local_rank(), mesh=mesh,
    )


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
