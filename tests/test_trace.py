"""The planner held to the run: `tenfold plan --trace` runs the engine's set-up and one optimizer
step on fake tensors over a fake world (tenfold.engine.preview.trace), and each per-rank memory term the
planner predicts must match the traced one within MEMORY_TOLERANCE. A term that misses and
could not be closed is listed in KNOWN_MISSES with the reason (strict xfail: it must still miss;
when it is fixed, the entry goes)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from conftest import HERE

MEMORY_TOLERANCE = 0.03  # |planned - traced| / traced
SHAPE = ["--set", "model.n_layers=4", "--set", "model.d_model=64", "--set", "model.n_heads=4", "--set", "model.d_ff=128",
         "--set", "model.max_seq_len=64", "--set", "model.vocab_size=256", "--seq-len", "32"]
# a mixture-of-experts variant of the small model: 4 routed experts (top 2) and a shared one per block
MOE = ["--set", "model.n_experts=4", "--set", "model.experts_per_token=2", "--set", "model.n_shared_experts=1"]
# GPT-3's blocks on the small model: LayerNorm, GELU, learned positions, biases, tied embeddings
GPT3_BLOCKS = ["--set", "model.norm=layernorm", "--set", "model.mlp=gelu", "--set", "model.pos=learned",
               "--set", "model.bias=true", "--set", "model.tie_embeddings=true"]
# name -> the flags of `tenfold plan` (the world is --gpus)
CASES = {
    "zero3": ["--zero", "3", "--gpus", "8"],
    "zero3_resharded": ["--zero", "3", "--gpus", "8", "--set", "parallel.param_persistence_threshold=0"],
    "zero2": ["--zero", "2", "--gpus", "8"],
    "zero2_accumulation": ["--zero", "2", "--gpus", "8", "--grad-accum", "2"],
    "hsdp": ["--zero", "3", "--gpus", "16", "--shard-group", "4"],
    "tp2_zero1": ["--zero", "1", "--gpus", "8", "--tp", "2"],
    "tp2_sequence_parallel": ["--zero", "3", "--gpus", "8", "--tp", "2", "--sequence-parallel"],
    "tp2_without_sequence_parallel": ["--zero", "3", "--gpus", "8", "--tp", "2", "--no-sequence-parallel"],
    "gpt3_blocks_tp2": ["--zero", "2", "--gpus", "8", "--tp", "2", *GPT3_BLOCKS],
    # the tied embedding on both ends of the pipeline, split over the vocabulary
    "gpt3_blocks_pp2_tp2": ["--zero", "2", "--gpus", "8", "--tp", "2", "--pp", "2", "--grad-accum", "4", *GPT3_BLOCKS],
    # Hugging Face Llama (its own RMSNorm and rotary code): ZeRO-3, tp 2, and tied embeddings over pp 2
    "hf_llama_zero3": ["--zero", "3", "--gpus", "8", "--hf-config", "tests/data/llama-tiny/config.json"],
    "hf_llama_tp2": ["--zero", "3", "--gpus", "8", "--tp", "2", "--hf-config", "tests/data/llama-tiny/config.json"],
    "hf_llama_tied_pp2": ["--zero", "3", "--gpus", "8", "--pp", "2", "--grad-accum", "4",
                          "--hf-config", "tests/data/llama-tied-tiny/config.json"],
    "pp2_zero3": ["--zero", "3", "--gpus", "8", "--pp", "2", "--grad-accum", "4"],
    # 8 blocks on 4 stages: the plan's most loaded rank is a middle one (rank 1: blocks only, a
    # receive buffer per micro-batch each way), where the trace meets every term
    "pp4_zero3_middle": ["--zero", "3", "--gpus", "8", "--pp", "4", "--grad-accum", "8", "--set", "model.n_layers=8"],
    # multi-stage schedules: 4 stages on 2 pipeline ranks (rank 0 holds stages 0 and 2)
    "pp2_interleaved_zero3": ["--zero", "3", "--gpus", "8", "--pp", "2", "--pp-schedule", "interleaved",
                              "--virtual-stages", "2", "--grad-accum", "4"],
    "pp2_zero_bubble_zero3": ["--zero", "3", "--gpus", "8", "--pp", "2", "--pp-schedule", "zero-bubble",
                              "--virtual-stages", "2", "--grad-accum", "4"],
    "recompute_full": ["--zero", "3", "--gpus", "8", "--ac", "full"],
    "recompute_selective": ["--zero", "3", "--gpus", "8", "--ac", "selective"],
    "recompute_op": ["--zero", "3", "--gpus", "8", "--ac", "op"],
    "recompute_op_tp2": ["--zero", "3", "--gpus", "8", "--tp", "2", "--ac", "op"],
    "fp32": ["--zero", "3", "--gpus", "8", "--precision", "fp32"],
    "one_process": ["--gpus", "1"],
    "offload_optimizer": ["--zero", "2", "--gpus", "8", "--offload", "optimizer"],
    "cp2_zero3": ["--zero", "3", "--gpus", "4", "--cp", "2"],  # dp 2 x cp 2: each sequence split over 2 ranks
    "ep2_moe": ["--zero", "3", "--gpus", "8", "--ep", "2", *MOE],
    "ep4_moe_zero2": ["--zero", "2", "--gpus", "8", "--ep", "4", *MOE],
    "ep2_moe_recompute_full": ["--zero", "3", "--gpus", "8", "--ep", "2", "--ac", "full", *MOE],
}
EP_CASES = ("ep2_moe", "ep4_moe_zero2", "ep2_moe_recompute_full")
TERMS = ("params_bytes", "grads_bytes", "optimizer_bytes", "gathered_params_bytes", "activations_bytes", "peak_bytes")

KNOWN_MISSES = {
    ("pp2_zero_bubble_zero3", "grads_bytes"):
        "zero-bubble runs a block's weight gradients apart from its input gradients, later: the traced high holds two "
        "blocks' 16-bit gradients beside the unsharded fp32 ones, the plan one: -14.7%",
    ("pp2_zero_bubble_zero3", "activations_bytes"):
        "the plan prices zero-bubble's micro-batches in flight as interleaved 1F1B's; the deferred weight "
        "gradients keep their inputs longer: -7.6%",
    ("pp2_zero_bubble_zero3", "peak_bytes"): "follows the gradient and activation misses: -7.3%",
    ("recompute_full", "peak_bytes"):
        "the high falls in a block's recomputed backward, where the units above it have reduce-scattered their "
        "gradients and a reduce-scatter buffer is live; the plan prices the start of the backward: -4.4%",
    ("offload_optimizer", "optimizer_bytes"):
        "HostAdamW keeps its states in host memory (the plan's cpu_bytes, 0 on the device); the trace runs on the CPU, "
        "where host and device are one",
    ("ep2_moe_recompute_full", "activations_bytes"):
        "an MoE block's recomputed backward: the plan adds the routed experts' and the shared expert's temporaries to "
        "the whole block's activations, the traced high holds less of them at once: +4.2%",
}


def plan_trace(flags: list[str]) -> dict:
    """`tenfold plan --trace --json` of the small model (or of the Hugging Face config `flags`
    names) on a fleet of `flags`: its `trace`."""
    model = ["--seq-len", "32"] if "--hf-config" in flags else ["--model", "tiny", *SHAPE]
    cmd = [sys.executable, "-m", "tenfold", "plan", *model, "--gpu", "h100-sxm", "--trace", "--json", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["trace"]


@functools.cache
def traced(case: str) -> dict:
    """One case's trace, run once and shared by its terms."""
    return plan_trace(CASES[case])


