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


def _qwen3(gpus: int, **choices):
    return planned("qwen3-235b-a22b", gpus, **{"precision": "bf16", "seq_len": 4096, "micro_batch": 1, "recompute": "full",
                                               "zero_stage": 3, **choices})


def test_expert_parallelism_splits_the_experts_and_zero_shards_them_over_their_replicas():
    """ZeRO-3 shards a rank's 1/ep of the experts over the dp / ep ranks holding the same ones, so
    each rank keeps 1/dp of every weight, with or without ep (tests/test_expert_parallel.py
    measures the same 1/dp on 4 ranks); ZeRO-0 keeps the rank's 1/ep whole."""
    from tenfold.models.presets import expert_param_count

    cfg = PRESETS["qwen3-235b-a22b"]
    one, ep8 = (predict(_qwen3(64, ep=e), "h100-sxm") for e in (1, 8))
    experts, dense = expert_param_count(cfg), param_count(cfg) - expert_param_count(cfg)
    # ep 1: ZeRO-3 shards everything over 64 ranks (fp32 weights, 4 bytes each)
    assert one.memory.params_bytes == pytest.approx(4 * param_count(cfg) / 64, rel=1e-6)
    # ep 8: the dense part over 64 ranks, 1/8 of the experts over the 8 ranks holding them
    assert ep8.memory.params_bytes == pytest.approx(4 * (dense / 64 + experts / 8 / 8), rel=1e-6)
    assert ep8.memory.optimizer_bytes == pytest.approx(8 * (dense / 64 + experts / 64), rel=1e-6)
    whole = predict(_qwen3(64, ep=8, zero_stage=0), "h100-sxm")
    assert whole.memory.params_bytes == pytest.approx(4 * (dense + experts / 8), rel=1e-6)
    assert ep8.time.ep_comm_s > 0 and one.time.ep_comm_s == 0


def test_all_to_all_crossing_nodes_costs_the_nic_and_its_volume_is_four_per_layer():
    from tenfold.plan import hardware
    from tenfold.plan import moe as moe_plan

    cfg = PRESETS["qwen3-235b-a22b"]
    hw = hardware.get_hardware("h100-sxm")
    inside, across = _qwen3(64, ep=8), _qwen3(64, ep=16)
    buffer = moe_plan.all_to_all_bytes(cfg, inside)
    assert buffer == 4096 * cfg.experts_per_token * cfg.d_model * 2  # b s k d bf16
    t8 = moe_plan.all_to_all_time(buffer, hw, moe_plan.ep_group(inside, hw))
    t16 = moe_plan.all_to_all_time(buffer, hw, moe_plan.ep_group(across, hw))
    assert moe_plan.ep_group(inside, hw).crosses_nodes is False and moe_plan.ep_group(across, hw).crosses_nodes
    assert t8 == pytest.approx(7 / 8 * buffer / (hw.intra_node_bw * hw.bus_efficiency)
                               + hw.collective_latency_s + hw.intra_latency_s)
    assert t16 == pytest.approx(8 / 16 * buffer / (hw.nic_bw * hw.bus_efficiency)
                                + hw.collective_latency_s + hw.inter_latency_s)
    volume = moe_plan.ep_volume_per_step(cfg, inside, cfg.n_layers)
    assert volume == pytest.approx(4 * cfg.n_layers * inside.grad_accum * buffer * 7 / 8)
    # full recompute replays the dispatch and combine: 6 all-to-alls per layer instead of 4
    assert predict(inside, hw).time.ep_comm_s == pytest.approx(6 * cfg.n_layers * inside.grad_accum * t8)


@pytest.mark.parametrize("gpus", [64, 1024])
def test_search_considers_expert_parallelism_for_a_235b_a22b_model(gpus):
    from tenfold.plan.hardware import get_hardware
    from tenfold.plan.report import _layout, varying_keys
    from tenfold.plan.search import _layouts, search

    base = planned("qwen3-235b-a22b", gpus, precision="bf16", seq_len=4096, global_batch=gpus * 4)
    eps = {run.ep for run in _layouts(base, get_hardware("h100-sxm"), None, gpus)}
    assert {1, 2, 8, 64} <= eps and max(eps) <= 128
    assert predict(_qwen3(gpus, ep=64), "h100-sxm").fits
    result = search(base, "h100-sxm", top_k=5)
    assert result.best and result.best[0].fits
    # with the experts sharded over their replicas, expert parallelism is among the fastest
    # layouts that fit (the pick on 1,024 GPUs), each row naming its degree once
    assert any(p.strategy["ep"] > 1 for p in result.best)
    varying = varying_keys(result.best)
    assert all(_layout(p, varying).count("ep=") == (p.strategy["ep"] > 1) for p in result.best)


def test_dense_models_search_no_expert_parallelism():
    from tenfold.plan.hardware import get_hardware
    from tenfold.plan.search import _layouts

    base = planned("tiny", 8, precision="bf16", global_batch=64)
    assert {run.ep for run in _layouts(base, get_hardware("h100-sxm"), None, 8)} == {1}


def test_emit_writes_the_ep_degree(tmp_path):
    from tenfold.config import build_config
    from tenfold.plan.advice import config_for_plan, launch_line

    base = build_config({"model": {"name": "tiny-moe"}})
    run = planned("tiny-moe", 4, precision="fp32", global_batch=8, ep=2)
    cfg, resolved = config_for_plan(base, run, gpus_per_node=4)
    assert cfg.parallel.ep_degree == 2 and resolved.ep == 2
    assert "--ep 2" in launch_line(cfg, 4, 4)
