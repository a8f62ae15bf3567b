"""Figures a user can trust: steady-state tokens/s with the warm-up apart, MFU never above 100%
(and none for a dtype without fast kernels), the measured peak and its cache, noted predicted-vs-measured rows,
the memory fallback without torch's private tracker, ladder.png's axes and labels, printed
paths, and the warning when a resume changes the global batch."""

from __future__ import annotations

import json
import logging

import pytest

from conftest import read_metrics, small_config, table_text
from tenfold.cli import main
from tenfold.config import build_config
from tenfold.engine.observe import peak as peak_mod
from tenfold.engine.memory.notes import row_notes
from tenfold.engine.observe.steady import StepTime, steady_state
from tenfold.engine.observe.summary import mfu
from tenfold.engine.loop.trainer import Trainer
from tenfold.plan.for_run import fmt_bytes

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- warm-up


def _times(seconds, tokens=100, instrumented=()):
    return [StepTime(i + 1, s, tokens, instrumented=i + 1 in instrumented) for i, s in enumerate(seconds)]


def test_warmup_is_the_leading_slow_steps():
    """A run whose steps 1-3 at ~400 tok/s, then ~1,900: the summary reports ~1,900."""
    s = steady_state(_times([0.25, 0.24, 0.26, 0.053, 0.052, 0.054], tokens=100))
    assert s["warmup_steps"] == 3 and s["steady_from_step"] == 4
    assert s["warmup_s"] == pytest.approx(0.75)
    assert s["tokens_per_s"] == pytest.approx(300 / (0.053 + 0.052 + 0.054))


def test_a_later_slow_step_is_steady_state_and_the_measured_step_is_apart():
    s = steady_state(_times([0.5, 2.0, 0.1, 0.1, 0.3, 0.1, 0.1, 0.1], instrumented={2}))
    assert s["warmup_steps"] == 1 and s["steady_from_step"] == 3  # step 2 (tracker) is not warm-up
    assert s["memory_measurement_s"] == pytest.approx(2.0)
    assert s["steady_s"] == pytest.approx(0.8)  # the slow step 5 stays in: noise is steady state too
    assert steady_state(_times([0.4]))["warmup_steps"] == 0  # one step: nothing to compare with
    assert steady_state([])["tokens_per_s"] is None


def test_summary_tokens_per_s_is_the_steady_rate_of_the_logged_steps(tmp_path):
    cfg = small_config(tmp_path, train={"steps": 6})
    summary = Trainer(build_config(cfg)).fit()
    rows = read_metrics(tmp_path / "run")
    measured_step = summary["memory"]["measured_step"]
    per_step = summary["batch"]["global_batch"] * summary["batch"]["seq_len"]
    again = steady_state([StepTime(r["step"], r["step_time_s"], per_step, r["step"] == measured_step) for r in rows])
    f = summary["final"]
    assert f["tokens_per_s"] == pytest.approx(again["tokens_per_s"])
    assert f["warmup_steps"] == again["warmup_steps"] and f["warmup_s"] == pytest.approx(again["warmup_s"])
    assert f["tokens_per_s_overall"] == pytest.approx(f["tokens"] / f["wall_s"])
    assert f["tokens_per_s_overall"] < f["tokens_per_s"]  # the wall time has the warm-up and the evaluation


def test_a_resumed_run_reports_its_own_rate_and_its_memory(tmp_path, capsys):
    """`--resume auto`: the overall rate is this run's tokens over this run's wall time (not the
    earlier run's tokens too), and the memory rows are there (this run's second step measured)."""
    Trainer(build_config(small_config(tmp_path, train={"steps": 3}))).fit()
    cfg = small_config(tmp_path, train={"steps": 6}, checkpoint={"resume": "auto"})
    summary = Trainer(build_config(cfg)).fit()
    f, per_step = summary["final"], summary["batch"]["global_batch"] * summary["batch"]["seq_len"]
    assert f["tokens"] == 6 * per_step and f["tokens_this_run"] == 3 * per_step and f["first_step"] == 4
    assert f["tokens_per_s_overall"] == pytest.approx(3 * per_step / f["wall_s"])
    memory = summary["memory"]
    assert memory["measured_step"] == 5 and memory["measured"]["params_bytes"] > 0
    out = table_text(capsys.readouterr().out)
    assert f"{6 * per_step:,} ({3 * per_step:,} in this run, resumed at step 3)" in out
    assert "over this run's whole wall time" in out and "memory: peak, tracked tensors" in out
    assert "measured at step 5" in out


