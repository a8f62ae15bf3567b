"""Pipeline layout without torch: the module names (FQNs) each stage owns, for tenfold's GPT and
for a Hugging Face Llama-family causal LM alike (torchtitan's `generate_llm_fqn_per_model_part`).

How many blocks each stage gets is the resolved run's `stage_layers` (tenfold.terms
.stage_layer_counts: the embedding and the head weighted as a layer each, or --pp-split), the split
the planner prices too; `stage_layout` turns it into the names the engine cuts the model by
(`tenfold.techniques.pipeline.split_model`). The two model kinds differ only in their module
names (`STAGE_NAMES`: each family's `stage_names`, tenfold.models.specs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tenfold.models.specs import SPECS, StageNames  # torch-free
from tenfold.terms import stage_layer_counts

STAGE_NAMES: dict[str, StageNames] = {kind: s.stage_names for kind, s in SPECS.items() if s.stage_names}


@dataclass(frozen=True)
class StageLayout:
    counts: list[int]  # blocks per stage, all stages
    fqns: list[list[str]]  # module names per stage, all stages


# --------------------------------------------------------------------------- the split


def stage_layout(n_layers: int, stages: int, pp_split: Sequence[int] | None = None, kind: str = "tenfold",
                 has_pos_emb: bool = False) -> StageLayout:
    """Blocks and module names of every stage: `pp_split` (--pp-split, checked) if given, else
    the even split with the embedding and the head weighted as one layer each."""
    counts = list(stage_layer_counts(n_layers, stages, pp_split))
    return StageLayout(counts, split_fqns(n_layers, counts, has_pos_emb, kind))


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
