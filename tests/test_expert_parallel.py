"""Expert parallelism (techniques/expert_parallel.py) on gloo: two ranks with the experts split
over ep 2 against one process holding every expert, under ZeRO-0 (DDP) and ZeRO-3 (FSDP2).

The ranks run tests/workers/moe_worker.py under torchrun (the Trainer, micro 2 x accum 1 x dp 2);
the reference runs here with the same global batch in the same micro-batches (micro 2 x accum 2:
rank r's rows are the one process's micro-batch r, tenfold.data.loader's order rule), so each
micro-batch's router balance loss is computed over the same tokens. fp32: only the order of the
floating-point sums differs (the all-to-all regroups rows; the dp average).

On 4 ranks the same comparison holds ep 2 over dp 4 (two ranks hold each half of the experts,
which ZeRO-2/3 shard between them, mode "replicas"), beside a 1F1B pipeline (pp 2 x dp 2, mode
"pipeline") and beside tensor parallelism (tp 2 x dp 2 without sequence parallelism, mode
"tensor")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tenfold.errors import UserError

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from conftest import FP32_RTOL, rel_err, torchrun  # noqa: E402
from workers import moe_worker as worker  # noqa: E402

RTOL = 1e-6


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return torchrun("equivalence", tmp_path_factory.mktemp("ep2"), worker="moe_worker.py", timeout=400)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    return worker.run_steps(worker.config(0, 2, 2, str(tmp_path_factory.mktemp("ref"))))


@pytest.fixture(scope="module")
def reference_micro1(tmp_path_factory):
    """One process, micro 1 x accum 4: the micro-batches of the ranks' micro 1 x accum 2 x dp 2."""
    import torch

    torch.set_num_threads(1)
    return worker.run_steps(worker.config(0, 1, 4, str(tmp_path_factory.mktemp("ref1"))))


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["0", "3", "3-accum-recompute", "ep1-0", "ep1-3"])
def test_ep_layouts_match_one_process_losses_and_first_step_gradients(two_ranks, reference, reference_micro1, run):
    if run == "3-accum-recompute":
        reference = reference_micro1
    for rank in ("0", "1"):
        got = two_ranks[rank][run]
        assert rel_err(got["losses"], reference["losses"]) < RTOL, (got["losses"], reference["losses"])
        assert rel_err(got["grad_norms"], reference["grad_norms"]) < 10 * RTOL
        assert got["grads"].keys() == reference["grads"].keys()
        for name, ref in reference["grads"].items():
            scale = max(abs(v) for v in ref)
            worst = max(abs(a - b) for a, b in zip(got["grads"][name], ref))
            assert worst <= RTOL * scale + 1e-9, (name, worst, scale)
        assert got["loads"] == reference["loads"]  # every rank logs the global assignments
    assert reference["losses"][-1] < reference["losses"][0] - 0.3  # it learns


@pytest.fixture(scope="module")
def replica_ranks(tmp_path_factory):
    return torchrun("replicas", tmp_path_factory.mktemp("dp4ep2"), nproc=4, worker="moe_worker.py", timeout=600)


@pytest.fixture(scope="module")
def reference_six(tmp_path_factory):
    """One process, micro 1 x accum 4, with 6 experts a layer."""
    import torch

    torch.set_num_threads(1)
    return worker.run_steps(worker.config(0, 1, 4, str(tmp_path_factory.mktemp("ref6")), n_experts=6))