# --------------------------------------------------------------------------- MFU and the peak


def test_mfu_is_never_above_100_percent():
    assert mfu(6e6, 1000.0, 1e10, 1) == (pytest.approx(0.6), None)
    value, note = mfu(6e6, 1000.0, 1e9, 1)  # 6 GFLOP/s achieved against a 1 GFLOP/s "peak"
    assert value is None and "exceed the peak used for MFU" in note


def test_the_reported_mfu_is_model_flops_times_tokens_per_s_over_the_peak(tmp_path):
    """On the path the Trainer takes: the FLOPs per token counted here from the trained model's
    own parameters (6N, Kaplan et al. 2020: N = the blocks' parameters and the output projection,
    tied or not; + 12 L s d for attention scores and values, PaLM App. B), the measured peak, the
    rate the run reports: summary and every metrics row give flops x tokens/s / peak."""
    peak, _ = peak_mod.mfu_peak("fp32")  # measured (bounded) or cached: the run starts with it
    trainer = Trainer(build_config(small_config(tmp_path, train={"steps": 4})))
    summary = trainer.fit()
    params = dict(trainer.model.named_parameters(remove_duplicate=False))
    n = sum(p.numel() for name, p in params.items() if name.startswith("layers.")) + params["output.weight"].numel()
    shape, seq = summary["config"]["model"], summary["batch"]["seq_len"]
    flops = 6.0 * n + 12.0 * shape["n_layers"] * seq * shape["d_model"]
    peak, _ = peak_mod.mfu_peak("fp32")  # a figure measured busy may have been raised at the end
    assert summary["model"]["flops_per_token"] == pytest.approx(flops, rel=1e-12)
    assert summary["hardware"]["peak_flops_per_device"] == pytest.approx(peak, rel=1e-12)
    f = summary["final"]
    assert f["mfu"] is not None and f["mfu"] == pytest.approx(flops * f["tokens_per_s"] / peak, rel=1e-9)
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 4 and all(r["mfu"] is not None and r["mfu"] <= 1.0 for r in rows)


