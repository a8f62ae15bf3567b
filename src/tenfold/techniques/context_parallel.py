"""Context parallelism: each sequence split over the cp ranks, attention computed across them.

Layout (load balancing for a causal mask): the sequence is cut into 2 x cp equal chunks and cp
rank r holds chunks r and 2cp-1-r ("head-tail"), so every rank holds one early chunk (little
to attend to) and one late chunk (much to attend to) and the ranks do the same attention work
(Llama 3 paper, arXiv:2407.21783, section 3.3.2; torchtitan / PyTorch `context_parallel`'s
round-robin load balancer; Megatron-Core's context parallelism). `local_positions` names the
positions a rank holds; `shard_sequence` / `unshard_sequence` go between the whole sequence and
a rank's part.

Attention (`context_attention`): every rank's keys and values reach every other rank through
an all-gather over the cp group, the scheme Llama 3 uses for its long-context stage (all-gather
based context parallelism, section 3.3.2): the K/V of grouped-query attention are small next
to Q, and an all-gather is one collective whose backward is a reduce-scatter of the K/V
gradients (`AllGatherBlocks`, an autograd.Function; the rest of the backward is autograd's). Each local query chunk then attends block by block: one block of every
earlier chunk (no mask) and its own chunk (causal mask); later chunks are skipped. Each block
gives its output and the log-sum-exp of its scores, and the blocks merge by log-sum-exp
(Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the merge of ring
attention, Liu et al. 2023, arXiv:2310.01889): out = sum_j exp(lse_j - lse) out_j with
lse = logsumexp_j(lse_j).

Two block kernels compute the same thing:
* on CPU, `FlashChunkAttention`: each block by torch's CPU flash kernel
  (`aten._scaled_dot_product_flash_attention_for_cpu`, which returns the log-sum-exp), no s x s
  tensor kept; its backward runs the kernel's backward on every block with the MERGED output
  and log-sum-exp, which gives each block its exact share of the gradient (the ring backward of
  FlashAttention-2, Dao 2023, section 3.1.2; ring-flash-attention). torch's own
  `torch.distributed.tensor.experimental.context_parallel` does not serve here: it raises
  NotImplementedError for that CPU kernel (torch 2.13).
* elsewhere, `block_attention`: the block math written out (scores in fp32), differentiable
  through autograd; it keeps each block's scores and probabilities for backward, so its memory
  grows with (s/cp)^2. (On CUDA, torch's `context_parallel` with its flash / cuDNN kernels is
  the memory-efficient route; tenfold does not wire it yet: docs/context_parallel.md.)

The cp ranks hold the same parameters and compute gradients on different tokens of the same
rows, so they join the data-parallel gradient reduction (FSDP2 / DDP over dp x cp, as
torchtitan shards over dp_shard x cp), count their own targets in the global token count and
load the same rows (tenfold.engine.parallel.distributed builds the groups; the step splits each
micro-batch with `local_batch`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.distributed as dist

from tenfold.errors import UserError
from tenfold.run import check_context_split

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- load-balanced layout


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) cp rank `rank` holds: its head and its mirrored tail."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions (into the whole sequence) of the tokens cp rank `rank` holds, in its order."""
    check_context_split(seq_len, cp)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp, rank)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of `x` along the sequence dimension `dim`."""
    return x.index_select(dim, local_positions(x.shape[dim], cp, rank, x.device))


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every cp rank's part (`parts` in rank order)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        head, tail = part.chunk(2, dim=dim)
        first, second = chunk_ids(cp, rank)
        chunks[first], chunks[second] = head, tail
    return torch.cat(chunks, dim=dim)


def local_batch(batch: dict, cp: int, rank: int) -> dict:
    """A micro-batch's (b, s) tensors cut to this rank's part, with the positions of its tokens:
    `positions` (tenfold's GPT: RoPE angles and learned positions) and `position_ids` (Hugging
    Face models; a packed row's own ids are cut like the tokens)."""
    out = {k: shard_sequence(v, cp, rank) if v.dim() >= 2 else v for k, v in batch.items()}
    seq_len = batch["input_ids"].shape[1]
    positions = local_positions(seq_len, cp, rank, batch["input_ids"].device)
    out["positions"] = positions
    if "position_ids" not in batch:
        out["position_ids"] = positions[None].expand(batch["input_ids"].shape[0], -1)
    return out


# --------------------------------------------------------------------------- attention


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v of one block pair and the log-sum-exp of its scores (fp32).
    `causal`: q and k are the same chunk, query t sees keys 0..t of it."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()), lse


def merge_blocks(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Blocks of one query chunk, each normalised over its own keys, as one softmax over all
    of them: weights exp(lse_j - lse)."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    return sum(torch.exp(l - lse).unsqueeze(-1) * o for o, l in zip(outs, lses))


class AllGatherBlocks(torch.autograd.Function):
    """Every cp rank's tensor, stacked in group-rank order (cp, *shape); backward: the sum over
    the ranks of the gradient of this rank's slot (a reduce-scatter). gloo has no
    reduce-scatter, so there the gradients are all-reduced and each rank keeps its slot (cp
    times the bytes, CPU runs only); every other backend (NCCL, and the fake one `tenfold plan
    --trace` runs a GPU job's step on) reduce-scatters. torch.distributed.nn.functional.all_gather
    emulates its backward on gloo with scatters that name group ranks as global ranks, which
    fails on a sub-group such as cp inside dp x cp (torch 2.13)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) != "gloo":
            out = torch.empty_like(grad[0])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        summed = grad.clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed[dist.get_rank(ctx.group)], None


def gather_blocks(t: torch.Tensor, group, cp: int) -> list[torch.Tensor]:
    """Every rank's K (or V) as the 2 x cp chunks of the whole sequence, in chunk order. The
    all-gather returns rank j's part (its chunks j and 2cp-1-j) at index j."""
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(AllGatherBlocks.apply(t, group).unbind(0)):
        head, tail = part.chunk(2, dim=-2)
        first, second = chunk_ids(cp, rank)
        chunks[first], chunks[second] = head, tail
    return chunks


class FlashChunkAttention(torch.autograd.Function):
    """One query chunk over its key/value blocks (the last one its own chunk, causal), each by
    the CPU flash kernel, merged by log-sum-exp. Backward: the kernel's backward per block with
    the merged output and log-sum-exp (P_j = exp(S_j - lse) is then block j's part of the whole
    softmax, and D = rowsum(dO * O) the whole row's), dq summed over the blocks. The blocks
    keep their kv heads (grouped-query attention): each is repeated to the query heads where
    it is used, forward and backward, so only the gathered K/V is kept, and the repeated
    heads' gradients are summed back."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, scale: float, rep: int, *blocks: torch.Tensor) -> torch.Tensor:
        n = len(blocks) // 2
        keys, values = blocks[:n], blocks[n:]
        outs, lses = [], []
        for j, (k, v) in enumerate(zip(keys, values)):
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, _heads(k, rep), _heads(v, rep), 0.0, is_causal=j == n - 1, scale=scale)
            outs.append(o.float())
            lses.append(lse)
        lse = torch.logsumexp(torch.stack(lses), dim=0)
        out = sum(torch.exp(l - lse).unsqueeze(-1) * o for o, l in zip(outs, lses)).to(q.dtype)
        ctx.scale, ctx.n, ctx.rep = scale, n, rep
        ctx.save_for_backward(q, out, lse, *blocks)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, out, lse, *blocks = ctx.saved_tensors
        n, rep, grad_out = ctx.n, ctx.rep, grad_out.contiguous()
        dq, dks, dvs = torch.zeros_like(q, dtype=torch.float32), [], []
        for j, (k, v) in enumerate(zip(blocks[:n], blocks[n:])):
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, _heads(k, rep), _heads(v, rep), out, lse, 0.0, j == n - 1, scale=ctx.scale)
            dq += gq.float()
            dks.append(_sum_heads(gk, rep))
            dvs.append(_sum_heads(gv, rep))
        return (dq.to(q.dtype), None, None, *dks, *dvs)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp: int, rank: int,
                      scale: float | None = None, kernel: str | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries (b, h, s/cp, d) over the whole sequence's keys
    and values, whose local parts k, v (b, h_kv, s/cp, d) every rank contributes; the result
    is this rank's part of causal attention over the whole sequence (`unshard_sequence` of
    every rank's result = `F.scaled_dot_product_attention(..., is_causal=True)`). `kernel`:
    "flash" (CPU only) or "math"; None: flash on CPU, math elsewhere."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kernel = kernel or ("flash" if q.device.type == "cpu" else "math")
    keys, values = gather_blocks(k, group, cp), gather_blocks(v, group, cp)
    rep = q.shape[1] // k.shape[1]  # grouped-query attention: kv heads travel once, repeat here
    outs = []
    for q_chunk, i in zip(q.chunk(2, dim=-2), chunk_ids(cp, rank)):
        ks, vs = keys[:i + 1], values[:i + 1]  # every earlier chunk, then its own
        if kernel == "flash":
            outs.append(FlashChunkAttention.apply(q_chunk, scale, rep, *ks, *vs))
            continue
        parts = [block_attention(q_chunk, _heads(kj, rep), _heads(vj, rep), scale, causal=j == i)
                 for j, (kj, vj) in enumerate(zip(ks, vs))]
        outs.append(merge_blocks([o for o, _ in parts], [l for _, l in parts]).to(q.dtype))
    return torch.cat(outs, dim=-2)


def _heads(t: torch.Tensor, rep: int) -> torch.Tensor:
    """kv heads repeated to the query heads (head i of q reads kv head i // rep)."""
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def _sum_heads(g: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of `_heads`: the repeated heads' gradients summed onto their kv head."""
    return g.unflatten(1, (-1, rep)).sum(2) if rep > 1 else g


class ContextParallelCore(nn.Module):
    """tenfold GPT's attention core (`Block.attn.core`) over the cp group: no parameters, so
    selective recompute wraps it as it wraps the plain core."""

    def __init__(self, group, cp: int, rank: int):
        super().__init__()
        self.group, self.cp, self.rank = group, cp, rank

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return context_attention(q, k, v, self.group, self.cp, self.rank)


HF_ATTENTION = "tenfold_cp"  # the name the cp attention is registered under in transformers


def hf_context_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The cp attention as a transformers attention function (AttentionInterface: q, k, v as
    (b, heads, s, d), the output as (b, s, heads, d)). The causal mask is the cp layout's own,
    over the global positions; the model's mask is not read (training rows carry no padding;
    a packed row's documents see each other, as under the plain kernel's is_causal)."""
    group, cp, rank = module.tenfold_cp
    return context_attention(query, key, value, group, cp, rank, scale=scaling).transpose(1, 2), None


def apply_context_parallel(model: nn.Module, blocks: list[nn.Module], group, cp: int, rank: int) -> None:
    """Swap every block's attention for the cp one: tenfold's GPT's `block.attn.core` module; a
    Hugging Face Llama's attention function (registered with transformers' AttentionInterface,
    the model's `_attn_implementation` set to it, its layers told the cp group)."""
    if blocks and hasattr(blocks[0], "self_attn"):
        from transformers import AttentionInterface

        # no mask function under this name: transformers then builds no mask tensor
        AttentionInterface.register(HF_ATTENTION, hf_context_attention)
        model.config._attn_implementation = HF_ATTENTION
        for block in blocks:
            block.self_attn.tenfold_cp = (group, cp, rank)
        return
    for block in blocks:
        attn = getattr(block, "attn", None)
        if not isinstance(getattr(attn, "core", None), nn.Module):
            raise UserError(f"context parallelism (--cp) needs tenfold's attention core `attn.core` or a Hugging "
                            f"Face Llama attention; {type(block).__name__} has neither")
        attn.core = ContextParallelCore(group, cp, rank)
