"""The planner's LoRA and QLoRA terms (a run with `run.lora`; tenfold.lora_terms has the rules
the engine shares): the frozen base's bytes, the adapters' model states, the tensors a step
keeps when most weights take no gradient, the FLOPs and the extra time.

Sources: Hu et al. 2021 (LoRA: A (r x in), B (out x r) per adapted Linear, W frozen);
Dettmers et al. 2023 (QLoRA §3: NF4 with double quantization, 4 + 8/64 + 16/16384 bits here;
the base dequantized for every matmul, forward and backward); PyTorch autograd's rule that a
matmul keeps its input only for the gradient of its weight (a frozen weight's input is not
saved; its backward needs the weight alone).

Memory per rank (ZeRO §5's divisions, as `memory.model_states` applies them):
  frozen base   B bytes per parameter (the compute dtype), NF4's bytes for the blocks' Linears
                QLoRA quantizes; no gradient, no optimizer state; divided by N_d at ZeRO-3
  adapters      fp32 weights + fp32 gradients + AdamW m, v: 16 bytes per parameter
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenfold.lora_terms import adapted_roles, nf4_bytes_per_param, nf4_quantizable, role_shapes
from tenfold.models.presets import ModelConfig, block_param_count
from tenfold.terms import element_bytes, runs_on_fsdp2

NF4_PER_WEIGHT = 17  # the 16-entry code book and the scalers' mean, in the weight's dtype (torchao's NF4Tensor)


@dataclass(frozen=True)
class LayerCounts:
    """One block's parameters under a LoRA run."""

    adapters: int  # A and B of every adapted Linear
    nf4: int  # parameters QLoRA holds in NF4
    nf4_weights: int  # how many weights that is
    adapted: tuple[str, ...]  # the roles with an adapter (q, k, v, o, gate, up, down)


def _roles(cfg: ModelConfig) -> tuple[str, ...]:
    return ("q", "k", "v", "o", "gate", "up", "down") if cfg.mlp == "swiglu" else ("q", "k", "v", "o", "up", "down")


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    return role_shapes(cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.ffn_dim)


def layer_counts(cfg: ModelConfig, run) -> LayerCounts:
    spec = run.lora
    shapes = _shapes(cfg)
    adapted = adapted_roles(spec, run.model_kind, run.hf_model_type, cfg.mlp)
    adapters = sum(spec.rank * (shapes[r][0] + shapes[r][1]) for r in adapted)
    quantized = [r for r in _roles(cfg) if spec.base == "nf4" and nf4_quantizable(shapes[r][1], shapes[r][0])]
    nf4 = sum(shapes[r][0] * shapes[r][1] for r in quantized)
    return LayerCounts(adapters, nf4, len(quantized), adapted)


def frozen_bytes(base_params: float, layers: int, counts: LayerCounts, precision: str) -> float:
    """The frozen base of a rank holding `base_params` and `layers` blocks: the compute dtype,
    NF4 (QLoRA §3, double quantization: lora_terms.nf4_bytes_per_param) where QLoRA puts it."""
    B = element_bytes(precision)
    nf4 = layers * counts.nf4
    return (base_params - nf4) * B + nf4 * nf4_bytes_per_param(B) + layers * counts.nf4_weights * NF4_PER_WEIGHT * B


@dataclass(frozen=True)
class LoraStates:
    params: float
    grads: float
    moments: float
    cpu: float


def model_states(base_params: float, layers: int, cfg: ModelConfig, run) -> LoraStates:
    """Bytes of one rank's model states (before the caller's ZeRO split): see the module
    docstring. `run`: a tenfold.run.ResolvedRun with `lora`."""
    counts = layer_counts(cfg, run)
    adapters = layers * counts.adapters
    z, dp = run.zero_runs_as, run.shard_size
    param_div = dp if z >= 3 and run.pp == 1 else 1
    grad_div = dp if z >= 2 and run.pp == 1 else 1
    opt_div = dp if z >= 1 else 1
    params = frozen_bytes(base_params, layers, counts, run.precision) + 4.0 * adapters
    if run.offload != "none":  # FSDP2's CPUOffloadPolicy: every shard, frozen or trained, and AdamW on the host
        return LoraStates(0.0, 0.0, 0.0, (params + 12.0 * adapters) / dp)
    return LoraStates(params / param_div, 4.0 * adapters / grad_div, 8.0 * adapters / opt_div, 0.0)


def adapter_params(cfg: ModelConfig, run, layers: int) -> float:
    return layers * layer_counts(cfg, run).adapters


# --------------------------------------------------------------------------- activations


