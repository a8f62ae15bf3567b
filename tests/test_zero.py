"""ZeRO stages 0-3 (techniques/zero.py) on gloo: equivalence with one process, per-rank
model-state memory 1/N, the global fp16 overflow vote.

The ranks run tests/workers/zero_worker.py under `python -m torch.distributed.run` (the
Trainer, the data engineer's GlobalBatchLoader, the memory engineer's measure_step_memory);
the single-process reference runs in this pytest process with the SAME global batch
(micro 2 x accum 2 on one rank == micro 1 x accum 2 x dp 2).

Tolerances: fp32 rel 1e-5 on every step's loss (measured ~1e-7: only the order of the
fp32 reductions differs). bf16 rel 2e-3: autocast rounds the matmul inputs to bf16 (8-bit
mantissa, 2^-8 = 3.9e-3 per element); the ranks see half the batch each, so the rounding
of the summed gradients differs between runs and drifts over 4 updates at lr 1e-2.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from conftest import BF16_RTOL, FP32_RTOL, rel_err, torchrun  # noqa: E402
from workers import zero_worker as worker  # noqa: E402

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return torchrun("equivalence", tmp_path_factory.mktemp("zero2"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, same global batch: micro 2 x accum 2."""
    out = str(tmp_path_factory.mktemp("ref"))
    return {dtype: worker.run_steps(worker.config(0, dtype, 2, 2, out), measure_at=None)[1]
            for dtype in ("fp32", "bf16")}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype,rtol", [("fp32", FP32_RTOL), ("bf16", BF16_RTOL)])
def test_stage_on_two_ranks_matches_one_process(two_ranks, reference, stage, dtype, rtol):
    ref = reference[dtype]["losses"]
    for rank in ("0", "1"):
        got = two_ranks[rank][f"{stage}-{dtype}"]
        assert rel_err(got["losses"], ref) < rtol, (got["losses"], ref)
        # the clipped-norm path: the global norm over shards equals the one-process norm
        assert rel_err(got["grad_norms"], reference[dtype]["grad_norms"]) < max(rtol, 1e-5) * 10
    assert ref[-1] < ref[0] - 0.5  # it learns: a wrong gradient would show in the curve


@pytest.fixture(scope="module")
def reduce_dtypes(tmp_path_factory):
    return torchrun("reduce_dtype", tmp_path_factory.mktemp("reduce_dtype"))


def gradient_reductions(run: dict) -> dict[str, int]:
    """{dtype: elements} the backend reduced in the last step, gradient buckets and units only:
    this model's are >= 16k elements; tenfold's own reductions (token count, the clipping
    norm's per-tensor sums) have <= 21."""
    out: dict[str, int] = {}
    for _name, dtype, numel in run["reductions"]:
        if numel >= 1024:
            out[dtype] = out.get(dtype, 0) + numel
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_deepspeed_communication_data_type_bf16_reduces_in_bf16(reduce_dtypes, stage, dtype):
    """What gloo itself reduced in one step (torch.profiler's `gloo:all_reduce` events: DDP's C++
    bucket all-reduce, the comm hook's, FSDP2's reduce-scatter, which gloo runs as an
    all-reduce): every gradient element once per reduction, in fp32 by default (also in bf16
    training: FSDP2 upcasts the bf16 gradients), in bf16 with a DeepSpeed JSON's
    `communication_data_type: bf16` read as `--deepspeed` reads it.
    Mutations: the JSON key ignored, `reduce_dtype_of` always fp32, the DDP hook not
    registered -> bf16 runs reduce in fp32; a reduce dtype of bf16 by default -> the default fails."""
    from tenfold.models.presets import param_count

    reductions = 1 if stage <= 1 else 2  # DDP once per step; FSDP2 on each of the 2 micro-steps
    expected = param_count(worker_model_config()) * reductions
    for rank in ("0", "1"):
        assert gradient_reductions(reduce_dtypes[rank][f"{stage}-{dtype}"]) == {"float": expected}
        assert gradient_reductions(reduce_dtypes[rank][f"{stage}-{dtype}-ds-bf16"]) == {"c10::BFloat16": expected}


