"""`tenfold train --dry-run`: the config checked and the run resolved, without torch.

It checks the whole config and prints what the run would be, in well under a second, with
nothing built, read or written: the run as `tenfold.run.resolve_run` resolves it for the
launch (processes pp x dp, the batch triplet, the precision, the model's shape and size, ZeRO
and recompute), the launcher's checks (`engine.launch.preflight`, the pipeline's limits), and
the planner's per-rank memory prediction for it, the one training prints at its start. What
needs the data, the model's modules or the device is checked when the run starts: the data
file's contents, a tokenizer's vocabulary against the model's, whether a Hugging Face model's
blocks allow the techniques, and bf16 support (a device without it trains in fp32).

The memory line is `tenfold.plan.for_run.memory_line`, the one training prints at its start and
`tenfold plan` prints for the same run.
"""

from __future__ import annotations

import os

from tenfold.engine.parallel.torchrun_env import launched_by_torchrun

# torch-free, shared with the trainer's start line and `tenfold plan`
from tenfold.plan.for_run import memory_by_category, memory_line


def world_size(cfg) -> int:
    """The processes this run has: torchrun's WORLD_SIZE when launched by it, else the config's
    nnodes x nproc. A config planned for several nodes (`parallel.nnodes`) must be started with
    that many processes."""
    par = cfg.parallel
    planned = par.nnodes * par.nproc
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if par.nnodes > 1 and world != planned:
            from tenfold.errors import UserError

            raise UserError(f"parallel.nnodes {par.nnodes} x parallel.nproc {par.nproc} = {planned} processes planned, "
                            f"but torchrun started {world} (WORLD_SIZE); start {par.nnodes} nodes with "
                            f"--nproc-per-node {par.nproc}, or change the config")
        return world
    return planned


def precision_text(precision: str, configured: str) -> str:
    """`fp32 (auto: this CPU has no bf16 matrix instructions)`, `bf16 (fp32 where ...)`."""
    if configured == "auto" and precision == "fp32":
        return "fp32 (auto: this CPU has no bf16 matrix instructions)"
    why = "auto; " if configured == "auto" else ""
    return precision + (f" ({why}fp32 where the device has no bf16)" if precision == "bf16" else "")


def room_here(local_ranks: int, with_torch: bool = False):
    """The memory each of `local_ranks` ranks has on this machine (tenfold.plan.room.Room): on
    a machine without a GPU, its host memory shared by them, torch-free; on a GPU machine one
    device's memory, read through torch (`with_torch`; None without it)."""
    from tenfold.plan.room import Room
    from tenfold.host import local_device_is_cpu

    if local_device_is_cpu():
        return Room(local_ranks)
    if not with_torch:
        return None
    import torch

    if not torch.cuda.is_available():
        return Room(local_ranks)
    return Room(local_ranks, float(torch.cuda.get_device_properties(0).total_memory), torch.cuda.get_device_name(0))


def fit_memory(run, room=None):
    """The planner's per-rank memory for the run as the fit check compares it, on this machine's
    device (no time: no peak FLOP/s to measure)."""
    from tenfold.plan.for_run import predict_run_memory

    hardware = "cpu"
    if room is not None and room.device_bytes is not None:  # torch is loaded: room_here read the GPU
        import torch

        from tenfold.engine.memory.measure import planner_hardware_name

        hardware = planner_hardware_name(torch.device("cuda", 0))
    return predict_run_memory(run, hardware)


def check_fit(cfg, world: int) -> None:
    """`tenfold train` before torch is imported: a run the planner says cannot fit this machine's
    host memory is refused in well under a second (a GPU's memory is checked once the device
    is up, engine/loop/parts.py)."""
    from tenfold.plan.room import refuse_unless_fits
    from tenfold.run import resolve_run

    room = room_here(cfg.parallel.nproc) if cfg.train.fit_check else None
    if room is not None:
        refuse_unless_fits(fit_memory(resolve_run(cfg, world)), room)


def describe(run, c, predicted: dict[str, int], fit: str | None = None) -> list[str]:
    """The dry run's report of `run`, resolved from the config `c`, one line per aspect."""
    from tenfold.models.presets import param_count

    m = run.model
    name = c.model.hf_pretrained or c.model.hf_config or c.model.name
    return [
        "tenfold train --dry-run: the config is valid; nothing was built, read or written",
        f"  model      {name}: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, vocab {m.vocab_size}, "
        f"context {m.max_seq_len} ({param_count(m) / 1e6:,.2f}M params)",
        f"  precision  {precision_text(run.precision, c.precision.dtype)}",
        f"  batch      {run.global_batch} = {run.micro_batch} x {run.grad_accum} x dp {run.dp} sequences of "
        f"{run.seq_len} tokens ({run.tokens_per_step:,} tokens per step), {c.train.steps} steps",
        f"  processes  {run.layout_line()}" + (f" ({c.parallel.nnodes} nodes x {c.parallel.nproc})"
                                                      if c.parallel.nnodes > 1 else ""),
        "  memory     " + memory_line(predicted).removeprefix("memory "),
        *([f"  fit        {fit}"] if fit else []),
        f"  output     {c.log.out}",
    ]


def dry_run(cfg) -> int:
    """`tenfold train --dry-run`: check, resolve and print the run; exit status 0."""
    from tenfold.engine.parallel.launch import preflight
    from tenfold.plan.room import fit_line
    from tenfold.run import resolve_run

    world = world_size(cfg)
    preflight(cfg, world)  # pp divides the processes, the batch triplet, the pipeline's limits
    run = resolve_run(cfg, world)
    room = room_here(cfg.parallel.nproc, with_torch=True)
    memory = fit_memory(run, room)
    for line in describe(run, cfg, memory_by_category(memory), fit_line(memory, room) if room else None):
        print(line)
    return 0
