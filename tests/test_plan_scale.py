"""The planner's time and memory model at scale, one term at a time, with hand-computed numbers:
NCCL-style ring and tree collectives, per-layer ZeRO collectives that overlap only concurrent
compute, offload priced by its host-link traffic, TP that must split the KV heads, the default
(PyTorch) activation accounting, and the GEMM ceiling as a share of the best measured matmul."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tenfold.models.presets import PRESETS
from tenfold.plan import comm, dp_time, memory
from tenfold.plan.api import predict, predict_memory
from tenfold.plan.flops import regathered_layers
from tenfold.plan.hardware import CATALOG, GEMM_SHARE_OF_MAMF
from tenfold.plan.search import OFFLOAD_CHOICES, search
from tenfold.run import Stack
from tenfold.terms import parse_recompute, tp_choices

from conftest import deepspeed_stack, planned

A100 = CATALOG["a100-80gb"]  # NVLink 300 GB/s, NIC 25 GB/s, bus efficiency 0.8
US = 1e-6
# Bandwidth only: no latency, full link rate (a 8-rank NVLink ring moves 7/8 S at 300 GB/s).
IDEAL = replace(A100, bus_efficiency=1.0, intra_latency_s=0.0, inter_latency_s=0.0, collective_latency_s=0.0)


# --------------------------------------------------------------------------- collectives
def test_ring_latency_counts_every_step_and_its_network_hops():
    # NCCL tuning.cc, ring/Simple: 8.4 us + 3.4 us per NVLink step + 9.6 us per network step.
    assert comm.ring_latency(A100, comm.Group(8, 8), 1) == pytest.approx((8.4 + 7 * 3.4) * US)
    assert comm.ring_latency(A100, comm.Group(16, 8), 1) == pytest.approx((8.4 + 14 * 3.4 + 1 * 9.6) * US)
    # 1536 ranks on 192 nodes: 1535 steps, 191 of them across the network: 6.4 ms per gather.
    assert comm.ring_latency(A100, comm.Group(1536, 8), 1) == pytest.approx((8.4 + 1344 * 3.4 + 191 * 9.6) * US)
    assert comm.ring_latency(A100, comm.Group(1536, 8), 2) == pytest.approx((8.4 + 2 * 1344 * 3.4 + 2 * 191 * 9.6) * US)


@pytest.mark.parametrize("group,bw", [
    (comm.Group(8, 8), 300e9 * 0.8),  # inside a node: NVLink
    (comm.Group(64, 8), 8 * 25e9 * 0.8),  # 8 members per node: 8 NICs (200 < 300 GB/s)
    (comm.Group(64, 2), 2 * 25e9 * 0.8),  # 2 per node (TP 4): 2 NICs
    (comm.Group(64, 1), 25e9 * 0.8),  # one per node (TP 8): the slowest link is one NIC
])
def test_gather_runs_at_the_slowest_link_the_group_spans(group, bw):
    S = 1e9
    expected = (group.size - 1) / group.size * S / bw + comm.ring_latency(A100, group, 1)
    assert comm.all_gather_time(S, A100, group) == pytest.approx(expected)
    assert comm.reduce_scatter_time(S, A100, group) == pytest.approx(expected)


def test_all_reduce_takes_the_faster_of_ring_and_tree():
    g = comm.Group(1536, 8)
    # 1 KB: latency-bound; the tree's 2 x (7 NVLink + log2(192) = 8 network hops) beats 2 x 1535 ring steps.
    tree = (8.4 + 2 * (7 * 3.4 + 8 * 9.6)) * US + 2 * 1e3 / (200e9 * 0.8)
    assert comm.all_reduce_time(1e3, A100, g) == pytest.approx(tree)
    # 10 GB on two nodes: bandwidth-bound; the ring moves 2 x 15/16 S, the tree 2 S.
    g2 = comm.Group(16, 8)
    ring = 2 * 15 / 16 * 1e10 / (200e9 * 0.8) + comm.ring_latency(A100, g2, 2)
    assert comm.all_reduce_time(1e10, A100, g2) == pytest.approx(ring)


# --------------------------------------------------------------------------- ZeRO, layer by layer
def test_layer_pipelined_exposure():
    # 4 layers of 0.5 ms compute, 1 ms transfers: the first is exposed, then 3 x 0.5 ms, then the tail.
    assert dp_time.layer_pipelined_exposed(4, 0.5e-3, 1e-3, 1e-3, 0.25e-3) == pytest.approx(2.75e-3)
    assert dp_time.layer_pipelined_exposed(4, 3e-3, 1e-3, 1e-3, 0.25e-3) == pytest.approx(1.25e-3)


def _work(**kw) -> dp_time.StageWork:
    # One layer's 16-bit params and grads take exactly 1 ms to gather / reduce-scatter over 8
    # NVLink ranks at 300 GB/s (7/8 of the buffer crosses each link).
    one_ms = 300e9 * 1e-3 * 8 / 7
    base = dict(layers=4, layer_fwd_s=0.5e-3, layer_bwd_s=3e-3, bwd_s=12e-3, layer_param_bytes=one_ms,
                layer_grad_bytes=one_ms, root_param_bytes=0.0, root_grad_bytes=0.0, regathered_layers=0.0,
                micro_batches=2, pp=1)
    base.update(kw)
    return dp_time.StageWork(**base)


def test_zero3_gathers_twice_but_the_last_block_and_reduces_per_layer_per_micro_batch():
    # The last block stays gathered from its forward to its backward, which follows at once
    # (techniques/zero.py `_backward_follows_forward`): 3 of the 4 layers are gathered again.
    d = dp_time.dp_step_comm(3, _work(), IDEAL, comm.Group(8, 8), overlap=True)
    assert d.total_s == pytest.approx(2 * (4 + 3 + 4) * 1e-3)  # m x (L ag fwd + (L - 1) ag bwd + L rs)
    # per micro-batch: forward 1 + 3 x (1 - 0.5); backward 0.75 (a layer's mean gather) + 0 + 1
    # (the last reduce-scatter)
    exposed = 2 * (2.5e-3 + 1.75e-3)
    assert d.exposed_s == pytest.approx(exposed + dp_time.OVERLAP_CONTENTION * (22e-3 - exposed))
    off = dp_time.dp_step_comm(3, _work(), IDEAL, comm.Group(8, 8), overlap=False)
    assert off.exposed_s == pytest.approx(off.total_s)


def test_zero3_regathers_layers_recomputed_in_a_segment():
    plain = dp_time.dp_step_comm(3, _work(), IDEAL, comm.Group(8, 8), overlap=True)
    seg = dp_time.dp_step_comm(3, _work(regathered_layers=2), IDEAL, comm.Group(8, 8), overlap=True)
    assert seg.total_s - plain.total_s == pytest.approx(2 * 2 * 1e-3)  # 2 micro-batches x 2 extra gathers
    assert regathered_layers(parse_recompute("segments:4"), 16) == 9  # 3 checkpointed segments of 4: all but their last
    assert regathered_layers(parse_recompute("full"), 16) == 0  # a block checkpointed alone recomputes inside its gather
    assert regathered_layers(parse_recompute("every:2"), 16) == 0


def test_zero2_gathers_once_per_step_and_reduces_per_layer_per_micro_batch():
    # The engine keeps stage 2's gathered units across the micro-batches (resharding after
    # backward only at the last one): one gather per layer per step.
    d = dp_time.dp_step_comm(2, _work(), IDEAL, comm.Group(8, 8), overlap=True)
    assert d.total_s == pytest.approx(4 * 1e-3 + 2 * 4 * 1e-3)
    exposed = 2.5e-3 + 2 * 1e-3  # the first forward as stage 3; each backward only its last reduce-scatter
    assert d.exposed_s == pytest.approx(exposed + dp_time.OVERLAP_CONTENTION * (12e-3 - exposed))


def test_zero1_under_tp_gathers_per_micro_batch_and_reduces_once():
    # FSDP2 with gradient sync only at the last micro-batch (tenfold.terms.zero_runs_as).
    d = dp_time.dp_step_comm(2, _work(reduce_once=True), IDEAL, comm.Group(8, 8), overlap=False)
    assert d.total_s == pytest.approx(2 * 4 * 1e-3 + 4 * 1e-3)


def test_pipelining_reduces_once_per_step_and_holds_unreduced_gradients():
    d = dp_time.dp_step_comm(3, _work(pp=2, micro_batches=4), IDEAL, comm.Group(8, 8), overlap=False)
    # stage 3: a gather for each backward, plus one gather (first forward) and one reduce-scatter per step
    assert d.total_s == pytest.approx(4 * 4 * 1e-3 + 4 * 1e-3 + 4 * 1e-3)
    d2 = dp_time.dp_step_comm(2, _work(pp=2, micro_batches=4), IDEAL, comm.Group(8, 8), overlap=False)
    assert d2.total_s == pytest.approx(4 * 1e-3 + 4 * 1e-3)  # one gather, one reduce-scatter per step
    # ...so until that reduce every rank holds its stage's full gradients (and, after a backward, parameters).
    pipe = memory.model_states(1e9, planned(1e9, 16, zero_stage=3, pp=2, stack=deepspeed_stack()))
    assert pipe.grads_bytes == 2e9 and pipe.params_bytes == 2e9 and pipe.optimizer_bytes == 12e9 / 8
    flat = memory.model_states(1e9, planned(1e9, 8, zero_stage=3, stack=deepspeed_stack()))
    assert flat.grads_bytes == flat.params_bytes == 2e9 / 8


def test_ddp_reduces_once_per_step_under_the_last_backward_only():
    g = comm.Group(8, 8)
    w = _work(layers=4, bwd_s=2e-3)
    ar = comm.all_reduce_time(4 * w.layer_grad_bytes, IDEAL, g)  # 4 layers: 2 x 7/8 x S / B = 8 ms
    assert ar == pytest.approx(8e-3)
    d0 = dp_time.dp_step_comm(0, w, IDEAL, g, overlap=True)
    assert d0.total_s == pytest.approx(ar)
    assert d0.exposed_s == pytest.approx(6e-3 + dp_time.OVERLAP_CONTENTION * 2e-3)  # only 2 ms of backward to hide it
    assert dp_time.dp_step_comm(0, replace(w, micro_batches=16), IDEAL, g, True).total_s == pytest.approx(ar)
    d1 = dp_time.dp_step_comm(1, w, IDEAL, g, overlap=True)
    ag = 4e-3  # ZeroRedundancyOptimizer: the updated 16-bit params, once, after the step, exposed
    assert d1.total_s == pytest.approx(ar + ag)
    assert d1.exposed_s == pytest.approx(6e-3 + ag + dp_time.OVERLAP_CONTENTION * 2e-3)


def test_zero3_per_gpu_throughput_falls_at_fixed_global_batch():
    """GPT-3 175B, ZeRO-3 only, global batch 1536, one micro-batch per rank: each added GPU
    shrinks a rank's compute, while its gathers of the whole model do not shrink and pay one
    more ring step each."""
    def run(gpus, gpus_per_node=None):
        s = planned("gpt3-175b", gpus, precision="bf16", zero_stage=3, recompute="full", global_batch=1536,
                    micro_batch=1536 // gpus, seq_len=2048, stack=deepspeed_stack())
        return predict(s, "a100-80gb", gpus_per_node=gpus_per_node)

    plans = [run(n) for n in (192, 384, 768, 1536)]
    tflops = [p.tflops_per_gpu for p in plans]
    assert tflops == sorted(tflops, reverse=True) and tflops[-1] < 0.95 * tflops[0]
    shares = [p.time.dp_comm_exposed_s / p.time.step_s for p in plans]
    assert shares == sorted(shares)
    # With one GPU per node every gather crosses one NIC: the 1536-GPU run loses most of its throughput.
    thin = [run(n, gpus_per_node=1) for n in (192, 1536)]
    assert thin[1].tflops_per_gpu < 0.5 * thin[0].tflops_per_gpu


def test_hybrid_sharding_recovers_what_full_sharding_loses_at_scale():
    """At a fixed global batch, ZeRO-3 over every rank gathers each layer across the whole fleet
    (ring latency grows with the ranks, each gather crosses the network) while each rank's
    compute shrinks: per-GPU throughput falls. Shard groups of one node gather over NVLink and
    all-reduce a 1/8 shard across nodes once per step (PyTorch HSDP; MiCS, Zhang et al. 2022)."""
    def tokens_per_gpu(gpus, group=None):
        run = planned("llama-7b", gpus, precision="bf16", zero_stage=3, global_batch=1024,
                      micro_batch=1024 // gpus, seq_len=2048, shard_group=group)
        return predict(run, "a100-80gb").tokens_per_s / gpus

    full = [tokens_per_gpu(n) for n in (256, 512, 1024)]
    assert full == sorted(full, reverse=True) and full[-1] < 0.75 * full[0]
    hybrid = [tokens_per_gpu(n, 8) for n in (256, 512, 1024)]
    assert hybrid[-1] > 1.2 * full[-1] and hybrid[-1] > 0.8 * hybrid[0]


def test_search_prefers_hybrid_sharding_on_a_1024_gpu_fleet():
    base = planned("llama-7b", 1, precision="bf16", global_batch=1024, seq_len=2048)
    result = search(base, "a100-80gb", gpus=1024, top_k=5)
    best = result.best[0]
    assert best.strategy["shard_group"] and best.strategy["zero_stage"] >= 2 and not best.unsupported
    plain = predict(base.with_(world_size=1024, zero_stage=3, micro_batch=1, check=False), "a100-80gb")
    assert best.tokens_per_s > 1.2 * plain.tokens_per_s
    assert "shard groups of" in best.layout_line


def _llama3_405b_search(top_k: int):
    from tenfold.plan.validation import LLAMA3_405B

    base = planned(LLAMA3_405B, 1, precision="bf16", global_batch=2048, seq_len=8192)
    return search(base, "h100-sxm", gpus=16384, top_k=top_k)


def test_search_ranks_pipelines_that_do_not_divide_the_layers():
    """Llama 3 405B has 126 layers; on 16,384 GPUs only pp 1 and 2 divide them. The search
    ranks pp 4 to 64 too, each split by the rule train resolves it with (tenfold.terms.
    layer_counts, embedding and head weighted as a layer), and Llama 3's own layout (tp 8,
    pp 16 interleaved, full recompute) beats every layout of pp 1 or 2.
    Mutation: only pp dividing the layers (the search's old filter) -> no uneven row."""
    from tenfold.terms import layer_counts

    best = _llama3_405b_search(60).best
    uneven = [p for p in best if 126 % p.strategy["pp"]]
    assert uneven and not best[0].unsupported
    assert len({p.strategy["pp"] for p in uneven}) >= 3  # pp 8, 16, 32, 64 today
    for p in best:
        split = p.strategy["stage_layers"]
        assert split == layer_counts(126, len(split)) and sum(split) == 126
    llama3 = [p for p in uneven if (p.strategy["tp"], p.strategy["pp"], p.strategy["pp_schedule"],
                                    p.strategy["recompute"]) == (8, 16, "interleaved", "full")]
    even = [p for p in best if p.strategy["pp"] <= 2]
    assert llama3 and even and llama3[0].tokens_per_s > max(p.tokens_per_s for p in even)


def test_the_search_table_shows_every_choice_that_differs_between_rows():
    """Two rows of `--search` never read alike unless their strategies are alike: the shard
    group, the split, sequence parallelism, the reduction dtype and any other key that differs
    are written. Mutation: the shard group left out of the row -> rows 1 and 2 of the 405B
    search (the same but for hybrid sharding) read alike."""
    from tenfold.plan.report import _layout, varying_keys

    best = _llama3_405b_search(12).best
    assert len({p.strategy["shard_group"] for p in best}) > 1
    varying = varying_keys(best)
    for i, a in enumerate(best):
        for b in best[i + 1:]:
            if a.strategy != b.strategy:
                assert _layout(a, varying) != _layout(b, varying), (a.strategy, b.strategy)
    assert any("shard-group=" in _layout(p, varying) and "split=" in _layout(p, varying) for p in best)
    # choices the row's compact form writes only when they are not the default, and one it never writes
    p = best[0]
    for key, other in (("reduce_dtype", "bf16"), ("sequence_parallel", False), ("precision", "fp32"),
                       ("stage_layers", [0] * len(p.strategy["stage_layers"]))):
        q = replace(p, strategy={**p.strategy, key: other})
        v = varying_keys([p, q])
        assert v == {key} and _layout(p, v) != _layout(q, v), key


# --------------------------------------------------------------------------- offload, TP, memory, peaks
def test_offload_zero1_keeps_the_16_bit_gradients_on_the_gpu():
    # 128 accumulated micro-batches at ZeRO-1: each rank holds its stage's full 16-bit gradients.
    s = planned("llama-70b", 64, precision="bf16", tp=2, pp=4, zero_stage=1, offload="optimizer", micro_batch=1,
                global_batch=1024, sequence_parallel=False, stack=deepspeed_stack())
    m = predict_memory(s.with_(tp=1, pp=8, check=False), "h100-sxm")
    stage_params = m.params_bytes / 2  # 16-bit parameters, whole on every dp rank at ZeRO-1
    assert stage_params == pytest.approx(9.4e9, rel=0.02)  # the most loaded stage: 10 of the 80 blocks
    assert m.grads_bytes == 2 * stage_params
    assert m.optimizer_bytes == 0 and m.cpu_bytes == pytest.approx(16 * stage_params / 8)
    # ZeRO-1 under tensor parallelism runs as stage 2 (FSDP2), which ships each partition too.
    assert predict_memory(s, "h100-sxm").grads_bytes == 0
    z2 = predict_memory(s.with_(zero_stage=2, tp=1, pp=8, check=False), "h100-sxm")
    assert z2.grads_bytes == 0  # ZeRO-2 ships each micro-batch's partition to the host


def test_offload_zero2_ships_gradients_every_micro_batch():
    slow = replace(CATALOG["a100-80gb"], host_link_bw=1e9)  # 1 GB/s host link makes the traffic visible
    s = planned("gpt3-1.3b", 8, precision="bf16", zero_stage=2, offload="optimizer", micro_batch=1, grad_accum=4,
                seq_len=2048, stack=deepspeed_stack())
    p = predict(s, slow)
    bwd = (p.time.compute_s / 4) * 2 / 3  # backward = 2/3 of forward + backward
    grads = 2.0 * p.params / 8  # the rank's 16-bit partition per micro-batch
    assert p.time.host_transfer_s == pytest.approx(4 * (grads / 1e9 - bwd), rel=0.02)
    assert predict(s.with_(zero_stage=1, check=False), slow).time.host_transfer_s == 0


def test_search_prices_offload_where_the_engine_has_it():
    """GPT-3 13B on 8 A100-40GB: the default search ranks offloaded layouts train runs (ZeRO-2/3
    through FSDP2; below the pipelined layouts, which fit without offload), each with its host memory priced and only where the same layout does not fit
    without offload (the fitting ones' offloaded twins are skipped as dominated); offload at
    ZeRO-1 is ranked only with include_unsupported, marked.
    Mutations: "optimizer" out of OFFLOAD_CHOICES or of capabilities.ENGINE.offload -> no
    offloaded row; the dominance rule dropped -> an offloaded twin of a fitting layout ranked."""
    from tenfold.plan.api import _fits

    hw = CATALOG["a100-40gb"]
    base = planned("gpt3-13b", 8, precision="bf16", global_batch=64, seq_len=2048)
    result = search(base, hw, top_k=200)
    offloaded = [p for p in result.best if p.strategy["offload"] != "none"]
    assert offloaded and result.dominated > 0
    for p in offloaded:
        assert p.strategy["zero_stage"] in (2, 3) and not p.unsupported and p.memory.cpu_bytes > 0
        assert not _fits(predict_memory(p.run.with_(offload="none", check=False), hw), hw, 8)
    res = search(base, hw, top_k=200, include_unsupported=True)
    offloaded = [p for p in res.best if p.strategy["offload"] == "optimizer"]
    # train offloads on FSDP2: at ZeRO-2/3, not at ZeRO-1
    assert any(p.strategy["zero_stage"] == 1 for p in offloaded)
    assert all(("offload 'optimizer'" in " ".join(p.unsupported)) == (p.strategy["zero_stage"] < 2) for p in offloaded)


def test_the_two_offload_values_are_priced_as_the_engine_runs_them():
    """tenfold's engine (fp32 parameters, FSDP2), Llama-7B ZeRO-3 on 8 GPUs: `optimizer`
    (HostAdamW) keeps the parameter and gradient shards on the device and holds the moments and
    the update's two buffers on the host, moving 12 bytes per parameter of the shard at the step
    and nothing per micro-batch; `optimizer+params` (CPUOffloadPolicy) keeps no model state on
    the device and moves the shard up for every all-gather and its gradient down after every
    reduce-scatter. Mutation: both priced as one -> the device states and the traffic agree."""
    slow = replace(A100, host_link_bw=1e9)  # 1 GB/s: the host traffic shows
    run = planned("llama-7b", 8, precision="bf16", zero_stage=3, micro_batch=1, grad_accum=4, seq_len=2048)
    none, opt, both = (predict(run.with_(offload=o, check=False), slow) for o in ("none", "optimizer", "optimizer+params"))
    shard = none.params / 8
    assert (opt.memory.params_bytes, opt.memory.grads_bytes) == (none.memory.params_bytes, none.memory.grads_bytes)
    assert opt.memory.optimizer_bytes == 0 < none.memory.optimizer_bytes
    assert both.memory.params_bytes == both.memory.grads_bytes == both.memory.optimizer_bytes == 0
    assert opt.memory.cpu_bytes == pytest.approx(16 * shard, rel=1e-3) and both.memory.cpu_bytes == opt.memory.cpu_bytes
    assert opt.time.host_transfer_s == 0 < both.time.host_transfer_s
    assert opt.time.optimizer_s - none.time.optimizer_s > 12 * shard / 1e9  # the step's copies, plus the host's Adam


def test_tp_must_split_the_heads_and_the_vocabulary():
    assert tp_choices(64, 8) == [1, 2, 4, 8]
    assert tp_choices(96) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    assert tp_choices(96, None, 50257) == [1]  # GPT-2's BPE vocabulary splits over no tp > 1
    assert tp_choices(96, None, 50304) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]  # GPT-3's, padded
    # 16 GPUs per node would allow TP 16, but 8 KV heads cannot be split 16 ways.
    result = search(planned("llama-70b", 64, global_batch=64, seq_len=4096), "h100-sxm", top_k=200, gpus_per_node=16,
                    include_unsupported=True)
    assert result.best and all(p.strategy["tp"] <= 8 for p in result.best)
    assert any(p.strategy["tp"] == 8 for p in result.best)  # the limit is the KV heads, not the search


