"""The run around the steps (`Trainer.fit`): open the outputs (folder, header, resume, metrics,
progress, signals, watchdog), step until done or preempted (evaluate, log, checkpoint), then
the summary and exports (engine/outputs/records.py). Reads the run's layout from the resolved run;
the loop's own settings (steps, logging, checkpoints) from its config. Works on the run's parts
(engine/loop/parts.py) and its counters (`TrainState`); one step is the callable it is given.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from tenfold.engine.outputs import records as run_outputs
from tenfold.engine.observe import summary as run_summary
from tenfold.config import TenfoldConfig
from tenfold.engine.loop import step
from tenfold.engine.outputs.checkpoint import CheckpointManager, read_latest, training_states
from tenfold.engine.loop.lora_run import LoraCheckpointState
from tenfold.engine.memory.measure import RunMemory
from tenfold.engine.observe.metrics import MetricsWriter, peak_memory_bytes
from tenfold.engine.loop.parts import Parts
from tenfold.engine.outputs.folder import RunFolder
from tenfold.engine.observe.steady import StepTime
from tenfold.engine.observe.step_log import StepLog, process_peak_label
from tenfold.engine.observe.watchdog import start_watchdog
from tenfold.techniques.compile import CompileClock, compile_failures
from tenfold.techniques.precision import StepResult

log = logging.getLogger("tenfold")


@dataclass
class TrainState:
    """Counters that a checkpoint must carry for an exact resume."""

    step: int = 0  # optimizer steps attempted (taken + skipped)
    tokens: int = 0  # tokens consumed (inputs, whole global batch)
    skipped: int = 0  # steps skipped for overflow / non-finite loss
    history: list = field(default_factory=list)  # (step, loss) of every step, for the summary
    global_batch: int = 0  # sequences per step of the run that saved it (0: not recorded)

    def state_dict(self) -> dict:
        """The counters as JSON data. global_batch only once known, so that a checkpoint from
        before it was recorded still validates against a fresh run's state (0: unknown)."""
        state = asdict(self)
        if not self.global_batch:
            del state["global_batch"]
        return state

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def checkpoint_states(parts: Parts, state: TrainState) -> dict:
    """What a checkpoint holds, by name (engine/checkpoint: Stateful objects)."""
    p = parts
    return training_states(p.model, p.optimizer, scheduler=p.scheduler, scaler=p.precision.scaler,
                           loader=p.loader, counters=state,
                           lora=LoraCheckpointState(p.lora) if p.lora else None)


