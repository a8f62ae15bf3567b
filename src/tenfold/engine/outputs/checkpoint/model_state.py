"""Model and optimizer as `Stateful` objects for `torch.distributed.checkpoint` (torchtitan's
`ModelWrapper` / `OptimizersContainer` pattern): `dcp.save`/`dcp.load` call `state_dict()`
and, after loading in place, `load_state_dict()`.

`get_model_state_dict` / `get_optimizer_state_dict` give the same FQN keys for a plain model,
DDP, FSDP2 (`fully_shard`), recompute-wrapped blocks and a pipeline stage, so a checkpoint
written on one layout loads on another: DCP reshards.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from tenfold.techniques.tied_embeddings import optimizer_aliases, rename_keys

# Optimizer state keyed per parameter FQN ("state.layers.0.attn.wq.weight.exp_avg",
# "param_groups.layers.0.attn.wq.weight.lr"), as torchtitan does: pipeline ranks hold different
# parameters, and a nested `param_groups` list would collide across them in DCP (one rank's
# list wins); flattened keys are disjoint per stage and reshard across pp/dp/ZeRO changes.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def local_optimizers(optimizer) -> list:
    """The optimizer(s) whose state this rank holds. ZeRO-1's ZeroRedundancyOptimizer keeps
    this rank's partition in `.optim` (whole parameters); saving that one per rank gives
    disjoint FQN keys, so DCP reshards ZeRO-1 like any other layout. (The wrapper's lr comes
    back through the LR schedule's load_state_dict.)"""
    if optimizer is None:
        return []

    return [optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer]


# A LoRA run's checkpoint: the parameters that train (the adapters) and no frozen base, which
# the run rebuilds from its source (engine/loop/lora_run.py checks it is the same base).
TRAINABLE_ONLY = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)


class ModelState:
    """The model's parameters and buffers (this rank's shards) under their FQNs; with
    `trainable_only`, the parameters that train (and the buffers)."""

    def __init__(self, model: torch.nn.Module, trainable_only: bool = False):
        self.model = model
        self.options = TRAINABLE_ONLY if trainable_only else STATE_DICT_OPTIONS

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, state: dict) -> None:
        if self.options is STATE_DICT_OPTIONS:
            set_model_state_dict(self.model, state, options=self.options)
            return
        # strict=False: the frozen base is not in the checkpoint; every trained parameter must be
        result = set_model_state_dict(self.model, state, options=replace(self.options, strict=False))
        trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
        missing = [k for k in result.missing_keys if k in trained]
        if missing:
            raise KeyError(f"the checkpoint has no {missing[0]!r}")

    def non_finite_parameter(self) -> str | None:
        """The name of the first trained parameter of this rank holding NaN/inf (local shards);
        a frozen one never changes (a LoRA run's base, possibly NF4, which has no isfinite)."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if not p.requires_grad:
                    continue
                local = p.to_local() if hasattr(p, "to_local") else p
                if local.numel() and not bool(torch.isfinite(local).all()):
                    return name
        return None


class OptimizerState:
    """The optimizer's state (AdamW moments, step counts, param_groups), flattened per FQN.

    A tied embedding's copy on the last pipeline stage keeps its state under the tied weight's
    name (`state.tok_emb.weight.exp_avg`, not `state.output.weight.exp_avg`), the name a
    one-process run gives the one Parameter: both stages write the same (equal) entries, and a
    checkpoint of any pp degree loads at any other (techniques/tied_embeddings.py)."""

    def __init__(self, model: torch.nn.Module, optimizer):
        self.model, self.optimizers = model, local_optimizers(optimizer)

    def state_dict(self) -> dict:
        state = get_optimizer_state_dict(self.model, self.optimizers, options=STATE_DICT_OPTIONS)
        return rename_keys(state, optimizer_aliases(self.model))

    def load_state_dict(self, state: dict) -> None:
        state = rename_keys(state, optimizer_aliases(self.model), reverse=True)
        set_optimizer_state_dict(self.model, self.optimizers, state, options=STATE_DICT_OPTIONS)