# bf16 reduction: every partial sum rounded to bf16 (2^-9 relative per element). Measured
# against one process: fp32 training 1.9e-4 on the loss, 3.7e-3 on the gradient norm;
# bf16 training 9.3e-4 / 6.6e-3 (the bf16 default: 8.7e-4 / 1.5e-2).
BF16_REDUCE_RTOL = {"fp32": (1e-3, 1e-2), "bf16": (BF16_RTOL, 2e-2)}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_bf16_reduction_on_two_ranks_stays_close_to_one_process(reduce_dtypes, reference, stage, dtype):
    """Mutations: the DDP hook leaving out the all-reduce's result (each rank keeps its own
    half-batch gradient) or its division by the group size, FSDP2 reducing nothing -> fail."""
    loss_rtol, norm_rtol = BF16_REDUCE_RTOL[dtype]
    for rank in ("0", "1"):
        got = reduce_dtypes[rank][f"{stage}-{dtype}-ds-bf16"]
        assert rel_err(got["losses"], reference[dtype]["losses"]) < loss_rtol, (got["losses"], reference[dtype])
        assert rel_err(got["grad_norms"], reference[dtype]["grad_norms"]) < norm_rtol


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_full_recompute_under_fsdp2_matches_one_process(two_ranks, reference, stage):
    """--ac full + ZeRO-2/3: checkpointed blocks re-gather their parameters in the recompute."""
    for rank in ("0", "1"):
        assert rel_err(two_ranks[rank][f"{stage}-fp32-ac"]["losses"], reference["fp32"]["losses"]) < FP32_RTOL


def test_unmapped_deepspeed_knobs_are_named_in_one_warning():
    from tenfold.engine.parallel.distributed import DistInfo as Dist  # rank 0 of one process
    from tenfold.techniques.zero import _warn_unmapped_knobs

    cfg = _Cfg(reduce_bucket_size=5e8, overlap_comm=False, contiguous_gradients=False)
    with pytest.warns(UserWarning) as record:
        _warn_unmapped_knobs(cfg, 3, Dist())
    assert len(record) == 1
    text = str(record[0].message)
    assert "reduce_bucket_size" in text and "overlap_comm=false" in text and "contiguous_gradients=false" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_unmapped_knobs(_Cfg(reduce_bucket_size=5e8), 1, Dist())  # DDP has bucket_cap_mb: no warning
        _warn_unmapped_knobs(_Cfg(reduce_bucket_size=5e8), 2, Dist())  # ZeRO-2: FSDP2 units of that size


@pytest.mark.slow
def test_collectives_per_step(two_ranks):
    """The communication of one steady-state step (micro 1 x accum 2 per rank, 2 blocks +
    the root). ZeRO-1: one broadcast of updated parameters per rank (flat buckets), not one
    per parameter tensor. ZeRO-2 on CPU: both blocks in one FSDP2 unit (a 25 MiB bucket of
    fp32 gradients), so 2 units with the root; each all-gathered once per step although two
    micro-steps run (the gathered parameters are kept between them), and reduce-scattered on
    every micro-step. With a 1-element bucket: one unit per block (3 units). ZeRO-3: one unit
    per block, gathered for each forward of every micro-step and again for its backward,
    except the last block and the root, whose backward follows their forward at once (kept
    gathered: persistence threshold 0 frees every other unit after use).
    Mutations: ZeroRedundancyOptimizer without parameters_as_bucket_view broadcasts once per
    parameter tensor; without `_keep_gathered` ZeRO-2 all-gathers twice per unit; without the
    grouping it has 3 units; resharding the last block and the root after forward re-gathers
    them in backward (12 gathers)."""
    micro = 2
    for rank in ("0", "1"):
        c = {s: two_ranks[rank][f"{s}-fp32"]["collectives"] for s in range(4)}
        assert c[1]["broadcast"] == 2, c[1]
        assert c[2]["all_gather_single"] == 2, c[2]
        assert c[2]["reduce_scatter_single"] == 2 * micro, c[2]
        per_block = two_ranks[rank]["2-fp32-per-block"]["collectives"]
        assert per_block["all_gather_single"] == 3 and per_block["reduce_scatter_single"] == 3 * micro, per_block
        assert c[3]["all_gather_single"] == (3 + 1) * micro, c[3]  # forward: root + 2 blocks; backward: block 0
        assert c[3]["reduce_scatter_single"] == 3 * micro, c[3]


