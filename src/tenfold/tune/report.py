"""A tune's outputs: tune.json (rewritten after every run), and at the end tune.md (the ranked
table and the calibration), tune.png (predicted vs measured, before and after calibration),
best.toml (the winner, for `tenfold train --config`) and hardware.toml (the calibrated machine,
for `tenfold plan --hardware-file`)."""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import replace
from typing import Any

from tenfold.plan.fit import leave_one_out, median_abs_error
from tenfold.tune.state import VERSION, Trial

# The Hardware `sources` entry each fitted constant replaces.
SOURCE_OF = {"elementwise_bw": "memory", "collective_bw": "intra", "collective_latency": "intra",
             "step_overhead": "overhead", "microbatch_overhead": "overhead"}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def ranked(trials: list[Trial]) -> list[Trial]:
    """Measured trials fastest first, then the others in the order they ran."""
    return sorted(trials, key=lambda t: (t.tokens_per_s is None, -(t.tokens_per_s or 0.0)))


def best_trial(trials: list[Trial]) -> Trial | None:
    measured = [t for t in trials if t.tokens_per_s]
    return max(measured, key=lambda t: t.tokens_per_s) if measured else None


def baseline_trial(trials: list[Trial]) -> Trial | None:
    return next((t for t in trials if t.baseline), None)


def document(tune) -> dict[str, Any]:
    """tune.json's content."""
    setup, trials = tune.setup, tune.trials
    best, base = best_trial(trials), baseline_trial(trials)
    return {
        "version": VERSION, "setup": tune.fingerprint, "command": setup.command, "updated": _now(),
        "machine": _machine(setup), "budget_s": setup.budget_s, "elapsed_s": round(tune.elapsed, 1),
        "stop_reason": tune.stop_reason or None, "memory_limit_bytes": setup.limit_bytes, "margin": setup.margin,
        "fixed": sorted(setup.fixed), "window_s": setup.window_s,
        "candidates": _counts(tune), "trials": [t.to_dict() for t in trials], "untried": _untried(tune),
        "calibration": _calibration(tune),
        "best": None if best is None else {
            "trial": best.id, "key": best.key, "name": best.name, "tokens_per_s": best.tokens_per_s,
            "vs_baseline": best.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s else None},
    }


def _machine(setup) -> dict[str, Any]:
    from tenfold.plan.hardware import cpu_model_name

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"device": setup.device, "cpu": cpu_model_name(), "cores": os.cpu_count(), "nproc": setup.nproc,
            "planner_hardware": setup.hardware.name, "load_avg_1_5_15": load}


def _counts(tune) -> dict[str, Any]:
    """`fitting`: the search's candidates (the baseline is one only if it is predicted to fit too);
    `tried`: how many of those ran."""
    s = tune.space
    space = {c.key for c in s.candidates}
    tried = {t.key for t in tune.trials}
    return {"fitting": len(space), "tried": len(tried & space), "baseline_fits": tune.baseline.key in space,
            "evaluated": s.evaluated, "over_memory": s.over_memory, "fixed_out": s.fixed_out,
            "refused_by_train": s.refused,
            "pruned": sum(1 for o in tune.outlooks.values() if o.optimistic <= _best(tune) and not o.ruled_out),
            "ruled_out": sum(1 for o in tune.outlooks.values() if o.ruled_out)}


def _best(tune) -> float:
    best = best_trial(tune.trials)
    return best.tokens_per_s if best else 0.0


def _untried(tune) -> list[dict[str, Any]]:
    best, cands = _best(tune), tune.candidates
    rows = sorted(tune.outlooks.values(), key=lambda o: -o.tokens_per_s)
    return [{"key": o.key, "name": cands[o.key].name, "knobs": cands[o.key].knobs,
             "predicted_before": cands[o.key].prior.tokens_per_s, "predicted_after": o.tokens_per_s,
             "optimistic": o.optimistic, "pruned": o.optimistic <= best, "ruled_out": o.ruled_out,
             "predicted_peak_bytes": cands[o.key].prior.memory.peak_bytes} for o in rows]


