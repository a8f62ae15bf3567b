"""Step memory: categories measured by the tensor tracker, recompute lowers activations in the
planner's order, the planner's prediction within 15% of the measurement, reports, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from memory_runs import measure, step_fn
from tenfold.config import build_config
from tenfold.engine.memory.measure import (
    MEMORY_KEYS,
    measure_step_memory,
    memory_report,
    percent_diff,
    predicted_memory,
)
from tenfold.models.gpt import GPT
from tenfold.models.presets import get_preset
from tenfold.run import resolve_run

F32 = 4


pytestmark = pytest.mark.usefixtures("one_thread")


def test_model_state_categories_are_exact():
    shape = dict(n_layers=2, d_model=64, n_heads=4, d_ff=128, max_seq_len=32)
    m = measure("tiny", "none", 2, 32, accum=2, **shape)
    n = sum(p.numel() for p in GPT(get_preset("tiny").with_overrides(**shape)).parameters())
    assert set(m) == set(MEMORY_KEYS) and all(isinstance(v, int) for v in m.values())
    assert m["params_bytes"] == F32 * n
    assert m["grads_bytes"] == F32 * n  # held at the optimizer step
    assert m["optimizer_bytes"] == 2 * F32 * n + F32 * len(list(GPT(get_preset("tiny").with_overrides(**shape)).parameters()))  # Adam m, v + a step counter per tensor
    cfg = get_preset("tiny").with_overrides(**shape)
    assert m["buffers_bytes"] == 2 * F32 * cfg.max_seq_len * cfg.head_dim  # RoPE cos/sin tables (one entry per element of a head)
    assert m["gathered_params_bytes"] == 0  # fp32: nothing is cast
    assert m["total_bytes"] == m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] + m["activations_bytes"]
    assert m["activations_bytes"] > 0
    assert m["peak_bytes"] >= m["params_bytes"] + m["optimizer_bytes"] + m["buffers_bytes"]


def test_autocast_weight_casts_are_gathered_params_not_activations():
    """bf16 autocast over fp32 parameters on one process: the 16-bit cast of each Linear's
    weight, kept for backward, is measured as `gathered_params_bytes` (2 bytes per element of
    every matmul weight: the blocks' and the output head's), not as activations, whose measure
    is then the fp32 run's save for the 16-bit saved tensors. The planner names the same term.
    Mutation: the tracker filing casts of parameters as activations (as MemTracker does) ->
    gathered 0 and the casts back in the activations."""
    shape = dict(n_layers=2, d_model=64, n_heads=4, d_ff=128, max_seq_len=32)
    half = measure("tiny", "none", 2, 32, dtype="bf16", **shape)
    full = measure("tiny", "none", 2, 32, dtype="fp32", **shape)
    model = GPT(get_preset("tiny").with_overrides(**shape))
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert half["gathered_params_bytes"] == 2 * matmul and full["gathered_params_bytes"] == 0
    assert half["total_bytes"] == sum(half[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                        "gathered_params_bytes", "activations_bytes"))
    assert half["activations_bytes"] < full["activations_bytes"]  # 16-bit saves, no weight copies among them
    cfg = build_config({"model": {"name": "tiny", **shape}, "train": {"micro_batch": 2}, "data": {"seq_len": 32},
                        "precision": {"dtype": "bf16"}})
    planned = predicted_memory(resolve_run(cfg, 1), dtype="bf16")
    assert planned["gathered_params_bytes"] == pytest.approx(half["gathered_params_bytes"], rel=0.25)


@pytest.fixture(scope="module")
def tiny_by_policy() -> dict[str, dict]:
    # the real `tiny` preset at a short sequence (quick on 2 cores)
    policies = ["none", "selective:attention", "every:2", "selective:mlp", "segments:2", "full"]
    return {p: measure("tiny", p, 4, 128) for p in policies}


def test_activation_memory_falls_in_the_planner_order(tiny_by_policy):
    cfg = build_config({"model": {"name": "tiny"}, "train": {"micro_batch": 4}, "data": {"seq_len": 128},
                        "precision": {"dtype": "fp32"}})
    predicted = {}
    for policy in tiny_by_policy:
        cfg.recompute.policy = policy
        predicted[policy] = predicted_memory(resolve_run(cfg, 1), dtype="fp32")["activations_bytes"]
    measured = {p: m["activations_bytes"] for p, m in tiny_by_policy.items()}
    planner_order = sorted(predicted, key=predicted.get, reverse=True)
    assert sorted(measured, key=measured.get, reverse=True) == planner_order
    assert planner_order[0] == "none" and planner_order[-1] == "full"


def test_full_recompute_keeps_under_half_of_none_on_tiny(tiny_by_policy):
    assert tiny_by_policy["full"]["activations_bytes"] < 0.5 * tiny_by_policy["none"]["activations_bytes"]
    # ... and model states do not move
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert tiny_by_policy["full"][key] == tiny_by_policy["none"][key]


@pytest.mark.parametrize("preset, b, s", [("tiny", 4, 128), ("small", 1, 256)])
@pytest.mark.parametrize("policy", ["none", "full", "op"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_prediction_within_15_percent_of_measurement(preset, b, s, policy, dtype):
    """Model states exactly; the gathered parameter copies (bf16: autocast's weight casts)
    within 5% (measured: -2%: the planner casts every parameter, autocast the matmul weights);
    what the forward keeps (activations + gathered copies) and the total within 15%. The
    activations alone within 20%: with full recompute in bf16 the measured high holds the
    recomputed layer's backward temporaries beside its rebuilt activations, which the planner's
    working layer does not (small, full, bf16: +19%; every other case within 11%)."""
    cfg = build_config({"model": {"name": preset}, "train": {"micro_batch": b}, "data": {"seq_len": s},
                        "precision": {"dtype": dtype}, "recompute": {"policy": policy}})
    measured = measure(preset, policy, b, s, dtype=dtype)
    predicted = predicted_memory(resolve_run(cfg, 1), None, dtype)
    diff = percent_diff(measured, predicted)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert diff[key] == 0.0, (key, diff)
    gathered = predicted["gathered_params_bytes"]
    assert measured["gathered_params_bytes"] == pytest.approx(gathered, rel=0.05, abs=0 if gathered else 1)
    forward = [m["activations_bytes"] + m["gathered_params_bytes"] for m in (measured, predicted)]
    assert forward[0] == pytest.approx(forward[1], rel=0.15), (forward, diff)
    assert abs(diff["total_bytes"]) <= 15.0 and abs(diff["activations_bytes"]) <= 20.0, diff


def test_gradient_accumulation_is_tracked_across_micro_batches():
    shape = dict(n_layers=2, d_model=64, n_heads=4, d_ff=128, max_seq_len=32)
    one = measure("tiny", "none", 2, 32, accum=1, **shape)
    two = measure("tiny", "none", 2, 32, accum=2, **shape)  # MemTracker alone refuses a 2nd root forward
    assert two["grads_bytes"] == one["grads_bytes"]
    # the second micro-batch runs while the first one's gradients are held
    assert two["peak_bytes"] > one["peak_bytes"]


def test_memory_report_lists_blocks_and_categories():
    from rich.console import Console

    torch.manual_seed(0)
    model = GPT(get_preset("tiny").with_overrides(n_layers=2, d_model=64, n_heads=4, d_ff=128, max_seq_len=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_step = step_fn(model, opt, [torch.randint(0, 256, (2, 33))])
    run_step()
    report = memory_report(model, opt, run_step, predicted={"params_bytes": 1, "activations_bytes": 1})
    names = [r["module"] for r in report.rows]
    assert {"GPT", "GPT.layers.0", "GPT.layers.1.mlp", "GPT.output"} <= set(names)
    assert report.rows[names.index("GPT.layers.0")]["forward_kept"] > 0
    console = Console(record=True, width=140)
    console.print(report)
    text = console.export_text()
    assert "activations" in text and "GPT.layers.1.attn" in text and "predicted" in text


def test_trainer_summary_carries_predicted_and_measured(small_cfg, tmp_path):
    from tenfold.engine.loop.trainer import Trainer

    summary = Trainer(small_cfg(recompute={"policy": "full"})).fit()
    mem = json.loads((tmp_path / "run" / "summary.json").read_text())["memory"]
    assert mem["measured_step"] == 2 and mem["measured_by"].startswith("tensor tracker")
    assert set(mem["predicted"]) == set(mem["measured"]) == set(MEMORY_KEYS)
    for key in ("params_bytes", "grads_bytes"):
        assert mem["measured"][key] == mem["predicted"][key]
        assert mem["diff_percent"][key] == 0.0
    assert summary["memory"] == mem


def test_cli_memory_report_prints_and_writes_nothing(tmp_path, capsys):
    from conftest import SMALL_FLAGS
    from tenfold.cli import main

    out = tmp_path / "out"
    assert main(["train", *SMALL_FLAGS, "--precision", "fp32", "--ac", "selective:mlp", "--memory-report",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "GPT.layers.0.mlp" in text and "activations" in text and "predicted" in text
    assert not out.exists()


@pytest.mark.parametrize("flag, message", [("every:0", "every:N"), ("segments:x", "segments:K"), ("offload", "CUDA")])
def test_cli_bad_or_unsupported_policy_exits_2(tmp_path, capsys, flag, message):
    if flag == "offload" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: offload is allowed here")
    from conftest import SMALL_FLAGS
    from tenfold.cli import main

    out = tmp_path / "out"
    assert main(["train", *SMALL_FLAGS, "--ac", flag, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and flag in err[0]
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("policy, expected", [("every:4", 0.9), ("segments:4", 1.2)])
def test_cli_prediction_for_layer_counts_the_policy_does_not_divide(tmp_path, policy, expected):
    """6 layers: every:4 recomputes block 3 alone, segments:4 the groups [0,1], [2,3], [4];
    the planner counts exactly those blocks (tenfold.terms). The tracker counts bytes, so the
    prediction's error is the same on every run (torch 2.13, fp32: +0.9% and +1.2%), and it is
    held to 0.7 points: segments split another way in the engine move it by about 2 points (5
    runs instead of 4), which a 15% tolerance let through. fp32, named: the figures are
    bytes of fp32 activations whatever the machine's `auto` precision."""
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tenfold", "train", "--model", "tiny", "--set", "model.n_layers=6",
                           "--ac", policy, "--steps", "2", "--no-progress", "--precision", "fp32", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff = json.loads((out / "summary.json").read_text())["memory"]["diff_percent"]
    assert diff["activations_bytes"] == pytest.approx(expected, abs=0.7), diff


def test_a_module_entered_twice_measures_without_torchs_file_a_bug_warning():
    """ModTracker warns "Please file a bug to PyTorch" when a module runs inside itself; nothing
    a user can act on, so it is not shown, and the process's warning format is left as it was."""
    import warnings

    from torch.distributed._tools.mod_tracker import ModTracker

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, inner=False):
            return self.lin(x) if inner else self(x, inner=True)

    model = Twice()
    opt = torch.optim.AdamW(model.parameters())
    formatwarning = warnings.formatwarning

    def step():
        model(torch.randn(4, 8)).sum().backward()
        opt.step()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ModTracker():  # the warning is real: torch's own tracker gives it on this model
            model(torch.randn(4, 8))
        warnings.formatwarning = formatwarning
        assert any("file a bug" in str(w.message) for w in caught)
        caught.clear()
        measured = measure_step_memory(model, opt, step)
    assert measured["params_bytes"] == 8 * 8 * 4 + 8 * 4
    assert not [w for w in caught if "file a bug" in str(w.message)], [str(w.message) for w in caught]
    assert warnings.formatwarning is formatwarning


