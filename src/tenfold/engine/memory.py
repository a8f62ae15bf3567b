"""Memory of one training step, measured and predicted, with the same keys.

Measured (`measure_step_memory`):
  * CPU: a tensor-level tracker, PyTorch's `torch.distributed._tools.mem_tracker.MemTracker`
    (a TorchDispatchMode that sees every storage the step creates and frees, and tells
    parameters, buffers, gradients, optimizer states and activations apart through module,
    gradient and optimizer hooks; tenfold.engine.tensor_tracker). The process's RSS cannot
    separate these categories.
  * CUDA: the caching allocator's statistics (`max_memory_allocated`) for the peak and tensor
    sizes for the model states (params, gradients, optimizer states, buffers).

Keys (ints, bytes; `MEMORY_KEYS`), the names the planner (`tenfold.plan`) uses:
  params_bytes, grads_bytes, optimizer_bytes  model states as held at the optimizer step
                                              (after backward, before gradients are freed)
  gathered_params_bytes                       unsharded working copies of parameters (FSDP2's
                                              all-gathered units, torch.amp's 16-bit weight
                                              casts) at their highest in the step
  activations_bytes                           tensors saved for backward plus temporaries
                                              (MemTracker's Activation + Temp) at their highest
                                              in the step (forward/backward), gathered copies not
  buffers_bytes, other_bytes                  non-parameter module buffers (RoPE tables), other
  peak_bytes                                  the step's peak total (every category at that moment)
  total_bytes                                 params + grads + optimizer + gathered params +
                                              activations, the
                                              planner's sum (an upper bound of the peak: not all
                                              gradients are live when activations peak)

Predicted (`predicted_memory`): the planner's `Plan.memory` for the resolved config, with
peak_bytes = the planner's total (its estimate of the peak).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn
from rich.console import Console, Group
from rich.table import Table

from tenfold.engine.distributed import gather_to_main
from tenfold.engine.memory_notes import row_notes
from tenfold.engine.metrics import peak_memory_bytes
from tenfold.engine.tensor_tracker import (
    category_bytes,
    gathered_bytes_now,
    gathered_tensors,
    measure_cpu,
    model_states_plus_activations,
    optimizers_of,
    unique_nbytes,
)
from tenfold.engine.tracker_probe import tracker_available
from tenfold.errors import RunError

# torch-free: `tenfold plan` reports the same prediction in the same words
from tenfold.plan.for_run import MEMORY_LINE_NAMES, fmt_bytes, memory_by_category, memory_line, predict_run_memory
from tenfold.plan.hardware import CATALOG
from tenfold.terms import MULTI_STAGE_SCHEDULES

if TYPE_CHECKING:  # typing only: engine/parts.py asks this module for the planner's hardware name
    from tenfold.engine.parts import Parts

# One import stays inside a function (`_ModState` in `module_rows`): private PyTorch API, loaded
# only once a tracker has run, so a torch without it still trains (tenfold.engine.tracker_probe).

MEMORY_KEYS = (
    "params_bytes", "grads_bytes", "optimizer_bytes", "gathered_params_bytes", "activations_bytes",
    "buffers_bytes", "other_bytes", "peak_bytes", "total_bytes",
)
log = logging.getLogger("tenfold")
COMPARED_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "gathered_params_bytes", "activations_bytes",
                 "peak_bytes")


# --------------------------------------------------------------------------- CUDA allocator


def _optimizer_state_tensors(optimizers) -> list[torch.Tensor]:
    return [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _measure_cuda(model, optimizer, run_step, device) -> dict:
    """Peak from the allocator; model states from tensor sizes. The allocator cannot tell
    activations from gradients, so activations_bytes = peak - (memory held when the step
    started: params, buffers, optimizer states) - gradients live at the peak (bounded by the
    gradients held at the optimizer step) - FSDP2's gathered parameters (their highest, read
    as each module's forward starts and ends): a lower bound of activations.
    torch.amp's weight casts (DDP, one process) stay in it: the allocator does not see them."""
    optimizers = optimizers_of(optimizer)
    params = [p for p in model.parameters()]
    grads_at_step: dict[str, int] = {}
    handles = [
        opt.register_step_pre_hook(
            lambda *_: grads_at_step.setdefault("g", unique_nbytes(p.grad for p in params)))
        for opt in optimizers
    ]
    gathered, most = gathered_tensors(model), [0]
    if gathered:
        def sample(*_):
            most[0] = max(most[0], gathered_bytes_now(gathered))

        for m in model.modules():  # after FSDP2's own hooks: a unit just gathered, or the stage at its end
            handles += [m.register_forward_pre_hook(sample), m.register_forward_hook(sample)]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    try:
        run_step()
    finally:
        for h in handles:
            h.remove()
    torch.cuda.synchronize(device)
    peak = int(torch.cuda.max_memory_allocated(device))
    grads = grads_at_step.get("g", 0)
    measured = {
        "params_bytes": unique_nbytes(params),
        "grads_bytes": grads,
        "optimizer_bytes": unique_nbytes(_optimizer_state_tensors(optimizers)),
        "gathered_params_bytes": most[0],
        "activations_bytes": max(0, peak - start - grads - most[0]),
        "buffers_bytes": unique_nbytes(model.buffers()),
        "other_bytes": 0,
        "peak_bytes": peak,
    }
    measured["total_bytes"] = model_states_plus_activations(measured)
    return measured


