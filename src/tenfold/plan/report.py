"""Rich tables for `tenfold plan` (the JSON form is `Plan.to_dict()`)."""

from __future__ import annotations

import sys

from rich import box
from rich.console import Console
from rich.table import Table

from tenfold.plan.api import Plan
from tenfold.plan.for_run import batch_line, memory_line
from tenfold.plan.hardware import GEMM_SHARE_OF_MAMF, Hardware

GiB = 2**30


def _gib(x: float | None) -> str:
    return "null" if x is None else f"{x / GiB:,.2f}"


def _secs(x: float) -> str:
    if x >= 1:
        return f"{x:,.2f} s"
    return f"{x * 1e3:,.1f} ms"


def _duration(x: float) -> str:
    if x >= 2 * 86400:
        return f"{x / 86400:,.1f} days"
    if x >= 2 * 3600:
        return f"{x / 3600:,.1f} h"
    return f"{x / 60:,.1f} min" if x >= 120 else _secs(x)


# The strategy keys `_layout` writes (or leaves out only at a value it shows by omission:
# no offload, no shard group, fp32 reduction, cp or ep 1); any other key that differs between the rows of
# one table is added as `key=value`, so two rows never read alike unless they are alike.
_LAYOUT_KEYS = frozenset({"world_size", "pp", "dp", "cp", "ep", "tp", "pp_schedule", "virtual_stages", "stage_layers",
                          "zero_stage", "zero_runs_as", "recompute", "micro_batch", "grad_accum", "global_batch",
                          "offload", "shard_group", "reduce_dtype", "sequence_parallel"})


def _layout(p: Plan, varying: frozenset[str] = frozenset()) -> str:
    """The compact layout of a search row (`zero=1->2`: ZeRO-1 runs as ZeRO-2 there), with every
    key in `varying` (the keys that differ between the table's rows) written."""
    s = p.strategy
    parts = [f"dp={p.dp}", f"tp={s['tp']}", f"pp={s['pp']}"] + ([f"cp={s['cp']}"] if s.get("cp", 1) > 1 else [])
    if s["pp"] > 1:
        parts.append(s["pp_schedule"] + (f"(v={s['virtual_stages']})" if s["virtual_stages"] > 1 else ""))
        parts.append(f"split={_split(s['stage_layers'])}")
    if s["tp"] > 1:
        parts.append("sp" if s["sequence_parallel"] else "no-sp")
    zero = f"{s['zero_stage']}" + (f"->{s['zero_runs_as']}" if s["zero_runs_as"] != s["zero_stage"] and p.dp > 1 else "")
    parts.append(f"zero={zero}")
    if s["shard_group"]:
        parts.append(f"shard-group={s['shard_group']}")
    if s.get("ep", 1) > 1:
        parts.append(f"ep={s['ep']}")
    parts += [f"ac={s['recompute']}", f"mb={p.micro_batch}", f"accum={p.grad_accum}", f"gb={p.global_batch}"]
    if s["offload"] != "none":
        parts.append(f"offload={s['offload']}")
    if s["reduce_dtype"] != "fp32":
        parts.append(f"reduce={s['reduce_dtype']}")
    unwritten = {"pp_schedule", "virtual_stages"} if s["pp"] == 1 else set()  # one stage: no schedule above
    parts += [f"{k}={s[k]}" for k in sorted(varying) if k not in _LAYOUT_KEYS or k in unwritten]
    return " ".join(parts)


def _split(counts: list[int]) -> str:
    """Blocks per stage, runs of equal counts shortened: `1,2x62,1` (126 layers, 64 stages)."""
    runs: list[list[int]] = []
    for n in counts:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ",".join(str(n) if k == 1 else f"{n}x{k}" for n, k in runs)


def varying_keys(plans: list[Plan]) -> frozenset[str]:
    """The strategy keys whose values differ between `plans`."""
    keys = set().union(*(p.strategy for p in plans)) if plans else set()
    return frozenset(k for k in keys if len({repr(p.strategy.get(k)) for p in plans}) > 1)


