"""Advice that runs: a planned strategy as the config `tenfold train` runs, its launch line, and
the TOML file `tenfold plan --emit FILE` writes.

The config is the user's own (every flag, `--config`, `--deepspeed` and `--set` they gave) with
the plan's strategy written in, and it is resolved by `tenfold.run.resolve_run`, the engine's
own check, before anything is printed or written: a launch line or file that train would refuse
is never produced.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from tenfold.config import TenfoldConfig, config_toml
from tenfold.errors import UserError
from tenfold.plan.api import Plan
from tenfold.plan.for_run import memory_by_category, memory_line
from tenfold.run import ResolvedRun, config_for_run, resolve_run

# What a strategy sets, written into an emitted file even at its default value.
STRATEGY_KEYS = {
    "model": ("name",), "data": ("seq_len",), "train": ("micro_batch", "global_batch"),
    "precision": ("dtype",), "recompute": ("policy",),
    "parallel": ("zero_stage", "pp_degree", "tp_degree", "ep_degree", "nproc", "nnodes"),
}
EMIT_MARK = "# Written by tenfold plan"
RENDEZVOUS = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "HEAD:29500", "--rdzv-id", "JOB")


def nodes_for(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, processes per node): the fewest nodes of at most `gpus_per_node` that split the
    GPUs evenly (torchrun starts the same number of processes on every node)."""
    nodes = -(-gpus // gpus_per_node)
    while gpus % nodes:
        nodes += 1
    return nodes, gpus // nodes


def config_for_plan(base: TenfoldConfig, run: ResolvedRun, gpus_per_node: int) -> tuple[TenfoldConfig, ResolvedRun]:
    """`base` with `run`'s layout written in (tenfold.run.config_for_run) and its processes as
    nodes x processes per node, resolved again as `tenfold train` resolves it (a UserError if
    train would refuse it): `tenfold train --config FILE` starts every rank of a one-node run,
    and torchrun on every node starts a run of several (`parallel.nnodes`)."""
    nodes, per_node = nodes_for(run.world_size, gpus_per_node)
    cfg = config_for_run(base, run).model_copy(deep=True)
    cfg.parallel.nproc, cfg.parallel.nnodes = per_node, nodes
    return cfg, resolve_run(cfg, run.world_size)


def launch_line(cfg: TenfoldConfig, gpus: int, gpus_per_node: int, config_file: str | None = None) -> str:
    """The command that starts this run: `tenfold train --nproc N ...` on one node, `torchrun
    --nnodes ... -m tenfold train ...` (run on every node, HEAD = the first node) on several."""
    from tenfold.run_args import train_argv  # the inverse of the flags train reads

    nodes, per_node = nodes_for(gpus, gpus_per_node)
    args = ["--config", config_file] if config_file else train_argv(cfg, STRATEGY_KEYS)
    if nodes == 1:
        return shlex.join(["tenfold", "train", *(["--nproc", str(gpus)] if gpus > 1 else []), *args])
    return shlex.join(["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node), *RENDEZVOUS,
                       "-m", "tenfold", "train", *args])


def emitted_toml(cfg: TenfoldConfig, plan: Plan, launch: str, replan: str) -> str:
    """The file `--emit` writes: a header saying what was planned and how to run it, then the config."""
    m = plan.memory
    header = [
        f"{EMIT_MARK} for {plan.model} on {plan.gpus} x {plan.hardware}: a strategy tenfold train runs.",
        f"# layout: {plan.layout_line}",
        f"# predicted per GPU on {plan.hardware}: {m.total_bytes / 2**30:,.2f} GiB of {m.capacity_bytes / 2**30:,.1f} GiB "
        f"(with allocator reserve and runtime), step {plan.step_time_s:,.3g} s, {plan.tokens_per_s:,.0f} tokens/s, "
        f"MFU {plan.mfu:.1%}",
        f"# {memory_line(memory_by_category(m))}",
        "# (`tenfold train --config THIS_FILE --dry-run` prints the same line)",
        "# run it:" + ("  (on every node; HEAD = the first node's hostname)" if launch.startswith("torchrun") else ""),
        f"#   {launch}",
        "# predict it again:",
        f"#   {replan}",
        "",
    ]
    return "\n".join(header) + config_toml(cfg, STRATEGY_KEYS)


def write_emit(path: str, text: str) -> None:
    """Write `text` to `path` whole (a temporary file, then a rename), never over a file that
    tenfold plan did not write."""
    p = Path(path)
    if p.is_symlink() or (p.exists() and not _written_by_plan(p)):
        raise UserError(f"--emit {path}: exists and was not written by tenfold plan; choose another path or remove it")
    if not p.parent.is_dir():
        raise UserError(f"--emit {path}: folder {p.parent} does not exist")
    tmp = p.with_name(f".{p.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, p)
    except OSError as e:
        try:  # on a read-only file system the clean-up fails too: the first error is the one to tell
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise UserError(f"--emit {path}: cannot write it ({e.strerror or e}); choose a writable place") from None


def _written_by_plan(p: Path) -> bool:
    if not p.is_file():  # a folder, a device, a FIFO (whose open would wait for a writer)
        return False
    try:
        with p.open("rb") as f:
            return f.read(len(EMIT_MARK)) == EMIT_MARK.encode()
    except OSError:
        return False
