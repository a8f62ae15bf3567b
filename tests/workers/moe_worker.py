"""Rank-side half of the expert-parallel tests: run by `python -m torch.distributed.run` from
tests/test_expert_parallel.py, never by pytest itself (no test functions).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/moe_worker.py MODE OUT.json

MODE: equivalence (2 ranks), pipeline, tensor or replicas (4 ranks).

Every rank builds the `Trainer` on the same token array (zero_worker's) with the tiny MoE model,
runs steps and records its losses and the first step's gradients (whole tensors, gathered);
rank 0 writes what every rank saw.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workers.zero_worker import STEPS, SEQ, token_array, write_per_rank  # noqa: E402

MODEL = {"name": "tiny-moe", "n_layers": 2, "d_model": 32, "n_heads": 4, "d_ff": 64, "max_seq_len": SEQ,
         "d_expert": 32, "n_experts": 4, "experts_per_token": 2, "n_shared_experts": 1}


def config(stage: int, micro: int, accum: int, out: str, ep: int = 1, pp: int = 1, tp: int = 1, **model) -> dict:
    return {
        "model": {**MODEL, **model},
        "data": {"seq_len": SEQ, "val_fraction": 0.0},
        "train": {"steps": STEPS, "micro_batch": micro, "grad_accum": accum, "lr": 1e-2,
                  "warmup_steps": 0, "eval_every": 0, "seed": 7, "grad_clip": 1.0},
        "precision": {"dtype": "fp32"},
        "parallel": {"zero_stage": stage, "param_persistence_threshold": 0, "ep_degree": ep, "pp_degree": pp,
                     "pp_schedule": "1f1b", "tp_degree": tp},
        "log": {"out": out, "progress": False, "tensorboard": False},
    }


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_steps(cfg: dict) -> dict:
    """Losses and gradient norms of STEPS steps, the expert load of each, and every parameter's
    whole gradient at the first optimizer step (before clipping scales it)."""
    from tenfold.engine.loop.trainer import Trainer
    from tenfold.models.moe import MoE
    from tenfold.techniques import zero
    from tenfold.techniques.expert_parallel import expert_params

    t = Trainer(cfg, dataset=token_array())
    t.setup()
    grads: dict[str, list] = {}

    def capture(*_):
        if not grads:
            for name, p in zero.unwrap(t.model).named_parameters():
                if p.grad is not None:
                    grads[name.replace("_fsdp_wrapped_module.", "")] = full(p.grad).flatten()[:64].tolist()

    t.optimizer.register_step_pre_hook(capture)
    # the elements of the split experts' weights this rank keeps (its FSDP2 shard of its ep part)
    held_expert_numel = sum(p.to_local().numel() for p in expert_params(zero.unwrap(t.model)))
    # a pipeline stage holds some of the MoE layers: its rows of the expert load are theirs
    layers = [int(name.split(".")[1]) for name, m in zero.unwrap(t.model).named_modules() if isinstance(m, MoE)]
    losses, norms, loads = [], [], []
    for _ in range(STEPS):
        result = t.train_step(t.loader.next_step())
        losses.append(result.loss)
        norms.append(result.grad_norm)
        loads.append(result.expert_load)
    return {"losses": losses, "grad_norms": norms, "grads": grads, "loads": loads, "layers": layers,
            "held_expert_numel": held_expert_numel}


def mode_equivalence(out_dir: str) -> dict:
    """ep 2 over the 2 dp ranks, micro 2 x accum 1 x dp 2, ZeRO-0 (DDP) and ZeRO-3 (FSDP2); with
    more ranks than ep, the ranks holding the same experts average them too. The same without
    ep (ep 1): DDP and FSDP2 reduce the experts' gradients with the others'."""
    world = int(os.environ["WORLD_SIZE"])
    micro, accum = (2, 1) if world == 2 else (1, 1)
    runs = {f"{stage}": run_steps(config(stage, micro, accum, os.path.join(out_dir, f"ep-{stage}"), ep=2))
            for stage in (0, 3)}
    # accumulation (micro 1 x accum 2) and full recompute: the all-to-alls replayed in backward
    recomputed = config(3, 1, 2, os.path.join(out_dir, "ep-ac"), ep=2)
    recomputed["recompute"] = {"policy": "full"}
    runs["3-accum-recompute"] = run_steps(recomputed)
    # no ep on the same ranks: the experts are data-parallel weights like the rest
    for stage in (0, 3):
        runs[f"ep1-{stage}"] = run_steps(config(stage, micro, accum, os.path.join(out_dir, f"ep1-{stage}"), ep=1))
    return runs


def mode_pipeline(out_dir: str) -> dict:
    """4 ranks: pp 2 x dp 2 with ep 2 over the dp ranks of each stage (one MoE layer a stage),
    micro 1 x accum 2 x dp 2 under 1F1B, ZeRO-0 and ZeRO-3 (and ZeRO-3 with full recompute);
    the same without ep."""
    runs = {f"pp2-{stage}": run_steps(config(stage, 1, 2, os.path.join(out_dir, f"pp-{stage}"), ep=2, pp=2))
            for stage in (0, 3)}
    # full recompute: the all-to-alls replayed in backward, the balance losses counted once
    recomputed = config(3, 1, 2, os.path.join(out_dir, "pp-ac"), ep=2, pp=2)
    recomputed["recompute"] = {"policy": "full"}
    runs["pp2-3-recompute"] = run_steps(recomputed)
    # no ep: the MoE layers' balance losses under the pipeline alone
    runs["pp2-ep1-0"] = run_steps(config(0, 1, 2, os.path.join(out_dir, "pp-ep1"), ep=1, pp=2))
    return runs


def mode_tensor(out_dir: str) -> dict:
    """4 ranks: tp 2 x dp 2 with ep 2 over the dp ranks, micro 2 x accum 1 x dp 2 (no sequence
    parallelism: the tp ranks route the same tokens), ZeRO-0 and ZeRO-3 (and ZeRO-3 with full
    recompute); ZeRO-3 without ep (the experts then sharded by FSDP2 over dp, whole on each tp rank)."""
    runs = {}
    for name, stage, ep, policy in (("tp2-0", 0, 2, "none"), ("tp2-3", 3, 2, "none"),
                                    ("tp2-3-recompute", 3, 2, "full"), ("tp2-ep1-3", 3, 1, "none")):
        cfg = config(stage, 2, 1, os.path.join(out_dir, name), ep=ep, tp=2)
        cfg["parallel"]["sequence_parallel"] = False
        cfg["recompute"] = {"policy": policy}
        runs[name] = run_steps(cfg)
    return runs


def mode_replicas(out_dir: str) -> dict:
    """4 ranks: dp 4 with ep 2, so two ranks hold each half of the experts; ZeRO-2/3 shard those
    experts over the two (FSDP2 over "dp_mod_ep"), ZeRO-0 keeps them whole and all-reduces them.
    micro 1 x accum 1 x dp 4: the one process's micro 1 x accum 4. With 6 experts each rank's 3
    do not split in two: FSDP2 shards them on their second dimension."""
    runs = {f"dp4-{stage}": run_steps(config(stage, 1, 1, os.path.join(out_dir, f"dp4-{stage}"), ep=2))
            for stage in (0, 2, 3)}
    runs["dp4-3-six"] = run_steps(config(3, 1, 1, os.path.join(out_dir, "dp4-six"), ep=2, n_experts=6))
    return runs


def main() -> None:
    mode, out_path = sys.argv[1], sys.argv[2]
    modes = {"equivalence": mode_equivalence, "pipeline": mode_pipeline, "tensor": mode_tensor,
             "replicas": mode_replicas}
    result = modes[mode](os.path.dirname(out_path))
    write_per_rank(result, out_path)


if __name__ == "__main__":
    main()
