"""`--search`: every valid strategy (TP x PP x CP x schedule x ZeRO x shard group x EP x micro-batch x recompute) for
a model, fleet and global batch; the top k that fit, by predicted throughput.

GPipe is never better than 1F1B (same bubble, more activations in flight) and is left out.
Every candidate is a `tenfold.run.ResolvedRun` derived from the user's run by `with_`, so the
search uses the engine's own rules. Only runs `tenfold train` can do are ranked
(tenfold.capabilities: no pipeline with fewer micro-batches than stages, ...);
`include_unsupported=True` ranks the others too, marked. Offload (`optimizer`, then
`optimizer+params` at ZeRO-3) is priced by its host-link traffic; when a layout fits with less
offload its more offloaded twins are skipped as dominated (counted, not evaluated).
Valid means: tp divides the query and key/value heads and stays inside a node (TP over the network is never
worth it: 4 all-reduces per layer per micro-batch); tp x pp divides the GPUs; the micro-batch
and data-parallel size divide the global batch; interleaving needs at least one layer per
stage (p x v <= layers) and micro-batches divisible by p. The stages need not divide the layers:
each candidate's blocks per stage come from the rule train uses when no --pp-split is given
(tenfold.terms.layer_counts, the embedding and the head weighted as a layer each), so an
emitted config leaves the split to train. Context parallelism (cp > 1) is tried for long
sequences only (`cp_choices`: from LONG_SEQUENCE tokens, keeping at least MIN_CP_CHUNK tokens per
rank), as Llama 3 turns it on for its long-context stage only (arXiv:2407.21783, section 3.3.2).
Memory is checked first (cheap); time only for what fits.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from tenfold import capabilities
from tenfold.errors import UserError
from tenfold.layout import build_layout, shard_group_problem
from tenfold.plan.api import Plan, _fits as fits, _predict, predict, predict_memory
from tenfold.plan.hardware import Hardware, get_hardware, with_gpus_per_node
from tenfold.run import ResolvedRun
from tenfold.terms import OFFLOADS, tp_choices

AC_CHOICES = ("none", "selective", "op", "full")
# Offload is priced by its host-link traffic (step_time.py), least offloaded first: a layout is
# tried with more offload only when it does not fit with less (more offload only adds host time).
# In the default search only where tenfold train runs it (tenfold.capabilities).
OFFLOAD_CHOICES = OFFLOADS
# Context parallelism is searched from this sequence length on (Llama 3: 8K without cp, cp 16 at
# 128K), each rank keeping at least MIN_CP_CHUNK tokens of the sequence (shorter chunks leave the
# K/V traffic large next to the attention compute).
LONG_SEQUENCE, MIN_CP_CHUNK = 16384, 2048


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


def search(base: ResolvedRun, hardware: "str | Hardware", top_k: int = 5, gpus_per_node: int | None = None,
           offloads: tuple[str, ...] = OFFLOAD_CHOICES, include_unsupported: bool = False,
           name: str | None = None, sequence_parallel: bool | None = None, gpus: int | None = None,
           tokens: float | None = None) -> SearchResult:
    """The top `top_k` layouts of `base` (same model, global batch and precision) on `gpus`
    processes (default: base's) that fit, fastest first. Only runs `tenfold train` can do
    (tenfold.capabilities) unless `include_unsupported`: then the others are ranked too, each
    with its reasons in `Plan.unsupported`. `sequence_parallel`: as the user asked for it (None:
    train's default, on wherever tp > 1). `tokens`: the training budget that fills each best
    layout's days."""
    if base.model is None:
        raise UserError("--search needs a model shape (--model, dimensions or --hf-config), not only --params")
    hw = with_gpus_per_node(get_hardware(hardware), gpus_per_node)
    result = SearchResult([], 0, 0, [], global_batch=base.global_batch)
    plans: list[Plan] = []
    for layout in _layouts(base, hw, sequence_parallel, gpus or base.world_size):
        fits_on_gpu = False
        for off in offloads:
            if off == "optimizer+params" and layout.zero_stage != 3:
                continue  # only ZeRO-3 partitions parameters
            if off != "none" and (layout.zero_stage == 0 or fits_on_gpu):
                # Offload only adds host time to an identical layout: when the layout fits
                # with less of it, the more offloaded twin is dominated.
                result.dominated += layout.zero_stage > 0
                continue
            run = layout if off == "none" else layout.with_(offload=off, check=False)
            problems = capabilities.problems(run)
            if problems and not include_unsupported:
                result.unsupported += 1
                continue
            p = _evaluate(run, hw, result, name)
            if p is not None:
                fits_on_gpu = True
                p.unsupported = problems
                plans.append((run, p))
    plans.sort(key=lambda rp: -rp[1].tokens_per_s)
    result.fitting = len(plans)
    result.best = [replace(predict(run, hw, name=name, tokens=tokens), unsupported=p.unsupported)
                   for run, p in plans[:top_k]]
    return result


def _evaluate(run: ResolvedRun, hw: Hardware, result: SearchResult, name: str | None) -> Plan | None:
    """Memory first (cheap); the time model only when it fits. Counted in `result`."""
    result.evaluated += 1
    mem = predict_memory(run, hw, name=name)
    if not fits(mem, hw, run.world_size):
        result.candidates.append((mem.total_bytes / 2**30, 0.0, False))
        return None
    p = _predict(run, hw, trace=False, mem=mem, name=name)
    result.candidates.append((p.memory.total_bytes / 2**30, p.tokens_per_s, True))
    return p


def _layouts(base: ResolvedRun, hw: Hardware, sequence_parallel: bool | None, gpus: int):
    """Every valid layout of `base` on `gpus` processes without offload, resolved by the run's
    own rules."""
    cfg, glob = base.model, base.global_batch
    tps = [t for t in _powers_of_two_upto(min(hw.gpus_per_node, gpus)) if t in tp_choices(cfg.n_heads, cfg.kv_heads, cfg.vocab_size)]
    # Any number of stages up to the layers: the blocks are split by the rule train uses
    # (tenfold.terms.stage_layer_counts), evenly or not.
    pps = [p for p in range(1, cfg.n_layers + 1) if gpus % p == 0]
    for tp, pp, cp, mb in itertools.product(tps, pps, cp_choices(base.seq_len, gpus), _powers_of_two_upto(min(glob, 16))):
        try:
            dp = build_layout(gpus, pp, tp, cp=cp).dp
        except UserError:  # pp x cp x tp does not divide the processes
            continue
        if glob % (mb * dp):
            continue
        m = glob // (mb * dp)
        for (sched, v), zero, ac, ep in itertools.product(_schedules(pp, m, cfg.n_layers), (0, 1, 2, 3), AC_CHOICES,
                                                          _ep_choices(cfg, dp) if cp == 1 else [1]):
            if zero and dp * cp == 1:
                continue  # nothing to partition
            if zero == 1 and tp > 1 and pp > 1:
                continue  # runs as ZeRO-2 (tenfold.terms.zero_runs_as), which a pipeline reduces once per step too
            for group in _shard_groups(zero, dp, tp, hw.gpus_per_node) if cp == 1 else [None]:
                try:
                    yield base.with_(check=False, world_size=gpus, tp=tp, pp=pp, cp=cp, micro_batch=mb, pp_schedule=sched,
                                     virtual_stages=v, global_batch=glob, zero_stage=zero, recompute=ac,
                                     offload="none", pp_split=None, shard_group=group, ep=ep,
                                     sequence_parallel=sequence_parallel if tp > 1 else None)
                except UserError:  # a layout the run's rules refuse (e.g. sequence split by tp)
                    continue


def cp_choices(seq_len: int, gpus: int) -> list[int]:
    """Context-parallel degrees to try: 1, and for a sequence of LONG_SEQUENCE tokens or more the
    powers of two up to the GPUs that leave each rank MIN_CP_CHUNK tokens or more."""
    if seq_len < LONG_SEQUENCE:
        return [1]
    return [c for c in _powers_of_two_upto(gpus) if c == 1 or (seq_len // c >= MIN_CP_CHUNK and seq_len % (2 * c) == 0)]


def _ep_choices(cfg, dp: int) -> list[int]:
    """Expert-parallel degrees of an MoE model: powers of two dividing dp and the experts (1: none)."""
    if not cfg.is_moe:
        return [1]
    return [e for e in _powers_of_two_upto(dp) if dp % e == 0 and cfg.n_experts % e == 0]


def _shard_groups(zero: int, dp: int, tp: int, gpus_per_node: int) -> list[int | None]:
    """ZeRO-2/3 over every dp rank (None), or hybrid sharding: shard groups of one node's dp
    ranks and of two nodes' (PyTorch HSDP; MiCS), where that leaves more than one replica."""
    groups: list[int | None] = [None]
    if zero >= 2:
        node = max(1, gpus_per_node // tp)
        groups += [g for g in (node, 2 * node) if g < dp and shard_group_problem(dp, g) is None]
    return groups


def _schedules(pp: int, m: int, layers: int) -> list[tuple[str, int]]:
    """GPipe is left out: same bubble as 1F1B (Narayanan §2.2) with m >= min(p, m) micro-batches
    in flight, so it never beats 1F1B on time or memory."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1)]
    if m % pp == 0:
        out += [("interleaved", v) for v in (2, 3, 4) if pp * v <= layers]
    return out
