"""Pipeline layout without torch: the module names (FQNs) each stage owns, given the blocks per
stage (torchtitan's `generate_llm_fqn_per_model_part`). How many blocks each stage gets is the
resolved run's `stage_layers` (tenfold.terms.stage_layer_counts), the split the planner prices
too; `tenfold.techniques.pipeline` builds the stages from both.
"""

from __future__ import annotations

from typing import Sequence


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