def layer_terms(cfg: ModelConfig, run) -> list[tuple[str, float, str, str, str]]:
    """(name, bytes per token, tp, selective part, source) of what one block of a LoRA run keeps
    for backward, eager PyTorch under autocast (tenfold's activation style): the residual stream
    is 16-bit (the frozen embedding is), a frozen norm keeps its fp32 input, a Linear's input is
    kept only where an adapter reads it (A's matmul needs it for A's gradient), the attention
    core and the activation function keep theirs as without adapters; each adapter keeps its
    r-wide A output (for B's gradient) and, with dropout, its mask and its dropped input."""
    h, f, a = cfg.d_model, cfg.ffn_dim, cfg.n_heads
    B = element_bytes(run.precision)
    spec, counts = run.lora, layer_counts(cfg, run)
    on = set(counts.adapted)
    L = "autograd: a frozen Linear keeps no input"
    attn_in = 4.0 + (B if on & {"q", "k", "v"} else 0.0)
    mlp_in = 4.0 + (B if on & {"gate", "up"} else 0.0)
    terms = [
        ("norm1 (+ the adapters' input)", attn_in * h, "replicated", "keep", f"frozen RMSNorm: fp32 input; {L}"),
        ("q, k, v (SDPA inputs)", 3 * B * h, "shard", "keep", "SDPA saves q, k, v"),
        ("SDPA output + logsumexp", B * h + 4.0 * a, "shard", "attn_core", "flash SDPA"),
        ("wo input", B * h if "o" in on else 0.0, "shard", "keep", L),
        ("norm2 (+ the adapters' input)", mlp_in * h, "replicated", "keep", f"frozen RMSNorm: fp32 input; {L}"),
    ]
    if cfg.mlp == "swiglu":
        terms.append(("w1 x, silu(w1 x), w3 x (+ w2 input)", (3 + ("down" in on)) * B * f, "shard", "mlp",
                      f"silu saves its input, mul both operands; {L}"))
    else:
        terms.append(("gelu input (+ w2 input)", (1 + ("down" in on)) * B * f, "shard", "mlp", L))
    shapes = _shapes(cfg)
    terms.append(("adapters' A outputs", B * spec.rank * len(on), "replicated", "keep", "lora_B's input, r wide"))
    if spec.dropout:
        width = sum(shapes[r][0] for r in on)
        terms.append(("adapters' dropout masks and inputs", (1.0 + B) * width, "replicated", "keep",
                      "PEFT's dropout per adapted Linear: a bool mask and the dropped input A reads"))
    return terms


def final_norm_bytes(cfg: ModelConfig, run) -> float:
    """The last stage besides the loss: the frozen final norm's fp32 input (the frozen head
    keeps no input)."""
    return run.micro_batch * run.local_seq_len * 4.0 * cfg.d_model


def autocast_copy_bytes(cfg: ModelConfig, run, layers: int) -> float:
    """Under autocast the fp32 adapters are cast to 16 bits for their matmuls (the frozen base
    is 16-bit already): 2 bytes per adapter parameter, kept for backward."""
    if run.precision == "fp32" or runs_on_fsdp2(run.zero_stage, run.tp, run.dp, run.offload):
        return 0.0  # under FSDP2 the adapters are gathered in 16 bits (gathered_param_bytes)
    return element_bytes(run.precision) * adapter_params(cfg, run, layers)


# --------------------------------------------------------------------------- FLOPs and time


def flops_per_token(cfg: ModelConfig, run) -> float:
    """Model FLOPs per token of a LoRA step (the engine's `lora_run.adapted`, the same count): a
    frozen matmul runs its forward and the backward to its input, 2 + 2 FLOPs per parameter (no
    weight gradient), an adapter the full 6 (Kaplan et al. 2020's 6N split by pass), attention
    12 L s d as without adapters (PaLM App. B; its backward is needed for the inputs)."""
    base = cfg.n_layers * block_param_count(cfg) + cfg.vocab_size * cfg.d_model
    adapters = cfg.n_layers * layer_counts(cfg, run).adapters
    return 4.0 * base + 6.0 * adapters + 12.0 * cfg.n_layers * run.seq_len * cfg.d_model


def adapter_gemm_shapes(cfg: ModelConfig, run) -> list[tuple[int, int, int]]:
    """(m, n, k) of the forward matmuls adapters add to one block: x A^T (t x r x in), then B."""
    t = run.micro_batch * run.local_seq_len
    shapes = _shapes(cfg)
    out = []
    for role in layer_counts(cfg, run).adapted:
        fan_in, fan_out = shapes[role]
        out += [(t, run.lora.rank, fan_in), (t, fan_out, run.lora.rank)]
    return out


def dequant_bytes(cfg: ModelConfig, run) -> float:
    """Bytes one block's NF4 weights move to be dequantized once (read NF4, write the compute
    dtype); QLoRA does it in the forward and again in the backward (torchao's linear_nf4)."""
    counts = layer_counts(cfg, run)
    B = element_bytes(run.precision)
    return counts.nf4 * (nf4_bytes_per_param(B) + B)


def dequant_working_bytes(cfg: ModelConfig, run) -> float:
    """The transient memory of dequantizing the largest NF4 weight (torchao's
    `NF4Tensor.get_original_weight`): the two halves' 4-bit codes as int64 indices (8 bytes per
    value together), their looked-up values, the scaled values and the stacked result (3 x B
    bytes per value), all alive until the weight is rebuilt; once per matmul, forward and
    backward, one weight at a time."""
    if run.lora is None or run.lora.base != "nf4":
        return 0.0
    shapes = _shapes(cfg)
    sizes = [shapes[r][0] * shapes[r][1] for r in _roles(cfg) if nf4_quantizable(shapes[r][1], shapes[r][0])]
    return (8.0 + 3.0 * element_bytes(run.precision)) * max(sizes, default=0)


def unit_bytes_per_param(run) -> tuple[float, float]:
    """(gathered bytes, gradient bytes) per parameter of one block as FSDP2 moves it under a LoRA
    run: the frozen base (16-bit or NF4) plus the adapters in the compute dtype; gradients only
    for the adapters, in fp32."""
    cfg = run.model
    counts = layer_counts(cfg, run)
    block = block_param_count(cfg)
    gathered = frozen_bytes(block, 1, counts, run.precision) + element_bytes(run.precision) * counts.adapters
    return gathered / block, 4.0 * counts.adapters / block
