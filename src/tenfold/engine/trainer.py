"""The training loop: config -> model + data -> techniques (parallelize) -> steps -> metrics.

One optimizer step (`Trainer.train_step`):
  1. count the target tokens of the whole global batch (all ranks, all micro-batches);
  2. per micro-batch: autocast forward, loss = sum of token losses / global tokens
     (x dp_size for the data-parallel average), scaled by the fp16 loss scale, backward;
     gradient reduction only on the last micro-batch where the ZeRO stage allows it;
  3. unscale, global overflow check (fp16) / non-finite check, skip or clip + step;
     the LR schedule advances only on steps that were taken (DeepSpeed's rule).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn

from tenfold.config import TenfoldConfig, build_config, resolve_batch
from tenfold.engine.distributed import DistInfo, init_distributed
from tenfold.engine.metrics import MetricsWriter, make_progress, peak_memory_bytes
from tenfold.errors import RunError, UserError
from tenfold.techniques import accumulation as acc


@dataclass
class TrainState:
    """Counters that a checkpoint must carry for an exact resume."""

    step: int = 0  # optimizer steps attempted (taken + skipped)
    tokens: int = 0  # tokens consumed (inputs, whole global batch)
    skipped: int = 0  # steps skipped for overflow / non-finite loss
    history: list = field(default_factory=list)  # (step, loss) of every step, for the summary


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    target_tokens: int


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Train tenfold's GPT (or a user's `nn.Module`) with the configured techniques.

    >>> from tenfold import Trainer
    >>> Trainer({"train": {"steps": 10}}).fit()        # doctest: +SKIP

    `model`: any module mapping input ids (b, s) to logits (b, s, vocab), or use `loss_fn`.
    `dataset`: a DataBundle, or an int array (N, seq_len + 1) of packed token sequences.
    `loss_fn(model, batch) -> (sum of token losses, number of targets)` replaces the default
    next-token cross-entropy; `batch` is a dict with input_ids and labels.
    """

    def __init__(
        self,
        config: TenfoldConfig | dict | None = None,
        model: nn.Module | None = None,
        dataset: Any = None,
        loss_fn: Callable | None = None,
    ):
        if config is None or isinstance(config, dict):
            config = build_config(config or {})
        self.cfg: TenfoldConfig = config
        self.user_model, self.user_dataset, self.loss_fn = model, dataset, loss_fn
        self.state = TrainState()
        self._setup_done = False

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Validate everything and build model, data, optimizer. Writes nothing to disk."""
        cfg = self.cfg
        self.dist: DistInfo = init_distributed(cfg.parallel.pp_degree, cfg.parallel.timeout_s)
        if cfg.parallel.pp_degree > 1 and self.dist.world_size % cfg.parallel.pp_degree:
            raise UserError(
                f"parallel.pp_degree ({cfg.parallel.pp_degree}) must divide the number of "
                f"processes ({self.dist.world_size})"
            )
        self.micro_batch, self.grad_accum, self.global_batch = resolve_batch(
            cfg.train.micro_batch, cfg.train.grad_accum, cfg.train.global_batch, self.dist.dp_size
        )
        self.seq_len = cfg.seq_len()
        from tenfold.techniques.precision import build_loss_scaler, resolve_dtype

        self.dtype_name = resolve_dtype(cfg.precision.dtype, self.dist.device)
        self.data = self._build_data()
        if self.user_dataset is not None:  # a user's packed rows set the sequence length
            self.seq_len = int(np.asarray(self.data.train[:1]).shape[1]) - 1
        seed_everything(cfg.train.seed)
        self.model = self._build_model()
        from tenfold.models.adapter import adapt, check_techniques  # [any model] blocks, FLOPs, loss

        self.adapter = adapt(self.model, self.seq_len, cfg.model.blocks, self.loss_fn)
        check_techniques(self.adapter, cfg)
        self.param_count = self.adapter.param_count
        self.flops_per_token = self.adapter.flops_per_token
        from tenfold.engine.parallelize import parallelize
        from tenfold.engine.schedule import build_scheduler
        from tenfold.techniques import zero

        from tenfold.techniques.precision import DTYPES

        param_dtype = None if self.dtype_name == "fp32" else DTYPES[self.dtype_name]
        self.model = parallelize(self.model, cfg, self.dist, blocks=self.adapter.blocks, param_dtype=param_dtype)
        self.optimizer = zero.build_optimizer_for(self.model, cfg.train, cfg.parallel, self.dist)
        self.scheduler = build_scheduler(self.optimizer, cfg.train, cfg.train.steps)
        self.scaler = build_loss_scaler(cfg.precision, self.dtype_name)
        from tenfold.data import GlobalBatchLoader

        self.loader = GlobalBatchLoader(
            self.data.train, self.global_batch, self.micro_batch, self.grad_accum,
            dp_rank=self.dist.dp_rank, dp_size=self.dist.dp_size, seed=cfg.train.seed,
        )
        self.out_dir = Path(cfg.log.out)
        self._setup_done = True

    def _build_data(self):
        from tenfold.data import build_data

        if self.user_dataset is None:
            vocab = self.cfg.model_config_resolved().vocab_size
            bundle = build_data(self.cfg.data, self.seq_len, self.cfg.train.seed, model_vocab_size=vocab)
        elif hasattr(self.user_dataset, "train") and hasattr(self.user_dataset, "val"):
            bundle = self.user_dataset
        else:
            bundle = _bundle_from_array(self.user_dataset, self.cfg.data.val_fraction)
        if self.user_model is None:
            vocab = self.cfg.model_config_resolved().vocab_size
            if bundle.vocab_size > vocab:
                raise UserError(
                    f"the tokenizer has {bundle.vocab_size} tokens but model.vocab_size is {vocab}; "
                    f"set --set model.vocab_size={bundle.vocab_size} or use a smaller tokenizer"
                )
        return bundle

    def _build_model(self) -> nn.Module:
        if self.user_model is not None:
            return self.user_model.to(self.dist.device)
        from tenfold.models.gpt import GPT

        self.model_cfg = self.cfg.model_config_resolved()
        if self.cfg.model.hf_config or self.cfg.model.hf_pretrained:  # [any model] transformers
            from tenfold.models.hf import build_hf_model

            return build_hf_model(self.cfg.model.hf_config, self.cfg.model.hf_pretrained).to(self.dist.device)
        return GPT(self.model_cfg).to(self.dist.device)

    def peak_flops_per_device(self) -> float | None:
        """Dense peak FLOP/s of one device for this dtype (MFU's denominator)."""
        if self.dist.device.type == "cpu":
            from tenfold.engine.peak import cpu_peak_flops

            return cpu_peak_flops(self.dtype_name)
        try:
            from tenfold.plan.hardware import gpu_peak_flops_for_device  # planner's catalog
        except ImportError:
            return None
        return gpu_peak_flops_for_device(torch.cuda.get_device_name(self.dist.device), self.dtype_name)

    # ------------------------------------------------------------------ one step

    def forward_loss(self, batch: dict) -> torch.Tensor:
        """Sum of token losses of one micro-batch (fp32)."""
        return self.adapter.loss_sum(self.model, batch)  # [any model] models/adapter.py

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        loss, global_tokens = self.accumulate_gradients(micro_batches)
        return self.apply_gradients(loss, global_tokens)

    def accumulate_gradients(self, micro_batches: list[dict]) -> tuple[float, int]:
        """Forward + backward over this rank's micro-batches; returns (global mean loss,
        global target tokens). Gradients are left in `.grad`, scaled by the loss scale."""
        from tenfold.techniques import zero
        from tenfold.techniques.precision import autocast_context

        dev = self.dist.device
        dp_group = self.dist.mesh["dp"].get_group() if self.dist.mesh is not None else None
        if self.dist.pp_size > 1:  # [pipeline] the schedule runs all micro-batches (techniques/pipeline.py)
            result = self.model.train_step(micro_batches, self.scaler.scale, dp_group)
            return result.loss, result.global_tokens
        global_tokens = int(acc.all_reduce_sum(acc.count_targets(micro_batches), dp_group))
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        for i, mb in enumerate(micro_batches):
            batch = {k: v.to(dev, non_blocking=True) for k, v in mb.items()}
            with zero.grad_sync(self.model, enabled=i == len(micro_batches) - 1):
                with autocast_context(self.dtype_name, dev):
                    mb_loss_sum = self.forward_loss(batch)
                loss = acc.scaled_for_backward(mb_loss_sum, global_tokens, self.dist.dp_size)
                self.scaler.scale_loss(loss).backward()
            loss_sum += mb_loss_sum.detach().double()
        return acc.all_reduce_sum(float(loss_sum), dp_group) / max(global_tokens, 1), global_tokens

    def apply_gradients(self, loss: float, global_tokens: int) -> StepResult:
        """Unscale, check for inf/NaN (globally), clip, step; or skip the step."""
        from tenfold.techniques import zero
        from tenfold.techniques.precision import grads_have_inf_or_nan

        params = [p for p in self.model.parameters() if p.requires_grad]
        self.scaler.unscale_grads_(params)
        non_finite = grads_have_inf_or_nan(params) if self.dtype_name == "fp16" else not math.isfinite(loss)
        if non_finite:
            return self._skip_step(loss, global_tokens)
        pp_groups = (self.dist.mesh["pp"].get_group(),) if self.dist.pp_size > 1 else ()  # [pipeline] all stages
        grad_norm = zero.clip_grad_norm(self.model, self.cfg.train.grad_clip, extra_groups=pp_groups)
        if not math.isfinite(grad_norm) and self.dtype_name != "fp16":
            return self._skip_step(loss, global_tokens, grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update(False)
        return StepResult(loss, grad_norm, False, global_tokens)

    def _skip_step(self, loss: float, tokens: int, grad_norm: float = float("nan")) -> StepResult:
        """An fp16 overflow (expected now and then) or a non-finite bf16/fp32 step: the
        weights, the optimizer and the LR schedule are left untouched."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.dtype_name == "fp16":
            self.scaler.update(True)
        elif self.cfg.train.on_nan == "stop":
            raise RunError(
                f"non-finite loss or gradients at step {self.state.step + 1} (loss={loss}); "
                "the weights were not updated. Lower train.lr, use --precision fp32, or pass "
                "--set train.on_nan=skip to skip such steps"
            )
        return StepResult(loss, grad_norm, True, tokens)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over the first eval_batches micro-batches. Every rank scores
        the same batches: sharded models need every rank in each forward anyway."""
        from tenfold.techniques.precision import autocast_context

        val = self.data.val
        if val is None or len(val) == 0:
            return None
        from tenfold.data import iter_eval

        self.model.eval()
        total, count = 0.0, 0
        if self.dist.pp_size > 1:  # [pipeline] forward through the stages, loss on the last
            batches = list(iter_eval(val, self.micro_batch, self.cfg.train.eval_batches))
            total = self.model.eval_loss_sum(batches)
            self.model.train()
            return total / max(sum(int((b["labels"] != acc.IGNORE_INDEX).sum()) for b in batches), 1)
        for batch in iter_eval(val, self.micro_batch, self.cfg.train.eval_batches):
            batch = {k: v.to(self.dist.device) for k, v in batch.items()}
            with autocast_context(self.dtype_name, self.dist.device):
                total += float(self.forward_loss(batch))
            count += int((batch["labels"] != acc.IGNORE_INDEX).sum())
        self.model.train()
        return total / max(count, 1)

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict:
        if not self._setup_done:
            self.setup()
        cfg, dist = self.cfg, self.dist
        main = dist.is_main
        if main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.console = _console(main)
        self._announce()
        from tenfold.engine.memory import RunMemory  # [memory] planner's prediction now, one step measured

        self.run_memory = RunMemory(self)
        self.run_memory.announce(self.console)
        from tenfold.engine.checkpoint import CheckpointManager  # [checkpoint] --resume, then saves

        self.checkpoints = CheckpointManager.from_config(cfg, self._checkpoint_states(), self.dist, self._checkpoint_log)
        self.checkpoints.resume()
        self.checkpoints.install_signal_handlers()
        writer = MetricsWriter(self.out_dir, main, cfg.log.tensorboard)
        progress = make_progress(main and cfg.log.progress)
        peak = self.peak_flops_per_device()
        tokens_per_step = self.global_batch * self.seq_len
        last: dict = {}
        val_loss = None
        wall_start = time.perf_counter()
        try:
            if progress is not None:
                progress.start()
                task = progress.add_task("train", total=cfg.train.steps, completed=self.state.step, stats="")
            while self.state.step < cfg.train.steps:
                micro_batches = self.loader.next_step()
                t0 = time.perf_counter()
                result = self.run_memory.step(self.state.step + 1, lambda: self.train_step(micro_batches))  # [memory]
                step_time = time.perf_counter() - t0
                self.state.step += 1
                self.state.tokens += tokens_per_step
                self.state.skipped += int(result.skipped)
                self.state.history.append((self.state.step, result.loss))
                tps = tokens_per_step / step_time
                mfu = self.flops_per_token * tps / (peak * dist.world_size) if peak else None
                last = {
                    "step": self.state.step, "loss": result.loss,
                    "lr": self.optimizer.param_groups[0]["lr"], "grad_norm": result.grad_norm,
                    "tokens_per_s": tps, "mfu": mfu, "loss_scale": self.scaler.scale,
                    "skipped": self.state.skipped, "peak_mem_bytes": peak_memory_bytes(dist.device),
                    "step_time_s": step_time, "tokens": self.state.tokens,
                    "elapsed_s": time.perf_counter() - wall_start,
                }
                if dist.pp_size > 1:  # [pipeline] per-device tokens/s; rank 0's bubble vs (P-1)/m
                    last.update(self.model.step_metrics(tps, dist.world_size))
                every = cfg.train.eval_every
                if (every and self.state.step % every == 0) or self.state.step == cfg.train.steps:
                    val_loss = self.evaluate()
                    last["val_loss"] = val_loss
                    writer.log_eval(self.state.step, val_loss) if val_loss is not None else None
                if self.state.step % cfg.log.log_every == 0 or self.state.step == cfg.train.steps:
                    writer.log_step(last)
                if progress is not None:
                    stats = f"loss {result.loss:.4f}  {tps:,.0f} tok/s" + (f"  MFU {mfu:.1%}" if mfu else "")
                    progress.update(task, completed=self.state.step, stats=stats)
                # [checkpoint] every N steps, at the last step, and once on SIGTERM/SIGINT (then stop)
                if self.checkpoints.after_step(self.state.step, last=self.state.step == cfg.train.steps):
                    break
        finally:
            self.checkpoints.close()  # [checkpoint] finish a background save, restore signal handlers
            if progress is not None:
                progress.stop()
            writer.close()
        wall = time.perf_counter() - wall_start
        summary = self._summary(last, val_loss, wall, peak)
        summary["memory"].update(self.run_memory.summary())  # [memory] predicted, measured, diff %
        if dist.world_size > 1:  # [zero] every rank's measured step (memory.measured's keys), on rank 0
            from tenfold.engine.distributed import gather_to_main

            summary["memory"]["measured_per_rank"] = gather_to_main(
                self.run_memory.measured or {"peak_bytes": peak_memory_bytes(dist.device)}, dist)
        if cfg.checkpoint.export_16bit and self.state.step == cfg.train.steps:  # [checkpoint] DeepSpeed key
            from tenfold.engine.export import export_after_training

            final = self.checkpoints.save_final(self.state.step)
            exported = export_after_training(self.out_dir, final, self.dtype_name, log=self._checkpoint_log)
            summary["export"] = exported["safetensors"] if exported else str(self.out_dir / "model.safetensors")
        if self.adapter.kind == "hf":  # [any model] OUT/hf: save_pretrained layout (every rank gathers)
            from tenfold.models.hf import save_hf_pretrained

            save_hf_pretrained(self.model, self.out_dir / "hf", main)
            summary["hf_export"] = str(self.out_dir / "hf")
        if main:
            _write_json_atomic(self.out_dir / "summary.json", summary)
            self._print_summary(summary)
        return summary

    # ------------------------------------------------------------------ reporting

    def _announce(self) -> None:
        if self.console is None:
            return
        c = self.cfg
        self.console.print(
            f"[bold]tenfold train[/] {self._model_label()}"
            f" ({self.param_count / 1e6:.2f}M params) | {self.dtype_name} | "
            f"batch {self.global_batch} = {self.micro_batch} x {self.grad_accum} x dp {self.dist.dp_size} "
            f"| seq {self.seq_len} | {c.train.steps} steps | {self.dist.world_size} process(es) on {self.dist.device.type}"
        )
        self.console.print(f"data: {self.data.describe()}")

    def _checkpoint_states(self) -> dict:  # [checkpoint] what a checkpoint holds, by name
        from tenfold.engine.checkpoint import training_states

        return training_states(self.model, self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                               loader=self.loader, counters=self.state)

    def _checkpoint_log(self, message: str) -> None:  # [checkpoint] one line, main rank only
        if self.console is not None:
            self.console.print(message, markup=False, highlight=False)

    def _model_label(self) -> str:  # [any model] preset name, HF config path or the user's class
        m = self.cfg.model
        if self.user_model is not None:
            return type(self.user_model).__name__
        return m.hf_pretrained or m.hf_config or m.name

    def _summary(self, last: dict, val_loss: float | None, wall: float, peak: float | None) -> dict:
        history = self.state.history
        tokens = self.state.tokens
        tps = tokens / wall if wall > 0 else None
        summary = {
            "config": self.cfg.to_dict(),
            "model": {
                "name": self._model_label(), "blocks": f"{len(self.adapter.blocks)} x {self.adapter.block_class}",
                "params": self.param_count, "flops_per_token": self.flops_per_token,
            },
            "hardware": {
                "device": str(self.dist.device), "world_size": self.dist.world_size,
                "peak_flops_per_device": peak, "dtype": self.dtype_name,
            },
            "batch": {"micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                      "global_batch": self.global_batch, "seq_len": self.seq_len},
            "final": {
                "steps": self.state.step, "tokens": tokens, "skipped_steps": self.state.skipped,
                "first_loss": history[0][1] if history else None,
                "loss": last.get("loss"), "val_loss": val_loss, "wall_s": wall,
                "tokens_per_s": tps,
                "mfu": self.flops_per_token * tps / (peak * self.dist.world_size) if (peak and tps) else None,
                "loss_scale": self.scaler.scale,
            },
            "losses": [loss for _, loss in history],
            "memory": {"peak_mem_bytes": last.get("peak_mem_bytes")},
        }
        if self.dist.pp_size > 1:  # [pipeline] split, measured bubble per stage vs (P-1)/m
            summary["pipeline"] = self.model.report(self.dist)
        return summary

    def _print_summary(self, summary: dict) -> None:
        if self.console is None:
            return
        from rich.table import Table

        f = summary["final"]
        t = Table(title="tenfold train: summary", show_header=False)
        t.add_row("steps (skipped)", f"{f['steps']} ({f['skipped_steps']})")
        t.add_row("tokens", f"{f['tokens']:,}")
        if f["first_loss"] is not None and f["loss"] is not None:
            drop = 100 * (1 - f["loss"] / f["first_loss"]) if f["first_loss"] else 0.0
            t.add_row("loss first -> last", f"{f['first_loss']:.4f} -> {f['loss']:.4f} ({drop:.0f}% lower)")
        if f["val_loss"] is not None:
            t.add_row("validation loss", f"{f['val_loss']:.4f}")
        t.add_row("wall time", f"{f['wall_s']:.1f} s")
        if f["tokens_per_s"]:
            t.add_row("tokens/s", f"{f['tokens_per_s']:,.0f}")
        if f["mfu"] is not None:
            t.add_row("MFU", f"{f['mfu']:.1%}")
        from tenfold.engine.memory import add_summary_rows  # [memory] predicted vs measured

        add_summary_rows(t, summary.get("memory", {}))
        t.add_row("output", str(self.out_dir))
        self.console.print(t)

    def memory_report(self) -> int:
        """[memory] `tenfold train --memory-report`: one warm-up step, then one step measured
        by module and category (beside the planner's prediction), printed; nothing is written."""
        from tenfold.engine.memory import run_memory_report

        report = run_memory_report(self)
        if self.dist.is_main:
            _console(True).print(report)
        return 0


class _ArrayBundle:
    def __init__(self, train, val, vocab_size: int):
        self.train, self.val, self.vocab_size = train, val, vocab_size

    def describe(self) -> str:
        return f"user dataset: {len(self.train)} train / {len(self.val)} val sequences"


def _bundle_from_array(data, val_fraction: float) -> _ArrayBundle:
    arr = np.asarray(data.numpy() if isinstance(data, torch.Tensor) else data)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2:
        raise UserError(
            f"dataset must be an integer array of shape (sequences, seq_len + 1), got shape {arr.shape}"
        )
    n_val = int(len(arr) * val_fraction)
    train, val = (arr[: len(arr) - n_val], arr[len(arr) - n_val :]) if n_val else (arr, arr[:0])
    return _ArrayBundle(train, val, int(arr.max()) + 1)


def _console(main: bool):
    if not main:
        return None
    from rich.console import Console

    return Console()


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)
