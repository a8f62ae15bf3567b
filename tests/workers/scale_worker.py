"""Rank-side half of tests/test_hsdp.py and tests/test_offload.py: run by
`python -m torch.distributed.run`, never by pytest itself (no test functions).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/scale_worker.py MODE OUT.json

Every rank builds the `Trainer` (tenfold's own wrapping, the path training takes) on the
same token array as tests/workers/zero_worker.py; rank 0 writes one JSON file with what every
rank saw, and the first step's full gradients to OUT-MODE-grads.pt files.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from zero_worker import config, run_steps, token_array, write_per_rank  # noqa: E402

GLOBAL_BATCH = 8  # sequences per step on every layout (micro 1 x accum 8 / dp)


def fixed_batch(cfg: dict, steps: int | None = None, **parallel) -> dict:
    """`cfg` at GLOBAL_BATCH sequences per step whatever the number of ranks (the same samples
    each step: a run resumed on another layout continues the same curve)."""
    cfg["train"].update(micro_batch=1, grad_accum=None, global_batch=GLOBAL_BATCH)
    if steps is not None:
        cfg["train"]["steps"] = steps
    cfg["parallel"].update(parallel)
    return cfg


def first_step_grads(cfg: dict) -> dict[str, torch.Tensor]:
    """The full (all-gathered) gradient of every parameter after the first step's backward,
    unscaled, before clipping and the optimizer step: what the data-parallel reduction left."""
    from tenfold.engine.loop.trainer import Trainer

    t = Trainer(cfg, dataset=token_array())
    t.setup()
    t.accumulate_gradients(t.loader.next_step())
    out = {}
    for name, p in t.model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().double().cpu() / t.scaler.scale
    return out


def layout_of(cfg: dict) -> dict:
    """How FSDP2 placed one block parameter: its DTensor mesh (rank layout and dim names),
    placements and the local shard's share of the whole tensor; and whether the offload
    policy was applied (read back from FSDP2's own state)."""
    from tenfold.engine.loop.trainer import Trainer
    from tenfold.techniques.offload import offloaded

    t = Trainer(cfg, dataset=token_array())
    t.setup()
    p = t.model.layers["0"].attn.wq.weight if hasattr(t.model.layers["0"].attn, "wq") else next(t.model.layers["0"].parameters())
    opt_devices = sorted({str(v.device) for s in t.optimizer.state.values() for v in s.values() if torch.is_tensor(v)})
    local = lambda q: q.to_local() if hasattr(q, "to_local") else q  # noqa: E731
    mesh = getattr(p, "device_mesh", None)
    return {
        "mesh": mesh.mesh.tolist() if mesh else None, "mesh_dims": list(mesh.mesh_dim_names) if mesh else [],
        "placements": [str(x) for x in getattr(p, "placements", ())], "local_share": local(p).numel() / p.numel(),
        "offloaded": offloaded(t.model), "param_devices": sorted({str(local(q).device) for q in t.model.parameters()}),
        "optimizer_devices": opt_devices, "optimizer_class": type(t.optimizer).__name__,
        "host_bytes": t.optimizer.host_bytes() if hasattr(t.optimizer, "host_bytes") else None,
    }


def save_grads(out_dir: str, key: str, grads: dict) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(grads, Path(out_dir) / f"grads-{key}.pt")


def mode_hsdp(out_dir: str) -> dict:
    """4 ranks, shard groups of 2: equivalence (fp32 ZeRO-2/3, bf16 ZeRO-3, with offload), layout,
    first gradients, and checkpoints: stop at step 2, resume on HSDP and on plain ZeRO-3 (shard 4)."""
    res: dict = {}
    for stage in (2, 3):
        res[f"{stage}-fp32"] = run_steps(fixed_batch(config(stage, "fp32", 1, 2, out_dir), shard_group_size=2), measure_at=None)[1]
    res["3-bf16"] = run_steps(fixed_batch(config(3, "bf16", 1, 2, out_dir), shard_group_size=2), measure_at=None)[1]
    res["3-fp32-full-shard"] = run_steps(fixed_batch(config(3, "fp32", 1, 2, out_dir)), measure_at=None)[1]
    res["layout"] = layout_of(fixed_batch(config(3, "fp32", 1, 2, out_dir), shard_group_size=2))
    for offload in ("optimizer+params", "optimizer"):
        offloaded_hsdp = fixed_batch(config(3, "fp32", 1, 2, out_dir), shard_group_size=2, offload=offload)
        res[f"3-fp32-offload-{offload}"] = run_steps(offloaded_hsdp, measure_at=None)[1]
        res[f"offload-layout-{offload}"] = layout_of(offloaded_hsdp)
    save_grads(out_dir, "hsdp", first_step_grads(fixed_batch(config(3, "fp32", 1, 2, out_dir), shard_group_size=2)))
    res.update(checkpoints(Path(out_dir)))
    return res


def _fit(cfg: dict) -> list[float]:
    from tenfold.engine.loop.trainer import Trainer

    return Trainer(cfg, dataset=token_array()).fit()["losses"]


def ckpt_config(out: Path, steps: int, **parallel) -> dict:
    cfg = fixed_batch(config(3, "fp32", 1, 2, str(out)), steps=steps, **parallel)
    cfg["checkpoint"] = {"every": 2}
    return cfg


def checkpoints(root: Path) -> dict:
    """HSDP (4 ranks, groups of 2): 4 steps uninterrupted, saving at steps 2 and 4; a new
    Trainer resumes its step-2 checkpoint to step 4 on the same layout, and on plain ZeRO-3
    over all 4 ranks (another shard group size). The 2-rank resume of the same checkpoint runs
    in mode `resume2`."""
    out = {"full": _fit(ckpt_config(root / "hsdp_full", 4, shard_group_size=2))}
    step2 = str(root / "hsdp_full" / "checkpoints" / "step_2")
    out["resumed_hsdp"] = _fit({**ckpt_config(root / "resumed_hsdp", 4, shard_group_size=2),
                                "checkpoint": {"every": 2, "resume": step2}})
    out["resumed_shard4"] = _fit({**ckpt_config(root / "resumed_shard4", 4), "checkpoint": {"every": 2, "resume": step2}})
    return out


def mode_resume2(out_dir: str) -> dict:
    """2 ranks (plain ZeRO-3) resume the 4-rank HSDP checkpoint that mode `hsdp` left in OUT's folder."""
    root = Path(out_dir)
    step2 = str(root / "hsdp_full" / "checkpoints" / "step_2")
    return {"resumed_2ranks": _fit({**ckpt_config(root / "resumed_2ranks", 4), "checkpoint": {"every": 2, "resume": step2}})}


def mode_offload(out_dir: str) -> dict:
    """2 ranks: each offload value with the stages it runs with, against no offload; the
    layout (policy applied, where the states live); and the model-state bytes on the host."""
    res: dict = {}
    for stage, offload in ((2, "none"), (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "optimizer+params")):
        cfg = fixed_batch(config(stage, "fp32", 1, 2, out_dir), offload=offload)
        res[f"{stage}-{offload}"] = run_steps(cfg, measure_at=None)[1]
        res[f"{stage}-{offload}-layout"] = layout_of(cfg)
    res["3-bf16-optimizer"] = run_steps(fixed_batch(config(3, "bf16", 1, 2, out_dir), offload="optimizer"), measure_at=None)[1]
    res["3-bf16-none"] = run_steps(fixed_batch(config(3, "bf16", 1, 2, out_dir)), measure_at=None)[1]
    save_grads(out_dir, "offload", first_step_grads(fixed_batch(config(3, "fp32", 1, 2, out_dir), offload="optimizer+params")))
    res.update(offload_checkpoints(Path(out_dir)))
    return res


def offload_checkpoints(root: Path) -> dict:
    """ZeRO-2 with `--offload optimizer` (the states in host memory): 4 steps uninterrupted,
    saving at step 2; that checkpoint resumed to step 4 with the same offload, and without."""
    def cfg(name: str, offload: str, **checkpoint) -> dict:
        c = fixed_batch(config(2, "fp32", 1, 2, str(root / name)), steps=4, offload=offload)
        c["checkpoint"] = {"every": 2, **checkpoint}
        return c

    out = {"offload-full": _fit(cfg("offload_full", "optimizer"))}
    step2 = str(root / "offload_full" / "checkpoints" / "step_2")
    out["offload-resumed"] = _fit(cfg("offload_resumed", "optimizer", resume=step2))
    out["offload-resumed-plain"] = _fit(cfg("offload_resumed_plain", "none", resume=step2))
    return out


def mode_offload1(out_dir: str) -> dict:
    """One process (no torchrun): ZeRO-Offload's single-device case runs FSDP2 on a mesh of one."""
    res = {}
    for stage, offload in ((2, "optimizer"), (3, "optimizer+params")):
        cfg = fixed_batch(config(stage, "fp32", 1, 2, out_dir), offload=offload)
        res[f"{stage}-{offload}"] = run_steps(cfg, measure_at=None)[1]
        res[f"{stage}-{offload}-layout"] = layout_of(cfg)
    return res


def main() -> None:
    mode, out_path = sys.argv[1], sys.argv[2]
    out_dir = os.path.dirname(out_path)
    modes = {"hsdp": mode_hsdp, "resume2": mode_resume2, "offload": mode_offload, "offload1": mode_offload1}
    write_per_rank(modes[mode](out_dir), out_path)


if __name__ == "__main__":
    main()
