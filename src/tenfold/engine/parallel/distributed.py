"""Process-group setup: one process or many under torchrun; gloo on CPU, NCCL on GPU.

* `join_layout(layout, timeout_s, offload)` (`init_distributed` from the degrees): reads
  torchrun's env:// variables, picks the backend from the device (NCCL with one GPU per rank,
  else gloo), builds the layout's ("pp", "dp", "tp") device mesh and, under hybrid sharding,
  its ("dp_replicate", "dp_shard") split, under context parallelism its ("dp_data", "cp") split,
  under expert parallelism its ("dp_mod_ep", "ep") view (tenfold.layout: the degrees, their
  rules, the mesh order); ZeRO-Offload on one process joins a process group of one.
* Failures: every rank's stderr lines are prefixed with `[rank k]`, an uncaught exception is
  recorded in torchelastic's error file (torchrun's failure summary then shows the rank and
  its error), and `tighten_timeouts` shortens the collective timeout after the first step, so
  a rank that hangs makes the others raise within that bound instead of waiting
  `timeout_s` (a rank that dies is noticed by torchrun's agent, which stops the others).
* Only rank 0 prints (`print0`) and writes shared files; `gather_to_main` collects per-rank
  results (memory) on rank 0.
* Agreement collectives for work that can fail on one rank (checkpoint saves and loads, the
  final export): `on_every_rank`, `any_rank`, `all_gather_small`, `broadcast_small`,
  `side_barrier`, on a gloo `side_group` of their own; no-ops on one process.
"""

from __future__ import annotations

import atexit
import io
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from tenfold.engine.parallel.torchrun_env import launched_by_torchrun
from tenfold.errors import UserError
from tenfold.layout import (DP_DIMS, EP_DIMS, Layout, build_context_parallel_mesh, build_expert_mesh, build_hybrid_mesh,
                            build_layout, build_mesh)


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
    tp_size: int = 1
    tp_rank: int = 0
    mesh: object | None = None  # torch DeviceMesh ("pp", "dp", "tp") when world_size > 1
    shard_size: int = 1  # ranks a ZeRO-2/3 state is split over (x cp), as tenfold.run.ResolvedRun.shard_size
    hybrid_mesh: object | None = None  # ("dp_replicate", "dp_shard") under hybrid sharding (tenfold.layout.build_hybrid_mesh)
    ep_size: int = 1  # expert parallelism: ranks one MoE layer's experts are split over (a split of dp)
    ep_mesh: object | None = None  # ("dp_mod_ep", "ep") view of the dp axis (tenfold.layout.build_expert_mesh)
    embedding_group: object | None = None  # tied embeddings across pipeline stages (`embedding_group`)
    # Context parallelism: the mesh's "dp" dimension holds dp x cp ranks (they all reduce the
    # gradients of the same parameters), split by tenfold.layout.build_context_parallel_mesh
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: object | None = None
    # The device type whose engine choices this rank follows ("": its own device's). The trace of
    # a GPU run (engine/preview/trace.py) computes on fake CPU tensors and builds the GPU run.
    engine_device: str = ""

    @property
    def engine_device_type(self) -> str:
        """"cuda" or "cpu": what the engine's device-dependent choices (tenfold.techniques.zero's
        FSDP2 units and prefetching) follow."""
        return self.engine_device or self.device.type

    @property
    def data_rank(self) -> int:
        """This rank's row of the data: the cp ranks of one dp replica load the same rows."""
        return self.dp_rank // self.cp_size

    @property
    def data_size(self) -> int:
        """Ranks that load different rows: dp (the mesh's "dp" dimension holds dp x cp)."""
        return self.dp_size // self.cp_size

    @property
    def hybrid(self) -> bool:
        """Hybrid sharding: the dp ranks form groups of `shard_size` that shard, replicated
        across groups."""
        return self.hybrid_mesh is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def initialized(self) -> bool:
        return self.world_size > 1


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device, host_collectives: bool = False) -> str:
    """NCCL for CUDA ranks, gloo otherwise (the only CPU backend that ships with torch).
    `host_collectives`: CUDA ranks also reduce tensors that live in host memory (ZeRO-Offload:
    FSDP2's offloaded gradients are CPU DTensors, and their global norm is an all-reduce of a
    CPU tensor, which NCCL cannot do), so CPU tensors go over gloo (torch's per-device backend
    string; torchtitan's fix for clipping under CPU offload, pytorch/torchtitan#622)."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_collectives else "nccl"


# `tenfold train --nproc`: the launcher creates this file when it gets SIGTERM/SIGINT; every
# rank checks for it at each step boundary, as for its own SIGTERM (engine/parallel/launch.py).
STOP_FILE_ENV = "TENFOLD_STOP_FILE"


def stop_requested() -> bool:
    """True once the launcher has asked the ranks to save and stop."""
    path = os.environ.get(STOP_FILE_ENV)
    return bool(path) and os.path.exists(path)


def world_size_from_env() -> int:
    """Processes in this job: torchrun's WORLD_SIZE, 1 when not launched by torchrun."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def init_distributed(pp_size: int = 1, timeout_s: float = 600.0, tp_size: int = 1, shard_group: int | None = None,
                     offload: bool = False, cp_size: int = 1, ep_size: int = 1) -> DistInfo:
    """Join the job's process group with pp x dp x cp x tp ranks over the job's processes (the
    layout's rules: tenfold.layout.build_layout). `shard_group`: the hybrid-sharding group
    (`parallel.shard_group_size`), dp ranks that shard together; None: every dp rank.
    `offload`: ZeRO-Offload, which runs on FSDP2 even on one process
    (`_one_process_group`) and reduces host tensors (`backend_for`). `ep_size`: expert-parallel
    ranks, a split of dp."""
    return join_layout(build_layout(world_size_from_env(), pp_size, tp_size, shard_group, cp=cp_size, ep=ep_size),
                       timeout_s, offload)


