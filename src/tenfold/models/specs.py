"""What differs between the model families tenfold trains, one `ModelSpec` per family, looked
up by the model kind (`spec_for`): tenfold's GPT ("tenfold"), a Hugging Face causal LM ("hf")
and a user's own `nn.Module` ("user"). `tenfold.models.adapter.model_kind` tells a model's kind;
the resolved run carries it as `run.model_kind`.

Everything here is plain data and attribute reads on a model object: no torch, no
transformers, so that the planner and the capability checks read the same specs as the engine.
The techniques keep their own code per family (techniques/tensor_parallel.py's plans,
techniques/pipeline.py's stages) and choose it from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

LinearNames = dict[str, tuple[str, ...]]

# Each family's block Linears by role. q/o: d -> d, k/v: d -> kv width, gate/up: d -> ffn,
# down: ffn -> d; GPT-2's fused c_attn is q, k and v in one matrix (a Conv1D, which PEFT adapts
# too), and its `c_proj` names both the attention's and the MLP's output projection.
_LLAMA = {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",), "gate_proj": ("gate",),
          "up_proj": ("up",), "down_proj": ("down",)}
_GPT2 = {"c_attn": ("q", "k", "v"), "c_proj": ("o", "down"), "c_fc": ("up",)}
HF_LINEAR_NAMES = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "gpt2": _GPT2}


def _gpt_linear_names(hf_model_type: str, mlp: str) -> LinearNames:
    mlp_names = {"w1": ("gate",), "w3": ("up",), "w2": ("down",)} if mlp == "swiglu" else {"w1": ("up",), "w2": ("down",)}
    return {"wq": ("q",), "wk": ("k",), "wv": ("v",), "wo": ("o",), **mlp_names}


def _hf_linear_names(hf_model_type: str, mlp: str) -> LinearNames | None:
    return HF_LINEAR_NAMES.get(hf_model_type)


def _unknown_linear_names(hf_model_type: str, mlp: str) -> None:
    return None


@dataclass(frozen=True)
class StageNames:
    """A family's module names for the pipeline split (tenfold.pipeline_layout): what the first
    stage holds before the blocks, the prefix of block i's name, and what the last stage holds
    after them."""

    embedding: tuple[str, ...]
    block_prefix: str
    head: tuple[str, ...]
    learned_positions: tuple[str, ...] = ()  # on the first stage too, when the model has them


def _gpt_shape(model: Any) -> tuple[int, bool, int, int]:
    cfg = model.cfg
    return cfg.n_layers, model.pos_emb is not None, cfg.d_model, cfg.vocab_size


def _hf_shape(model: Any) -> tuple[int, bool, int, int]:
    c = model.config
    return c.num_hidden_layers, False, c.hidden_size, c.vocab_size


@dataclass(frozen=True)
class ModelSpec:
    """One model family: how tenfold reads it and which built-in techniques know it."""

    kind: str  # "tenfold" | "hf" | "user": the key of SPECS
    label: str  # how messages name the family ("a {label} model")
    # transformers' API: forward(input_ids=..., use_cache=False, position_ids=...), save_pretrained
    # exports, PEFT adapter folders, attention masked per packed example by position_ids, blocks
    # declared in _no_split_modules, and support that depends on config.model_type
    hugging_face: bool
    block_path: str | None  # the ModuleDict holding the blocks in call order (None: found, adapter.find_blocks)
    architecture_known: bool  # the config describes its layers and widths (the planner prices it; FLOPs count attention)
    builtin_tp_plan: bool  # techniques/tensor_parallel.py has its plan (a user's module brings its own)
    # (blocks, learned positions, d_model, vocab) of a model the pipeline split can cut; None: it cannot
    pipeline_shape: Callable[[Any], tuple[int, bool, int, int]] | None
    stage_names: StageNames | None  # the module names the pipeline split cuts it by
    # {module name: roles} of one block's Linears, from (config.model_type, mlp); None: unknown names
    linear_names: Callable[[str, str], LinearNames | None]
    own_moe_blocks: bool = False  # its config may make blocks tenfold's MoE layers (models/moe.py)


SPECS = {
    "tenfold": ModelSpec("tenfold", "tenfold GPT", hugging_face=False, block_path="layers", architecture_known=True,
                         builtin_tp_plan=True, pipeline_shape=_gpt_shape, linear_names=_gpt_linear_names,
                         stage_names=StageNames(("tok_emb",), "layers.", ("norm", "output"), learned_positions=("pos_emb",)),
                         own_moe_blocks=True),
    # stage names: transformers' LlamaForCausalLM and the families sharing its layout (Mistral, Qwen2)
    "hf": ModelSpec("hf", "Hugging Face", hugging_face=True, block_path=None, architecture_known=True,
                    builtin_tp_plan=True, pipeline_shape=_hf_shape, linear_names=_hf_linear_names,
                    stage_names=StageNames(("model.embed_tokens",), "model.layers.", ("model.norm", "lm_head"))),
    "user": ModelSpec("user", "user's own", hugging_face=False, block_path=None, architecture_known=False,
                      builtin_tp_plan=False, pipeline_shape=None, linear_names=_unknown_linear_names, stage_names=None),
}


def spec_for(kind: str) -> ModelSpec:
    """The spec of the model family `kind` ("tenfold", "hf" or "user")."""
    return SPECS[kind]
