"""Run the selected rungs in order and write the ladder's outputs. On a terminal a progress bar
shows where it is; off a terminal (a log file, CI, `nohup`) or with --no-progress it prints a
line as each rung starts and one as it ends, flushed, so a long ladder is never silent."""

from __future__ import annotations

import datetime as _dt
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tenfold.ladder import measure, predict, report
from tenfold.ladder import rungs as R
from tenfold.ladder.machine import device_type


@dataclass
class Ladder:
    setup: R.LadderSetup
    user_layers: list[dict]  # config layers every rung starts from (model, --set, --seq-len)
    selected: list[str]
    out_dir: Path
    memory_budget: int | None
    timeout_s: float
    model: str
    command: str
    repeats: int = 1  # runs of the whole ladder, alternating order; each rung counts its best
    results: list[measure.RungResult] = field(default_factory=list)
    chosen: dict[str, Any] = field(default_factory=dict)  # the recompute rung's micro-batch choice

    # ------------------------------------------------------------------ rungs

    def user_set_args(self) -> list[str]:
        """The user layers as `--set` items for `tenfold train` (model name first)."""
        out = []
        for layer in self.user_layers:
            for section, keys in layer.items():
                for key, value in keys.items():
                    out += ["--set", f"{section}.{key}={R._toml(value)}"]
        return out

    def default_budget(self) -> int:
        """Twice the planner's peak for the accumulation rung (micro-batch 1, mixed precision):
        a device on which the baseline's batch fits with room to spare, but where a large
        micro-batch without recompute does not."""
        p = predict.predict_rung(R.accum_rung(self.setup), self.user_layers, self.device)
        return int(2 * p.peak_bytes) if p.peak_bytes else 1 << 30

    def activation_scale(self) -> float:
        """measured / predicted activations of the last micro-batch-1 rung in mixed precision."""
        for r in reversed(self.results):
            if r.name in ("accum", "mixed") and r.status == "measured":
                m, p = r.memory.get("activations_bytes"), r.predicted_memory.get("activations_bytes")
                if m and p:
                    return max(0.25, min(4.0, m / p))  # a wild ratio is a measurement problem, not a scale
        return 1.0

    def spec_for(self, name: str, chosen: dict[str, Any]) -> R.RungSpec:
        s = self.setup
        if name == "fp32":
            return R.fp32_rung(s)
        if name == "mixed":
            return R.mixed_rung(s)
        if name == "accum":
            return R.accum_rung(s)
        mb = chosen.get("micro_batch")
        if mb is None:
            choice = predict.choose_micro_batch(s, self.user_layers, self.memory_budget, self.activation_scale(), self.device)
            chosen.update(micro_batch=choice.micro_batch, policy=choice.policy, note=choice.note,
                          candidates=choice.candidates)
            mb = choice.micro_batch
        if name == "recompute":
            return R.recompute_rung(replace(s, ac_policy=chosen["policy"]), mb, chosen["note"])
        rung = R.zero_rung if name == "zero" else R.pipeline_rung

        def build(policy: str) -> R.RungSpec:
            return rung(replace(s, ac_policy=policy), mb)

        spec = build(chosen["policy"])  # a fixed --ac: the recompute rung's policy, kept by the rungs after it
        if s.ac_policy == "auto" and spec.skip is None:  # auto: what this rung's per-rank memory still needs
            pc = predict.choose_policy(build, self.user_layers, self.memory_budget, self.activation_scale(), self.device)
            spec = build(pc.policy)
            spec.notes.append(pc.note)
            chosen.setdefault("later_rungs", {})[name] = {"policy": pc.policy, "note": pc.note, "candidates": pc.candidates}
        return spec

    # ------------------------------------------------------------------ run

    def run(self, show_progress: bool = True) -> int:
        self.device = device_type()
        if self.memory_budget is None:
            self.memory_budget = self.default_budget()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        header = self.header()
        chosen = self.chosen
        exit_on_sigterm()
        bar = show_progress and sys.stdout.isatty()
        self.lines = not bar
        progress = _progress(bar)
        with progress:
            task = progress.add_task("ladder", total=len(self.selected) * self.repeats, detail="")
            first: dict[str, tuple[R.RungSpec, predict.Prediction]] = {}
            for name in self.selected:  # run 1: each rung's spec may depend on the rungs measured before it
                spec = self.spec_for(name, chosen)
                progress.update(task, description=f"rung {spec.index} {name}", detail="predicting")
                pred = predict.predict_rung(spec, self.user_layers, self.device)
                first[name] = (spec, pred)
                self.results.append(self._measure(spec, pred, 1, progress, task))
                self._record(header, progress, task, self.results[-1], 1)
            for run in range(2, self.repeats + 1):
                # runs 2, 4, ... go backwards: a slow spell of the machine does not fall on the
                # same end of the ladder every time
                order = list(reversed(self.selected)) if run % 2 == 0 else self.selected
                for name in order:
                    spec, pred = first[name]
                    result = self.results[self.selected.index(name)]
                    again = None
                    if spec.skip is None and result.status == "measured":
                        again = self._measure(spec, pred, run, progress, task)
                        measure.add_repeat(result, again)
                    self._record(header, progress, task, result, run, again)
        return self.finish(header)

    def _measure(self, spec: R.RungSpec, pred: predict.Prediction, run: int, progress, task) -> measure.RungResult:
        """Run `spec` once (run k > 1 writes OUT/rung_<i>_<name>/run_<k>/), with step progress."""
        label = f"rung {spec.index} {spec.name}" + (f" (run {run}/{self.repeats})" if self.repeats > 1 else "")
        steps = spec.overrides["train"]["steps"]
        if self.lines and spec.skip is None:
            _say(f"{label}: {steps} steps, {self.setup.budget_tokens:,} tokens, at most {self.timeout_s:,.0f} s")

        def on_step(done: int) -> None:
            progress.update(task, description=label, detail=f"step {done}/{steps}")

        out = self.out_dir / f"rung_{spec.index}_{spec.name}"
        if run > 1:
            out = out / f"run_{run}"
        return measure.run_rung(spec, out, self.user_set_args(), pred, self.timeout_s, on_step)

    def _record(self, header: dict[str, Any], progress, task, result: measure.RungResult, run: int,
                again: measure.RungResult | None = None) -> None:
        """Multipliers and ladder.json after every run of a rung (an interrupted ladder keeps
        them); off a terminal, the line of the run that just ended (`again`: a repeat)."""
        report.add_multipliers(self.results)
        report.write_json(self.out_dir / "ladder.json", report.ladder_dict(self.results, header))
        if self.lines and (run == 1 or again is not None):
            _say(report.rung_line(again or result, run if self.repeats > 1 else None))
        progress.update(task, advance=1, detail=f"{result.status}"
                        + (f", {result.tokens_per_s:,.0f} tok/s" if result.tokens_per_s else ""))

    def finish(self, header: dict[str, Any]) -> int:
        header["finished"] = _now()
        if self.chosen:
            header["micro_batch_choice"] = dict(self.chosen)  # the recompute rung's memory-budget search
        report.print_table(self.results, header)
        report.write_json(self.out_dir / "ladder.json", report.ladder_dict(self.results, header))
        (self.out_dir / "ladder.md").write_text(report.markdown(self.results, header))
        report.plot(self.results, header, self.out_dir / "ladder.png")
        verdict = report.best_line(self.results)
        import sys

        from rich.console import Console

        c = Console(width=None if sys.stdout.isatty() else 170)
        if verdict is not None:
            c.print(verdict, highlight=False, markup=False)
        c.print("wrote:\n" + "\n".join(f"  {self.out_dir / name}" for name in ("ladder.json", "ladder.md", "ladder.png")),
                highlight=False, soft_wrap=True)
        return 0 if any(r.status == "measured" for r in self.results) else 1

    def header(self) -> dict[str, Any]:
        s = self.setup
        return {
            "hardware": hardware_info(self.device),
            "model": self.model,
            "date": _now(),
            "command": self.command,
            "budget_tokens": s.budget_tokens,
            "seq_len": s.seq_len,
            "global_batch": s.global_batch,
            "nproc": s.nproc,
            "memory_budget_bytes": self.memory_budget,
            "rungs_selected": self.selected,
            "user_layers": self.user_layers,
            "repeats": self.repeats,
            "tokens_per_s_definition": "global batch x seq_len x steps after the first / their elapsed time"
                                       + ("; the best of the rung's runs (tokens_per_s_runs)" if self.repeats > 1 else ""),
        }