def join_layout(layout: Layout, timeout_s: float = 600.0, offload: bool = False) -> DistInfo:
    """Join the job's process group and build `layout`'s device mesh (tenfold.layout.build_mesh)
    and, under hybrid sharding, its ("dp_replicate", "dp_shard") split (`DistInfo.hybrid_mesh`),
    under context parallelism its cp sub-mesh (`DistInfo.cp_group`), under expert parallelism its
    ("dp_mod_ep", "ep") view (`DistInfo.ep_mesh`). The layout must span the job's processes
    (torchrun's WORLD_SIZE)."""
    world = world_size_from_env()
    if layout.world_size != world:
        raise UserError(f"the layout {' x '.join(f'{k} {v}' for k, v in layout.degrees().items())} spans "
                        f"{layout.world_size} processes, the job has {world}")
    if world == 1:
        return _one_process_group(timeout_s) if offload else DistInfo(device=pick_device(0))

    rank = int(os.environ["RANK"])
    install_failure_reporting(rank)
    _register_exit_shutdown()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(local_rank)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend_for(device, offload), "timeout": timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            kwargs["device_id"] = device  # eager NCCL init, one communicator per device
        dist.init_process_group(**kwargs)
    mesh = build_mesh(layout, device.type)
    info = DistInfo(
        rank=rank, world_size=world, local_rank=local_rank, device=device,
        dp_size=layout.grad_ranks, dp_rank=mesh["dp"].get_local_rank(),
        pp_size=layout.pp, pp_rank=mesh["pp"].get_local_rank(),
        tp_size=layout.tp, tp_rank=mesh["tp"].get_local_rank(), mesh=mesh, shard_size=layout.dp_shard * layout.cp,
        hybrid_mesh=build_hybrid_mesh(layout, mesh),
        ep_size=layout.ep, ep_mesh=build_expert_mesh(layout, mesh),
    )
    cp_mesh = build_context_parallel_mesh(layout, mesh)
    if cp_mesh is not None:
        info.cp_size, info.cp_rank, info.cp_group = layout.cp, cp_mesh.get_local_rank(), cp_mesh.get_group()
    return info


def _one_process_group(timeout_s: float) -> DistInfo:
    """One process that offloads (ZeRO-Offload's single-GPU case): FSDP2 shards over a device
    mesh, so the process joins a process group of one, over an in-memory store (no network);
    FSDP2's collectives over one rank are copies."""
    device = pick_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend_for(device, True), "store": dist.HashStore(), "rank": 0,
                                  "world_size": 1, "timeout": timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
        _register_exit_shutdown()
    return DistInfo(device=device, mesh=build_mesh(Layout(), device.type), shard_size=1)


