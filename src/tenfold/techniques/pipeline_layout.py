"""Pipeline layout without torch: how the blocks are divided among the stages (by FQN,
torchtitan's `generate_llm_fqn_per_model_part`) and which rank owns which stage.
`tenfold.techniques.pipeline` builds the stages from this. The checks a pipelined run must pass
(stage count, micro-batches, tied embeddings, --pp-split) are the engine's capability table's,
`tenfold.capabilities`, applied whenever a run is resolved and by `tenfold plan --search`.
"""

from __future__ import annotations

from typing import Sequence

from tenfold.errors import UserError


# --------------------------------------------------------------------------- the split


def layer_counts(n_layers: int, stages: int, input_weight: int = 1, output_weight: int = 1) -> list[int]:
    """Blocks per stage with the embedding and the head weighted as `input_weight` and
    `output_weight` layers (torchtitan `generate_llm_fqn_per_model_part`): the
    L + w_in + w_out "effective layers" are cut into equal parts, earlier stages taking
    the remainder, and the first/last stage give up w_in/w_out of their share."""
    if stages == 1:
        return [n_layers]
    effective = n_layers + input_weight + output_weight
    per_stage, extra = divmod(effective, stages)
    if per_stage < max(input_weight, output_weight):
        raise UserError(
            f"cannot split {n_layers} layers into {stages} stages with the embedding and head "
            f"weighted as layers; use fewer stages or --pp-split"
        )
    counts, left = [], n_layers
    for s in range(stages):
        share = per_stage + (1 if s < extra else 0)
        if s == 0:
            share -= input_weight
        if s == stages - 1:
            share -= output_weight
        take = min(share, left) if s < stages - 1 else left
        counts.append(take)
        left -= take
    return counts


def split_fqns(n_layers: int, counts: Sequence[int], has_pos_emb: bool) -> list[list[str]]:
    """Module names (FQNs in `GPT`) owned by each stage, given blocks per stage."""
    out, start = [], 0
    for s, n in enumerate(counts):
        names = []
        if s == 0:
            names += ["tok_emb"] + (["pos_emb"] if has_pos_emb else [])
        names += [f"layers.{i}" for i in range(start, start + n)]
        if s == len(counts) - 1:
            names += ["norm", "output"]
        out.append(names)
        start += n
    return out


def local_stage_ids(pp_rank: int, pp_size: int, n_stages: int) -> list[int]:
    """Looped placement: rank r runs stages r, r+P, ... (Megatron's interleaving)."""
    return list(range(pp_rank, n_stages, pp_size))
