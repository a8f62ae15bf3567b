"""Rank-side half of the context-parallel attention test: run by `python -m torch.distributed.run`
from tests/test_context_parallel.py, never by pytest itself (no test functions).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/cp_worker.py MODE OUT.json

MODE `attention` (2 ranks): every rank draws the same whole-sequence q, k, v (grouped-query: 4 query
heads, 2 kv heads) and weights w; the reference is plain causal attention over the whole
sequence in this process, and its loss sum(out * w) backpropagated. Each rank then runs
`context_attention` on its part and the same loss on its part; rank 0 writes the largest
differences of the gathered outputs and q/k/v gradients from the reference.

MODE `train-N` (N ranks; N = 1 gives the reference): the Trainer on learnable token rows of
length SEQ, each case of CASES that fits N ranks (its cp / dp / tp / pp layout, or one process),
3 steps; rank 0 writes every step's loss, the validation loss after them (pipelined cases) and
the first step's gradients (whole tensors, as the optimizer sees them, every pipeline stage's)
of each case to OUT.json and OUT.pt, and for case cp2 the activations of its last step,
measured and predicted.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tenfold.techniques.context_parallel import context_attention, shard_sequence, unshard_sequence

SEQ, ROWS, STEPS = 512, 16, 3
VAL_ROWS = 4  # held-out rows after the ROWS training rows (pipelined cases)


def long_llama() -> str:
    """tests/data/llama-tiny with a context of SEQ positions (its own is 128)."""
    import tempfile

    with open(os.path.join(os.path.dirname(__file__), "..", "data", "llama-tiny", "config.json")) as f:
        config = {**json.load(f), "max_position_embeddings": SEQ}
    path = os.path.join(tempfile.gettempdir(), f"llama-tiny-{SEQ}-{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path

MODEL = {"name": "tiny", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128,
         "max_seq_len": SEQ}
LEARNED = {**MODEL, "pos": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True, "tie_embeddings": True}
# name -> (ranks, model, parallel section, micro-batch per dp rank); one process runs each
# case's reference with the micro-batch of all its dp ranks and the same micro-batches per step
# (ACCUM: 1 unless named)
CASES = {
    "cp2": (2, MODEL, {"cp_degree": 2}, 2),
    "cp2-learned": (2, LEARNED, {"cp_degree": 2}, 2),
    "cp2-recompute": (2, MODEL, {"cp_degree": 2}, 2),
    "cp2-dp2-zero3": (4, MODEL, {"cp_degree": 2, "zero_stage": 3}, 1),
    "cp2-tp2": (4, MODEL, {"cp_degree": 2, "tp_degree": 2}, 2),
    "cp2-hf-llama": (2, {"hf_config": long_llama()}, {"cp_degree": 2}, 2),
    "cp2-pp2": (4, MODEL, {"cp_degree": 2, "pp_degree": 2}, 1),
    "cp2-pp2-learned": (4, LEARNED, {"cp_degree": 2, "pp_degree": 2, "pp_schedule": "gpipe"}, 1),
    "cp2-pp2-hf-llama": (4, {"hf_config": long_llama()}, {"cp_degree": 2, "pp_degree": 2}, 1),
    "cp2-pp2-zero-bubble": (4, {**MODEL, "n_layers": 4}, {"cp_degree": 2, "pp_degree": 2, "pp_schedule": "zero-bubble",
                                                          "virtual_stages": 2, "zero_stage": 2}, 1),
}
ACCUM = {name: 2 for name in CASES if "-pp2" in name}  # a pipeline step streams micro-batches through its stages


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

    def whole(t):
        parts = [torch.empty_like(t) for _ in range(cp)]
        dist.all_gather(parts, t.contiguous())
        return unshard_sequence(parts, dim=2)

    diffs = {"scale": ref.abs().max().item()}
    for kernel in ("flash", "math"):
        local = [shard_sequence(t, cp, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
        out = context_attention(*local, group=dist.group.WORLD, cp=cp, rank=rank, kernel=kernel)
        (out * shard_sequence(w, cp, rank, dim=2)).sum().backward()
        # the math kernel's blocks run in fp32, so both compare at fp32 precision
        diffs[f"{kernel}-out"] = (whole(out.detach()) - ref.detach()).abs().max().item()
        for name, t, r in zip("qkv", local, (ref_q, ref_k, ref_v)):
            diffs[f"{kernel}-grad_{name}"] = (whole(t.grad) - r.grad).abs().max().item()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(diffs, f)
    dist.barrier()
    dist.destroy_process_group()


def token_rows(rows: int = ROWS) -> "np.ndarray":
    """Learnable rows (an arithmetic progression mod 50 from a random start): the loss falls."""
    import numpy as np

    starts = np.random.default_rng(0).integers(0, 50, size=(rows, 1))
    return ((starts + 3 * np.arange(SEQ + 1)) % 50).astype(np.int64)


def held_out(name: str) -> bool:
    return "-pp2" in name


def case_config(name: str, world: int, out: str) -> dict:
    ranks, model, parallel, micro = CASES[name]
    one = world == 1
    dp = ranks // (parallel.get("cp_degree", 1) * parallel.get("tp_degree", 1) * parallel.get("pp_degree", 1))
    return {
        "model": dict(model),
        # the pipelined cases also score held-out rows (each cp rank its part, through the stages)
        "data": {"seq_len": SEQ, "val_fraction": VAL_ROWS / (ROWS + VAL_ROWS) if held_out(name) else 0.0},
        "train": {"steps": STEPS, "micro_batch": micro * dp if one else micro, "grad_accum": ACCUM.get(name, 1),
                  "lr": 1e-2, "warmup_steps": 0,
                  "eval_every": 0, "seed": 7, "grad_clip": 0.0},
        "precision": {"dtype": "fp32"},
        "recompute": {"policy": "full" if name.endswith("recompute") else "none"},
        "parallel": {"param_persistence_threshold": 0, **({} if one else parallel)},
        "log": {"out": out, "progress": False, "tensorboard": False},
    }


def whole_grads(model) -> dict:
    """Every parameter's gradient as one whole tensor (DTensor shards gathered), by the name
    the plain model gives it."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        for wrapper in ("module.", "_checkpoint_wrapped_module.", "_orig_mod."):
            name = name.replace(wrapper, "")
        out[name] = g.detach().clone()
    return out


