"""The planner's models one piece at a time: activations of tenfold's own model against the
tensors autograd really saves, recompute policies, ZeRO/offload, pipeline stages, `cpu`, search."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tenfold.models.presets import PRESETS, ModelConfig
from tenfold.plan import hardware
from tenfold.plan.api import _prepare, _stage_memory, predict
from tenfold.plan.flops import layer_forward_flops_per_token
from tenfold.plan.memory import activation_bytes_per_layer, loss_bytes_per_token, stage_activations
from tenfold.plan.search import search
from tenfold.run import Stack

from conftest import deepspeed_stack, planned

MEGATRON = Stack(activation_style="megatron")


def _saved_tensor_bytes(cfg: ModelConfig, dtype: str, b: int, s: int) -> int:
    """Bytes autograd saves for backward in one forward of tenfold's GPT (distinct storages,
    parameters excluded): the quantity the activation model describes."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from tenfold.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(ids)
        F.cross_entropy(logits.float().view(-1, cfg.vocab_size), ids.view(-1))
    return sum(seen.values())


@pytest.mark.parametrize("name,dtype", [("tiny", "fp32"), ("tiny", "bf16"), ("small", "fp32")])
def test_tenfold_activation_model_matches_saved_tensors(name, dtype):
    cfg, b, s = PRESETS[name], 2, 64
    measured = _saved_tensor_bytes(cfg, dtype, b, s)
    run = planned(cfg, precision=dtype, micro_batch=b, seq_len=s)
    plan = predict(run, "a100-80gb")
    sa = stage_activations(cfg, run, (cfg.n_layers,), first=True, last=True)
    # The saved tensors: every block's and the last layer's, of which the loss's log-probabilities
    # only (its two gradients exist at the start of the backward but are not saved tensors).
    loss_gradients = (loss_bytes_per_token(cfg, run) - 4 * cfg.vocab_size) * b * s
    predicted = sa.stored_bytes + sa.extra_bytes - loss_gradients + plan.memory.autocast_weight_copies_bytes
    assert predicted == pytest.approx(measured, rel=0.05)


def test_gqa_shrinks_megatron_k_v_but_not_tenfold_repeat_interleave():
    mha = PRESETS["llama-7b"]
    gqa = replace(mha, n_kv_heads=8)
    meg = dict(precision="bf16", seq_len=2048, micro_batch=1, stack=MEGATRON)
    own = dict(precision="bf16", seq_len=2048, micro_batch=1)
    assert activation_bytes_per_layer(gqa, planned(gqa, **meg)) < activation_bytes_per_layer(mha, planned(mha, **meg))
    assert activation_bytes_per_layer(gqa, planned(gqa, **own)) == activation_bytes_per_layer(mha, planned(mha, **own))


@pytest.mark.parametrize("style", ["megatron", "tenfold"])
def test_recompute_policies_order_activation_memory(style):
    cfg = PRESETS["llama-7b"]
    stack = Stack(activation_style=style, master_weights=style == "megatron")
    act = {ac: predict(planned(cfg, 8, precision="bf16", micro_batch=4, seq_len=2048, stack=stack, recompute=ac,
                               zero_stage=3), "a100-80gb").memory.activations_bytes
           for ac in ("none", "selective:mlp", "every:2", "segments:4", "full", "offload")}
    assert act["none"] > act["selective:mlp"] > act["full"]
    assert act["none"] > act["every:2"] > act["full"]
    assert act["none"] > act["segments:4"] > act["full"]
    assert act["offload"] < act["full"] * 5  # one layer in flight on the GPU


def test_full_recompute_adds_one_forward_of_the_blocks():
    cfg = PRESETS["gpt3-1.3b"]
    s = planned(cfg, 8, precision="bf16", micro_batch=2, global_batch=16, seq_len=2048, stack=deepspeed_stack())
    none = predict(s, "a100-80gb")
    full = predict(s.with_(recompute="full", check=False), "a100-80gb")
    extra = full.hardware_flops_per_step - none.hardware_flops_per_step
    assert extra == pytest.approx(cfg.n_layers * layer_forward_flops_per_token(cfg, 2048) * 16 * 2048)
    assert full.model_flops_per_step == none.model_flops_per_step  # MFU does not count recompute
    assert full.step_time_s > none.step_time_s and full.mfu < none.mfu


