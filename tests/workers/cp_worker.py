"""Rank-side half of the context-parallel attention test: run by `python -m torch.distributed.run`
from tests/test_context_parallel.py, never by pytest itself (no test functions).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/cp_worker.py MODE OUT.json

MODE `attention`: every rank draws the same whole-sequence q, k, v (grouped-query: 4 query
heads, 2 kv heads) and weights w; the reference is plain causal attention over the whole
sequence in this process, and its loss sum(out * w) backpropagated. Each rank then runs
`context_attention` on its part and the same loss on its part; rank 0 writes the largest
differences of the gathered outputs and q/k/v gradients from the reference.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tenfold.techniques.context_parallel import context_attention, shard_sequence, unshard_sequence


def attention(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, s, d = 2, 4, 2, 64, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    w = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)

    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(ref_q, ref_k.repeat_interleave(2, 1), ref_v.repeat_interleave(2, 1),
                                         is_causal=True)
    (ref * w).sum().backward()

    local = [shard_sequence(t, cp, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    out = context_attention(*local, group=dist.group.WORLD, cp=cp, rank=rank)
    (out * shard_sequence(w, cp, rank, dim=2)).sum().backward()

    def whole(t):
        parts = [torch.empty_like(t) for _ in range(cp)]
        dist.all_gather(parts, t.contiguous())
        return unshard_sequence(parts, dim=2)

    # out is computed in fp32 (block scores in fp32), so compare at fp32 precision
    diffs = {"out": (whole(out.detach()) - ref.detach()).abs().max().item()}
    for name, t, r in zip("qkv", local, (ref_q, ref_k, ref_v)):
        diffs[f"grad_{name}"] = (whole(t.grad) - r.grad).abs().max().item()
    diffs["scale"] = ref.abs().max().item()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(diffs, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"attention": attention}[sys.argv[1]](sys.argv[2])
