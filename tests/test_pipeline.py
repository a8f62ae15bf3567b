"""Pipeline parallelism (techniques/pipeline.py): the split, its validation, and the
equivalence of torch.distributed.pipelining over gloo with one plain process.

PyTorch's own CI runs its multi-process pipelining schedules only on accelerators
so these gloo tests are our guard: every schedule on pp=2 must give the
single-process loss curve (fp32, rel 1e-5), and pp=2 x dp=2 with FSDP2 on the dp axis too.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipeline_harness import (
    CFG, SEQ, assert_close_curve, assert_matches_fsdp_bf16, assert_same_grads, assert_tied_norms, launch, load_full_grads,
    reference_run,
)
from tenfold.errors import UserError
from tenfold.models.gpt import GPT
from tenfold.models.presets import get_preset, param_count
from tenfold.techniques import pipeline as pp
from tenfold.techniques import pipeline_runner
from tenfold.run import resolve
from tenfold.terms import layer_counts



# --------------------------------------------------------------------------- the split


@pytest.mark.parametrize("n_layers,stages", [(4, 2), (4, 4), (8, 3), (12, 4), (5, 2), (3, 3)])
def test_layer_counts_cover_every_layer_once(n_layers, stages):
    counts = layer_counts(n_layers, stages)
    assert len(counts) == stages and sum(counts) == n_layers and min(counts) >= 0
    # Embedding and head weigh one layer each: the effective loads differ by at most one.
    loads = [c + (s == 0) + (s == stages - 1) for s, c in enumerate(counts)]
    assert max(loads) - min(loads) <= 1, loads


def test_layer_counts_match_torchtitan_examples():
    # torchtitan generate_llm_fqn_per_model_part: L + 2 effective layers cut evenly,
    # the remainder going to the earliest stages.
    assert layer_counts(4, 2) == [2, 2]
    assert layer_counts(4, 4) == [1, 2, 1, 0]
    assert layer_counts(8, 3) == [3, 3, 2]
    assert layer_counts(6, 1) == [6]


def test_split_keeps_parameter_names_and_tensors():
    torch.manual_seed(0)
    model = GPT(CFG)
    full = model.state_dict()
    seen: dict[str, torch.Tensor] = {}
    for rank in range(2):
        split = pp.split_model(model, rank, 2, layer_counts(CFG.n_layers, 4))
        assert split.stage_ids == [rank, rank + 2]
        for stage in split.modules:
            for name, t in stage.state_dict().items():
                assert name not in seen, f"{name} owned by two stages"
                seen[name] = t
    assert set(seen) == set(full)
    for name, t in seen.items():  # the GPT's own tensors, not copies
        assert t.data_ptr() == full[name].data_ptr(), name


def test_chained_stages_compute_the_full_forward():
    torch.manual_seed(0)
    model = GPT(CFG)
    ids = torch.randint(0, CFG.vocab_size, (2, SEQ))
    split = pp.split_model(model, 0, 1, layer_counts(CFG.n_layers, 3))  # all 3 stages on one "rank"
    h = ids
    for stage in split.modules:
        h = stage(h)
    assert torch.equal(h, model(ids))


def test_manual_split_and_description():
    model = GPT(CFG)
    split = pp.split_model(model, 1, 2, [1, 3])
    assert list(split.modules[0].layers) == ["1", "2", "3"] and split.modules[0].is_last
    lines = pp.describe_split(split)
    assert lines[0].startswith("stage 0 (pp rank 0): layer 0 + tok_emb")
    total = sum(int(line.rsplit("; ", 1)[1].split()[0].replace(",", "")) for line in lines)
    assert total == param_count(CFG)


@pytest.mark.parametrize("layout", [
    dict(pp=2), dict(pp=4, grad_accum=4), dict(pp=2, pp_schedule="interleaved", grad_accum=2),
    dict(pp=2, pp_split=(3, 1)), dict(pp=2, pp_schedule="interleaved", virtual_stages=3, grad_accum=2, n_layers=10),
    dict(pp=2, tie=True), dict(pp=4, grad_accum=4, tie=True),
    dict(pp=2, pp_schedule="interleaved", grad_accum=2, tie=True),
])
def test_the_planner_prices_the_parameters_each_rank_really_holds(layout):
    """One split for both: the resolved run's `stage_layers` cut the real model (split_model)
    and give the planner's per-rank parameters (tenfold.plan.shape.run_rank_params), the last
    stage's copy of a tied embedding included."""
    from tenfold.plan.shape import run_rank_params, shape_of

    cfg = CFG.with_overrides(n_layers=layout.pop("n_layers", CFG.n_layers), tie_embeddings=layout.pop("tie", False))
    run = resolve(cfg, layout["pp"], check=False, **layout)
    model = GPT(cfg)
    for rank in range(run.pp):
        split = pp.split_model(model, rank, run.pp, run.stage_layers)
        held = sum(p.numel() for stage in split.modules for p in stage.parameters())
        assert run_rank_params(shape_of(cfg), run, rank) == held, (rank, run.stage_layers)


