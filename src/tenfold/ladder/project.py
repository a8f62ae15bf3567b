"""`tenfold ladder --project`: the same rungs on a big fleet, from the planner, beside the
small-scale ladder measured here (OUT/ladder.json) if there is one.

The fleet's rungs are the planner's own (`tenfold.plan.ladder.run_ladder`, what `tenfold plan
--ladder` prints, with the recipe's claimed days where the scenario is the recipe's): one device in
fp32 at batch 1 -> mixed precision -> accumulation x8 -> checkpointing -> ZeRO-3 on a node ->
pipeline over the fleet. Rung k there is rung k here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tenfold.ladder.report import fmt_multiplier, fmt_rate, write_json
from tenfold.ladder.rungs import RUNG_NAMES

GiB = 2**30


def project(model: str, gpu: str, gpus: int, tokens: float | None, pp: int | None,
            gpus_per_node: int | None, seq_len: int | None) -> list:
    """The planner's ladder for the fleet (raises UserError for a bad model/GPU/count)."""
    from tenfold.errors import UserError
    from tenfold.plan.hardware import get_hardware
    from tenfold.plan.ladder import run_ladder

    hw = get_hardware(gpu)
    node = gpus_per_node or min(8, hw.gpus_per_node)
    stages = pp or 8
    if gpus < node or gpus % node:
        raise UserError(f"--gpus {gpus} must be a positive multiple of the GPUs per node ({node}) for --project")
    if gpus % stages:
        raise UserError(f"--gpus {gpus} must be a multiple of the pipeline stages ({stages}); pass --pp")
    return run_ladder(model, hw, gpus_node=node, gpus_final=gpus, pp=stages, tokens=tokens or 300e9,
                      seq_len=seq_len)


def load_measured(out_dir: Path) -> dict[str, dict] | None:
    path = out_dir / "ladder.json"
    if not path.is_file():
        return None
    from tenfold.errors import UserError
    from tenfold.textfiles import read_text  # bounded: a regular file, not a FIFO read forever

    try:
        data = json.loads(read_text(path, "ladder.json", 64 * 2**20))
        return {r["name"]: r for r in data.get("rungs", [])} | {"_header": data}
    except (UserError, ValueError, KeyError, TypeError):
        return None


def projection_rows(rungs: list, measured: dict[str, dict] | None) -> list[dict[str, Any]]:
    rows = []
    for i, r in enumerate(rungs):
        p = r.plan
        name = RUNG_NAMES[i] if i < len(RUNG_NAMES) else None
        here = (measured or {}).get(name) if name else None
        rows.append({
            "index": i, "name": name or "final", "fleet_rung": r.name, "gpus": r.gpus,
            "gib_per_gpu": p.memory.total_bytes / GiB, "fits": p.fits, "days": p.train_days,
            "tokens_per_s": p.tokens_per_s, "mfu": p.mfu, "time_multiplier": r.factor,
            "seed_days": None if r.seed is None else r.seed.days, "seed_factor": None if r.seed is None else r.seed.factor,
            "measured_here": None if not here else {
                "status": here.get("status"), "tokens_per_s": here.get("tokens_per_s"),
                "time_multiplier": here.get("time_multiplier"), "predicted_tokens_per_s": here.get("predicted_tokens_per_s"),
            },
        })
    return rows


def print_projection(rows: list[dict], title: str, console=None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    c = console or Console(width=None if sys.stdout.isatty() else 170)
    seed = any(r["seed_days"] is not None for r in rows)
    here = any(r["measured_here"] for r in rows)
    t = Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left")
    cols = ["#", "rung on the fleet (planner)", "GPUs", "GiB/GPU", "fits", "days", "time x"]
    cols += ["seed days", "seed x"] if seed else []
    cols += ["here: tok/s", "here: time x"] if here else []
    for col in cols:
        t.add_column(col, justify="left" if col.startswith("rung") else "right", overflow="fold")
    for r in rows:
        days = "-" if r["days"] is None else (f"{r['days']:,.0f}" if r["days"] >= 100 else f"{r['days']:,.1f}")
        row = [str(r["index"]), r["fleet_rung"], str(r["gpus"]), f"{r['gib_per_gpu']:,.0f}",
               "yes" if r["fits"] else "[red]no[/]", days, fmt_multiplier(r["time_multiplier"])]
        if seed:
            row += ["-" if r["seed_days"] is None else f"{r['seed_days']:g}", r["seed_factor"] or "-"]
        if here:
            m = r["measured_here"] or {}
            if m.get("status") == "measured":
                row += [fmt_rate(m.get("tokens_per_s")), fmt_multiplier(m.get("time_multiplier"))]
            else:
                row += [m.get("status") or "-", "-"]
        t.add_row(*row)
    c.print(t)


def run_project(args, out_dir: Path) -> int:
    rungs = project(args.model or "gpt3-175b", args.gpu or "a100-80gb", args.gpus or 64, args.project_tokens,
                    args.pp_project, None, args.seq_len)
    measured = load_measured(out_dir)
    rows = projection_rows(rungs, measured)
    first = rungs[0].plan
    title = (f"tenfold ladder --project: {first.model} on {args.gpus or 64} x {first.hardware}, "
             f"{first.tokens:.3g} tokens, seq {first.seq_len} (planner)")
    from rich.console import Console

    c = Console(width=None if sys.stdout.isatty() else 170)
    print_projection(rows, title, c)
    if measured is None:
        c.print(f"(no measured ladder in {out_dir}: run `tenfold ladder --quick --out {out_dir}` to put one beside it)")
    else:
        h = measured["_header"]
        c.print(f"here: {h.get('model')} on {h.get('hardware', {}).get('description')}, measured {h.get('date')} ({out_dir / 'ladder.json'})")
    for i, r in enumerate(rungs):
        for note in r.notes:
            c.print(f"  {i}: {note}")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "projection.json", {"model": first.model, "hardware": first.hardware, "gpus": args.gpus or 64,
                                             "tokens": first.tokens, "rungs": rows,
                                             "notes": [n for r in rungs for n in r.notes]})
    return 0
