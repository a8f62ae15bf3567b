"""tune.md and the table printed at the end, both from tune.json's content."""

from __future__ import annotations

from typing import Any

from tenfold.tune.choose import OPTIMISM

SHOWN_UNTRIED = 10


def _rate(x: float | None) -> str:
    return "-" if not x else f"{x:,.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _mib(x: float | None) -> str:
    return "-" if not x else f"{x / 2**20:,.1f}"


def _err(pred: float | None, meas: float | None) -> str:
    return "-" if not pred or not meas else f"{pred / meas - 1:+.0%}"


def trial_rows(doc: dict[str, Any]) -> list[list[str]]:
    """One row per trial, fastest first (measured), then the failed ones."""
    trials = sorted(doc["trials"], key=lambda t: (t["tokens_per_s"] is None, -(t["tokens_per_s"] or 0)))
    base = next((t["tokens_per_s"] for t in doc["trials"] if t["baseline"]), None)
    rows = []
    for rank, t in enumerate(trials, start=1):
        runs = t["tokens_per_s_runs"]
        rate = _rate(t["tokens_per_s"]) + (f" ({' / '.join(_rate(r) for r in runs)})" if len(runs) > 1 else "")
        status = t["status"] + (f": {t['reason']}" if t["reason"] else "")
        peak = max(t["peak_bytes_per_rank"]) if t["peak_bytes_per_rank"] else None
        rows.append([
            str(rank) if t["tokens_per_s"] else "-", t["id"] + (" (baseline)" if t["baseline"] else ""), t["name"],
            status, rate, f"{t['tokens_per_s'] / base:.2f}x" if t["tokens_per_s"] and base else "-",
            f"{_rate(t['predicted_before'])} ({_err(t['predicted_before'], t['tokens_per_s'])})",
            f"{_rate(t['predicted_after'])} ({_err(t['predicted_after'], t['tokens_per_s'])})",
            f"{_mib(peak)}{' RSS' if t.get('peak_is_rss') and peak else ''} ({_mib(t['predicted_peak_bytes'])})",
        ])
    return rows


TRIAL_HEADER = ["#", "trial", "strategy", "status", "tok/s (runs)", "vs baseline", "planner, before (err)",
                "calibrated (err)", "peak MiB/rank: tracked tensors (planner)"]
PEAK_NOTE = ("peak: one step's tracked tensors on the most loaded rank (the tensor tracker; on CUDA the allocator), "
             "the quantity the planner predicts; `RSS`: the process's peak resident set instead, where the tracker "
             "cannot follow the run (multi-stage pipeline schedules on a CPU): libraries, caches and data "
             "included, so not comparable with the planner's figure.")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]]


def render(doc: dict[str, Any]) -> str:
    m, counts, cal = doc["machine"], doc["candidates"], doc["calibration"]
    lines = [f"# tenfold tune: {m['nproc']} x {m['planner_hardware']} ({m['cpu']}, {m['cores']} cores)", "",
             f"`{doc['command']}` - {doc['updated']}; budget {doc['budget_s']:,.0f} s, this session ran "
             f"{doc['elapsed_s']:,.0f} s; load average {m['load_avg_1_5_15']} (1/5/15 min) at the end.", "",
             f"Stopped: {doc['stop_reason'] or '-'}", ""]
    if doc["best"]:
        b = doc["best"]
        vs = f", {b['vs_baseline']:.2f}x the baseline" if b["vs_baseline"] else ""
        lines += [f"**Best: {b['trial']} [{b['name']}], {b['tokens_per_s']:,.0f} tokens/s{vs}** (best.toml).", ""]
    lines += [f"Candidates: {counts['fitting']} fit the memory limit with the margin"
              + ("" if counts.get("baseline_fits", True) else " (the baseline is not one of them)") + f", {counts['tried']} tried "
              f"({counts['tried'] / max(1, counts['fitting']):.0%}), {counts['pruned']} pruned (their optimistic "
              f"rate is below the best measured), {counts.get('ruled_out', 0)} ruled out by a failed trial; "
              f"{counts['evaluated']} strategies priced, {counts['over_memory']} "
              f"over memory, {counts['fixed_out']} outside --fixed.", "", "## Trials, fastest first", "",
              *_table(TRIAL_HEADER, trial_rows(doc)), "",
              "tok/s: steady state after the warm-up step (best of the runs; every run shown). planner: the "
              "prediction before calibration, calibrated: after it (error vs measured). " + PEAK_NOTE, ""]
    lines += _untried_section(doc) + _calibration_section(cal)
    return "\n".join(lines) + "\n"