def test_pipeline_receive_buffers_count_from_the_steps_start():
    """torch.distributed.pipelining makes its receive buffers at the first step and keeps them;
    a later step that never touches one still holds it: the tracker files each as an activation
    from the tracked step's start (checked on a stand-in with PipelineStage's attributes; the
    trace checks the real stages, tests/test_trace.py)."""
    from types import SimpleNamespace

    from tenfold.engine.memory.tensor_tracker import measure_cpu, pipeline_receive_buffers

    layer = torch.nn.Linear(8, 8)
    inputs = [SimpleNamespace(buffer=torch.zeros(64, 8)) for _ in range(3)]
    grads = [SimpleNamespace(buffer=torch.zeros(32, 8)), SimpleNamespace(buffer=None)]
    stage = SimpleNamespace(args_recv_info={i: (x,) for i, x in enumerate(inputs)},
                            grad_recv_info={i: (g,) for i, g in enumerate(grads)})
    model = torch.nn.Sequential(layer)
    model.runner = SimpleNamespace(stages=[stage])
    assert len(pipeline_receive_buffers(model)) == 4
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)

    def step() -> None:  # no activations of its own: the forward's output is freed at once
        with torch.no_grad():
            model(torch.zeros(1, 8))

    measured, _ = measure_cpu(model, optimizer, step, torch.device("cpu"))
    assert measured["activations_bytes"] >= (3 * 64 + 32) * 8 * F32