def step_memory(t, run_step) -> dict:
    """Activations of one step: measured by the tensor tracker, predicted by the planner."""
    from tenfold.engine.memory import measure_step_memory, predicted_memory

    measured = measure_step_memory(t.model, t.optimizer, run_step, t.dist.device)
    predicted = predicted_memory(t.parts.run, t.dist.device, "fp32")
    return {"measured": measured["activations_bytes"], "predicted": predicted["activations_bytes"]}


def train(world: int, out_path: str) -> None:
    from tenfold.engine.distributed import init_distributed, shutdown
    from tenfold.engine.trainer import Trainer

    results, grads = {}, {}
    for name, (ranks, *_rest) in CASES.items():
        if world not in (1, ranks):
            continue
        rows = token_rows(ROWS + VAL_ROWS if held_out(name) else ROWS)
        t = Trainer(case_config(name, world, os.path.dirname(out_path)), dataset=rows)
        t.setup()
        first: dict = {}

        def keep_first(*_, first=first, model=t.model):
            if not first:
                first.update(whole_grads(model))

        t.optimizer.register_step_pre_hook(keep_first)
        losses, memory = [], None
        for i in range(STEPS):
            mbs = t.loader.next_step()
            if name == "cp2" and i == STEPS - 1:  # the last step: DDP rebuilt its buckets in step 2
                memory = step_memory(t, lambda: losses.append(t.train_step(mbs).loss))
            else:
                losses.append(t.train_step(mbs).loss)
        if t.dist.pp_size > 1:  # each rank holds its stages' gradients: every stage's, by name
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, first)
            first = {k: v for part in every for k, v in part.items()}
        results[name] = {"losses": losses, "memory": memory, "val_loss": t.evaluate()}
        grads[name] = first
    info = init_distributed()
    if info.is_main:
        with open(out_path, "w") as f:
            json.dump(results, f)
        torch.save(grads, out_path + ".pt")
    shutdown()


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "attention":
        attention(out)
    else:
        train(int(mode.split("-")[1]), out)
