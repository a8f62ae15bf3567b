"""Tensor and sequence parallelism (techniques/tensor_parallel.py) on gloo: every layout gives
the one-process loss curve, the per-step collective bytes equal the planner's, the matrices'
model states are divided by tp, and bad layouts exit 2 in one line.

The ranks run tests/workers/tp_worker.py under `python -m torch.distributed.run`
(2 ranks: tp 2; 4 ranks: tp 2 x dp 2 at every ZeRO stage, tp 2 x pp 2); the one-process
references run in this pytest process on the same global batch. The CLI tests go through
`tenfold train` itself (launcher, checkpoints, resume on another layout, export).

Tolerances. fp32: rel 1e-5 on every step's loss and gradient norm and on the validation loss
(measured <= 1e-7: the split matmuls only add their partial sums in another order). bf16: the
first loss within 1e-4, the curve within 5e-3 (TP_BF16_RTOL, below). Resume: 1e-6.
Collective bytes: equal (both are sums of the same integers' multiples).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FP32_RTOL, HERE, read_metrics, rel_err, torchrun, train_summary
from workers import tp_worker as worker
from workers.zero_worker import MODEL, run_steps, token_array

from tenfold.cli import main
from tenfold.config import build_config
from tenfold.errors import UserError
from tenfold.run import resolve_run

pytestmark = pytest.mark.usefixtures("one_thread")
RESUME_RTOL = 1e-6
# bf16 over 3 updates at lr 1e-2: one bf16 rounding step (2^-8 = 3.9e-3) of the loss, relative.
# Wider than ZeRO's 2e-3: besides the batch split, the row-split projections round their
# partial products to bf16 before the reduce-scatter (one process rounds the full sum once).
TP_BF16_RTOL = 5e-3


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return torchrun("tp2", tmp_path_factory.mktemp("tp2"), nproc=2, worker="tp_worker.py")


@pytest.fixture(scope="module")
def tp2dp2(tmp_path_factory):
    return torchrun("tp2dp2", tmp_path_factory.mktemp("tp2dp2"), nproc=4, timeout=400,
                    worker="tp_worker.py")


_REFERENCES: dict = {}


def reference(cfg: dict, world: int) -> dict:
    """The one-process run of the same global batch (cached per config)."""
    ref_cfg = worker.reference_config(cfg, world)
    key = json.dumps(ref_cfg, sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = worker.run_case(ref_cfg)
    return _REFERENCES[key]


def assert_same_curve(got: dict, ref: dict, rtol: float) -> None:
    assert rel_err(got["losses"], ref["losses"]) < rtol, (got["losses"], ref["losses"])
    assert rel_err(got["grad_norms"], ref["grad_norms"]) < rtol * 10, (got["grad_norms"], ref["grad_norms"])
    assert rel_err([got["val_loss"]], [ref["val_loss"]]) < rtol, (got["val_loss"], ref["val_loss"])
    assert min(ref["losses"][1:]) < ref["losses"][0] - 0.3  # it learns: a wrong gradient shows


# --------------------------------------------------------------------------- equivalence


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gqa-sp", "no-sp", "gpt3-style", "recompute", "hf-llama", "hf-llama-tied"])
def test_tp2_gives_the_one_process_curve(tp2, case):
    """tp 2: RoPE + GQA heads split with sequence parallelism; without it; GPT-3 blocks
    (LayerNorm + biases, GELU, learned positions, tied embeddings); full recompute over TP;
    a Hugging Face Llama (GQA) by its module names, untied and tied. Training losses,
    gradient norms and the validation loss."""
    if case.startswith("hf-"):
        pytest.importorskip("transformers", reason="the Hugging Face case needs the hf extra")
    ref = reference(worker.TP2_CASES[case], 2)
    for rank in ("0", "1"):
        assert_same_curve(tp2[rank][case], ref, FP32_RTOL)


@pytest.mark.slow
def test_tp2_bf16_within_tolerance(tp2):
    """bf16: the first step's loss (forward only: the split matmuls round differently) within
    1e-4 (measured 3e-6); the 3-step curve within TP_BF16_RTOL (measured 2.3e-3)."""
    ref = reference(worker.TP2_CASES["bf16-sp"], 2)
    for rank in ("0", "1"):
        got = tp2[rank]["bf16-sp"]["losses"]
        assert rel_err(got[:1], ref["losses"][:1]) < 1e-4
        assert rel_err(got, ref["losses"]) < TP_BF16_RTOL


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero0", "zero1", "zero2", "zero3", "pp2"])
def test_tp2_with_dp2_or_pp2_gives_the_one_process_curve(tp2dp2, case):
    """tp 2 x dp 2 at ZeRO 0-3 (replicate, FSDP2 reducing once per step, FSDP2 stage 2/3
    on the dp axis), and tp 2 x pp 2 (1F1B, sequence-split activations between stages)."""
    ref = reference(worker.TP2DP2_CASES[case], 4)
    for rank in ("0", "1", "2", "3"):
        assert_same_curve(tp2dp2[rank][case], ref, FP32_RTOL)


@pytest.mark.slow
def test_user_module_with_its_own_plan_matches_one_process(tp2, tmp_path):
    from tenfold.engine.loop.trainer import Trainer

    cfg = worker.reference_config(worker.tp_config(), 2)
    t = Trainer(cfg, model=worker.user_model(), dataset=token_array())
    t.setup()
    ref = [t.train_step(t.loader.next_step()).loss for _ in range(3)]
    for rank in ("0", "1"):
        assert rel_err(tp2[rank]["user"]["losses"], ref) < FP32_RTOL


# --------------------------------------------------------------------------- what TP guarantees


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(worker.COMM_CASES))
def test_collective_bytes_equal_the_planners(tp2, case):
    """Every byte on the tp group in one step (measured by engine/observe/comm_bytes.py) is in the
    planner's TP traffic (Plan.tp_bytes_per_step), and no more."""
    from tenfold.plan.for_run import predict_run

    cfg = worker.COMM_CASES[case]
    planned = predict_run(resolve_run(build_config(cfg), 2), "cpu").tp_bytes_per_step
    for rank in ("0", "1"):
        assert tp2[rank][f"comm-{case}"]["ring_bytes"] == pytest.approx(planned, rel=1e-12), tp2[rank][f"comm-{case}"]