def _untried_section(doc: dict[str, Any]) -> list[str]:
    rows = [[u["name"], _rate(u["predicted_before"]), _rate(u["predicted_after"]), _rate(u["optimistic"]),
             f"ruled out: {u['ruled_out']}" if u.get("ruled_out") else "pruned" if u["pruned"] else "not reached"]
            for u in doc["untried"][:SHOWN_UNTRIED]]
    if not rows:
        return []
    return [f"## Untried candidates (the {len(rows)} the calibrated planner ranks highest of {len(doc['untried'])})", "",
            *_table(["strategy", "planner, before", "calibrated", f"optimistic (+{OPTIMISM:g} sigma)", ""], rows), ""]


def _calibration_section(cal: dict[str, Any] | None) -> list[str]:
    if cal is None:
        return ["## Calibration", "", "Nothing measured: no calibration.", ""]
    rows = []
    for c in cal["constants"]:
        by = ", ".join(f"{d['trial']} ({d['elasticity']:.0%})" for d in c["determined_by"][:6]) or "-"
        rows.append([c["label"], f"{c['prior']:.4g} {c['unit']}", f"{c['fitted']:.4g} {c['unit']}",
                     f"{c['one_sigma'][0]:.3g} .. {c['one_sigma'][1]:.3g}", "yes" if c["determined"] else "no", by])
    loo = cal.get("median_abs_error_leave_one_out")
    return ["## Calibration (hardware.toml)", "",
            *_table(["constant", "prior", "fitted", "1 sigma", "determined", "trials it governs (share of their time)"],
                    rows), "",
            f"Median |predicted / measured - 1| over the measured trials: {_pct(cal['median_abs_error_before'])} before, "
            f"{_pct(cal['median_abs_error_after'])} after calibration"
            + (f", {_pct(loo)} leave-one-out (each trial predicted by a fit to the others)" if loo is not None else "")
            + f". Run-to-run spread estimated at {cal['noise_ln']:.1%}; the trials determine "
              f"{cal['effective_parameters']:.1f} of the {len(rows)} constants.", ""]


def print_summary(doc: dict[str, Any], console) -> None:
    from rich.table import Table

    t = Table(title="tenfold tune: trials, fastest first")
    for h in TRIAL_HEADER:
        t.add_column(h, overflow="fold")
    rows = trial_rows(doc)[:15]
    for r in rows:
        t.add_row(*r)
    console.print(t)
    if any(" RSS (" in r[-1] for r in rows):
        console.print(PEAK_NOTE, highlight=False, markup=False)
    cal = doc["calibration"]
    if cal:
        console.print(f"planner error, median over measured trials: {_pct(cal['median_abs_error_before'])} before -> "
                      f"{_pct(cal['median_abs_error_after'])} after calibration"
                      + (f" ({_pct(cal.get('median_abs_error_leave_one_out'))} leave-one-out)"
                         if cal.get("median_abs_error_leave_one_out") is not None else ""), highlight=False, markup=False)
    if doc["best"]:
        b = doc["best"]
        console.print(f"best: {b['trial']} [{b['name']}] {b['tokens_per_s']:,.0f} tok/s"
                      + (f", {b['vs_baseline']:.2f}x the baseline" if b["vs_baseline"] else ""), highlight=False, markup=False)