def _params():
    for case in CASES:
        for term in TERMS:
            why = KNOWN_MISSES.get((case, term))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            yield pytest.param(case, term, id=f"{case}-{term.removesuffix('_bytes')}", marks=marks)


@pytest.mark.parametrize("case,term", list(_params()))
def test_planned_memory_term_matches_the_trace(case, term):
    row = traced(case)["memory"][term]
    planned, measured = row["planned"], row["traced"]
    assert measured is not None and planned is not None
    assert abs(planned - measured) <= MEMORY_TOLERANCE * max(measured, 1), (
        f"{case} {term}: planned {planned}, traced {measured} ({row['diff_percent']}%)")


def test_known_misses_name_real_cases():
    assert {case for case, _ in KNOWN_MISSES} <= set(CASES)
    assert {term for _, term in KNOWN_MISSES} <= set(TERMS)


def test_the_traced_pipeline_holds_a_receive_buffer_per_micro_batch():
    """1F1B on 2 stages, 4 micro-batches of b x s x h bf16: the first stage holds 4 buffers for
    its output's gradient, the last 4 for its input (PipelineStage makes them at the first step
    and keeps them), all within the traced activations, as the plan prices them."""
    out = traced("pp2_zero3")
    one = 8 * 32 * 64 * 2
    for stage in out["stages"]:
        m = stage["memory"]
        assert m["receive_buffer_bytes"] == 4 * one, stage["stage"]
        assert m["activations_bytes"] > m["receive_buffer_bytes"]


