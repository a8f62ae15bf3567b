"""Running a pipelined step: the `torch.distributed.pipelining` schedule over this rank's
stages, the token-weighted loss, bubble measurement, and `PipelinedModel`, the module the
trainer drives under pipeline parallelism. What each stage owns is decided in
tenfold.techniques.pipeline."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import pipelining as pl
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.pipelining import PipelineStage

from tenfold.errors import UserError
from tenfold.models.loss import replicated_value
from tenfold.models.moe import _in_backward, moe_layers, with_stage_aux_loss
from tenfold.models.specs import spec_for
from tenfold.techniques.accumulation import all_reduce_sum, count_targets
from tenfold.techniques.pipeline import PipelineSplit, stage_io_examples
from tenfold.techniques.tensor_parallel import loss_context
from tenfold.techniques.tied_embeddings import TiedEmbedding
from tenfold.terms import IGNORE_INDEX, MULTI_STAGE_SCHEDULES


# --------------------------------------------------------------------------- the step


def predicted_bubble(pp_size: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """Planner's bubble fraction (P-1)/m, divided by V for interleaved schedules
    (Narayanan et al. 2021 §2.2): idle time relative to the ideal compute time."""
    return (pp_size - 1) / (n_microbatches * virtual_stages)


class _StageTimer:
    """Busy time of this rank's stages: wraps the forward/backward chunk methods of each
    `PipelineStage`. Everything else in the step's wall time is idle: waiting for the
    neighbour stage, and the p2p transfers themselves (not overlapped on gloo/CPU)."""

    def __init__(self) -> None:
        self.busy_s = 0.0

    def wrap(self, stage, method: str) -> None:
        fn = getattr(stage, method)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - t0

        setattr(stage, method, timed)


def _autocast_forward(stage, dtype: torch.dtype) -> None:
    """Run the stage's forward chunks under autocast, and only those: the schedule calls
    backward outside forward_one_chunk, and backward must not run under autocast
    (autograd replays each op in the dtype its forward used)."""
    fn = stage.forward_one_chunk

    def forward_one_chunk(*args, **kwargs):
        with torch.autocast(stage.device.type, dtype=dtype):
            return fn(*args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk


@dataclass
class PipelineStepResult:
    loss: float  # global mean token loss (same value on every rank)
    global_tokens: int  # target tokens of the whole global batch
    step_s: float  # wall time of the schedule step on this rank
    pipeline_s: float  # wall time of the whole pipeline step: max of step_s over the pp group
    busy_s: float  # time this rank spent in its stages' forward/backward
    bubble: float  # (pipeline_s - busy_s) / busy_s: idle relative to compute, as (P-1)/m is

    @property
    def idle_share(self) -> float:
        """Idle share of the step's wall time, 1 - busy/T (= (P-1)/(m+P-1) for 1F1B)."""
        return 1.0 - self.busy_s / self.pipeline_s