def _calibration(tune) -> dict[str, Any] | None:
    f = tune.calibration
    if f is None:
        return None
    measured = {t.id: t.tokens_per_s for t in tune.trials if t.tokens_per_s}
    out = {"constants": [c.to_dict() for c in f.constants], "noise_ln": f.noise,
           "effective_parameters": f.effective_parameters,
           "median_abs_error_before": median_abs_error(f.predicted_prior, measured),
           "median_abs_error_after": median_abs_error(f.predicted, measured)}
    if tune.leave_one_out:
        out["median_abs_error_leave_one_out"] = median_abs_error(tune.leave_one_out, measured)
        out["leave_one_out"] = tune.leave_one_out
    return out


# --------------------------------------------------------------------------- the end


def finish(tune) -> int:
    """Final calibration and every output; exit status 0 when anything was measured."""
    from tenfold.tune import figure, markdown

    f, out = tune.calibration, tune.setup.out
    if f is not None:
        for t in tune.trials:
            t.predicted_after = f.predicted.get(t.id)
        obs = tune.observations()
        if len(obs) >= 3:
            tune.log.say(f"checking the calibration: {len(obs)} refits, each without one trial")
            tune.leave_one_out = leave_one_out(obs, tune.setup.hardware, tune.calibration_constants())
    best = best_trial(tune.trials)
    written = ["tune.json", "tune.md", "tune.png"]
    if best is not None:
        (out / "best.toml").write_text(best_toml(tune, best))
        written.append("best.toml")
    if f is not None:
        (out / "hardware.toml").write_text(hardware_file(tune))
        written.append("hardware.toml")
    tune.save()
    (out / "tune.md").write_text(markdown.render(document(tune)))
    figure.plot(document(tune), out / "tune.png")
    markdown.print_summary(document(tune), tune.log.console)
    tune.log.say("wrote:\n" + "\n".join(f"  {out / name}" for name in written))
    if best is None:
        from tenfold.errors import say

        say("error", tune.why_nothing_measured())
        return 1
    return 0


def best_toml(tune, best: Trial) -> str:
    from tenfold.config import config_toml
    from tenfold.plan.advice import STRATEGY_KEYS

    cfg = tune.candidates[best.key].config
    base = baseline_trial(tune.trials)
    vs = f" ({best.tokens_per_s / base.tokens_per_s:.2f}x the baseline's {base.tokens_per_s:,.0f})" \
        if base and base.tokens_per_s else ""
    out = tune.setup.out
    header = [
        f"# Written by tenfold tune, {_now()}: the fastest of {sum(1 for t in tune.trials if t.tokens_per_s)} "
        f"strategies measured on {tune.setup.nproc} x {tune.setup.hardware.name}.",
        f"# {best.name}: {best.tokens_per_s:,.0f} tokens/s measured{vs}",
        "# train it:",
        f"#   tenfold train --config {out / 'best.toml'}",
        "# predict it with the calibrated machine:",
        f"#   tenfold plan --config {out / 'best.toml'} --hardware-file {out / 'hardware.toml'}",
        "",
    ]
    return "\n".join(header) + config_toml(cfg, STRATEGY_KEYS)


def hardware_file(tune) -> str:
    """The calibrated machine as a hardware file, each fitted constant's source saying which
    trials determined it."""
    from tenfold.plan.hardware import hardware_toml

    f = tune.calibration
    grouped: dict[str, list[str]] = {}
    for c in f.constants:
        trials = ", ".join(f"{n} ({e:.0%})" for n, e in c.determined_by[:6]) or "none"
        how = (f"fitted to trials {trials}" if c.determined
               else f"not pinned down by the trials (1 sigma: {c.low:.4g}-{c.high:.4g}), the prior weighs in "
               f"(trials it governs: {trials})")
        key = "matmul" if c.key.startswith("matmul:") else SOURCE_OF.get(c.key, c.key)
        grouped.setdefault(key, []).append(f"{c.label} {c.fitted:.4g} {c.unit} (prior {c.prior:.4g}), {how}")
    sources = {**f.hardware.sources, **{k: f"tenfold tune {_now()}: " + "; ".join(v) for k, v in grouped.items()}}
    hw = replace(f.hardware, name=f"{f.prior.name}-tuned", sources=sources)
    header = (f"# Written by tenfold tune, {_now()}: {tune.setup.hardware.name} with its speed constants fitted to "
              f"{len(f.predicted)} measured trial(s) ({tune.setup.out / 'tune.md'}).\n"
              f"# Use it: tenfold plan --hardware-file {tune.setup.out / 'hardware.toml'} ...\n\n")
    return header + hardware_toml(hw)
