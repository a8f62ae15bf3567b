"""What a run says about itself: the header line at the start, `summary.json` and the summary
table at the end. Built from plain values, so the training loop only hands over what it measured."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class RunFacts:
    """What the summary reports about the run itself (not what it measured)."""

    config: dict
    model_label: str
    blocks: str
    params: int
    flops_per_token: float
    device: str
    world_size: int
    dtype: str
    peak_flops_per_device: float | None
    batch: dict  # micro_batch, grad_accum, global_batch, seq_len
    mfu_note: str | None = None  # why no MFU is reported (a dtype without fast kernels here)
    layout: dict | None = None  # the resolved run's layout (tenfold.run.ResolvedRun.layout), as `tenfold plan` prices it
    peak_source: str = ""  # where the MFU peak comes from (a datasheet, or this CPU's cached measurement)
    layout_line: str = ""


def header_line(facts: RunFacts, steps: int, dp: int, device_type: str, tp: int = 1) -> str:
    b = facts.batch
    split = f" | tp {tp}" if tp > 1 else ""
    fp8 = " + fp8 matmuls" if facts.config.get("precision", {}).get("fp8") else ""
    return (
        f"[bold]tenfold train[/] {facts.model_label} ({facts.params / 1e6:.2f}M params) | {facts.dtype}{fp8} | "
        f"batch {b['global_batch']} = {b['micro_batch']} x {b['grad_accum']} x dp {dp}{split} "
        f"| seq {b['seq_len']} | {steps} steps | {facts.world_size} process(es) on {device_type}"
    ) + (f"\nlayout: {facts.layout_line}" if facts.layout_line else "")


def mfu(flops_per_token: float, tokens_per_s: float | None, peak: float | None,
        devices: int) -> tuple[float | None, str | None]:
    """(MFU, None) or (None, why not). Model FLOPs utilisation: model FLOPs per second over the
    devices' dense peak (PaLM, Chowdhery et al. 2022, appendix B). A rate above the peak means
    the peak is wrong (measured while the machine was busy, or for another thread count), and
    no MFU above 100% is ever reported."""
    if not peak or not tokens_per_s:
        return None, None
    value = flops_per_token * tokens_per_s / (peak * devices)
    if value > 1.0:
        return None, (f"the run's {flops_per_token * tokens_per_s / devices / 1e9:,.1f} GFLOP/s per device exceed "
                      f"the peak used for MFU ({peak / 1e9:,.1f}): the peak was measured while the machine was "
                      "busy; on a CPU it is measured again at the end of the next run")
    return value, None


def build_summary(facts: RunFacts, history: list, totals: dict, last: dict, wall_s: float,
                  step_times: list | None = None) -> dict:
    """summary.json's content. `history`: (step, loss) of every step; `totals`: steps, tokens,
    skipped_steps, val_loss, loss_scale, compile_s (None without torch.compile); `step_times`: `steady.StepTime` of this run's steps.
    tokens_per_s is the steady-state rate (engine/observe/steady.py), with the warm-up on its own and
    tokens_per_s_overall = this run's tokens / its wall time (evaluation and checkpoints
    included); after a resume `tokens` counts every run's, `tokens_this_run` this one's."""
    from tenfold.engine.observe.step_log import process_peak_label
    from tenfold.engine.observe.steady import steady_state

    tokens = totals["tokens"]
    this_run = sum(t.tokens for t in step_times or [])
    steady = steady_state(step_times or [])
    tps = steady["tokens_per_s"]
    value, note = mfu(facts.flops_per_token, tps, facts.peak_flops_per_device, facts.world_size)
    if note and facts.device.startswith("cpu"):  # a run beat the cached CPU peak: it is too low
        from tenfold.engine.observe.peak import note_exceeded

        note_exceeded(facts.dtype, facts.flops_per_token * tps / facts.world_size, ranks=facts.world_size)
    return {
        "config": facts.config,
        "model": {"name": facts.model_label, "blocks": facts.blocks, "params": facts.params,
                  "flops_per_token": facts.flops_per_token},
        "hardware": {"device": facts.device, "world_size": facts.world_size,
                     "peak_flops_per_device": facts.peak_flops_per_device, "peak_source": facts.peak_source,
                     "dtype": facts.dtype},
        "batch": dict(facts.batch),
        "layout": facts.layout,
        "final": {
            "steps": totals["steps"], "tokens": tokens, "skipped_steps": totals["skipped_steps"],
            "first_loss": history[0][1] if history else None, "loss": last.get("loss"),
            "val_loss": totals["val_loss"], "wall_s": wall_s, "tokens_per_s": tps,
            "tokens_this_run": this_run, "first_step": step_times[0].step if step_times else None,
            "tokens_per_s_overall": this_run / wall_s if wall_s > 0 and step_times else None,
            "warmup_steps": steady["warmup_steps"], "warmup_s": steady["warmup_s"],
            "steady_from_step": steady["steady_from_step"], "steady_steps": steady["steady_steps"],
            "memory_measurement_s": steady["memory_measurement_s"], "compile_s": totals.get("compile_s"),
            "mfu": value, "mfu_note": note or facts.mfu_note,
            "loss_scale": totals["loss_scale"],
        },
        "losses": [loss for _, loss in history],
        "memory": {"peak_mem_bytes": last.get("peak_mem_bytes"),  # the process's, as the step lines show it
                   "peak_mem_of": process_peak_label(facts.device.split(":")[0])},
    }


def summary_table(summary: dict, out_dir: Path):
    """The table printed at the end of a run (predicted beside measured memory included)."""
    from rich.table import Table

    from tenfold.engine.memory.measure import add_summary_rows

    f = summary["final"]
    t = Table(title="tenfold train: summary", show_header=False)
    t.add_row("steps (skipped)", f"{f['steps']} ({f['skipped_steps']})")
    resumed = f.get("first_step") and f["first_step"] > 1
    t.add_row("tokens", f"{f['tokens']:,}" + (f" ({f['tokens_this_run']:,} in this run, resumed at step "
                                               f"{f['first_step'] - 1})" if resumed else ""))
    if f["first_loss"] is not None and f["loss"] is not None:
        drop = 100 * (1 - f["loss"] / f["first_loss"]) if f["first_loss"] else 0.0
        t.add_row("loss first -> last", f"{f['first_loss']:.4f} -> {f['loss']:.4f} ({drop:.0f}% lower)")
    if f["val_loss"] is not None:
        t.add_row("validation loss", f"{f['val_loss']:.4f}")
    t.add_row("wall time", f"{f['wall_s']:.1f} s")
    if f["tokens_per_s"]:
        overall = (f" ({f['tokens_per_s_overall']:,.0f} over this run's whole wall time)"
                   if f["tokens_per_s_overall"] else "")
        t.add_row("tokens/s (steady state)", f"{f['tokens_per_s']:,.0f} from step {f['steady_from_step']}{overall}")
        t.add_row("warm-up", f"{f['warmup_steps']} step(s), {f['warmup_s']:.1f} s"
                  + (f" (+ {f['memory_measurement_s']:.1f} s: the step measured for memory)"
                     if f["memory_measurement_s"] else ""))
    if f.get("compile_s") is not None:
        t.add_row("torch.compile", f"{f['compile_s']:.1f} s compiling (not in the warm-up or tokens/s)")
    if f["mfu"] is not None:
        peak = summary["hardware"].get("peak_flops_per_device") or 0.0
        t.add_row("MFU", f"{f['mfu']:.1%} of {peak / 1e9:,.1f} GFLOP/s per rank: {summary['hardware'].get('peak_source', '')}")
    elif f.get("mfu_note"):
        t.add_row("MFU", f"not reported: {f['mfu_note']}")
    add_summary_rows(t, summary.get("memory", {}))
    memory = summary.get("memory", {})
    if memory.get("peak_mem_bytes"):
        from tenfold.plan.for_run import fmt_bytes

        label = memory.get("peak_mem_of", "peak RSS")
        what = ("the CUDA allocator's high-water mark over the run" if label == "peak allocated" else
                "the process's highest resident set: tensors and the libraries, allocator caches, data")
        t.add_row(f"memory: {label} (process)", f"{fmt_bytes(memory['peak_mem_bytes'])}\n[dim]{what}; not predicted[/]")
    t.add_row("output", str(out_dir))
    return t


def outputs_text(paths: list[tuple[str, str]]) -> str:
    """The closing lines: every file or folder the run wrote, one per line."""
    width = max((len(p) for p, _ in paths), default=0)
    return "wrote:\n" + "\n".join(f"  {p:<{width}}  {what}" for p, what in paths)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Through `NAME.tmp` and a rename; a link planted at either name is replaced, never
    written through (`safe_files.Folder.write_atomic`)."""
    from tenfold.engine.outputs.safe_files import Folder

    with Folder(path.parent, follow=True) as folder:
        folder.write_atomic(path.name, json.dumps(obj, indent=2, default=str).encode(), scratch=path.name + ".tmp")