class PipelineRunner:
    """One optimizer step's forward+backward through the pipeline.

    `train_step(inputs, targets, global_tokens)` takes this dp rank's m micro-batches
    (lists of (b, s) tensors, or whole (m*b, s) tensors), runs the schedule and returns a
    `PipelineStepResult` whose `.loss` is the global mean token loss on every rank
    (computed on the last stage, one all_reduce). Gradients are left in the parameters,
    equal to the single-process gradients (after the dp average done by DDP/FSDP) times
    `loss_scale`.
    """

    def __init__(
        self,
        stage_modules: Sequence[nn.Module],
        stage_ids: Sequence[int],
        n_stages: int,
        schedule: str,
        n_microbatches: int,
        *,
        device: torch.device,
        pp_group: dist.ProcessGroup | None = None,
        dp_size: int = 1,
        autocast_dtype: torch.dtype | None = None,
        stage_io: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        tp_size: int = 1,
        seq_len: int | None = None,
        with_positions: bool = False,
        cp_size: int = 1,
    ):
        self.schedule_name = schedule
        self.n_microbatches = n_microbatches
        self.stage_ids = list(stage_ids)
        self.n_stages = n_stages
        self.dp_size = dp_size
        self.tp_size = tp_size  # the tp ranks of a last stage each hold the whole (replicated) loss
        # context parallelism: dp_size counts dp x cp ranks; the cp ranks of one dp rank each
        # score their part of the same rows
        self.cp_size = cp_size
        self.device = device
        self.pp_group = pp_group
        self.loss_scale = 1.0  # fp16: the trainer passes the dynamic scale to each step
        self.global_tokens = 1
        # Hugging Face stages take the micro-batch's position ids (techniques/pipeline_hf.py), and
        # so do tenfold's GPT stages under context parallelism (`GPTStage.forward`)
        self.with_positions = with_positions
        self.modules = list(stage_modules)
        # stage_io: (input, output) example per local stage (stage_io_examples) -> static
        # p2p metadata; None -> PipelineStage infers shapes from the first step.
        io = stage_io or [(None, None)] * len(self.modules)
        self.stages = [
            PipelineStage(m, s, n_stages, device, input_args=x, output_args=y, group=pp_group)
            for m, s, (x, y) in zip(self.modules, self.stage_ids, io)
        ]
        # mixture-of-experts stages: each micro-batch's balance losses join the gradient at the
        # stage output (`_aux_hook`), weighted by the micro-batch's target tokens
        self.mb_targets: list[int] = []
        self._aux_calls = [0] * len(self.modules)
        for i, m in enumerate(self.modules):
            if moe_layers(m):
                m.register_forward_hook(self._aux_hook(i))
        self.timer = _StageTimer()
        for st in self.stages:
            if autocast_dtype is not None and autocast_dtype != torch.float32:
                _autocast_forward(st, autocast_dtype)
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                self.timer.wrap(st, method)
        self.schedule = build_schedule(schedule, self.stages, n_microbatches, self._loss_fn)
        # (b, s) of a micro-batch of token ids: fixed by the static metadata (a stage's input is
        # (b, s / tp, d) under sequence parallelism, so not read from it), else by the first step
        self.micro_shape: tuple[int, ...] | None = (
            (stage_io[0][0].shape[0], seq_len or stage_io[0][0].shape[1]) if stage_io else None)

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return (self.n_stages - 1) in self.stage_ids

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # sum CE / GLOBAL tokens * dp_size: micro-batch losses add up to this dp rank's share
        # of the global mean, and the dp average (divide by dp_size) in DDP/FSDP makes it the
        # exact global mean; the schedule itself must not rescale (scale_grads=False).
        # Under tensor parallelism the logits are split over the vocabulary and the cross-entropy
        # runs under loss_parallel (entered around the whole schedule step in `_run`).
        ce = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return ce * (self.dp_size * self.loss_scale / self.global_tokens)

    def _aux_hook(self, index: int):
        """A forward hook on local stage `index`: in a training forward (not a recompute's replay
        in backward) the output carries the stage's MoE balance losses, their gradient the one
        `tenfold.models.moe.with_router_aux_loss` gives them without a pipeline: the micro-batch's
        target tokens x dp x loss scale / global tokens. The schedule runs a stage's forwards in
        micro-batch order, so the k-th call of a step is micro-batch k."""

        def hook(module, args, output):
            if not (module.training and torch.is_grad_enabled()) or _in_backward() or not self.mb_targets:
                return None
            mb = self._aux_calls[index]
            self._aux_calls[index] += 1
            weight = self.mb_targets[mb] * self.dp_size * self.loss_scale / self.global_tokens
            return with_stage_aux_loss(output, module, weight)

        return hook

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool,
             positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        b, rem = divmod(inputs.shape[0], self.n_microbatches)
        if rem or (self.micro_shape is not None and (b, *inputs.shape[1:]) != self.micro_shape):
            raise ValueError(
                f"a pipeline step takes {self.n_microbatches} micro-batches of shape "
                f"{self.micro_shape}; got a batch of shape {tuple(inputs.shape)}"
            )
        self.micro_shape = (b, *inputs.shape[1:])  # p2p buffers are sized by the first step
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        args = (inputs,) if self.has_first_stage else ()
        tgt = targets if self.has_last_stage else None
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval

        # keyword arguments reach every stage, cut into micro-batches like the inputs
        kwargs = self._position_kwargs(inputs, positions)
        with loss_context(self.tp_size):  # forward and backward, as loss_parallel asks
            run(*args, target=tgt, losses=losses, return_outputs=False, **kwargs)
        return [replicated_value(loss) for loss in losses]

    def _position_kwargs(self, inputs: torch.Tensor, positions: torch.Tensor | None) -> dict:
        if not self.with_positions:
            return {}
        if positions is None:  # what transformers uses when none are given: 0..s-1 in every row
            positions = torch.arange(inputs.shape[1]).repeat(inputs.shape[0], 1)
        return {"position_ids": positions.to(self.device)}

    def train_step(self, inputs, targets, global_tokens: int, loss_scale: float = 1.0,
                   positions: torch.Tensor | None = None) -> PipelineStepResult:
        if isinstance(inputs, (list, tuple)):
            inputs, targets = torch.cat(list(inputs)), torch.cat(list(targets))
        self.global_tokens, self.loss_scale = max(int(global_tokens), 1), float(loss_scale)
        self.mb_targets = [int((t != IGNORE_INDEX).sum()) for t in targets.tensor_split(self.n_microbatches)]
        self._aux_calls = [0] * len(self.modules)
        self.timer.busy_s = 0.0
        if self.pp_group is not None and dist.is_initialized():
            # Start the stages together, so the bubble is not mixed with the previous
            # step's imbalance (optimizer step, data loading).
            dist.barrier(group=self.pp_group)
        t0 = time.perf_counter()
        losses = self._run(inputs, targets, train=True, positions=positions)
        step_s = time.perf_counter() - t0
        # Last stages hold sum(mb losses) = (their dp share of the mean) * dp_size * scale, once
        # on each of their tp ranks.
        local = sum(l.detach().double() for l in losses) / self.loss_scale if losses else 0.0
        loss = self._sum_over_world(local) / (self.dp_size * self.tp_size)
        pipeline_s = self._max_over_pp(step_s)
        busy = self.timer.busy_s
        bubble = (pipeline_s - busy) / busy if busy > 0 else float("nan")
        return PipelineStepResult(loss, int(global_tokens), step_s, pipeline_s, busy, bubble)

    def _max_over_pp(self, value: float) -> float:
        """The pipeline step ends when its slowest stage ends: a stage that finishes early
        (the last stage, after its final backward) is idle until then."""
        t = torch.tensor(value, dtype=torch.float64, device=self.device)
        if self.pp_group is not None and dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pp_group)
        return float(t)

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> float:
        """Sum of token CE over (inputs, targets), forward only, on every rank. Rows are
        padded with ignored targets to whole steps of the training shape (the p2p buffers
        keep the shape of the first training step)."""
        per_step = self.n_microbatches * (self.micro_shape[0] if self.micro_shape else 1)
        pad = (-inputs.shape[0]) % per_step
        if pad:
            inputs = torch.cat([inputs, inputs.new_zeros((pad, *inputs.shape[1:]))])
            targets = torch.cat([targets, targets.new_full((pad, *targets.shape[1:]), IGNORE_INDEX)])
            if positions is not None:
                positions = torch.cat([positions, torch.arange(positions.shape[1]).repeat(pad, 1)])
        self.global_tokens, self.loss_scale, dp = 1, 1.0, self.dp_size
        self.dp_size = 1
        try:
            total = 0.0
            for i in range(0, inputs.shape[0], per_step):
                rows = slice(i, i + per_step)
                losses = self._run(inputs[rows], targets[rows], train=False,
                                   positions=positions[rows] if positions is not None else None)
                total += float(sum(l.double() for l in losses)) if losses else 0.0
        finally:
            self.dp_size = dp
        # Every dp group scores the same rows (Trainer.evaluate), its cp ranks a part of each,
        # and every tp rank of a last stage holds the whole loss, so the world sum counts them
        # (dp x cp) / cp x tp times.
        return self._sum_over_world(total) / (dp // self.cp_size * self.tp_size)

    def _sum_over_world(self, value) -> float:
        """Only the last stage has the loss; an all_reduce over every rank (other stages add
        0) gives the value everywhere, so rank 0 (a first stage) can report it."""
        t = torch.as_tensor(value, dtype=torch.float64).reshape(()).to(self.device).clone()
        if dist.is_initialized():
            dist.all_reduce(t)
        return float(t)


def build_schedule(name: str, stages: list, n_microbatches: int, loss_fn: Callable):
    classes = {
        "gpipe": pl.ScheduleGPipe,
        "1f1b": pl.Schedule1F1B,
        "interleaved": pl.ScheduleInterleaved1F1B,
        "zero-bubble": pl.ScheduleInterleavedZeroBubble,
    }
    cls = classes[name]
    if name in MULTI_STAGE_SCHEDULES:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(stages) != 1:
        raise UserError(f"the {name} schedule runs one stage per rank, got {len(stages)}")
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


class PipelinedModel(nn.Module):
    """This rank's pipeline stages as one module with the full model's parameter names.

    It registers the submodules this rank owns (`tok_emb`, `layers.k`, `norm`, `output` of
    tenfold's GPT; `model.embed_tokens`, `model.layers.k`, `model.norm`, `lm_head` of a Hugging
    Face model) under their original names, so `named_parameters()` / `state_dict()` are a
    slice of the full model's and the optimizer, clipping, overflow check and checkpoints
    treat it like any model. The work is done by `self.runner` (a `PipelineRunner` over the
    parts as wrapped by recompute/ZeRO); calling the module directly is an error, because one
    rank cannot run the whole forward.
    """

    def __init__(self, split: PipelineSplit, parts: Sequence[nn.Module], runner: PipelineRunner, dist_info=None,
                 tied: TiedEmbedding | None = None):
        super().__init__()
        for stage_id, m in zip(split.stage_ids, split.modules):
            for fqn in split.fqns[stage_id]:
                _register(self, fqn, m.get_submodule(fqn))
        self.config = getattr(split.modules[0], "config", None)  # a Hugging Face model's (save_pretrained)
        self.dist_info = dist_info
        self.split = split
        self.parts = list(parts)  # plain list: the parts' modules are registered above
        self.runner = runner
        self.tied = tied  # tied embeddings: this rank's copy and its embedding group (tied_embeddings.py)
        self.bubbles: list[float] = []  # measured bubble of each step on this rank (idle / busy)

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "a pipelined model holds only this rank's stages; run steps with "
            "PipelinedModel.train_step / eval_loss_sum"
        )

    def train_step(self, micro_batches: list[dict], loss_scale: float = 1.0,
                   dp_group: dist.ProcessGroup | None = None) -> PipelineStepResult:
        """Forward+backward of this dp rank's micro-batches (dicts with input_ids, labels)
        through the pipeline; the loss is normalised by the GLOBAL target-token count."""

        global_tokens = int(all_reduce_sum(count_targets(micro_batches), dp_group))
        inputs, labels, positions = _concat(micro_batches)
        result = self.runner.train_step(inputs, labels, global_tokens, loss_scale, positions)
        if self.tied is not None:  # the two copies' gradients summed: before clipping and the step
            self.tied.all_reduce_grads(self)
        self.bubbles.append(result.bubble)
        return result

    def eval_loss_sum(self, batches: list[dict]) -> float:
        return self.runner.eval_loss_sum(*_concat(batches))

    def full_state_dict(self, trainable_only: bool = False) -> dict | None:
        """The whole model's unsharded state dict (CPU) on global rank 0, None elsewhere. Each
        stage's tensors are gathered over dp and tp (ZeRO-3 shards, tp splits) on its own ranks,
        then the stages' first dp/tp ranks, which form global rank 0's pp group, send them to
        rank 0. `trainable_only`: the parameters that train (a LoRA run's adapters). Collective:
        every rank calls it."""

        options = StateDictOptions(full_state_dict=True, ignore_frozen_params=trainable_only)
        state = get_model_state_dict(self, options=options)
        state = {k: v.detach().cpu() for k, v in state.items()}
        d = self.dist_info
        if d is None or not dist.is_initialized():
            return state
        if d.dp_rank or d.tp_rank:
            return None
        parts: list | None = [None] * d.pp_size if d.rank == 0 else None
        dist.gather_object(state, parts, dst=0, group=d.mesh["pp"].get_group())
        return {k: v for part in parts for k, v in part.items()} if parts is not None else None

    def step_metrics(self, tokens_per_s: float, world_size: int) -> dict:
        """metrics.jsonl fields of the last step: tokens/s per device (torchtitan's tps is
        per device too), this rank's measured bubble (idle / busy) and the planner's (P-1)/(m V)."""
        pp_size = self.split.pp_size
        return {
            "tokens_per_s_per_device": tokens_per_s / world_size,
            "pp_bubble": self.bubbles[-1] if self.bubbles else None,  # rank 0 = first stage
            "pp_bubble_predicted": predicted_bubble(
                pp_size, self.runner.n_microbatches, len(self.runner.stage_ids)),
        }

    def report(self, dist_info) -> dict:
        """Split, schedule and bubble (measured per pp rank vs predicted), for summary.json.
        Collective: every rank must call it. The first step is left out of the measured
        bubble (it includes the p2p shape handshake)."""
        steady = self.bubbles[1:] or self.bubbles
        mine = sum(steady) / len(steady) if steady else float("nan")
        per_rank = gather_per_rank(mine)
        pp = dist_info.pp_size
        n = len(per_rank) // pp  # ranks per pp rank: dp x tp (global rank = (pp*dp + dp)*tp + tp)
        per_stage_rank = [sum(per_rank[r * n:(r + 1) * n]) / n for r in range(pp)]
        v = len(self.runner.stage_ids)
        return {
            "schedule": self.runner.schedule_name,
            "stages": self.split.n_stages, "virtual_stages": v,
            "blocks_per_stage": self.split.counts,
            "microbatches": self.runner.n_microbatches,
            "bubble_predicted": predicted_bubble(pp, self.runner.n_microbatches, v),
            "bubble_measured_per_pp_rank": per_stage_rank,
        }