@pytest.mark.parametrize("fast, fp16_peak, outcome", [
    (False, None, "no fast kernels"),  # no fp16 matrix instructions: most x86 CPUs (186.8% MFU before the rule)
    (True, 1e16, "mfu"),  # a CPU with fast fp16 matmuls: the MFU against the fp16 peak
    (True, 2e3, "above 100%"),  # a cached peak (2 kFLOP/s) every run beats
])
def test_fp16_on_this_cpu_reports_no_mfu_above_100_percent(tmp_path, monkeypatch, fast, fp16_peak, outcome):
    """An fp16 run on a CPU against each cached peak (measured on a quiet machine, so nothing
    is measured again): without fp16 matrix instructions no MFU and the reason; with them
    exactly model FLOPs x tokens/s over the fp16 peak; against a peak the run beats no MFU
    with the reason, never above 100%, and the peak marked to be measured again.
    Mutations: the fast-kernel rule (engine/observe/peak.mfu_peak) or the 100% cap (engine/observe/summary.mfu)
    removed -> an MFU is reported where none may be."""
    monkeypatch.setenv("TENFOLD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak_mod, "fast_kernels", lambda dtype: dtype != "fp16" or fast)
    cache = tmp_path / "cpu_peak.json"
    if fp16_peak is not None:
        cache.write_text(json.dumps({peak_mod.cpu_key(): {"fp16": fp16_peak, "load_per_core": {"fp16": 0.1}}}))
    cfg = small_config(tmp_path, precision={"dtype": "fp16"}, train={"steps": 2})
    summary = Trainer(build_config(cfg)).fit()
    f, rows = summary["final"], read_metrics(tmp_path / "run")
    assert len(rows) == 2
    if outcome == "no fast kernels":
        assert f["mfu"] is None and "fp16 matmuls have no fast kernels on this CPU (no avx512_fp16" in f["mfu_note"]
        assert all(r["mfu"] is None for r in rows)
    elif outcome == "mfu":
        assert f["mfu"] == pytest.approx(summary["model"]["flops_per_token"] * f["tokens_per_s"] / fp16_peak, rel=1e-9)
        assert 0 < f["mfu"] < 1 and all(0 < r["mfu"] < 1 for r in rows)
    else:
        assert f["mfu"] is None and "exceed the peak used for MFU" in f["mfu_note"]
        assert all(r["mfu"] is None for r in rows)
        assert "fp16" in json.loads(cache.read_text())[peak_mod.cpu_key()]["exceeded"]


def test_a_stale_low_peak_gives_no_mfu_says_why_and_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TENFOLD_CACHE_DIR", str(tmp_path))
    key = peak_mod.cpu_key()
    low = {"fp32": 1.0, "load_per_core": {"fp32": 0.1}}  # 1 FLOP/s, "measured quiet"
    (tmp_path / "cpu_peak.json").write_text(json.dumps({key: low}))
    summary = Trainer(build_config(small_config(tmp_path, train={"steps": 2}))).fit()
    assert summary["final"]["mfu"] is None and "measured again at the end of the next run" in summary["final"]["mfu_note"]
    assert all(r["mfu"] is None for r in read_metrics(tmp_path / "run"))
    entry = json.loads((tmp_path / "cpu_peak.json").read_text())[key]
    assert entry["exceeded"]["fp32"] > 1.0  # the run's rate: the cached figure is known to be too low
    assert peak_mod.cpu_peak_flops("fp32", measure=False) == 1.0  # a run's start: never a measurement
    monkeypatch.setattr(peak_mod, "load_per_core", lambda: 3.0)  # even on a busy machine
    monkeypatch.setattr(peak_mod, "measure_peak", lambda dtype: 5e10)
    assert peak_mod.cpu_peak_flops("fp32") == 5e10
    entry = json.loads((tmp_path / "cpu_peak.json").read_text())[key]
    assert "fp32" not in entry["exceeded"] and entry["fp32"] == 5e10
    monkeypatch.setattr(peak_mod, "measure_peak", lambda dtype: 1e9)  # not measured again: nothing says so
    assert peak_mod.cpu_peak_flops("fp32") == 5e10


def test_plan_and_train_use_one_peak_for_the_same_run(tmp_path, monkeypatch):
    """A run with a thread per core and `tenfold plan --gpu cpu` read the same cached figure, and
    N ranks share it alike: `plan` prices each at 1/N of it as `train` with N ranks reports."""
    import os

    import torch

    from tenfold.plan.hardware import get_hardware
    from tenfold.plan.step_time import compute_share

    monkeypatch.setenv("TENFOLD_CACHE_DIR", str(tmp_path))
    rates = {"fp32": 90e9, "bf16": 300e9, "fp16": 2e9}
    monkeypatch.setattr(peak_mod, "measure_peak", lambda dtype: rates[dtype])
    monkeypatch.setattr(peak_mod, "fast_kernels", lambda dtype: True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(os.cpu_count())
        trained = {n: peak_mod.mfu_peak("bf16", ranks=n)[0] for n in (1, 2, 4)}
    finally:
        torch.set_num_threads(threads)
    hw = get_hardware("cpu")
    assert hw.peak_flops == {"bf16": 300e9}  # what was measured: nothing else, nothing measured here
    assert {n: hw.peak("bf16") * compute_share(hw, n) for n in (1, 2, 4)} == trained
    assert trained[2] == 150e9 and str(tmp_path) in peak_mod.peak_source("cpu") and str(tmp_path) in hw.sources["peak"]


def test_a_16_bit_format_without_matrix_instructions_gets_no_mfu_and_no_measurement(monkeypatch):
    def never(dtype, *args, **kwargs):
        raise AssertionError(f"{dtype} measured")

    monkeypatch.setattr(peak_mod, "cpu_peak_flops", never)
    monkeypatch.setattr(peak_mod, "cpu_has_bf16_matmul", lambda: False)
    monkeypatch.setattr(peak_mod, "cpuinfo_field", lambda name: "fpu sse avx512f")
    for dtype, flags in (("bf16", "avx512_bf16 or amx_bf16"), ("fp16", "avx512_fp16 or amx_fp16")):
        value, note = peak_mod.mfu_peak(dtype)
        assert value is None and f"{dtype} matmuls have no fast kernels" in note and flags in note
    monkeypatch.setattr(peak_mod, "cpuinfo_field", lambda name: "fpu avx512f avx512_fp16")
    monkeypatch.setattr(peak_mod, "cpu_peak_flops", lambda dtype, threads, measure: {"fp16": 7e10}[dtype])
    assert peak_mod.mfu_peak("fp16") == (7e10, None)


def test_a_peak_from_another_torch_or_thread_count_is_measured_again(tmp_path, monkeypatch):
    """The cache key names the machine, the torch version and the thread count: a change of
    either measures again, and this machine's figures from another torch are dropped."""
    from tenfold.plan import cpu_peak

    monkeypatch.setenv("TENFOLD_CACHE_DIR", str(tmp_path))
    measured = iter([7e9, 8e9, 9e9])
    monkeypatch.setattr(peak_mod, "measure_peak", lambda dtype: next(measured))
    old_format = f"{cpu_peak.cpu_model_name()}|threads=2"  # keyed by an older rule
    (tmp_path / "cpu_peak.json").write_text(json.dumps({old_format: {"fp32": 1.0}, "Other CPU|threads=4": {"fp32": 2.0}}))
    assert peak_mod.cpu_peak_flops("fp32", threads=1) == 7e9
    assert peak_mod.cpu_peak_flops("fp32", threads=2) == 8e9  # another thread count: its own figure
    assert peak_mod.cpu_peak_flops("fp32", threads=1) == 7e9  # cached
    monkeypatch.setattr(cpu_peak, "torch_version", lambda: "9.9.9")
    assert peak_mod.cpu_peak_flops("fp32", threads=1) == 9e9  # another torch: measured again
    cache = json.loads((tmp_path / "cpu_peak.json").read_text())
    assert set(cache) == {peak_mod.cpu_key(1), "Other CPU|threads=4"}  # this machine's stale ones dropped
    assert cpu_peak.cached_peak("fp32", 1) == 9e9  # the planner reads the same entry


def test_a_peak_measured_on_a_busy_machine_is_measured_again_when_quieter(tmp_path, monkeypatch):
    """A peak cached at load 2.0 per core is re-measured once the machine is quiet, and the
    higher figure is kept; neither a still-busy machine nor one measured quiet measures again."""
    monkeypatch.setenv("TENFOLD_CACHE_DIR", str(tmp_path))
    rates = iter([40e9, 410e9, 300e9])
    monkeypatch.setattr(peak_mod, "measure_peak", lambda dtype: next(rates))
    monkeypatch.setattr(peak_mod, "load_per_core", lambda: 2.0)
    assert peak_mod.cpu_peak_flops("bf16") == 40e9  # measured busy
    assert peak_mod.cpu_peak_flops("bf16") == 40e9  # still as busy: not measured again
    monkeypatch.setattr(peak_mod, "load_per_core", lambda: 1.0)
    assert peak_mod.cpu_peak_flops("bf16") == 40e9  # less busy, still busy: not measured again
    monkeypatch.setattr(peak_mod, "load_per_core", lambda: 0.3)
    assert peak_mod.cpu_peak_flops("bf16", measure=False) == 40e9  # a run's start waits on nothing
    assert peak_mod.cpu_peak_flops("bf16") == 410e9  # quieter: measured again
    monkeypatch.setattr(peak_mod, "load_per_core", lambda: 0.1)
    assert peak_mod.cpu_peak_flops("bf16") == 410e9  # measured quiet: kept (the 300e9 is never drawn)
    entry = json.loads((tmp_path / "cpu_peak.json").read_text())[peak_mod.cpu_key()]
    assert entry["bf16"] == 410e9 and entry["load_per_core"]["bf16"] == 0.3


# --------------------------------------------------------------------------- memory table


MEASURED = {"params_bytes": 50, "grads_bytes": 50, "optimizer_bytes": 100, "activations_bytes": 300,
            "total_bytes": 500, "peak_bytes": 420}
PREDICTED = {"params_bytes": 100, "grads_bytes": 50, "optimizer_bytes": 100, "activations_bytes": 0,
             "total_bytes": 250, "peak_bytes": 250 + 50 * 2**20, "other_bytes": 50 * 2**20}


def test_each_row_that_counts_differently_says_how():
    zero2 = row_notes(PREDICTED, MEASURED, zero_stage=2, dp=2, user_module=True)
    assert "fp32 shard" in zero2["params_bytes"] and "DeepSpeed's ZeRO-2" in zero2["params_bytes"]
    assert "not predicted for your own module" in zero2["activations_bytes"]
    # the planner prices the buffers of the engine that runs (FSDP2's unit at ZeRO-2, DDP's buckets below)
    assert "below the sum" in zero2["peak_bytes"] and "50.00 MiB of communication buffers" in zero2["peak_bytes"]
    assert "upper bound of the peak" in zero2["total_bytes"]
    assert "gathered params" in zero2["params_bytes"] and "optimizer_bytes" not in zero2
    offloaded = row_notes(PREDICTED, MEASURED, zero_stage=2, dp=2, user_module=False, offload="optimizer", on_cpu=True)
    assert "host memory too" in offloaded["optimizer_bytes"]
    plain = row_notes(PREDICTED, MEASURED, zero_stage=0, dp=2, user_module=False)
    assert "params_bytes" not in plain and "activations_bytes" not in plain
    assert "lacks" not in plain["peak_bytes"] and "lacks" not in zero2["peak_bytes"]
    assert row_notes(PREDICTED, None, 2, 2, False) == {}


def test_summary_has_the_notes_and_the_table_shows_them(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "2", "--precision", "fp32",
                 "--set", "model.n_layers=2", "--set", "model.d_model=64", "--set", "model.n_heads=4",
                 "--set", "model.d_ff=128", "--set", "model.max_seq_len=64", "--seq-len", "32",
                 "--set", "data.max_bytes=300000", "--set", "log.tensorboard=false"]) == 0
    memory = json.loads((tmp_path / "run" / "summary.json").read_text())["memory"]
    assert {"total_bytes", "peak_bytes"} <= set(memory["notes"])
    text = capsys.readouterr().out
    out = " ".join(text.split())  # the table wraps long cells
    assert "upper bound of the" in out and "warm-up" in out
    # two peaks, each labelled for what it is: the process's resident set on the step lines and
    # in its own row, the tracked tensors of one step beside the planner's prediction
    assert memory["peak_mem_of"] == "peak RSS" and memory["measured_by"] == "tensor tracker (MemTracker)"
    steps = [ln for ln in text.splitlines() if ln.startswith("step ")]
    assert len(steps) == 2 and all("| peak RSS " in ln and "peak mem" not in ln for ln in steps), steps
    cells = table_text(text)
    rss = f"memory: peak RSS (process) {fmt_bytes(memory['peak_mem_bytes'])}"
    assert rss in cells and "the process's highest resident set" in cells, cells
    tensors = f"memory: peak, tracked tensors {fmt_bytes(memory['predicted']['peak_bytes'])} predicted, "
    assert tensors + f"{fmt_bytes(memory['measured']['peak_bytes'])} measured" in cells, cells


def test_without_torchs_tensor_tracker_the_run_trains_and_says_so(tmp_path, monkeypatch, caplog):
    from tenfold.engine.memory import tracker_probe

    monkeypatch.setattr(tracker_probe, "_TRACKER_PROBE", None)
    monkeypatch.setitem(__import__("sys").modules, "torch.distributed._tools.mem_tracker", None)
    usable, why = tracker_probe.tracker_available()
    assert not usable and "torch.distributed._tools.mem_tracker" in why
    with caplog.at_level(logging.WARNING, logger="tenfold"):
        summary = Trainer(build_config(small_config(tmp_path, train={"steps": 3}))).fit()
    assert summary["final"]["steps"] == 3 and summary["memory"]["measured"] is None
    assert summary["memory"]["note"].startswith("memory was not measured")
    assert any("memory was not measured" in r.message for r in caplog.records)


# --------------------------------------------------------------------------- ladder.png


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_ladder_png_axes_are_linear_and_no_label_overlaps():
    from tenfold.ladder.measure import RungResult
    from tenfold.ladder.report import add_multipliers, figure

    mib = 2**20
    mem = {"params_bytes": 14 * mib, "grads_bytes": 14 * mib, "optimizer_bytes": 28 * mib, "activations_bytes": 200 * mib}
    rungs = [RungResult(i, n, n, "measured", None, {}, tokens_per_s=t, predicted_tokens_per_s=p,
                        peak_mem_bytes=250 * mib, predicted_peak_bytes=260 * mib, memory=dict(mem))
             for i, (n, t, p) in enumerate([("fp32", 700, 650), ("mixed", 1500, 1700), ("accum", 1600, 1650),
                                            ("recompute", 1300, 1250), ("zero", 1900, 2100)])]
    rungs.append(RungResult(5, "pipeline", "pipeline", "skipped", "needs 2 ranks", {}, predicted_tokens_per_s=1800))
    add_multipliers(rungs)
    fig = figure(rungs, {"model": "tiny", "budget_tokens": 65536, "hardware": {"description": "cpu"}})
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax_t, ax_m = fig.axes
    assert ax_t.get_yscale() == ax_m.get_yscale() == "linear" and ax_t.get_ylim()[0] == 0
    assert ax_t.get_ylim()[1] >= 2100  # every marker inside the axes
    texts = [t.get_window_extent(renderer) for t in ax_t.texts]
    assert len(texts) == 6  # five speed-ups and one status
    markers = [p for coll in ax_t.collections for p in ax_t.transData.transform(coll.get_offsets())]
    for i, box in enumerate(texts):
        assert not any(_overlap(box, other) for other in texts[i + 1:])
        assert not any(box.x0 - 6 < x < box.x1 + 6 and box.y0 - 6 < y < box.y1 + 6 for x, y in markers)
    for ax in (ax_t, ax_m):
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels()]
        assert all(not _overlap(a, b) for a, b in zip(ticks, ticks[1:]))
        assert all(t.get_rotation() == 0 for t in ax.get_xticklabels())


