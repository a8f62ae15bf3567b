"""tenfold.layout: the degrees of a run, their rules and messages, and the torch mesh made from
them (on a gloo world of one process and on torch's fake process group of 64 ranks)."""

from __future__ import annotations

import contextlib

import pytest

from tenfold.errors import UserError
from tenfold.layout import MESH_ORDER, Layout, build_layout


@pytest.mark.parametrize("world, pp, tp, group, cp, degrees", [
    (1, 1, 1, None, 1, (1, 1, 1, 1, 1)),
    (8, 2, 2, None, 1, (2, 1, 2, 1, 2)),
    (64, 2, 4, None, 1, (2, 1, 8, 1, 4)),
    (64, 2, 4, 2, 1, (2, 4, 2, 1, 4)),  # 8 dp ranks in shard groups of 2: 4 replicas
    (64, 2, 4, 8, 1, (2, 1, 8, 1, 4)),  # one group of every dp rank: no split
    (64, 2, 4, 3, 1, (2, 1, 8, 1, 4)),  # a group that cannot split dp leaves it whole (capabilities refuses it)
    (64, 1, 4, None, 4, (1, 1, 4, 4, 4)),  # cp splits the data ranks: 16 / 4
    (64, 1, 2, 2, 2, (1, 8, 2, 2, 2)),  # dp 16 in shard groups of 2 (8 replicas), each dp rank 2 cp ranks
])
def test_degrees_multiply_to_the_world(world, pp, tp, group, cp, degrees):
    layout = build_layout(world, pp, tp, group, cp=cp)
    assert tuple(layout.degrees().values()) == degrees and tuple(layout.degrees()) == MESH_ORDER
    assert layout.world_size == world and layout.dp == degrees[1] * degrees[2]
    assert layout.cp == cp and layout.grad_ranks == layout.dp * cp
    assert layout.hybrid == (degrees[1] > 1)
    # the torch mesh's "dp" holds every rank that reduces the same gradients: dp x cp
    assert layout.mesh_dim_names == ("pp", "dp", "tp") and layout.mesh_shape == (pp, layout.dp * cp, tp)


def test_enabled_names_the_dimensions_with_more_than_one_rank():
    assert Layout().enabled() == ()
    assert build_layout(64, 2, 4, 2).enabled() == ("pp", "dp_replicate", "dp_shard", "tp")
    assert build_layout(8, 1, 2).enabled() == ("dp_shard", "tp")
    assert build_layout(8, 1, 2, cp=2).enabled() == ("dp_shard", "cp", "tp")
    assert build_layout(4, 1, 1, cp=4).enabled() == ("cp",)


@pytest.mark.parametrize("world, pp, tp, cp, message", [
    (12, 1, 8, 1, "parallel.pp_degree (--pp) 1 x parallel.cp_degree (--cp) 1 x parallel.tp_degree (--tp) 8 = 8 must "
                  "divide the number of processes (12); world = pp x dp x cp x tp"),
    (3, 2, 1, 1, "= 2 must divide the number of processes (3)"),
    (8, 1, 2, 3, "parallel.cp_degree (--cp) 3 x parallel.tp_degree (--tp) 2 = 6 must divide the number of processes (8)"),
    (4, 0, 1, 1, "parallel.pp_degree (--pp) must be a positive integer, got 0"),
    (4, 1, True, 1, "parallel.tp_degree (--tp) must be a positive integer, got True"),
    (4, 1, 2.0, 1, "parallel.tp_degree (--tp) must be a positive integer, got 2.0"),
    (4, 1, 1, 0, "parallel.cp_degree (--cp) must be a positive integer, got 0"),
    (0, 1, 1, 1, "the number of processes must be a positive integer, got 0"),
])
def test_bad_degrees_are_refused_by_name(world, pp, tp, cp, message):
    with pytest.raises(UserError) as e:
        build_layout(world, pp, tp, cp=cp)
    assert message in str(e.value)


def test_ep_splits_the_data_parallel_ranks_without_multiplying_the_world():
    layout = build_layout(16, pp=2, tp=2, ep=2)
    assert layout == Layout(pp=2, dp_replicate=1, dp_shard=4, tp=2, ep=2)
    assert layout.world_size == 16 and layout.dp == 4 and layout.dp_mod_ep == 2
    assert tuple(layout.degrees()) == MESH_ORDER and layout.mesh_shape == (2, 4, 2)  # ep is a view of dp
    assert layout.enabled() == ("pp", "dp_shard", "tp", "ep")
    assert build_layout(8, ep=8).dp_mod_ep == 1


