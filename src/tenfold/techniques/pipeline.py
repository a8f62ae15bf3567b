"""Pipeline parallelism: split the model (tenfold's GPT, or a Hugging Face Llama, Mistral or
Qwen2 causal LM) into stages and stream micro-batches through them.

Everything that schedules, sends and receives is `torch.distributed.pipelining`
(`PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` / `ScheduleInterleaved1F1B` /
`ScheduleInterleavedZeroBubble`); this module only decides *what* each stage owns and
*how the loss is normalised*, following torchtitan (`torchtitan/distributed/pipeline_parallel.py`):

1. Split by FQN (`tenfold.pipeline_layout.stage_layout`, the one split the planner shares):
   the block stack is cut by layer count with the token embedding and the output head each
   weighted as one layer, torchtitan's `generate_llm_fqn_per_model_part`. `--pp-split` sets
   the blocks per stage by hand.
2. Each stage keeps the full model's modules it owns, under the same names
   (`tok_emb.weight`, `layers.7.attn.wq.weight`, `output.weight`; for a Hugging Face model
   `model.embed_tokens.weight`, `model.layers.7.self_attn.q_proj.weight`, `lm_head.weight`),
   so a stage's state_dict is a slice of the full model's and checkpoints stay portable
   across pp degrees. `GPTStage.forward` runs embed (first stage), its blocks, head (last
   stage); `HFStage` (techniques/pipeline_hf.py) does the same for transformers' modules.
3. Recompute and ZeRO (FSDP2) are applied to each stage afterwards by
   `tenfold.engine.parallelize` (order: pipeline split -> recompute -> ZeRO).
4. The schedule is built with `scale_grads=False` and a loss that is already
   `sum(token CE) / global_tokens * dp_size` (torchtitan normalises by the global number of
   valid tokens in its trainer): the schedule must not divide by the
   micro-batch count again, and the dp average in DDP/FSDP then cancels the `* dp_size`,
   leaving exactly the single-process gradient of the mean token loss.

Looped placement for multi-stage schedules: rank r owns stages r, r+P, r+2P, ...
(torchtitan's `stage_ids_this_rank` for "loop" style schedules).

Tied embeddings (the head's weight is the embedding's): the split finds the tie and, on a rank
that holds the last stage without the first, gives the head a copy of its own
(techniques/tied_embeddings.py keeps the two copies one weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

# The split (blocks per stage) is the resolved run's `stage_layers`, checked and shared with the
# planner (tenfold.terms); the schedules' rules are the capability table's (tenfold.capabilities).
from tenfold.errors import UserError
from tenfold.models.adapter import model_kind
from tenfold.models.gpt import GPT
from tenfold.models.specs import spec_for
from tenfold.pipeline_layout import block_index, stage_layout  # torch-free, shared with the planner
from tenfold.techniques.pipeline_hf import HFStage
from tenfold.techniques.tied_embeddings import TiedPair, find_tied_pair, untie_on_rank
from tenfold.terms import local_stage_ids, runs_on_fsdp2


class GPTStage(nn.Module):
    """A slice of `tenfold.models.gpt.GPT` that keeps the full model's parameter names.

    It holds the GPT's own submodules (not copies) that the stage owns; the others are None
    and skipped. `forward` reuses `GPT.embed` / `GPT.head`, so a stage computes exactly
    what the full model computes on its slice.
    """

    def __init__(self, model: nn.Module, fqns: Sequence[str], stage_id: int, n_stages: int):
        super().__init__()

        if not isinstance(model, GPT):
            raise TypeError(f"GPTStage slices tenfold's GPT, not {type(model).__name__}")
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

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` (b, s): where the micro-batch's tokens sit in their sequences, the same
        in every row (context parallelism hands each rank two chunks of every sequence,
        techniques/context_parallel.py `local_batch`); None: 0..s-1, as `GPT.forward`."""
        positions = position_ids[0] if position_ids is not None else None
        h = GPT.embed(self, x, positions) if self.is_first else x  # type: ignore[arg-type]
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None and cos is not None:
            cos, sin = cos[positions], sin[positions]
        for block in self.layers.values():
            h = block(h, cos, sin)
        return GPT.head(self, h) if self.is_last else h  # type: ignore[arg-type]


@torch.no_grad()
def boundary_dtypes(stages: Sequence[nn.Module], autocast_dtype: torch.dtype | None) -> list[torch.dtype]:
    """dtype of each stage's output (the residual stream, logits for the last stage) under
    the run's autocast, found by chaining ALL stages (built on the full model, before the
    split drops what this rank does not own) on two tokens. `PipelineStage` needs them for
    static p2p metadata (`stage_io_examples`)."""
    device = next(stages[0].parameters()).device
    h = torch.zeros((1, 2), dtype=torch.long, device=device)
    extra = stage_kwargs(stages[0], h)
    enabled = autocast_dtype is not None and autocast_dtype != torch.float32
    out = []
    with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=enabled):
        for stage in stages:
            h = stage(h, **extra)
            out.append(h.dtype)
    return out


def stage_kwargs(stage: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict:
    """What every stage takes besides the activations: a Hugging Face stage the position ids
    of the whole sequences (the rows' own, or 0..s-1), tenfold's GPT nothing."""
    if not isinstance(stage, HFStage):
        return {}
    if position_ids is None:
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device).repeat(b, 1)
    return {"position_ids": position_ids}


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
    modules: list[nn.Module]  # GPTStage or HFStage, one per local stage
    n_stages: int
    pp_size: int
    counts: list[int]  # blocks per stage, all stages
    fqns: list[list[str]]  # module names per stage, all stages
    params: list[int]  # parameters per stage, all stages
    kind: str = "tenfold"  # the model kind (tenfold.models.specs)
    d_model: int = 0  # width of the residual stream sent between stages
    vocab_size: int = 0  # width of the last stage's logits
    dtypes: list[torch.dtype] | None = None  # each stage's output dtype (boundary_dtypes)
    tied: TiedPair | None = None  # the embedding the last stage's head is tied to (every rank knows it)
    tied_local: tuple[str, ...] = ()  # this rank's copies of it kept apart from another rank's (tied_embeddings)