# --------------------------------------------------------------------------- public API


def _device_of(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def measure_step_memory(
    model: nn.Module, optimizer: Any, run_step: Callable[[], None], device: torch.device | str | None = None
) -> dict[str, int]:
    """Run `run_step()` (forward + backward over all micro-batches + optimizer step) once and
    return its memory by category (`MEMORY_KEYS`, bytes). Call it on a step >= 2, when the
    optimizer states exist before the step (as in every later step); on step 1 they are
    created inside the step and are still counted (from the end of the optimizer step)."""
    dev = _device_of(model, device)
    if dev.type == "cuda":
        return _measure_cuda(model, optimizer, run_step, dev)
    return measure_cpu(model, optimizer, run_step, dev)[0]


class MemoryReport:
    """The result of `memory_report`: `measured` (MEMORY_KEYS), `rows` (per module) and a rich
    rendering (category summary beside `predicted` if given, then the per-module table)."""

    def __init__(self, measured: dict, rows: list[dict], predicted: dict | None = None):
        self.measured, self.rows, self.predicted = measured, rows, predicted
        self.note: str | None = None

    def __rich__(self):
        parts = [comparison_table(self.measured, self.predicted), rows_table(self.rows)]
        return Group(*parts, *([self.note] if self.note else []))

    def __str__(self) -> str:
        console = Console(width=120, record=True, file=open("/dev/null", "w"))
        console.print(self)
        return console.export_text()


def memory_report(
    model: nn.Module, optimizer: Any, run_step: Callable[[], None], device: torch.device | str | None = None,
    depth: int = 4, predicted: dict | None = None,
) -> MemoryReport:
    """Measure one step with the tensor-level tracker (also on GPU: it attributes memory to
    modules) and return a `MemoryReport` (printable with rich): the category summary and the
    per-module breakdown (FQN depth <= `depth`; the root is depth 1, tenfold's blocks
    `GPT.layers.i` depth 3, their attention/MLP depth 4). `tenfold train --memory-report` prints it.
    As for `measure_step_memory`, run a warm-up step first so the optimizer states exist."""
    dev = _device_of(model, device)
    measured, tracker = measure_cpu(model, optimizer, run_step, dev, per_module=True)
    if dev.type == "cuda":  # the allocator's peak is the truth on GPU; keep both visible
        measured["peak_bytes"] = max(measured["peak_bytes"], int(torch.cuda.max_memory_allocated(dev)))
    return MemoryReport(measured, module_rows(tracker, dev, depth), predicted)


def module_rows(tracker, device: torch.device, depth: int = 4) -> list[dict]:
    """Per module (the last micro-batch's forward/backward): parameters, buffers, input and
    output, what its forward left allocated (saved activations + output), peak during its
    forward and its backward."""
    from torch.distributed._tools.mem_tracker import _ModState

    def total(snaps) -> int:
        return max((category_bytes(s, device)["total"] for s in snaps or []), default=0)

    rows = []
    for stats in tracker.memory_tracking.values():
        fqn = stats.mod_fqn
        if fqn.count(".") + 1 > depth:
            continue
        pre = stats.snapshots.get(_ModState.PRE_FW, [])
        post = stats.snapshots.get(_ModState.POST_FW, [])
        kept = (
            category_bytes(post[-1], device)["total"] - category_bytes(pre[-1], device)["total"]
            if pre and post else 0
        )
        rows.append({
            "module": fqn, "params": getattr(stats, "parameter_mem", 0), "buffers": getattr(stats, "buffer_mem", 0),
            "input": getattr(stats, "input_mem", 0), "output": getattr(stats, "output_mem", 0),
            "forward_kept": kept, "peak_forward": total(stats.snapshots.get(_ModState.PEAK_FW)),
            "peak_backward": total(stats.snapshots.get(_ModState.PEAK_BW)),
        })
    return sorted(rows, key=lambda r: _natural_key(r["module"]))


def _natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def rows_table(rows: list[dict]):
    t = Table(title="memory by module, MiB (one step, last micro-batch; fw kept = left allocated by its forward)",
              title_justify="left")
    t.add_column("module", no_wrap=True)
    for col in ("param", "buf", "in", "out", "fw kept", "pk fw", "pk bw"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["module"], *(f"{r[k] / 2**20:.2f}" for k in (
            "params", "buffers", "input", "output", "forward_kept", "peak_forward", "peak_backward")))
    return t


def percent_diff(measured: dict, predicted: dict | None) -> dict[str, float | None]:
    """100 * (measured - predicted) / predicted, per key (None where undefined)."""
    out: dict[str, float | None] = {}
    for k in COMPARED_KEYS + ("total_bytes",):
        p, m = (predicted or {}).get(k), measured.get(k)
        out[k] = None if not p or m is None else round(100.0 * (m - p) / p, 2)
    return out


def comparison_table(measured: dict, predicted: dict | None = None, title: str = "memory per rank, one step"):
    t = Table(title=title, title_justify="left")
    t.add_column("")
    if predicted is not None:
        t.add_column("predicted", justify="right")
    t.add_column("measured", justify="right")
    if predicted is not None:
        t.add_column("diff", justify="right")
    diff = percent_diff(measured, predicted)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "gathered_params_bytes", "activations_bytes",
                "buffers_bytes", "peak_bytes", "total_bytes"):
        row = [MEMORY_LINE_NAMES.get(key, key.removesuffix("_bytes"))]
        if predicted is not None:
            row.append(fmt_bytes(predicted.get(key)))
        row.append(fmt_bytes(measured.get(key)))
        if predicted is not None:
            row.append("-" if diff.get(key) is None else f"{diff[key]:+.1f}%")
        t.add_row(*row)
    return t


