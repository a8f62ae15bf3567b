"""Which run next: the budget goes where it can still change the answer.

1. The baseline (the user's own configuration) first: it is what the winner is measured against.
2. Explore: of the candidates not yet tried, the one with the highest optimistic rate, the
   calibrated planner's tokens/s times e^(1.5 sigma) (sigma: the spread of its prediction, from
   the calibration's posterior uncertainty and the runs' own noise; an upper confidence bound,
   Auer et al. 2002, Srinivas et al. 2010). A candidate whose optimistic rate is below the
   best measured rate cannot change the answer and is pruned; one a failed trial rules out
   (`ruled_out`) is not tried either. Exploring ends when none is left, or when `--max-trials`
   candidates have run.
3. Confirm (successive halving, Jamieson & Talwalkar 2016): the best half of the measured
   candidates (at most 4) run again, then the best two of those; a candidate's rate is the best
   of its runs, so a slow spell of a shared machine does not decide the winner.
The budget is spent when the next run would start after it; a run starts only if the time it is
expected to take fits what is left, at least half of it, so a tune ends within its budget and
one run. Until a trial has been measured the budget does not stop it (runner.RUNS_PAST_BUDGET
runs at most): a tune hands back a measured strategy, or says why it could not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tenfold.tune.state import Trial

OPTIMISM = 1.5  # standard deviations of optimism in the upper confidence bound
CONFIRM_FIRST = 4  # at most this many candidates in the first confirmation round
ROUNDS = (CONFIRM_FIRST, 2)  # survivors per confirmation round


@dataclass
class Outlook:
    """A candidate's calibrated prediction and its spread (ln units)."""

    key: str
    tokens_per_s: float
    sigma: float
    ruled_out: str | None = None  # why a failed trial makes this one not worth a run (`ruled_out`)

    @property
    def optimistic(self) -> float:
        return self.tokens_per_s * math.exp(OPTIMISM * self.sigma)


@dataclass
class Action:
    kind: str  # "baseline" | "explore" | "confirm"
    key: str
    round: int  # the run's number for its trial (1 = its first run)
    why: str


def best_rate(trials: list[Trial]) -> float:
    return max((t.tokens_per_s or 0.0 for t in trials), default=0.0)


def next_action(baseline_key: str, trials: list[Trial], outlooks: list[Outlook], explored_cap: int | None) -> Action | None:
    """The next run, or None when nothing left could change the answer."""
    by_key = {t.key: t for t in trials}
    if baseline_key not in by_key:
        return Action("baseline", baseline_key, 1, "the user's configuration, the baseline")
    best = best_rate(trials)
    explored = sum(1 for t in trials if not t.baseline)
    if explored_cap is None or explored < explored_cap:
        pick = promising(outlooks, by_key, best)
        if pick:
            o = pick[0]
            return Action("explore", o.key, 1, f"planner: {o.tokens_per_s:,.0f} tok/s, optimistic {o.optimistic:,.0f} "
                                                f"> best measured {best:,.0f}")
    return confirmation(trials)


def promising(outlooks: list[Outlook], tried: dict[str, Trial], best: float) -> list[Outlook]:
    """Untried candidates that could beat `best`, the most optimistic first."""
    return sorted((o for o in outlooks if o.key not in tried and not o.ruled_out and o.optimistic > best),
                  key=lambda o: -o.optimistic)


@dataclass(frozen=True)
class Shape:
    """What the failure rules compare: a candidate's parallel layout and its predicted peak."""

    layout: tuple  # (ZeRO stage, pipeline stages, schedule, tensor-parallel size)
    peak_bytes: float


def ruled_out(trials: list[Trial], shapes: dict[str, Shape]) -> dict[str, str]:
    """Untried candidates that the failed trials rule out, each with why:
    - a trial that failed with an error (not out of memory, not a timeout) takes out its parallel
      layout: an engine or launcher error in a layout repeats in it, whatever the micro-batch;
    - a trial that ran out of memory takes out every candidate the planner predicts to need at
      least as much memory per rank (memory grows with what the prediction counts)."""
    out: dict[str, str] = {}
    tried = {t.key for t in trials}
    for t in trials:
        if t.status not in ("failed", "oom") or t.key not in shapes:
            continue
        bad = shapes[t.key]
        for key, shape in shapes.items():
            if key in tried or key in out:
                continue
            if t.status == "failed" and shape.layout == bad.layout:
                out[key] = f"the same layout failed in {t.id}"
            elif t.status == "oom" and shape.peak_bytes >= bad.peak_bytes:
                out[key] = f"predicted to need at least the memory {t.id} ran out of"
    return out


def confirmation(trials: list[Trial]) -> Action | None:
    """The next run of the successive-halving rounds, or None when they are done."""
    ranked = sorted((t for t in trials if t.tokens_per_s), key=lambda t: -(t.tokens_per_s or 0.0))
    if len(ranked) < 2:
        return None
    survivors = ranked
    for k, size in enumerate(ROUNDS, start=2):  # round k = each survivor's k-th run
        survivors = survivors[:min(size, max(2, math.ceil(len(survivors) / 2)))]
        for t in survivors:
            if len(t.finished_runs) < k:
                return Action("confirm", t.key, len(t.finished_runs) + 1,
                              f"confirmation round {k - 1}: the best {len(survivors)} run again")
    return None