def test_trace_records_the_fsdp2_collectives_of_the_full_world():
    """ZeRO-3 on 8 ranks: the reduce-scatters run on groups of 8 and carry each rank's whole
    unsharded gradient (8 x its shard) per micro-batch, and the all-gathers gather the
    16-bit parameters; nothing runs on a group of another size (the fake world is the full one)."""
    out = traced("zero3")
    kinds = {(c["kind"], c["group_size"]) for c in out["collectives"]}
    assert ("reduce_scatter", 8) in kinds and ("all_gather", 8) in kinds
    assert {size for _, size in kinds} == {8}
    rs = next(c for c in out["collectives"] if c["kind"] == "reduce_scatter")
    grads = out["memory"]["grads_bytes"]["traced"]
    assert rs["payload_bytes"] == 8 * grads  # fp32 reduce of the whole unsharded gradient, once (one micro-batch)


def test_pipelined_unsharded_gradients_are_traced_as_gradients():
    """Under pipelining FSDP2 holds every micro-batch's gradient unsharded, in fp32, until one
    reduce-scatter at the end of the step: the trace files them as gradients (the plan's grads
    term: the fp32 ones and one block's bf16 ones before they are added in), not as
    activations, and reduces each once per step."""
    out = traced("pp4_zero3_middle")
    grads, acts = out["memory"]["grads_bytes"], out["memory"]["activations_bytes"]
    assert grads["traced"] == pytest.approx(grads["planned"], rel=0.01)
    assert acts["traced"] == pytest.approx(acts["planned"], rel=0.10)
    rs = next(c for c in out["collectives"] if c["kind"] == "reduce_scatter")
    assert rs["payload_bytes"] == pytest.approx(out["memory"]["params_bytes"]["traced"] * out["layout"]["dp"], rel=0.01)


def test_pipelined_gradient_casts_and_reduce_buffers_are_not_traced_as_activations():
    """pp 2 under ZeRO-2 with full recompute, wide blocks on 8 tokens (a stage's fp32 gradients
    far above its activations): FSDP2's post-backward casts each unsharded gradient to fp32 at
    its first micro-batch, and reduce-scatters them at the last; the trace files the casts as
    gradients and the reduce-scatter's buffers as communication buffers as they are made, so
    the traced activation high-water mark (the saved block inputs, the stage's all-gather
    buffers) stays below the stage's fp32 gradients. Mutation: filed after the post-backward
    (tensor_tracker.file_unsharded_grads_as_gradients) -> 12.6 MB against 8.7 MB of gradients."""
    out = plan_trace(["--set", "model.d_model=256", "--set", "model.d_ff=1024", "--seq-len", "8", "--zero", "2",
                      "--gpus", "4", "--pp", "2", "--ac", "full", "--micro-batch", "1", "--grad-accum", "4"])
    memory = out["memory"]
    fp32_grads = memory["params_bytes"]["traced"] * out["layout"]["dp"]  # the stage's unsharded fp32 gradients
    assert memory["grads_bytes"]["traced"] >= fp32_grads
    for stage in out["stages"]:
        assert 0 < stage["memory"]["activations_bytes"] < fp32_grads, stage


