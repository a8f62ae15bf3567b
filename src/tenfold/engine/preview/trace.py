"""`tenfold plan --trace`: the run's own set-up and one optimizer step, on fake tensors, for one
rank of a world of the run's full size.

What runs is what `tenfold train` runs (engine/loop/parts.py's model build, every technique applied in
engine/parallel/parallelize.py, the optimizer; engine/loop/step.py's micro-batches, pipeline schedule, clip and
optimizer step), with two substitutions that move no data:
  * tensors are `torch._subclasses.fake_tensor.FakeTensor`s (shape, dtype and storage size,
    no memory behind them), so a 175B-parameter model costs nothing to build;
  * the process group is torch's `fake` backend over a `FakeStore`
    (torch.testing._internal.distributed.fake_pg), which accepts every collective of a world of
    any size and does nothing, as torchtitan's memory estimation runs a large world on one
    process (torchtitan/scripts/estimate/estimation.py).
DTensor derives each operator's global output shape on fake tensors of its own; in the trace
those would be the trace's, so that propagation runs apart from the tracker, as in a real run
(stand_ins.py `sharding_metadata_apart`).

A mixture-of-experts router's choices depend on values fake tensors do not have; the trace
routes every token balanced (`balanced_routing`: token t's k experts are t k, ..., t k + k - 1
mod E, every expert the same share, the planner's assumption, tenfold.plan.moe), so the routing
bookkeeping (counts, sort, all-to-all split sizes) runs on real index tensors beside the fake
activations. An all-to-all of real tensors (the expert-parallel split sizes) returns this rank's
input as its output (`_as_every_rank_sends`): every rank of the fake world runs the same step,
so what arrives is what this rank sends.

Two steps run: the first creates the optimizer states, the second is measured with the tensor
tracker a real run uses (engine/memory/tensor_tracker.py: params, grads, optimizer, gathered params,
activations, buffers, the peak) and a dispatch mode that records every collective (kind, the
mesh dimension of its group and the group's size, payload; `CollectiveLog`). Host syncs
(`.item()`) of data-dependent fake values return a fixed value (`_no_value`): the loss and
overflow flag have no meaning here (a zero flag = finite gradients, so the optimizer step is
taken); a value fake tensors still know (a constant, Adam's step counter) is returned as it is,
and operators on real tensors only (the device mesh's rank table, the routing's indices and
counts) run for real.

Run as `python -m tenfold.engine.preview.trace --world W --rank R -- <train flags>`: one JSON line on
stdout. `trace_run` (the parent) starts one such process per distinct pipeline stage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import replace
from contextlib import contextmanager
from typing import Any

from tenfold.engine.preview.stand_ins import (
    balanced_routing,
    ddp_reduces_in_python,
    ddp_without_shape_check,
    module_conversion_to_itself_keeps_it,
    sharding_metadata_apart,
)

# The child's imports (torch, the engine) are inside the functions: `tenfold plan` imports this
# module for `trace_run` without torch.

RESULT_PREFIX = "TENFOLD_TRACE "
C10D_KINDS = {  # c10d ops (what FSDP2, DDP and pipelining call) -> kind
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "allgather_": "all_gather",
    "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "broadcast_": "broadcast",
    "send": "send", "recv_": "recv", "alltoall_base_": "all_to_all",
}
FUNCTIONAL_KINDS = {"all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
                    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
                    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
                    "broadcast": "broadcast", "all_to_all_single": "all_to_all"}
# Bytes one rank sends per payload byte in a ring (nccl-tests' PERFORMANCE.md bus-bandwidth
# factors; the unit tenfold.engine.observe.comm_bytes and tenfold.plan.tp_traffic use).
RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n,
        "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0, "recv": lambda n: 0.0}


# --------------------------------------------------------------------------- the child


def _nbytes(t) -> int:
    return int(t.numel() * t.element_size())


def _tensors(x) -> list:
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _group(args, group_now: tuple[int, str | None] | None,
           labels: dict[str, str]) -> tuple[int | None, str | None]:
    """The size and the mesh dimension (`labels`: process group name -> "dp", "tp", "cp", ...)
    of a collective's process group: a functional collective names its group; a c10d op holds
    it as a script object that Python cannot read, so they are the ones the `torch.distributed`
    call around it named (`_named_groups`), None outside one."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in reversed(args):
        if isinstance(a, str):
            return int(_resolve_process_group(a).size()), labels.get(a)
    return group_now if group_now is not None else (None, None)