@pytest.mark.slow
def test_zero2_one_unit_per_block_matches_one_process(two_ranks, reference):
    for rank in ("0", "1"):
        assert rel_err(two_ranks[rank]["2-fp32-per-block"]["losses"], reference["fp32"]["losses"]) < FP32_RTOL


def test_zero2_groups_consecutive_blocks_up_to_the_bucket():
    from tenfold.techniques.zero import CPU_UNIT_BUCKET, fsdp_units, unit_bucket

    blocks = [torch.nn.Linear(10, 10) for _ in range(5)]  # 110 parameters each
    sizes = lambda units: [len(u) for u in units]  # noqa: E731
    assert sizes(fsdp_units(blocks, 2, 230)) == [2, 2, 1]
    assert sizes(fsdp_units(blocks, 2, 100)) == [1, 1, 1, 1, 1]  # a block larger than the bucket: alone
    assert sizes(fsdp_units(blocks, 2, None)) == [1] * 5
    assert sizes(fsdp_units(blocks, 3, 10**9)) == [1] * 5  # ZeRO-3 frees block by block
    assert [b for u in fsdp_units(blocks, 2, 230) for b in u] == blocks  # order kept
    assert unit_bucket(_Cfg(), "cpu") == CPU_UNIT_BUCKET == 6_553_600
    assert unit_bucket(_Cfg(), "cuda") is None  # per block: reduce-scatters overlap the backward
    assert unit_bucket(_Cfg(reduce_bucket_size=1000), "cuda") == 1000


