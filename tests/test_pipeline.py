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
    CFG, SEQ, assert_close_curve, assert_matches_fsdp_bf16, assert_same_grads, launch, load_full_grads, reference_run,
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
])
def test_the_planner_prices_the_parameters_each_rank_really_holds(layout):
    """One split for both: the resolved run's `stage_layers` cut the real model (split_model)
    and give the planner's per-rank parameters (tenfold.plan.shape.run_rank_params)."""
    from tenfold.plan.shape import run_rank_params, shape_of

    cfg = CFG.with_overrides(n_layers=layout.pop("n_layers", CFG.n_layers))
    run = resolve(cfg, layout["pp"], check=False, **layout)
    model = GPT(cfg)
    for rank in range(run.pp):
        split = pp.split_model(model, rank, run.pp, run.stage_layers)
        held = sum(p.numel() for stage in split.modules for p in stage.parameters())
        assert run_rank_params(shape_of(cfg), run, rank) == held, (rank, run.stage_layers)


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
        ({"tie_embeddings": True}, "model.tie_embeddings=true cannot be pipelined"),
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
]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_every_schedule_matches_one_process(reference, tmp_path):
    results = launch(2, PP2_CASES, tmp_path)
    assert len(results) == len(PP2_CASES), results[-1]
    full_names = sorted(n for n, _ in GPT(CFG).named_parameters())
    bf16 = reference_run(torch.bfloat16)
    for case, res in zip(PP2_CASES, results):
        what = f"{case}"
        want = bf16 if case.get("dtype") == "bf16" else reference
        # bf16: the same autocast ops in the same order per row; tolerance for the
        # different micro-batch grouping of the matmuls (2 rows vs ROWS/m rows).
        rel = 2e-3 if case.get("dtype") == "bf16" else 1e-5
        assert_close_curve(res["loss"], want["loss"], rel, what + " loss")
        assert_close_curve(res["grad_norm"], want["grad_norm"], max(rel, 1e-5), what + " grad norm")
        grad_tol = 2e-3 if case.get("dtype") == "bf16" else 1e-6
        assert_same_grads(load_full_grads(tmp_path, case), want["grads"], grad_tol, grad_tol, what)
        assert math.isclose(res["eval_sum"], want["eval_sum"], rel_tol=max(rel, 1e-5)), what
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
]
@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_dp2_zero_matches_one_process(reference, tmp_path):
    results = launch(4, DP_CASES, tmp_path)
    assert len(results) == len(DP_CASES), results[-1]
    for case, res in zip(DP_CASES, results):
        if case.get("dtype") == "bf16":
            assert_matches_fsdp_bf16(res, reference_run(torch.bfloat16), str(case))
            continue
        assert_close_curve(res["loss"], reference["loss"], 1e-5, f"{case} loss")
        assert_close_curve(res["grad_norm"], reference["grad_norm"], 1e-5, f"{case} grad norm")
        assert math.isclose(res["eval_sum"], reference["eval_sum"], rel_tol=1e-5), case
        assert_same_grads(load_full_grads(tmp_path, case), reference["grads"], 1e-6, 1e-6, str(case))