def print_plan(p: Plan, hw: Hardware, explain: bool = False, console: Console | None = None) -> None:
    c = console or Console()
    active = (f", {p.active_params / 1e9:,.3g}B active" if p.active_params is not None and p.active_params < p.params
              else "")
    c.print(f"[bold]{p.model}[/] ({p.params / 1e9:,.3g}B params{active}) on {p.gpus} x {p.hardware} "
            f"({p.gpus_per_node}/node), {p.strategy['precision']}, seq {p.seq_len}")
    c.print(f"layout: {p.layout_line}; micro-batch {p.micro_batch} x {p.grad_accum} x dp {p.dp} = {p.global_batch}",
            highlight=False)
    c.print(_memory_table(p))
    if p.max_micro_batch is not None:
        c.print(f"largest micro-batch that fits with these settings: {p.max_micro_batch}")
    c.print(_time_table(p))
    c.print(_throughput_table(p))
    for n in p.notes:
        c.print(f"note: {n}")
    if explain:
        print_explain(p, hw, c)


def _memory_table(p: Plan) -> Table:
    m = p.memory
    t = Table(title=f"Memory per GPU ({m.stage} stage)", box=box.SIMPLE_HEAVY)
    t.add_column("component")
    t.add_column("GiB", justify="right")
    t.add_column("how")
    rows = [
        ("parameters", m.params_bytes, "B/param x params on this rank"),
        ("gradients", m.grads_bytes, "B/param x params (÷dp from ZeRO-2)"),
        ("optimizer: fp32 master weights", m.master_weights_bytes, "4 B/param (÷dp from ZeRO-1)"),
        ("optimizer: Adam moments", m.optimizer_moments_bytes, "8 B/param (÷dp from ZeRO-1)"),
        ("= model states", m.model_states_bytes, "ZeRO Table 1"),
        ("activations", m.activations_bytes,
         "null (only --params)" if m.activations_bytes is None else
         f"{_gib(m.activations_per_layer_bytes)} GiB/layer, {m.inflight_microbatches:g} micro-batch(es) in flight"),
        ("communication buffers", m.comm_buffers_bytes, "buckets / gathered units"),
        ("gathered parameters", m.gathered_params_bytes, _gathered_how(m)),
        ("allocator reserve", m.allocator_reserve_bytes, "10% of dynamic memory"),
        ("CUDA context + workspaces", m.runtime_overhead_bytes, "estimate"),
    ]
    for name, v, how in rows:
        if v == 0 and name == "gathered parameters":
            continue
        t.add_row(name, _gib(v), how)
    verdict = "[green]fits[/]" if p.fits else "[red]does not fit[/]"
    t.add_row("[bold]total[/]", f"[bold]{_gib(m.total_bytes)}[/]", f"of {_gib(m.capacity_bytes)} GiB: {verdict}")
    if m.cpu_bytes:
        t.add_row("host memory (offload)", _gib(m.cpu_bytes), "per rank")
    return t


def _gathered_how(m) -> str:
    if m.autocast_weight_copies_bytes:
        return "torch.amp's 16-bit weight casts, kept for backward"
    return "unsharded copies FSDP2 computes with (compute dtype)"


def _time_table(p: Plan) -> Table:
    tt = Table(title="Time per optimizer step", box=box.SIMPLE_HEAVY)
    tt.add_column("component")
    tt.add_column("time", justify="right")
    if p.time.source == "achieved_tflops":
        tt.add_row("step (from --achieved-tflops)", _secs(p.time.step_s))
        return tt
    for name, v in (("compute (fwd + bwd)", p.time.compute_s), ("recompute", p.time.recompute_s),
                    ("TP communication (exposed)", p.time.tp_comm_s), ("PP communication", p.time.pp_comm_s),
                    *((("EP all-to-all", p.time.ep_comm_s),) if p.time.ep_comm_s else ()),
                    ("offload PCIe traffic (exposed)", p.time.host_transfer_s),
                    (f"pipeline bubble ({p.time.bubble_fraction:.1%})", p.time.bubble_s),
                    (f"DP/ZeRO comm exposed (of {_secs(p.time.dp_comm_s)})", p.time.dp_comm_exposed_s),
                    ("optimizer step", p.time.optimizer_s)):
        tt.add_row(name, _secs(v))
    if p.time.embedding_sync_s:
        tt.add_row("tied embedding all-reduce (first + last stage)", _secs(p.time.embedding_sync_s))
    if p.time.overhead_s:
        tt.add_row("overhead (measured: per step + per micro-batch)", _secs(p.time.overhead_s))
    tt.add_row("[bold]step[/]", f"[bold]{_secs(p.time.step_s)}[/]")
    return tt