@pytest.mark.parametrize("world, pp, tp, ep, message", [
    (12, 1, 2, 4, "parallel.ep_degree (--ep) 4 must divide the 6 data-parallel ranks (world / (pp x cp x tp)): "
                  "expert parallelism splits the data-parallel ranks; allowed: 1, 2, 3, 6"),
    (4, 2, 1, 4, "parallel.ep_degree (--ep) 4 must divide the 2 data-parallel ranks"),
    (4, 1, 1, 0, "parallel.ep_degree (--ep) must be a positive integer, got 0"),
    (4, 1, 1, True, "parallel.ep_degree (--ep) must be a positive integer, got True"),
])
def test_bad_ep_degrees_are_refused_by_name(world, pp, tp, ep, message):
    with pytest.raises(UserError) as e:
        build_layout(world, pp, tp, ep=ep)
    assert message in str(e.value)


def test_the_resolver_takes_its_degrees_from_the_layout():
    """The run's pp/dp/tp/world are the layout's; the resolver's messages are the layout's."""
    from tenfold.models.presets import get_preset
    from tenfold.run import resolve

    run = resolve(get_preset("tiny"), 8, pp=2, zero_stage=3, shard_group=2, micro_batch=1, global_batch=8)
    assert run.dims == Layout(pp=2, dp_replicate=2, dp_shard=2, tp=1)
    assert (run.world_size, run.pp, run.dp, run.tp, run.shard_size, run.replicas) == (8, 2, 4, 1, 2, 2)
    with pytest.raises(UserError, match=r"= 2 must divide the number of processes \(3\)"):
        resolve(get_preset("tiny"), 3, pp=2)
    run = resolve(get_preset("tiny"), 8, cp=2, tp=2, zero_stage=3, micro_batch=1, global_batch=4, seq_len=64)
    assert run.dims == Layout(dp_shard=2, cp=2, tp=2)
    assert (run.dp, run.cp, run.grad_ranks, run.shard_size) == (2, 2, 4, 4)