def collective_record(func, args, group_now: tuple[int, str | None] | None = None,
                      labels: dict[str, str] | None = None) -> dict | None:
    """kind, group size, group (the mesh dimension it runs on, None where unknown) and payload
    of one collective op (c10d or functional), else None.
    Payload: the full buffer, as nccl-tests counts it: an all-reduce's or broadcast's tensor, a
    reduce-scatter's input, an all-gather's output (= the input shard x group size), a
    send/recv's tensor."""
    packet = getattr(func, "_overloadpacket", None)
    name, namespace = getattr(packet, "__name__", ""), str(getattr(func, "namespace", ""))
    kind = C10D_KINDS.get(name) if namespace == "c10d" else (
        FUNCTIONAL_KINDS.get(name) if namespace == "_c10d_functional" else None)
    if kind is None:
        return None
    size, group = _group(args, group_now, labels or {})
    if namespace == "c10d":
        inputs = _tensors(args[1] if kind in ("all_gather", "reduce_scatter") and len(args) > 1 else args[0])
        if kind == "all_gather":  # (outputs, inputs, ...): the outputs are the full buffer
            inputs = _tensors(args[0])
        payload = sum(_nbytes(t) for t in inputs)
    else:
        payload = sum(_nbytes(t) for t in _tensors(args[0]))
        if kind == "all_gather":
            payload *= size or 1
    return {"kind": kind, "group_size": size, "group": group, "payload_bytes": payload}


def _collective_log_class():
    import torch
    import torch.utils._pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    class CollectiveLog(TorchDispatchMode):
        """Every collective the step issues, in order; `.item()` of a data-dependent fake value
        returns 0 (module docstring). DTensor operands are left to DTensor, which turns them
        into functional collectives that this mode then sees."""

        def __init__(self) -> None:
            super().__init__()
            self.records: list[dict] = []
            self.recording = False
            # (size, mesh dimension) of the group a torch.distributed call names, set by `_named_groups`
            self.group_now: tuple[int, str | None] | None = None
            self.labels: dict[str, str] = {}  # process group name -> mesh dimension (`group_labels`)
            self.default_group = 1  # a collective no Python call names (DDP's C++ reducer: the dp group)
            self.p2p_group = 1  # a send/recv no Python call names (pipelining's lone isend/irecv: the pp group)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            from torch.distributed.tensor import DTensor

            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
                # Real tensors only (the device mesh's rank table, the routing's indices and
                # counts): a real result, as a run computes it.
                with _disable_current_modes():
                    out = func(*args, **(kwargs or {}))
                    self._record(func, args)
                    _as_every_rank_sends(func, args)
                return out
            if func is torch.ops.aten._local_scalar_dense.default:
                try:
                    return func(*args, **(kwargs or {}))
                except Exception:  # noqa: BLE001 - DataDependentOutputException: no value
                    return _no_value(args[0].dtype)
            out = func(*args, **(kwargs or {}))
            self._record(func, args)
            return out

        def _record(self, func, args) -> None:
            if not self.recording:
                return
            rec = collective_record(func, args, self.group_now, self.labels)
            if rec is None:
                return
            if rec["group_size"] is None:  # no Python call named its group
                p2p = rec["kind"] in ("send", "recv")
                rec["group_size"] = self.p2p_group if p2p else self.default_group
                rec["group"] = "pp" if p2p else "dp"
            self.records.append(rec)

    return CollectiveLog


