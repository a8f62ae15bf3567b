"""One optimizer step, top to bottom (`Trainer.train_step` = accumulate_gradients, then
apply_gradients):
  1. count the target tokens of the whole global batch (all ranks, all micro-batches);
  2. per micro-batch: autocast forward, loss = sum of token losses / global tokens
     (x dp_size for the data-parallel average), scaled by the fp16 loss scale, backward;
     gradient reduction only on the last micro-batch where the ZeRO stage allows it;
     under context parallelism each micro-batch is first cut to this cp rank's part of every
     sequence (techniques/context_parallel.py), whose targets it counts and whose loss it sums;
  3. under tensor parallelism, settle the gradients of replicated parameters;
  4. `techniques.precision.finish_step`: unscale, the global overflow / non-finite check, skip
     or clip (global norm over every shard and pipeline stage) + step; the LR schedule advances
     only on steps that were taken (DeepSpeed's rule).
Validation (`evaluate`) runs the same forward without gradients.
"""

from __future__ import annotations

import logging

import torch

from tenfold.data import iter_eval
from tenfold.engine.loop.parts import Parts
from tenfold.models.moe import finish_router_step
from tenfold.techniques import accumulation as acc
from tenfold.techniques import zero
from tenfold.techniques.context_parallel import local_batch
from tenfold.techniques.expert_parallel import reduce_expert_gradients
from tenfold.techniques.precision import StepResult, Update, finish_step
from tenfold.techniques.tensor_parallel import loss_context, settle_gradients

log = logging.getLogger("tenfold")


def accumulate_gradients(p: Parts, micro_batches: list[dict]) -> tuple[float, int]:
    """Forward + backward over this rank's micro-batches; returns (global mean loss,
    global target tokens). Gradients are left in `.grad`, scaled by the loss scale."""
    dist, scaler = p.dist, p.precision.scaler
    dp_group = dist.mesh["dp"].get_group() if dist.mesh is not None else None
    micro_batches = cp_parts(p, micro_batches)
    if dist.pp_size > 1:  # the pipeline schedule runs all micro-batches (techniques/pipeline_runner.py)
        result = p.model.train_step(micro_batches, scaler.scale, dp_group)
        return result.loss, result.global_tokens
    global_tokens = int(acc.all_reduce_sum(acc.count_targets(micro_batches), dp_group))
    loss_sum = torch.zeros((), dtype=torch.float64, device=dist.device)
    for i, mb in enumerate(micro_batches):
        batch = {k: v.to(dist.device, non_blocking=True) for k, v in mb.items()}
        with zero.grad_sync(p.model, enabled=i == len(micro_batches) - 1), loss_context(dist.tp_size):
            with p.precision.autocast():
                mb_loss_sum = forward_loss(p, batch)
            loss = acc.scaled_for_backward(mb_loss_sum, global_tokens, dist.dp_size)
            scaler.scale_loss(loss).backward()
        loss_sum += mb_loss_sum.detach().double()
    return acc.all_reduce_sum(float(loss_sum), dp_group) / max(global_tokens, 1), global_tokens


def cp_parts(p: Parts, batches: list[dict]) -> list[dict]:
    """Under context parallelism, this cp rank's part of each batch (its two chunks of every
    sequence, with their positions); the batches themselves otherwise."""
    d = p.dist
    return [local_batch(b, d.cp_size, d.cp_rank) for b in batches] if d.cp_size > 1 else batches


def forward_loss(p: Parts, batch: dict) -> torch.Tensor:
    """Sum of token losses of one micro-batch (fp32); under tensor parallelism inside
    `loss_context` (loss_parallel: the logits stay split over the vocabulary)."""
    return p.adapter.loss_sum(p.model, batch)


def apply_gradients(p: Parts, loss: float, global_tokens: int, step: int) -> StepResult:
    """The step tail every run takes (techniques.precision.finish_step); `step`: the number of
    the optimizer step being taken (1-based)."""
    params = [q for q in p.model.parameters() if q.requires_grad]
    if p.dist.ep_size > 1:
        reduce_expert_gradients(p.model, expert_replica_group(p.dist), p.dist.dp_size, zero.experts_sharded(p.model))
    if p.dist.tp_size > 1:
        settle_gradients(params)
    train = p.train  # clipping and the non-finite rule are not part of the run's layout
    update = Update(p.optimizer, p.scheduler, p.precision, lambda max_norm: clip(p, max_norm), train.grad_clip,
                    on_nan=train.on_nan)
    result = finish_step(update, params, loss, global_tokens, step=step)
    if result.message and p.dist.is_main:
        log.warning(result.message)
    dp_group = p.dist.mesh["dp"].get_group() if p.dist.mesh is not None else None
    result.expert_load = finish_router_step(p.model, dp_group, update_bias=not result.skipped)
    return result


def expert_replica_group(dist):
    """The ranks holding the same experts (None: only this one)."""
    replicas = dist.ep_mesh["dp_mod_ep"]
    return replicas.get_group() if replicas.size() > 1 else None


def clip(p: Parts, max_norm: float) -> float:
    """Clip to the global gradient norm over every shard and every pipeline stage."""
    pp_groups = (p.dist.mesh["pp"].get_group(),) if p.dist.pp_size > 1 else ()
    return zero.clip_grad_norm(p.model, max_norm, extra_groups=pp_groups)


@torch.no_grad()
def evaluate(p: Parts) -> float | None:
    """Mean validation loss over the first eval_batches micro-batches. Every rank scores
    the same batches: sharded models need every rank in each forward anyway."""
    val = p.data.val
    if val is None or len(val) == 0:
        return None
    batches = list(iter_eval(val, p.run.micro_batch, p.train.eval_batches))
    count = sum(acc.count_targets([b]) for b in batches)
    p.model.eval()
    try:
        if p.dist.pp_size > 1:  # forward through the stages, loss on the last (summed over cp ranks)
            return p.model.eval_loss_sum(cp_parts(p, batches)) / max(count, 1)
        total = 0.0
        for batch in cp_parts(p, batches):
            with p.precision.autocast(), loss_context(p.dist.tp_size):
                total += float(forward_loss(p, {k: v.to(p.dist.device) for k, v in batch.items()}))
        if p.dist.cp_size > 1:  # each cp rank scored its part of every sequence
            total = acc.all_reduce_sum(total, p.dist.cp_group)
        return total / max(count, 1)
    finally:
        p.model.train()
