"""Model shapes as data: named presets, exact parameter counts and FLOPs per token.

Pure Python on purpose: the planner (`tenfold.plan`) imports this module and must not
import torch. `param_count(cfg)` equals `sum(p.numel() for p in GPT(cfg).parameters())`
exactly (tests/test_gpt.py holds the two together).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Literal

from tenfold.errors import UserError


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer (pre-norm, causal)."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    max_seq_len: int
    n_kv_heads: int | None = None  # None = n_heads (multi-head); fewer = grouped-query attention
    d_ff: int | None = None  # None = 4*d (gelu) or the LLaMA rule 2/3*4d rounded to 256 (swiglu)
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    pos: Literal["rope", "learned"] = "rope"
    bias: bool = False
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Mixture of experts (tenfold.models.moe): 0 experts = a dense MLP in every block.
    n_experts: int = 0  # routed experts per block
    experts_per_token: int = 2  # k of token-choice top-k routing
    d_expert: int | None = None  # one routed expert's hidden width; None = ffn_dim
    n_shared_experts: int = 0  # always-on experts of width d_expert (DeepSeekMoE)
    router_aux_loss_coef: float = 0.01  # Switch/GShard balance loss weight; 0 = off
    router_bias_rate: float = 0.0  # DeepSeek-V3 aux-loss-free bias update speed; 0 = off
    router_norm_topk: bool = True  # renormalise the k chosen weights to sum to 1 (Mixtral)
    capacity_factor: float = 0.0  # 0 = dropless; c > 0: each expert keeps ceil(c T k / E) tokens
    # Shapes of Hugging Face families that tenfold's GPT does not build (set only by
    # tenfold.models.hf_config from a config.json; GPT(cfg) refuses them, `hf_only_fields`).
    d_head: int | None = None  # per-head width; None = d_model / n_heads (Qwen3 sets head_dim)
    qkv_bias: bool = False  # biases on the q, k and v projections only (Qwen2, Qwen2-MoE)
    qk_norm: bool = False  # RMSNorm over each head's q and k (Qwen3, Qwen3-MoE)
    d_shared: int | None = None  # the shared experts' total width; None = n_shared_experts * expert_dim
    shared_expert_gate: bool = False  # a sigmoid gate d_model -> 1 on the shared expert (Qwen2-MoE)

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise UserError(f"model.{name} must be a positive integer, got {getattr(self, name)}")
        if self.d_head is None and self.d_model % self.n_heads:
            raise UserError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})"
            )
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads:
            raise UserError(
                f"model.n_kv_heads ({self.kv_heads}) must be positive and divide n_heads ({self.n_heads})"
            )
        if self.mlp not in ("swiglu", "gelu"):
            raise UserError(f"model.mlp must be 'swiglu' or 'gelu', got {self.mlp!r}")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise UserError(f"model.norm must be 'rmsnorm' or 'layernorm', got {self.norm!r}")
        if self.pos not in ("rope", "learned"):
            raise UserError(f"model.pos must be 'rope' or 'learned', got {self.pos!r}")
        if self.pos == "rope" and self.head_dim % 2:
            raise UserError(f"RoPE needs an even head dimension, got {self.head_dim}")
        self._check_moe()

    def _check_moe(self) -> None:
        if self.n_experts < 0 or self.n_shared_experts < 0:
            raise UserError("model.n_experts and model.n_shared_experts must be >= 0")
        if not self.n_experts:
            return
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise UserError(f"model.experts_per_token ({self.experts_per_token}) must be between 1 and "
                            f"model.n_experts ({self.n_experts})")
        if self.mlp != "swiglu":
            raise UserError("mixture-of-experts blocks use SwiGLU experts: set model.mlp = 'swiglu'")
        if self.expert_dim <= 0:
            raise UserError(f"model.d_expert must be positive, got {self.d_expert}")
        for name in ("router_aux_loss_coef", "router_bias_rate", "capacity_factor"):
            if getattr(self, name) < 0:
                raise UserError(f"model.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.d_head if self.d_head is not None else self.d_model // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the query projection's output (n_heads x head_dim; d_model unless d_head is set)."""
        return self.n_heads * self.head_dim

    @property
    def shared_dim(self) -> int:
        """The shared experts' total hidden width (0 without shared experts)."""
        return self.d_shared if self.d_shared is not None else self.n_shared_experts * self.expert_dim

    def hf_only_fields(self) -> list[str]:
        """The fields set here that only Hugging Face families have (tenfold's GPT builds none)."""
        return [f for f in ("d_head", "qkv_bias", "qk_norm", "d_shared", "shared_expert_gate")
                if getattr(self, f) not in (None, False)]

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "gelu":
            return 4 * self.d_model
        # LLaMA: 2/3 of 4d, rounded up to a multiple of 256 (Touvron et al. 2023, model.py).
        hidden = int(2 * 4 * self.d_model / 3)
        return 256 * ((hidden + 255) // 256)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def active_ffn_dim(self) -> int:
        """The MLP width one token's forward runs through: a dense MLP's, or for MoE the k routed
        plus the shared experts' (what its FLOPs and saved activations scale with)."""
        if not self.is_moe:
            return self.ffn_dim
        return self.experts_per_token * self.expert_dim + self.shared_dim

    @property
    def router_dim(self) -> int:
        """Router outputs per token (its matmul is d_model x n_experts); 0 for a dense model."""
        return self.n_experts

    @property
    def expert_dim(self) -> int:
        return self.d_expert if self.d_expert is not None else self.ffn_dim

    def to_dict(self) -> dict:
        return asdict(self)

    def with_overrides(self, **overrides) -> "ModelConfig":
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise UserError(
                f"unknown model field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
            )
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


GPT3_PADDED_VOCAB = 50304  # 50257 BPE tokens + 47 never-used rows


def _gpt3(n_layers: int, d_model: int, n_heads: int) -> ModelConfig:
    # Brown et al. 2020 Table 2.1: GPT-2 style blocks (LayerNorm, GELU 4d MLP, biases,
    # learned positions, tied embeddings), context 2048, BPE vocabulary of 50257 padded to 50304,
    # a multiple of 128 (Megatron-LM's make_vocab_size_divisible_by), so that tensor parallelism
    # up to 128 splits the embedding and the output layer by token.
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, vocab_size=GPT3_PADDED_VOCAB, max_seq_len=2048,
        mlp="gelu", norm="layernorm", pos="learned", bias=True, tie_embeddings=True,
    )


