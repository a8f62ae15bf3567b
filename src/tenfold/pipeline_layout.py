"""Pipeline layout without torch: how the blocks are divided among the stages (by FQN,
torchtitan's `generate_llm_fqn_per_model_part`) and which rank owns which stage.

`stage_layout` is THE split: the engine builds its stages from it
(`tenfold.techniques.pipeline.split_model`) for tenfold's GPT and for a Hugging Face
Llama-family causal LM alike, and the planner can price the same stages, since it imports no
torch. The two model kinds differ only in their module names (`STAGE_NAMES`). The checks a
pipelined run must pass (stage count, micro-batches, tied embeddings, --pp-split) are the engine's
capability table's, `tenfold.capabilities`, applied whenever a run is resolved and by
`tenfold plan --search`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tenfold.errors import UserError


@dataclass(frozen=True)
class StageNames:
    """A model kind's module names: what the first stage holds before the blocks, the prefix of
    block i's name, and what the last stage holds after them."""

    embedding: tuple[str, ...]
    block_prefix: str
    head: tuple[str, ...]
    learned_positions: tuple[str, ...] = ()  # on the first stage too, when the model has them


STAGE_NAMES = {
    "tenfold": StageNames(("tok_emb",), "layers.", ("norm", "output"), learned_positions=("pos_emb",)),
    # transformers' LlamaForCausalLM and the families that share its layout (Mistral, Qwen2)
    "hf": StageNames(("model.embed_tokens",), "model.layers.", ("model.norm", "lm_head")),
}


@dataclass(frozen=True)
class StageLayout:
    counts: list[int]  # blocks per stage, all stages
    fqns: list[list[str]]  # module names per stage, all stages


# --------------------------------------------------------------------------- the split


def stage_layout(n_layers: int, stages: int, pp_split: Sequence[int] | None = None, kind: str = "tenfold",
                 has_pos_emb: bool = False) -> StageLayout:
    """Blocks and module names of every stage: `pp_split` (--pp-split, checked) if given, else
    the even split with the embedding and the head weighted as one layer each."""
    from tenfold.capabilities import check_manual_split

    if stages > n_layers:
        raise UserError(f"{stages} pipeline stages is more than the model's {n_layers} layers; use fewer stages")
    if pp_split is not None:
        check_manual_split(pp_split, stages, n_layers)
        counts = list(pp_split)
    else:
        counts = layer_counts(n_layers, stages)
    return StageLayout(counts, split_fqns(n_layers, counts, has_pos_emb, kind))


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


def split_fqns(n_layers: int, counts: Sequence[int], has_pos_emb: bool = False, kind: str = "tenfold") -> list[list[str]]:
    """Module names (FQNs in the full model of `kind`, STAGE_NAMES) owned by each stage, given
    blocks per stage."""
    if sum(counts) != n_layers:
        raise ValueError(f"block counts {list(counts)} do not sum to the model's {n_layers} layers")
    names_of = STAGE_NAMES[kind]
    out, start = [], 0
    for s, n in enumerate(counts):
        names = []
        if s == 0:
            names += [*names_of.embedding, *(names_of.learned_positions if has_pos_emb else ())]
        names += [f"{names_of.block_prefix}{i}" for i in range(start, start + n)]
        if s == len(counts) - 1:
            names += list(names_of.head)
        out.append(names)
        start += n
    return out


def block_index(fqn: str, kind: str = "tenfold") -> int | None:
    """The block number of a stage's module name, None for the embedding and the head."""
    prefix = STAGE_NAMES[kind].block_prefix
    return int(fqn[len(prefix):]) if fqn.startswith(prefix) else None


def local_stage_ids(pp_rank: int, pp_size: int, n_stages: int) -> list[int]:
    """Looped placement: rank r runs stages r, r+P, ... (Megatron's interleaving)."""
    return list(range(pp_rank, n_stages, pp_size))