@pytest.mark.slow
def test_split_matrices_hold_half_their_model_states(tp2):
    """params, grads and Adam states at the optimizer step: the matrices and embeddings 1/tp,
    the (replicated) norm weights whole; the memory tracker measures the same bytes."""
    ref = run_steps(worker.reference_config(worker.TP2_CASES["gqa-sp"], 2), measure_at=None, steps=2)[1]["state_bytes"]
    norms = (2 * MODEL["n_layers"] + 1) * MODEL["d_model"] * 4  # RMSNorm weights, fp32
    expected = {"params_bytes": (ref["params_bytes"] - norms) // 2 + norms,
                "grads_bytes": (ref["grads_bytes"] - norms) // 2 + norms,
                "optimizer_bytes": (ref["optimizer_bytes"] - 2 * norms) // 2 + 2 * norms}
    from tenfold.models.gpt import GPT

    # the tracker also sees AdamW's 0-dim `step` counter of each parameter (4 bytes)
    steps = 4 * sum(1 for _ in GPT(build_config({"model": {**MODEL, "n_kv_heads": 2}}).model.build()).parameters())
    for rank in ("0", "1"):
        got = tp2[rank]["gqa-sp"]
        assert got["state_bytes"] == expected
        measured = {k: got["measured"][k] for k in expected}
        assert measured == {**expected, "optimizer_bytes": expected["optimizer_bytes"] + steps}


@pytest.mark.slow
def test_one_ranks_fp16_overflow_skips_the_step_on_both(tp2):
    for rank in ("0", "1"):
        rows = tp2[rank]["fp16_overflow"]
        assert [r["skipped"] for r in rows] == [False, True, False]
        assert [r["weights_changed"] for r in rows] == [True, False, True]
    assert tp2["0"]["fp16_overflow"] == tp2["1"]["fp16_overflow"]


@pytest.mark.slow
def test_tp_ranks_draw_their_own_random_numbers(tp2):
    """Dropout inside a TP region (this rank's heads) must not repeat the other rank's mask."""
    assert tp2["0"]["rng"] != tp2["1"]["rng"]


# --------------------------------------------------------------------------- bad layouts

LLAMA = str(Path(__file__).parent / "data" / "llama-tiny" / "config.json")
GPT2 = str(Path(__file__).parent / "data" / "gpt2-tiny" / "config.json")
BAD = [
    (["train", "--tp", "3"], "parallel.tp_degree (--tp) 3 must divide the 4 query heads"),
    (["train", "--nproc", "4", "--tp", "4", "--hf-config", LLAMA], "and the 2 key/value heads"),
    (["train", "--nproc", "3", "--tp", "2"], "must divide the number of processes (3)"),
    (["train", "--sequence-parallel"], "needs parallel.tp_degree (--tp) > 1"),
    (["train", "--nproc", "2", "--tp", "2", "--seq-len", "33"], "must be a multiple of parallel.tp_degree"),
    (["train", "--nproc", "2", "--tp", "2", "--hf-config", GPT2], "model_type 'gpt2' has no tensor-parallel plan"),
    (["plan", "--model", "tiny", "--gpus", "3", "--tp", "3"], "parallel.tp_degree (--tp) 3 must divide the 4 query heads"),
    (["plan", "--hf-config", LLAMA, "--gpus", "4", "--tp", "4"], "and the 2 key/value heads"),
    (["train", "--nproc", "2", "--tp", "2", "--set", "model.vocab_size=257"], "must divide the vocabulary of 257 tokens"),
    (["plan", "--model", "tiny", "--set", "model.vocab_size=257", "--gpus", "2", "--tp", "2"],
     "must divide the vocabulary of 257 tokens"),
]


@pytest.mark.parametrize("argv,needle", BAD)
def test_bad_tensor_parallel_layouts_exit_2_in_one_line(tmp_path, capsys, argv, needle):
    out = tmp_path / "never"
    extra = ["--out", str(out), "--no-progress", "--steps", "1"] if argv[0] == "train" else []
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


def test_a_module_the_plan_does_not_know_is_named():
    from tenfold.models.gpt import GPT
    from tenfold.techniques import tensor_parallel as tp

    model = GPT(build_config({}).model.build())
    model.layers["1"].adapter = torch.nn.Linear(8, 8)  # e.g. a LoRA adapter the plan cannot split
    with pytest.raises(UserError, match=r"module layers\.1\.adapter has parameters the plan does not split"):
        tp.check_plan(model, tp.gpt_plan(model, True), 2)
    with pytest.raises(UserError, match="user's own module and has no tensor-parallel plan"):
        tp.plan_for(torch.nn.Linear(2, 2), "user", True)


def test_an_unmapped_hugging_face_block_is_named():
    pytest.importorskip("transformers", reason="needs the hf extra")
    from tenfold.models.hf import build_hf_model
    from tenfold.techniques import tensor_parallel as tp

    with pytest.raises(UserError, match="cannot split GPT2LMHeadModel: module transformer.layers not found"):
        tp.plan_for(build_hf_model(hf_config=GPT2), "hf", True)


def test_the_run_and_the_planner_share_the_tp_layout():
    """dp = world / (pp x tp); sequence parallelism on by default; the run the planner prices
    carries both, so the memory printed at the start of a run is split by tp."""
    from tenfold.plan.for_run import predict_run

    run = resolve_run(build_config({"parallel": {"tp_degree": 2, "pp_degree": 2}, "train": {"grad_accum": 2}}), 8)
    assert (run.dp, run.tp, run.sequence_parallel) == (2, 2, True)
    one = predict_run(resolve_run(build_config({}), 1), "cpu").memory
    two = predict_run(resolve_run(build_config({"parallel": {"tp_degree": 2}}), 2), "cpu").memory
    assert two.params_bytes < 0.6 * one.params_bytes
    off = resolve_run(build_config({"parallel": {"tp_degree": 2, "sequence_parallel": False}}), 2)
    assert not off.sequence_parallel
    # ZeRO-1 under TP runs on FSDP2 (stage 2's engine): predicted as what it holds, and said so
    zero1 = {"parallel": {"tp_degree": 2, "zero_stage": 1}}
    four = resolve_run(build_config(zero1), 4)
    assert four.zero_runs_as == 2 and "runs as ZeRO-2 on FSDP2" in four.layout_line()
    assert predict_run(four, "cpu").memory.grads_bytes == predict_run(four.with_(zero_stage=2), "cpu").memory.grads_bytes
    assert resolve_run(build_config(zero1), 2).zero_runs_as == 0  # dp 1: nothing wrapped


def test_plan_prices_sequence_parallelism_as_train_runs_it(capsys):
    """`tenfold plan --tp 2` reads train's flags: sequence parallelism on unless
    --no-sequence-parallel, as `tenfold train --tp 2` runs it."""
    argv = ["plan", "--model", "tiny", "--gpus", "2", "--tp", "2", "--gpu", "cpu", "--json"]
    assert main(argv) == 0
    on = json.loads(capsys.readouterr().out)
    assert main([*argv, "--no-sequence-parallel"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert (on["strategy"]["sequence_parallel"], off["strategy"]["sequence_parallel"]) == (True, False)
    assert on["memory"]["activations_bytes"] < off["memory"]["activations_bytes"]
    assert on["tp_bytes_per_step"] > 0 and not on["unsupported"]


def test_the_vocabulary_parallel_embedding_makes_only_its_own_rows_gradient():
    """tenfold's vocabulary-parallel embedding: its backward makes this rank's (V / tp, d) rows of
    the gradient, already Shard(0) like the weight; torch's RowwiseParallel makes the whole
    (V, d) matrix on every rank (Replicate) and keeps its rows only later (3.7 GB on GPT-3's
    first pipeline stage at tp 4). One rank on torch's fake process group, shapes recorded as
    the backward makes them. (The numerics: the tp tests above, which equal one process.)"""
    proc = subprocess.run([sys.executable, str(HERE / "workers" / "vocab_embedding_worker.py")],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tenfold"] == {"whole_matrix": False, "placements": ["S(0)"], "local_shape": [1024 // 4, 16]}
    assert got["torch"]["whole_matrix"] and got["torch"]["placements"] == ["R"]


def test_planner_traffic_per_layer_is_narayanans():
    """One layer (a middle pipeline stage: no embedding, no head), per micro-batch: 8 b s h (t-1)/t
    elements (Narayanan et al. 2021 section 3.2), with or without sequence parallelism."""
    from tenfold.models.presets import get_preset
    from tenfold.plan.tp_traffic import tp_traffic
    from tenfold.run import resolve

    cfg = get_preset("tiny")
    for sp in (True, False):
        run = resolve(cfg, 12, tp=4, pp=3, pp_split=(1, 1, 2), sequence_parallel=sp, precision="fp32", micro_batch=2,
                      seq_len=16, grad_accum=3)
        t = tp_traffic(cfg, run, 1)
        assert t.blocks == 3 * 8 * 2 * 16 * 256 * 3 / 4 * 4
        assert t.embedding == t.head == 0


# --------------------------------------------------------------------------- the CLI


def _train(tmp_path: Path, name: str, *flags: str, timeout: int = 400) -> dict:
    return train_summary(tmp_path / name, "--steps", "4", "--grad-accum", "2", *flags, timeout=timeout)


def _losses(tmp_path: Path, name: str) -> list[float]:
    return [m["loss"] for m in read_metrics(tmp_path / name)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cli_tp2_matches_resumes_on_one_process_and_exports(tmp_path):
    """`tenfold train --nproc 2 --tp 2` = one process; its step-2 checkpoint resumes on one
    process exactly; `tenfold export` writes the full (unsplit) tensors; the memory printed
    beside the measurement is within 15%."""
    one = _train(tmp_path, "one", "--checkpoint-every", "4")
    tp = _train(tmp_path, "tp2", "--nproc", "2", "--tp", "2", "--checkpoint-every", "2")
    for a, b in zip(tp["losses"], one["losses"], strict=True):
        assert math.isclose(a, b, rel_tol=FP32_RTOL)
    _train(tmp_path, "resumed", "--resume", str(tmp_path / "tp2" / "checkpoints" / "step_2"))
    for a, b in zip(_losses(tmp_path, "resumed"), _losses(tmp_path, "one")[2:], strict=True):
        assert math.isclose(a, b, rel_tol=RESUME_RTOL)
    memory = tp["memory"]
    assert abs(memory["diff_percent"]["total_bytes"]) < 15, memory
    assert len(memory["measured_per_rank"]) == 2
    assert memory["measured"]["params_bytes"] < 0.6 * one["memory"]["measured"]["params_bytes"]
    from safetensors.torch import load_file

    for name in ("one", "tp2"):
        assert main(["export", str(tmp_path / name / "checkpoints" / "step_4"), "--dtype", "fp32",
                     "--out", str(tmp_path / f"{name}.safetensors")]) == 0
    full, split = (load_file(tmp_path / f"{n}.safetensors") for n in ("one", "tp2"))
    assert full.keys() == split.keys()
    for key in full:
        assert full[key].shape == split[key].shape, key
        torch.testing.assert_close(split[key], full[key], rtol=1e-4, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cli_tp2_dp2_checkpoint_resumes_on_dp2(tmp_path):
    """A tp 2 x dp 2 ZeRO-3 checkpoint resumes on 2 ranks without TP (dp 2, ZeRO-1): DCP
    reshards the (dp, tp)-split DTensors."""
    four = _train(tmp_path, "tp2dp2", "--nproc", "4", "--tp", "2", "--zero", "3", "--micro-batch", "1",
                  "--checkpoint-every", "2", timeout=600)
    _train(tmp_path, "dp2", "--nproc", "2", "--zero", "1", "--micro-batch", "1",
           "--resume", str(tmp_path / "tp2dp2" / "checkpoints" / "step_2"))
    for a, b in zip(_losses(tmp_path, "dp2"), four["losses"][2:], strict=True):
        assert math.isclose(a, b, rel_tol=FP32_RTOL)
