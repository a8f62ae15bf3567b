"""Rank-side half of tests/test_recompute_op.py: run by `python -m torch.distributed.run`, never by
pytest itself (no test functions).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/recompute_worker.py op OUT.json

Each layout (ZeRO-0, ZeRO-3 in fp32 and bf16, tensor parallelism with and without sequence
parallelism, two pipeline stages) trains the same steps with `--ac none`, `--ac op` and `--ac
full`. For each step the rank compares op's loss and every gradient (gathered whole where they
are sharded) with none's and keeps the largest relative difference; step 2 is measured with the
engine's memory tracker. Rank 0 writes one JSON file with what every rank saw.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from zero_worker import config, token_array, write_per_rank  # noqa: E402

STEPS = 3
MICRO = 4  # sequences per micro-batch: enough tokens that activations, not AdamW temporaries, set the high-water mark
LAYOUTS = {
    "zero0-fp32": dict(stage=0, dtype="fp32"),
    "zero3-fp32": dict(stage=3, dtype="fp32"),
    "zero3-bf16": dict(stage=3, dtype="bf16"),
    "tp2-fp32": dict(stage=0, dtype="fp32", tp_degree=2, sequence_parallel=False),
    "tp2-sp-fp32": dict(stage=0, dtype="fp32", tp_degree=2, sequence_parallel=True),
    "pp2-fp32": dict(stage=0, dtype="fp32", pp_degree=2),
}


def full_grad(p: torch.Tensor) -> torch.Tensor | None:
    g = p.grad
    if g is None:
        return None
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()


def run(layout: dict, policy: str, out_dir: str) -> dict:
    """Losses, per-step gradients (by name) and step 2's measured memory of one policy."""
    from tenfold.engine.memory.measure import measure_step_memory
    from tenfold.engine.loop.trainer import Trainer
    from tenfold.techniques.recompute import describe

    layout = dict(layout)
    cfg = config(layout.pop("stage"), layout.pop("dtype"), MICRO, 2, out_dir, **layout)
    cfg["recompute"] = {"policy": policy}
    t = Trainer(cfg, dataset=token_array())
    t.setup()
    losses, grads, measured = [], [], None
    for i in range(STEPS):
        mbs = t.loader.next_step()
        box = []

        def step():
            loss, tokens = t.accumulate_gradients(mbs)
            grads.append({n: full_grad(p) for n, p in t.model.named_parameters()})
            box.append(t.apply_gradients(loss, tokens))

        if i == 1:
            measured = measure_step_memory(t.model, t.optimizer, step, t.dist.device)
        else:
            step()
        losses.append(box[0].loss)
    return {"losses": losses, "grads": grads, "activations_bytes": measured["activations_bytes"],
            "recomputed_modules": len(describe(t.model))}


def max_rel(a: dict, b: dict) -> float:
    worst = 0.0
    for name, want in b.items():
        got = a[name]
        if want is None or got is None:
            assert want is None and got is None, name
            continue
        worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)))
    return worst


def mode_op(out_dir: str) -> dict:
    results = {}
    for name, layout in LAYOUTS.items():
        runs = {p: run(layout, p, out_dir) for p in ("none", "op", "full")}
        none, op = runs["none"], runs["op"]
        results[name] = {
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(op["losses"], none["losses"])),
            "grad_rel": max(max_rel(g, h) for g, h in zip(op["grads"], none["grads"])),
            "grad_count": sum(g is not None for g in none["grads"][-1].values()),
            "losses": none["losses"],
            "activations_bytes": {p: r["activations_bytes"] for p, r in runs.items()},
            "recomputed_modules": op["recomputed_modules"],
        }
    return results


def main() -> None:
    mode, out_path = sys.argv[1], sys.argv[2]
    write_per_rank({"op": mode_op}[mode](os.path.dirname(out_path)), out_path)


if __name__ == "__main__":
    main()
