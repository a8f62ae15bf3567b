"""Mixture-of-experts feed-forward layer: token-choice top-k routing, routed SwiGLU experts computed
with one grouped GEMM, optional shared experts, and the router's load-balancing terms.

Routing (Shazeer et al. 2017; GShard, Lepikhin et al. 2020): each token's router scores are a
softmax over the experts; the token goes to its k highest-scoring experts and its output is the
score-weighted sum of theirs (scores renormalised over the k chosen, Mixtral's rule, unless
`router_norm_topk` is off, Qwen2-MoE's default).

Balance, two ways:
  * the auxiliary loss of Switch Transformers (Fedus et al. 2021, eq. 4-6) in GShard's top-k form:
    aux = E * sum_i f_i * P_i, f_i = share of the token->expert assignments that went to expert i,
    P_i = mean router probability of expert i; 1.0 when perfectly balanced. Its gradient joins the
    LM loss's (`with_router_aux_loss`) scaled by `router_aux_loss_coef` per target token, so the
    logged loss stays the language-model loss.
  * DeepSeek-V3's auxiliary-loss-free bias (Liu et al. 2024, section 2.1.2): a per-expert bias added
    to the scores for the choice of experts only (never to the weights); after each step it moves
    by `router_bias_rate` towards balance: b_i += rate * sign(mean load - load_i).

Dropless by default: every token reaches its k experts. With `capacity_factor` c > 0 each expert
takes at most ceil(c * T * k / E) of a micro-batch's T tokens, first come first served in token
order (GShard's capacity), and the overflow is dropped (the residual carries those tokens).

Experts run as one `torch._grouped_mm` over the tokens sorted by expert (torchtitan's MoE); a plain
loop over experts is the reference (`EXPERT_IMPL`, tests/test_moe.py holds the two equal).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tenfold.models.presets import ModelConfig

# "grouped" (one grouped GEMM) or "loop" (one matmul per expert, the reference).
EXPERT_IMPL = "grouped"


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm wants 16-byte aligned strides (dims that are multiples of 16 / element bytes)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and w.shape[-1] % align == 0 and w.shape[-2] % align == 0


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm's backward refuses a gradient with a zero stride (what `.sum().backward()`
    # feeds it), so its output hands on a contiguous one.
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """Rows of `x` (N, a), sorted by group, times their group's matrix of `w` (G, a, b): (N, b).
    `counts[g]` rows belong to group g."""
    impl = impl or EXPERT_IMPL
    if impl == "grouped" and _grouped_mm_ok(x, w):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return _contiguous_grad(torch._grouped_mm(x, w, offs=offsets))
    pieces = torch.split(x, counts.tolist())
    return torch.cat([piece @ w[g] for g, piece in enumerate(pieces)]) if pieces else x.new_zeros(0, w.shape[-1])


class RoutedExperts(nn.Module):
    """E SwiGLU experts as three stacked weights, w2(silu(x w1) * (x w3)) per expert (Shazeer 2020).
    Stacked (E, in, out) so one grouped GEMM runs all experts and ZeRO-3 / expert parallelism
    shard them along the expert dimension."""

    def __init__(self, n_experts: int, d_model: int, d_expert: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, d_expert))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, d_expert))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_expert, d_model))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x` (N, d): rows sorted by expert, `counts` (E_local,) rows per expert."""
        # under expert parallelism the weights are DTensors: this rank's experts are the local part
        w1, w3, w2 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w3, self.w2))
        if torch.is_autocast_enabled(x.device.type):  # grouped_mm is not on autocast's lists
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w1, w3, w2 = x.to(dtype), w1.to(dtype), w3.to(dtype), w2.to(dtype)
        h = F.silu(grouped_matmul(x, w1, counts)) * grouped_matmul(x, w3, counts)
        return grouped_matmul(h, w2, counts)


class SharedExperts(nn.Module):
    """DeepSeekMoE's always-on shared experts (Dai et al. 2024): one SwiGLU MLP of width
    n_shared * d_expert, which is what n_shared experts of width d_expert sum to."""

    def __init__(self, d_model: int, width: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, width, bias=False)
        self.w3 = nn.Linear(d_model, width, bias=False)
        self.w2 = nn.Linear(width, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _in_backward() -> bool:
    # True while autograd runs a backward pass: activation recompute replays the forward there,
    # and a replay must not count the router's load a second time.
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """(b, s, d) -> (b, s, d). After a training forward, `aux_loss` holds this layer's balance loss
    (a graph tensor, taken by `with_router_aux_loss`) and `load` the assignments per expert since
    the last `finish_router_step`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.norm_topk = cfg.router_norm_topk
        self.aux_coef, self.bias_rate, self.capacity_factor = (
            cfg.router_aux_loss_coef, cfg.router_bias_rate, cfg.capacity_factor)
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = RoutedExperts(cfg.n_experts, cfg.d_model, cfg.expert_dim)
        self.shared = SharedExperts(cfg.d_model, cfg.n_shared_experts * cfg.expert_dim) if cfg.n_shared_experts else None
        # Persistent: the aux-loss-free bias is training state, saved and resumed with the weights.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts), persistent=True)
        # A plain tensor, not a buffer: DDP broadcasts buffers from rank 0 before each forward.
        self.load = torch.zeros(cfg.n_experts)
        self.aux_loss: torch.Tensor | None = None
        # Expert parallelism (tenfold.techniques.expert_parallel) replaces this with its dispatcher.
        self.dispatch = local_dispatch

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router scores (T, E) in fp32, the chosen experts (T, k) and their weights (T, k)."""
        scores = self.router(h).float().softmax(dim=-1)
        choice = scores + self.expert_bias if self.bias_rate > 0 else scores
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return scores, chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = x.reshape(-1, d)
        scores, chosen, weights = self.route(h)
        counts = torch.bincount(chosen.reshape(-1), minlength=self.n_experts)
        if self.training and torch.is_grad_enabled():
            # computed in a recompute's replay too: it must save the tensors the forward saved
            aux = balance_loss(scores, counts) if self.aux_coef > 0 else None
            if not _in_backward():
                self.load = self.load.to(counts.device) + counts.detach().to(self.load.dtype)
                self.aux_loss = aux
        out = self.dispatch(self, h, chosen, weights, counts)
        if self.shared is not None:
            out = out + self.shared(h)
        return out.reshape(b, s, d).to(x.dtype)

    def capacity(self, n_tokens: int) -> int | None:
        if self.capacity_factor <= 0:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)


