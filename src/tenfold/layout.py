"""The parallel layout of a run: how many ranks each mesh dimension has, the rules those
degrees obey, and the torch device mesh made from them (torchtitan's `ParallelDims` plays the
same part). The resolver (tenfold.run), the engine (tenfold.engine.parallel.distributed) and the
planner's search (tenfold.plan.search) all take their degrees from here.

Dimensions, outermost first (`MESH_ORDER`): pipeline stages, data-parallel replicas of a shard
group, data-parallel ranks of a shard group, context-parallel ranks, tensor-parallel ranks. tp
is innermost and contiguous (its collectives run in every layer: its ranks must share a node),
then cp (the attention's K/V all-gather, every layer), then dp, then pp (Megatron-LM's and
torchtitan's order). The two data-parallel degrees multiply into dp. The cp ranks of one dp rank
train the same parameters on other tokens of the same rows, so the torch mesh keeps dp x cp as
one "dp" dimension (`mesh_dim_names`: every rank that reduces the same gradients), split into
("dp_replicate", "dp_shard") only under hybrid sharding (`build_hybrid_mesh`) and into
("dp_data", "cp") only under context parallelism (`build_context_parallel_mesh`).

Expert parallelism (`ep`, `SPLIT_DIMS`) is no factor of the world: it splits the data-parallel
ranks (torchtitan borrows its ep ranks from data parallelism the same way), so ep divides dp.
Its mesh (`build_expert_mesh`) views the "dp" dimension as ("dp_mod_ep", "ep"), ep innermost:
consecutive dp ranks form one ep group, which splits each MoE layer's experts and exchanges its
tokens by all-to-all; "dp_mod_ep" joins the ranks that hold the same experts.

A new mesh dimension touches: a field of `Layout` and its place in `MESH_ORDER` (its degree
then enters `world_size`, the mesh shape and names, the divisibility rule and its message) or,
for one that splits another dimension's ranks, in `SPLIT_DIMS` (with its view of the mesh),
its keyword in `build_layout` plus any rule of its own there, one row of the run's choice table
(tenfold.choices: config key, flag, default), and the technique that uses the dimension.

No torch at import: `tenfold plan` builds layouts without it (`build_mesh` imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tenfold.choices import BY_NAME
from tenfold.errors import UserError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first
DP_DIMS = ("dp_replicate", "dp_shard")  # the data-parallel degrees: dp = their product
GRAD_DIMS = DP_DIMS + ("cp",)  # one "dp" dimension of the torch mesh: the ranks that reduce the same gradients
# Dimensions that split the ranks of a MESH_ORDER one instead of multiplying the world:
# {dimension: the mesh dimension it splits}.
SPLIT_DIMS = {"ep": "dp"}
EP_DIMS = ("dp_mod_ep", "ep")  # the expert view of "dp" (`build_expert_mesh`), ep innermost
# The degrees a user sets (the data-parallel ones follow from the world), named as every
# message says them: config key (flag), from the run-choice table.
DEGREE_FLAGS = {name: f"{BY_NAME[name].key} ({BY_NAME[name].flag})"
                for name in (*MESH_ORDER, *SPLIT_DIMS) if name not in DP_DIMS}


@dataclass(frozen=True)
class Layout:
    """Degrees of every mesh dimension; world_size is their product."""

    pp: int = 1  # pipeline stages
    dp_replicate: int = 1  # copies of each shard group (hybrid sharding); 1 otherwise
    dp_shard: int = 1  # data-parallel ranks in a shard group: every dp rank unless hybrid
    cp: int = 1  # context-parallel ranks: each sequence split over them (techniques/context_parallel.py)
    tp: int = 1  # tensor-parallel ranks
    ep: int = 1  # expert-parallel ranks: each MoE layer's experts split over ep of the dp ranks (ep divides dp)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: replicas x shard group."""
        return self.dp_replicate * self.dp_shard

    @property
    def grad_ranks(self) -> int:
        """Ranks that hold the same parameters and reduce their gradients together: dp x cp (the
        cp ranks train on other tokens of the same rows; torchtitan shards over dp_shard x cp).
        The torch mesh's "dp" dimension."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, name) for name in MESH_ORDER)

    @property
    def hybrid(self) -> bool:
        """Hybrid sharding: groups of dp_shard ranks shard, the groups replicate."""
        return self.dp_replicate > 1

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The torch mesh's dimensions: MESH_ORDER with the data-parallel pair and cp as one "dp"."""
        names: list[str] = []
        for name in MESH_ORDER:
            name = "dp" if name in GRAD_DIMS else name
            if name not in names:
                names.append(name)
        return tuple(names)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.grad_ranks if name == "dp" else getattr(self, name) for name in self.mesh_dim_names)

    @property
    def dp_mod_ep(self) -> int:
        """Ranks holding the same experts: the dp ranks over the ep group."""
        return self.dp // self.ep

    def degrees(self) -> dict[str, int]:
        """{dimension: ranks} in MESH_ORDER (their product is the world)."""
        return {name: getattr(self, name) for name in MESH_ORDER}

    def enabled(self) -> tuple[str, ...]:
        """The dimensions with more than one rank, in MESH_ORDER, then the splitting ones (ep)."""
        return tuple(name for name in (*MESH_ORDER, *SPLIT_DIMS) if getattr(self, name) > 1)