def test_zero_stages_and_offload_move_memory():
    s = planned("llama-13b", 16, precision="bf16", micro_batch=1, seq_len=2048, stack=deepspeed_stack())
    states = [predict(s.with_(zero_stage=z, check=False), "a100-80gb").memory.model_states_bytes for z in range(4)]
    assert states == sorted(states, reverse=True) and states[3] < states[0] / 10
    off = predict(s.with_(zero_stage=3, offload="optimizer", check=False), "a100-80gb").memory
    assert off.optimizer_bytes == 0 and off.grads_bytes == 0 and off.cpu_bytes > 0 and off.params_bytes > 0
    offp = predict(s.with_(zero_stage=3, offload="optimizer+params", check=False), "a100-80gb").memory
    assert offp.params_bytes == 0 and offp.cpu_bytes > off.cpu_bytes


def test_gradient_buffers_are_those_of_the_engine_that_runs():
    """Two 25 MiB DDP buckets per rank where DDP reduces (ZeRO-0/1, no tensor parallelism); one
    unsharded gradient unit where FSDP2 machinery does (ZeRO-2, and `replicate` under tp); none on
    one GPU or where tensor / pipeline parallelism use every GPU (dp = 1), as `tenfold train` runs."""
    from tenfold.plan.shape import largest_unit_params, shape_of

    def buffers(g, tp, pp, zero=0):
        run = planned("tiny", g, precision="bf16", micro_batch=1, seq_len=256, tp=tp, pp=pp, zero_stage=zero)
        return predict(run, "cpu").memory.comm_buffers_bytes

    unit = largest_unit_params(shape_of("tiny"), 2) * 4  # fp32 gradients of the largest unit, tp 2
    assert buffers(1, 1, 1) == buffers(2, 2, 1) == 0
    assert buffers(2, 1, 2) == 256 * 256 * 2  # only the input gradient a stage sends: b*s*h in bf16
    assert buffers(2, 1, 1) == buffers(2, 1, 1, zero=1) == 50 * 2**20
    assert buffers(4, 2, 1) == pytest.approx(unit)  # replicate (FSDP2) under tp: one unit's gradients
    assert buffers(2, 1, 1, zero=2) == pytest.approx(largest_unit_params(shape_of("tiny"), 1) * 4)


def test_pipeline_memory_is_the_most_loaded_stage_and_gpipe_holds_m():
    s = planned("gpt3-175b", 64, precision="bf16", tp=8, pp=8, micro_batch=1, global_batch=64, seq_len=2048,
                sequence_parallel=False, stack=deepspeed_stack())
    f1b = predict(s, "a100-80gb")
    gpipe = predict(s.with_(pp_schedule="gpipe", check=False), "a100-80gb")
    # 64 micro-batches: rank 1 (7 in flight, a receive buffer per micro-batch each way) holds
    # more than the first (8 in flight, gradient buffers only) and the last (the logits)
    shape, hw = _prepare(s, "a100-80gb", None, None)
    every_rank = [_stage_memory(shape, hw, s, r).total_bytes for r in range(8)]
    assert f1b.memory.stage == "pp rank 1" and f1b.memory.total_bytes == max(every_rank)
    assert f1b.memory.inflight_microbatches == 7 and gpipe.memory.inflight_microbatches == 64
    assert gpipe.memory.activations_bytes > 4 * f1b.memory.activations_bytes


def test_the_second_pipeline_rank_is_priced_when_another_holds_the_most_blocks():
    """A split whose largest stage is rank 3's (13 blocks): rank 1 holds fewer blocks but more
    micro-batches in flight and receive buffers both ways, and is the most loaded; the rank
    reported is the most loaded of all eight. Mutation: rank 1 left out of
    ResolvedRun.busiest_ranks -> rank 0 reported."""
    s = planned("gpt3-175b", 64, precision="bf16", tp=8, pp=8, micro_batch=1, global_batch=64, seq_len=2048,
                sequence_parallel=False, stack=deepspeed_stack(), pp_split=[11, 12, 12, 13, 12, 12, 12, 12])
    shape, hw = _prepare(s, "a100-80gb", None, None)
    every_rank = [_stage_memory(shape, hw, s, r).total_bytes for r in range(8)]
    assert max(range(8), key=s.rank_layers) == 3
    memory = predict(s, "a100-80gb").memory
    assert memory.stage == "pp rank 1" and memory.total_bytes == max(every_rank)


