"""`tenfold ladder`: rung configs, the memory-budget choice, multipliers, outputs, skipped and
failed rungs, the projection, bad options. One small real ladder (two measured rungs on a
shrunken `tiny`) is shared by the output tests; no timing is asserted (docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from tenfold.cli import main
from tenfold.errors import UserError
from tenfold.ladder import parse_bytes, parse_rungs
from tenfold.ladder import rungs as R
from tenfold.ladder.measure import RungResult, run_rung, steady_tokens_per_s
from tenfold.ladder.predict import Prediction, choose_micro_batch
from tenfold.ladder.report import COLUMNS, add_multipliers, best_line, best_rung, fmt_multiplier, markdown, table_rows

# `tiny` shrunk (conftest.SMALL_MODEL) so that one rung is a few seconds of a 2-core CPU.
SMALL = [
    "--set", "model.n_layers=2", "--set", "model.d_model=64", "--set", "model.n_heads=4",
    "--set", "model.d_ff=128", "--set", "model.max_seq_len=64", "--seq-len", "32",
    "--set", "data.max_bytes=200000",
]
SMALL_LAYERS = [{"model": {"name": "tiny", "n_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 128, "max_seq_len": 64}},
                {"data": {"seq_len": 32, "max_bytes": 200_000}}]


def _setup(**kw) -> R.LadderSetup:
    base = dict(seq_len=32, global_batch=8, budget_tokens=32 * 16, nproc=2, pp=2, zero_stage=3,
                ac_policy="full", mixed_dtype="bf16", eval_seqs=8)
    base.update(kw)
    return R.LadderSetup(**base)


# --------------------------------------------------------------------------- rung configs


def test_rungs_are_cumulative_and_train_the_same_tokens():
    s = _setup()
    specs = [R.fp32_rung(s), R.mixed_rung(s), R.accum_rung(s), R.recompute_rung(s, 4, ""),
             R.zero_rung(s, 4), R.pipeline_rung(s, 4)]
    k = [sp.knobs for sp in specs]
    assert [x["precision"] for x in k] == ["fp32"] + ["bf16"] * 5
    assert (k[0]["global_batch"], k[1]["global_batch"]) == (1, 1)
    assert all(x["global_batch"] == 8 for x in k[2:])
    assert k[2]["micro_batch"] == 1 and k[2]["grad_accum"] == 8
    assert k[3]["micro_batch"] == 4 and k[3]["recompute"] == "full"
    assert k[4]["dp"] == 2 and k[4]["zero_stage"] == 3 and k[4]["recompute"] == "full"
    assert k[5]["pp"] == 2 and k[5]["grad_accum"] >= 2  # a pipeline needs >= pp micro-batches
    for x in k:  # the same budget: steps x global batch x seq_len
        assert x["steps"] * x["global_batch"] * s.seq_len == s.budget_tokens
    for sp in specs:  # the same validation sequences in every rung
        t = sp.overrides["train"]
        assert t["eval_batches"] * t["micro_batch"] == s.eval_seqs


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_a_cpu_without_bf16_instructions_skips_the_mixed_rung_and_the_rest_train_in_fp32(monkeypatch, fast_bf16):
    from tenfold import host
    from tenfold.ladder import machine

    monkeypatch.setattr(machine, "device_type", lambda: "cpu")
    monkeypatch.setattr(host, "cpu_has_bf16_matmul", lambda: fast_bf16)
    dtype, skip = machine.mixed_precision()
    assert (dtype, skip is None) == (("bf16", True) if fast_bf16 else ("fp32", False))
    s = _setup(mixed_dtype=dtype, mixed_skip=skip)
    mixed = R.mixed_rung(s)
    assert mixed.skip == skip and (fast_bf16 or "no bf16 matrix instructions" in mixed.skip)
    assert mixed.knobs["precision"] == "bf16" and mixed.title.endswith("(bf16)")  # what it runs, or would
    later = [R.accum_rung(s), R.recompute_rung(s, 4, ""), R.zero_rung(s, 4), R.pipeline_rung(s, 4)]
    assert {sp.knobs["precision"] for sp in later} == {dtype}


def test_skips_name_the_reason():
    one = _setup(nproc=1)
    assert "at least 2" in R.zero_rung(one, 4).skip
    assert "2 stages on 2 processes" in R.pipeline_rung(one, 4).skip
    assert "does not divide" in R.pipeline_rung(_setup(nproc=3, global_batch=9), 3).skip
    assert R.zero_rung(_setup(), 4).skip is None and R.pipeline_rung(_setup(), 4).skip is None


def test_set_args_round_trip_through_the_config():
    from tenfold.config import build_config, parse_set_item

    spec = R.recompute_rung(_setup(), 2, "")
    args = spec.set_args()
    items = [args[i + 1] for i in range(0, len(args), 2)]
    cfg = build_config(*SMALL_LAYERS, *[parse_set_item(i) for i in items])
    assert cfg.recompute.policy == "full" and cfg.train.micro_batch == 2 and cfg.train.grad_accum == 4
    assert cfg.precision.dtype == "bf16" and cfg.log.tensorboard is False


def test_budget_rounds_up_to_whole_global_batches():
    assert R.budget_tokens(1000, 32, 8) == 1024
    assert R.budget_tokens(1, 32, 8) == 256
    assert R.budget_tokens(512, 32, 8) == 512


def test_memory_budget_choice_uses_recompute():
    s = _setup(global_batch=16, ac_policy="full")
    small = choose_micro_batch(s, SMALL_LAYERS, budget_bytes=1)
    assert small.micro_batch == 1 and "nothing fits" in small.note
    big = choose_micro_batch(s, SMALL_LAYERS, budget_bytes=1 << 40)
    assert big.micro_batch == 16 and big.policy == "full"
    peak = {(r["micro_batch"], r["policy"]): r["peak_bytes"] for r in big.candidates}
    assert peak[(16, "full")] < peak[(16, "none")]  # recompute saves activations
    assert peak[(1, "full")] < peak[(16, "full")]  # a larger micro-batch needs more
    # a budget between the two peaks at micro-batch 16: fits only with recompute
    mid = (peak[(16, "full")] + peak[(16, "none")]) / 2
    choice = choose_micro_batch(s, SMALL_LAYERS, budget_bytes=mid)
    assert choice.micro_batch == 16 and "without recompute micro-batch" in choice.note
    # measured activations twice the prediction: the same budget buys a smaller micro-batch
    assert choose_micro_batch(s, SMALL_LAYERS, mid, activation_scale=2.0).micro_batch < 16


def test_auto_recompute_takes_the_least_recompute_that_fits():
    s = _setup(global_batch=16, ac_policy="auto")
    roomy = choose_micro_batch(s, SMALL_LAYERS, budget_bytes=1 << 40)
    policies = {r["policy"] for r in roomy.candidates}
    assert {"selective", "every:2", "full", "none"} <= policies
    assert roomy.micro_batch == 16 and roomy.policy != "full"  # everything fits: the cheapest policy
    peak = {(r["micro_batch"], r["policy"]): r["peak_bytes"] for r in roomy.candidates}
    tight = choose_micro_batch(s, SMALL_LAYERS, budget_bytes=peak[(16, "full")] * 1.001)
    assert tight.micro_batch == 16 and peak[(16, tight.policy)] <= peak[(16, "full")] * 1.001


def test_later_rungs_keep_only_the_recompute_their_memory_needs():
    from tenfold.ladder.predict import choose_policy

    s = _setup(global_batch=16, ac_policy="auto")

    def build(policy):
        return R.zero_rung(replace(s, ac_policy=policy), 8)

    roomy = choose_policy(build, SMALL_LAYERS, budget_bytes=1 << 40)
    assert roomy.policy == "none" and "recompute off" in roomy.note  # everything fits: no recompute
    peak = {r["policy"]: r["peak_bytes"] for r in roomy.candidates}
    assert peak["full"] < peak["none"]
    tight = choose_policy(build, SMALL_LAYERS, budget_bytes=peak["full"] * 1.001)
    assert tight.policy != "none" and peak[tight.policy] <= peak["full"] * 1.001
    nothing = choose_policy(build, SMALL_LAYERS, budget_bytes=1)
    assert nothing.policy == "full" and "nothing fits" in nothing.note


# --------------------------------------------------------------------------- arithmetic


def _result(name, tps, status="measured"):
    return RungResult(0, name, name, status, None, {}, tokens_per_s=tps)


def test_multipliers_against_previous_and_baseline():
    rs = [_result("fp32", 100.0), _result("mixed", 200.0), _result("accum", None, "failed"), _result("recompute", 150.0)]
    add_multipliers(rs)
    assert rs[1].speedup_vs_previous == pytest.approx(2.0) and rs[1].time_multiplier == pytest.approx(0.5)
    assert rs[3].speedup_vs_previous == pytest.approx(0.75)  # against the last measured rung
    assert rs[3].cumulative_multiplier == pytest.approx(100 / 150)
    assert rs[2].time_multiplier is None
    assert fmt_multiplier(0.5) == "/ 2.00" and fmt_multiplier(1.3) == "x 1.30"


def test_no_ratio_to_a_baseline_that_was_not_measured():
    """Rungs 0 and 1 timed out: rung 3 is not "8.83x the baseline" measured against rung 2."""
    timeout = "timed out after 300 s; give it more time with --timeout SECONDS"
    rs = [_result("fp32", None, "failed"), _result("mixed", None, "failed"), _result("accum", 120.0),
          _result("recompute", 1060.0)]
    for i, r in enumerate(rs):
        r.index, r.reason = i, (timeout if r.status == "failed" else None)
        r.config = {"precision": "fp32", "micro_batch": 1, "grad_accum": 1, "dp": 1, "recompute": "none",
                    "zero_stage": 0, "pp": 1}
    add_multipliers(rs)
    assert all(r.speedup_vs_baseline is None and r.cumulative_multiplier is None for r in rs)
    assert rs[3].speedup_vs_previous == pytest.approx(1060 / 120)  # the rung before it was measured
    assert best_rung(rs) is None
    assert best_line(rs) == ("fastest rung: 3 recompute, 1,060 tok/s; no ratio to the baseline: rung 0 fp32 failed "
                             f"({timeout})")
    rows = table_rows(rs)
    assert [row[COLUMNS.index("cumulative")] for row in rows] == ["-"] * 4
    assert "x the baseline" not in markdown(rs, _HEADER)
    rs[0].status, rs[0].tokens_per_s = "measured", 100.0
    add_multipliers(rs)
    assert best_line(rs) == "best rung: 3 recompute, 10.60x the baseline's tokens/s"


_HEADER = {"model": "tiny", "hardware": {"description": "cpu", "planner_hardware": "cpu", "cores": 2},
           "date": "today", "command": "tenfold ladder", "budget_tokens": 512, "seq_len": 32, "global_batch": 8,
           "memory_budget_bytes": 2**20}


def test_a_timeout_says_whether_the_machine_was_busy_and_how_to_give_more_time(tmp_path, monkeypatch):
    from tenfold.ladder import measure

    monkeypatch.setattr(measure.os, "cpu_count", lambda: 2)
    busy = measure.timeout_reason(300, [3.9, 4.4], "--timeout SECONDS")
    assert busy == ("timed out after 300 s; the machine was busy (load average 4.4 on 2 cores), which slows every "
                    "run; give it more time with --timeout SECONDS")
    assert measure.timeout_reason(300, [0.5, 1.0], "--trial-timeout SECONDS") == (
        "timed out after 300 s; give it more time with --trial-timeout SECONDS")
    spec = R.fp32_rung(_setup())
    res = run_rung(spec, tmp_path / "rung", list(SMALL), Prediction(), timeout_s=1)  # a real run, stopped
    assert res.status == "failed" and res.reason.startswith("timed out after 1 s")
    assert res.reason.endswith("give it more time with --timeout SECONDS")


def test_off_a_terminal_the_ladder_says_each_rung_as_it_goes(tmp_path, capsys, monkeypatch):
    """stdout is not a terminal (capsys): a line as each rung starts and ends, each one printed
    before the next rung runs; the baseline's timeout gives no ratio, and the table still ends it."""
    from tenfold.ladder import measure

    printed: list[str] = []
    rates = {"fp32": None, "mixed": 900.0, "accum": 1100.0}

    def fake_rung(spec, out, user_set, prediction, timeout_s, on_step=None):
        printed.append(capsys.readouterr().out)
        r = RungResult(spec.index, spec.name, spec.title, "measured" if rates[spec.name] else "failed",
                       None if rates[spec.name] else measure.timeout_reason(timeout_s, None, "--timeout SECONDS"),
                       spec.knobs, tokens_per_s=rates[spec.name], process_s=3.0)
        return r

    monkeypatch.setattr(measure, "run_rung", fake_rung)
    monkeypatch.setattr("tenfold.ladder.mixed_precision", bf16_pays_here)
    assert main(["ladder", "--rungs", "fp32,mixed,accum", "--nproc", "1", "--tokens", "256", "--global-batch", "2",
                 "--repeats", "1", "--timeout", "300", "--out", str(tmp_path), *SMALL]) == 0
    printed.append(capsys.readouterr().out)
    assert printed[0].splitlines()[-1] == "rung 0 fp32: 8 steps, 256 tokens, at most 300 s"
    assert printed[1].splitlines()[-2:] == [
        "rung 0 fp32: failed: timed out after 300 s; give it more time with --timeout SECONDS",
        "rung 1 mixed: 8 steps, 256 tokens, at most 300 s"]
    assert "rung 1 mixed: measured, 900 tok/s" in printed[2]
    end = printed[3]
    assert "rung 2 accum: measured, 1,100 tok/s" in end and "tenfold ladder: tiny" in end
    assert "x the baseline" not in end
    assert "fastest rung: 2 accum, 1,100 tok/s; no ratio to the baseline: rung 0 fp32 failed (timed out" in end


