"""`--search`: every valid strategy (TP x PP x schedule x ZeRO x micro-batch x recompute) for
a model, fleet and global batch; the top k that fit, by predicted throughput.

GPipe is never better than 1F1B (same bubble, more activations in flight) and is left out.
Only strategies `tenfold train` can run are ranked (tenfold.capabilities: no tensor parallelism
or offload in the engine today, no pipeline for a model with tied embeddings or fewer
micro-batches than stages, ...); `include_unsupported=True` ranks the others too, marked.
Optimizer offload is left out by default; with `offloads=("none", "optimizer")` (and
`include_unsupported`) it is priced by its host-link traffic, and when a layout fits without
offload its offloaded twin is skipped as dominated (counted, not evaluated).
Valid means: tp divides the query and key/value heads and stays inside a node (TP over the network is never
worth it: 4 all-reduces per layer per micro-batch); tp x pp divides the GPUs; the micro-batch
and data-parallel size divide the global batch; interleaving needs layers divisible by p x v
and micro-batches divisible by p. Memory is checked first (cheap); time only for what fits.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from tenfold.errors import UserError
from tenfold.plan.api import Plan, _fits as fits, _predict, predict, predict_memory
from tenfold.plan.for_run import strategy_problems
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
    unsupported: int = 0  # strategies `tenfold train` cannot run, left out (tenfold.capabilities)
    global_batch: int = 0  # sequences per step, the same for every strategy


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
           gpus_per_node: int | None = None, offloads: tuple[str, ...] = OFFLOAD_CHOICES,
           include_unsupported: bool = False, model_kind: str = "tenfold", hf_model_type: str = "") -> SearchResult:
    """The top `top_k` strategies that fit, fastest first. Only strategies `tenfold train` can run
    (tenfold.capabilities, for a model of `model_kind`) unless `include_unsupported`: then the
    others are ranked too, each with its reasons in `Plan.unsupported`."""
    shape: ModelShape = shape_of(model)
    if not shape.known:
        raise UserError("--search needs a model shape (--model, dimensions or --hf-config), not only --params")
    hw = with_gpus_per_node(get_hardware(hardware), gpus_per_node)
    seq = base.seq_len or shape.cfg.max_seq_len
    glob = base.global_batch or default_global_batch(seq, gpus)
    result = SearchResult([], 0, 0, [], global_batch=glob)
    plans: list[Plan] = []
    for layout, m in _layouts(shape, hw, gpus, replace(base, seq_len=seq, global_batch=glob)):
        fits_on_gpu = False
        for off in offloads:
            if off != "none" and (layout.zero == 0 or fits_on_gpu):
                # Offload only adds host time to an identical layout: when the layout fits
                # without it, the offloaded twin is dominated.
                result.dominated += layout.zero > 0
                continue
            s = replace(layout, offload=off)
            problems = strategy_problems(s, shape.cfg, gpus, m, model_kind, hf_model_type)
            if problems and not include_unsupported:
                result.unsupported += 1
                continue
            p = _evaluate(shape, hw, gpus, s, result)
            if p is not None:
                fits_on_gpu = off == "none"
                p.unsupported = problems
                plans.append(p)
    plans.sort(key=lambda p: -p.tokens_per_s)
    result.fitting = len(plans)
    result.best = [replace(predict(shape, hw, gpus, Strategy(**p.strategy)), unsupported=p.unsupported)
                   for p in plans[:top_k]]
    return result


def _evaluate(shape: ModelShape, hw: Hardware, gpus: int, s: Strategy, result: SearchResult) -> Plan | None:
    """Memory first (cheap); the time model only when it fits. Counted in `result`."""
    result.evaluated += 1
    mem = predict_memory(shape, hw, gpus, s)
    if not fits(mem, hw, gpus):
        result.candidates.append((mem.total_bytes / 2**30, 0.0, False))
        return None
    p = _predict(shape, hw, gpus, s, trace=False, mem=mem)
    result.candidates.append((p.memory.total_bytes / 2**30, p.tokens_per_s, True))
    return p


def _layouts(shape: ModelShape, hw: Hardware, gpus: int, base: Strategy):
    """Every valid layout without offload, with its number of micro-batches per step."""
    cfg, glob = shape.cfg, base.global_batch
    tps = [t for t in _powers_of_two_upto(min(hw.gpus_per_node, gpus)) if t in tp_choices(cfg.n_heads, cfg.kv_heads)]
    pps = [p for p in range(1, cfg.n_layers + 1) if gpus % p == 0 and cfg.n_layers % p == 0]
    for tp, pp, mb in itertools.product(tps, pps, _powers_of_two_upto(min(glob, 16))):
        dp = gpus // (tp * pp)
        if gpus % (tp * pp) or glob % (mb * dp):
            continue
        m = glob // (mb * dp)
        for (sched, v), zero, ac in itertools.product(_schedules(pp, m, cfg.n_layers), (0, 1, 2, 3), AC_CHOICES):
            if zero and dp == 1:
                continue  # nothing to partition
            yield replace(base, tp=tp, pp=pp, micro_batch=mb, grad_accum=None, pp_schedule=sched, virtual_stages=v,
                          zero=zero, offload="none", ac=ac, sequence_parallel=base.sequence_parallel and tp > 1), m


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
