"""Pipeline parallelism: split the GPT into stages and stream micro-batches through them.

Everything that schedules, sends and receives is `torch.distributed.pipelining`
(`PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` / `ScheduleInterleaved1F1B` /
`ScheduleInterleavedZeroBubble`); this module only decides *what* each stage owns and
*how the loss is normalised*, following torchtitan (`torchtitan/distributed/pipeline_parallel.py`):

1. Split by FQN (`split_fqns`): the block stack is cut by layer count with the token
   embedding and the output head each weighted as one layer, torchtitan's
   `generate_llm_fqn_per_model_part`. `--pp-split` sets the blocks per stage by hand.
2. Each stage keeps the full model's modules it owns, under the same names
   (`tok_emb.weight`, `layers.7.attn.wq.weight`, `output.weight`), so a stage's
   state_dict is a slice of the full model's and checkpoints stay portable across pp
   degrees. `GPTStage.forward` runs embed (first stage), its blocks, head (last stage).
3. Recompute and ZeRO (FSDP2) are applied to each stage afterwards by
   `tenfold.engine.parallelize` (order: pipeline split -> recompute -> ZeRO).
4. The schedule is built with `scale_grads=False` and a loss that is already
   `sum(token CE) / global_tokens * dp_size` (torchtitan normalises by the global number of
   valid tokens in its trainer): the schedule must not divide by the
   micro-batch count again, and the dp average in DDP/FSDP then cancels the `* dp_size`,
   leaving exactly the single-process gradient of the mean token loss.

Looped placement for multi-stage schedules: rank r owns stages r, r+P, r+2P, ...
(torchtitan's `stage_ids_this_rank` for "loop" style schedules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

# The split (blocks per stage) is the resolved run's `stage_layers`, checked and shared with the
# planner (tenfold.terms); the schedules' rules are the capability table's (tenfold.capabilities).
from tenfold.errors import UserError
from tenfold.techniques.pipeline_layout import split_fqns  # torch-free
from tenfold.terms import layer_counts, local_stage_ids


class GPTStage(nn.Module):
    """A slice of `tenfold.models.gpt.GPT` that keeps the full model's parameter names.

    It holds the GPT's own submodules (not copies) that the stage owns; the others are None
    and skipped. `forward` reuses `GPT.embed` / `GPT.head`, so a stage computes exactly
    what the full model computes on its slice.
    """

    def __init__(self, model: nn.Module, fqns: Sequence[str], stage_id: int, n_stages: int):
        super().__init__()
        from tenfold.models.gpt import GPT  # local: keep this module importable for planning

        if not isinstance(model, GPT):
            raise UserError(
                f"parallel.pp_degree > 1 splits tenfold's GPT into stages; {type(model).__name__} "
                "is not one (use --pp 1, or pipeline it with torch.distributed.pipelining directly)"
            )
        self.cfg = model.cfg
        self.stage_id, self.n_stages = stage_id, n_stages
        owned = set(fqns)
        self.tok_emb = model.tok_emb if "tok_emb" in owned else None
        self.pos_emb = model.pos_emb if "pos_emb" in owned else None
        self.layers = nn.ModuleDict(
            {k: b for k, b in model.layers.items() if f"layers.{k}" in owned}
        )
        self.norm = model.norm if "norm" in owned else None
        self.output = model.output if "output" in owned else None
        # RoPE tables are non-persistent buffers: every stage with blocks needs them.
        if model.rope_cos is not None:
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None

    @property
    def is_first(self) -> bool:
        return self.tok_emb is not None

    @property
    def is_last(self) -> bool:
        return self.output is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tenfold.models.gpt import GPT

        h = GPT.embed(self, x) if self.is_first else x  # type: ignore[arg-type]
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin)
        return GPT.head(self, h) if self.is_last else h  # type: ignore[arg-type]


@torch.no_grad()
def boundary_dtypes(model: nn.Module, counts: Sequence[int], autocast_dtype: torch.dtype | None) -> list[torch.dtype]:
    """dtype of each stage's output (the residual stream, logits for the last stage) under
    the run's autocast, found by running the full model on two tokens before the split.
    `PipelineStage` needs them for static p2p metadata (`stage_io_examples`)."""
    device = next(model.parameters()).device
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    enabled = autocast_dtype is not None and autocast_dtype != torch.float32
    out, blocks = [], list(model.layers.values())
    with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=enabled):
        h, start = model.embed(ids), 0
        for n in counts:
            for block in blocks[start:start + n]:
                h = block(h, model.rope_cos, model.rope_sin)
            start += n
            out.append(h.dtype)
        out[-1] = model.head(h).dtype
    return out


def stage_io_examples(stage_id: int, n_stages: int, micro_shape: tuple[int, int], d_model: int,
                      vocab: int, dtypes: Sequence[torch.dtype], seq_split: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors with the shape/dtype of a stage's input and output for one micro-batch:
    token ids (b, s) into the first stage, the residual stream (b, s / seq_split, d) between
    stages (seq_split = tp under sequence parallelism), logits (b, s, vocab) out of the last. Static metadata spares `PipelineStage` its
    dynamic shape inference, a real forward/backward outside DDP's no_sync that leaves the
    DDP reducer expecting gradients twice in torch 2.13 (an INTERNAL ASSERT at the next step)."""
    b, s = micro_shape
    if stage_id == 0:
        x = torch.empty((b, s), dtype=torch.long, device="meta")
    else:
        x = torch.empty((b, s // seq_split, d_model), dtype=dtypes[stage_id - 1], device="meta", requires_grad=True)
    last = stage_id == n_stages - 1
    out_shape = (b, s, vocab) if last else (b, s // seq_split, d_model)
    y = torch.empty(out_shape, dtype=dtypes[stage_id], device="meta", requires_grad=True)
    return x, y


@dataclass
class PipelineSplit:
    """What this rank owns: stage ids, the stage modules, and the whole plan for printing."""

    stage_ids: list[int]
    modules: list[GPTStage]
    n_stages: int
    pp_size: int
    counts: list[int]  # blocks per stage, all stages
    fqns: list[list[str]]  # module names per stage, all stages
    dtypes: list[torch.dtype] | None = None  # each stage's output dtype (boundary_dtypes)


def split_model(model: nn.Module, pp_rank: int, pp_size: int, counts: Sequence[int] | None = None) -> PipelineSplit:
    """Cut the (fully initialised) GPT into stages of `counts` blocks each (the resolved run's
    `stage_layers`, the split the planner prices; default: one stage per rank, split by
    `tenfold.terms.layer_counts`) and keep this rank's.

    Every rank builds the same full model from the same seed first, so the pipeline starts
    from exactly the weights a single process would have; the modules a rank does not own
    are dropped with the full model (for models too large for one host, build on the meta
    device and load a seed checkpoint by FQN, as torchtitan recommends).
    """
    cfg = model.cfg
    counts = list(counts) if counts is not None else layer_counts(cfg.n_layers, pp_size)
    n = len(counts)
    fqns = split_fqns(cfg.n_layers, counts, model.pos_emb is not None)
    ids = local_stage_ids(pp_rank, pp_size, n)
    modules = [GPTStage(model, fqns[s], s, n) for s in ids]
    return PipelineSplit(
        stage_ids=ids, modules=modules, n_stages=n, pp_size=pp_size, counts=counts, fqns=fqns
    )


def describe_split(split: PipelineSplit, model_cfg) -> list[str]:
    """One line per stage: its modules and parameter count (from the presets' exact counts)."""
    from tenfold.models.presets import block_param_count, embedding_param_count, head_param_count

    lines = []
    for s, (names, n_blocks) in enumerate(zip(split.fqns, split.counts)):
        params = n_blocks * block_param_count(model_cfg)
        params += embedding_param_count(model_cfg) if s == 0 else 0
        params += head_param_count(model_cfg) if s == split.n_stages - 1 else 0
        blocks = [x for x in names if x.startswith("layers.")]
        if not blocks:
            span = "no blocks"
        elif len(blocks) == 1:
            span = f"layer {blocks[0][7:]}"
        else:
            span = f"layers {blocks[0][7:]}-{blocks[-1][7:]}"
        extras = [x for x in names if not x.startswith("layers.")]
        lines.append(
            f"stage {s} (pp rank {s % split.pp_size}): "
            f"{span}{' + ' + ', '.join(extras) if extras else ''}; {params:,} params"
        )
    return lines


# --------------------------------------------------------------------------- engine glue


def split_for_rank(model: nn.Module, run, dist_info, compute_dtype: torch.dtype | None) -> PipelineSplit:
    """Step 1 of `engine.parallelize` under PP: split, print the split once. The run's pipeline
    rules were checked when it was resolved (tenfold.run.resolve_run). `compute_dtype`: the
    autocast dtype (None for fp32)."""
    split = split_model(model, dist_info.pp_rank, dist_info.pp_size, run.stage_layers)
    split.dtypes = boundary_dtypes(model, split.counts, compute_dtype or torch.float32)
    if dist_info.is_main:
        print(f"pipeline: {split.n_stages} stages on {dist_info.pp_size} ranks, schedule "
              f"{run.pp_schedule}, {run.grad_accum} micro-batches/step")
        for line in describe_split(split, model.cfg):
            print("  " + line)
    return split