def _throughput_table(p: Plan) -> Table:
    r = Table(title="Throughput", box=box.SIMPLE_HEAVY)
    r.add_column("metric")
    r.add_column("value", justify="right")
    r.add_row("tokens/s", f"{p.tokens_per_s:,.0f}")
    r.add_row("TFLOP/s per GPU (model FLOPs)", f"{p.tflops_per_gpu:,.1f}")
    r.add_row("TFLOP/s per GPU (incl. recompute)", f"{p.hardware_tflops_per_gpu:,.1f}")
    r.add_row("MFU / HFU", f"{p.mfu:.1%} / {p.hfu:.1%}")
    if p.train_days is not None:
        r.add_row(f"days for {p.tokens:.3g} tokens", f"{p.train_days:,.1f}")
        r.add_row("GPU-hours", f"{p.gpu_hours:,.0f}")
    return r


def print_explain(p: Plan, hw: Hardware, c: Console) -> None:
    t = Table(title="Where each figure comes from", box=box.SIMPLE, show_lines=False)
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("formula")
    t.add_column("source")
    for e in p.explain:
        v = "null" if e.value is None else (f"{e.value / GiB:,.3f} GiB" if e.key.endswith("_bytes") else f"{e.value:,.4g}")
        t.add_row(e.key, v, e.formula, e.source)
    c.print(t)
    h = Table(title=f"Hardware: {hw.name}", box=box.SIMPLE)
    h.add_column("item")
    h.add_column("value")
    h.add_column("source")
    peaks = ", ".join(f"{k} {v / 1e12:,.1f}" for k, v in hw.peak_flops.items() if v)
    h.add_row("peak TFLOP/s (dense)", peaks, hw.sources.get("peak", ""))
    h.add_row("memory", f"{hw.memory_bytes / GiB:,.1f} GiB, HBM {hw.hbm_bw / 1e9:,.0f} GB/s", hw.sources.get("memory", ""))
    h.add_row("intra-node", f"{hw.intra_node_bw / 1e9:,.0f} GB/s per GPU", hw.sources.get("intra", ""))
    h.add_row("inter-node", f"{hw.nic_bw / 1e9:,.1f} GB/s per GPU", hw.sources.get("nic", ""))
    h.add_row("best matmul / peak", f"{hw.matmul_fraction:.3f}", hw.sources.get("matmul", ""))
    share = hw.gemm_efficiency / hw.matmul_fraction
    why = ("calibrated on Narayanan et al. 2021 Table 1 only" if abs(share - GEMM_SHARE_OF_MAMF) < 1e-9
           else "as given (hardware file, or a measured peak)")
    h.add_row("GEMM efficiency ceiling", f"{hw.gemm_efficiency:.3f} of peak", f"{share:.3f} x best matmul, {why}")
    h.add_row("host link", f"{hw.host_link_bw / 1e9:,.0f} GB/s per GPU", hw.sources.get("host", ""))
    if hw.sm_count:
        h.add_row("SMs", f"{hw.sm_count}", hw.sources.get("sms", ""))
    c.print(h)


def print_run(run: dict | None, console: Console | None = None) -> None:
    """The run as `tenfold train` prints it at its start, and how to launch it (or why train cannot)."""
    if run is None:
        return
    c = console or Console()
    c.print(f"the run: {batch_line(run['batch'], run['dp'])} | {run['steps']} steps "
            f"(about {_duration(run['steps_time_s'])}) | {run['processes']} process(es)")
    c.print(memory_line(run["memory_predicted"]), markup=False, highlight=False)
    _print_launch(c, run["unsupported"], run["launch"], run["emitted"])


def _print_launch(c: Console, unsupported: list[str], launch: str | None, emitted: str | None) -> None:
    if unsupported:
        c.print("[red]tenfold train cannot run this:[/] " + "; ".join(unsupported), highlight=False)
    if launch:
        if emitted:
            c.print(f"wrote {emitted}")
        where = " (on every node; HEAD = the first node's hostname)" if launch.startswith("torchrun") else ""
        c.print(f"launch{where}:")
        c.print(f"  {launch}", markup=False, highlight=False, soft_wrap=True)