def test_a_gloo_world_of_one_has_a_mesh_of_ones():
    import torch.distributed as dist

    from tenfold.layout import build_hybrid_mesh, build_mesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layout = build_layout(1)
        mesh = build_mesh(layout, "cpu")
        assert mesh.mesh_dim_names == ("pp", "dp", "tp") and tuple(mesh.mesh.shape) == (1, 1, 1)
        assert build_hybrid_mesh(layout, mesh) is None
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """This process as `rank` of torch's fake process group (collectives do nothing)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_fake_world_of_64_splits_dp_into_replicas_of_shard_groups():
    """pp 2 x (dp_replicate 2 x dp_shard 4) x tp 4 on rank 37 of torch's fake process group:
    tp is innermost (ranks 36..39), the dp ranks of rank 37 are 33, 37, ..., 61, and the shard
    group is 4 neighbouring dp ranks, replicated across 2 groups. Mutations: MESH_ORDER with dp
    and tp swapped, or replicate and shard swapped -> other ranks."""
    from tenfold.layout import build_hybrid_mesh, build_mesh

    with fake_world(37, 64):
        layout = build_layout(64, pp=2, tp=4, shard_group=4)
        mesh = build_mesh(layout, "cpu")
        assert mesh.mesh_dim_names == ("pp", "dp", "tp") and tuple(mesh.mesh.shape) == (2, 8, 4)
        assert mesh["tp"].mesh.tolist() == [36, 37, 38, 39]
        assert mesh["dp"].mesh.tolist() == [33, 37, 41, 45, 49, 53, 57, 61]
        assert mesh["pp"].mesh.tolist() == [5, 37]
        assert mesh["dp_tp"].mesh.tolist() == list(range(32, 64))  # flattened for the gradient norm
        hybrid = build_hybrid_mesh(layout, mesh)
        assert hybrid.mesh_dim_names == ("dp_replicate", "dp_shard") and tuple(hybrid.mesh.shape) == (2, 4)
        assert hybrid["dp_shard"].mesh.tolist() == [33, 37, 41, 45]
        assert hybrid["dp_replicate"].mesh.tolist() == [37, 53]


def test_a_fake_world_of_64_splits_the_gradient_ranks_into_data_and_cp():
    """pp 2 x (dp_replicate 2 x dp_shard 2) x cp 2 x tp 4 on rank 37 of torch's fake process
    group: the mesh's "dp" holds the 8 dp x cp ranks that reduce the same gradients (33, 37, ...,
    61), cp is its inner part (the neighbours 33 and 37), and a shard group is dp_shard x cp = 4
    of them. Mutations: cp outside dp in the split, or the shard group without cp -> other ranks."""
    from tenfold.layout import build_context_parallel_mesh, build_hybrid_mesh, build_mesh

    with fake_world(37, 64):
        layout = build_layout(64, pp=2, tp=4, shard_group=2, cp=2)
        assert layout == Layout(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=4)
        mesh = build_mesh(layout, "cpu")
        assert mesh.mesh_dim_names == ("pp", "dp", "tp") and tuple(mesh.mesh.shape) == (2, 8, 4)
        assert mesh["dp"].mesh.tolist() == [33, 37, 41, 45, 49, 53, 57, 61]
        assert build_context_parallel_mesh(layout, mesh).mesh.tolist() == [33, 37]
        hybrid = build_hybrid_mesh(layout, mesh)
        assert hybrid["dp_shard"].mesh.tolist() == [33, 37, 41, 45]
        assert hybrid["dp_replicate"].mesh.tolist() == [37, 53]
        assert build_context_parallel_mesh(build_layout(64, pp=2, tp=4), mesh) is None


def test_a_fake_world_of_64_groups_neighbouring_dp_ranks_into_ep_groups():
    """pp 2 x dp 8 x tp 4 with ep 4 on rank 37 (dp ranks 33, 37, ..., 61, dp index 1): its ep
    group is dp indices 0-3, the ranks holding its experts are dp indices 1 and 5. Mutation:
    EP_DIMS in the other order -> ep over strided dp ranks."""
    from tenfold.layout import build_expert_mesh, build_mesh

    with fake_world(37, 64):
        layout = build_layout(64, pp=2, tp=4, ep=4)
        mesh = build_mesh(layout, "cpu")
        assert mesh["dp"].mesh.tolist() == [33, 37, 41, 45, 49, 53, 57, 61]
        experts = build_expert_mesh(layout, mesh)
        assert experts.mesh_dim_names == ("dp_mod_ep", "ep") and tuple(experts.mesh.shape) == (2, 4)
        assert experts["ep"].mesh.tolist() == [33, 37, 41, 45]
        assert experts["dp_mod_ep"].mesh.tolist() == [37, 53]
        assert build_expert_mesh(build_layout(64, pp=2, tp=4), mesh) is None


def test_expert_and_context_parallelism_together_are_refused():
    with pytest.raises(UserError, match=r"parallel.ep_degree \(--ep\) 2 with parallel.cp_degree \(--cp\) 2"):
        build_layout(8, cp=2, ep=2)


def test_the_resolver_checks_ep_against_the_model():
    from tenfold.models.presets import get_preset
    from tenfold.run import resolve

    run = resolve(get_preset("tiny-moe"), 4, ep=2, micro_batch=1, global_batch=4)
    assert run.ep == 2 and run.dims.ep == 2 and run.dp == 4
    assert "experts over ep 2" in run.layout_line()
    with pytest.raises(UserError, match=r"parallel.ep_degree \(--ep\) 2 needs a mixture-of-experts model"):
        resolve(get_preset("tiny"), 4, ep=2)
    n = get_preset("tiny-moe").n_experts
    with pytest.raises(UserError, match=rf"must divide model.n_experts \({n}\)"):
        resolve(get_preset("tiny-moe"), 4 * (n + 1), ep=n + 1)


def test_the_engine_maps_every_reduce_dtype_and_offload_the_resolver_allows():
    """The value lists live in tenfold.terms; the engine's tables cover exactly them."""
    from tenfold.capabilities import ENGINE
    from tenfold.config import ParallelSection
    from tenfold.techniques.zero import TORCH_REDUCE_DTYPES
    from tenfold.terms import OFFLOADS, REDUCE_DTYPES

    assert tuple(TORCH_REDUCE_DTYPES) == REDUCE_DTYPES
    assert ENGINE.offload == OFFLOADS
    for value in OFFLOADS:
        assert ParallelSection(offload=value).offload == value


def test_the_engine_refuses_a_layout_that_does_not_span_the_job(monkeypatch):
    """engine.distributed.join_layout: the layout's world is the job's (one process here)."""
    from tenfold.engine.parallel.distributed import join_layout

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(UserError, match="the layout pp 2 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 1 spans 2 processes, "
                                        "the job has 1"):
        join_layout(build_layout(2, pp=2))
    assert join_layout(build_layout(1)).world_size == 1