def _as_every_rank_sends(func, args) -> None:
    """A c10d all-to-all of real tensors (the expert-parallel split sizes): its output is its
    input, what every rank of a world that runs the same step receives (the fake backend
    writes nothing)."""
    packet = getattr(func, "_overloadpacket", None)
    if str(getattr(func, "namespace", "")) == "c10d" and getattr(packet, "__name__", "") == "alltoall_base_":
        out, inp = args[0], args[1]
        if out.shape == inp.shape:
            out.copy_(inp)


def _no_value(dtype):
    """What `.item()` of a fake value with no known value returns: False for a flag (no
    overflow), 0.0 for a float (the loss, a norm: finite), 1 for an integer (torch.pipelining's
    warm-up vote, an int32 of 1 per stage whose p2p metadata is static, as tenfold's stages'
    are: techniques/pipeline.py `stage_io_examples`)."""
    import torch

    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point else 1


NAMED_GROUP_CALLS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_gather",
                     "reduce_scatter", "send", "recv", "batch_isend_irecv", "all_reduce_coalesced",
                     "all_to_all_single",
                     "all_gather_single", "reduce_scatter_single")  # FSDP2's, torch 2.13
# (isend/irecv stay unwrapped: torch checks a P2POp's function by identity; pipelining sends
# through batch_isend_irecv, whose group is its ops' group.)


class _DoneWork:
    """An async all-reduce's handle whose future holds the reduced tensor, as gloo's and NCCL's
    do (the fake backend's holds None; DDP's bf16 communication hook reads it,
    techniques/zero.py `bf16_reduce_hook`)."""

    def __init__(self, tensor) -> None:
        self.tensor = tensor

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        import torch

        fut = torch.futures.Future()
        fut.set_result([self.tensor])
        return fut


@contextmanager
def _named_groups(log):
    """Wrap torch.distributed's collectives so that `log` knows the size of the group each c10d
    op below them runs on (FSDP2, pipelining and tenfold look the functions up on the module at
    call time)."""
    import inspect

    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in NAMED_GROUP_CALLS if hasattr(dist, name)}

    def wrap(fn):
        signature = inspect.signature(fn)

        def call(*args, **kwargs):
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
                group = bound.get("group") or next((op.group for op in bound.get("p2p_op_list", ())), None)
            except TypeError:
                group = None
            name = getattr(group if group is not None else dist.group.WORLD, "group_name", None)
            outer, log.group_now = log.group_now, (dist.get_world_size(group), log.labels.get(name))
            try:
                work = fn(*args, **kwargs)
            finally:
                log.group_now = outer
            if fn.__name__ == "all_reduce" and work is not None:  # async: a future holding the tensor
                return _DoneWork(args[0] if args else kwargs["tensor"])
            return work

        return call

    for name, fn in originals.items():
        setattr(dist, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _summarize(records: list[dict]) -> list[dict]:
    """Collectives of one step by (kind, group size, group): count, payload and ring bytes per
    rank."""
    out: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0])
    for r in records:
        key = (r["kind"], r["group_size"], r["group"] or "")
        out[key][0] += 1
        out[key][1] += r["payload_bytes"]
        out[key][2] += RING[r["kind"]](r["group_size"]) * r["payload_bytes"] if r["group_size"] > 1 else 0.0
    return [{"kind": k, "group_size": n, "group": g or None, "count": c, "payload_bytes": p, "ring_bytes": round(b, 1)}
            for (k, n, g), (c, p, b) in sorted(out.items())]


def group_labels(d) -> dict[str, str]:
    """{process group name: mesh dimension} of a DistInfo's groups: the mesh's ("pp", "dp",
    "tp", a flattened "dp_tp"), the hybrid split's, the cp group, the expert view's ("dp_mod_ep",
    "ep"). A group that two dimensions
    share (cp over every dp x cp rank when dp is 1) takes the later, more specific one."""
    out: dict[str, str] = {}
    if d.mesh is not None:
        names = list(d.mesh.mesh_dim_names) + (["dp_tp"] if d.dp_size > 1 and d.tp_size > 1 else [])
        for name in names:
            out[d.mesh[name].get_group().group_name] = name
    if d.hybrid_mesh is not None:
        for name in d.hybrid_mesh.mesh_dim_names:
            out[d.hybrid_mesh[name].get_group().group_name] = name
    if d.cp_group is not None:
        out[d.cp_group.group_name] = "cp"
    if d.ep_mesh is not None:
        for name in d.ep_mesh.mesh_dim_names:
            out[d.ep_mesh[name].get_group().group_name] = name
    return out