class Fit:
    """One `Trainer.fit()` over the run's parts and counters.

    `cfg`: the run's config (the loop's settings, the outputs); `train_step(micro_batches)`: one
    optimizer step; `model_label`: the model's name in the header and summary.json;
    `own_model`: the model is a user's module (the memory prediction takes its parameter count)."""

    def __init__(self, parts: Parts, cfg: TenfoldConfig, state: TrainState, folder: RunFolder, *,
                 train_step: Callable[[list[dict]], StepResult], model_label: str, own_model: bool):
        self.parts, self.folder, self.train_step = parts, folder, train_step
        self.model_label, self.own_model = model_label, own_model
        self.cfg, self.run, self.dist, self.state = cfg, parts.run, parts.dist, state
        self.out_dir = Path(self.cfg.log.out)
        self.writer: MetricsWriter | None = None  # none until the outputs are open
        self.watchdog = None  # engine/observe/watchdog.StepWatchdog while a multi-process fit() runs
        self.val_loss: float | None = None

    def __call__(self) -> dict:
        wall_start = time.perf_counter()
        try:
            self._open_outputs()
            with compile_failures(self.run.compile):  # one line, not dynamo's traceback
                last = self._loop(wall_start)
            return run_outputs.finish(self, last, time.perf_counter() - wall_start)
        except BaseException:
            if self.dist.is_main:  # OUT as it was found, or the run --overwrite replaces kept aside
                self.folder.failed()
            raise
        finally:
            if self.writer is not None:
                self.writer.close()  # after finish's final figures

    # ------------------------------------------------------------------ outputs

    def _open_outputs(self) -> None:
        """Output folder, header, memory prediction, resume, metrics writer, progress bar."""
        t, main = self.parts, self.dist.is_main
        if main:
            self.folder.open()  # creates OUT; --overwrite moves the earlier run aside
        self.tokenizer_dir = run_outputs.save_tokenizer(t.data, self.out_dir) if main else None  # OUT/tokenizer
        self.console = run_outputs.console(main)
        self.facts = run_outputs.facts(t, self.cfg, self.model_label)
        if self.console is not None:
            self.console.print(run_summary.header_line(self.facts, self.cfg.train.steps, self.dist.data_size,
                                                       self.dist.device.type, self.dist.tp_size))
            self.console.print(f"data: {t.data.describe()}")
            if t.lora is not None:
                self.console.print(t.lora.summary.line(t.lora.spec))
        self.checkpoints = CheckpointManager.from_config(self.cfg, checkpoint_states(t, self.state), self.dist, self.say)
        saved = self.checkpoints.resume()
        self.run_memory = RunMemory(t, self.state.step, self.own_model)  # after the resume: it measures this run's second step
        self.run_memory.announce(self.console)
        self._check_resumed_batch(saved)
        self.checkpoints.install_signal_handlers()
        self.writer = MetricsWriter(self.out_dir, main, self.cfg.log.tensorboard, start_step=self.state.step,
                                    wandb=run_outputs.start_wandb(self) if main else None)
        if self.writer.dropped_rows:  # resumed: the rows of the steps about to be redone
            self.say(f"metrics: {self.writer.dropped_rows} row(s) after step {self.state.step} removed from "
                     "metrics.jsonl (redone from the checkpoint)")
        lc = self.cfg.log
        self.step_log = StepLog(self.console, self.cfg.train.steps, self.state.step, lc.log_every, lc.progress,
                                peak_label=process_peak_label(self.dist.device.type))
        self.step_times: list[StepTime] = []
        self.compile_clock = CompileClock(self.run.compile)  # compile time on its own
        self.watchdog = start_watchdog(self.cfg, self.dist, self._on_stall)

    def _check_resumed_batch(self, saved: dict | None) -> None:
        """A resume that changes the global batch (another number of ranks with the default
        micro-batch, other flags) changes what a step means: say so, and how to keep it."""
        old, new = self.state.global_batch, self.run.global_batch
        self.state.global_batch = new
        if saved is None or not old or old == new:
            return
        dp = self.dist.data_size  # ranks that load different rows (dp x cp reduce the gradients)
        keep = (f"pass --global-batch {old} to keep it" if old % dp == 0 else
                f"{old} is not a multiple of this run's {dp} data-parallel ranks, so it cannot be kept here")
        message = (f"resume: the global batch changes from {old} to {new} sequences per step (saved on "
                   f"{saved.get('world_size', '?')} rank(s), resumed on {self.dist.world_size}); each step now "
                   f"takes {new / old:.3g}x the tokens under the same learning-rate schedule; {keep}")
        if self.dist.is_main:
            log.warning(f"tenfold: warning: {message}")

    def _on_stall(self, message: str) -> None:
        """The watchdog fired (its thread; this rank's loop is stuck in a collective): keep what
        can be kept without the peers. Rank 0 flushes the metrics and writes summary.json
        with the reason and the checkpoint to resume from."""
        if not self.dist.is_main:
            return
        self.writer.flush()
        summary = run_summary.build_summary(self.facts, self.state.history, run_outputs.totals(self), {}, 0.0)
        latest = read_latest(self.checkpoints.root)
        summary["stopped"] = {"reason": message, "at_step": self.state.step + 1,
                              "resume_from": str(latest) if latest else None}
        run_summary.write_json_atomic(self.out_dir / "summary.json", summary)

    def _close_outputs(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        self.checkpoints.close()  # finish a background save, restore signal handlers
        self.step_log.stop()

    def say(self, message: str) -> None:  # one line, main rank only
        if self.console is not None:
            self.console.print(message, markup=False, highlight=False)

    # ------------------------------------------------------------------ loop

    def _loop(self, wall_start: float) -> dict:
        last: dict = {}
        try:
            self.step_log.start()
            while self.state.step < self.cfg.train.steps:
                last = self._step_and_log(wall_start)  # then a checkpoint: every N, last, SIGTERM
                stop = self.checkpoints.after_step(self.state.step, last=self.is_last_step())
                if self.dist.is_main:  # a run it replaces (--overwrite) goes once this one has a checkpoint
                    self.folder.stepped(saved=bool(self.checkpoints.saves))
                if stop:
                    break
        except BaseException:
            self.writer.close()  # also when a step fails
            raise
        finally:
            self._close_outputs()
        return last

    def is_last_step(self) -> bool:
        return self.state.step == self.cfg.train.steps

    def _step_and_log(self, wall_start: float) -> dict:
        """One optimizer step: run it, update the counters, evaluate when due, write the
        metrics row and the progress bar. Returns the row."""
        t, s = self.parts, self.state
        micro_batches = t.loader.next_step()
        if self.watchdog is not None:
            self.watchdog.step_started(s.step + 1)
        c0, t0 = self.compile_clock.seconds(), time.perf_counter()
        result = self.run_memory.step(s.step + 1, lambda: self.train_step(micro_batches))
        step_time = time.perf_counter() - t0
        if self.watchdog is not None:
            self.watchdog.step_finished(step_time)
        s.step += 1
        s.tokens += self.run.tokens_per_step
        s.skipped += int(result.skipped)
        s.history.append((s.step, result.loss))
        self.step_times.append(StepTime(s.step, step_time, self.run.tokens_per_step,
                                        instrumented=self.run_memory.measured_step == s.step,
                                        compile_s=self.compile_clock.seconds() - c0))
        row = self._metrics_row(result, step_time, time.perf_counter() - wall_start)
        every = self.cfg.train.eval_every
        if (every and s.step % every == 0) or self.is_last_step():
            self.val_loss = row["val_loss"] = step.evaluate(t)
            if self.val_loss is not None:
                self.writer.log_eval(s.step, self.val_loss)
        if s.step % self.cfg.log.log_every == 0 or self.is_last_step():
            self.writer.log_step(row)
        self.step_log.update(row)
        return row

    def _metrics_row(self, result: StepResult, step_time: float, elapsed: float) -> dict:
        t = self.parts
        tps = self.run.tokens_per_step / step_time
        row = {
            "step": self.state.step, "loss": result.loss, "lr": t.optimizer.param_groups[0]["lr"],
            "grad_norm": result.grad_norm, "tokens_per_s": tps,
            "mfu": run_summary.mfu(t.adapter.flops_per_token, tps, self.facts.peak_flops_per_device, self.dist.world_size)[0],
            "loss_scale": t.precision.scaler.scale, "skipped": self.state.skipped,
            "peak_mem_bytes": peak_memory_bytes(self.dist.device), "step_time_s": step_time,
            "tokens": self.state.tokens, "elapsed_s": elapsed,
        }
        if self.dist.pp_size > 1:  # per-device tokens/s; rank 0's bubble vs (P-1)/m
            row.update(t.model.step_metrics(tps, self.dist.world_size))
        if result.expert_load is not None:  # router assignments per expert, one list per MoE block
            row["expert_load"] = result.expert_load
        return row