def test_steady_tokens_per_s_leaves_out_warmup_and_measured_steps():
    recs = [{"step": 1, "step_time_s": 10.0}, {"step": 2, "step_time_s": 1.0},
            {"step": 3, "step_time_s": 5.0, "memory_measured": True}, {"step": 4, "step_time_s": 1.0}]
    assert steady_tokens_per_s(recs, 100) == pytest.approx(100.0)
    assert steady_tokens_per_s(recs[:1], 100) == pytest.approx(10.0)  # one step: use it
    assert steady_tokens_per_s([], 100) is None
    # with the loop's elapsed time: data and logging between steps count too
    timed = [dict(r, elapsed_s=e) for r, e in zip(recs, (10.0, 11.5, 17.0, 18.5))]
    assert steady_tokens_per_s(timed, 100) == pytest.approx(300 / (8.5 - 4.0))


def test_memory_of_the_most_loaded_rank():
    from tenfold.ladder.measure import _read_memory

    ranks = [{"peak_bytes": 5, "activations_bytes": 1}, {"peak_bytes": 9, "activations_bytes": 2}]
    r = _result("pipeline", 1.0)
    _read_memory(r, {"measured": ranks[0], "measured_per_rank": ranks}, [])
    assert r.peak_mem_bytes == 9 and r.memory["activations_bytes"] == 2 and "rank 1 of 2" in r.memory_source
    rss = _result("fp32", 1.0)
    _read_memory(rss, {"peak_mem_bytes": 300}, [{"peak_mem_bytes": 200}])
    assert rss.peak_mem_bytes == 300 and "RSS" in rss.memory_source


