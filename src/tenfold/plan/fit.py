"""Fit a machine's speed constants to measured runs: the planner's own time model, with the
constants that set its speeds chosen by least squares so that its predictions match what was
measured (`tenfold tune` calls this after every trial).

The constants, each a field of `tenfold.plan.hardware.Hardware`:

  matmul:<dtype>       FLOP/s a training step's GEMMs reach, per dtype   (achieved_matmul_flops)
  elementwise_bw       bytes/s of the memory-bound work: norms, activations, casts, softmax,
                       the loss and the optimizer step                   (hbm_bw)
  collective_bw        bytes/s per rank of collectives and pipeline sends inside a node (intra_node_bw)
  collective_latency   seconds per ring step of a collective             (intra_latency_s)
  step_overhead        seconds per optimizer step outside the modelled work (step_overhead_s)
  microbatch_overhead  seconds per micro-batch (operator dispatch, autograd bookkeeping) (microbatch_overhead_s)

An overhead the hardware does not have starts at 1% of the median measured step (micro-batch)
with a wide prior (a factor 20 at one sigma): at 0 it would govern no share of any run's time,
and the fit could not move it.

The fit is a maximum a posteriori estimate with log-normal priors centred on the hardware's own
values: it minimises

    sum_i (ln(predicted_i / measured_i) / noise)^2 + sum_k (ln(c_k / c_k0) / prior_k)^2

over ln c by Levenberg-Marquardt (Levenberg 1944, Marquardt 1963; Nocedal & Wright,
"Numerical Optimization" ch. 10), with the Jacobian taken by finite differences of the planner
itself. Logarithms keep every constant positive and weigh a 10% miss alike at any speed; the
prior keeps a constant that no measurement depends on where it was (a tune on one node says
nothing about the network between nodes) instead of letting it drift. The posterior covariance
of the linearised problem, (J^T J / noise^2 + diag(1 / prior^2))^-1, gives each constant's
uncertainty and each untried strategy's predictive spread.

Each constant is reported with the runs that determined it: those whose predicted time moves
by at least 5% per unit of its logarithm (the elasticity d ln T / d ln c, which is the share of
the run's time the constant governs), and it counts as determined when the measurements pin it
down to +-25% (one posterior standard deviation). An undetermined constant is still fitted, but
the split between it and the others is the prior's, not the machine's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from tenfold.plan.api import _predict, predict_memory
from tenfold.plan.hardware import Hardware
from tenfold.run import ResolvedRun

NOISE = 0.10  # run-to-run spread of a measured rate assumed by the fit (ln units), before it is estimated
MIN_NOISE = 0.05  # the estimate's floor: a few runs agreeing by chance do not make the model exact
RATE_PRIOR = 1.0  # prior spread of a speed constant (ln): a factor 2.7 either way at 1 sigma
OVERHEAD_PRIOR = 3.0  # prior spread of an overhead (ln): a factor 20 either way at 1 sigma ...
OVERHEAD_START = 0.01  # ... around 1% of the median measured step (micro-batch) where the hardware has none
ELASTICITY_SHOWN = 0.05  # a run "determines" a constant that governs at least 5% of its time
DETERMINED = math.log(1.25)  # a constant is determined when known to +-25% (one posterior sigma)
STEP = 1e-3  # finite-difference step in ln c


@dataclass(frozen=True)
class Observation:
    """One measured run: what ran and its measured tokens/s."""

    name: str
    run: ResolvedRun  # what ran, as the planner prices it (the precision the engine ran)
    tokens_per_s: float


@dataclass(frozen=True)
class Constant:
    """One fitted constant: how to read it from a Hardware and write it back."""

    key: str
    label: str
    unit: str
    scale: float  # value / scale is shown in `unit`
    prior_sigma: float  # ln units
    get: Callable[[Hardware], float]
    put: Callable[[Hardware, float], Hardware]
    # An overhead the hardware does not have (0) starts at 1% of the median measured step
    # ("step") or micro-batch ("microbatch"): a logarithm needs a start above 0, and at 0 it
    # would govern no share of any run's time, so nothing would move it.
    overhead: str | None = None


def _matmul(dtype: str) -> Constant:
    def get(hw: Hardware) -> float:
        return hw.gemm_peak(dtype) * hw.gemm_efficiency

    def put(hw: Hardware, v: float) -> Hardware:
        return replace(hw, achieved_matmul_flops={**hw.achieved_matmul_flops, dtype: v})

    return Constant(f"matmul:{dtype}", f"matmul rate, {dtype}", "TFLOP/s", 1e12, RATE_PRIOR, get, put)


def _field(key: str, name: str, label: str, unit: str, scale: float, sigma: float, overhead: str | None = None) -> Constant:
    return Constant(key, label, unit, scale, sigma, lambda hw: getattr(hw, name), lambda hw, v: replace(hw, **{name: v}),
                    overhead)


def constants_for(dtypes) -> list[Constant]:
    """The constants fitted for runs in these precisions."""
    return [
        *[_matmul(d) for d in sorted(set(dtypes))],
        _field("elementwise_bw", "hbm_bw", "elementwise bandwidth", "GB/s", 1e9, RATE_PRIOR),
        _field("collective_bw", "intra_node_bw", "collective bandwidth (in a node)", "GB/s", 1e9, RATE_PRIOR),
        _field("collective_latency", "intra_latency_s", "collective latency per ring step", "us", 1e-6, RATE_PRIOR),
        _field("step_overhead", "step_overhead_s", "overhead per optimizer step", "ms", 1e-3, OVERHEAD_PRIOR, "step"),
        _field("microbatch_overhead", "microbatch_overhead_s", "overhead per micro-batch", "ms", 1e-3, OVERHEAD_PRIOR,
               "microbatch"),
    ]


@dataclass
class ConstantFit:
    key: str
    label: str
    unit: str
    prior: float  # in `unit`
    fitted: float  # in `unit`
    low: float  # one posterior standard deviation either side, in `unit`
    high: float
    determined_by: list[tuple[str, float]]  # (run, |d ln T / d ln c|: the share of its time), largest first
    determined: bool  # the measurements, not the prior, set it

    def to_dict(self) -> dict:
        return {"key": self.key, "label": self.label, "unit": self.unit, "prior": self.prior, "fitted": self.fitted,
                "factor": self.fitted / self.prior if self.prior else None, "one_sigma": [self.low, self.high],
                "determined": self.determined,
                "determined_by": [{"trial": n, "elasticity": round(e, 3)} for n, e in self.determined_by]}


@dataclass
class _Space:
    """The fitted coordinates: x_k = ln(c_k / start_k)."""

    prior: Hardware
    consts: list[Constant]
    starts: list[float]

    def machine(self, x) -> Hardware:
        hw = self.prior
        for c, xk, start in zip(self.consts, x, self.starts):
            hw = c.put(hw, start * math.exp(float(xk)))
        return hw


@dataclass
class Fit:
    prior: Hardware
    hardware: Hardware  # the calibrated machine
    constants: list[ConstantFit]
    predicted: dict[str, float]  # run name -> tokens/s with the calibrated machine
    predicted_prior: dict[str, float]  # run name -> tokens/s with the prior machine
    noise: float  # estimated spread of ln(measured / predicted) of one run
    effective_parameters: float  # how many constants the runs determine (trace of the hat matrix)
    _space: _Space = field(repr=False, default=None)  # type: ignore[assignment]
    _x: list[float] = field(repr=False, default_factory=list)
    _covariance: list[list[float]] = field(repr=False, default_factory=list)

    def predictive(self, run: ResolvedRun, mem=None) -> tuple[float, float]:
        """(tokens/s, spread of its ln) for a run that was not measured: the calibrated model's
        prediction and the posterior uncertainty it carries, plus the noise of one run."""
        import numpy as np

        mem = mem if mem is not None else predict_memory(run, self.prior)
        base = _ln_rate(run, self.hardware, mem)
        grad = np.array([(_ln_rate(run, self._space.machine(_bump(self._x, k)), mem) - base) / STEP
                         for k in range(len(self._x))])
        var = float(grad @ np.array(self._covariance) @ grad) if len(grad) else 0.0
        return math.exp(base), math.sqrt(max(0.0, var) + self.noise**2)


def _bump(x, k: int) -> list[float]:
    out = [float(v) for v in x]
    out[k] += STEP
    return out


def _ln_rate(run: ResolvedRun, hw: Hardware, mem) -> float:
    return math.log(_predict(run, hw, trace=False, mem=mem).tokens_per_s)


def fit(observations: list[Observation], prior: Hardware, consts: list[Constant] | None = None,
        noise: float = NOISE, min_noise: float = MIN_NOISE, iterations: int = 60) -> Fit:
    """The calibrated machine for `observations` (at least one), starting from `prior`;
    `noise`: the spread of ln(measured rate) the fit weighs the runs with."""
    import numpy as np

    if not observations:
        raise ValueError("fit needs at least one measured run")
    consts = consts if consts is not None else constants_for(o.run.precision for o in observations)
    plans = [_predict(o.run, prior, trace=False) for o in observations]
    mems = [p.memory for p in plans]
    space = _Space(prior, consts, _starts(consts, prior, observations, plans))
    measured = np.log([o.tokens_per_s for o in observations])
    sig = np.array([c.prior_sigma for c in consts])

    def data_residuals(x) -> np.ndarray:
        hw = space.machine(x)
        return np.array([_ln_rate(o.run, hw, m) for o, m in zip(observations, mems)]) - measured

    def jacobian(x, r0) -> np.ndarray:
        cols = [(data_residuals(_bump(x, k)) - r0) / STEP for k in range(len(consts))]
        return np.stack(cols, axis=1) if cols else np.zeros((len(observations), 0))

    x, r, J = _levenberg_marquardt(np.zeros(len(consts)), data_residuals, jacobian, sig, noise, iterations)
    info = J.T @ J / noise**2
    p_eff = float(np.trace(info @ np.linalg.inv(info + np.diag(1 / sig**2))))
    dof = len(observations) - p_eff
    est = max(min_noise, math.sqrt(float(r @ r) / dof) if dof >= 1 else noise)
    cov = np.linalg.inv(J.T @ J / est**2 + np.diag(1 / sig**2))
    hw = space.machine(x)
    names = [o.name for o in observations]
    return Fit(
        prior=prior, hardware=hw, noise=est, effective_parameters=p_eff,
        constants=[_constant_fit(space, k, x, J, names, cov) for k in range(len(consts))],
        predicted={n: math.exp(v) for n, v in zip(names, r + measured)},
        predicted_prior={o.name: p.tokens_per_s for o, p in zip(observations, plans)},
        _space=space, _x=[float(v) for v in x], _covariance=cov.tolist(),
    )


def _starts(consts: list[Constant], prior: Hardware, observations: list[Observation], plans) -> list[float]:
    """Each constant's prior value, or for an overhead the hardware lacks, 1% of the median
    measured step (micro-batch)."""
    steps = sorted(p.tokens_per_step / o.tokens_per_s for o, p in zip(observations, plans))
    mbs = sorted(p.tokens_per_step / o.tokens_per_s / p.grad_accum for o, p in zip(observations, plans))
    median = {"step": steps[len(steps) // 2], "microbatch": mbs[len(mbs) // 2]}
    return [c.get(prior) or OVERHEAD_START * median[c.overhead] if c.overhead else c.get(prior) for c in consts]


def _cost(x, r, sig, noise: float) -> float:
    import numpy as np

    return float(r @ r) / noise**2 + float(np.sum((x / sig) ** 2))


def _levenberg_marquardt(x, data_residuals, jacobian, sig, noise: float, iterations: int):
    """Minimise |r(x) / noise|^2 + |x / sig|^2; returns (x, r(x), J(x))."""
    import numpy as np

    def cost(x, r) -> float:
        return _cost(x, r, sig, noise)

    r = data_residuals(x)
    J = jacobian(x, r)
    lam = 1e-2
    for _ in range(iterations):
        A = J.T @ J / noise**2 + np.diag(1 / sig**2)
        g = J.T @ r / noise**2 + x / sig**2
        x_new = x + np.linalg.solve(A + lam * np.diag(np.diag(A)), -g)
        r_new = data_residuals(x_new)
        if cost(x_new, r_new) < cost(x, r):
            moved = float(np.max(np.abs(x_new - x)))
            x, r, lam = x_new, r_new, max(lam / 3, 1e-7)
            J = jacobian(x, r)
            if moved < 1e-5:
                break
        else:
            lam *= 4
            if lam > 1e8:
                break
    return x, r, J


def _constant_fit(space: _Space, k: int, x, J, names: list[str], cov) -> ConstantFit:
    c, start = space.consts[k], space.starts[k]
    sigma = math.sqrt(max(0.0, float(cov[k, k])))
    # The share of each run's time c governs, |d ln(step time) / d ln c| = |d ln(tokens/s) / d ln c|
    # (negative for a rate: faster, less time).
    shares = sorted(((n, float(abs(e))) for n, e in zip(names, J[:, k]) if abs(e) >= ELASTICITY_SHOWN),
                    key=lambda t: -t[1])
    value = start * math.exp(float(x[k]))
    return ConstantFit(
        key=c.key, label=c.label, unit=c.unit, prior=c.get(space.prior) / c.scale, fitted=value / c.scale,
        low=value * math.exp(-sigma) / c.scale, high=value * math.exp(sigma) / c.scale, determined_by=shares,
        determined=sigma < DETERMINED,
    )


def leave_one_out(observations: list[Observation], prior: Hardware, consts: list[Constant] | None = None) -> dict[str, float]:
    """Each run's tokens/s as predicted by a fit to the other runs (an honest, out-of-sample check)."""
    consts = consts if consts is not None else constants_for(o.run.precision for o in observations)
    out: dict[str, float] = {}
    for i, o in enumerate(observations):
        rest = observations[:i] + observations[i + 1:]
        if rest:
            out[o.name] = fit(rest, prior, consts).predictive(o.run)[0]
    return out


def median_abs_error(predicted: dict[str, float], measured: dict[str, float]) -> float | None:
    """median over runs of |predicted / measured - 1|."""
    errors = sorted(abs(predicted[n] / measured[n] - 1) for n in measured if n in predicted and measured[n])
    if not errors:
        return None
    mid = len(errors) // 2
    return errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2