# --------------------------------------------------------------------------- predicted


def planner_hardware_name(device: torch.device) -> str:
    """The planner's catalog entry for this device: `cpu`, or the CUDA device's name matched
    against the catalog (H100 SXM when nothing matches: memory is what is compared here and
    the catalog's capacity does not enter the predicted bytes)."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for family, key in (("h200", "h200"), ("b200", "b200"), ("mi300", "mi300x"), ("l40s", "l40s"),
                        ("4090", "rtx4090"), ("v100", "v100")):
        if family in name and key in CATALOG:
            return key
    if "h100" in name:
        return "h100-pcie" if "pcie" in name else "h100-sxm"
    if "a100" in name:
        return "a100-40gb" if "40gb" in name else "a100-80gb"
    return "h100-sxm"


def predicted_memory(run, device: torch.device | None = None, dtype: str | None = None, plan=None,
                     params: float | None = None) -> dict[str, int]:
    """The planner's per-rank prediction for a resolved run (tenfold.run), under the
    measurement's keys.

    `dtype`: the precision the engine actually runs (bf16 falls back to fp32 where the device
    lacks it); default the configured one. `plan`: an already computed `Plan`. `params`: the
    parameter count of a user's own module, whose shape the config does not describe (then only
    model states are predicted, activations are 0). The categories are
    `tenfold.plan.for_run.memory_by_category`'s, which `tenfold plan` reports too.
    """
    if plan is not None:
        return memory_by_category(plan.memory)
    hardware = planner_hardware_name(device or torch.device("cpu"))
    return memory_by_category(predict_run_memory(run, hardware, dtype, params))  # no time: no peak to wait on


# --------------------------------------------------------------------------- one run


class RunMemory:
    """Predicted vs measured memory of one `tenfold train` run (engine/fit.py builds it).

    At start: the planner's per-rank prediction, printed. At step `measure_at` (this run's
    second step, also after a resume: the optimizer states exist by then, as in every later
    step; its first for a one-step run): the step runs under the tracker. At the end:
    `summary()` for summary.json's `memory` section (`predicted`, `measured`, `diff_percent`)
    and `add_summary_rows()` for the summary table.
    """

    def __init__(self, parts: Parts, start_step: int, own_model: bool):
        """`parts`: the run's parts; `start_step`: the counters' step (> 0 after a resume);
        `own_model`: the model is a user's module (its parameter count feeds the prediction)."""
        self.parts, self.own_model = parts, own_model
        self.predicted: dict | None = None
        self.measured: dict | None = None
        self.measured_step: int | None = None
        self.note: str | None = None
        self.measure_at = start_step + 2 if parts.train.steps >= start_step + 2 else start_step + 1

    def predict(self) -> dict | None:
        p = self.parts
        params = float(p.adapter.param_count) if self.own_model else None
        try:
            self.predicted = predicted_memory(p.run, p.dist.device, p.precision.name, params=params)
        except Exception as exc:  # noqa: BLE001 - the prediction must never stop a training run
            self.predicted, self.note = None, f"no prediction: {type(exc).__name__}: {exc}"
        return self.predicted

    def announce(self, console) -> None:
        self.predict()
        if console is None:
            return
        if self.predicted is None:
            console.print(f"memory per rank: {self.note}")
            return
        console.print(f"{memory_line(self.predicted)}; measured at step {self.measure_at}")

    def step(self, step_number: int, run_step: Callable[[], Any]) -> Any:
        """Run `run_step()` (one optimizer step); measured when it is the representative step."""
        if step_number != self.measure_at or self.measured is not None:
            return run_step()
        t = self.parts
        run = t.run
        if run.pp > 1 and run.pp_schedule in MULTI_STAGE_SCHEDULES and t.dist.device.type != "cuda":
            # The tensor tracker's module hooks break a multi-stage schedule's stage backward
            # ("Failed to run stage backward ... Output gradient grad=False", torch 2.13): the
            # per-rank figure is then the process's peak resident set (summary's measured_per_rank).
            self.note = f"not measured by category: the tensor tracker cannot follow the {run.pp_schedule} schedule"
            return run_step()
        usable, why = tracker_available() if t.dist.device.type != "cuda" else (True, None)
        if not usable:
            self.note = f"memory was not measured: {why}"
            if t.dist.is_main:
                log.warning(f"tenfold: warning: {self.note}; training goes on")
            return run_step()
        out: list = []
        self.measured = measure_step_memory(t.model, t.optimizer, lambda: out.append(run_step()), t.dist.device)
        self.measured_step = step_number
        return out[0]

    def summary(self) -> dict:
        method = None
        if self.measured is not None:
            method = "cuda allocator" if self.parts.dist.device.type == "cuda" else "tensor tracker (MemTracker)"
        out = {
            "predicted": self.predicted, "measured": self.measured,
            "diff_percent": percent_diff(self.measured, self.predicted) if self.measured and self.predicted else None,
            "measured_step": self.measured_step, "measured_by": method,
        }
        if self.note:
            out["note"] = self.note
        t = self.parts
        out["notes"] = row_notes(self.predicted, self.measured, t.run.zero_stage, t.dist.dp_size,
                                 self.own_model, t.run.offload, t.dist.device.type == "cpu")
        dist = t.dist
        if dist.world_size > 1:  # every rank's measured step (memory.measured's keys), on rank 0
            mine = self.measured or {"peak_bytes": peak_memory_bytes(dist.device)}
            out["measured_per_rank"] = gather_to_main(mine, dist)
        return out


