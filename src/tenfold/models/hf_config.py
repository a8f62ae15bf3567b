"""A Hugging Face `config.json` read as tenfold's `ModelConfig` (shape only, no torch, no
transformers): the planner predicts a Hugging Face model from this, and the engine checks the
run's shape with it before transformers builds the model."""

from __future__ import annotations

import json

from tenfold.errors import UserError
from tenfold.models.presets import ModelConfig


def _get(d: dict, *keys, default=None):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def read_config_json(path: str, flag: str = "--hf-config") -> dict:
    """`flag`: the option the user gave the file or folder with (named in every message). Read
    only from a regular file of at most a few MB (tenfold.textfiles): a device or a FIFO given
    by mistake is one line, not a read that never ends."""
    from tenfold.textfiles import read_text

    text = read_text(path, flag)
    try:
        d = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{flag} {path}: not valid JSON ({exc})") from None
    if not isinstance(d, dict):
        raise UserError(f"{flag} {path}: expected a JSON object (a Hugging Face config.json)")
    return d


def hf_model_type(path: str) -> str:
    """The config.json's `model_type` ("llama", "gpt2", ...), lower case; "" when absent."""
    return str(read_config_json(path).get("model_type", "")).lower()


def model_from_hf_config(path: str, flag: str = "--hf-config") -> ModelConfig:
    """A Hugging Face `config.json` (LLaMA/Mistral/Qwen-style or GPT-2/NeoX-style keys)."""
    d = read_config_json(path, flag)
    layers = _get(d, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _get(d, "hidden_size", "n_embd", "d_model")
    heads = _get(d, "num_attention_heads", "n_head")
    vocab = _get(d, "vocab_size")
    if None in (layers, hidden, heads, vocab):
        raise UserError(
            f"{flag} {path}: needs num_hidden_layers, hidden_size, num_attention_heads and vocab_size (or GPT-2's n_layer, n_embd, n_head)"
        )
    act = str(_get(d, "hidden_act", "activation_function", default="gelu")).lower()
    swiglu = act in ("silu", "swish", "swiglu")
    model_type = str(d.get("model_type", "")).lower()
    gpt2_like = model_type in ("gpt2", "gpt_neox", "gptj", "gpt_neo", "opt", "bloom")
    return ModelConfig(
        n_layers=int(layers), d_model=int(hidden), n_heads=int(heads), vocab_size=int(vocab),
        max_seq_len=int(_get(d, "max_position_embeddings", "n_positions", "n_ctx", default=2048)),
        n_kv_heads=_get(d, "num_key_value_heads"), d_ff=_get(d, "intermediate_size", "n_inner"),
        mlp="swiglu" if swiglu else "gelu", norm="layernorm" if gpt2_like or "layer_norm_epsilon" in d else "rmsnorm",
        pos="learned" if model_type == "gpt2" else "rope", bias=bool(d.get("attention_bias", gpt2_like)),
        tie_embeddings=bool(d.get("tie_word_embeddings", model_type == "gpt2")),
    )