def test_a_tied_embedding_is_one_parameter_on_one_rank_and_two_copies_across_ranks():
    """Tied embeddings (techniques/tied_embeddings.py): stages on one rank share the Parameter
    (chained, they compute the tied model's logits); on different ranks the last stage's head is
    a Parameter of its own, zero until the broadcast from the first stage fills it."""
    from tenfold.techniques.tied_embeddings import TiedPair

    tied = CFG.with_overrides(tie_embeddings=True)
    torch.manual_seed(0)
    model = GPT(tied)
    split = pp.split_model(model, 0, 1, layer_counts(CFG.n_layers, 3))  # all 3 stages on one "rank"
    assert split.tied == TiedPair("tok_emb.weight", "output.weight") and split.tied_local == ()
    assert split.modules[-1].output.weight is split.modules[0].tok_emb.weight
    ids = torch.randint(0, CFG.vocab_size, (2, SEQ))
    h = ids
    for stage in split.modules:
        h = stage(h)
    assert torch.equal(h, model(ids))
    first, last = (pp.split_model(GPT(tied), rank, 2) for rank in (0, 1))
    assert first.tied_local == ("tok_emb.weight",) and last.tied_local == ("output.weight",)
    head = last.modules[0].output.weight
    assert head.shape == (CFG.vocab_size, CFG.d_model) and not head.any()
    assert pp.describe_split(last)[-1].endswith("params; output.weight tied to stage 0's tok_emb.weight")
    assert first.params[-1] == last.params[-1] == sum(p.numel() for p in last.modules[0].parameters())


def test_a_tie_between_other_stages_is_refused():
    model = GPT(CFG)
    model.layers["3"].attn.wq.weight = model.layers["0"].attn.wq.weight
    with pytest.raises(UserError, match=r"layers.0.attn.wq.weight \(pipeline stage 0\) and layers.3.attn.wq.weight "
                                        r"\(stage 1\) are one tied weight; pipeline stages share only the embedding"):
        pp.split_model(model, 0, 2)


@pytest.mark.parametrize("zero,shards", [(0, 1), (2, 64)])  # ZeRO-0 under tp: whole gradients
def test_the_planner_prices_the_tied_embedding_all_reduce_once_per_step(zero, shards):
    """GPT-3 175B on tp 4 x pp 4 x dp 64 (its fastest layouts): tied, the step adds one
    all-reduce of the local (V, d) gradient (/ tp, / dp where ZeRO-2/3 shards it, fp32) over the
    first and the last pipeline rank, two nodes apart, and the last stage holds the same parameters
    as an untied head (planner vs engine: test_the_planner_prices_the_parameters_each_rank_really_holds)."""
    from tenfold.plan import comm
    from tenfold.plan.api import predict
    from tenfold.plan.hardware import get_hardware

    gpt3 = get_preset("gpt3-175b")
    choices = dict(tp=4, pp=4, pp_schedule="interleaved", virtual_stages=4, micro_batch=1, global_batch=1536,
                   zero_stage=zero)
    tied, untied = (predict(resolve(m, 1024, **choices), "a100-80gb")
                    for m in (gpt3, gpt3.with_overrides(tie_embeddings=False)))
    local_bytes = 4 * gpt3.vocab_size * gpt3.d_model / 4 / shards
    want = comm.all_reduce_time(local_bytes, get_hardware("a100-80gb"), comm.Group(2, 1))
    assert tied.time.embedding_sync_s == pytest.approx(want) and want > 0 and untied.time.embedding_sync_s == 0
    assert tied.time.step_s == pytest.approx(untied.time.step_s + want)
    assert tied.memory.total_bytes == untied.memory.total_bytes
    one_stage = predict(resolve(gpt3, 1024, tp=4, micro_batch=1, global_batch=1536, zero_stage=3), "a100-80gb")
    assert one_stage.time.embedding_sync_s == 0  # pp 1: one Parameter, nothing to reduce


def test_predicted_bubble():
    assert pipeline_runner.predicted_bubble(2, 4) == 0.25
    assert pipeline_runner.predicted_bubble(4, 8, 2) == 3 / 16


# --------------------------------------------------------------------------- validation


