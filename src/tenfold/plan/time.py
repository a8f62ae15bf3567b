"""Step time: GEMMs at a shape-dependent efficiency, memory-bound elementwise work, attention,
recompute, TP/PP/DP communication with what overlaps, and the pipeline bubble.

The physics, in order:
1. GEMM time = max(FLOPs / (peak x e_max x tile utilisation), bytes / HBM bandwidth): the
   roofline (Williams et al. 2009) with tile and wave quantisation (128x128 output tiles spread
   over the SMs: a GEMM with 1.1 waves of tiles runs as 2). e_max is the one calibrated number
   (hardware.GEMM_SHARE_OF_MAMF, Narayanan Table 1 only), scaled per GPU by its measured
   best matmul over its datasheet peak (hardware: matmul_fraction).
2. Backward = 2 x forward matmuls (grad wrt inputs and wrt weights); recompute adds forwards.
3. Norms, activations, residual adds, RoPE, softmax: memory-bound, bytes / (0.8 x HBM).
4. Flash attention skips the masked half of a causal s x s (executed work), its backward
   recomputes P (2.5x forward).
5. TP all-reduces (Megatron, 2 forward + 2 backward per layer, + 2 per recomputed layer) are
   on the critical path (not overlapped, as in Megatron 2021/2022).
6. Pipeline: (m + (p-1)/v) x t_microbatch (Narayanan Eq. 1; interleaving divides the bubble by v
   and multiplies p2p traffic by v).
7. DP / ZeRO: per layer, overlapped only with the compute that runs at the same time
   (dp_time.py); assembled with the rest in step_time.py.
8. Optimizer step: memory-bound over the rank's shard (~30 bytes/param read+written).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tenfold.models.presets import ModelConfig
from tenfold.plan.flops import Gemm, attention_core_gemms, head_gemm, layer_gemms
from tenfold.plan import fp8
from tenfold.plan import lora as lora_plan
from tenfold.plan.moe import LOAD_IMBALANCE
from tenfold.plan.hardware import Hardware
from tenfold.run import ResolvedRun
from tenfold.terms import RecomputePolicy, element_bytes

MEMORY_EFFICIENCY = 0.8  # fraction of HBM bandwidth that streaming kernels reach (assumption)
TILE_MN = 128
TILE_K = 64
FLASH_KERNEL_EFFICIENCY = 0.85  # flash attention vs a plain GEMM of the same shape (FA2 paper: 50-73% of peak fwd)


def _quantised(x: int, tile: int) -> float:
    return x / (math.ceil(x / tile) * tile)


def gemm_efficiency(g: Gemm, hw: Hardware) -> float:
    """e_max x tile utilisation x wave utilisation (GPU only)."""
    eff = hw.gemm_efficiency
    if hw.sm_count:
        eff *= _quantised(g.m, TILE_MN) * _quantised(g.n, TILE_MN) * _quantised(g.k, TILE_K)
        tiles = math.ceil(g.m / TILE_MN) * math.ceil(g.n / TILE_MN) * g.count
        waves = math.ceil(tiles / hw.sm_count)
        eff *= tiles / (waves * hw.sm_count)
    return eff


def gemm_time(g: Gemm, hw: Hardware, peak: float, elem_bytes: float) -> float:
    compute = g.flops / (peak * gemm_efficiency(g, hw))
    memory = g.count * (g.m * g.k + g.k * g.n + g.m * g.n) * elem_bytes / (hw.hbm_bw * MEMORY_EFFICIENCY)
    return max(compute, memory)


def elementwise_bytes_per_token(cfg: ModelConfig, run: ResolvedRun) -> float:
    """Forward bytes moved by the non-matmul ops of one layer, per token (backward ~2x).
    megatron (fused kernels): 2 norms read+write h, 2 bias-dropout-adds read 2h write h, a fused
    GeLU (f) or SwiGLU (3f), RoPE on q, k, a fused scale-mask-softmax without flash.
    tenfold (eager PyTorch): RMSNorm is ~8 fp32 passes (F.rms_norm's composite kernels plus
    the casts around it), 16-bit casts of the Linears' inputs, RoPE's pair swap and two
    multiplies, the transposed copy, SwiGLU's silu and mul as separate kernels."""
    h, f = cfg.d_model, cfg.active_ffn_dim
    kv = cfg.kv_heads * cfg.head_dim
    B = element_bytes(run.precision)
    tp, seq_len, st = run.tp, run.seq_len, run.stack
    # Norms and residual adds see the whole (b, s, h) on every tp rank unless sequence parallelism
    # splits them by position (Korthikanti et al. 2022, section 4.2.2).
    rep = tp if run.sequence_parallel else 1
    if st.activation_style == "tenfold":
        per_norm = 8 * 8.0 * h
        replicated = 2 * per_norm + 2 * (3 * 4.0 * h) + 3 * 2 * B * h
        sharded = 6 * 2 * B * (h + kv) + 2 * 2 * B * h + (5 * B * f if cfg.mlp == "swiglu" else 8 * B * f)
    else:
        replicated = (4 + 6) * B * h + (3.0 * h if st.dropout else 0.0)
        sharded = 2 * B * (h + kv) + (3 * B * f if cfg.mlp == "swiglu" else 2 * B * f)
    if not st.flash_attention:
        a = cfg.n_heads
        sharded += 2 * B * a * seq_len + ((2 * B + 1) * a * seq_len if st.dropout else 0.0)
    return replicated / rep + sharded / tp