def print_search(result, hw: Hardware, gpus: int, advice=None, console: Console | None = None) -> None:
    c = console or Console()
    c.print(f"evaluated {result.evaluated} strategies on {gpus} x {hw.name}, global batch {result.global_batch}; "
            f"{result.fitting} fit"
            + (f"; {result.dominated} offloaded twins of fitting layouts skipped as dominated" if result.dominated else "")
            + (f"; {result.unsupported} that tenfold train cannot run left out (--include-unsupported shows them)"
               if result.unsupported else ""))
    if not result.best:
        c.print("[red]no strategy fits[/]: more GPUs, a smaller global batch, or --include-unsupported for "
                "strategies tenfold train cannot run (offload at ZeRO-0/1, another training stack, ...)")
        return
    t = Table(title="Fastest strategies that fit", box=box.SIMPLE_HEAVY)
    for col in ("#", "layout", "GiB/GPU", "step", "tokens/s", "MFU", "days", "train"):
        # the layout folds onto more lines rather than cutting a word (a long split) short
        t.add_column(col, justify="right" if col not in ("layout", "train") else "left",
                     overflow="fold" if col == "layout" else "ellipsis")
    varying = varying_keys(result.best)
    for i, p in enumerate(result.best, 1):
        t.add_row(str(i), _layout(p, varying), _gib(p.memory.total_bytes), _secs(p.step_time_s), f"{p.tokens_per_s:,.0f}",
                  f"{p.mfu:.1%}", "-" if p.train_days is None else f"{p.train_days:,.1f}",
                  "runs" if not p.unsupported else "[red]cannot[/]")
    c.print(t)
    if any(p.train_days is None for p in result.best):
        c.print("days: - without a token budget; --tokens N (training tokens, e.g. 300e9) fills it")
    for i, p in enumerate(result.best, 1):
        if p.unsupported:
            c.print(f"#{i}: tenfold train cannot run it: {'; '.join(p.unsupported)}", highlight=False)
    if advice is None:
        c.print("[red]none of these is a strategy tenfold train runs[/]; rerun without --include-unsupported")
        return
    if result.best[0].unsupported:
        c.print(f"the fastest strategy tenfold train runs: #{result.best.index(next(p for p in result.best if not p.unsupported)) + 1}")
    _print_launch(c, [], advice.launch, advice.emitted)


def _days(d: float) -> str:
    if d >= 100:
        return f"{d:,.0f}"
    return f"{d:.1f}" if d >= 1 else f"{d:.3g}"


def print_ladder(rungs, console: Console | None = None) -> None:
    c = console or Console(width=None if sys.stdout.isatty() else 120)
    seed = rungs[0].seed is not None
    first = rungs[0].plan
    c.print(f"[bold]Optimization ladder[/]: {first.model} on {first.hardware}, {first.tokens:.3g} tokens, seq {first.seq_len}"
            + (" (beside the recipe's own claims)" if seed else ""))
    t = Table(box=box.SIMPLE_HEAVY)
    cols = ["#", "rung", "GPUs", "GiB/GPU", "fits", "days", "time x"]
    if seed:
        cols += ["seed days", "seed x"]
    for col in cols:
        if col == "rung":
            t.add_column(col, min_width=26)
        else:
            t.add_column(col, justify="right", no_wrap=True)
    for i, r in enumerate(rungs):
        p = r.plan
        gib = p.memory.total_bytes / GiB
        row = [str(i), r.name, str(r.gpus), f"{gib:,.0f}" if gib >= 10 else f"{gib:.2f}", "yes" if p.fits else "[red]no[/]",
               _days(p.train_days), "-" if r.factor is None else f"{r.factor:.2f}"]
        if seed:
            row += [f"{r.seed.days:g}", r.seed.factor]
        t.add_row(*row)
    c.print(t)
    for i, r in enumerate(rungs):
        if r.seed is not None:
            c.print(f"[bold]{i}[/] seed memory claim: {r.seed.memory_text}")
        for n in r.notes:
            c.print(f"  - {n}")
