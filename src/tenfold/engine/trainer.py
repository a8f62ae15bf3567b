"""The training loop: config -> resolved run -> model + data -> techniques (parallelize) -> steps.

One optimizer step (`Trainer.train_step`):
  1. count the target tokens of the whole global batch (all ranks, all micro-batches);
  2. per micro-batch: autocast forward, loss = sum of token losses / global tokens
     (x dp_size for the data-parallel average), scaled by the fp16 loss scale, backward;
     gradient reduction only on the last micro-batch where the ZeRO stage allows it;
  3. `techniques.precision.finish_step`: unscale, the global overflow / non-finite check, skip
     or clip + step; the LR schedule advances only on steps that were taken (DeepSpeed's rule).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn

from tenfold.config import TenfoldConfig, build_config
from tenfold.data.arrays import bundle_from_array
from tenfold.engine import summary as run_summary
from tenfold.engine import run_shape
from tenfold.engine.distributed import DistInfo, init_distributed, launched_by_torchrun, tighten_timeouts_after_first_step
from tenfold.engine.metrics import MetricsWriter, peak_memory_bytes
from tenfold.engine.peak import peak_source
from tenfold.engine.steady import StepTime
from tenfold.techniques.compile import CompileClock, compile_failures
from tenfold.engine.step_log import StepLog, process_peak_label
from tenfold.errors import UserError
from tenfold.run import ResolvedRun, resolve_run
from tenfold.techniques import accumulation as acc
from tenfold.techniques.precision import Precision, StepResult, build_precision, finish_step

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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


TP_SEED_OFFSET = 2718  # Megatron-LM's model-parallel seed offset (megatron/core/tensor_parallel/random.py)


def seed_tensor_parallel_ranks(seed: int, dist: DistInfo) -> None:
    """After the model is built (the same weights on every rank): give each tp rank its own
    torch random stream, so that dropout inside a tensor-parallel region (attention
    probabilities of this rank's heads) draws masks independent of the other ranks' heads, as
    Megatron-LM's model-parallel RNG does. Outside those regions, under sequence parallelism,
    activations are DTensors and torch's DTensor random ops draw each shard's part of one
    global mask. Data order does not use torch's stream (tenfold.data keeps its own)."""
    if dist.tp_size > 1:
        torch.manual_seed(seed + TP_SEED_OFFSET + dist.tp_rank)


class Trainer:
    """Train tenfold's GPT (or a user's `nn.Module`) with the configured techniques.

    >>> from tenfold import Trainer
    >>> Trainer({"train": {"steps": 10}}).fit()        # doctest: +SKIP

    `model`: any module mapping input ids (b, s) to logits (b, s, vocab), or use `loss_fn`.
    `dataset`: a DataBundle, or an int array (N, seq_len + 1) of packed token sequences.
    `loss_fn(model, batch) -> (sum of token losses, number of targets)` replaces the default
    next-token cross-entropy; `batch` is a dict with input_ids and labels.
    `tp_plan`: under `parallel.tp_degree > 1`, how to split a user's own `model`
    ({module FQN or pattern: torch.distributed.tensor.parallel.ParallelStyle}, the argument of
    `parallelize_module`; docs/tensor_parallel.md). tenfold's GPT and Hugging Face Llama-family
    models have a built-in plan.
    """

    def __init__(
        self,
        config: TenfoldConfig | dict | None = None,
        model: nn.Module | None = None,
        dataset: Any = None,
        loss_fn: Callable | None = None,
        tp_plan: dict | None = None,
    ):
        if config is None or isinstance(config, dict):
            config = build_config(config or {})
        self.cfg: TenfoldConfig = config
        self.user_model, self.user_dataset, self.loss_fn = model, dataset, loss_fn
        self.tp_plan = tp_plan
        self.state = TrainState()
        self.console = None
        self.watchdog = None  # engine/watchdog.StepWatchdog while a multi-process fit() runs
        self._setup_done = False

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Validate everything and build model, data, optimizer. Writes nothing to disk."""
        cfg = self.cfg
        world = run_shape.world_size(cfg) if launched_by_torchrun() else 1  # checks a multi-node plan's size
        self.run: ResolvedRun = resolve_run(cfg, world, own_model=self.user_model is not None)
        from tenfold.engine.wandb_log import check_available

        check_available(cfg.log.wandb)
        self.dist: DistInfo = init_distributed(self.run.pp, cfg.parallel.timeout_s, self.run.tp, self.run.shard_group,
                                               offload=self.run.offload != "none")
        self.precision: Precision = build_precision(cfg.precision, self.dist.device)
        if self.dist.device.type == "cpu":  # before the model and data take their memory
            from tenfold.engine.host_malloc import tune_malloc

            tune_malloc()
        self.data = self._build_data()
        if self.user_dataset is not None:  # a user's packed rows set the sequence length
            self.run = self.run.with_seq_len(int(np.asarray(self.data.train[:1]).shape[1]) - 1)
        seed_everything(cfg.train.seed)
        self._build_model()
        seed_tensor_parallel_ranks(cfg.train.seed, self.dist)
        self._build_optimizer()
        from tenfold.data import make_loader  # in memory, or streamed (data.streaming)

        r = self.run
        self.loader = make_loader(
            self.data, r.global_batch, r.micro_batch, r.grad_accum,
            dp_rank=self.dist.dp_rank, dp_size=self.dist.dp_size, seed=cfg.train.seed,
        )
        self.out_dir = Path(cfg.log.out)
        self._setup_done = True

    def _build_data(self):
        from tenfold.data import build_data

        if self.user_dataset is None:
            bundle = build_data(self.cfg.data, self.run.seq_len, self.cfg.train.seed, model_vocab_size=self.run.model.vocab_size,
                                hf_pretrained=self.cfg.model.hf_pretrained)
        elif hasattr(self.user_dataset, "train") and hasattr(self.user_dataset, "val"):
            bundle = self.user_dataset
        else:
            bundle = bundle_from_array(self.user_dataset, self.cfg.data.val_fraction)
        vocab = self.run.model.vocab_size
        if self.user_model is None and bundle.vocab_size > vocab:
            raise UserError(
                f"the tokenizer has {bundle.vocab_size} tokens but model.vocab_size is {vocab}; "
                f"set --set model.vocab_size={bundle.vocab_size} or use a smaller tokenizer"
            )
        return bundle

    def _build_model(self) -> None:
        """The model on this rank's device, its adapter (blocks, FLOPs, loss), then every
        technique applied in the one composition point."""
        from tenfold.engine.parallelize import check_techniques, check_tensor_parallel, parallelize
        from tenfold.models.adapter import adapt

        model = self._new_model().to(self.dist.device)
        self.adapter = adapt(model, self.run.seq_len, self.cfg.model.blocks, self.loss_fn)
        check_techniques(self.adapter, self.cfg)
        check_tensor_parallel(model, self.adapter, self.run, self.tp_plan)
        if hasattr(self.data, "fit_to_model"):  # packed examples: position_ids where the model masks by them
            self.data.fit_to_model(model, self.adapter.kind, self.dist.device)
        self.model = parallelize(model, self.run, self.dist, blocks=self.adapter.blocks,
                                 param_dtype=self.precision.compute_dtype, kind=self.adapter.kind,
                                 tp_plan=self.tp_plan)

    def _new_model(self) -> nn.Module:
        if self.user_model is not None:
            return self.user_model
        m = self.cfg.model
        if m.hf_config or m.hf_pretrained:  # a Hugging Face causal LM through transformers
            from tenfold.models.hf import build_hf_model

            return build_hf_model(m.hf_config, m.hf_pretrained)
        from tenfold.models.gpt import GPT

        return GPT(self.run.model)

    def _build_optimizer(self) -> None:
        from tenfold.engine.schedule import build_scheduler
        from tenfold.techniques import fp8, zero

        cfg = self.cfg
        self.optimizer = zero.build_optimizer_for(self.model, cfg.train, cfg.parallel, self.dist)
        fp8.precompute_scales_after_steps(self.optimizer, self.model)  # --fp8 under FSDP2: scales in one all-reduce
        tighten_timeouts_after_first_step(self.optimizer, cfg.parallel.timeout_s, self.dist)
        self.scheduler = build_scheduler(self.optimizer, cfg.train, cfg.train.steps)

    # The run's resolved values under the names the rest of the engine reads.
    micro_batch = property(lambda self: self.run.micro_batch)
    grad_accum = property(lambda self: self.run.grad_accum)
    global_batch = property(lambda self: self.run.global_batch)
    seq_len = property(lambda self: self.run.seq_len)
    dtype_name = property(lambda self: self.precision.name)
    scaler = property(lambda self: self.precision.scaler)
    param_count = property(lambda self: self.adapter.param_count)
    flops_per_token = property(lambda self: self.adapter.flops_per_token)

    def mfu_peak(self) -> tuple[float | None, str | None]:
        """(dense peak FLOP/s of one device for this dtype, MFU's denominator; or None and
        why no MFU is reported)."""
        if self.dist.device.type == "cpu":
            from tenfold.engine.peak import mfu_peak

            return mfu_peak(self.dtype_name, ranks=self.dist.world_size)  # the ranks share this machine's peak
        from tenfold.plan.hardware import gpu_peak_flops_for_device  # the planner's catalog

        return gpu_peak_flops_for_device(torch.cuda.get_device_name(self.dist.device), self.dtype_name), None

    def peak_flops_per_device(self) -> float | None:
        return self.mfu_peak()[0]

    # ------------------------------------------------------------------ one step

    def forward_loss(self, batch: dict) -> torch.Tensor:
        """Sum of token losses of one micro-batch (fp32)."""
        return self.adapter.loss_sum(self.model, batch)

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        loss, global_tokens = self.accumulate_gradients(micro_batches)
        return self.apply_gradients(loss, global_tokens)

    def accumulate_gradients(self, micro_batches: list[dict]) -> tuple[float, int]:
        """Forward + backward over this rank's micro-batches; returns (global mean loss,
        global target tokens). Gradients are left in `.grad`, scaled by the loss scale."""
        from tenfold.techniques import zero

        dev = self.dist.device
        dp_group = self.dist.mesh["dp"].get_group() if self.dist.mesh is not None else None
        if self.dist.pp_size > 1:  # the pipeline schedule runs all micro-batches (techniques/pipeline_runner.py)
            result = self.model.train_step(micro_batches, self.scaler.scale, dp_group)
            return result.loss, result.global_tokens
        global_tokens = int(acc.all_reduce_sum(acc.count_targets(micro_batches), dp_group))
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        for i, mb in enumerate(micro_batches):
            batch = {k: v.to(dev, non_blocking=True) for k, v in mb.items()}
            with zero.grad_sync(self.model, enabled=i == len(micro_batches) - 1), self._loss_context():
                with self.precision.autocast():
                    mb_loss_sum = self.forward_loss(batch)
                loss = acc.scaled_for_backward(mb_loss_sum, global_tokens, self.dist.dp_size)
                self.scaler.scale_loss(loss).backward()
            loss_sum += mb_loss_sum.detach().double()
        return acc.all_reduce_sum(float(loss_sum), dp_group) / max(global_tokens, 1), global_tokens

    def apply_gradients(self, loss: float, global_tokens: int) -> StepResult:
        """The step tail every run takes (techniques.precision.finish_step)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.dist.tp_size > 1:
            from tenfold.techniques.tensor_parallel import settle_gradients

            settle_gradients(params)
        train = self.cfg.train
        result = finish_step(self.optimizer, self.scheduler, self.precision, params, loss, global_tokens,
                             self._clip, train.grad_clip, on_nan=train.on_nan, step=self.state.step + 1)
        if result.message and self.dist.is_main:
            log.warning(result.message)
        return result

    def _loss_context(self):
        """loss_parallel under tensor parallelism: the logits stay split over the vocabulary."""
        from tenfold.techniques.tensor_parallel import loss_context

        return loss_context(self.dist.tp_size)

    def _clip(self, max_norm: float) -> float:
        """Clip to the global gradient norm over every shard and every pipeline stage."""
        from tenfold.techniques import zero

        pp_groups = (self.dist.mesh["pp"].get_group(),) if self.dist.pp_size > 1 else ()
        return zero.clip_grad_norm(self.model, max_norm, extra_groups=pp_groups)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over the first eval_batches micro-batches. Every rank scores
        the same batches: sharded models need every rank in each forward anyway."""
        from tenfold.data import iter_eval

        val = self.data.val
        if val is None or len(val) == 0:
            return None
        batches = list(iter_eval(val, self.micro_batch, self.cfg.train.eval_batches))
        count = sum(acc.count_targets([b]) for b in batches)
        self.model.eval()
        try:
            if self.dist.pp_size > 1:  # forward through the stages, loss on the last
                return self.model.eval_loss_sum(batches) / max(count, 1)
            total = 0.0
            for batch in batches:
                with self.precision.autocast(), self._loss_context():
                    total += float(self.forward_loss({k: v.to(self.dist.device) for k, v in batch.items()}))
            return total / max(count, 1)
        finally:
            self.model.train()

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict:
        from tenfold.engine.distributed import on_every_rank
        from tenfold.engine.run_folder import RunFolder

        # --out, --resume and an earlier run in --out, before anything is built or written
        self.folder = on_every_rank(lambda: RunFolder.check(self.cfg), peer_error=UserError)
        if not self._setup_done:
            self.setup()
        wall_start = time.perf_counter()
        try:
            self._open_outputs()
            with compile_failures(self.cfg.train.compile):  # one line, not dynamo's traceback
                last = self._loop(wall_start)
            return self._finish(last, time.perf_counter() - wall_start)
        except BaseException:
            if self.dist.is_main:  # OUT as it was found, or the run --overwrite replaces kept aside
                self.folder.failed()
            raise
        finally:
            if hasattr(self, "writer"):  # none when the outputs could not be opened
                self.writer.close()  # after _finish's final figures

    def _loop(self, wall_start: float) -> dict:
        last: dict = {}
        try:
            self.step_log.start()
            while self.state.step < self.cfg.train.steps:
                last = self._step_and_log(wall_start, last)  # then a checkpoint: every N, last, SIGTERM
                stop = self.checkpoints.after_step(self.state.step, last=self._is_last_step())
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

    def _is_last_step(self) -> bool:
        return self.state.step == self.cfg.train.steps

    def _step_and_log(self, wall_start: float, last: dict) -> dict:
        """One optimizer step: run it, update the counters, evaluate when due, write the
        metrics row and the progress bar. Returns the row."""
        micro_batches = self.loader.next_step()
        if self.watchdog is not None:
            self.watchdog.step_started(self.state.step + 1)
        c0, t0 = self.compile_clock.seconds(), time.perf_counter()
        result = self.run_memory.step(self.state.step + 1, lambda: self.train_step(micro_batches))
        step_time = time.perf_counter() - t0
        if self.watchdog is not None:
            self.watchdog.step_finished(step_time)
        s = self.state
        s.step += 1
        s.tokens += self.run.tokens_per_step
        s.skipped += int(result.skipped)
        s.history.append((s.step, result.loss))
        self.step_times.append(StepTime(s.step, step_time, self.run.tokens_per_step,
                                        instrumented=self.run_memory.measured_step == s.step,
                                        compile_s=self.compile_clock.seconds() - c0))
        row = self._metrics_row(result, step_time, time.perf_counter() - wall_start)
        every = self.cfg.train.eval_every
        if (every and s.step % every == 0) or self._is_last_step():
            self.val_loss = row["val_loss"] = self.evaluate()
            if self.val_loss is not None:
                self.writer.log_eval(s.step, self.val_loss)
        if s.step % self.cfg.log.log_every == 0 or self._is_last_step():
            self.writer.log_step(row)
        self.step_log.update(row)
        return row

    def _metrics_row(self, result: StepResult, step_time: float, elapsed: float) -> dict:
        tps = self.run.tokens_per_step / step_time
        row = {
            "step": self.state.step, "loss": result.loss, "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": result.grad_norm, "tokens_per_s": tps,
            "mfu": run_summary.mfu(self.flops_per_token, tps, self.peak, self.dist.world_size)[0],
            "loss_scale": self.scaler.scale, "skipped": self.state.skipped,
            "peak_mem_bytes": peak_memory_bytes(self.dist.device), "step_time_s": step_time,
            "tokens": self.state.tokens, "elapsed_s": elapsed,
        }
        if self.dist.pp_size > 1:  # per-device tokens/s; rank 0's bubble vs (P-1)/m
            row.update(self.model.step_metrics(tps, self.dist.world_size))
        return row

    # ------------------------------------------------------------------ outputs

    def _open_outputs(self) -> None:
        """Output folder, header, memory prediction, resume, metrics writer, progress bar."""
        from tenfold.engine.checkpoint import CheckpointManager
        from tenfold.engine.memory import RunMemory

        from tenfold.engine.watchdog import start_watchdog

        main = self.dist.is_main
        if main:
            self.folder.open()  # creates OUT; --overwrite moves the earlier run aside
        self.tokenizer_dir = self._save_tokenizer() if main else None  # OUT/tokenizer
        self.console = _console(main)
        self.facts = self._facts()
        if self.console is not None:
            self.console.print(run_summary.header_line(self.facts, self.cfg.train.steps, self.dist.dp_size,
                                                       self.dist.device.type, self.dist.tp_size))
            self.console.print(f"data: {self.data.describe()}")
        self.checkpoints = CheckpointManager.from_config(self.cfg, self._checkpoint_states(), self.dist, self._say)
        saved = self.checkpoints.resume()
        self.run_memory = RunMemory(self)  # after the resume: it measures this run's second step
        self.run_memory.announce(self.console)
        self._check_resumed_batch(saved)
        self.checkpoints.install_signal_handlers()
        self.writer = MetricsWriter(self.out_dir, main, self.cfg.log.tensorboard, start_step=self.state.step,
                                    wandb=self._start_wandb() if main else None)
        if self.writer.dropped_rows:  # resumed: the rows of the steps about to be redone
            self._say(f"metrics: {self.writer.dropped_rows} row(s) after step {self.state.step} removed from "
                      "metrics.jsonl (redone from the checkpoint)")
        lc = self.cfg.log
        self.step_log = StepLog(self.console, self.cfg.train.steps, self.state.step, lc.log_every, lc.progress,
                                peak_label=process_peak_label(self.dist.device.type))
        self.step_times: list[StepTime] = []
        self.compile_clock = CompileClock(self.cfg.train.compile)  # compile time on its own
        self.val_loss = None
        self.watchdog = start_watchdog(self.cfg, self.dist, self._on_stall)

    def _on_stall(self, message: str) -> None:
        """The watchdog fired (its thread; this rank's loop is stuck in a collective): keep what
        can be kept without the peers. Rank 0 flushes the metrics and writes summary.json
        with the reason and the checkpoint to resume from."""
        if not self.dist.is_main:
            return
        from tenfold.engine.checkpoint import read_latest

        self.writer.flush()
        s = self.state
        summary = run_summary.build_summary(self.facts, s.history, self._totals(), {}, 0.0)
        latest = read_latest(self.checkpoints.root)
        summary["stopped"] = {"reason": message, "at_step": s.step + 1, "resume_from": str(latest) if latest else None}
        run_summary.write_json_atomic(self.out_dir / "summary.json", summary)

    def _check_resumed_batch(self, saved: dict | None) -> None:
        """A resume that changes the global batch (another number of ranks with the default
        micro-batch, other flags) changes what a step means: say so, and how to keep it."""
        old, new = self.state.global_batch, self.run.global_batch
        self.state.global_batch = new
        if saved is None or not old or old == new:
            return
        dp = self.dist.dp_size
        keep = (f"pass --global-batch {old} to keep it" if old % dp == 0 else
                f"{old} is not a multiple of this run's {dp} data-parallel ranks, so it cannot be kept here")
        message = (f"resume: the global batch changes from {old} to {new} sequences per step (saved on "
                   f"{saved.get('world_size', '?')} rank(s), resumed on {self.dist.world_size}); each step now "
                   f"takes {new / old:.3g}x the tokens under the same learning-rate schedule; {keep}")
        if self.dist.is_main:
            log.warning(f"tenfold: warning: {message}")

    def _start_wandb(self):
        if not self.cfg.log.wandb:
            return None
        from tenfold.engine import wandb_log

        return wandb_log.start(self.cfg.log, self.cfg.to_dict(), self.out_dir, self.state.step, self._say)

    @property
    def peak(self) -> float | None:
        return self.facts.peak_flops_per_device

    def _facts(self) -> run_summary.RunFacts:
        r = self.run
        peak, mfu_note = self.mfu_peak()
        return run_summary.RunFacts(
            config=self.cfg.to_dict(), model_label=self._model_label(),
            blocks=f"{len(self.adapter.blocks)} x {self.adapter.block_class}", params=self.param_count,
            flops_per_token=self.flops_per_token, device=str(self.dist.device), world_size=self.dist.world_size,
            dtype=self.dtype_name, peak_flops_per_device=peak, mfu_note=mfu_note, peak_source=peak_source(self.dist.device.type),
            batch=r.batch_summary(), layout=r.layout(), layout_line=r.layout_line(),
        )

    def _totals(self) -> dict:  # the counters summary.json reports
        s = self.state
        return {"steps": s.step, "tokens": s.tokens, "skipped_steps": s.skipped, "val_loss": self.val_loss,
                "loss_scale": self.scaler.scale, "compile_s": self.compile_clock.report()}

    def _close_outputs(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        self.checkpoints.close()  # finish a background save, restore signal handlers
        self.step_log.stop()

    def _finish(self, last: dict, wall: float) -> dict:
        """summary.json (rank 0), the requested exports, the summary table."""
        s = self.state
        summary = run_summary.build_summary(self.facts, s.history, self._totals(), last, wall, self.step_times)
        if self.dist.pp_size > 1:  # split, measured bubble per stage vs (P-1)/m
            summary["pipeline"] = self.model.report(self.dist)
        summary["memory"].update(self.run_memory.summary())
        summary.update(self._exports())
        summary["tokenizer"] = self._tokenizer_summary(self.tokenizer_dir, summary.get("hf_export"))
        self.writer.log_final(summary["final"])
        if self.dist.is_main:
            run_summary.write_json_atomic(self.out_dir / "summary.json", summary)
            self.console.print(run_summary.summary_table(summary, self.out_dir))
            self.console.print(run_summary.outputs_text(self._written_paths(summary)), soft_wrap=True, highlight=False)
            self.folder.commit()  # finished: the run --overwrite replaces goes now
        return summary

    def _written_paths(self, summary: dict) -> list[tuple[str, str]]:
        """(path, what it is) of every file or folder this run wrote, for the closing lines."""
        out = [(str(self.out_dir / "summary.json"), "final figures, resolved config, memory")]
        out += [(str(path), what) for path, what in self.writer.paths.values()]
        saves = self.checkpoints.saves
        if saves:
            out.append((str(saves[-1].path), f"checkpoint of step {saves[-1].step}"))
        if summary.get("export"):
            out.append((summary["export"], "16-bit weights (checkpoint.export_16bit)"))
        if summary.get("hf_export"):
            out.append((summary["hf_export"], "Hugging Face save_pretrained folder"))
        if self.tokenizer_dir is not None:
            out.append((str(self.tokenizer_dir), "the tokenizer that made the token ids"))
        return out

    def _exports(self) -> dict:
        """The 16-bit safetensors export (DeepSpeed's stage3_gather_16bit_weights_on_model_save)
        and, for a Hugging Face model, its save_pretrained folder. Every rank takes part."""
        out: dict = {}
        if self.cfg.checkpoint.export_16bit and self._is_last_step():
            from tenfold.engine.export import export_after_training

            final = self.checkpoints.save_final(self.state.step)  # the trainer exports, not the manager
            exported = export_after_training(self.out_dir, final, self.dtype_name, log=self._say)
            out["export"] = exported["safetensors"] if exported else str(self.out_dir / "model.safetensors")
        if self.adapter.kind == "hf":
            from tenfold.models.hf import save_hf_pretrained

            save_hf_pretrained(self.model, self.out_dir / "hf", self.dist.is_main)
            out["hf_export"] = str(self.out_dir / "hf")
        return out

    def _checkpoint_states(self) -> dict:
        """What a checkpoint holds, by name (engine/checkpoint: Stateful objects)."""
        from tenfold.engine.checkpoint import training_states

        return training_states(self.model, self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                               loader=self.loader, counters=self.state)

    def _save_tokenizer(self) -> Path | None:
        """OUT/tokenizer: the tokenizer that made the ids, written under a fresh scratch name and
        renamed into place (the tokenizers library follows links; a link there is replaced)."""
        if not hasattr(self.data, "save_tokenizer"):
            return None
        from tenfold.engine.run_folder import replace_folder

        return replace_folder(self.out_dir, "tokenizer", self.data.save_tokenizer)

    def _tokenizer_summary(self, saved: Path | None, hf_dir: str | None) -> dict | None:
        """summary.json's record of the tokenizer; a copy goes beside the HF weights."""
        if saved is not None and hf_dir:
            self.data.save_tokenizer(hf_dir)
        record = self.data.tokenizer_record() if hasattr(self.data, "tokenizer_record") else None
        return {**record, "saved": str(saved) if saved else None} if record else None

    def _say(self, message: str) -> None:  # one line, main rank only
        if self.console is not None:
            self.console.print(message, markup=False, highlight=False)

    def _model_label(self) -> str:  # preset name, HF config path or the user's class
        m = self.cfg.model
        if self.user_model is not None:
            return type(self.user_model).__name__
        return m.hf_pretrained or m.hf_config or m.name

    def memory_report(self) -> int:
        """`tenfold train --memory-report`: one warm-up step, then one step measured by module
        and category (beside the planner's prediction), printed; nothing is written."""
        from tenfold.engine.memory import run_memory_report

        report = run_memory_report(self)
        if self.dist.is_main:
            _console(True).print(report)
        return 0


def _console(main: bool):
    if not main:
        return None
    from rich.console import Console

    return Console(soft_wrap=True)  # a line stays one line in a log file; tables keep their width