def check_traceable(run, dp: int) -> None:
    """UserError for a layout the trace cannot run: DDP (ZeRO-0/1 without tensor parallelism
    on several data-parallel ranks, `dp`: the dp x cp ranks that reduce gradients) keeps its
    buckets in C++ and reads their host memory before every forward (`Reducer._rebuild_buckets`),
    which fake tensors have none of; a mixture-of-experts model in another precision than bf16
    (torch._grouped_mm's fake kernel); expert parallelism over a Hugging Face model's experts
    (its split sizes come from the router's real choices)."""
    from tenfold.errors import UserError
    from tenfold.models.specs import spec_for

    if run.ep > 1 and spec_for(run.model_kind).hugging_face:
        raise UserError(f"--trace runs expert parallelism on tenfold's MoE blocks, whose routing it balances; a Hugging "
                        f"Face {run.hf_model_type} model's router picks experts from values fake tensors lack: trace it "
                        f"with --ep 1 (its experts then sharded by --zero 2/3)")
    if run.model is not None and run.model.is_moe and run.precision != "bf16":
        raise UserError(f"--trace runs mixture-of-experts models in bf16 (--precision bf16); torch's fake-tensor "
                        f"kernel of the experts' grouped GEMM (torch._grouped_mm) takes bf16 only, not {run.precision}")
    if dp > 1 and run.zero_runs_as <= 1:
        raise UserError(f"--trace runs FSDP2 layouts (--zero 2 or 3, or any ZeRO stage with --tp > 1); ZeRO-{run.zero_stage} "
                        f"on {dp} data-parallel ranks runs on DDP, whose C++ gradient buckets cannot run on fake tensors")


def trace_rank(train_flags: list[str], world: int, rank: int) -> dict:
    """Set up the run of `train_flags` as rank `rank` of `world` and trace one step (the module docstring).
    Returns {"rank", "stage", "batch" (the micro-batches the step ran, over the data-parallel ranks the
    mesh has), "layout" (the mesh built), "memory": MEMORY_KEYS, "collectives": [...]}."""
    t0 = time.perf_counter()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tenfold.engine.loop import parts as P
    from tenfold.engine.loop import step as S
    from tenfold.engine.parallel.distributed import join_layout
    from tenfold.engine.memory.tensor_tracker import measure_cpu, pipeline_receive_buffer_bytes
    from tenfold.run import resolve_run
    from tenfold.run_args import add_run_arguments, config_from_args
    from tenfold.techniques.precision import build_precision

    train = argparse.ArgumentParser(prog="tenfold train")  # train's run flags, as the command line adds them
    add_run_arguments(train)
    cfg = config_from_args(train.parse_args(train_flags))
    run = resolve_run(cfg, world)
    check_traceable(run, run.grad_ranks)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    d = replace(join_layout(run.dims, cfg.parallel.timeout_s, offload=run.offload != "none"),
                engine_device="cuda")  # the GPU run's FSDP2 units and prefetching, not a CPU run's
    precision = build_precision(run.precision, cfg.precision, d.device)
    log = _collective_log_class()()
    log.default_group, log.p2p_group = d.dp_size, d.pp_size
    log.labels = group_labels(d)
    with FakeTensorMode(allow_non_fake_inputs=True), log, module_conversion_to_itself_keeps_it(), \
            ddp_without_shape_check(), _named_groups(log), balanced_routing(), sharding_metadata_apart():
        P.seed_everything(cfg.train.seed)
        model, adapter, lora = P.build_model(P.new_model(run, cfg, None), run, cfg.model.blocks, d, precision, None,
                                             None, None)
        ddp_reduces_in_python(model)
        optimizer, scheduler = P.build_optimizer(model, run, cfg.train, cfg.parallel.timeout_s, d)
        parts = P.Parts(run, d, precision, None, adapter, model, optimizer, scheduler, None, cfg.train, lora)
        shape = (run.micro_batch, run.seq_len)
        batches = [{"input_ids": torch.zeros(shape, dtype=torch.long), "labels": torch.zeros(shape, dtype=torch.long)}
                   for _ in range(run.grad_accum)]

        def one_step() -> None:
            loss, tokens = S.accumulate_gradients(parts, batches)
            S.apply_gradients(parts, loss, tokens, 1)

        one_step()  # creates the optimizer states, as a run's first step does
        log.recording = True
        measured, _ = measure_cpu(model, optimizer, one_step, d.device)
        log.recording = False
        measured["receive_buffer_bytes"] = pipeline_receive_buffer_bytes(model)  # of the activations
    batch = {"micro_batch": run.micro_batch, "grad_accum": len(batches), "dp": d.data_size, "seq_len": run.seq_len,
             "global_batch": run.micro_batch * len(batches) * d.data_size}
    layout = {"processes": d.world_size, "pp": d.pp_size, "dp": d.data_size, "cp": d.cp_size, "tp": d.tp_size,
              "shard_size": d.shard_size, "hybrid": d.hybrid, "ep": d.ep_size}
    return {"rank": rank, "stage": d.pp_rank, "batch": batch, "layout": layout, "memory": measured,
            "collectives": _summarize(log.records),
            "seconds": round(time.perf_counter() - t0, 2)}


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tenfold.engine.preview.trace")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("flags", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    import warnings

    warnings.filterwarnings("ignore")  # fake tensors and the fake backend warn on every use
    from tenfold.errors import UserError

    try:
        result = trace_rank(flags, a.world, a.rank)
    except UserError as exc:
        print(f"tenfold plan --trace: error: {exc}", file=sys.stderr)
        return 2
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------- the parent