def embedding_group(info: DistInfo) -> tuple[Any, int | None]:
    """Megatron-LM's embedding group for tied embeddings across pipeline stages: the first and
    the last pipeline rank at this rank's (dp, tp) coordinate, as (group, global rank of its
    first-stage member); (None, None) on a middle pipeline rank, which is in none. With two
    pipeline ranks that is the "pp" group itself; otherwise each pair is its own group, created
    by its two members only (`use_local_synchronization`), so a world of thousands of ranks
    creates no group it does not use. Kept in `info.embedding_group` (its timeout is tightened
    with the others')."""
    ranks = info.mesh.mesh  # (pp, dp, tp) -> global rank
    pair = [int(ranks[0, info.dp_rank, info.tp_rank]), int(ranks[-1, info.dp_rank, info.tp_rank])]
    if info.rank not in pair:
        return None, None
    if info.pp_size == 2:
        group = info.mesh["pp"].get_group()
    else:
        group = dist.new_group(ranks=pair, use_local_synchronization=True)
    info.embedding_group = group
    return group, pair[0]


# --------------------------------------------------------------------------- timeouts


def _all_groups(info: DistInfo) -> list:
    groups = [None]  # the default group
    if info.mesh is not None:
        for name in info.mesh.mesh_dim_names:
            groups.append(info.mesh[name].get_group())
    if info.hybrid_mesh is not None:
        groups += [info.hybrid_mesh[name].get_group() for name in DP_DIMS]
    if info.ep_mesh is not None:
        groups += [info.ep_mesh[name].get_group() for name in EP_DIMS]
    if info.embedding_group is not None:
        groups.append(info.embedding_group)
    if info.cp_group is not None:
        groups.append(info.cp_group)
    return groups


def tightened_timeout_s(first_step_s: float, timeout_s: float, floor_s: float = 120.0, factor: float = 20.0) -> float:
    """The collective timeout after the first step: `factor` x the first step (which also paid
    for warm-up), at least `floor_s` (evaluation and checkpoint saves run collectives too),
    never more than the configured `timeout_s`."""
    return min(timeout_s, max(floor_s, factor * first_step_s))


def tighten_timeouts(info: DistInfo, timeout_s: float) -> None:
    """Set the timeout of every process group this rank uses (default, pp, dp, tp). The first
    step runs under the generous `parallel.timeout_s` (process start, data build, lazy FSDP
    init); afterwards a rank that stops answering is detected within `timeout_s`."""
    if not (info.initialized and dist.is_initialized()):
        return

    for group in _all_groups(info):
        _set_pg_timeout(timedelta(seconds=timeout_s), group)


# --------------------------------------------------------------------------- output


def tighten_timeouts_after_first_step(optimizer: torch.optim.Optimizer, timeout_s: float, info: DistInfo) -> None:
    """After the first optimizer step (process start, lazy FSDP init and warm-up are behind us)
    shorten the collective timeout from `parallel.timeout_s` to ~20x that first step, at
    least 120 s (`distributed.tightened_timeout_s`): a rank that hangs is then noticed in
    bounded time. Measured from the optimizer's creation, so it includes the first step."""
    if not info.initialized:
        return
    started = time.perf_counter()
    done = False

    def after_first_step(*_):
        # Stays registered (a no-op from now on): removing a hook while the optimizer iterates
        # its post-hooks raises "OrderedDict mutated during iteration" when another post-hook
        # follows it (the memory measurement's, on a one-step run).
        nonlocal done
        if not done:
            done = True
            tighten_timeouts(info, tightened_timeout_s(time.perf_counter() - started, timeout_s))

    optimizer.register_step_post_hook(after_first_step)


def print0(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only (every rank of a one-process run is rank 0)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs)


def gather_to_main(obj: Any, info: DistInfo) -> list | None:
    """Every rank's `obj` (picklable) as a list indexed by rank on rank 0, None elsewhere.
    A collective: every rank must call it."""
    if not (info.initialized and dist.is_initialized()):
        return [obj]
    out = [None] * info.world_size if info.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


class _RankPrefixed(io.TextIOBase):
    """A text stream that starts every line with `[rank k] ` (stderr of a multi-rank job:
    torchrun interleaves the ranks' output, so each line must say whose it is)."""

    def __init__(self, stream, prefix: str, already: str):
        self._stream, self._prefix, self._at_line_start = stream, prefix, True
        self._already = already  # torch's own excepthook writes "[rank0]:" lines

    def write(self, s: str) -> int:
        if not s:
            return 0
        out = []
        for piece in s.splitlines(keepends=True):
            if self._at_line_start and not piece.startswith(self._already):
                out.append(self._prefix)
            out.append(piece)
            self._at_line_start = piece.endswith("\n")
        self._stream.write("".join(out))
        return len(s)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self):  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")