def test_trace_refuses_a_ddp_layout_with_the_reason():
    cmd = [sys.executable, "-m", "tenfold", "plan", "--model", "tiny", *SHAPE, "--gpu", "h100-sxm", "--trace",
           "--zero", "1", "--gpus", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent, timeout=600)
    assert proc.returncode == 2
    assert "DDP" in proc.stderr and "--zero 2 or 3" in proc.stderr


COLLECTIVE_TOLERANCE = 0.01  # |planned - traced| / traced, bytes one rank sends per step
TP_CASES = {  # tensor parallelism alone: every traced collective of a group > 1 is the planner's tp traffic
    "tp2_sp": ["--tp", "2", "--gpus", "2", "--sequence-parallel"],
    "tp2_no_sp": ["--tp", "2", "--gpus", "2", "--no-sequence-parallel"],
    "tp4_sp_recompute_full": ["--tp", "4", "--gpus", "4", "--sequence-parallel", "--ac", "full"],
    "tp2_fp32_accumulation": ["--tp", "2", "--gpus", "2", "--precision", "fp32", "--micro-batch", "2",
                              "--global-batch", "8"],
}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_planned_tensor_parallel_bytes_match_the_trace(case):
    traffic = plan_trace(TP_CASES[case])["traffic"]
    assert traffic["traced"] > 0
    assert abs(traffic["planned"] - traffic["traced"]) <= COLLECTIVE_TOLERANCE * traffic["traced"], traffic


# layouts whose data-parallel traffic the planner states for the traced rank (no pipeline: it
# states the slowest stage's; ep and cp reduce over groups of their own)
DP_CASES = [c for c, flags in CASES.items()
            if not {"--pp", "--ep", "--cp"} & set(flags) and flags[flags.index("--gpus") + 1] != "1"]


@pytest.mark.parametrize("case", DP_CASES)
def test_planned_data_parallel_bytes_match_the_trace(case):
    """What a rank sends per step on its data-parallel groups (FSDP2's all-gathers and
    reduce-scatters, hybrid sharding's all-reduce across the replicas), planned
    (plan/dp_time.py `dp_step_bytes`, the gathers and reductions the time model prices) against
    the traced collectives on the dp groups. Mutation: every ZeRO-3 block gathered again for its
    backward (persistent blocks, the last block and the root included) -> +33% on `zero3`."""
    dp = traced(case)["dp_traffic"]
    assert dp["traced"] > 0
    assert abs(dp["planned"] - dp["traced"]) <= COLLECTIVE_TOLERANCE * dp["traced"], dp


def test_planned_context_parallel_bytes_match_the_trace():
    """dp 2 x cp 2 under ZeRO-3: the cp attention's K/V all-gathers (forward) and the
    reduce-scatters of their gradients (backward) run on the cp group (2 ranks), apart from
    FSDP2's collectives on the 4 dp x cp ranks, and their ring bytes per step are the planner's
    (plan/cp_traffic.py) within COLLECTIVE_TOLERANCE. Mutation: the gradient all-reduced as on
    gloo -> twice the bytes."""
    out = traced("cp2_zero3")
    assert (out["layout"]["dp"], out["layout"]["cp"], out["batch"]["dp"]) == (2, 2, 2)
    on_cp = {c["kind"] for c in out["collectives"] if c["group"] == "cp"}
    assert on_cp == {"all_gather", "reduce_scatter"} and all(
        c["group_size"] == 2 for c in out["collectives"] if c["group"] == "cp")
    assert {c["group_size"] for c in out["collectives"] if c["group"] == "dp"} == {4}
    traffic = out["cp_traffic"]
    assert traffic["traced"] > 0
    assert abs(traffic["planned"] - traffic["traced"]) <= COLLECTIVE_TOLERANCE * traffic["traced"], traffic


