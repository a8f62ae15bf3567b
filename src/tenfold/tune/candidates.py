"""The strategies a tune may try: `tenfold plan --search`'s runnable strategies for the user's
model, processes and global batch that fit the memory limit with a margin, in every precision
this device runs fast, plus the user's own configuration (the baseline, tried first whatever
the planner thinks of it).

A candidate is a whole `tenfold train` config: the user's, with the strategy written in by
`tenfold.plan.advice.config_for_plan` (what `tenfold plan --emit` writes), so a trial trains
exactly what `best.toml` will hold.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tenfold.config import TenfoldConfig
from tenfold.errors import UserError
from tenfold.plan.api import Plan, predict
from tenfold.plan.hardware import Hardware
from tenfold.run import ResolvedRun, resolve_run

# What a tune varies, each a name for --fixed: precision, micro-batch (with accumulation at the
# fixed global batch), recompute policy, ZeRO stage, pipeline (stages, schedule, virtual stages),
# tensor parallelism (where the engine has it: tenfold.capabilities).
KNOBS = ("precision", "micro_batch", "recompute", "zero", "pp", "tp")


@dataclass
class Candidate:
    key: str  # stable across runs of the tune (resuming matches trials by it)
    config: TenfoldConfig  # what the trial trains and best.toml holds
    run: ResolvedRun  # as the engine runs it here (the precision this device runs), what the planner prices
    prior: Plan  # the planner's prediction before any calibration
    baseline: bool = False

    @property
    def knobs(self) -> dict:
        r = self.run
        return {"precision": r.precision, "micro_batch": r.micro_batch, "grad_accum": r.grad_accum,
                "global_batch": r.global_batch, "dp": r.dp, "zero": r.zero_stage, "recompute": str(r.recompute),
                "pp": r.pp, "pp_schedule": r.pp_schedule if r.pp > 1 else None,
                "virtual_stages": r.virtual_stages if r.pp > 1 else None, "tp": r.tp}

    @property
    def name(self) -> str:
        k = self.knobs
        pp = f" | pp {k['pp']} {k['pp_schedule']}" + (f" v{k['virtual_stages']}" if k["virtual_stages"] > 1 else "") \
            if k["pp"] > 1 else ""
        tp = f" | tp {k['tp']}" if k["tp"] > 1 else ""
        return (f"{k['precision']} | {k['micro_batch']}x{k['grad_accum']}x dp {k['dp']} | ZeRO-{k['zero']} "
                f"| ac {k['recompute']}{pp}{tp}")


def strategy_key(run: ResolvedRun) -> str:
    key = f"{run.precision}-mb{run.micro_batch}x{run.grad_accum}-zero{run.zero_stage}-ac_{run.recompute}-pp{run.pp}"
    if run.pp > 1:
        key += f"-{run.pp_schedule}" + (f"{run.virtual_stages}" if run.virtual_stages > 1 else "")
    return key + (f"-tp{run.tp}" if run.tp > 1 else "")


def baseline(cfg: TenfoldConfig, nproc: int, hw: Hardware, precision: str) -> Candidate:
    """The user's own configuration; `precision` is the one the engine really runs here."""
    run = resolve_run(cfg, nproc)  # UserError (exit 2): a baseline train would refuse
    if precision != run.precision:
        run = run.with_(precision=precision, check=False)
    return Candidate(strategy_key(run), cfg, run, predict(run, hw, name=cfg.model.name), baseline=True)


@dataclass
class Space:
    """What the search found: the candidates that fit, and what was left out (and why)."""

    candidates: list[Candidate]
    evaluated: int  # strategies the planner priced
    over_memory: int  # predicted not to fit the limit with the margin
    fixed_out: int  # differ from the baseline in a knob the user fixed
    refused: list[str]  # strategies train refused after all (their reasons)


def search_space(cfg: TenfoldConfig, base: Candidate, hw: Hardware, nproc: int, precisions: list[str],
                 limit_bytes: float, margin: float, fixed: set[str]) -> Space:
    """Every runnable strategy whose predicted per-rank total fits `(1 - margin) x limit_bytes`."""
    from tenfold.plan.advice import config_for_plan
    from tenfold.plan.search import search

    sized = replace(hw, memory_bytes=(1 - margin) * limit_bytes * (min(nproc, hw.gpus_per_node) if hw.shared_compute else 1))
    space = Space([], 0, 0, 0, [])
    for precision in (precisions if "precision" not in fixed else [base.run.precision]):
        start = base.run.with_(precision=precision, check=False)
        result = search(start, sized, top_k=10**9, name=cfg.model.name, sequence_parallel=cfg.parallel.sequence_parallel)
        space.evaluated += result.evaluated
        space.over_memory += result.evaluated - result.fitting
        for plan in result.best:
            if _differs(plan, base, fixed):
                space.fixed_out += 1
                continue
            try:
                cand_cfg, run = config_for_plan(cfg, plan.run, hw.gpus_per_node)
            except UserError as e:
                space.refused.append(str(e))
                continue
            space.candidates.append(Candidate(strategy_key(run), cand_cfg, run, predict(run, hw, name=cfg.model.name)))
    return space


def _differs(plan: Plan, base: Candidate, fixed: set[str]) -> bool:
    s, b = plan.strategy, base.knobs
    got = {"micro_batch": plan.micro_batch, "recompute": s["recompute"], "zero": s["zero_stage"], "tp": s["tp"],
           "pp": (s["pp"], s["pp_schedule"] if s["pp"] > 1 else None, s["virtual_stages"] if s["pp"] > 1 else None)}
    want = {"micro_batch": b["micro_batch"], "recompute": b["recompute"], "zero": b["zero"], "tp": b["tp"],
            "pp": (b["pp"], b["pp_schedule"], b["virtual_stages"])}
    return any(got[k] != want[k] for k in fixed if k in got)
