"""Expert parallelism (`--ep N`): each MoE layer's routed experts split over N ranks, tokens sent to
the rank of their expert and back with all-to-all (GShard, Lepikhin et al. 2020, section 2.2;
torchtitan's ExpertParallel).

The ep ranks are borrowed from the data-parallel ranks, as torchtitan does: the dp axis of the
device mesh is viewed as (dp / ep, ep) (`tenfold.layout.build_expert_mesh`); ranks of one ep
group hold different experts and exchange tokens, ranks with the same ep index hold the same
experts and average their gradients.

  * the expert weights become DTensors sharded on the expert dimension over the ep mesh
    (Shard(0)), so a checkpoint (DCP) holds each expert once and reloads on another ep size;
  * dispatch: tokens sorted by expert, split sizes exchanged, one all-to-all there, the local
    experts' grouped GEMM, one all-to-all back (`_AllToAll` is its own backward with the splits
    swapped);
  * ZeRO-2/3 shard the expert weights further over the ranks that hold the same experts
    ("dp_mod_ep"; torchtitan's FSDP over dp_shard_mod_ep): each experts module is its own FSDP2
    unit on that mesh (`tenfold.techniques.zero`), so a rank keeps 1/dp of every expert's weight,
    gradient and AdamW states, as it does of the dense weights. Stages 0/1 (DDP) and replicated
    tensor-parallel runs leave the expert weights alone (DDP ignores them, `replicate` gets them as
    `ignored_params`): they stay whole on each replica.
  * the reduction: each rank's loss is already scaled by dp / global tokens
    (tenfold.techniques.accumulation), and an expert's gradient on one rank holds the tokens of
    its whole ep group, so the SUM over the dp / ep replicas holds every token once, dp times.
    `reduce_expert_gradients` divides that sum by dp: whole experts are summed by an all-reduce
    over the replicas first; sharded ones come out of FSDP2's reduce-scatter as the replicas'
    AVERAGE (sum / (dp / ep)), which leaves a division by ep.

Beside a pipeline, each stage's dp ranks form its ep groups (the dp axis of that stage's mesh);
beside tensor parallelism, each tp rank's (the MoE layers are whole on every tp rank,
`tensor_parallel.gpt_plan`, and see the same tokens: no sequence parallelism), so the tp ranks
hold the same experts, compute the same gradients and reduce them over their own ep replicas.

Hugging Face MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE: `hf_expert_modules`) hold their routed
experts as one module with 3-D `gate_up_proj` (E, 2I, d) and `down_proj` (E, d, I) parameters,
called with the router's (tokens, k) choices and weights; under ep those two become Shard(0)
DTensors and the module's forward is `HFExpertParallelForward`: the same exchange, each local
expert's two matmuls as transformers' own loop runs them, each token's k outputs summed in
expert order as that loop sums them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tenfold.models.moe import MoE, moe_layers, sort_by_expert


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; its gradient goes back the same way, splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertParallelDispatch:
    """MoE.dispatch over an ep group (replaces `tenfold.models.moe.local_dispatch`)."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def __call__(self, moe: MoE, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        order, kept = sort_by_expert(chosen, counts, moe.capacity(h.shape[0]))
        token = order // moe.top_k
        local = moe.n_experts // self.size
        # rows for each (destination rank, its local expert); then what each source sends us
        send_counts = kept.reshape(self.size, local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        send_splits = send_counts.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = all_to_all(h[token], recv_splits, send_splits, self.group)
        # received rows come by source rank, then expert: regroup them by local expert (row i's
        # (source, expert) slot is repeat_interleave's index, its expert that slot mod `local`;
        # derived from the counts alone)
        expert_of_row = torch.repeat_interleave(recv_counts.reshape(-1)) % local
        regroup = torch.argsort(expert_of_row, stable=True)
        y = moe.experts(received[regroup], recv_counts.sum(0))
        y = y[torch.argsort(regroup)]
        y = all_to_all(y, send_splits, recv_splits, self.group)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros(h.shape, dtype=y.dtype, device=h.device).index_add(0, token, y)


HF_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def hf_expert_modules(model: nn.Module) -> list[nn.Module]:
    """A Hugging Face model's routed-expert modules (MixtralExperts, Qwen2MoeExperts,
    Qwen3MoeExperts: `num_experts` and the 3-D weights of HF_EXPERT_WEIGHTS); [] for other models."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "num_experts", None), int) and not isinstance(m, MoE)
            and all(isinstance(getattr(m, n, None), nn.Parameter) and getattr(m, n).dim() == 3 for n in HF_EXPERT_WEIGHTS)]


class HFExpertParallelForward:
    """The forward of a Hugging Face experts module whose weights expert parallelism split:
    (tokens, d) rows, the router's (tokens, k) expert indices and weights -> (tokens, d)."""

    def __init__(self, module: nn.Module, group, size: int):
        self.module, self.group, self.size = module, group, size

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        m, size = self.module, self.size
        local, k = m.num_experts // size, top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        counts = torch.bincount(chosen, minlength=m.num_experts)
        order = torch.argsort(chosen, stable=True)  # by expert, then token: transformers' per-token order
        token = order // k
        send_counts = counts.reshape(size, local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        received = all_to_all(hidden_states[token], recv_splits, send_splits, self.group)
        regroup = torch.argsort(torch.repeat_interleave(recv_counts.reshape(-1)) % local, stable=True)
        rows = received[regroup]
        gate_up, down = (getattr(m, n).to_local() for n in HF_EXPERT_WEIGHTS)
        outs, start = [], 0
        for e, n in enumerate(recv_counts.sum(0).tolist()):
            gate, up = F.linear(rows[start:start + n], gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(m.act_fn(gate) * up, down[e]))
            start += n
        y = torch.cat(outs)[torch.argsort(regroup)]
        y = all_to_all(y, send_splits, recv_splits, self.group)
        y = y * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add(0, token, y.to(hidden_states.dtype))


def split_expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding the routed experts that expert parallelism split (`apply_expert_parallel`):
    ZeRO-2/3 make each one its own FSDP2 unit over the ranks holding the same experts. None
    without ep: there the experts are data-parallel weights like any other."""
    ours = [m.experts for m in moe_layers(model) if isinstance(m.dispatch, ExpertParallelDispatch)]
    return ours + [m for m in hf_expert_modules(model) if isinstance(m.__dict__.get("forward"), HFExpertParallelForward)]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' weights that expert parallelism split: what DDP and `replicate` skip and
    `reduce_expert_gradients` reduces (`split_expert_modules`' parameters)."""
    return [p for m in split_expert_modules(model) for p in m.parameters()]


def _shard_experts(module: nn.Module, names, ep_mesh) -> None:
    for name in names:
        param = getattr(module, name)
        sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=0)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def apply_expert_parallel(model: nn.Module, ep_mesh) -> None:
    """Split every MoE layer's experts over `ep_mesh` (1-D): each weight a DTensor Shard(0) made
    from global rank-0's full tensor (so the split model is the one a single process builds),
    the layer's dispatch over the ep group (a Hugging Face experts module: its forward)."""
    size = ep_mesh.size()
    dispatch = ExpertParallelDispatch(ep_mesh.get_group(), size)
    for moe in moe_layers(model):
        _shard_experts(moe.experts, [n for n, _ in moe.experts.named_parameters(recurse=False)], ep_mesh)
        moe.dispatch = dispatch
    for module in hf_expert_modules(model):
        _shard_experts(module, HF_EXPERT_WEIGHTS, ep_mesh)
        module.forward = HFExpertParallelForward(module, ep_mesh.get_group(), size)


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module, replica_group, dp_size: int, averaged_by_fsdp: bool) -> None:
    """Expert gradients divided by dp from their sum over the ranks holding the same experts (see
    the module docstring). `averaged_by_fsdp`: FSDP2 shards the experts (ZeRO-2/3) and has
    averaged them over those ranks; otherwise they are whole and are summed here over
    `replica_group` (None when there is one such rank)."""
    replicas = replica_group.size() if replica_group is not None else 1
    for p in expert_params(model):
        if p.grad is None:
            continue
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if averaged_by_fsdp:
            local.div_(dp_size // replicas)  # average x replicas / dp = sum / dp
            continue
        if replica_group is not None:
            dist.all_reduce(local, group=replica_group)
        local.div_(dp_size)
