"""`tenfold train --pp`: bad pipeline settings exit 2 with one line before any rank starts,
and `--nproc 2 --pp 2` gives the one-process loss curve through the real CLI, trainer and
data loader (on a smaller shape)."""

from __future__ import annotations

import math

import pytest
from conftest import read_metrics, train_summary

from tenfold.cli import main

BAD_PIPELINES = [
    (["--nproc", "2", "--pp", "2", "--grad-accum", "1"], "train.grad_accum=1 < parallel.pp_degree=2"),
    (["--nproc", "3", "--pp", "2", "--grad-accum", "4"], "must divide the number of processes (3)"),
    (["--pp", "2", "--grad-accum", "4"], "must divide the number of processes (1)"),
    (["--nproc", "2", "--pp", "2", "--grad-accum", "4", "--pp-schedule", "interleaved", "--virtual-stages", "4"],
     "8 pipeline stages"),
    (["--nproc", "2", "--pp", "2", "--grad-accum", "3", "--pp-schedule", "interleaved", "--virtual-stages", "2"],
     "multiple of parallel.pp_degree"),
    (["--nproc", "2", "--pp", "2", "--grad-accum", "4", "--virtual-stages", "2"], "needs an interleaved schedule"),
    (["--nproc", "2", "--pp", "2", "--grad-accum", "4", "--pp-split", "3,3"], "summing to model.n_layers (4)"),
    (["--nproc", "2", "--pp", "2", "--grad-accum", "4", "--pp-split", "1,x"], "--pp-split"),
    (["--nproc", "2", "--pp", "2", "--grad-accum", "4", "--pp-schedule", "dualpipe"], "parallel.pp_schedule"),
    (["--nproc", "4", "--pp", "2", "--grad-accum", "4", "--pp-schedule", "zero-bubble", "--virtual-stages", "2",
      "--zero", "1"], "needs parallel.zero_stage 2 or 3"),
]


@pytest.mark.parametrize("flags,needle", BAD_PIPELINES)
def test_bad_pipeline_settings_exit_2(tmp_path, capsys, flags, needle):
    out = tmp_path / "never"
    try:
        code = main(["train", "--out", str(out), "--no-progress", "--micro-batch", "2", *flags])
    except SystemExit as e:  # argparse errors
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


def _train(tmp_path, name: str, *flags: str) -> dict:
    return train_summary(tmp_path / name, "--steps", "3", "--grad-accum", "4", *flags)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cli_pp2_gives_the_one_process_loss_curve(tmp_path):
    one = _train(tmp_path, "one")
    two = _train(tmp_path, "pp2", "--nproc", "2", "--pp", "2")
    for step, (a, b) in enumerate(zip(two["losses"], one["losses"], strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), (step, a, b)
    # the clipped norm is the norm over both stages' gradients, as on one process
    norms = [[m["grad_norm"] for m in read_metrics(tmp_path / name)] for name in ("one", "pp2")]
    for step, (a, b) in enumerate(zip(*norms, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), (step, a, b)
    assert math.isclose(two["final"]["val_loss"], one["final"]["val_loss"], rel_tol=1e-5)
    pipe = two["pipeline"]
    assert pipe["blocks_per_stage"] == [1, 1] and pipe["bubble_predicted"] == 0.25
    assert len(pipe["bubble_measured_per_pp_rank"]) == 2
    assert len(two["memory"]["measured_per_rank"]) == 2
    assert "pipeline" not in one


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved", "zero-bubble"])
def test_cli_multi_stage_schedules_run_and_give_the_one_process_curve(tmp_path, schedule):
    """Every step of a `tenfold train` with a multi-stage schedule, the step measured for memory
    included: the tensor tracker's hooks broke their stage backward ("Failed to run stage
    backward"), so that step's memory is the process's peak resident set instead (noted)."""
    layers = ["--set", "model.n_layers=4"]  # 2 ranks x 2 virtual stages
    one = _train(tmp_path, "one", *layers)
    two = _train(tmp_path, schedule, "--nproc", "2", "--pp", "2", "--pp-schedule", schedule, *layers,
                 *(["--virtual-stages", "2"] if schedule == "interleaved" else []))
    for step, (a, b) in enumerate(zip(two["losses"], one["losses"], strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), (step, a, b)
    assert "tensor tracker cannot follow" in two["memory"]["note"]
    assert len(two["memory"]["measured_per_rank"]) == 2


TIED = ("--steps", "4", "--set", "model.tie_embeddings=true", "--checkpoint-every", "2")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tied_embeddings_pipelined_resume_exactly_reshard_to_and_from_one_process_and_export_once(tmp_path):
    """A tied model through the real trainer: pp 2 x dp 2 with ZeRO-3 (two copies, FSDP2-sharded
    alike) gives the one-process curve and gradient norm (the tied weight counted once); resumed
    from its step-2 checkpoint it continues bit for bit; its checkpoint resumes on one process and
    a one-process checkpoint resumes on pp 2 (the copy's optimizer state is stored under the tied
    weight's name); the export holds the tied matrix once."""
    import torch
    from safetensors.torch import load_file

    from tenfold.engine.outputs.export import consolidated_model_state
    from tenfold.models.gpt import GPT
    from tenfold.models.presets import get_preset

    one = train_summary(tmp_path / "one", *TIED, "--grad-accum", "4")
    piped = train_summary(tmp_path / "pp", *TIED, "--grad-accum", "2", "--nproc", "4", "--pp", "2", "--zero", "3")
    close = lambda a, b: all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a, b, strict=True))  # noqa: E731
    assert close(piped["losses"], one["losses"]), (piped["losses"], one["losses"])
    norms = [[m["grad_norm"] for m in read_metrics(tmp_path / name)] for name in ("one", "pp")]
    assert close(*norms), norms

    ckpt = tmp_path / "pp" / "checkpoints" / "step_2"
    again = train_summary(tmp_path / "again", *TIED, "--grad-accum", "2", "--nproc", "4", "--pp", "2", "--zero", "3",
                          "--resume", str(ckpt))
    assert again["losses"][-2:] == piped["losses"][-2:], (again["losses"], piped["losses"])
    to_one = train_summary(tmp_path / "to_one", *TIED, "--grad-accum", "4", "--resume", str(ckpt))
    assert close(to_one["losses"][-2:], piped["losses"][-2:]), (to_one["losses"], piped["losses"])
    from_one = train_summary(tmp_path / "from_one", *TIED, "--grad-accum", "4", "--nproc", "2", "--pp", "2",
                             "--resume", str(tmp_path / "one" / "checkpoints" / "step_2"))
    assert close(from_one["losses"][-2:], one["losses"][-2:]), (from_one["losses"], one["losses"])

    saved = consolidated_model_state(tmp_path / "pp" / "checkpoints" / "step_4")
    assert torch.equal(saved["tok_emb.weight"], saved["output.weight"])  # the two stages' copies
    assert main(["export", str(tmp_path / "pp"), "--dtype", "fp32", "--out", str(tmp_path / "m.safetensors")]) == 0
    weights = load_file(str(tmp_path / "m.safetensors"))
    assert "tok_emb.weight" in weights and "output.weight" not in weights
    shape = dict(n_layers=2, d_model=64, n_heads=4, d_ff=128, max_seq_len=64, tie_embeddings=True)
    model = GPT(get_preset("tiny").with_overrides(**shape))
    model.load_state_dict(weights, strict=True)
    assert model.output.weight is model.tok_emb.weight and torch.equal(model.tok_emb.weight, saved["tok_emb.weight"])
