"""Tied embeddings across pipeline stages, as Megatron-LM pipelines them (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"; Megatron's
`setup_embeddings_and_output_layer` and `_allreduce_word_embedding_grads`).

A model with tied embeddings (GPT-3, GPT-2, Llama 3.2 1B/3B, Qwen2.5 up to 3B: `tok_emb.weight`
is `output.weight`, `model.embed_tokens.weight` is `lm_head.weight`) uses one (V, d) matrix twice:
to look tokens up on the first pipeline stage and to project onto the vocabulary on the last.
When those stages run on different ranks, one Parameter cannot serve both, so:

1. **Two copies.** The last stage's head gets a Parameter of its own (`untie_head`), zero-filled,
   and takes the first stage's values by a broadcast over the *embedding group*: the first and the
   last pipeline rank at the same (dp, tp) coordinate (`engine.distributed.embedding_group`).
   Megatron fills its copy with zeros and all-reduces over the same group, which is the same
   broadcast. The first stage is the one source of the values, whatever each rank built.
2. **One gradient.** After every step's backward (after the data-parallel reduction, so each copy
   holds the dp-reduced gradient of its own use) the two gradients are summed over the embedding
   group (`TiedEmbedding.all_reduce_grads`), before unscaling, the overflow vote, clipping and the
   optimizer step. Both copies then hold the gradient the single Parameter would have on one
   process, both optimizers take the same step from the same state, and the copies stay equal bit
   for bit. Under ZeRO-2/3 (FSDP2) both copies are sharded alike over dp (dim 0 of the same shape
   on the same dp mesh), and under tensor parallelism the vocabulary-parallel embedding and the
   column-parallel head both split dim 0 of (V, d) over tp, so the local shards at equal (dp, tp)
   coordinates are the same rows and are summed directly.
3. **Counted once.** The global gradient norm for clipping leaves the last stage's copy out
   (`uncounted_in_norm`; Megatron's `param_is_not_shared`): the first stage counts the tied weight.
   The copy is still clipped with the rest.
4. **One name in the optimizer state.** In a checkpoint the copy's optimizer state is stored under
   the tied weight's own name (`optimizer_aliases`: `state.tok_emb.weight.*`, written by both
   stages, identical), as a one-process run stores it, while the model state keeps both names
   (`tok_emb.weight` and `output.weight`, as `state_dict()` of the tied model has them). A
   checkpoint of any pp degree therefore resumes at any other, pp 1 included.

Where the first and the last stage run on the same rank (pp 1, or a placement that puts both on
one rank), the Parameter stays shared and nothing here runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from tenfold.errors import UserError
from tenfold.pipeline_layout import StageNames
from tenfold.techniques.tensor_parallel import settle_gradients


@dataclass(frozen=True)
class TiedPair:
    """The tied weight's name on the first stage (the embedding) and on the last (the head)."""

    embedding: str  # "tok_emb.weight" (tenfold's GPT), "model.embed_tokens.weight" (Hugging Face)
    head: str  # "output.weight", "lm_head.weight"


def find_tied_pair(stages: Sequence[nn.Module], names: StageNames) -> TiedPair | None:
    """The weight the last stage's head shares with the first stage's embedding (tied
    embeddings), None if none. Every stage is built on the same full model, so a tie shows as one
    Parameter in two stages. A Parameter shared any other way is refused: only the
    embedding/head tie has a synchronisation (two copies, summed gradients). `names`: the model
    kind's module names (tenfold.models.specs: its stage_names)."""
    owner: dict[int, tuple[int, str]] = {}
    pair = None
    last = len(stages) - 1
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            first = owner.setdefault(id(p), (s, name))
            if first[0] == s:
                continue
            if (pair is None and first[0] == 0 and s == last and _in(first[1], names.embedding)
                    and _in(name, names.head)):
                pair = TiedPair(first[1], name)
                continue
            raise UserError(
                f"{first[1]} (pipeline stage {first[0]}) and {name} (stage {s}) are one tied weight; pipeline "
                "stages share only the embedding of the first stage with the output head of the last. Untie "
                "them or use --pp 1"
            )
    return pair


def _in(name: str, modules: Sequence[str]) -> bool:
    return any(name.startswith(m + ".") for m in modules)


@torch.no_grad()
def untie_head(stage: nn.Module, pair: TiedPair) -> nn.Parameter:
    """Give the last stage's head a Parameter of its own (zeros, filled by `broadcast_initial`)."""
    module_name, attr = pair.head.rsplit(".", 1)
    module = stage.get_submodule(module_name)
    shared = getattr(module, attr)
    copy = nn.Parameter(torch.zeros_like(shared), requires_grad=shared.requires_grad)
    setattr(module, attr, copy)
    return copy


