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
    """A Hugging Face `config.json` (LLaMA/Mistral/Qwen-style or GPT-2/NeoX-style keys; the MoE
    families of MOE_FAMILIES)."""
    return model_from_hf_dict(read_config_json(path, flag), path, flag)


def model_from_hf_dict(d: dict, path: str = "config", flag: str = "--hf-config") -> ModelConfig:
    """`model_from_hf_config` of the config's dict (a config.json's, or `PretrainedConfig.to_dict()`)."""
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
    head_dim = _get(d, "head_dim")
    return ModelConfig(
        n_layers=int(layers), d_model=int(hidden), n_heads=int(heads), vocab_size=int(vocab),
        max_seq_len=int(_get(d, "max_position_embeddings", "n_positions", "n_ctx", default=2048)),
        n_kv_heads=_get(d, "num_key_value_heads"), d_ff=_get(d, "intermediate_size", "n_inner"),
        mlp="swiglu" if swiglu else "gelu", norm="layernorm" if gpt2_like or "layer_norm_epsilon" in d else "rmsnorm",
        pos="learned" if model_type == "gpt2" else "rope", bias=bool(d.get("attention_bias", gpt2_like)),
        tie_embeddings=bool(d.get("tie_word_embeddings", model_type == "gpt2")),
        d_head=int(head_dim) if head_dim is not None and int(head_dim) * int(heads) != int(hidden) else None,
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(d.get("qkv_bias", True))),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **_moe_shape(d, model_type, int(layers), path, flag),
    )


# The Hugging Face mixture-of-experts families: config.json key -> ModelConfig field, with the
# transformers config class's default where the key is absent.
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def _moe_shape(d: dict, model_type: str, layers: int, path: str, flag: str) -> dict:
    """The MoE fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json ({} for a dense family).
    Mixtral: every block's MLP is `num_local_experts` experts of width `intermediate_size`, top
    `num_experts_per_tok`, renormalised. Qwen2-MoE and Qwen3-MoE: experts of width
    `moe_intermediate_size`, renormalised when `norm_topk_prob`; Qwen2-MoE adds one shared
    expert of width `shared_expert_intermediate_size` behind a sigmoid gate."""
    if model_type == "mixtral":
        return {"n_experts": int(_get(d, "num_local_experts", "num_experts", default=8)),
                "experts_per_token": int(_get(d, "num_experts_per_tok", default=2)),
                "d_expert": int(_get(d, "intermediate_size", default=14336)), "router_norm_topk": True}
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return {}
    qwen2 = model_type == "qwen2_moe"
    step = int(_get(d, "decoder_sparse_step", default=1))
    dense = sorted(set(int(i) for i in (d.get("mlp_only_layers") or []))
                   | {i for i in range(layers) if step <= 0 or (i + 1) % step})
    if dense:
        raise UserError(
            f"{flag} {path}: dense MLP layers in a {model_type} model (mlp_only_layers / decoder_sparse_step "
            f"make layers {dense[:8]} dense) are not supported; supported: every layer MoE "
            "(decoder_sparse_step 1, mlp_only_layers [])"
        )
    shape = {"n_experts": int(_get(d, "num_experts", default=60 if qwen2 else 128)),
             "experts_per_token": int(_get(d, "num_experts_per_tok", default=4 if qwen2 else 8)),
             "d_expert": int(_get(d, "moe_intermediate_size", default=1408 if qwen2 else 768)),
             "router_norm_topk": bool(d.get("norm_topk_prob", False))}
    if qwen2:
        shape.update(d_shared=int(_get(d, "shared_expert_intermediate_size", default=5632)), shared_expert_gate=True)
    return shape
