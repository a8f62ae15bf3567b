"""Hybrid sharding (HSDP, `parallel.shard_group_size` / `--shard-group`): FSDP2 on a 2-D
(dp_replicate, dp_shard) mesh, on 4 gloo ranks in 2 groups of 2.

The ranks run tests/workers/scale_worker.py (the Trainer, tenfold's own wrapping); the
one-process reference runs here with the same global batch (8 sequences per step: micro 1 x
accum 8 on one process, micro 1 x accum 2 x dp 4 on four ranks).

Tolerances: fp32 rel 1e-6 on every step's loss and on the first step's gradients (measured
~1e-8: only the order of the fp32 reductions differs). gloo has no PREMUL_SUM, so FSDP2
averages (it divides by 2 in the reduce-scatter inside a group and by 2 in the all-reduce
across groups) and the trainer multiplies the loss by dp = 4: a gradient scaled by the group
size instead would be off by 2x. bf16: rel 2e-3, as tests/test_zero.py says why.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "workers"))
from conftest import BF16_RTOL, rel_err, torchrun  # noqa: E402
from workers import scale_worker as worker  # noqa: E402
from workers.zero_worker import config, run_steps  # noqa: E402

from tenfold.config import build_config  # noqa: E402
from tenfold.errors import UserError  # noqa: E402
from tenfold.run import resolve_run  # noqa: E402

RTOL = 1e-6


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory):
    """4 ranks (HSDP runs and the checkpoint at step 2), then 2 ranks resuming that checkpoint."""
    tmp = tmp_path_factory.mktemp("hsdp")
    four = torchrun("hsdp", tmp, nproc=4, timeout=900, worker="scale_worker.py")
    two = torchrun("resume2", tmp, nproc=2, timeout=400, worker="scale_worker.py")
    return {"four": four, "two": two, "tmp": tmp}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hsdp-ref"))
    torch.set_num_threads(1)
    runs = {dtype: run_steps(worker.fixed_batch(config(3, dtype, 1, 2, out)), measure_at=None)[1] for dtype in ("fp32", "bf16")}
    runs["grads"] = worker.first_step_grads(worker.fixed_batch(config(3, "fp32", 1, 2, out)))
    return runs


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_hsdp_on_four_ranks_matches_one_process(hsdp_runs, reference, stage):
    ref = reference["fp32"]
    for rank in map(str, range(4)):
        got = hsdp_runs["four"][rank][f"{stage}-fp32"]
        assert rel_err(got["losses"], ref["losses"]) < RTOL, (got["losses"], ref["losses"])
        assert rel_err(got["grad_norms"], ref["grad_norms"]) < RTOL
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # it learns


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("offload", ["optimizer+params", "optimizer"])
def test_hsdp_with_offload_matches_one_process(hsdp_runs, reference, offload):
    """HSDP + ZeRO-Offload on the 2-D mesh (`optimizer+params`: CPUOffloadPolicy; `optimizer`:
    HostAdamW over (Replicate, Shard) DTensors): same curve, and each rank's host memory is 16 B
    per parameter over its group of 2, not over all 4."""
    n = sum(g.numel() for g in reference["grads"].values())
    for rank in map(str, range(4)):
        run = hsdp_runs["four"][rank][f"3-fp32-offload-{offload}"]
        assert rel_err(run["losses"], reference["fp32"]["losses"]) < RTOL
        layout = hsdp_runs["four"][rank][f"offload-layout-{offload}"]
        assert layout["offloaded"] == (offload == "optimizer+params") and layout["placements"] == ["R", "S(0)"]
        b = run["state_bytes"]
        host = b["params_bytes"] + b["grads_bytes"] + b["optimizer_bytes"]
        if offload == "optimizer":
            host = layout["host_bytes"]
        assert host == pytest.approx(16 * n / 2, rel=0.01)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hsdp_bf16_matches_one_process(hsdp_runs, reference):
    for rank in map(str, range(4)):
        assert rel_err(hsdp_runs["four"][rank]["3-bf16"]["losses"], reference["bf16"]["losses"]) < BF16_RTOL


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hsdp_gradients_match_one_process(hsdp_runs, reference):
    """The first step's reduced gradient of every parameter (the full tensor, before clipping):
    the data-parallel average over 4 ranks through a reduce-scatter in each group of 2 and an
    all-reduce across the groups, with the loss multiplied by dp. Mutation: the loss multiplied
    by the group size (2) instead of dp -> every gradient off by 2x."""
    got = torch.load(hsdp_runs["tmp"] / "grads-hsdp.pt")
    want = reference["grads"]
    assert set(got) == set(want)
    for name, g in want.items():
        assert (got[name] - g).abs().max() <= RTOL * g.abs().max(), name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parameters_shard_in_groups_and_replicate_across(hsdp_runs):
    """Each parameter is a DTensor on the (dp_replicate, dp_shard) mesh [[0, 1], [2, 3]]:
    neighbouring ranks 0-1 and 2-3 shard (half each), the groups replicate. Mutations: a 1-D
    mesh (every rank a quarter, placements (Shard(0),)); replicate and shard swapped (groups
    0-2 and 1-3: the sharding collectives would cross the node boundary)."""
    for rank in map(str, range(4)):
        layout = hsdp_runs["four"][rank]["layout"]
        assert layout["mesh"] == [[0, 1], [2, 3]] and layout["mesh_dims"] == ["dp_replicate", "dp_shard"]
        assert layout["placements"] == ["R", "S(0)"] and layout["local_share"] == 0.5
        assert not layout["offloaded"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hsdp_all_reduces_across_groups_once_per_step(hsdp_runs):
    """Collectives of one step (accum 2, 3 FSDP2 units): the same all-gathers and
    reduce-scatters as plain ZeRO-3 over 4 ranks (inside the groups now: per micro-step the 3
    units in forward and block 0 again in backward, test_zero.test_collectives_per_step), plus
    one all-reduce per unit per step across the groups, not one per micro-step. Mutation:
    without `set_requires_all_reduce(False)` on the first micro-step, 6 all-reduces instead of 3."""
    for rank in map(str, range(4)):
        hsdp = hsdp_runs["four"][rank]["3-fp32"]["collectives"]
        plain = hsdp_runs["four"][rank]["3-fp32-full-shard"]["collectives"]
        assert hsdp["all_gather_single"] == plain["all_gather_single"] == (3 + 1) * 2
        assert hsdp["reduce_scatter_single"] == plain["reduce_scatter_single"] == 3 * 2
        assert hsdp["all_reduce"] - plain.get("all_reduce", 0) == 3


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hsdp_checkpoint_resumes_exactly_on_four_ranks(hsdp_runs):
    """A new run resumes the uninterrupted run's step-2 checkpoint on the same HSDP layout:
    steps 3-4 bit for bit the uninterrupted ones."""
    r = hsdp_runs["four"]["0"]
    assert len(r["full"]) == 4 and len(r["resumed_hsdp"]) == 4
    assert r["resumed_hsdp"][2:] == r["full"][2:]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["resumed_shard4", "resumed_2ranks"])
def test_hsdp_checkpoint_reshards_to_other_layouts(hsdp_runs, where):
    """The 4-rank HSDP checkpoint (groups of 2) resumed through DCP on plain ZeRO-3 over the
    same 4 ranks (one group of 4) and on 2 ranks: the uninterrupted curve, to the reduction
    order (rel 1e-6)."""
    full = hsdp_runs["four"]["0"]["full"]
    got = hsdp_runs["two"]["0"][where] if where == "resumed_2ranks" else hsdp_runs["four"]["0"][where]
    assert len(got) == 4
    assert rel_err(got[2:], full[2:]) < RTOL, (got, full)


# --------------------------------------------------------------------------- validation


def _refusal(world: int, **parallel) -> str:
    cfg = build_config({"parallel": parallel})
    with pytest.raises(UserError) as e:
        resolve_run(cfg, world)
    # `tenfold plan` prices the same run and marks it with the same reason
    from tenfold import capabilities

    assert capabilities.problems(resolve_run(cfg, world, check=False)) == [str(e.value)]
    return str(e.value)


@pytest.mark.parametrize("world, parallel, needle", [
    (4, {"zero_stage": 3, "shard_group_size": 3}, "must divide the 4 data-parallel ranks (world / (pp x tp)) and be at "
                                                  "least 2; allowed: 2, 4"),
    (4, {"zero_stage": 3, "shard_group_size": 1}, "be at least 2"),
    (8, {"zero_stage": 3, "shard_group_size": 4, "tp_degree": 4}, "must divide the 2 data-parallel ranks"),
    (4, {"zero_stage": 1, "shard_group_size": 2}, "needs --zero 2 or 3, got 1"),
    (4, {"zero_stage": 0, "shard_group_size": 2}, "needs --zero 2 or 3, got 0"),
])
def test_bad_shard_groups_are_refused_by_train_and_plan_alike(world, parallel, needle):
    assert needle in _refusal(world, **parallel)


def test_shard_group_sizes_that_run():
    for world, parallel in ((4, {"zero_stage": 3, "shard_group_size": 2}), (4, {"zero_stage": 2, "shard_group_size": 4}),
                            (8, {"zero_stage": 3, "shard_group_size": 2, "tp_degree": 2}),
                            (8, {"zero_stage": 3, "shard_group_size": 2, "pp_degree": 2})):
        run = resolve_run(build_config({"parallel": parallel, "train": {"grad_accum": 2}}), world)
        group = parallel["shard_group_size"]
        assert run.shard_group == (None if group == run.dp else group) == run.layout()["shard_group"]  # dp: plain ZeRO
    assert resolve_run(build_config({}), 4).shard_group is None


def test_the_mesh_splits_dp_into_replicate_x_shard():
    """The engine's own meshes (tenfold.layout.build_mesh, build_hybrid_mesh) for pp 2 x dp 8 x tp 2 in
    shard groups of 2, on rank 5 of torch's fake process group of 32: the dp ranks of rank 5
    are 1, 3, ..., 15 (tp 2 inside them); the shard group is 2 neighbouring dp ranks (one node
    holds shard x tp ranks), replicated across the 4 groups. Mutations: the two dimensions
    swapped, or the group sizes swapped (4 x 2 for 2 x 4) -> other ranks."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tenfold.engine.parallel.distributed import DistInfo
    from tenfold.layout import build_hybrid_mesh, build_layout, build_mesh

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=32)
    try:
        layout = build_layout(32, pp=2, tp=2, shard_group=2)
        mesh = build_mesh(layout, "cpu")
        assert mesh["dp"].mesh.tolist() == [1, 3, 5, 7, 9, 11, 13, 15]
        hybrid = build_hybrid_mesh(layout, mesh)
        assert hybrid.mesh_dim_names == ("dp_replicate", "dp_shard") and tuple(hybrid.mesh.shape) == (4, 2)
        assert hybrid["dp_shard"].mesh.tolist() == [5, 7]  # rank 5 shards with its dp neighbour
        assert hybrid["dp_replicate"].mesh.tolist() == [1, 5, 9, 13]  # and replicates across groups
        assert dist.get_process_group_ranks(hybrid["dp_shard"].get_group()) == [5, 7]
        assert DistInfo(dp_size=8, shard_size=2, hybrid_mesh=hybrid).hybrid
        assert not DistInfo(dp_size=8, shard_size=8).hybrid and not DistInfo().hybrid
    finally:
        dist.destroy_process_group()


def test_dry_run_names_the_shard_groups_and_the_offload(capsys):
    from tenfold.cli import main

    assert main(["train", "--nproc", "8", "--zero", "3", "--shard-group", "4", "--offload", "optimizer", "--dry-run"]) == 0
    assert "ZeRO-3 in shard groups of 4; recompute none; offload optimizer" in capsys.readouterr().out
    assert main(["train", "--nproc", "8", "--zero", "3", "--shard-group", "8", "--dry-run"]) == 0
    assert "ZeRO-3; recompute" in capsys.readouterr().out  # a group of every dp rank is plain ZeRO-3