def untie_on_rank(pair: TiedPair | None, stages: Sequence[nn.Module], local_ids: Sequence[int]) -> tuple[str, ...]:
    """The names of the tied weight's copies this rank keeps apart from another rank's: the
    embedding where it runs the first stage only, the head (untied here) where it runs the last
    stage only; none where it runs both (one Parameter, shared directly) or neither. `stages`:
    every stage, built on one full model; `local_ids`: the stages this rank runs."""
    if pair is None:
        return ()
    first, last = 0 in local_ids, len(stages) - 1 in local_ids
    if first == last:
        return ()
    if last:
        untie_head(stages[-1], pair)
        return (pair.head,)
    return (pair.embedding,)


def _stage_parameter(stages: Sequence[nn.Module], name: str) -> nn.Parameter:
    for stage in stages:
        found = dict(stage.named_parameters()).get(name)
        if found is not None:
            return found
    raise KeyError(name)


@dataclass
class TiedEmbedding:
    """This rank's part in keeping a tied embedding one weight across pipeline stages.

    `local`: the names of the copies this rank holds apart from the other stage's (the first
    stage's embedding, or the last stage's head; empty where both stages run here or neither);
    `group`: the embedding group (this rank and its peer stage at the same dp, tp coordinate)."""

    pair: TiedPair
    local: tuple[str, ...] = ()
    group: object | None = None

    @property
    def holds_head_copy(self) -> bool:
        return self.pair.head in self.local

    @torch.no_grad()
    def broadcast_initial(self, stages: Sequence[nn.Module], src: int) -> None:
        """Every copy takes the first stage's values (`src`: the global rank of this group's
        first-stage member). `stages`: this rank's stage modules, before tensor parallelism and
        ZeRO wrap them (plain tensors)."""
        for name in self.local:
            dist.broadcast(_stage_parameter(stages, name).data, src=src, group=self.group)

    @torch.no_grad()
    def all_reduce_grads(self, model: nn.Module) -> None:
        """Sum the two copies' gradients over the embedding group (after the data-parallel
        reduction, before clipping and the step). The local parts of DTensor gradients: both
        copies are split alike over dp and tp (module docstring)."""
        for name in self.local:
            p = model.get_parameter(name)
            if not p.requires_grad:  # frozen (both copies alike: untie_head keeps the flag)
                continue
            if p.grad is None:
                raise RuntimeError(f"tied weight {name} has no gradient after the pipeline step")
            settle_gradients([p])  # a gradient in another layout than its weight takes the weight's first
            grad = p.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if local.is_contiguous():
                dist.all_reduce(local, group=self.group)
            else:
                summed = local.contiguous()
                dist.all_reduce(summed, group=self.group)
                local.copy_(summed)

    def uncounted_in_norm(self, model: nn.Module) -> list[nn.Parameter]:
        """The last stage's copy: clipped, but left out of the global norm (the first stage
        counts the tied weight once)."""
        return [model.get_parameter(self.pair.head)] if self.holds_head_copy else []

    def optimizer_aliases(self) -> dict[str, str]:
        """{copy's name: tied weight's name} for this rank's optimizer state in checkpoints."""
        return {self.pair.head: self.pair.embedding} if self.holds_head_copy else {}


def uncounted_in_norm(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of `model` that clipping's global norm must not count (a tied weight's second
    copy); empty for a model that is not a pipeline stage with one."""
    tied = getattr(model, "tied", None)
    return tied.uncounted_in_norm(model) if isinstance(tied, TiedEmbedding) else []


def optimizer_aliases(model: nn.Module) -> dict[str, str]:
    tied = getattr(model, "tied", None)
    return tied.optimizer_aliases() if isinstance(tied, TiedEmbedding) else {}


def rename_keys(state: dict, aliases: dict[str, str], reverse: bool = False) -> dict:
    """Flattened optimizer-state keys (`state.<fqn>.<key>`, `param_groups.<fqn>.<key>`) with each
    alias's FQN replaced by its target (`reverse`: back again)."""
    if not aliases:
        return state
    pairs = [(b, a) if reverse else (a, b) for a, b in aliases.items()]
    out = {}
    for key, value in state.items():
        for old, new in pairs:
            for section in ("state.", "param_groups."):
                if key.startswith(section + old + "."):
                    key = section + new + key[len(section + old):]
        out[key] = value
    return out