def balance_loss(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Switch/GShard: E * sum_i f_i P_i; f from the (non-differentiable) assignment counts, P the
    mean router probability, through which the gradient flows."""
    n_experts = scores.shape[-1]
    f = counts.to(scores.dtype) / counts.sum().clamp(min=1)
    return n_experts * (f * scores.mean(dim=0)).sum()


def sort_by_expert(chosen: torch.Tensor, counts: torch.Tensor, capacity: int | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments (flattened token*k + slot) sorted by expert, stable in token order, and the
    kept count per expert. With a capacity, each expert keeps its first `capacity` tokens."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    if capacity is None:
        return order, counts
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(order.numel(), device=order.device) - starts[flat[order]]
    return order[position < capacity], counts.clamp(max=capacity)


def local_dispatch(moe: MoE, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
    """All experts on this process: gather each assignment's token, run the experts, scale by the
    router weight, sum back into the tokens."""
    order, kept = sort_by_expert(chosen, counts, moe.capacity(h.shape[0]))
    token = order // moe.top_k
    y = moe.experts(h[token], kept)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros(h.shape, dtype=y.dtype, device=h.device).index_add(0, token, y)


# --------------------------------------------------------------------------- training hooks


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


class _AddAuxGrad(torch.autograd.Function):
    """Returns the loss unchanged; in backward, the aux loss receives the loss's gradient times
    `weight` (Megatron-Core's MoEAuxLossAutoScaler idea): the aux term follows every scaling the
    LM loss gets (global tokens, data-parallel size, fp16 loss scale) without entering its value."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad * ctx.weight, None


class _StageAuxGrad(torch.autograd.Function):
    """Returns a pipeline stage's output unchanged; in backward, the stage's balance losses receive
    `weight`, the constant gradient `_AddAuxGrad` hands them outside a pipeline (the micro-batch's
    target tokens times the gradient of its summed token loss): a stage before the last has no loss
    to carry them."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux_dtype = weight, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.weight, dtype=ctx.aux_dtype, device=grad.device), None


def with_stage_aux_loss(out: torch.Tensor, module: nn.Module, weight: float) -> torch.Tensor:
    """A pipeline stage's output carrying the balance losses of the stage's MoE layers (at their
    coef) with gradient `weight` (techniques/pipeline_runner.py: the micro-batch's target tokens
    x dp x loss scale / global tokens); `out` itself when no layer holds one."""
    layers = [m for m in moe_layers(module) if m.aux_loss is not None]
    if not layers:
        return out
    aux = sum(m.aux_coef * m.aux_loss for m in layers)
    for m in layers:
        m.aux_loss = None
    return _StageAuxGrad.apply(out, aux, float(weight))


def with_hf_router_aux_loss(loss_sum: torch.Tensor, aux: torch.Tensor | None, coef: float, n_targets: int) -> torch.Tensor:
    """A Hugging Face MoE model's balance loss (its output's `aux_loss`, present when the config
    sets output_router_logits) joining the gradient at `coef` (router_aux_loss_coef) per target
    token, as `with_router_aux_loss` does for tenfold's MoE layers; the value stays the LM loss."""
    if aux is None or not coef or not torch.is_grad_enabled():
        return loss_sum
    return _AddAuxGrad.apply(loss_sum, coef * aux, float(n_targets))


def with_router_aux_loss(loss_sum: torch.Tensor, model: nn.Module, n_targets: int) -> torch.Tensor:
    """`loss_sum` (a micro-batch's summed token losses) carrying the balance losses' gradients of the
    model's MoE layers at coef per target token: the token-weighted mean over the global batch."""
    layers = [m for m in moe_layers(model) if m.aux_loss is not None]
    if not layers or not torch.is_grad_enabled():
        for m in layers:
            m.aux_loss = None
        return loss_sum
    aux = sum(m.aux_coef * m.aux_loss for m in layers)
    for m in layers:
        m.aux_loss = None
    return _AddAuxGrad.apply(loss_sum, aux, float(n_targets))


@torch.no_grad()
def finish_router_step(model: nn.Module, group=None, update_bias: bool = True) -> list[list[int]] | None:
    """After an optimizer step: the step's assignments per expert summed over the data-parallel
    ranks (one row per MoE layer, for metrics.jsonl), the aux-loss-free biases moved towards
    balance, the counters cleared. None for a dense model."""
    layers = moe_layers(model)
    if not layers:
        return None
    loads = torch.stack([m.load for m in layers])
    if group is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(loads, group=group)
    for m, load in zip(layers, loads):
        if update_bias and m.bias_rate > 0:
            m.expert_bias += m.bias_rate * torch.sign(load.mean() - load)
        m.load.zero_()
    return [[int(v) for v in row] for row in loads.tolist()]
