"""`--plot FILE.png`: memory breakdown, search candidates, ladder rungs (matplotlib, Agg)."""

from __future__ import annotations

import os
import sys

from tenfold.errors import UserError

GiB = 2**30


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    """Write the figure and say where (on stderr, so that `--json` output stays pure JSON)."""
    if not str(path).lower().endswith((".png", ".svg", ".pdf")):
        raise UserError(f"--plot {path}: use a .png, .svg or .pdf file name")
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as exc:
        raise UserError(f"--plot {path}: cannot write ({exc.strerror})") from None
    print(f"tenfold plan: wrote {os.path.abspath(path)}", file=sys.stderr)


def _memory_parts(plan) -> list[tuple[str, float]]:
    m = plan.memory
    return [
        ("params", m.params_bytes), ("grads", m.grads_bytes), ("fp32 master", m.master_weights_bytes),
        ("Adam moments", m.optimizer_moments_bytes), ("gathered params", m.gathered_params_bytes),
        ("activations", m.activations_bytes or 0.0), ("buffers", m.comm_buffers_bytes),
        ("reserve + context", m.allocator_reserve_bytes + m.runtime_overhead_bytes),
    ]


def plot_memory(plan, path: str, ax=None) -> None:
    plt = _plt()
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(8, 2.6))
    left = 0.0
    for name, v in _memory_parts(plan):
        if v <= 0:
            continue
        ax.barh([0], [v / GiB], left=left, label=f"{name} {v / GiB:,.1f}")
        left += v / GiB
    ax.axvline(plan.memory.capacity_bytes / GiB, color="k", linestyle="--", label=f"capacity {plan.memory.capacity_bytes / GiB:,.0f}")
    ax.set_yticks([])
    ax.set_xlabel("GiB per GPU")
    ax.set_title(f"{plan.model} on {plan.gpus} x {plan.hardware}: {'fits' if plan.fits else 'does not fit'}")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    if own:
        _save(fig, path)
        plt.close(fig)


def plot_search(result, path: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2 if result.best else 1, figsize=(12 if result.best else 6, 4), squeeze=False)
    ax = axes[0][0]
    fit = [(g, t) for g, t, ok in result.candidates if ok]
    nofit = [g for g, t, ok in result.candidates if not ok]
    if fit:
        ax.scatter([g for g, _ in fit], [t for _, t in fit], s=6, label=f"fits ({len(fit)})")
    if nofit:
        ax.scatter(nofit, [0] * len(nofit), s=6, color="red", alpha=0.3, label=f"does not fit ({len(nofit)})")
    ax.set_xscale("log")
    ax.set_xlabel("GiB per GPU")
    ax.set_ylabel("predicted tokens/s")
    ax.legend(fontsize=8)
    ax.set_title("strategies evaluated")
    if result.best:
        plot_memory(result.best[0], path, ax=axes[0][1])
        axes[0][1].set_title("best: " + axes[0][1].get_title())
    _save(fig, path)
    plt.close(fig)


def plot_ladder(rungs, path: str) -> None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    names = [str(i) for i in range(len(rungs))]
    a1.bar(names, [r.plan.train_days for r in rungs], label="planner")
    if rungs[0].seed is not None:
        a1.plot(names, [r.seed.days for r in rungs], "o", color="k", label="the recipe's claim")
    a1.set_yscale("log")
    a1.set_ylabel("days")
    a1.set_xlabel("rung")
    a1.legend(fontsize=8)
    a2.bar(names, [r.plan.memory.total_bytes / GiB for r in rungs], color=["tab:green" if r.plan.fits else "tab:red" for r in rungs])
    a2.axhline(rungs[0].plan.memory.capacity_bytes / GiB, color="k", linestyle="--")
    a2.set_yscale("log")
    a2.set_ylabel("GiB per GPU (red: does not fit)")
    a2.set_xlabel("rung")
    fig.suptitle("; ".join(f"{i}: {r.name}" for i, r in enumerate(rungs)), fontsize=7, wrap=True)
    _save(fig, path)
    plt.close(fig)