def test_trace_records_the_all_to_alls_on_their_own_group():
    """ep 2 of 8 dp ranks: every all-to-all runs on the "ep" group of 2 ranks, 4 per MoE block
    (dispatch and combine, forward and backward) plus the split sizes' exchange in each forward;
    the experts' gradients are all-reduced over the 4 ranks holding the same experts
    ("dp_mod_ep"), the rest reduce-scattered over all 8 dp ranks."""
    out = traced("ep2_moe")
    a2a = [c for c in out["collectives"] if c["kind"] == "all_to_all"]
    assert [(c["group"], c["group_size"], c["count"]) for c in a2a] == [("ep", 2, 4 * (4 + 1))]
    groups = {(c["kind"], c["group"], c["group_size"]) for c in out["collectives"]}
    assert ("all_reduce", "dp_mod_ep", 4) in groups and ("reduce_scatter", "dp", 8) in groups
    assert out["layout"]["ep"] == 2


@pytest.mark.parametrize("case", EP_CASES)
def test_planned_all_to_all_bytes_match_the_trace(case):
    """The planner's all-to-all bytes per rank and step (tenfold.plan.moe: b s k d per dispatch or
    combine, (ep-1)/ep leaving the rank, 2 more per recomputed block) against the traced ones
    (which also carry the split sizes' exchange)."""
    a2a = traced(case)["all_to_all"]
    assert a2a["traced"] > 0
    assert abs(a2a["planned"] - a2a["traced"]) <= COLLECTIVE_TOLERANCE * a2a["traced"], a2a


def test_trace_refuses_a_moe_model_outside_bf16_with_the_reason():
    cmd = [sys.executable, "-m", "tenfold", "plan", "--model", "tiny", *SHAPE, *MOE, "--gpu", "h100-sxm", "--trace",
           "--zero", "3", "--gpus", "8", "--ep", "2", "--precision", "fp32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent, timeout=600)
    assert proc.returncode == 2
    assert "bf16" in proc.stderr and "torch._grouped_mm" in proc.stderr


def test_pipelined_context_parallel_stages_send_the_local_sequence():
    """pp 2 x cp 2 under ZeRO-3: rank 0 (the first stage) sends each micro-batch's part of the
    residual stream, s/cp tokens (b x s/cp x d, bf16), to the next stage and receives as much
    back, and its cp group's K/V bytes are the planner's. Mutation: the stages' p2p metadata at
    the whole sequence -> the first stage's backward receives a (b, s, d) gradient for its
    (b, s/cp, d) output and the step fails."""
    out = plan_trace(["--zero", "3", "--gpus", "4", "--cp", "2", "--pp", "2", "--grad-accum", "2"])
    assert (out["layout"]["pp"], out["layout"]["cp"], out["layout"]["dp"]) == (2, 2, 1)
    b, m, s = out["batch"]["micro_batch"], out["batch"]["grad_accum"], out["batch"]["seq_len"]
    for kind in ("send", "recv"):
        p2p = next(c for c in out["collectives"] if c["kind"] == kind and c["group"] == "pp")
        assert (p2p["count"], p2p["payload_bytes"]) == (m, m * b * (s // 2) * 64 * 2), p2p
    traffic = out["cp_traffic"]
    assert traffic["traced"] > 0
    assert abs(traffic["planned"] - traffic["traced"]) <= COLLECTIVE_TOLERANCE * traffic["traced"], traffic


@pytest.mark.parametrize("case", ["pp2_interleaved_zero3", "pp2_zero_bubble_zero3"])
def test_multi_stage_rank_runs_both_of_its_stages(case):
    """pp 2 with 2 stages per rank (4 stages): rank 0 holds stages 0 and 2, so its parameters are
    both stages' (the plan's, exactly), and per micro-batch it sends stage 0's output and stage
    2's output forward and stage 2's input gradient back (3 sends of b x s x d bf16; stage 0 sends
    no gradient), receiving as many."""
    out = traced(case)
    assert out["memory"]["params_bytes"]["traced"] == out["memory"]["params_bytes"]["planned"]
    b, m, s = out["batch"]["micro_batch"], out["batch"]["grad_accum"], out["batch"]["seq_len"]
    for kind in ("send", "recv"):
        p2p = next(c for c in out["collectives"] if c["kind"] == kind and c["group"] == "pp")
        assert (p2p["count"], p2p["payload_bytes"]) == (3 * m, 3 * m * b * s * 64 * 2), p2p