def install_failure_reporting(rank: int) -> None:
    """Prefix this rank's stderr lines and record an uncaught exception in torchelastic's
    error file (torchrun prints it in its failure summary, with the rank)."""
    if not isinstance(sys.stderr, _RankPrefixed):
        sys.stderr = _RankPrefixed(sys.stderr, f"[rank {rank}] ", already=f"[rank{rank}]:")
    previous = sys.excepthook
    if getattr(previous, "_tenfold", False):
        return

    def hook(exc_type, exc, tb):
        global _FAILING
        _FAILING = True
        if os.environ.get("TORCHELASTIC_ERROR_FILE") and not issubclass(exc_type, KeyboardInterrupt):
            try:
                ErrorHandler().record_exception(exc)
            except Exception:  # reporting must never mask the original error
                pass
        previous(exc_type, exc, tb)

    hook._tenfold = True  # type: ignore[attr-defined]
    sys.excepthook = hook


_FAILING = False  # set by the excepthook: this rank is dying of an uncaught exception
_EXIT_BARRIER_S = 30.0
_exit_registered = False


def _register_exit_shutdown() -> None:
    """Leave the process group at interpreter exit (the CLI, a script, a test worker), so
    that no entry point can forget it (see `shutdown`)."""
    global _exit_registered
    if not _exit_registered:
        atexit.register(_shutdown_at_exit)
        _exit_registered = True


def _shutdown_at_exit() -> None:
    if not dist.is_initialized():
        return
    if _FAILING:  # no barrier: the peers may be inside another collective; torchrun stops them
        return
    try:
        if dist.get_backend() == "gloo":
            # bounded: a peer that left without us (it failed) is named, not waited for
            dist.monitored_barrier(timeout=timedelta(seconds=_EXIT_BARRIER_S))
        else:
            dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # exiting anyway; say why the exit was not clean
        print(f"tenfold: process group shutdown: {e}", file=sys.stderr)


def shutdown() -> None:
    """Leave the process group cleanly. The barrier first: a rank that destroys its gloo
    group while a peer is still in a collective can abort the peer ("terminate called
    without an active exception", seen with torch 2.13 + gloo)."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- agreement collectives
#
# Small collectives that keep the ranks in step around work that can fail on one rank only
# (checkpoint saves and loads, the export at the end of training). They run on a separate
# gloo group (`side_group`), one process or many alike: with one process they are no-ops.


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_now() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist_on() else 0


def world_now() -> int:
    return dist.get_world_size() if dist_on() else 1


_SIDE_GROUP: dict[str, Any] = {}


def side_group():
    """The gloo group every checkpoint collective runs on (created collectively on first use,
    once per default process group). Two reasons: `tighten_timeouts` shortens the training
    groups' timeout after step 1 to max(120 s, 20 x first step), and the slowest rank's write
    of a large checkpoint can take longer, while this group keeps torch's default (30 min);
    and async saves run collectives from a background thread, which must never interleave
    with the training loop's collectives on the default group (torchtitan uses a gloo group
    for the same reason)."""
    if not dist_on():
        return None
    default = dist.distributed_c10d._get_default_group()
    if _SIDE_GROUP.get("default") is not default:
        _SIDE_GROUP.update(default=default, group=dist.new_group(backend="gloo"))
    return _SIDE_GROUP["group"]


def side_barrier() -> None:
    if dist_on():
        dist.barrier(group=side_group())


def all_gather_small(obj: Any) -> list[Any]:
    """Every rank's `obj` (small, JSON-like), indexed by rank; one process -> [obj]. Pickle
    over the process group is fine here: the bytes come from our own ranks, not a file."""
    if not dist_on():
        return [obj]
    out: list[Any] = [None] * world_now()
    dist.all_gather_object(out, obj, group=side_group())
    return out


def broadcast_small(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=side_group())
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one (a MAX all-reduce on the default
    group, one per step), so that decisions taken at a step boundary (stop, save) agree."""
    if not dist_on():
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def on_every_rank(fn, peer_error=RuntimeError) -> Any:
    """Run `fn` on every rank and make a failure on one rank a failure on all of them, so that
    no rank walks on into the next collective while another has given up (a hang). The rank
    that failed re-raises its own exception; the others raise `peer_error("rank k: ...")`."""
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        error = e
    messages = all_gather_small(None if error is None else f"rank {rank_now()}: {first_line(error)}")
    if error is not None:
        raise error
    failed = [m for m in messages if m]
    if failed:
        raise peer_error(failed[0])
    return result