# --------------------------------------------------------------------------- paths and resume


def test_plan_plot_says_where_it_wrote(tmp_path, capsys):
    png = tmp_path / "mem.png"
    assert main(["plan", "--model", "tiny", "--gpu", "a100-80gb", "--plot", str(png), "--json"]) == 0
    captured = capsys.readouterr()
    assert png.is_file() and f"wrote {png}" in captured.err
    json.loads(captured.out)  # --json stays pure JSON


def test_resume_with_another_global_batch_warns(tmp_path, caplog):
    Trainer(build_config(small_config(tmp_path, train={"steps": 2, "micro_batch": 4}))).fit()
    same = small_config(tmp_path, train={"steps": 3, "micro_batch": 4}, checkpoint={"resume": "auto"})
    with caplog.at_level(logging.WARNING, logger="tenfold"):
        Trainer(build_config(same)).fit()
    assert not [r for r in caplog.records if "global batch" in r.message]
    other = small_config(tmp_path, train={"steps": 4, "micro_batch": 4, "global_batch": 8},
                         checkpoint={"resume": "auto"})
    with caplog.at_level(logging.WARNING, logger="tenfold"):
        Trainer(build_config(other)).fit()
    (warning,) = [r.message for r in caplog.records if "global batch" in r.message]
    assert "changes from 4 to 8 sequences per step" in warning and "--global-batch 4" in warning


def test_a_checkpoint_saved_before_the_batch_was_recorded_still_loads():
    """trainer_state.json from a tenfold without `global_batch` validates against a fresh run's
    counters (0: unknown, so no warning); once known, the batch is saved."""
    from tenfold.engine.outputs.checkpoint.states import JsonState
    from tenfold.engine.loop.trainer import TrainState

    fresh = TrainState()
    JsonState(fresh, "state").validate({"step": 3, "tokens": 96, "skipped": 0, "history": [[1, 5.0]]})
    fresh.load_state_dict({"step": 3, "tokens": 96, "skipped": 0, "history": [[1, 5.0]]})
    assert fresh.step == 3 and fresh.global_batch == 0
    fresh.global_batch = 8
    assert JsonState(fresh, "state").state_dict()["global_batch"] == 8