def add_summary_rows(table, memory: dict) -> None:
    """Predicted vs measured rows for the trainer's final summary table: one step's tracked
    tensors, by category, and their peak (the process's peak RSS is another row, summary.py)."""
    pred, meas = memory.get("predicted"), memory.get("measured")
    if not meas:
        if memory.get("note"):
            table.add_row("memory", memory["note"])
        return
    diff, notes = memory.get("diff_percent") or {}, memory.get("notes") or {}
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "gathered_params_bytes", "activations_bytes",
                "total_bytes", "peak_bytes"):
        if key not in meas:  # a summary written before the key existed
            continue
        p = f"{fmt_bytes(pred.get(key))} predicted, " if pred else ""
        d = f" ({diff[key]:+.1f}%)" if diff.get(key) is not None else ""
        names = {"total_bytes": "sum p+g+o+gp+a", "peak_bytes": "peak, tracked tensors", **MEMORY_LINE_NAMES}
        label = names.get(key, key.removesuffix("_bytes"))
        note = f"\n[dim]{notes[key]}[/]" if notes.get(key) else ""
        table.add_row(f"memory: {label}", f"{p}{fmt_bytes(meas[key])} measured{d}{note}")


def run_memory_report(parts: Parts, train_step: Callable[[list[dict]], Any], own_model: bool, depth: int = 4):
    """`tenfold train --memory-report`: one warm-up step (creates the optimizer states), then
    one step under the tracker; returns the `MemoryReport` (predicted beside measured).
    `train_step(micro_batches)`: one optimizer step on the set-up `parts`."""
    usable, why = tracker_available()
    if not usable:
        raise RunError(f"--memory-report needs PyTorch's tensor tracker: {why}")
    train_step(parts.loader.next_step())
    batches = parts.loader.next_step()
    rm = RunMemory(parts, 0, own_model)
    predicted = rm.predict()
    report = memory_report(parts.model, parts.optimizer, lambda: train_step(batches),
                           parts.dist.device, depth=depth, predicted=predicted)
    report.note = rm.note
    return report