@pytest.mark.slow
def test_every_rank_trains_rank0s_initial_weights(two_ranks):
    for stage in ("0", "2", "3"):
        r0, r1 = two_ranks["0"]["init_sync"][stage], two_ranks["1"]["init_sync"][stage]
        assert r0["before"] != r1["before"]  # the ranks did start apart
        assert r0["after"] == pytest.approx(r0["before"], rel=1e-12)
        assert r1["after"] == pytest.approx(r0["before"], rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_fsdp2_bf16_params_with_fp32_shards_match_one_process(two_ranks, reference, stage):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the ranks gather bf16
    copies of fp32 sharded master weights; the one-process reference keeps fp32 weights under
    autocast. Same bf16 tolerance (measured: 9e-4 on the loss)."""
    for rank in ("0", "1"):
        got = two_ranks[rank][f"{stage}-bf16-params"]
        assert rel_err(got["losses"], reference["bf16"]["losses"]) < BF16_RTOL
        # the master weights stay fp32 and sharded: 4 bytes x numel / 2 per rank
        assert got["state_bytes"]["params_bytes"] == two_ranks[rank][f"{stage}-fp32"]["state_bytes"]["params_bytes"]


@pytest.mark.slow
def test_model_states_per_rank_are_one_nth_at_their_stage(two_ranks):
    """Bytes held at the optimizer step on each rank (local shards; ZeRO-1's local states):
    optimizer states halve at stage >= 1, gradients at stage >= 2, parameters at stage 2 and
    3 (FSDP2 reshards after backward at both: docs/zero.md). 'About': ZeRO-1 splits whole
    tensors and FSDP2 pads dim 0 to a multiple of N."""
    for rank in ("0", "1"):
        b = {s: two_ranks[rank][f"{s}-fp32"]["state_bytes"] for s in range(4)}
        full = b[0]
        assert b[1]["optimizer_bytes"] == pytest.approx(full["optimizer_bytes"] / 2, rel=0.05)
        assert b[1]["grads_bytes"] == full["grads_bytes"] and b[1]["params_bytes"] == full["params_bytes"]
        for s in (2, 3):
            for key in ("optimizer_bytes", "grads_bytes", "params_bytes"):
                assert b[s][key] == pytest.approx(full[key] / 2, rel=0.02), (s, key)


@pytest.mark.slow
def test_measured_memory_per_rank_shows_the_sharding(two_ranks):
    """The memory engineer's measure_step_memory on each rank (MemTracker): the optimizer
    states at stage >= 1 and parameters + gradients at stage >= 2 are half of what stage 0
    keeps in parameters (fp32: grads == params in size, Adam states == 2 x params)."""
    for rank in ("0", "1"):
        m = {s: two_ranks[rank][f"{s}-fp32"]["measured"] for s in range(4)}
        params0 = m[0]["params_bytes"]
        # DDP's gradients are views into its buckets, allocated before the tracker starts:
        # they are counted all the same (full size at stages 0 and 1)
        for s in (0, 1):
            assert m[s]["grads_bytes"] == pytest.approx(params0, rel=0.01), s
        assert m[0]["optimizer_bytes"] == pytest.approx(2 * params0, rel=0.01)
        assert m[1]["optimizer_bytes"] == pytest.approx(params0, rel=0.05)
        for s in (2, 3):
            assert m[s]["optimizer_bytes"] == pytest.approx(params0, rel=0.02)
            assert m[s]["grads_bytes"] == pytest.approx(params0 / 2, rel=0.02)
            assert m[s]["params_bytes"] == pytest.approx(params0 / 2, rel=0.02)


@pytest.mark.slow
def test_gathered_parameters_are_measured_and_planned_as_their_own_term(two_ranks):
    """`gathered_params_bytes`, measured on each rank (FSDP2's all-gather output storages filed
    and their all-gather buffers filed as gathered copies, never as activations) and planned:
    nothing under DDP in fp32 (stages 0-1), the whole model in fp32 at ZeRO-2 (every unit stays
    gathered from its forward to its backward) and the buffer of the unit gathered ahead, part
    of it at ZeRO-3 (units gathered one or two at a time); the planner's figure within 2% at
    ZeRO-2; at ZeRO-3 the plan (the root, the block computing and the next one's all-gather
    buffer) exactly, or one block more: on CPU the engine issues FSDP2's gathers as async gloo
    work (techniques/zero.py `_gather_ahead_on_cpu`), and a rank that runs ahead holds the next
    block's copy while the previous one is not yet freed (seen on rank 0 in about one run of
    four, the machine quiet or loaded).
    Mutation: the tracker not filing FSDP2's gathered storages apart -> 0 at ZeRO-2."""
    from tenfold.models.presets import block_param_count, get_preset
    from tenfold.config import build_config
    from tenfold.engine.memory.measure import predicted_memory
    from tenfold.run import resolve_run

    for rank in ("0", "1"):
        m = {s: two_ranks[rank][f"{s}-fp32"]["measured"] for s in range(4)}
        params0 = m[0]["params_bytes"]
        planned = {s: predicted_memory(resolve_run(build_config(worker.config(s, "fp32", 1, 2, ".")), 2))["gathered_params_bytes"]
                   for s in range(4)}
        assert m[0]["gathered_params_bytes"] == m[1]["gathered_params_bytes"] == planned[0] == planned[1] == 0
        # ZeRO-2: the whole model, and the all-gather buffer of the unit gathered ahead (on CPU the
        # blocks form one unit up to the bucket, so the buffer holds them all)
        assert params0 < m[2]["gathered_params_bytes"] < 2 * params0
        assert m[2]["gathered_params_bytes"] == pytest.approx(planned[2], rel=0.02), (m[2], planned[2])
        assert 0 < m[3]["gathered_params_bytes"] < m[2]["gathered_params_bytes"]
        shape = {k: v for k, v in worker.MODEL.items() if k != "name"}
        block = 4 * block_param_count(get_preset("tiny").with_overrides(**shape))  # fp32
        assert m[3]["gathered_params_bytes"] in (planned[3], planned[3] + block), (m[3], planned[3], block)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_four_ranks_hold_a_quarter(tmp_path):
    four = torchrun("memory", tmp_path, nproc=4, timeout=400)
    for rank in map(str, range(4)):
        b = {int(s): v["state_bytes"] for s, v in four[rank].items()}
        assert b[1]["optimizer_bytes"] == pytest.approx(b[0]["optimizer_bytes"] / 4, rel=0.15)
        assert b[2]["grads_bytes"] == pytest.approx(b[0]["grads_bytes"] / 4, rel=0.03)
        assert b[3]["params_bytes"] == pytest.approx(b[0]["params_bytes"] / 4, rel=0.03)
        m = {int(s): v["measured"] for s, v in four[rank].items()}
        assert m[3]["params_bytes"] == pytest.approx(m[0]["params_bytes"] / 4, rel=0.03)
        assert m[3]["optimizer_bytes"] == pytest.approx(m[0]["optimizer_bytes"] / 4, rel=0.03)
    # every rank ran the same steps
    losses = {tuple(four[r]["3"]["losses"]) for r in map(str, range(4))}
    assert len(losses) == 1


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(two_ranks):
    for stage in ("0", "3"):
        r0, r1 = two_ranks["0"]["fp16_overflow"][stage], two_ranks["1"]["fp16_overflow"][stage]
        assert [s["skipped"] for s in r0] == [False, True, False], r0
        assert [s["skipped"] for s in r1] == [False, True, False], r1
        assert [s["scale"] for s in r0] == [s["scale"] for s in r1]  # identical scalers
        assert r0[1]["scale"] == r0[0]["scale"] / 2 or r0[1]["scale"] == r0[0]["scale"]  # hysteresis
        assert not r0[1]["weights_changed"] and not r1[1]["weights_changed"]
        assert r0[2]["weights_changed"] and r1[2]["weights_changed"]


# --------------------------------------------------------------------------- single process


class _Cfg:
    def __init__(self, **kw):
        self.zero_stage, self.contiguous_gradients, self.reduce_bucket_size = 0, True, None
        self.overlap_comm, self.param_persistence_threshold, self.timeout_s = None, 100_000, 600.0
        self.__dict__.update(kw)


def test_one_process_is_the_plain_model_for_every_stage():
    from tenfold.engine.parallel.distributed import DistInfo
    from tenfold.models.gpt import GPT
    from tenfold.techniques import zero

    model = GPT(worker_model_config())
    for stage in range(4):
        assert zero.apply_zero(model, _Cfg(zero_stage=stage), DistInfo()) is model
        assert zero.zero_stage_of(model) is None
        with zero.grad_sync(model, enabled=False):  # nothing to skip on one process
            pass


def test_bad_stage_is_a_user_error():
    from tenfold.engine.parallel.distributed import DistInfo
    from tenfold.errors import UserError
    from tenfold.techniques import zero

    with pytest.raises(UserError, match="zero_stage"):
        zero.apply_zero(torch.nn.Linear(2, 2), _Cfg(zero_stage=4), DistInfo())


def test_persistence_threshold_keeps_small_units_gathered():
    from tenfold.techniques.zero import _reshard_after_forward

    assert _reshard_after_forward(3, 10_001, 10_000) is True
    assert _reshard_after_forward(3, 10_000, 10_000) is False  # DeepSpeed: numel <= threshold persists
    assert _reshard_after_forward(2, 10**9, 0) is False  # stage 2 never frees after forward


def test_zero3_keeps_the_last_block_and_the_root_gathered_into_backward():
    from tenfold.techniques.zero import _backward_follows_forward

    class Dist:
        pp_size = 1

    assert _backward_follows_forward(3, Dist()) == [False, False, True, True]  # 3 blocks, then the root
    Dist.pp_size = 2  # pipelining: other micro-batches' forwards run before this backward
    assert _backward_follows_forward(3, Dist()) == [False] * 4


def worker_model_config():
    from tenfold.models.presets import get_preset

    m = dict(worker.MODEL)
    return get_preset(m.pop("name")).with_overrides(**m)
