"""The per-layer table of saved activations: one row per tensor a transformer block keeps for
its backward, per token (tenfold.plan.memory multiplies by the micro-batch's tokens, divides
by tensor parallelism and counts the layers and micro-batches in flight). Two accountings:
Korthikanti et al. 2022's (Megatron-LM's fused kernels) and tenfold's own model under eager
PyTorch and torch.amp."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tenfold.models.presets import ModelConfig
from tenfold.plan import lora as lora_plan
from tenfold.run import ResolvedRun
from tenfold.terms import element_bytes


@dataclass(frozen=True)
class ActTerm:
    """One saved tensor of a transformer layer: bytes per token, or per token x seq for the
    s^2 attention terms. `tp` says how tensor parallelism treats it: "shard" (divided by t),
    "replicated" (divided by t only with sequence parallelism), "whole" (never divided: the
    sequence-parallel all-gather's output). `part` is what selective
    recompute can drop: "attn_core" or "mlp" internals, or "keep"."""

    name: str
    bytes_per_token: float
    tp: str
    part: str
    per_seq: bool = False  # True: multiply by s as well (a*s^2*b terms)
    source: str = ""


def layer_activation_terms(cfg: ModelConfig, run: ResolvedRun) -> tuple[ActTerm, ...]:
    """The per-layer saved activations of one micro-batch (cached; see _layer_terms; a LoRA
    run's: plan/lora.py)."""
    st = run.stack
    if run.lora is not None and st.activation_style == "tenfold":
        return tuple(ActTerm(n, b, tp, part, source=src) for n, b, tp, part, src in lora_plan.layer_terms(cfg, run))
    return _layer_terms(cfg, run.precision, st.activation_style, st.flash_attention, st.dropout, run.model_kind == "hf")


@functools.lru_cache(maxsize=256)
def _layer_terms(cfg: ModelConfig, precision: str, style: str, flash: bool, drop: bool,
                 hf: bool = False) -> tuple[ActTerm, ...]:
    """The per-layer saved activations of one micro-batch, per token (multiply by b*s).

    style "megatron" reproduces Korthikanti et al. 2022 §4.1, Eq. (1): sbh(34 + 5as/h) with
    16-bit activations, 1-byte dropout masks, LayerNorm, a 4h GeLU MLP and no flash attention.
    The same terms generalise to GQA (k, v of size kv_dim), SwiGLU (Megatron's fused bias-swiglu
    keeps the 2f input and the f output), fp32 training (4-byte elements), no dropout, and flash
    attention (no s^2 terms; output O + logsumexp instead).

    style "tenfold" describes tenfold's own model under eager PyTorch + torch.amp
    (tenfold/models/gpt.py): dropout-free; each norm computes in fp32 and keeps its fp32 input
    and statistics (RMSNorm also its fp32 x / rms) and hands the Linears after it one output
    in the compute dtype (`_norm_terms`); SDPA with is_causal saves q, k, v (GQA heads already
    repeat_interleave'd to full size), its output (wo's input, a view) and logsumexp; the math
    kernel's output is copied for wo; SwiGLU saves w1(x), silu(w1 x), w3(x) and their product.
    RoPE saves only cos/sin tables (constants, not counted). `hf`: a Hugging Face model's own
    norms (`norm_bytes_per_token`).
    """
    h, f = cfg.d_model, cfg.active_ffn_dim
    kv = cfg.kv_heads * cfg.head_dim
    a = cfg.n_heads
    B = element_bytes(precision)  # bytes of one activation element
    half = precision != "fp32"
    terms = _megatron_terms(cfg, h, f, kv, a, B, flash, drop) if style == "megatron" else _tenfold_terms(cfg, h, f, a, B, half, flash, hf)
    return terms + _moe_terms(cfg, B) if cfg.is_moe else terms


def _moe_terms(cfg: ModelConfig, B: float) -> tuple[ActTerm, ...]:
    """What an MoE layer saves beyond its active experts' SwiGLU (counted in f = active width):
    the router's fp32 logits and probabilities (E each per token), the k routed copies of each
    token the grouped GEMM reads (Megatron-Core's permuted tokens), the experts' outputs the
    router weight multiplies, and the weighted outputs, which `index_add` keeps (its backward
    formula reads the source's shape through the tensor) (tenfold/models/moe.py)."""
    src = "tenfold/models/moe.py: router softmax in fp32; tokens gathered per expert (k copies)"
    k = cfg.experts_per_token
    return (ActTerm("router logits + probabilities (fp32)", 2 * 4.0 * cfg.n_experts, "replicated", "mlp", source=src),
            ActTerm("routed token copies, expert outputs, weighted outputs", 3 * B * k * cfg.d_model, "replicated",
                    "mlp", source=src),
            # chosen experts, sort order and token index (int64), chosen and sorted weights (fp32)
            ActTerm("routing indices and weights", (3 * 8.0 + 2 * 4.0) * k, "replicated", "mlp", source=src))


def _megatron_terms(cfg: ModelConfig, h: int, f: int, kv: int, a: int, B: float, flash: bool,
                    drop: bool) -> tuple[ActTerm, ...]:
    """Korthikanti et al. 2022 §4.1's terms (see _layer_terms)."""
    terms: list[ActTerm] = []
    add = terms.append
    K = "Korthikanti et al. 2022 §4.1"
    add(ActTerm("norm1 input", B * h, "replicated", "keep", source=f"{K}: LayerNorm input 2sbh"))
    add(ActTerm("qkv input", B * h, "replicated", "keep", source=f"{K}: QKV input 2sbh"))
    add(ActTerm("q, k", B * (h + kv), "shard", "keep", source=f"{K}: Q and K 4sbh (GQA: k is kv_dim)"))
    add(ActTerm("v", B * kv, "shard", "keep", source=f"{K}: V 2sbh"))
    if flash:
        add(ActTerm("attention output O + logsumexp", 4.0 * a, "shard", "attn_core",
                    source="FlashAttention (Dao 2022): saves O (shared with the out-proj input) and fp32 logsumexp"))
    else:
        add(ActTerm("softmax output", B * a, "shard", "attn_core", per_seq=True, source=f"{K}: 2as^2b"))
        if drop:
            add(ActTerm("softmax dropout mask", 1.0 * a, "shard", "attn_core", per_seq=True, source=f"{K}: as^2b"))
            add(ActTerm("softmax dropout output", B * a, "shard", "attn_core", per_seq=True, source=f"{K}: 2as^2b"))
    add(ActTerm("out-proj input", B * h, "shard", "keep", source=f"{K}: 2sbh"))
    if drop:
        add(ActTerm("attention dropout mask", 1.0 * h, "replicated", "keep", source=f"{K}: sbh"))
    add(ActTerm("norm2 input", B * h, "replicated", "keep", source=f"{K}: LayerNorm input 2sbh"))
    add(ActTerm("mlp input", B * h, "replicated", "keep", source=f"{K}: linear input 2sbh"))
    if cfg.mlp == "gelu":
        add(ActTerm("gelu input", B * f, "shard", "mlp", source=f"{K}: GeLU input 8sbh (f = 4h)"))
        add(ActTerm("fc2 input", B * f, "shard", "mlp", source=f"{K}: linear input 8sbh (f = 4h)"))
    else:
        add(ActTerm("swiglu input (w1 x, w3 x)", 2 * B * f, "shard", "mlp",
                    source="Megatron fused bias_swiglu saves its 2f input"))
        add(ActTerm("fc2 input", B * f, "shard", "mlp", source="linear input, f"))
    if drop:
        add(ActTerm("mlp dropout mask", 1.0 * h, "replicated", "keep", source=f"{K}: sbh"))
    return tuple(terms)


def _tenfold_terms(cfg: ModelConfig, h: int, f: int, a: int, B: float, half: bool,
                   flash: bool, hf: bool = False) -> tuple[ActTerm, ...]:
    """tenfold's own model under eager PyTorch + torch.amp (see _layer_terms)."""
    terms: list[ActTerm] = []
    add = terms.append
    T = "tenfold/models/gpt.py under torch.amp"
    for where in ("norm1", "norm2"):
        terms += _norm_terms(cfg, where, B if half else 4.0, hf)
    add(ActTerm("q, k, v (SDPA inputs)", 3 * B * h, "shard", "keep",
                source=f"{T}: SDPA saves q, k, v; GQA k/v are repeat_interleave'd to full width"))
    if flash:
        # The kernel writes its output (b, s, heads, head_dim) in memory and returns it as
        # (b, heads, s, head_dim): wo's input, y.transpose(1, 2).reshape, is a view of it.
        # Selective recompute of the attention core frees the logsumexp only: the output is
        # what the checkpointed core returns, and wo keeps it.
        add(ActTerm("SDPA output (wo input)", B * h, "shard", "keep",
                    source=f"{T}: flash SDPA saves its output; wo reads it as a view"))
        add(ActTerm("SDPA logsumexp", 4.0 * a, "shard", "attn_core", source=f"{T}: flash SDPA's fp32 logsumexp"))
    else:
        add(ActTerm("attention probabilities", B * a, "shard", "attn_core", per_seq=True, source="math SDPA: softmax output as^2b"))
        add(ActTerm("wo input (transposed copy)", B * h, "shard", "keep",
                    source=f"{T}: the math kernel's output is (b, heads, s, head_dim): the reshape copies"))
    # an MoE layer is whole on every tp rank (tenfold.techniques.tensor_parallel.gpt_plan)
    mlp_tp = "replicated" if cfg.is_moe else "shard"
    if cfg.mlp == "swiglu":
        add(ActTerm("w1 x, silu(w1 x), w3 x, product", 4 * B * f, mlp_tp, "mlp",
                    source=f"{T}: silu saves its input, mul both operands, w2 its input"))
    else:
        add(ActTerm("w1 x, gelu(w1 x)", 2 * B * f, mlp_tp, "mlp", source=f"{T}: gelu saves its input, w2 its input"))
    return tuple(terms)


def norm_bytes_per_token(cfg: ModelConfig, hf: bool = False, B: float = 2.0) -> tuple[float, float]:
    """(bytes per channel, bytes per token) that one norm keeps for backward besides its
    output. tenfold's (tenfold/models/gpt.py: both compute in fp32 from `x.float()`): LayerNorm
    (native_layer_norm) its fp32 input, mean and 1/std; RMSNorm (F.rms_norm's ATen
    decomposition) its fp32 input, the fp32 x / rms that the weight multiplies, and 1/rms. A
    Hugging Face RMSNorm (LlamaRMSNorm: x.float(), its mean square, x * rsqrt, cast back, then
    the weight) keeps its fp32 input, 1/rms and the normalised value in the compute dtype `B`."""
    if cfg.norm != "rmsnorm":
        return 4.0, 8.0
    return (4.0 + B, 4.0) if hf else (8.0, 4.0)


def _norm_terms(cfg: ModelConfig, where: str, out_bytes: float, hf: bool = False) -> tuple[ActTerm, ...]:
    """A norm before the attention or the MLP: what it keeps (split by sequence parallelism
    with the residual stream), and its one output copy the Linears after it keep, cast once to
    the compute dtype (fp32 without autocast). Under sequence parallelism that copy is the
    whole sequence: DTensor all-gathers the norm's output before the column-parallel Linears,
    which keep the gathered tensor (Megatron gathers it again in backward instead)."""
    per_channel, per_token = norm_bytes_per_token(cfg, hf, out_bytes)
    name = "RMSNorm" if cfg.norm == "rmsnorm" else "LayerNorm"
    src = "tenfold/models/gpt.py: the norm computes in fp32 and casts its output once"
    return (ActTerm(f"{where} ({name}: fp32 input, statistics)", per_channel * cfg.d_model + per_token,
                    "replicated", "keep", source=src),
            ActTerm(f"{where} output (the Linears' input)", out_bytes * cfg.d_model, "whole", "keep",
                    source=src + "; under sequence parallelism the Linears keep the all-gathered copy"))