def check_degree_values(world_size: object, **degrees: object) -> None:
    """Each degree (and the number of processes) is a positive integer."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UserError(f"the number of processes must be a positive integer, got {world_size!r}")
    for name, v in degrees.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"{DEGREE_FLAGS[name]} must be a positive integer, got {v!r}")


def shard_group_problem(dp: int, shard_group: int | None) -> str | None:
    """Why `shard_group` dp ranks cannot form the shard groups of `dp` ranks (None: they can)."""
    if shard_group is None or (shard_group >= 2 and dp % shard_group == 0):
        return None
    allowed = ", ".join(str(d) for d in range(2, dp + 1) if dp % d == 0) or "none"
    return (f"parallel.shard_group_size {shard_group} (--shard-group) must divide the {dp} data-parallel ranks "
            f"(world / (pp x tp)) and be at least 2; allowed: {allowed}")


def ep_problem(dp: int, ep: int, cp: int = 1) -> str | None:
    """Why `ep` expert-parallel ranks cannot split `dp` data-parallel ranks (None: they can)."""
    if ep > 1 and cp > 1:
        return (f"{DEGREE_FLAGS['ep']} {ep} with {DEGREE_FLAGS['cp']} {cp}: expert parallelism splits the "
                f"data-parallel ranks and context parallelism shares them, and the two are not composed; "
                f"allowed: one of them above 1")
    if dp % ep == 0:
        return None
    allowed = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0)
    return (f"{DEGREE_FLAGS['ep']} {ep} must divide the {dp} data-parallel ranks (world / (pp x cp x tp)): "
            f"expert parallelism splits the data-parallel ranks; allowed: {allowed}")


def build_layout(world_size: int, pp: int = 1, tp: int = 1, shard_group: int | None = None, cp: int = 1,
                 ep: int = 1) -> Layout:
    """The layout of `world_size` processes: pp, cp and tp as given, data parallelism over the
    rest (world = pp x dp x cp x tp); hybrid sharding splits dp into replicas x groups of
    `shard_group`; expert parallelism splits dp into groups of `ep` (`ep_problem`: ep divides
    dp).
    Refuses (UserError) degrees that are not positive integers or do not divide the world. A
    shard group that cannot split dp (`shard_group_problem`, which tenfold.capabilities reports
    among the run's problems) leaves dp unsplit."""
    given = {"pp": pp, "cp": cp, "tp": tp}
    check_degree_values(world_size, **given, ep=ep)
    model_parallel = math.prod(given.values())
    if world_size % model_parallel:
        product = " x ".join(f"{DEGREE_FLAGS[name]} {v}" for name, v in given.items())
        raise UserError(f"{product} = {model_parallel} must divide the number of processes ({world_size}); "
                        f"world = {' x '.join(_world_terms())}")
    dp = world_size // model_parallel
    shard = dp if shard_group is None or shard_group_problem(dp, shard_group) else shard_group
    problem = ep_problem(dp, ep, cp)
    if problem:
        raise UserError(problem)
    return Layout(pp=pp, dp_replicate=dp // shard, dp_shard=shard, cp=cp, tp=tp, ep=ep)


def _world_terms() -> list[str]:
    """MESH_ORDER with the data-parallel pair as "dp": ["pp", "dp", "cp", "tp"]."""
    terms: list[str] = []
    for name in MESH_ORDER:
        name = "dp" if name in DP_DIMS else name
        if name not in terms:
            terms.append(name)
    return terms


def build_mesh(layout: Layout, device_type: str):
    """The torch DeviceMesh of `layout` over the default process group, dimensions
    `layout.mesh_dim_names` (("pp", "dp", "tp")). Under tensor and data parallelism together
    ("dp", "tp") is also flattened to "dp_tp": FSDP2 on the dp axis of tp-split parameters gives
    2-D (dp, tp) DTensors, and a reduction over both (the gradient norm) is then one all-reduce
    on that group instead of two in a row (torchtitan flattens its data-parallel dims the same
    way)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=layout.mesh_dim_names)
    if layout.grad_ranks > 1 and layout.tp > 1:
        mesh["dp", "tp"]._flatten("dp_tp")
    return mesh


def build_hybrid_mesh(layout: Layout, mesh):
    """Hybrid sharding: the "dp" dimension of `mesh` split into ("dp_replicate", "dp_shard"), a
    group of `layout.dp_shard` neighbouring dp ranks that shard, the groups replicating; None
    without hybrid sharding. "dp_shard" is the inner dimension, so when a node holds dp_shard x
    tp ranks the sharding collectives stay on the node and only the replicas' gradient
    all-reduce crosses nodes (PyTorch HSDP; torchtitan's dp_replicate x dp_shard). Under context
    parallelism a shard group is dp_shard x cp ranks (the cp ranks of a dp rank hold the same
    parameters). `mesh` stays as it is: whatever reduces over every data-parallel rank (loss,
    token count) reads "dp"."""
    if not layout.hybrid:
        return None
    return mesh["dp"]._unflatten(0, (layout.dp_replicate, layout.dp_shard * layout.cp), DP_DIMS)


def build_context_parallel_mesh(layout: Layout, mesh):
    """Context parallelism: the "dp" dimension of `mesh` (dp x cp ranks) split into ("dp_data",
    "cp"), the cp ranks of one dp rank neighbours (the inner dimension, MESH_ORDER), so that the
    attention's K/V all-gather stays among close ranks (torchtitan's order: dp_replicate,
    dp_shard, cp, tp); None without context parallelism. The gradient reduction, the loss and
    the token count keep reading "dp" (every rank that trains the same parameters); the data
    order reads dp_rank // cp (tenfold.engine.parallel.distributed.DistInfo.data_rank). Returns the 1-D
    "cp" mesh."""
    if layout.cp <= 1:
        return None
    return mesh["dp"]._unflatten(0, (layout.dp, layout.cp), ("dp_data", "cp"))["cp"]


def build_expert_mesh(layout: Layout, mesh):
    """Expert parallelism: the "dp" dimension of `mesh` viewed as `EP_DIMS` ("dp_mod_ep", "ep"),
    groups of `layout.ep` consecutive dp ranks. "ep" splits each MoE layer's experts and carries
    its token all-to-all; "dp_mod_ep" joins the ranks holding the same experts (their gradient
    reduction). None without expert parallelism (never with context parallelism: `ep_problem`);
    `mesh` stays as it is."""
    if layout.ep <= 1:
        return None
    return mesh["dp"]._unflatten(0, (layout.dp_mod_ep, layout.ep), EP_DIMS)