def _register(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Put `module` at `fqn` under `root`, making the containers on the way (ModuleDicts)."""
    *path, name = fqn.split(".")
    for part in path:
        if not hasattr(root, part):
            setattr(root, part, nn.ModuleDict())
        root = getattr(root, part)
    root.add_module(name, module)


def _concat(batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input ids, labels, position ids or None) of the micro-batches, as whole tensors."""
    positions = [b["position_ids"] for b in batches if "position_ids" in b]
    return (torch.cat([b["input_ids"] for b in batches]), torch.cat([b["labels"] for b in batches]),
            torch.cat(positions) if positions else None)


def build_pipelined_model(split: PipelineSplit, parts: Sequence[nn.Module], run, dist_info,
                          compute_dtype: torch.dtype | None, tied: TiedEmbedding | None = None) -> PipelinedModel:
    """Last step of `engine.parallelize` under PP: the parts (after recompute and ZeRO) go
    into `PipelineStage`s and the configured schedule. `tied`: the tied embedding's copies."""
    micro_batch = run.micro_batch
    io = None
    if split.dtypes is not None:
        # Under sequence parallelism a stage hands on its (b, s/tp, d) slice of the residual
        # stream: Narayanan et al. 2021's scatter/gather of p2p traffic, section 4.1. Under
        # context parallelism a stage holds this cp rank's s/cp tokens of every sequence
        # (`run.local_seq_len`), and so do its p2p buffers and the last stage's logits.
        seq_split = run.tp if run.sequence_parallel else 1
        io = [stage_io_examples(sid, split.n_stages, (micro_batch, run.local_seq_len), split.d_model,
                                split.vocab_size, split.dtypes, seq_split) for sid in split.stage_ids]
    runner = PipelineRunner(
        parts, split.stage_ids, split.n_stages, run.pp_schedule, run.grad_accum, device=dist_info.device,
        pp_group=dist_info.mesh["pp"].get_group(), dp_size=dist_info.dp_size,
        autocast_dtype=compute_dtype or torch.float32, stage_io=io, tp_size=dist_info.tp_size,
        seq_len=run.local_seq_len, cp_size=dist_info.cp_size,
        # a Hugging Face stage takes position ids; under cp every stage does (its tokens' own positions)
        with_positions=spec_for(split.kind).hugging_face or dist_info.cp_size > 1,
    )
    return PipelinedModel(split, parts, runner, dist_info, tied)


def gather_per_rank(value) -> list:
    """[value of rank 0, rank 1, ...] on every rank (one all_gather_object)."""
    if not dist.is_initialized():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
