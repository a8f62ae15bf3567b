"""`--search`: every valid strategy (TP x PP x schedule x ZeRO x micro-batch x recompute) for
a model, fleet and global batch; the top k that fit, by predicted throughput.

GPipe is never better than 1F1B (same bubble, more activations in flight) and is left out.
Optimizer offload is left out by default (tenfold's engine has none); with `offloads=("none",
"optimizer")` it is priced by its host-link traffic, and when a layout fits without offload its
offloaded twin is skipped as dominated (counted, not evaluated).
Valid means: tp divides the query and key/value heads and stays inside a node (TP over the network is never
worth it: 4 all-reduces per layer per micro-batch); tp x pp divides the GPUs; the micro-batch
and data-parallel size divide the global batch; interleaving needs layers divisible by p x v
and micro-batches divisible by p. Memory is checked first (cheap); time only for what fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tenfold.errors import UserError
from tenfold.plan.api import Plan, _fits as fits, _predict, predict, predict_memory
from tenfold.plan.hardware import Hardware, get_hardware, with_gpus_per_node
from tenfold.plan.shape import ModelShape, shape_of
from tenfold.plan.strategy import Strategy, tp_choices

AC_CHOICES = ("none", "selective", "full")
# tenfold's engine has no optimizer offload, so the default search leaves it out; pass
# offloads=("none", "optimizer") to price it (host-link traffic per micro-batch, step_time.py).
OFFLOAD_CHOICES = ("none",)


@dataclass
class SearchResult:
    best: list[Plan]  # the top k that fit, fastest first
    evaluated: int  # strategies whose memory was computed
    fitting: int  # of which fit
    candidates: list[tuple[float, float, bool]]  # (total GiB, tokens/s or 0, fits) for --plot
    dominated: int = 0  # offloaded twins of layouts that already fit without offload (skipped)


def _powers_of_two_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def default_global_batch(seq_len: int, dp_max: int) -> int:
    """About 4M tokens (GPT-3 175B used 3.2M, LLaMA 4M), a power of two in sequences."""
    return max(1, 2 ** round(math.log2(max(1, 4 * 2**20 / seq_len))))


def search(model, hardware: "str | Hardware", gpus: int, base: Strategy, top_k: int = 5,
           gpus_per_node: int | None = None, offloads: tuple[str, ...] = OFFLOAD_CHOICES) -> SearchResult:
    shape: ModelShape = shape_of(model)
    if not shape.known:
        raise UserError("--search needs a model shape (--model, dimensions or --hf-config), not only --params")
    hw = with_gpus_per_node(get_hardware(hardware), gpus_per_node)
    cfg = shape.cfg
    seq = base.seq_len or cfg.max_seq_len
    glob = base.global_batch or default_global_batch(seq, gpus)
    tps = [t for t in _powers_of_two_upto(min(hw.gpus_per_node, gpus)) if t in tp_choices(cfg.n_heads, cfg.kv_heads)]
    pps = [p for p in range(1, cfg.n_layers + 1) if gpus % p == 0 and cfg.n_layers % p == 0]
    mbs = [b for b in _powers_of_two_upto(min(glob, 16))]
    plans: list[Plan] = []
    candidates: list[tuple[float, float, bool]] = []
    evaluated = dominated = 0
    for tp in tps:
        for pp in pps:
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for mb in mbs:
                if glob % (mb * dp):
                    continue
                m = glob // (mb * dp)
                for sched, v in _schedules(pp, m, cfg.n_layers):
                    for zero in (0, 1, 2, 3):
                        if zero and dp == 1:
                            continue  # nothing to partition
                        for ac in AC_CHOICES:
                            fits_on_gpu = False
                            for off in offloads:
                                if off != "none" and (zero == 0 or fits_on_gpu):
                                    # Offload only adds host time to an identical layout: when the
                                    # layout fits without it, the offloaded twin is dominated.
                                    dominated += off != "none" and zero > 0
                                    continue
                                s = replace(base, tp=tp, pp=pp, micro_batch=mb, global_batch=glob, grad_accum=None,
                                            seq_len=seq, pp_schedule=sched, virtual_stages=v, zero=zero, offload=off,
                                            ac=ac, sequence_parallel=base.sequence_parallel and tp > 1)
                                evaluated += 1
                                mem = predict_memory(shape, hw, gpus, s)
                                if not fits(mem, hw, gpus):
                                    candidates.append((mem.total_bytes / 2**30, 0.0, False))
                                    continue
                                fits_on_gpu = off == "none"
                                p = _predict(shape, hw, gpus, s, trace=False, mem=mem)
                                candidates.append((p.memory.total_bytes / 2**30, p.tokens_per_s, True))
                                plans.append(p)
    plans.sort(key=lambda p: -p.tokens_per_s)
    best = [predict(shape, hw, gpus, Strategy(**p.strategy)) for p in plans[:top_k]]
    return SearchResult(best, evaluated, len(plans), candidates, dominated)


def _schedules(pp: int, m: int, layers: int) -> list[tuple[str, int]]:
    """GPipe is left out: same bubble as 1F1B (Narayanan §2.2) with m >= min(p, m) micro-batches
    in flight, so it never beats 1F1B on time or memory."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1)]
    if m % pp == 0:
        for v in (2, 3, 4):
            if layers % (pp * v) == 0:
                out.append(("interleaved", v))
    return out
