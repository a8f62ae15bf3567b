"""The planner on mixture-of-experts models: memory from the total parameters, FLOPs and MFU from
the active ones, the MoE layer's saved activations against the tensors the module saves."""

from __future__ import annotations

import pytest

from tenfold.models.presets import PRESETS, active_param_count, flops_per_token, head_param_count, param_count
from tenfold.plan.api import predict
from tenfold.plan.flops import layer_forward_flops_per_token, layer_gemms

from conftest import planned
from test_plan_model import _saved_tensor_bytes


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_activation_model_matches_saved_tensors(dtype):
    cfg, b, s = PRESETS["tiny-moe"], 2, 64
    measured = _saved_tensor_bytes(cfg, dtype, b, s)
    plan = predict(planned(cfg, precision=dtype, micro_batch=b, seq_len=s), "a100-80gb")
    predicted = plan.memory.activations_bytes + plan.memory.autocast_weight_copies_bytes
    predicted -= 4 * b * s * cfg.vocab_size  # the log-probabilities' gradient is not a saved tensor
    assert predicted == pytest.approx(measured, rel=0.1)


@pytest.mark.parametrize("name", ["tiny-moe", "mixtral-8x7b", "deepseek-moe-16b", "qwen3-235b-a22b"])
def test_layer_flops_are_the_active_parameters(name):
    cfg, s = PRESETS[name], 4096
    # 3 x the blocks' forward + the output layer = the MFU numerator (6 x active params + 12 L s d)
    head = 6.0 * cfg.vocab_size * cfg.d_model
    head += 6.0 * cfg.n_layers * 2 * cfg.d_model  # the norms' weights, counted in N, no matmul
    assert 3 * cfg.n_layers * layer_forward_flops_per_token(cfg, s) + head == pytest.approx(flops_per_token(cfg, s))
    gemm_flops = sum(g.flops for g in layer_gemms(cfg, 1, s, 1)) / s  # per token, balanced experts
    attn = 4.0 * s * cfg.d_model
    assert gemm_flops == pytest.approx(layer_forward_flops_per_token(cfg, s) - attn, rel=1e-3)


def test_plan_prices_memory_on_total_and_mfu_on_active_parameters():
    cfg = PRESETS["mixtral-8x7b"]
    plan = predict(planned(cfg, 64, precision="bf16", micro_batch=1, seq_len=4096, zero_stage=3,
                           recompute="full"), "h100-sxm")
    assert plan.params == param_count(cfg) and plan.active_params == active_param_count(cfg)
    assert plan.active_params < plan.params / 3
    # ZeRO-3 over 64 ranks: the 16-bit-free fp32 weights of ALL experts, sharded (memory sees the total)
    assert plan.memory.params_bytes == pytest.approx(4 * param_count(cfg) / 64, rel=0.01)
    # FLOPs per step from the active parameters; MFU is those FLOPs over the peak
    assert plan.model_flops_per_step == pytest.approx(flops_per_token(cfg, 4096) * plan.tokens_per_step)
    assert plan.model_flops_per_step < 6 * param_count(cfg) * plan.tokens_per_step / 3
    assert head_param_count(cfg) > 0