def stage_ranks(pp: int, dp: int, tp: int, stages: list[int] | None = None) -> list[int]:
    """One global rank per pipeline stage of `stages` (default: every stage): the (pp, dp, tp)
    mesh's first rank of the stage (tenfold.layout: tp innermost, then dp, then pp; `dp` is the
    mesh's, dp x cp)."""
    return [s * dp * tp for s in (range(pp) if stages is None else stages)]


def _child(train_flags: list[str], world: int, rank: int, timeout_s: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tenfold.engine.preview.trace", "--world", str(world), "--rank", str(rank), "--", *train_flags]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _result(proc: subprocess.Popen, rank: int, timeout_s: float) -> dict:
    from tenfold.errors import RunError, UserError

    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RunError(f"--trace: rank {rank} took more than {timeout_s:.0f} s") from None
    line = next((ln for ln in out.splitlines() if ln.startswith(RESULT_PREFIX)), None)
    if proc.returncode == 2:
        raise UserError(err.strip().splitlines()[-1].removeprefix("tenfold plan --trace: error: "))
    if line is None:
        tail = "\n".join(err.strip().splitlines()[-15:])
        raise RunError(f"--trace: rank {rank} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(line.removeprefix(RESULT_PREFIX))


def trace_run(train_flags: list[str], world: int, pp: int, dp: int, tp: int, stages: list[int] | None = None,
              parallel: int = 2, timeout_s: float = 1800.0) -> list[dict]:
    """Trace one rank of each pipeline stage in `stages` (default every stage), each in its own
    process (a process group and a fake world per process), `parallel` at a time; returns
    their results in stage order."""
    ranks = stage_ranks(pp, dp, tp, stages)
    results: dict[int, dict] = {}
    running: list[tuple[int, subprocess.Popen]] = []
    try:
        for rank in ranks:
            running.append((rank, _child(train_flags, world, rank, timeout_s)))
            if len(running) >= parallel:
                r, proc = running.pop(0)
                results[r] = _result(proc, r, timeout_s)
        for r, proc in running:
            results[r] = _result(proc, r, timeout_s)
    finally:
        for _, proc in running:
            if proc.poll() is None:
                proc.kill()
    return [results[r] for r in ranks]


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