def _check(**overrides):
    """A pipelined run of `tiny` resolved as train resolves it (tenfold.run.resolve: the split's
    rules; tenfold.capabilities: the schedules')."""
    kw = dict(n_layers=4, world_size=2, pp=2, pp_schedule="1f1b", virtual_stages=None, grad_accum=4)
    kw.update(overrides)
    model = get_preset("tiny").with_overrides(n_layers=kw.pop("n_layers"), tie_embeddings=kw.pop("tie_embeddings", False))
    resolve(model, kw.pop("world_size"), **kw)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"grad_accum": 1}, "train.grad_accum=1 < parallel.pp_degree=2"),
        ({"world_size": 3}, "= 2 must divide the number of processes (3)"),
        ({"pp": 4, "world_size": 4, "pp_schedule": "interleaved", "virtual_stages": 2, "grad_accum": 8},
         "8 pipeline stages"),
        ({"n_layers": 1}, "more than the model's 1 layers"),
        ({"pp_schedule": "interleaved", "virtual_stages": 2, "grad_accum": 5}, "multiple of parallel.pp_degree"),
        ({"virtual_stages": 2}, "needs an interleaved schedule"),
        ({"pp_schedule": "dualpipe"}, "parallel.pp_schedule (--pp-schedule) 'dualpipe'; allowed"),
        ({"pp_split": [4]}, "parallel.pp_split has 1 entries but there are 2 stages"),
        ({"pp_split": [3, 3]}, "summing to model.n_layers (4)"),
        ({"world_size": 4, "pp_schedule": "zero-bubble", "virtual_stages": 2, "zero_stage": 1},
         "zero-bubble schedule with data parallelism needs parallel.zero_stage 2 or 3"),
        ({"pp_split": [2, 0, 2], "pp_schedule": "interleaved", "virtual_stages": 3, "pp": 1},
         None),  # pp=1: nothing to check
    ],
)
def test_validation_names_the_problem(overrides, needle):
    if needle is None:
        _check(**overrides)
        return
    with pytest.raises(UserError) as e:
        _check(**overrides)
    assert needle in str(e.value)


def test_valid_configs_pass():
    _check()
    _check(pp_schedule="gpipe", grad_accum=2)
    _check(pp_schedule="zero-bubble", virtual_stages=2, grad_accum=4)
    _check(pp_split=[0, 4])
    _check(world_size=4, pp_schedule="zero-bubble", virtual_stages=2, zero_stage=2)
    _check(n_layers=10, pp_schedule="interleaved", grad_accum=2)  # 10 layers on 4 stages: 3/3/2/2 (uneven is fine)
    _check(tie_embeddings=True)  # the first and the last stage each keep a copy (techniques/tied_embeddings.py)


# --------------------------------------------------------------------------- multi-process


@pytest.fixture(scope="module")
def reference():
    return reference_run()


PP2_CASES = [
    {"pp": 2, "schedule": "gpipe", "m": 4},
    {"pp": 2, "schedule": "1f1b", "m": 4},
    {"pp": 2, "schedule": "interleaved", "v": 2, "m": 4},
    {"pp": 2, "schedule": "zero-bubble", "v": 2, "m": 4},
    {"pp": 2, "schedule": "1f1b", "m": 2, "split": [1, 3], "ac": "full"},
    {"pp": 2, "schedule": "1f1b", "m": 4, "dtype": "bf16"},
    {"pp": 2, "schedule": "gpipe", "m": 4, "loss_scale": 1024.0},  # a power of 2: exact in fp32
    # tied embeddings: the first stage's embedding and the last stage's head are two copies
    {"pp": 2, "schedule": "gpipe", "m": 4, "tie": True},
    {"pp": 2, "schedule": "1f1b", "m": 4, "tie": True, "loss_scale": 1024.0},
    {"pp": 2, "schedule": "interleaved", "v": 2, "m": 4, "tie": True},
    {"pp": 2, "schedule": "zero-bubble", "v": 2, "m": 4, "tie": True},
]


TIED_RTOL = 1e-6  # tied embeddings: losses and eval loss against one process (norms: assert_tied_norms)


@pytest.fixture(scope="module")
def tied_references():
    """One-process runs of the tied model: CFG's 4 blocks and 8 (for 4 ranks x 2 stages)."""
    return {layers: reference_run(tie=True, layers=layers) for layers in (CFG.n_layers, 8)}