def test_default_activation_accounting_holds_the_fp32_loss_tensors():
    cfg = PRESETS["llama-7b"]
    b, s, V = 1, 4096, cfg.vocab_size
    default = memory.final_layer_activation_bytes(cfg, planned(cfg, micro_batch=b, seq_len=s))
    megatron = memory.final_layer_activation_bytes(cfg, planned(cfg, micro_batch=b, seq_len=s,
                                                                stack=Stack(activation_style="megatron")))
    assert Stack().activation_style == "tenfold"
    # the loss at the start of its backward: fp32 log-probabilities, their gradient and the
    # logits' gradient (12 b s V); + the final RMSNorm: its fp32 input, fp32 x*rsqrt and 1/rms,
    # and its 16-bit output for the head
    assert default - 12 * b * s * V == pytest.approx((4 + 4 + 2) * b * s * cfg.d_model + 4 * b * s)
    assert megatron - 4 * b * s * V == pytest.approx(2 * 2 * b * s * cfg.d_model)


def test_gemm_ceiling_is_a_share_of_the_measured_best_matmul():
    assert CATALOG["a100-80gb"].gemm_efficiency == pytest.approx(GEMM_SHARE_OF_MAMF * 271.2 / 312)
    assert CATALOG["h100-sxm"].gemm_efficiency == pytest.approx(GEMM_SHARE_OF_MAMF * 794.5 / 989)
    assert CATALOG["b200"].gemm_efficiency == pytest.approx(GEMM_SHARE_OF_MAMF * 1745.0 / 2250)
    for name, hw in CATALOG.items():
        for key in ("peak", "memory", "intra", "nic", "sms", "host", "matmul"):
            assert hw.sources.get(key), (name, key)