def test_option_parsing():
    assert parse_bytes("256MiB") == 256 * 2**20 and parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("4096") == 4096
    assert parse_rungs("pipeline,fp32") == ["fp32", "pipeline"]
    for bad in ("lots", "-1MiB", "0"):
        with pytest.raises(UserError):
            parse_bytes(bad)
    with pytest.raises(UserError, match="allowed: fp32, mixed"):
        parse_rungs("fp32,turbo")


def test_a_repeat_keeps_the_best_run_and_every_figure():
    from tenfold.ladder.measure import add_repeat

    first = RungResult(0, "fp32", "fp32", "measured", None, {}, tokens=1000, tokens_per_s=100.0, mfu=0.2)
    add_repeat(first, RungResult(0, "fp32", "fp32", "measured", None, {}, tokens_per_s=125.0))
    assert first.tokens_per_s_runs == [100.0, 125.0] and first.tokens_per_s == 125.0
    assert first.time_for_budget_s == pytest.approx(8.0) and first.mfu == pytest.approx(0.25)
    add_repeat(first, RungResult(0, "fp32", "fp32", "measured", None, {}, tokens_per_s=90.0))
    assert first.tokens_per_s == 125.0 and len(first.tokens_per_s_runs) == 3  # a slower run is kept, not counted
    add_repeat(first, RungResult(0, "fp32", "fp32", "failed", "exit status 1", {}))
    assert first.tokens_per_s == 125.0 and "run 4 failed: exit status 1" in first.notes