def assert_tied_copies_equal(res: dict, what: str) -> None:
    """The first stage's embedding and the last stage's head, bit for bit after training."""
    assert res["tied_copies_differ_by"] == 0.0, f"{what}: the tied copies differ by {res['tied_copies_differ_by']}"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_every_schedule_matches_one_process(reference, tied_references, tmp_path):
    """Every schedule, untied and tied, against one process: losses, gradient norms (the tied
    weight counted once), eval loss, and the first step's gradient of every parameter (the
    tied weight's under both of its names: both copies hold the summed gradient)."""
    results = launch(2, PP2_CASES, tmp_path)
    assert len(results) == len(PP2_CASES), results[-1]
    bf16 = reference_run(torch.bfloat16)
    for case, res in zip(PP2_CASES, results):
        what = f"{case}"
        want = bf16 if case.get("dtype") == "bf16" else tied_references[CFG.n_layers] if case.get("tie") else reference
        full_names = sorted(n for n, _ in GPT(CFG.with_overrides(tie_embeddings=bool(case.get("tie"))))
                            .named_parameters(remove_duplicate=False))
        if case.get("tie"):
            assert_tied_copies_equal(res, what)
        # bf16: the same autocast ops in the same order per row; tolerance for the
        # different micro-batch grouping of the matmuls (2 rows vs ROWS/m rows).
        rel = 2e-3 if case.get("dtype") == "bf16" else TIED_RTOL if case.get("tie") else 1e-5
        assert_close_curve(res["loss"], want["loss"], rel, what + " loss")
        if case.get("tie"):
            assert_tied_norms(res["grad_norm"], want["grad_norm"], what)
        else:
            assert_close_curve(res["grad_norm"], want["grad_norm"], max(rel, 1e-5), what + " grad norm")
        grad_tol = 2e-3 if case.get("dtype") == "bf16" else 1e-6
        assert_same_grads(load_full_grads(tmp_path, case), want["grads"], grad_tol, grad_tol, what)
        assert math.isclose(res["eval_sum"], want["eval_sum"], rel_tol=rel), what
        assert res["names"] == full_names, what  # stages together hold the full model's FQNs
        rep = res["report"]
        assert rep["bubble_predicted"] == pipeline_runner.predicted_bubble(2, case["m"], case.get("v", 1))
        assert len(rep["bubble_measured_per_pp_rank"]) == 2
        assert all(0.0 <= b < 100 for b in rep["bubble_measured_per_pp_rank"])  # idle / busy


DP_CASES = [  # ZeRO 1 = DDP + ZeroRedundancyOptimizer, 2/3 = FSDP2 (techniques/zero.py)
    {"pp": 2, "schedule": "1f1b", "m": 4, "zero": 1},
    {"pp": 2, "schedule": "gpipe", "m": 2, "zero": 3},
    {"pp": 2, "schedule": "interleaved", "v": 2, "m": 2, "zero": 0},  # DDP, 2 stages per rank
    {"pp": 2, "schedule": "zero-bubble", "v": 2, "m": 2, "zero": 2, "ac": "full"},
    {"pp": 2, "schedule": "1f1b", "m": 2, "zero": 3, "dtype": "bf16"},  # 16-bit residual stream between stages
    # tied embeddings on 4 ranks: ZeRO-1/2/3 on dp 2, tensor parallelism, 4 pipeline ranks
    {"pp": 2, "schedule": "1f1b", "m": 4, "zero": 1, "tie": True},
    {"pp": 2, "schedule": "interleaved", "v": 2, "m": 2, "zero": 3, "tie": True},
    {"pp": 2, "schedule": "zero-bubble", "v": 2, "m": 2, "zero": 2, "tie": True},
    {"pp": 2, "schedule": "1f1b", "m": 4, "tp": 2, "tie": True},
    {"pp": 4, "schedule": "1f1b", "m": 4, "tie": True},
    {"pp": 4, "schedule": "interleaved", "v": 2, "m": 4, "tie": True, "layers": 8},
]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_dp2_zero_matches_one_process(reference, tied_references, tmp_path):
    results = launch(4, DP_CASES, tmp_path)
    assert len(results) == len(DP_CASES), results[-1]
    for case, res in zip(DP_CASES, results):
        if case.get("dtype") == "bf16":
            assert_matches_fsdp_bf16(res, reference_run(torch.bfloat16), str(case))
            continue
        want = tied_references[case.get("layers", CFG.n_layers)] if case.get("tie") else reference
        if case.get("tie"):
            assert_tied_copies_equal(res, str(case))
        rel = TIED_RTOL if case.get("tie") else 1e-5
        assert_close_curve(res["loss"], want["loss"], rel, f"{case} loss")
        if case.get("tie"):
            assert_tied_norms(res["grad_norm"], want["grad_norm"], str(case))
        else:
            assert_close_curve(res["grad_norm"], want["grad_norm"], rel, f"{case} grad norm")
        assert math.isclose(res["eval_sum"], want["eval_sum"], rel_tol=rel), case
        assert_same_grads(load_full_grads(tmp_path, case), want["grads"], 1e-6, 1e-6, str(case))