def _say(text: str) -> None:
    print(text, flush=True)  # a log file or pipe sees it now, not when the ladder ends


def exit_on_sigterm() -> None:
    """SIGTERM -> SystemExit, so the running rung's process group is stopped on the way out."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def hardware_info(device: str) -> dict[str, Any]:
    import torch

    from tenfold.engine.memory.measure import planner_hardware_name
    from tenfold.plan.hardware import cpu_model_name

    info: dict[str, Any] = {"device": device, "cpu": cpu_model_name(), "cores": os.cpu_count(),
                            "torch": torch.__version__, "threads": torch.get_num_threads(),
                            "planner_hardware": planner_hardware_name(torch.device(device))}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
        info["description"] = f"{torch.cuda.device_count()} x {info['gpu']}"
    else:
        from tenfold.engine.observe.peak import cpu_peak_flops

        info["peak_flops"] = {d: cpu_peak_flops(d) for d in ("fp32", "bf16")}
        info["description"] = f"{info['cpu']}, {info['cores']} cores"
    return info


def _progress(enabled: bool):
    from contextlib import nullcontext

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not enabled:
        class _Quiet(nullcontext):
            def add_task(self, *a, **k):
                return 0

            def update(self, *a, **k):
                pass

        return _Quiet()
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[detail]}"), TimeElapsedColumn())