# --------------------------------------------------------------------------- a real ladder


def bf16_pays_here() -> tuple[str, None]:
    """ladder.mixed_precision as on a machine where bf16 pays (a GPU, a CPU with bf16 matrix
    instructions): tests of the ladder's own mechanics measure the mixed rung on any CPU."""
    return "bf16", None


@pytest.fixture(scope="module")
def ladder_out(tmp_path_factory):
    """fp32 and mixed measured; zero and pipeline skipped (one process); ~20 s of CPU."""
    out = tmp_path_factory.mktemp("ladder")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tenfold.ladder.mixed_precision", bf16_pays_here)
        rc = main(["ladder", "--quick", "--rungs", "fp32,mixed,zero,pipeline", "--nproc", "1", "--tokens", "256",
                   "--global-batch", "2", "--no-progress", "--out", str(out), *SMALL])
    assert rc == 0
    return out


def test_ladder_writes_json_md_png(ladder_out):
    data = json.loads((ladder_out / "ladder.json").read_text())
    assert data["hardware"]["device"] == "cpu" and data["hardware"]["planner_hardware"] == "cpu"
    assert [r["name"] for r in data["rungs"]] == ["fp32", "mixed", "zero", "pipeline"]
    for r in data["rungs"][:2]:
        assert r["status"] == "measured", r["reason"]
        for key in ("tokens_per_s", "predicted_tokens_per_s", "peak_mem_bytes", "predicted_peak_bytes"):
            assert r[key] > 0, key
        assert math.isfinite(r["val_loss"]) and r["tokens"] == data["budget_tokens"]
        assert Path(r["out_dir"], "summary.json").is_file()
        assert r["config"]["micro_batch"] == 1 and r["config"]["grad_accum"] == 1
    assert data["rungs"][0]["config"]["precision"] == "fp32"
    assert data["rungs"][1]["config"]["precision"] in ("bf16", "fp16")
    # --quick runs the ladder twice (in order, then reversed); each rung counts its best run
    assert data["repeats"] == 2
    for r in data["rungs"][:2]:
        assert len(r["tokens_per_s_runs"]) == 2 and r["tokens_per_s"] == max(r["tokens_per_s_runs"])
        assert Path(r["out_dir"], "run_2", "summary.json").is_file()
    assert data["rungs"][1]["speedup_vs_baseline"] == pytest.approx(
        data["rungs"][1]["tokens_per_s"] / data["rungs"][0]["tokens_per_s"])
    md = (ladder_out / "ladder.md").read_text()
    assert "| # | rung |" in md and "fp32, micro-batch 1 (baseline)" in md and "skipped" in md
    png = (ladder_out / "ladder.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 600 and height > 300


def test_skipped_rungs_are_reported_with_the_reason(ladder_out):
    data = json.loads((ladder_out / "ladder.json").read_text())
    zero, pipe = data["rungs"][2], data["rungs"][3]
    assert zero["status"] == "skipped" and "--nproc is 1" in zero["reason"]
    assert pipe["status"] == "skipped" and "2 stages on 2 processes" in pipe["reason"]
    assert not (ladder_out / "rung_4_zero").exists()  # nothing was started for them
    md = (ladder_out / "ladder.md").read_text()
    assert "--nproc is 1" in md


def test_projection_beside_the_measured_ladder(ladder_out, capsys):
    rc = main(["ladder", "--project", "--gpu", "a100-80gb", "--gpus", "64", "--model", "gpt3-175b",
               "--out", str(ladder_out)])
    assert rc == 0
    proj = json.loads((ladder_out / "projection.json").read_text())
    assert proj["model"] == "gpt3-175b" and proj["gpus"] == 64
    rows = proj["rungs"]
    assert [r["name"] for r in rows[:6]] == list(R.RUNG_NAMES)
    assert rows[0]["seed_days"] == 30 and rows[0]["gpus"] == 1 and rows[5]["gpus"] == 64
    assert rows[0]["measured_here"]["status"] == "measured"
    assert rows[4]["measured_here"]["status"] == "skipped"
    assert "here: tok/s" in capsys.readouterr().out


def test_a_failing_rung_is_reported_not_raised(tmp_path):
    spec = R.fp32_rung(_setup())
    spec.overrides["train"]["micro_batch"] = 0  # the trainer refuses it: exit 2
    res = run_rung(spec, tmp_path / "rung", ["--set", "model.n_layers=1"], Prediction(), timeout_s=120)
    assert res.status == "failed"
    assert "exit status 2" in res.reason and "micro_batch" in res.reason


# --------------------------------------------------------------------------- bad options


@pytest.mark.parametrize("argv, words", [
    (["--rungs", "fp32,turbo"], "turbo"),
    (["--memory-budget", "lots"], "--memory-budget"),
    (["--nproc", "0"], "--nproc"),
    (["--tokens", "-5"], "--tokens"),
    (["--ac", "sometimes"], "sometimes"),
    (["--zero", "4"], "--zero"),
    (["--repeats", "0"], "--repeats"),
    (["--set", "model.name=gpt5"], "gpt5"),
    (["--gpus", "64"], "--project"),
    (["--project", "--gpu", "z80"], "z80"),
    (["--project", "--gpus", "60"], "--gpus"),
])
def test_bad_options_exit_2_with_one_line(tmp_path, capsys, argv, words):
    out = tmp_path / "never"
    assert main(["ladder", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
    if "--project" not in argv:
        assert not out.exists()  # nothing half-written