def _expert_numel(n_experts: int) -> int:
    m = worker.MODEL
    return m["n_layers"] * 3 * n_experts * m["d_model"] * m["d_expert"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("run, dp_share", [("dp4-0", 2), ("dp4-2", 4), ("dp4-3", 4), ("dp4-3-six", 4)])
def test_ep2_on_four_ranks_shards_the_experts_over_their_replicas_and_matches_one_process(
        replica_ranks, reference_micro1, reference_six, run, dp_share):
    """dp 4, ep 2: each half of the experts lives on two ranks. ZeRO-2/3 shard it over the two
    (FSDP2 over "dp_mod_ep"), so a rank keeps 1/4 of the experts' elements, as of every other
    weight; ZeRO-0 keeps its half whole. Losses every step and first-step gradients equal one
    process (the sharded gradients are FSDP2's average over the replicas, rescaled to the sum over
    dp: a wrong factor or a missed reduction fails the gradients)."""
    reference = reference_six if run.endswith("six") else reference_micro1
    n_experts = 6 if run.endswith("six") else worker.MODEL["n_experts"]
    for rank in ("0", "1", "2", "3"):
        got = replica_ranks[rank][run]
        _assert_matches(got, reference)
        assert got["grads"].keys() == reference["grads"].keys()
        assert got["held_expert_numel"] * dp_share == _expert_numel(n_experts)


@pytest.fixture(scope="module")
def pipeline_ranks(tmp_path_factory):
    return torchrun("pipeline", tmp_path_factory.mktemp("pp2ep2"), nproc=4, worker="moe_worker.py", timeout=900)


@pytest.fixture(scope="module")
def tensor_ranks(tmp_path_factory):
    return torchrun("tensor", tmp_path_factory.mktemp("tp2ep2"), nproc=4, worker="moe_worker.py", timeout=900)


def _assert_matches(got: dict, reference: dict) -> None:
    """Losses of every step, the first step's gradients of the parameters this rank holds (all
    of them, unless a pipeline stage holds some) and the expert load of its MoE layers."""
    assert rel_err(got["losses"], reference["losses"]) < RTOL, (got["losses"], reference["losses"])
    assert rel_err(got["grad_norms"], reference["grad_norms"]) < 10 * RTOL
    assert got["grads"] and set(got["grads"]) <= set(reference["grads"])
    for name, values in got["grads"].items():
        ref = reference["grads"][name]
        scale = max(abs(v) for v in ref)
        worst = max(abs(a - b) for a, b in zip(values, ref))
        assert worst <= RTOL * scale + 1e-9, (name, worst, scale)
    assert [[step[i] for i in got["layers"]] for step in reference["loads"]] == got["loads"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["pp2-0", "pp2-3", "pp2-3-recompute", "pp2-ep1-0"])
def test_ep_under_a_1f1b_pipeline_matches_one_process(pipeline_ranks, reference_micro1, run):
    """pp 2 x dp 2, ep 2 over each stage's dp ranks, micro 1 x accum 2: the one process's micro 1 x
    accum 4. Each stage's ranks hold half the parameters; together they hold every one."""
    held = set()
    for rank in ("0", "1", "2", "3"):
        got = pipeline_ranks[rank][run]
        _assert_matches(got, reference_micro1)
        assert len(got["layers"]) == 1  # one MoE layer a stage
        held |= set(got["grads"])
    assert held == set(reference_micro1["grads"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["tp2-0", "tp2-3", "tp2-3-recompute", "tp2-ep1-3"])
def test_ep_beside_tensor_parallel_attention_matches_one_process(tensor_ranks, reference, run):
    """tp 2 x dp 2, ep 2 over the dp ranks of each tp rank, micro 2 x accum 1."""
    for rank in ("0", "1", "2", "3"):
        got = tensor_ranks[rank][run]
        _assert_matches(got, reference)
        assert got["grads"].keys() == reference["grads"].keys()


def _resolve(world: int, parallel: dict, **sections):
    from tenfold.config import build_config
    from tenfold.run import resolve_run

    cfg = {"model": {"name": "tiny-moe"}, "parallel": parallel, "train": {"grad_accum": 2}, **sections}
    return resolve_run(build_config(cfg), world)


@pytest.mark.parametrize("world, parallel, sections, message", [
    (4, {"pp_degree": 2, "ep_degree": 2, "pp_schedule": "gpipe"}, {},
     r"--ep\) 2 with --pp needs --pp-schedule 1f1b \(got gpipe\)"),
    (4, {"pp_degree": 2, "ep_degree": 2, "zero_stage": 2}, {}, r"--ep\) 2 with --pp needs --zero 0 or 3 \(got 2\)"),
    (4, {"tp_degree": 2, "ep_degree": 2, "zero_stage": 2, "sequence_parallel": False}, {},
     r"--ep\) 2 with --tp needs --zero 0 or 3 \(got 2\)"),
    (4, {"tp_degree": 2, "ep_degree": 2}, {}, r"--tp\) 2 on a mixture-of-experts model .* pass --no-sequence-parallel"),
    (4, {"tp_degree": 2, "sequence_parallel": True}, {},
     r"--tp\) 2 on a mixture-of-experts model .* pass --no-sequence-parallel"),
    (8, {"pp_degree": 2, "tp_degree": 2, "ep_degree": 2, "sequence_parallel": False}, {},
     r"--tp\) 2 on a mixture-of-experts model runs without --pp \(got --pp 2\)"),
    (4, {"pp_degree": 2, "ep_degree": 2}, {"recompute": {"policy": "full"}, "precision": {"fp8": True}},
     r"--ep\) 2 does not combine with --fp8"),
])
def test_ep_beside_pp_or_tp_refuses_what_is_not_run(world, parallel, sections, message):
    with pytest.raises(UserError, match=message):
        _resolve(world, parallel, **sections)


def test_ep_beside_tp_on_a_hugging_face_moe_model_is_refused():
    from tenfold.config import build_config
    from tenfold.run import resolve_run

    cfg = {"model": {"hf_config": str(HERE / "data" / "mixtral-tiny" / "config.json")},
           "parallel": {"tp_degree": 2, "ep_degree": 2, "sequence_parallel": False}}
    with pytest.raises(UserError, match=r"--ep\) 2 with --tp needs tenfold's MoE blocks \(got a Hugging Face model "
                                        r"of model_type 'mixtral'\)"):
        resolve_run(build_config(cfg), 4)


def test_ep_beside_a_1f1b_pipeline_or_tp_without_sequence_parallelism_resolves():
    for zero in (0, 3):
        assert _resolve(4, {"pp_degree": 2, "ep_degree": 2, "zero_stage": zero}).ep == 2
        assert _resolve(4, {"tp_degree": 2, "ep_degree": 2, "zero_stage": zero, "sequence_parallel": False}).ep == 2


def _train(out: Path, *flags: str) -> list[dict]:
    from conftest import RUN_FLAGS, read_metrics, tenfold_child

    moe = ["--model", "tiny-moe", "--set", "model.d_expert=32", "--set", "model.n_experts=4",
           "--set", "model.n_shared_experts=1", "--set", "model.d_ff=64", "--set", "model.d_model=32"]
    proc = tenfold_child("train", "--out", str(out), "--precision", "fp32", "--micro-batch", "2", "--global-batch", "4",
                         *RUN_FLAGS, *moe, "--set", "model.d_model=32", "--lr", "1e-2", "--set", "train.warmup_steps=0",
                         *flags, timeout=400, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(out)


@pytest.mark.multiprocess
def test_an_ep2_checkpoint_resumes_exactly_on_other_ep_sizes(tmp_path):
    """4 steps on 2 ranks with ep 2, saving at step 2; steps 3-4 again from that checkpoint on one
    process (every expert in one place) and on 2 ranks without ep. Step 3 repeats bit for bit (the
    restored weights, optimizer states and data position are the saved ones); step 4 within the
    fp32 tolerance of a changed reduction order (dp 2 without ep all-reduces the experts' gradients
    in DDP's buckets)."""
    whole = _train(tmp_path / "ep2", "--nproc", "2", "--ep", "2", "--steps", "4", "--checkpoint-every", "2")
    checkpoint = str(tmp_path / "ep2" / "checkpoints" / "step_2")
    for name, flags in (("one", ()), ("dp2", ("--nproc", "2"))):
        resumed = _train(tmp_path / name, *flags, "--steps", "4", "--resume", checkpoint)
        assert [r["step"] for r in resumed] == [3, 4]
        assert resumed[0]["loss"] == whole[2]["loss"], name
        assert rel_err([r["loss"] for r in resumed], [r["loss"] for r in whole[2:]]) < FP32_RTOL, name
        assert [r["expert_load"] for r in resumed] == [r["expert_load"] for r in whole[2:]]


@pytest.mark.multiprocess
def test_a_checkpoint_of_experts_sharded_over_their_replicas_resumes_on_other_layouts(tmp_path):
    """4 steps on 4 ranks with ep 2 at ZeRO-3 (each half of the experts sharded over its two
    replicas), saving at step 2; steps 3-4 again from that checkpoint on one process and on 2 ranks
    with ep 2 (no replicas). The checkpoint holds every expert once, whatever the sharding: the
    resumed losses equal the uninterrupted run's within the fp32 tolerance of a changed reduction
    order, and the expert load repeats exactly."""
    one_micro = ("--micro-batch", "1", "--zero", "3")
    whole = _train(tmp_path / "dp4", "--nproc", "4", "--ep", "2", *one_micro, "--steps", "4", "--checkpoint-every", "2")
    checkpoint = str(tmp_path / "dp4" / "checkpoints" / "step_2")
    for name, flags in (("one", ()), ("ep2", ("--nproc", "2", "--ep", "2"))):
        resumed = _train(tmp_path / name, *flags, *one_micro, "--steps", "4", "--resume", checkpoint)
        assert [r["step"] for r in resumed] == [3, 4]
        assert rel_err([r["loss"] for r in resumed], [r["loss"] for r in whole[2:]]) < FP32_RTOL, name
        assert [r["expert_load"] for r in resumed] == [r["expert_load"] for r in whole[2:]]