@dataclass
class LayerTimes:
    fwd: float  # one layer, one micro-batch: matmuls + attention + elementwise
    bwd: float
    attn_fwd: float
    mlp_fwd: float
    tp_comm_fwd: float  # exposed TP all-reduce time (forward; backward the same)
    op_rerun_fwd: float = 0.0  # what per-op selective recompute runs again: the unsaved matmuls + elementwise


def layer_times(cfg: ModelConfig, run: ResolvedRun, hw: Hardware, peak: float, tp_ar_time: float) -> LayerTimes:
    B = element_bytes(run.precision)
    # Context parallelism: s/cp tokens of each sequence per rank; their queries attend over all
    # s keys, so the rank does 1/cp of the sequence's attention (balanced by the head-tail layout)
    micro_batch, seq_len, tp = run.micro_batch, run.local_seq_len, run.tp
    gemms = layer_gemms(cfg, micro_batch, seq_len, tp)
    mm_peak = fp8.block_matmul_peak(hw, run, peak)  # float8 matmuls in the blocks with --fp8
    g_times = {g.name: gemm_time(g, hw, mm_peak, B) for g in gemms}
    if run.ep > 1:  # the busiest expert rank's share of the routed tokens (plan/moe.py)
        for name in ("experts-in", "experts-out"):
            g_times[name] *= LOAD_IMBALANCE
    core = attention_core_gemms(cfg, micro_batch, run.seq_len, tp)
    core_t = sum(gemm_time(g, hw, peak, B) for g in core) / run.cp
    if run.stack.flash_attention:
        attn_f = 0.5 * core_t / FLASH_KERNEL_EFFICIENCY  # causal: masked blocks skipped
        attn_b = 2.5 * attn_f  # FA2 backward: 5 matmuls vs 2
    else:
        attn_f, attn_b = core_t, 2 * core_t
    per_token = elementwise_bytes_per_token(cfg, run) + fp8.cast_bytes_per_token(cfg, run)
    elem = per_token * micro_batch * seq_len / (hw.hbm_bw * MEMORY_EFFICIENCY)
    mm = sum(g_times.values())
    fwd = mm + attn_f + elem
    bwd = 2 * mm + attn_b + 2 * elem
    if run.lora is not None:
        fwd, bwd = _lora_layer_times(cfg, run, hw, peak, mm, attn_f, attn_b, elem)
    mlp_f = sum(t for name, t in g_times.items() if name not in ("qkv", "out-proj"))  # MLP or MoE layer
    return LayerTimes(fwd, bwd, attn_f, mlp_f, 2 * tp_ar_time, op_rerun_matmuls(cfg, g_times) + elem)


