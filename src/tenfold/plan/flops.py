"""FLOP counts: the MFU convention, recompute FLOPs (HFU), the papers' closed forms.

Convention (stated in docs/planner.md): model FLOPs = forward + backward = 3 x forward, every
matmul including the output layer, attention scores and values counted in full (no causal
halving: PaLM App. B, torchtitan, 2023 Megatron); recompute is not counted in MFU, it is in HFU
(Chowdhery et al. 2022, Korthikanti et al. 2022 App. A).
"""

from __future__ import annotations

from dataclasses import dataclass

from tenfold.models.presets import ModelConfig, flops_per_token
from tenfold.terms import RecomputePolicy


@dataclass(frozen=True)
class Gemm:
    name: str
    m: int  # rows (tokens)
    n: int
    k: int
    count: int = 1  # batched copies (attention: b * heads / t)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


def layer_gemms(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int) -> list[Gemm]:
    """Forward matmuls of one block on one TP rank (Megatron's column/row split: QKV and MLP-in
    split their output dim by t, out-proj and MLP-out their input dim)."""
    h, f = cfg.d_model, cfg.active_ffn_dim
    kv = cfg.kv_heads * cfg.head_dim
    t = micro_batch * seq_len
    up = 2 * f if cfg.mlp == "swiglu" else f
    gemms = [Gemm("qkv", t, (h + 2 * kv) // tp, h), Gemm("out-proj", t, h, h // tp)]
    if cfg.is_moe:
        return gemms + moe_gemms(cfg, t)
    return gemms + [Gemm("mlp-in", t, up // tp, h), Gemm("mlp-out", t, h, f // tp)]


def moe_gemms(cfg: ModelConfig, tokens: int) -> list[Gemm]:
    """An MoE layer's matmuls for `tokens` tokens: the router, then one grouped GEMM per
    projection over the experts, each expert taking t k / E rows when balanced (torchtitan's
    grouped_mm; the experts are not split by tensor parallelism), and the shared experts."""
    h, de, e = cfg.d_model, cfg.expert_dim, cfg.n_experts
    rows = max(1, -(-tokens * cfg.experts_per_token // e))
    out = [Gemm("router", tokens, e, h), Gemm("experts-in", rows, 2 * de, h, e), Gemm("experts-out", rows, h, de, e)]
    if cfg.shared_dim:
        ds = cfg.shared_dim
        out += [Gemm("shared-in", tokens, 2 * ds, h), Gemm("shared-out", tokens, h, ds)]
    return out


def attention_core_gemms(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int) -> list[Gemm]:
    """QK^T and (softmax)V: b*a/t batched (s x hd) @ (hd x s) and (s x s) @ (s x hd)."""
    count = micro_batch * cfg.n_heads // tp
    return [Gemm("qk^T", seq_len, seq_len, cfg.head_dim, count), Gemm("pv", seq_len, cfg.head_dim, seq_len, count)]


def head_gemm(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int) -> Gemm:
    return Gemm("logits", micro_batch * seq_len, cfg.vocab_size // tp, cfg.d_model)


def layer_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of one block per token: 2 x matmul params + 4 s h (Narayanan §5.1 per layer
    24Bsh^2 + 4Bs^2h for the GPT shape; here with the real kv and ffn widths)."""
    h, f = cfg.d_model, cfg.active_ffn_dim
    kv = cfg.kv_heads * cfg.head_dim
    up = 3 if cfg.mlp == "swiglu" else 2
    return 2.0 * (h * (h + 2 * kv) + h * h + up * h * f + h * cfg.router_dim) + 4.0 * seq_len * h


def attention_core_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 4.0 * seq_len * cfg.d_model


def mlp_forward_flops_per_token(cfg: ModelConfig) -> float:
    up = 3 if cfg.mlp == "swiglu" else 2
    return 2.0 * (up * cfg.d_model * cfg.active_ffn_dim + cfg.d_model * cfg.router_dim)


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """MFU numerator per token: tenfold.models.presets.flops_per_token (6N + 12 L s d)."""
    return flops_per_token(cfg, seq_len)


def recomputed_layers(policy: RecomputePolicy, n_layers: int) -> float:
    """Blocks whose whole forward runs twice: exactly the blocks the engine wraps
    (tenfold.terms.RecomputePolicy.checkpointed_blocks); per-op recompute runs only part of
    each block again (op_rerun_flops_per_token)."""
    return 0.0 if policy.kind == "op" else float(len(policy.recomputed_blocks(n_layers)))


def regathered_layers(policy: RecomputePolicy, n_layers: int) -> float:
    """Blocks that ZeRO-3 gathers a third time per micro-batch: a segment of several blocks
    (`segments:K`) is recomputed in backward before its inner blocks' own backward starts, so
    every block of a checkpointed segment but its last runs FSDP2's forward hooks again; a
    block checkpointed alone recomputes inside its backward gather."""
    if policy.kind != "segments":
        return 0.0
    return float(sum(len(group) - 1 for group in policy.checkpointed_blocks(n_layers)))


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, policy: RecomputePolicy,
                              recomputed: float | None = None) -> float:
    """Extra forward FLOPs per token. Full: one more forward of each block (Narayanan Eq. 3's
    96 = 72 + 24). Selective (attention): QK^T and PV again, 4 s h per layer (Korthikanti Eq. 8:
    s/(6h) of the forward). Selective (mlp): the MLP matmuls again. `recomputed`: blocks wrapped
    whole (default: those of one unpipelined stack of `cfg.n_layers`)."""
    if policy.kind in ("full", "every", "segments"):
        n = recomputed_layers(policy, cfg.n_layers) if recomputed is None else recomputed
        return n * layer_forward_flops_per_token(cfg, seq_len)
    if policy.kind == "selective":
        per = attention_core_forward_flops_per_token(cfg, seq_len) if policy.target == "attention" else mlp_forward_flops_per_token(cfg)
        return cfg.n_layers * per
    if policy.kind == "op":
        return cfg.n_layers * op_rerun_flops_per_token(cfg)
    return 0.0


def op_rerun_flops_per_token(cfg: ModelConfig) -> float:
    """Per-op selective recompute runs wk, wo and w3 (SwiGLU) or w2 (GeLU) again
    (tenfold.terms.op_saved_tensors keeps the other matmuls' and attention's outputs)."""
    h, f = cfg.d_model, cfg.active_ffn_dim
    kv = cfg.kv_heads * cfg.head_dim
    return 2.0 * (h * kv + h * h + h * f)


# ---- closed forms from the papers (validation and --explain)

def korthikanti_model_flops(B: int, L: int, s: int, h: int, V: int) -> float:
    """Korthikanti et al. 2022 Eq. (7): 72 B L s h^2 (1 + s/(6h) + V/(12 h L))."""
    return 72.0 * B * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L))


def korthikanti_hardware_flops_selective(B: int, L: int, s: int, h: int, V: int) -> float:
    """Korthikanti Eq. (8), selective recompute: 72 B L s h^2 (1 + s/(3h) + V/(12 h L))."""
    return 72.0 * B * L * s * h * h * (1 + s / (3 * h) + V / (12 * h * L))


def narayanan_flops(B: int, L: int, s: int, h: int, V: int) -> float:
    """Narayanan et al. 2021 Eq. (3), with full recompute: 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    return 96.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def narayanan_params(L: int, h: int, V: int, s: int) -> float:
    """Narayanan Eq. (2): P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
    return 12.0 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))


def narayanan_days(tokens: float, params: float, gpus: int, achieved_flops: float) -> float:
    """Narayanan Eq. (4): end-to-end training time ~ 8 T P / (n X), in days."""
    return 8.0 * tokens * params / (gpus * achieved_flops) / 86400.0


def palm_flops_per_token(n_non_embedding: float, L: int, H: int, Q: int, T: int) -> float:
    """PaLM App. B (nanoGPT estimate_mfu): 6N + 12 L H Q T."""
    return 6.0 * n_non_embedding + 12.0 * L * H * Q * T
