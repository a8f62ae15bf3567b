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

from tenfold.capabilities import num_stages
from tenfold.config import TenfoldConfig, build_config, config_toml
from tenfold.errors import UserError
from tenfold.plan.api import Plan
from tenfold.run import ResolvedRun, resolve_run
from tenfold.terms import MULTI_STAGE_SCHEDULES, virtual_stages_for

# What a strategy sets, written into an emitted file even at its default value.
STRATEGY_KEYS = {
    "model": ("name",), "data": ("seq_len",), "train": ("micro_batch", "global_batch"),
    "precision": ("dtype",), "recompute": ("policy",), "parallel": ("zero_stage", "pp_degree", "tp_degree", "nproc"),
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


def config_for_plan(base: TenfoldConfig, plan: Plan, gpus_per_node: int) -> tuple[TenfoldConfig, ResolvedRun]:
    """`base` with `plan`'s strategy written in, resolved as `tenfold train` resolves it (a
    UserError if train would refuse it). One node: `parallel.nproc` is the GPU count, so
    `tenfold train --config FILE` starts every rank; several nodes: torchrun starts them."""
    if plan.unsupported:
        raise UserError(f"tenfold train cannot run this strategy: {'; '.join(plan.unsupported)}")
    s, d = plan.strategy, base.model_dump(mode="json")
    par = d["parallel"]
    before = num_stages(par["pp_degree"], par["pp_schedule"], virtual_stages_for(par["pp_schedule"], par["virtual_stages"]))
    keep_split = before == num_stages(s["pp"], s["pp_schedule"], s["virtual_stages"])  # blocks per stage still apply
    par.update(zero_stage=s["zero"], pp_degree=s["pp"], pp_schedule=s["pp_schedule"], tp_degree=s["tp"],
               # train's default (on with tp > 1) unless the plan says otherwise
               sequence_parallel=None if s["sequence_parallel"] == (s["tp"] > 1) else s["sequence_parallel"],
               virtual_stages=s["virtual_stages"] if s["pp_schedule"] in MULTI_STAGE_SCHEDULES else None,
               pp_split=par["pp_split"] if keep_split else None,
               nproc=plan.gpus if plan.gpus <= gpus_per_node else 1)
    d["train"].update(micro_batch=plan.micro_batch, global_batch=plan.global_batch, grad_accum=None)
    d["data"]["seq_len"] = plan.seq_len
    d["precision"]["dtype"] = s["precision"]
    d["recompute"]["policy"] = s["ac"]
    cfg = build_config(d)
    return cfg, resolve_run(cfg, plan.gpus)


def launch_line(cfg: TenfoldConfig, gpus: int, gpus_per_node: int, config_file: str | None = None) -> str:
    """The command that starts this run: `tenfold train --nproc N ...` on one node, `torchrun
    --nnodes ... -m tenfold train ...` (run on every node, HEAD = the first node) on several."""
    from tenfold.cli import train_argv  # the inverse of the flags train reads

    args = ["--config", config_file] if config_file else train_argv(cfg, STRATEGY_KEYS)
    if gpus <= gpus_per_node:
        return shlex.join(["tenfold", "train", *(["--nproc", str(gpus)] if gpus > 1 else []), *args])
    nodes, per_node = nodes_for(gpus, gpus_per_node)
    return shlex.join(["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node), *RENDEZVOUS,
                       "-m", "tenfold", "train", *args])


def emitted_toml(cfg: TenfoldConfig, plan: Plan, launch: str, replan: str) -> str:
    """The file `--emit` writes: a header saying what was planned and how to run it, then the config."""
    m = plan.memory
    header = [
        f"{EMIT_MARK} for {plan.model} on {plan.gpus} x {plan.hardware}: a strategy tenfold train runs.",
        f"# predicted per GPU: {m.total_bytes / 2**30:,.2f} GiB of {m.capacity_bytes / 2**30:,.1f} GiB, step "
        f"{plan.step_time_s:,.3g} s, {plan.tokens_per_s:,.0f} tokens/s, MFU {plan.mfu:.1%}",
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
    try:
        with p.open("rb") as f:
            return f.read(len(EMIT_MARK)) == EMIT_MARK.encode()
    except OSError:
        return False