def _lora_layer_times(cfg: ModelConfig, run: ResolvedRun, hw: Hardware, peak: float, mm: float, attn_f: float,
                      attn_b: float, elem: float) -> tuple[float, float]:
    """A LoRA block: the frozen matmuls' backward is the input gradient only (1 x forward, not
    2 x); each adapter adds its two thin matmuls (r wide, forward + 2 x backward); QLoRA
    dequantizes each NF4 weight in the forward and again in the backward, memory-bound (plan/lora.py)."""
    B = element_bytes(run.precision)
    adapters = sum(gemm_time(Gemm("lora", m, n, k), hw, peak, B) for m, n, k in lora_plan.adapter_gemm_shapes(cfg, run))
    dequant = lora_plan.dequant_bytes(cfg, run) / (hw.hbm_bw * MEMORY_EFFICIENCY)
    return mm + adapters + attn_f + elem + dequant, mm + 2 * adapters + attn_b + 2 * elem + dequant


def op_rerun_matmuls(cfg: ModelConfig, g_times: dict) -> float:
    """The matmuls per-op selective recompute runs again (tenfold.terms.op_saved_tensors keeps
    the 1st, 3rd, 5th and 7th of wq, wk, wv, wo, w1, (w3,) w2): wk, wo, and w3 (SwiGLU) or w2
    (GeLU, its 6th); attention is kept."""
    kv = cfg.kv_heads * cfg.head_dim
    wk = g_times["qkv"] * kv / (cfg.d_model + 2 * kv)
    if cfg.is_moe:  # the experts' w3 halves of the grouped up-projections
        third = (g_times["experts-in"] + g_times.get("shared-in", 0.0)) / 2
    else:
        third = g_times["mlp-in"] / 2 if cfg.mlp == "swiglu" else g_times["mlp-out"]
    return wk + g_times["out-proj"] + third


def recompute_time(lt: LayerTimes, policy: RecomputePolicy, layers: int, recomputed: int) -> float:
    """Extra time per micro-batch of a rank with `layers` blocks, `recomputed` of them wrapped
    whole (their TP all-reduces are counted with TP comm)."""
    if policy.kind in ("full", "every", "segments"):
        return lt.fwd * recomputed
    if policy.kind == "selective":
        return layers * (lt.attn_fwd if policy.target == "attention" else lt.mlp_fwd)
    if policy.kind == "op":
        return layers * lt.op_rerun_fwd
    return 0.0


def head_time(cfg: ModelConfig, run: ResolvedRun, hw: Hardware, peak: float) -> tuple[float, float]:
    """Output layer forward and backward, plus the fp32 cross-entropy (memory-bound)."""
    B = element_bytes(run.precision)
    micro_batch, seq_len, tp = run.micro_batch, run.local_seq_len, run.tp
    g = head_gemm(cfg, micro_batch, seq_len, tp)
    t = gemm_time(g, hw, peak, B)
    ce = micro_batch * seq_len * cfg.vocab_size / tp * (B + 4.0 * 3) / (hw.hbm_bw * MEMORY_EFFICIENCY)
    frozen = run.lora is not None  # a LoRA run's head takes no weight gradient
    return t + ce, (1 if frozen else 2) * t + ce


def optimizer_step_time(params_on_rank: float, hw: Hardware, offload: bool, gpus_on_node: int,
                        pcie_bytes_per_param: float = 4.0) -> float:
    """Adam over the rank's shard: read param, grad, master, m, v; write master, m, v, param:
    ~30 bytes/param, memory-bound. Offloaded: on the host, whose memory bandwidth (taken as
    8 x one GPU's host link) is shared by the node's ranks, plus what crosses the host link at
    the step: the updated 16-bit params up, and at ZeRO-1 the reduced 16-bit gradients down
    (ZeRO-2/3 send theirs every micro-batch, step_time.host_transfer_exposed)."""
    if offload:
        host_bw = 8 * hw.host_link_bw / max(1, gpus_on_node)
        return params_on_rank * (30.0 / host_bw + pcie_bytes_per_param / hw.host_link_bw)
    return params_on_rank * 30.0 / (hw.hbm_bw * MEMORY_EFFICIENCY)
