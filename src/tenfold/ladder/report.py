"""The ladder's outputs: a rich table (the recipe's ladder with measured multipliers),
OUT/ladder.json, OUT/ladder.md and OUT/ladder.png (measured bars beside predicted markers)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tenfold.ladder.measure import RungResult
from tenfold.ladder.rungs import SEED_CLAIMS

MiB = 2**20
MEMORY_PARTS = (  # measured categories, stacked in the chart (engine/memory/measure.py's keys)
    ("params_bytes", "params"), ("grads_bytes", "grads"), ("optimizer_bytes", "optimizer"),
    ("gathered_params_bytes", "gathered params"), ("activations_bytes", "activations"),
)
LATER_PARTS = ("gathered_params_bytes",)  # absent from a summary.json written before it existed: 0


def add_multipliers(results: list[RungResult]) -> None:
    """Speed-up and time multiplier of each measured rung against the previous measured rung
    and the baseline (the ladder's first rung). Every rung trains the same tokens, so the time
    multiplier is the inverse of the throughput ratio (the recipe's "time / 2"). A baseline
    that was not measured (it failed or timed out) gives no ratio to it at all: another rung
    in its place would claim a speed-up over a run that never happened."""
    measured = [r for r in results if r.status == "measured" and r.tokens_per_s]
    if not measured:
        return
    base = results[0] if results[0] is measured[0] else None
    for prev, r in zip([None, *measured[:-1]], measured):
        r.speedup_vs_baseline = r.tokens_per_s / base.tokens_per_s if base else None
        r.cumulative_multiplier = 1.0 / r.speedup_vs_baseline if base else None
        if prev is not None:
            r.speedup_vs_previous = r.tokens_per_s / prev.tokens_per_s
            r.time_multiplier = 1.0 / r.speedup_vs_previous


def fmt_multiplier(m: float | None) -> str:
    """A time multiplier as the recipe writes it: "/ 2.0" for faster, "x 1.30" for slower."""
    if m is None:
        return "-"
    return f"/ {1 / m:.2f}" if m < 1 else f"x {m:.2f}"


def fmt_bytes(n: float | None) -> str:
    return "-" if not n else f"{n / MiB:,.0f} MiB"


def fmt_peak(r: RungResult) -> str:
    """The measured peak per rank: tracked tensors, or (marked) the process's peak RSS."""
    rss = r.peak_mem_bytes and "RSS" in (r.memory_source or "")
    return fmt_bytes(r.peak_mem_bytes) + (" RSS" if rss else "")


def fmt_rate(x: float | None) -> str:
    return "-" if not x else f"{x:,.0f}"


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:,.1f} s" if s < 120 else f"{s / 60:,.1f} min"


def config_text(c: dict[str, Any]) -> str:
    parts = [c["precision"], f"{c['micro_batch']}x{c['grad_accum']}x{c['dp']}"]
    if c["recompute"] != "none":
        parts.append(f"ac {c['recompute']}")
    if c["zero_stage"]:
        parts.append(f"zero {c['zero_stage']}")
    if c["pp"] > 1:
        parts.append(f"pp {c['pp']}")
    return " ".join(parts)


def table_rows(results: list[RungResult]) -> list[list[str]]:
    rows = []
    for r in results:
        status = r.status if r.status == "measured" else f"{r.status}"
        rows.append([
            str(r.index), r.title, config_text(r.config), fmt_rate(r.tokens_per_s), fmt_rate(r.predicted_tokens_per_s),
            fmt_time(r.time_for_budget_s), fmt_multiplier(r.time_multiplier), fmt_multiplier(r.cumulative_multiplier),
            SEED_CLAIMS.get(r.name, ""), fmt_peak(r), fmt_bytes(r.predicted_peak_bytes),
            "-" if r.val_loss is None else f"{r.val_loss:.3f}", status,
        ])
    return rows


COLUMNS = ["#", "rung", "precision mbxaccxdp ...", "tok/s", "pred tok/s", "time for budget", "time x",
           "cumulative", "seed says", "peak (tensors)", "pred peak", "val loss", "status"]
PEAK_NOTE = ("peak (tensors): one step's tracked tensors per rank (the tensor tracker, the quantity the planner "
             "predicts); `RSS`: the process's peak resident set where the tracker could not measure (libraries, "
             "caches and data included, not comparable with pred peak)")


def print_table(results: list[RungResult], header: dict[str, Any], console=None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    import sys

    c = console or Console(width=None if sys.stdout.isatty() else 170)
    t = Table(title=f"tenfold ladder: {header['model']} on {header['hardware']['description']}, "
                    f"{header['budget_tokens']:,} tokens per rung", box=box.SIMPLE_HEAVY, title_justify="left")
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in ("rung", "precision mbxaccxdp ...", "seed says", "status") else "right",
                     overflow="fold")
    for row in table_rows(results):
        style = None if row[-1] == "measured" else "dim"
        t.add_row(*row, style=style)
    c.print(t)
    if header.get("repeats", 1) > 1:
        c.print(f"  tok/s: the best of {header['repeats']} runs of the ladder per rung (in order, then reversed); "
                "every run's figure in ladder.md / ladder.json (tokens_per_s_runs)")
    if any(fmt_peak(r).endswith(" RSS") for r in results):
        c.print(f"  {PEAK_NOTE}", highlight=False, markup=False)
    for r in results:
        if r.status != "measured":
            c.print(f"  [yellow]{r.index} {r.name} {r.status}[/]: {r.reason}")
        if r.prediction_error:
            c.print(f"  [yellow]{r.index} {r.name} planner[/]: {r.prediction_error}")


def ladder_dict(results: list[RungResult], header: dict[str, Any]) -> dict[str, Any]:
    return {**header, "rungs": [r.to_dict() for r in results]}


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def markdown(results: list[RungResult], header: dict[str, Any]) -> str:
    hw = header["hardware"]
    lines = [
        f"# tenfold ladder: {header['model']}",
        "",
        f"- machine: {hw['description']}",
        f"- date: {header['date']}",
        f"- command: `{header['command']}`",
        f"- budget: {header['budget_tokens']:,} tokens per rung, seq {header['seq_len']}, "
        f"target global batch {header['global_batch']}, memory budget {fmt_bytes(header['memory_budget_bytes'])}",
        "- tokens/s: steady state (optimizer steps after the first)"
        + (f", the best of {header['repeats']} runs of the ladder (in order, then reversed)" if header.get("repeats", 1) > 1 else "")
        + f"; predicted: `tenfold.plan.api.predict` on `{hw['planner_hardware']}`",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" if i in (1, 2, 8, 12) else "---:" for i in range(len(COLUMNS))) + "|",
    ]
    for row in table_rows(results):
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
    lines += ["", "## Rungs", ""]
    for r in results:
        lines.append(f"- **{r.index} {r.name}** ({r.status}): {r.title}.")
        if r.reason:
            lines.append(f"  - reason: {r.reason}")
        for n in r.notes:
            lines.append(f"  - {n}")
        if len(r.tokens_per_s_runs) > 1:
            runs = " / ".join(f"{x:,.0f}" for x in r.tokens_per_s_runs)
            lines.append(f"  - tokens/s of its {len(r.tokens_per_s_runs)} runs: {runs} (the best is counted)")
        if r.memory and r.memory_source:
            cats = ", ".join(f"{label} {fmt_bytes(r.memory.get(key))}" for key, label in MEMORY_PARTS if key in r.memory)
            lines.append(f"  - memory ({r.memory_source}): {cats or ''} peak {fmt_bytes(r.peak_mem_bytes)}")
        if r.load_avg:
            lines.append(f"  - machine load average (1 min) before / after: {r.load_avg[0]:.1f} / {r.load_avg[1]:.1f} "
                         f"on {header['hardware'].get('cores')} cores; the rung's processes: {r.process_s:.0f} s wall, "
                         f"{r.cpu_s:.0f} CPU-s")
        if len(r.memory_per_rank) > 1:
            peaks = ", ".join(fmt_bytes(x.get("peak_bytes")) for x in r.memory_per_rank)
            lines.append(f"  - peak per rank: {peaks}")
        if r.prediction_error:
            lines.append(f"  - planner: {r.prediction_error}")
    verdict = best_line(results)
    if verdict is not None:
        lines += ["", verdict[0].upper() + verdict[1:] + "."]
    if any(fmt_peak(r).endswith(" RSS") for r in results):
        lines += ["", PEAK_NOTE + "."]
    return "\n".join(lines) + "\n"


def rung_line(r: RungResult, run: int | None = None) -> str:
    """One rung's outcome as one line (printed as it ends when the ladder runs off a terminal)."""
    head = f"rung {r.index} {r.name}" + (f" (run {run})" if run else "")
    if r.status != "measured":
        return f"{head}: {r.status}: {r.reason}"
    pred = f" (planner {fmt_rate(r.predicted_tokens_per_s)})" if r.predicted_tokens_per_s else ""
    return (f"{head}: measured, {fmt_rate(r.tokens_per_s)} tok/s{pred}, peak {fmt_peak(r)} per rank, "
            f"{fmt_time(r.process_s)} in all")


def best_rung(results: list[RungResult]) -> RungResult | None:
    measured = [r for r in results if r.status == "measured" and r.speedup_vs_baseline]
    return max(measured, key=lambda r: r.speedup_vs_baseline, default=None)


def best_line(results: list[RungResult]) -> str | None:
    """The closing verdict: the best rung as a multiple of the baseline, or, with the baseline
    not measured, the fastest rung in tokens/s and why no ratio is given."""
    best = best_rung(results)
    if best is not None:
        return f"best rung: {best.index} {best.name}, {best.speedup_vs_baseline:.2f}x the baseline's tokens/s"
    measured = [r for r in results if r.status == "measured" and r.tokens_per_s]
    if not results or not measured:
        return None
    base, fastest = results[0], max(measured, key=lambda r: r.tokens_per_s)
    return (f"fastest rung: {fastest.index} {fastest.name}, {fastest.tokens_per_s:,.0f} tok/s; no ratio to the baseline: "
            f"rung {base.index} {base.name} {base.status} ({base.reason})")


def plot(results: list[RungResult], header: dict[str, Any], path: Path) -> None:
    """Write `figure(...)` as a PNG (atomically)."""
    import matplotlib.pyplot as plt

    fig = figure(results, header)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def figure(results: list[RungResult], header: dict[str, Any]):
    """Two panels: throughput and peak memory per rank, one group per rung, both on linear axes
    from zero (a 2.7x speed-up looks 2.7x tall); measured bars (memory stacked by category
    where measured), predicted values as markers. Text sits where no marker can be: speed-ups
    at the foot of their bars, rung names under the axis on two short lines, unrotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(results)))
    labels = [f"{r.index}\n{r.name.replace('_', chr(10))}" for r in results]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 6.2))
    _throughput_panel(ax_t, results, xs)
    _memory_panel(ax_m, results, xs)
    for ax in (ax_t, ax_m):
        ax.set_xticks(xs, labels, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    fig.suptitle(f"tenfold ladder: {header['model']}, {header['budget_tokens']:,} tokens per rung, "
                 f"{header['hardware']['description']}", fontsize=10)
    fig.tight_layout()
    return fig


def _throughput_panel(ax, results: list[RungResult], xs: list[int]) -> None:
    measured = [r.tokens_per_s or 0 for r in results]
    ax.bar(xs, measured, width=0.6, color="tab:blue", label="measured tokens/s")
    pred = [(x, r.predicted_tokens_per_s) for x, r in zip(xs, results) if r.predicted_tokens_per_s]
    if pred:
        ax.scatter([p[0] for p in pred], [p[1] for p in pred], marker="D", color="tab:red", zorder=3,
                   label="planner's prediction")
    top = max([*measured, *(p[1] for p in pred), 1.0])
    ax.set_ylim(0, top * 1.12)
    for x, r in zip(xs, results):
        if r.status != "measured":
            _status_text(ax, x, r.status)
        elif r.speedup_vs_baseline:
            inside = r.tokens_per_s >= 0.12 * top  # room for the label inside the bar's foot
            ax.text(x, 0.02 * top if inside else r.tokens_per_s + 0.01 * top, f"{r.speedup_vs_baseline:.2f}x",
                    ha="center", va="bottom", fontsize=9, fontweight="bold",
                    color="white" if inside else "black", zorder=4)
    ax.set_xlim(-0.6, len(results) - 0.4)
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput (in the bars: speed-up vs the baseline)", fontsize=10)
    _legend_below(ax)


def _status_text(ax, x: float, status: str) -> None:
    """A rung that was not measured: its status at the foot of the empty slot."""
    ax.text(x, 0.02, status, ha="center", va="bottom", transform=ax.get_xaxis_transform(), color="gray", fontsize=9)


def _memory_panel(ax, results: list[RungResult], xs: list[int]) -> None:
    bottoms = [0.0] * len(results)
    colors = ("tab:gray", "tab:olive", "tab:purple", "tab:cyan", "tab:orange")
    by_category = [all(k in r.memory for k, _ in MEMORY_PARTS if k not in LATER_PARTS) for r in results]
    for (key, label), color in zip(MEMORY_PARTS, colors):
        vals = [r.memory.get(key, 0) / MiB if ok else 0.0 for r, ok in zip(results, by_category)]
        if any(vals):
            ax.bar(xs, vals, width=0.6, bottom=bottoms, color=color, label=f"measured {label}")
            bottoms = [b + v for b, v in zip(bottoms, vals)]
    # Rungs without a per-category measurement: the process's peak RSS as a hatched bar.
    rss = [r.peak_mem_bytes / MiB if (r.peak_mem_bytes and not ok) else 0.0 for r, ok in zip(results, by_category)]
    if any(rss):
        ax.bar(xs, rss, width=0.6, color="white", edgecolor="tab:gray", hatch="//", label="measured peak RSS (process)")
    # The peak is one moment of the step: below the stacked sum (params/grads/optimizer are
    # counted at the optimizer step, activations at the peak).
    peaks = [(x, r.peak_mem_bytes / MiB) for x, r, ok in zip(xs, results, by_category) if r.peak_mem_bytes and ok]
    if peaks:
        ax.scatter([p[0] for p in peaks], [p[1] for p in peaks], marker="_", s=700, linewidths=2.5, color="black",
                   zorder=3, label="measured peak (one moment)")
    pred = [(x, r.predicted_peak_bytes / MiB) for x, r in zip(xs, results) if r.predicted_peak_bytes]
    if pred:
        ax.scatter([p[0] for p in pred], [p[1] for p in pred], marker="D", color="tab:red", zorder=4,
                   label="planner's predicted peak")
    for x, r in zip(xs, results):
        if r.status != "measured":
            _status_text(ax, x, r.status)
    ax.set_ylim(bottom=0)
    ax.set_xlim(-0.6, len(results) - 0.4)
    ax.set_ylabel("MiB per rank")
    ax.set_title("memory per rank (stacked: states at the optimizer step, activations at the peak)", fontsize=10)
    _legend_below(ax)


def _legend_below(ax) -> None:
    """Legends under the axes: bars of any height stay visible."""
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
