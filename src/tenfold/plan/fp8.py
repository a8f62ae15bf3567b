"""Float8 training (`tenfold train --fp8`, torchao's tensorwise dynamic scaling) as the planner
prices it: the transformer blocks' Linears run as float8 matmuls, everything else (attention
core, embedding, output head, elementwise work) at the 16-bit rate.

- Matmul rate: the blocks' GEMMs at the hardware's dense FP8 peak (`Hardware.peak("fp8")`);
  hardware without one (CPU emulation through `torch._scaled_mm`, A100) is priced at its 16-bit
  rate, and the plan says so.
- Casts: each float8 Linear scales and casts its input, its weight and (in backward) its output
  gradient: read 2 bytes, write 1, forward and backward (torchao `Float8Linear`; Micikevicius et
  al. 2022, "FP8 Formats for Deep Learning").
- Memory: the saved activations do not change (torchao saves the 16-bit input and the weight);
  under FSDP2 (ZeRO-2/3) the block weights are all-gathered in float8, 1 byte per parameter, so
  the gathered copies and the all-gather traffic of the blocks halve (torchao
  `enable_fsdp_float8_all_gather`).
"""

from __future__ import annotations

from tenfold.models.presets import ModelConfig
from tenfold.run import ResolvedRun
from tenfold.terms import element_bytes, runs_on_fsdp2

CASTS_PER_TENSOR = 2  # forward and backward layouts of each cast tensor (torchao casts both)


def gathers_in_float8(run: ResolvedRun) -> bool:
    """FSDP2 all-gathers the blocks' weights in float8 (ZeRO-2/3 with --fp8)."""
    return run.fp8 and run.zero_runs_as >= 2 and runs_on_fsdp2(run.zero_stage, run.tp, run.dp, run.offload)


def block_param_bytes(run: ResolvedRun) -> float:
    """Bytes of one gathered block parameter."""
    return 1.0 if gathers_in_float8(run) else element_bytes(run.precision)


def block_matmul_peak(hw, run: ResolvedRun, peak: float) -> float:
    """The rate the blocks' GEMMs are priced at: `peak` (the 16-bit one, already shared among
    ranks), scaled by the hardware's FP8/16-bit peak ratio with --fp8 where it has an FP8 peak."""
    fp8 = hw.peak_flops.get("fp8") if run.fp8 else None
    return peak * fp8 / hw.peak(run.precision) if fp8 else peak


def cast_bytes_per_token(cfg: ModelConfig, run: ResolvedRun) -> float:
    """Bytes per token one block's float8 casts move (activations and output gradients; the
    weights' casts are per step, not per token, and small beside them at training batch sizes)."""
    if not run.fp8:
        return 0.0
    h, f = cfg.d_model, cfg.active_ffn_dim
    kv = cfg.kv_heads * cfg.head_dim
    up = 2 * f if cfg.mlp == "swiglu" else f
    tp = run.tp
    # input + output gradient elements per token of wq/wk/wv (h in, h + 2kv out), wo, the up and down projections
    elements = (h + (h + 2 * kv) / tp) + (h / tp + h) + (h + up / tp) + (f / tp + h)
    return CASTS_PER_TENSOR * elements * (2.0 + 1.0)
