"""tune.png: the planner's predicted tokens/s against the measured, before and after
calibration, with the diagonal (left); every run's tokens/s in the order it ran, with the best
so far (right)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(doc: dict[str, Any], path: Path) -> None:
    from tenfold.plan.plot import _plt

    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.6))
    _predicted_vs_measured(left, doc)
    _timeline(right, doc)
    fig.suptitle(f"tenfold tune: {doc['machine']['nproc']} x {doc['machine']['planner_hardware']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _predicted_vs_measured(ax, doc: dict[str, Any]) -> None:
    measured = [t for t in doc["trials"] if t["tokens_per_s"]]
    if not measured:
        ax.text(0.5, 0.5, "nothing measured", ha="center", va="center", transform=ax.transAxes)
        return
    x = [t["tokens_per_s"] for t in measured]
    before = [t["predicted_before"] for t in measured]
    after = [t["predicted_after"] or t["predicted_before"] for t in measured]
    for xi, b, a in zip(x, before, after):  # each trial's prediction, before -> after
        ax.plot([xi, xi], [b, a], color="tab:gray", lw=0.6, alpha=0.6)
    ax.scatter(x, before, facecolors="none", edgecolors="tab:gray", s=50, label="planner, before calibration")
    ax.scatter(x, after, color="tab:blue", s=30, label="planner, calibrated")
    for t, a in zip(measured, after):
        ax.annotate(t["id"], (t["tokens_per_s"], a), textcoords="offset points", xytext=(4, 4), fontsize=8)
    lo, hi = min(x + before + after) / 1.3, max(x + before + after) * 1.3
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [lo / 1.15, hi / 1.15], [lo * 1.15, hi * 1.15], color="tab:green", alpha=0.1,
                    label="within 15%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured tokens/s")
    ax.set_ylabel("predicted tokens/s")
    _plain_ticks(ax)
    # below the axes: inside, it hid the points it was drawn over (any corner can hold some)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax.set_title("planner vs measurement")


def _timeline(ax, doc: dict[str, Any]) -> None:
    runs = sorted(((r, t) for t in doc["trials"] for r in t["runs"]), key=lambda rt: rt[0].get("started") or "")
    if not runs:
        return
    best, xs, ys, bests = 0.0, [], [], []
    for i, (r, t) in enumerate(runs, start=1):
        rate = r["tokens_per_s"] if r["status"] == "measured" else None
        if rate:
            best = max(best, rate)
            xs.append(i)
            ys.append(rate)
            ax.annotate(t["id"], (i, rate), textcoords="offset points", xytext=(3, 3), fontsize=8)
        else:
            ax.axvline(i, color="tab:red", alpha=0.3, lw=4)
        bests.append(best or None)
    ax.scatter(xs, ys, color="tab:blue", label="run (steady-state tokens/s)")
    ax.step(range(1, len(runs) + 1), bests, where="post", color="tab:orange", label="best so far")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("run, in the order they ran (red: failed, oom or timeout)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    ax.set_title("the budget, run by run")


def _plain_ticks(ax) -> None:
    """Log axes labelled 3,000 / 10,000 rather than 3x10^3 (and no crowded minor labels)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        axis.set_minor_formatter(NullFormatter())
