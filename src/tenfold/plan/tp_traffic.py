"""Tensor-parallel traffic of one optimizer step, per rank, collective by collective.

Unit: the bytes one rank sends in a ring implementation (nccl-tests' bus-bandwidth factors):
an all-reduce of S bytes over t ranks moves 2 (t-1)/t S, a reduce-scatter or all-gather of S
bytes (t-1)/t S. `tenfold.engine.observe.comm_bytes` measures the same quantity, and a test holds the
two equal for tenfold's GPT (tests/test_tensor_parallel.py).

Per micro-batch (b sequences of s tokens, hidden h, t tp ranks, L layers on this stage):
  blocks      Megatron-LM's 4 all-reduces of b s h per layer (2 forward, 2 backward; an MoE
              layer, whole on every tp rank, drops the MLP's two;
              Narayanan et al. 2021 section 3.2: 8 b s h (t-1)/t elements); sequence
              parallelism replaces each by a reduce-scatter + all-gather of the same volume
              (Korthikanti et al. 2022 section 4.2.2). In the compute dtype (2 bytes under
              bf16/fp16 autocast, the matmul output's dtype), else 4.
  recompute   a checkpointed group re-runs its forward collectives, except the last one
              (the last projection's output is needed by no saved tensor, and torch's
              non-reentrant checkpoint stops recomputing early): SP 4n - 1 of (t-1)/t b s h
              for n layers, without SP 2n - 1 all-reduces.
  embedding   the vocabulary-split lookup: one reduce-scatter (SP) or all-reduce forward and
              its all-gather backward (SP), in fp32 (tenfold keeps fp32 parameters and the
              lookup is not autocast); learned positions add the same for s h (a (1, s) lookup).
  head        the gather of the final norm's output before the vocabulary-split projection,
              forward, and its reduce-scatter backward (or one all-reduce backward without SP).
  loss        loss_parallel's cross-entropy: 3 all-reduces of b s fp32 values (the row
              maximum, the sum of exponentials, the target's logit).
Per step:
  norms       under SP each norm's weight gradient is a partial sum over this rank's sequence
              positions, all-reduced once (per micro-batch when FSDP2 reduces per micro-batch).
  clip        the global gradient norm: one fp32 per DTensor parameter, all-reduced (on the
              tp group when there is no data parallelism; else on the flattened dp x tp group).
"""

from __future__ import annotations

from dataclasses import dataclass

from tenfold.models.presets import ModelConfig, norm_param_count
from tenfold.run import ResolvedRun


@dataclass(frozen=True)
class TPTraffic:
    """Bytes per rank per optimizer step on the tensor-parallel group, by source."""

    blocks: float
    recompute: float
    embedding: float
    head: float
    loss: float
    norms: float
    clip: float

    @property
    def total(self) -> float:
        return self.blocks + self.recompute + self.embedding + self.head + self.loss + self.norms + self.clip


def ring(kind: str, t: int) -> float:
    """Bytes one rank sends per byte of payload (all_reduce, reduce_scatter, all_gather)."""
    return (2.0 if kind == "all_reduce" else 1.0) * (t - 1) / t


def tp_traffic(cfg: ModelConfig, run: ResolvedRun, pp_rank: int) -> TPTraffic:
    """The traffic of pipeline rank `pp_rank` of `run`: its blocks (and their checkpointed groups,
    tenfold.terms.RecomputePolicy.checkpointed_blocks), the embedding on the first rank, the head
    on the last."""
    tp, sequence_parallel, precision = run.tp, run.sequence_parallel, run.precision
    micro_batch, seq_len, grad_accum, dp, zero = run.micro_batch, run.seq_len, run.grad_accum, run.dp, run.zero_runs_as
    layers, first, last = run.rank_layers(pp_rank), pp_rank == 0, pp_rank == run.pp - 1
    recompute_groups = [g for n in run.rank_stage_layers(pp_rank) for g in run.recompute.checkpointed_blocks(n)]
    if tp <= 1:
        return TPTraffic(0, 0, 0, 0, 0, 0, 0)
    h, m = cfg.d_model, grad_accum
    act = micro_batch * seq_len * h * (2.0 if precision in ("bf16", "fp16") else 4.0)
    step = ring("reduce_scatter", tp)  # = (t-1)/t; an all-reduce is two of these
    if cfg.is_moe:
        # an MoE layer is whole on every tp rank (tensor_parallel.gpt_plan; no sequence
        # parallelism): the attention's two all-reduces per layer only, and a recompute replays
        # each of them (the MoE layer after it saves the all-reduced output)
        blocks = m * layers * 4 * step * act
        per_group = lambda n: 2 * n  # noqa: E731
    else:
        blocks = m * layers * 8 * step * act
        per_group = (lambda n: 4 * n - 1) if sequence_parallel else (lambda n: 2 * (2 * n - 1))
    recompute = m * sum(per_group(len(g)) for g in recompute_groups) * step * act
    embedding = head = loss = 0.0
    if first:
        rows = micro_batch * seq_len + (seq_len if cfg.pos == "learned" else 0)
        embedding = m * 2 * step * rows * h * 4.0
    if last:
        head = m * 2 * step * act
        loss = m * 3 * ring("all_reduce", tp) * micro_batch * seq_len * 4.0
    norms = 0.0
    if sequence_parallel:
        norm_numel = norm_param_count(cfg)
        per_reduce = (2 * layers + (1 if last else 0)) * norm_numel * 4.0 * ring("all_reduce", tp)
        norms = per_reduce * (m if dp > 1 and zero >= 2 else 1)
    clip = ring("all_reduce", tp) * 4.0 * dtensor_count(cfg, layers, first, last, sequence_parallel) if dp == 1 else 0.0
    return TPTraffic(blocks, recompute, embedding, head, loss, norms, clip)


def dtensor_count(cfg: ModelConfig, layers: int, first: bool, last: bool, sequence_parallel: bool) -> int:
    """Parameter tensors the plan makes DTensors: every matmul weight (and bias) and the
    embeddings; the norms' weights (and biases) too under sequence parallelism."""
    per_norm = 2 if cfg.norm == "layernorm" else 1
    linears = 4 + (0 if cfg.is_moe else 3 if cfg.mlp == "swiglu" else 2)  # an MoE layer: plain tensors
    block = linears * (2 if cfg.bias else 1) + (2 * per_norm if sequence_parallel else 0)
    n = layers * block
    if first:
        n += 1 + (1 if cfg.pos == "learned" else 0)
    if last:
        n += (0 if cfg.tie_embeddings and first else 1) + (per_norm if sequence_parallel else 0)
    return n