def _llama(n_layers: int, d_model: int, n_heads: int, d_ff: int, n_kv_heads: int | None = None) -> ModelConfig:
    # Touvron et al. 2023 (LLaMA / Llama 2): RMSNorm, RoPE, SwiGLU, no biases, untied, vocab 32000.
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff,
        vocab_size=32000, max_seq_len=4096,
    )


def _mixtral(n_layers: int, d_model: int, n_heads: int, d_ff: int, n_kv_heads: int, n_experts: int,
             top_k: int) -> ModelConfig:
    # Jiang et al. 2024 (Mixtral of Experts), Table 1: Mistral 7B's blocks with 8 SwiGLU experts,
    # top-2, vocab 32000, context 32768, rope theta 1e6; HF config router_aux_loss_coef 0.02.
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff,
        vocab_size=32000, max_seq_len=32768, rope_theta=1e6, n_experts=n_experts,
        experts_per_token=top_k, router_aux_loss_coef=0.02,
    )


PRESETS: dict[str, ModelConfig] = {
    # Byte-level models that train on a laptop CPU (vocab 256 = the default corpus's bytes).
    "tiny": ModelConfig(n_layers=4, d_model=256, n_heads=4, d_ff=768, vocab_size=256, max_seq_len=256),
    "small": ModelConfig(n_layers=8, d_model=512, n_heads=8, d_ff=1408, vocab_size=256, max_seq_len=512),
    # GPT-3 family (Table 2.1). XL lists 24 heads of 128 which cannot make d_model=2048;
    # we keep d_head=128 (16 heads), as the FLOPs and parameter counts only see d_model.
    "gpt3-125m": _gpt3(12, 768, 12),
    "gpt3-350m": _gpt3(24, 1024, 16),
    "gpt3-760m": _gpt3(24, 1536, 16),
    "gpt3-1.3b": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    "gpt3-13b": _gpt3(40, 5120, 40),  # the paper prints 5140, a typo for 40 x 128
    "gpt3-175b": _gpt3(96, 12288, 96),
    "llama-7b": _llama(32, 4096, 32, 11008),
    "llama-13b": _llama(40, 5120, 40, 13824),
    "llama-70b": _llama(80, 8192, 64, 28672, n_kv_heads=8),
    # Mixture of experts (tenfold.models.moe). tiny-moe: the byte-level test model, 8 experts top-2
    # plus one shared expert, every piece of the MoE path switched on.
    "tiny-moe": ModelConfig(n_layers=2, d_model=64, n_heads=4, d_ff=128, vocab_size=256, max_seq_len=256,
                            n_experts=8, experts_per_token=2, d_expert=64, n_shared_experts=1),
    "mixtral-8x7b": _mixtral(32, 4096, 32, 14336, 8, 8, 2),
    # DeepSeek-V2-Lite's MoE shape (DeepSeek-AI 2024, HF config): 64 fine-grained routed experts of
    # width 1408, top-6, 2 shared experts, vocab 102400. Attention is tenfold's grouped-query
    # attention (not MLA) and every block is MoE (the published model keeps block 0 dense), so the
    # count is close to, not equal to, the published 15.7B total / 2.4B active.
    "deepseek-moe-16b": ModelConfig(
        n_layers=27, d_model=2048, n_heads=16, d_ff=10944, vocab_size=102400, max_seq_len=4096,
        n_experts=64, experts_per_token=6, d_expert=1408, n_shared_experts=2, router_aux_loss_coef=0.001,
    ),
    # Qwen3-235B-A22B (Qwen team 2025, HF config.json): 94 blocks, 128 experts of width 1536, top-8,
    # no shared expert, 64 query / 4 kv heads of 128 (q width 8192 > d_model 4096: tenfold's
    # attention ties q width to d_model, so the attention here is slightly smaller).
    "qwen3-235b-a22b": ModelConfig(
        n_layers=94, d_model=4096, n_heads=32, n_kv_heads=4, d_ff=12288, vocab_size=151936,
        max_seq_len=40960, rope_theta=1e6, n_experts=128, experts_per_token=8, d_expert=1536,
        router_aux_loss_coef=0.001,
    ),
}