def test_cpu_hardware_reads_the_engine_cache_without_torch(tmp_path, monkeypatch):
    from tenfold.plan.cpu_peak import cache_key, machine_threads

    (tmp_path / "cpu_peak.json").write_text(json.dumps({cache_key(machine_threads()): {"fp32": 1e11, "bf16": 2e11}}))
    monkeypatch.setenv("TENFOLD_CACHE_DIR", str(tmp_path))
    hw = hardware.get_hardware("cpu")
    assert hw.peak("fp32") == 1e11 and hw.shared_compute and hw.memory_bytes > 2**30
    one = predict(planned("tiny", 1, precision="fp32", micro_batch=8, seq_len=256), hw)
    two = predict(planned("tiny", 2, precision="fp32", micro_batch=8, seq_len=256), hw)
    assert one.fits and two.tokens_per_s < 2 * one.tokens_per_s  # two ranks share the cores


def test_search_beats_plain_data_parallel_and_everything_fits():
    base = planned("gpt3-6.7b", 16, precision="bf16", global_batch=64, seq_len=2048)
    result = search(base, "a100-80gb", top_k=5)
    assert result.best and all(p.fits for p in result.best)
    plain = predict(base.with_(micro_batch=1, zero_stage=1, recompute="full", check=False), "a100-80gb")
    assert result.best[0].tokens_per_s >= plain.tokens_per_s
    assert result.evaluated > result.fitting > 0


def test_search_reports_nothing_when_nothing_fits():
    result = search(planned("gpt3-175b", 8, precision="bf16", global_batch=8, seq_len=2048), "a100-80gb")
    assert result.best == [] and result.fitting == 0


def test_predict_accepts_hardware_names_and_objects():
    run = planned("gpt3-125m", 8, micro_batch=4, stack=deepspeed_stack())
    a = predict(run, "h100")
    b = predict(run, hardware.CATALOG["h100-sxm"])
    assert a.to_dict()["memory"]["total_bytes"] == b.to_dict()["memory"]["total_bytes"]
    json.dumps(a.to_dict())
    assert a.memory.master_weights_bytes == 4 * a.params
    with pytest.raises(TypeError):
        predict("gpt3-125m", "h100")  # a resolved run, nothing else


def test_largest_micro_batch_is_the_boundary_of_fitting():
    from tenfold.plan.api import largest_micro_batch, predict_memory

    s = planned("llama-7b", 8, precision="bf16", seq_len=2048, zero_stage=3, stack=deepspeed_stack())
    b = largest_micro_batch(s, "a100-80gb")
    assert b >= 1
    fits = lambda mb: predict_memory(s.with_(micro_batch=mb, grad_accum=1, global_batch=None, check=False), "a100-80gb")  # noqa: E731
    assert fits(b).total_bytes <= fits(b).capacity_bytes < fits(b + 1).total_bytes
    assert largest_micro_batch(s.with_(recompute="full", check=False), "a100-80gb") > b  # recompute frees room
    big = planned("gpt3-175b", 8, precision="bf16", seq_len=2048, zero_stage=3, stack=deepspeed_stack())
    assert largest_micro_batch(big, "a100-80gb") == 0
    small = largest_micro_batch(s, "a100-80gb", memory_budget_bytes=40e9)
    assert 1 <= small < b


def test_fp8_prices_the_blocks_matmuls_at_the_fp8_peak_and_gathers_a_byte_per_weight():
    """--fp8 (torchao float8 linears): the blocks' GEMMs at the hardware's dense FP8 peak, the
    float8 casts as memory traffic, and under FSDP2 the block weights gathered in one byte."""
    from tenfold.plan.gathered import gathered_param_bytes
    from tenfold.plan.shape import largest_unit_params, shape_of

    run = planned("llama-7b", 8, precision="bf16", zero_stage=3, micro_batch=2, seq_len=4096)
    bf16, fp8 = predict(run, "h100-sxm"), predict(run.with_(fp8=True, check=False), "h100-sxm")
    assert 1.1 < fp8.tokens_per_s / bf16.tokens_per_s < 1.6  # torchtitan: 1.2-1.5x on large models
    assert fp8.time.dp_comm_s < 0.8 * bf16.time.dp_comm_s  # the blocks' gathers move half the bytes
    unit = largest_unit_params(shape_of("llama-7b"), 1)
    assert gathered_param_bytes(0, run.with_(fp8=True, check=False), unit) == gathered_param_bytes(0, run, unit) / 2
    a100 = predict(run.with_(fp8=True, check=False), "a100-80gb")  # no FP8 tensor cores: the bf16 rate, said
    assert any("no float8 matmul peak" in n for n in a100.notes)
    assert a100.tokens_per_s <= predict(run, "a100-80gb").tokens_per_s  # + the casts