def split_model(model: nn.Module, pp_rank: int, pp_size: int, counts: Sequence[int] | None = None,
                autocast_dtype: torch.dtype | None = None) -> PipelineSplit:
    """Cut the (fully initialised) model, tenfold's GPT or a Hugging Face Llama-family causal
    LM, into stages of `counts` blocks each (the resolved run's `stage_layers`, the split the
    planner prices; default one stage per rank, tenfold.terms.layer_counts) and keep this rank's.

    Every rank builds the same full model from the same seed first, so the pipeline starts
    from exactly the weights a single process would have; the modules a rank does not own
    are dropped with the full model (for models too large for one host, build on the meta
    device and load a seed checkpoint by FQN, as torchtitan recommends). With tied embeddings a
    rank that runs the last stage but not the first unties the model's head (a zero-filled copy
    of its own, techniques/tied_embeddings.py): split a model once.
    """
    kind, n_layers, has_pos_emb, d_model, vocab = _model_facts(model)
    layout = stage_layout(n_layers, len(counts) if counts is not None else pp_size, counts, kind, has_pos_emb)
    n = len(layout.counts)
    stage_cls = HFStage if spec_for(kind).hugging_face else GPTStage
    every = [stage_cls(model, layout.fqns[s], s, n) for s in range(n)]
    tied = find_tied_pair(every, spec_for(kind).stage_names)  # tied embeddings: the first and the last stage each keep a copy
    ids = local_stage_ids(pp_rank, pp_size, n)
    params = [sum(p.numel() for p in m.parameters()) for m in every]
    dtypes = boundary_dtypes(every, autocast_dtype)  # on the full model, before any copy is untied
    return PipelineSplit(
        stage_ids=ids, modules=[every[s] for s in ids], n_stages=n, pp_size=pp_size, counts=layout.counts,
        fqns=layout.fqns, params=params, kind=kind, d_model=d_model, vocab_size=vocab, dtypes=dtypes,
        tied=tied, tied_local=untie_on_rank(tied, every, ids),
    )


def _model_facts(model: nn.Module) -> tuple[str, int, bool, int, int]:
    """(kind, layers, learned positions, d_model, vocab) of a model the split can cut."""

    kind = model_kind(model)
    shape = spec_for(kind).pipeline_shape
    if shape is not None:
        return (kind, *shape(model))
    raise UserError(
        f"parallel.pp_degree > 1 splits tenfold's GPT or a Hugging Face Llama-family model into stages; "
        f"{type(model).__name__} is neither (use --pp 1, or pipeline it with torch.distributed.pipelining directly)"
    )


def _send_as(dtype: torch.dtype):
    """A forward hook giving a stage's output the dtype its p2p metadata names: gloo and NCCL
    move raw bytes, so a tensor of another dtype would arrive as garbage. A no-op when the
    prediction holds (always, in the tested layouts); a cast (exact, differentiable) otherwise."""

    def hook(module, args, output):
        return output.to(dtype)

    return hook


def describe_split(split: PipelineSplit) -> list[str]:
    """One line per stage: its modules and parameter count."""
    lines = []
    for s, names in enumerate(split.fqns):
        blocks = [i for i in (block_index(x, split.kind) for x in names) if i is not None]
        if not blocks:
            span = "no blocks"
        elif len(blocks) == 1:
            span = f"layer {blocks[0]}"
        else:
            span = f"layers {blocks[0]}-{blocks[-1]}"
        extras = [x for x in names if block_index(x, split.kind) is None]
        tie = (f"; {split.tied.head} tied to stage 0's {split.tied.embedding}"
               if split.tied and s == split.n_stages - 1 else "")
        lines.append(
            f"stage {s} (pp rank {s % split.pp_size}): "
            f"{span}{' + ' + ', '.join(extras) if extras else ''}; {split.params[s]:,} params{tie}"
        )
    return lines


# --------------------------------------------------------------------------- engine glue


def split_for_rank(model: nn.Module, run, dist_info, compute_dtype: torch.dtype | None) -> PipelineSplit:
    """Step 1 of `engine.parallelize` under PP: split, print the split once. The run's pipeline
    rules were checked when it was resolved (tenfold.run.resolve_run). `compute_dtype`: the
    autocast dtype (None for fp32)."""
    split = split_model(model, dist_info.pp_rank, dist_info.pp_size, run.stage_layers, compute_dtype or torch.float32)

    if compute_dtype is not None and runs_on_fsdp2(run.zero_stage, dist_info.tp_size, dist_info.dp_size, run.offload):
        # FSDP2's 16-bit parameters make the residual stream 16-bit too (the embedding's output,
        # every block's): what the stages really send, not the fp32 of the unwrapped model
        split.dtypes = [compute_dtype] * (split.n_stages - 1) + split.dtypes[-1:]
    for sid, module in zip(split.stage_ids, split.modules):
        if sid < split.n_stages - 1:
            module.register_forward_hook(_send_as(split.dtypes[sid]))
    if dist_info.is_main:
        print(f"pipeline: {split.n_stages} stages on {dist_info.pp_size} ranks, schedule "
              f"{run.pp_schedule}, {run.grad_accum} micro-batches/step")
        for line in describe_split(split):
            print("  " + line)
    return split
