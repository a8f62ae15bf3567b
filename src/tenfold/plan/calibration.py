"""The one calibrated constant: the GEMM efficiency ceiling as a share of the best measured
matmul (hardware.GEMM_SHARE_OF_MAMF), fitted on Narayanan et al. 2021 Table 1 only (weak
scaling of GPT models, 1.7B-1T, 32-3072 A100-80GB on Selene). On an A100 that ceiling is
share x 0.869 of the datasheet peak (its measured best matmul is 271.2 of 312 TFLOP/s).

Each row is run through the full time model with that system's setup (Megatron-LM 2021: fp16,
GPT blocks with LayerNorm, GeLU 4h, dropout, fused softmax without flash attention, full
activation recompute, no DP all-reduce overlap, scatter/gather p2p, the micro-batch and
interleave settings of `examples/academic_paper_scripts/sc21/run_table_1.sh`) and its
throughput expressed in the paper's convention: Eq. (3) FLOPs / (step time x GPUs).
`python -m tenfold.plan.calibration` prints the fit and the per-row errors.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tenfold.models.presets import ModelConfig
from tenfold.plan.flops import narayanan_flops
from tenfold.plan.hardware import CATALOG

# params_B, heads, hidden, layers, tp, pp, gpus, batch, micro_batch, layers per virtual stage (0 = none), TFLOP/s
NARAYANAN_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 0, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 0, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 0, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 0, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 0, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 5, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 5, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 3, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 1, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 0, 163),
]
VOCAB, SEQ = 51200, 2048


def row_model(row) -> ModelConfig:
    _, heads, hidden, layers, *_ = row
    return ModelConfig(n_layers=layers, d_model=hidden, n_heads=heads, vocab_size=VOCAB, max_seq_len=SEQ,
                       mlp="gelu", norm="layernorm", pos="learned", bias=True, tie_embeddings=True)


def row_run(row):
    """Narayanan Table 1's run: Megatron's stack (fp16 with master weights, dropout, no flash
    attention, no DP overlap), full recompute, interleaved where its layers per stage say so."""
    from tenfold.run import Stack, resolve

    _, _, _, layers, tp, pp, gpus, batch, mb, lpv, _ = row
    v = layers // pp // lpv if lpv else 1
    stack = Stack(master_weights=True, flash_attention=False, dropout=True, overlap_comm=False,
                  activation_style="megatron")
    stages = pp * v
    even = (layers // stages,) * stages if pp > 1 else None  # Megatron splits the blocks evenly
    return resolve(row_model(row), gpus, precision="fp16", micro_batch=mb, global_batch=batch, seq_len=SEQ,
                   recompute="full", tp=tp, pp=pp, pp_schedule="interleaved" if v > 1 else "1f1b",
                   virtual_stages=v if v > 1 else None, pp_split=even, sequence_parallel=False, stack=stack,
                   check=False)


def predicted_tflops(row, share_of_mamf: float) -> float:
    from tenfold.plan.api import _predict

    a100 = CATALOG["a100-80gb"]
    hw = replace(a100, gemm_efficiency=share_of_mamf * a100.matmul_fraction)
    plan = _predict(row_run(row), hw, trace=False)
    _, _, h, L, *_ = row
    flops = narayanan_flops(plan.global_batch, L, SEQ, h, VOCAB)
    return flops / plan.step_time_s / row[6] / 1e12


def fit(lo: float = 0.4, hi: float = 1.0) -> tuple[float, list[tuple[float, float, float]]]:
    """Least squares on log(predicted / published) over the share (golden-section search)."""

    def loss(e: float) -> float:
        return sum(math.log(predicted_tflops(r, e) / r[-1]) ** 2 for r in NARAYANAN_TABLE1)

    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    for _ in range(40):
        if loss(c) < loss(d):
            b, d = d, c
            c = b - g * (b - a)
        else:
            a, c = c, d
            d = a + g * (b - a)
    e = (a + b) / 2
    rows = [(r[0], r[-1], predicted_tflops(r, e)) for r in NARAYANAN_TABLE1]
    return e, rows


def main() -> None:
    e, rows = fit()
    print(f"fitted share of the best matmul = {e:.4f} (A100 ceiling {e * CATALOG['a100-80gb'].matmul_fraction:.4f} of peak)")
    for params, published, predicted in rows:
        print(f"{params:>7.1f}B  published {published:5.0f}  predicted {predicted:6.1f}  ({predicted / published - 1:+.1%})")


if __name__ == "__main__":
    main()
