"""The tune's loop: run the chosen trial, recalibrate the planner on everything measured so far,
re-rank what is left, until the budget is spent or nothing left could change the answer; then
write the outputs."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenfold.plan.fit import Fit, Observation, constants_for, fit
from tenfold.tune import choose, state
from tenfold.tune.candidates import Candidate, Space
from tenfold.tune.choose import Action, Outlook
from tenfold.tune.state import Trial
from tenfold.tune.trial import Run, run_trial, trial_steps

FIRST_STARTUP_S = 30.0  # what a trial spends outside its measured window, until one has run
PRIOR_SPREAD = 1.0  # spread (ln) of an uncalibrated prediction
# Runs a tune may start after its budget while no trial has been measured yet (a baseline that
# runs out of memory on purpose, or timeouts on a busy machine, can take the whole budget): a
# tune hands back at least one measured strategy, or says after these why it could not.
RUNS_PAST_BUDGET = 3


@dataclass
class Tune:
    setup: Any  # tenfold.tune.setup.TuneSetup
    baseline: Candidate
    space: Space
    trials: list[Trial]
    log: Any  # tenfold.tune.progress.TuneLog
    fingerprint: dict = field(default_factory=dict)  # the setup this tune folder belongs to (state.fingerprint)
    calibration: Fit | None = None
    leave_one_out: dict[str, float] = field(default_factory=dict)  # trial id -> tokens/s fitted without it
    outlooks: dict[str, Outlook] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    runs_this_session: int = 0
    runs_past_budget: int = 0  # runs started after the budget because nothing was measured yet
    stop_reason: str = ""

    @property
    def candidates(self) -> dict[str, Candidate]:
        out = {self.baseline.key: self.baseline}
        for c in self.space.candidates:
            out.setdefault(c.key, c)
        return out

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        self.recalibrate()
        while True:
            action = choose.next_action(self.baseline.key, self.trials, list(self.outlooks.values()),
                                        self.setup.max_trials)
            if action is None:
                self.stop_reason = self._nothing_left()
                break
            expected = self.expected_s(self.candidates[action.key])
            left = self.setup.budget_s - self.elapsed
            if self.runs_this_session and (left <= 0 or expected > 2 * left):  # a session's first run always starts
                spent = (f"budget spent: {self.elapsed:,.0f} s of {self.setup.budget_s:,.0f} s"
                         + (f" (the next run needs ~{expected:,.0f} s)" if left > 0 else ""))
                if any(t.tokens_per_s for t in self.trials):
                    self.stop_reason = spent
                    break
                if self.runs_past_budget >= RUNS_PAST_BUDGET:
                    self.stop_reason = f"{spent}, and {RUNS_PAST_BUDGET} more runs measured nothing"
                    break
                self.runs_past_budget += 1  # nothing measured yet: one more run, past the budget
            self.run_action(action, expected)
            self.recalibrate()
        self.log.finish_loop(self.stop_reason)

    def run_action(self, action: Action, expected: float) -> None:
        c = self.candidates[action.key]
        trial = self._trial_for(c)
        steps = trial_steps(self.step_s(c), self.setup.window_s)
        timeout = self.setup.trial_timeout_s or max(120.0, 4 * expected)
        trial.runs.append(Run(action.round, "running", None, str(Path(trial.folder) / f"run_{action.round}"), steps))
        self.save()
        self.log.start_run(trial, action, steps, expected)
        run = run_trial(c, Path(trial.folder), action.round, steps, timeout, self.setup.limit_bytes,
                        on_step=lambda done: self.log.tick(self.elapsed, done, steps))
        trial.runs[-1] = run
        self.runs_this_session += 1
        self.log.end_run(trial, run, self.outlooks.get(c.key))
        self.save()

    def _trial_for(self, c: Candidate) -> Trial:
        for t in self.trials:
            if t.key == c.key:
                return t
        tid = f"t{len(self.trials) + 1}"
        t = Trial(tid, c.key, c.name, c.baseline or c.key == self.baseline.key, c.knobs,
                  str(self.setup.out / "trials" / f"{tid}-{_safe(c.key)}"), c.prior.tokens_per_s,
                  c.prior.memory.peak_bytes)
        self.trials.append(t)
        return t

    # ------------------------------------------------------------------ the model

    def observations(self) -> list[Observation]:
        cands = self.candidates
        return [Observation(t.id, cands[t.key].run, t.tokens_per_s)
                for t in self.trials if t.tokens_per_s and t.key in cands]

    def recalibrate(self) -> None:
        """Refit on every measured trial, then re-rank the candidates not yet tried."""
        obs = self.observations()
        self.calibration = fit(obs, self.setup.hardware, self.calibration_constants()) if obs else None
        tried = {t.key for t in self.trials}
        shapes = {k: choose.Shape((c.run.zero_stage, c.run.pp, c.run.pp_schedule if c.run.pp > 1 else None, c.run.tp),
                                  c.prior.memory.peak_bytes) for k, c in self.candidates.items()}
        ruled = choose.ruled_out(self.trials, shapes)
        self.outlooks = {}
        for key, c in self.candidates.items():
            if key in tried:
                continue
            if self.calibration is None:
                rate, sigma = c.prior.tokens_per_s, PRIOR_SPREAD
            else:
                rate, sigma = self.calibration.predictive(c.run, c.prior.memory)
            self.outlooks[key] = Outlook(key, rate, sigma, ruled.get(key))

    def calibration_constants(self):
        """Every precision a candidate may use: an untried one's matmul rate is uncertain, not exact."""
        return constants_for({c.run.precision for c in self.candidates.values()})

    def predicted(self, c: Candidate) -> float:
        if self.calibration is None:
            return c.prior.tokens_per_s
        return self.calibration.predictive(c.run, c.prior.memory)[0]

    def step_s(self, c: Candidate) -> float:
        return c.run.tokens_per_step / self.predicted(c)

    def expected_s(self, c: Candidate) -> float:
        """A run's expected duration: its steps at the calibrated step time, plus what runs so far
        spent outside their measured window (start-up, warm-up, the memory step, shutdown)."""
        outside = [r.process_s - r.steady_s for t in self.trials for r in t.measured if r.process_s and r.steady_s]
        extra = statistics.median(outside) if outside else FIRST_STARTUP_S
        return extra + (trial_steps(self.step_s(c), self.setup.window_s) - 1) * self.step_s(c)

    def why_nothing_measured(self) -> str:
        """One line: why no trial was measured, from what each one did."""
        done = [f"{t.id} [{t.name}] {t.status}" + (f" ({t.reason})" if t.reason else "") for t in self.trials]
        runs = "; ".join(done) if done else "no trial ran"
        return f"no trial was measured ({self.stop_reason}): {runs}"

    def _nothing_left(self) -> str:
        untried = len(self.candidates) - len(self.trials)
        if self.setup.max_trials is not None and sum(not t.baseline for t in self.trials) >= self.setup.max_trials:
            return f"--max-trials {self.setup.max_trials} reached; confirmation rounds done"
        return (f"nothing left could change the answer: {untried} untried candidate(s), none with an optimistic "
                f"rate above the best measured; confirmation rounds done")

    # ------------------------------------------------------------------ outputs

    def save(self) -> None:
        from tenfold.tune.report import document

        state.save(self.setup.out / "tune.json", document(self))


def _safe(key: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in key)