# Sizes as published, for the tests and the planner's notes.
PUBLISHED_PARAMS: dict[str, float] = {
    "gpt3-125m": 125e6, "gpt3-350m": 350e6, "gpt3-760m": 760e6, "gpt3-1.3b": 1.3e9,
    "gpt3-2.7b": 2.7e9, "gpt3-6.7b": 6.7e9, "gpt3-13b": 13.0e9, "gpt3-175b": 175.0e9,
    "llama-7b": 6.7e9, "llama-13b": 13.0e9, "llama-70b": 70e9,
    "mixtral-8x7b": 46.7e9, "deepseek-moe-16b": 15.7e9, "qwen3-235b-a22b": 235e9,
}
# Active parameters per token as published (Mixtral Table 1: 12.9B; DeepSeek-V2-Lite: 2.4B;
# Qwen3: 22B).
PUBLISHED_ACTIVE_PARAMS: dict[str, float] = {
    "mixtral-8x7b": 12.9e9, "deepseek-moe-16b": 2.4e9, "qwen3-235b-a22b": 22e9,
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown model preset {name!r}; allowed: {', '.join(PRESETS)}") from None


def norm_param_count(cfg: ModelConfig) -> int:
    """One norm's parameters: LayerNorm's weight and bias, RMSNorm's weight."""
    return cfg.d_model * (2 if cfg.norm == "layernorm" else 1)


def block_param_count(cfg: ModelConfig) -> int:
    """Parameters of one transformer block."""
    d, kv, q = cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.q_dim
    attn = d * q + 2 * d * kv + q * d  # q, k, v, out projections
    if cfg.bias:
        attn += q + 2 * kv + d
    elif cfg.qkv_bias:
        attn += q + 2 * kv
    if cfg.qk_norm:
        attn += 2 * cfg.head_dim
    return attn + _ffn_param_count(cfg, active=False) + 2 * norm_param_count(cfg)


def _ffn_param_count(cfg: ModelConfig, active: bool) -> int:
    """One block's MLP, or its MoE layer: router + routed experts (all of them, or the k a token
    uses when `active`) + shared experts."""
    d = cfg.d_model
    if cfg.is_moe:
        routed = cfg.experts_per_token if active else cfg.n_experts
        gate = d if cfg.shared_expert_gate else 0
        return d * cfg.n_experts + routed * 3 * d * cfg.expert_dim + 3 * d * cfg.shared_dim + gate
    ff = cfg.ffn_dim
    if cfg.mlp == "swiglu":
        return 3 * d * ff + ((2 * ff + d) if cfg.bias else 0)
    return 2 * d * ff + ((ff + d) if cfg.bias else 0)


def active_block_param_count(cfg: ModelConfig) -> int:
    """Parameters one token's forward uses in a block: for MoE only k routed experts; = all for dense."""
    return block_param_count(cfg) - _ffn_param_count(cfg, active=False) + _ffn_param_count(cfg, active=True)


def moe_layer_param_count(cfg: ModelConfig) -> int:
    """One block's MoE layer (router, routed and shared experts); 0 for a dense model."""
    return _ffn_param_count(cfg, active=False) if cfg.is_moe else 0


def expert_param_count(cfg: ModelConfig) -> int:
    """Routed-expert parameters of the whole model (what expert parallelism splits)."""
    return cfg.n_layers * cfg.n_experts * 3 * cfg.d_model * cfg.expert_dim if cfg.is_moe else 0


def embedding_param_count(cfg: ModelConfig) -> int:
    n = cfg.vocab_size * cfg.d_model
    if cfg.pos == "learned":
        n += cfg.max_seq_len * cfg.d_model
    return n


def head_param_count(cfg: ModelConfig) -> int:
    """Final norm plus the output projection (zero extra when tied to the embedding)."""
    return norm_param_count(cfg) + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters of `tenfold.models.gpt.GPT(cfg)`."""
    return embedding_param_count(cfg) + cfg.n_layers * block_param_count(cfg) + head_param_count(cfg)


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters a token's forward uses (MoE: k routed experts per block); = param_count for dense."""
    return param_count(cfg) - cfg.n_layers * (block_param_count(cfg) - active_block_param_count(cfg))


def non_embedding_param_count(cfg: ModelConfig) -> int:
    """Kaplan et al. 2020's N: parameters excluding the token and position embeddings."""
    n = cfg.n_layers * block_param_count(cfg) + norm_param_count(cfg)
    if not cfg.tie_embeddings:
        n += cfg.vocab_size * cfg.d_model  # the untied output matmul does work per token
    return n


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), the MFU convention.

    6N for the weight matmuls (Kaplan et al. 2020; N counts every block matmul and the
    output projection, tied or not, since it is a matmul per token; embeddings lookups and
    norms are not matmuls) plus 12*L*s*d for attention scores and values (PaLM, Chowdhery
    et al. 2022 App. B, 12*L*H*Q*T with H*Q = d; the causal mask is not discounted, the
    usual convention). nanoGPT's GPT-2 124M at T=1024 gives 875,062,886,400 per sequence
    (nanoGPT `estimate_mfu`). Recompute is not counted here (that would be HFU).
    Mixture of experts: N counts the ACTIVE parameters (the k routed experts a token visits, the
    shared experts and the router), as DeepSeek-V3 and Megatron-Core count an MoE model's MFU.
    """
    n_matmul = cfg.n_layers * active_block_param_count(cfg) + cfg.vocab_size * cfg.d_model
    return 6.0 * n_matmul + 12.0 * cfg.n_layers * seq_len * cfg.d_model
