"""A pipeline stage of a Hugging Face Llama-family causal LM (Llama, Mistral, Qwen2).

transformers' `LlamaModel.forward` does three things before its decoder layers: it embeds the
tokens, builds the causal mask (`masking_utils.create_causal_mask`, or the sliding-window mask
for the layers whose `config.layer_types` entry is "sliding_attention", or all layers when
`config.sliding_window` is set, as Mistral does) from the position ids, and turns the position
ids into the rotary cos/sin tables (`model.rotary_emb`). After the layers it applies
`model.norm`, and `LlamaForCausalLM` the `lm_head`. A stage that holds only some layers must redo
the middle part itself: the mask and the rotary tables depend only on the position ids, not on
any weights, so every stage computes them from the micro-batch's `position_ids`, which the
pipeline passes to every stage as a keyword argument (torch.distributed.pipelining hands a
`step`'s kwargs to each stage; only the activations travel between stages). torchtitan's
transformers backend splits these models the same way: embedding on the first stage, norm and
head on the last, each stage running `rotary_emb` and the mask for its own layers.

The stage keeps the model's own modules under the model's own names (`model.embed_tokens`,
`model.layers.N`, `model.norm`, `lm_head`), so its state_dict is a slice of the full model's:
checkpoints and the save_pretrained export keep the Hugging Face names.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from tenfold.errors import UserError
from tenfold.pipeline_layout import block_index

MASK_KINDS = ("full_attention", "sliding_attention")
MIN_TRANSFORMERS = 5  # major version


class HFStage(nn.Module):
    """A slice of a transformers `LlamaForCausalLM` (or Mistral / Qwen2) holding the modules of
    `fqns` (tenfold.pipeline_layout.STAGE_NAMES["hf"]); the others are None or absent."""

    base_model_prefix = "model"  # where tensor_parallel.hf_plan finds the decoder layers

    def __init__(self, model: nn.Module, fqns: Sequence[str], stage_id: int, n_stages: int):
        super().__init__()
        inner = getattr(model, "model", None)
        if inner is None or not isinstance(getattr(inner, "layers", None), nn.ModuleList) or not hasattr(model, "lm_head"):
            raise UserError(
                f"parallel.pp_degree > 1: {type(model).__name__} does not have the Llama layout "
                "(model.embed_tokens, model.layers, model.norm, lm_head); use --pp 1"
            )
        check_transformers_version()
        self.config = model.config
        self.stage_id, self.n_stages = stage_id, n_stages
        owned = set(fqns)
        self.model = nn.Module()
        self.model.embed_tokens = inner.embed_tokens if "model.embed_tokens" in owned else None
        blocks = sorted(i for i in (block_index(f, "hf") for f in fqns) if i is not None)
        self.model.layers = nn.ModuleDict({str(i): inner.layers[i] for i in blocks})
        self.model.norm = inner.norm if "model.norm" in owned else None
        self.model.rotary_emb = inner.rotary_emb  # no weights; its inv_freq buffer is not saved
        self.lm_head = model.lm_head if "lm_head" in owned else None
        self.mask_kinds = {i: mask_kind(self.config, i) for i in blocks}

    @property
    def is_first(self) -> bool:
        return self.model.embed_tokens is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.model.layers.values())

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or the residual stream -> the residual stream, or logits
        (last stage). `position_ids` (b, s): the micro-batch's positions, whole sequences."""
        h = self.model.embed_tokens(x) if self.is_first else x
        if self.model.layers:
            # shape, dtype and device for the mask: the whole sequence even where h is this tp
            # rank's slice of it (sequence parallelism)
            like = h.new_empty((position_ids.shape[0], position_ids.shape[1], 1))
            masks = {kind: causal_mask(self.config, like, position_ids, kind) for kind in set(self.mask_kinds.values())}
            rotary = self.model.rotary_emb(h, position_ids)
            for key, layer in self.model.layers.items():
                h = layer(h, attention_mask=masks[self.mask_kinds[int(key)]], position_ids=position_ids,
                          position_embeddings=rotary)
        if self.is_last:
            h = self.lm_head(self.model.norm(h))
        return h


def mask_kind(config, layer: int) -> str:
    """The attention mask layer `layer` uses, as the model's own forward picks it."""
    types = getattr(config, "layer_types", None)
    kind = types[layer] if types else (
        "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention")
    if kind not in MASK_KINDS:
        raise UserError(
            f"parallel.pp_degree > 1: layer {layer} of this {config.model_type} model uses {kind!r} attention; "
            f"the pipeline stages build {' and '.join(MASK_KINDS)} masks only; use --pp 1"
        )
    return kind


def check_transformers_version() -> None:
    """The stages call transformers' mask functions and decoder layers as transformers 5 defines
    them (keyword `inputs_embeds`, no cache_position; a layer returns a tensor)."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major < MIN_TRANSFORMERS:
        raise UserError(
            f"pipelining a Hugging Face model (--pp > 1) needs transformers>={MIN_TRANSFORMERS}, found "
            f"{transformers.__version__}; upgrade it (pip install -U 'transformers>={MIN_TRANSFORMERS}') or use --pp 1"
        )


def causal_mask(config, like: torch.Tensor, position_ids: torch.Tensor, kind: str):
    """transformers' own mask for `kind` (None where sdpa's is_causal suffices), from the
    position ids alone: no padding mask (tenfold ignores padded targets in the loss) and no cache.
    Restarting position ids (packed fine-tuning rows) give the block-diagonal mask."""
    from transformers import masking_utils

    fn = masking_utils.create_causal_mask if kind == "full_attention" else masking_utils.create_sliding_window_causal_mask
    return fn(config, inputs_embeds=like, attention_mask=None, cache=None, position_ids=position_ids)
