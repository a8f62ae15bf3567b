"""`tenfold plan` as a user runs it: the promised outputs, JSON keys, bad input -> 2."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from tenfold.plan.cli import main, register


def run_json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_done_when_zero3_7_5b_params_only(capsys):
    d = run_json(capsys, "--params", "7.5e9", "--gpus", "64", "--zero", "3", "--precision", "fp16")
    assert d["memory"]["model_states_bytes"] == pytest.approx(1.875e9)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "total_bytes",
                "master_weights_bytes"):
        assert key in d["memory"]
    assert d["memory"]["activations_bytes"] is None  # --params alone: activations unknown
    for key in ("fits", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "train_days"):
        assert key in d
    assert d["memory"]["params_bytes"] + d["memory"]["grads_bytes"] + d["memory"]["optimizer_bytes"] == pytest.approx(1.875e9)


def test_done_when_175b_34_days(capsys):
    d = run_json(capsys, "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "1024", "--tp", "8", "--pp", "16",
                 "--micro-batch", "1", "--global-batch", "1536", "--seq-len", "2048", "--ac", "full",
                 "--tokens", "300e9", "--achieved-tflops", "140")
    assert d["train_days"] == pytest.approx(34, rel=0.05)
    assert d["fits"] is True
    assert d["dp"] == 8 and d["grad_accum"] == 192


def test_time_model_without_achieved_tflops_is_in_range(capsys):
    # The same run from the planner's own time model: Narayanan report 140 TFLOP/s (34 days);
    # the calibrated model should land within +-20% of that without being told.
    d = run_json(capsys, "--model", "gpt3-175b", "--gpus", "1024", "--tp", "8", "--pp", "16", "--global-batch", "1536", "--micro-batch", "1",
                 "--ac", "full", "--tokens", "300e9", "--precision", "fp16", "--no-flash-attention", "--dropout",
                 "--no-overlap-comm")
    assert d["train_days"] == pytest.approx(34, rel=0.2)
    assert d["hardware_tflops_per_gpu"] == pytest.approx(140, rel=0.2)
    assert 0 < d["mfu"] < d["hfu"] < 1


def test_done_when_ladder_prints_seed_path_with_notes(capsys):
    assert main(["--ladder"]) == 0
    out = capsys.readouterr().out
    for text in ("1 GPU, fp32", "fp16 mixed precision", "ZeRO-3", "pipeline", "master weights", "seed"):
        assert text in out, text
    d = run_json(capsys, "--ladder")
    rungs = d["rungs"]
    assert len(rungs) == 7
    assert [r["seed"]["days"] for r in rungs] == [30, 15, 10, 13, 2.2, 1.8, 3]
    # The recipe's final configuration (ZeRO-3 with 8 pipeline stages on 64 GPUs) does not fit: pipelining keeps each
    # stage's gradients unreduced and its parameters unsharded between micro-batches.
    assert rungs[0]["fits"] is False and rungs[-1]["fits"] is False
    assert "reduces once per step" in " ".join(rungs[-1]["notes"])
    # fp16 keeps 16 B/param of model states: the recipe's 25% saving does not happen.
    assert rungs[1]["model_states_bytes"] == pytest.approx(rungs[0]["model_states_bytes"])
    assert all(r["notes"] for r in rungs)


def test_ladder_any_model_has_no_seed_column(capsys):
    d = run_json(capsys, "--ladder", "--model", "gpt3-1.3b", "--gpus", "16", "--pp", "2")
    assert all(r["seed"] is None for r in d["rungs"])
    assert d["rungs"][-1]["fits"]


def test_done_when_search_175b_1024(capsys):
    # Megatron's layouts for GPT-3 are what tenfold train runs: tensor parallelism inside a node
    # (with sequence parallelism, as train defaults), pipeline stages across nodes with GPT-3's
    # tied embeddings as two copies (techniques/tied_embeddings.py), ZeRO on the data-parallel
    # axis; the search ranks them runnable and launches the fastest...
    d = run_json(capsys, "--search", "--model", "gpt3-175b", "--gpus", "1024", "--global-batch", "1536", "--top", "3")
    assert d["best"] and d["unsupported"] > 0 and "--tp" in d["launch"] and "--pp" in d["launch"]
    assert all(not p["unsupported"] and p["strategy"]["tp"] > 1 and p["strategy"]["pp"] > 1
               and p["strategy"]["sequence_parallel"] for p in d["best"])
    runnable = [p["tokens_per_s"] for p in d["best"]]
    # ... and what train cannot run, priced and marked on request, is not faster.
    d = run_json(capsys, "--search", "--model", "gpt3-175b", "--gpus", "1024", "--global-batch", "1536", "--top", "3",
                 "--include-unsupported")
    assert d["fitting"] > 0 and len(d["best"]) == 3
    speeds = [p["tokens_per_s"] for p in d["best"]]
    assert speeds == sorted(speeds, reverse=True) and speeds == runnable
    assert all(p["fits"] for p in d["best"])


def test_import_has_no_torch(tmp_path):
    # train's flags, a search, the launch line and --emit included
    code = ("import sys, tenfold.plan, tenfold.plan.cli, tenfold.plan.api, tenfold.plan.search, tenfold.plan.ladder;"
            "from tenfold.cli import main; main(['plan', '--model', 'gpt3-1.3b', '--gpus', '8', '--json']);"
            "main(['plan', '--model', 'gpt3-125m', '--gpus', '8', '--search', '--emit', 'run.toml', '--set', 'train.lr=1e-4']);"
            "main(['plan', '--config', 'run.toml', '--json']);"
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import tenfold.plan"], capture_output=True, text=True)
    assert r.returncode == 0 and "torch" not in r.stderr


def test_rich_output_and_explain(capsys):
    assert main(["--model", "gpt3-175b", "--gpus", "64", "--tp", "8", "--pp", "8", "--zero", "1", "--ac", "full",
                 "--global-batch", "512", "--tokens", "300e9", "--explain"]) == 0
    out = capsys.readouterr().out
    for text in ("Memory per GPU", "master weights", "Time per optimizer step", "MFU", "Korthikanti", "ZeRO",
                 "Narayanan", "NVIDIA datasheet"):
        assert text in out, text


def test_plot_writes_png(tmp_path, capsys):
    out = tmp_path / "mem.png"
    assert main(["--model", "gpt3-1.3b", "--gpus", "8", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out2 = tmp_path / "search.png"
    assert main(["--model", "gpt3-125m", "--gpus", "8", "--search", "--plot", str(out2), "--global-batch", "64"]) == 0
    assert out2.stat().st_size > 1000


@pytest.mark.parametrize("argv,message", [
    (["--model", "nope"], "unknown model preset"),
    (["--model", "gpt3-175b", "--ac", "every:0"], "every:N"),
    (["--model", "gpt3-175b", "--ac", "segments:x"], "segments: needs a positive integer"),
    (["--model", "gpt3-175b", "--ac", "sometimes"], "invalid recompute policy"),
    (["--model", "gpt3-175b", "--gpus", "12", "--tp", "8"], "= 8 must divide the number of processes (12)"),
    (["--model", "gpt3-175b", "--gpus", "10", "--tp", "5"], "must divide the 96 query heads"),
    (["--model", "llama-70b", "--gpus", "32", "--tp", "32"], "and the 8 key/value heads (each rank computes whole heads); allowed: 1, 2, 4, 8"),
    (["--model", "gpt3-175b", "--gpus", "8", "--global-batch", "12", "--micro-batch", "4"], "multiple of --micro-batch"),
    (["--model", "gpt3-175b", "--gpu", "tpu-v9"], "unknown --gpu"),
    (["--model", "gpt3-175b", "--precision", "bf16", "--gpu", "v100"], "not supported on v100"),
    (["--model", "gpt3-175b", "--params", "1e9"], "give one model"),
    (["--layers", "4", "--hidden", "64"], "need --heads, --vocab"),
    (["--params", "1e9", "--search"], "needs a model shape"),
    (["--model", "gpt3-175b", "--seq-len", "4096"], "above the model's context model.max_seq_len (2048)"),
    (["--model", "llama-7b", "--micro-batch", "2", "--grad-accum", "2", "--global-batch", "8", "--gpus", "4"],
     "must equal --micro-batch x --grad-accum x data-parallel size"),
    (["--model", "tiny", "--set", "parallel.offload=1"], "invalid value 1 for parallel.offload"),
    (["--model", "tiny", "--pp", "8", "--gpus", "8"], "8 pipeline stages is more than the model's 4 layers"),
    (["--config", "/nonexistent/run.toml"], "config file not found"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_bad_flag_values_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--params", "-5"])
    assert exc.value.code == 2


def test_register_adds_plan_subcommand(capsys):
    parser = argparse.ArgumentParser(prog="tenfold")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    args = parser.parse_args(["plan", "--params", "7.5e9", "--gpus", "64", "--zero", "3", "--precision", "fp16", "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["model_states_bytes"] == pytest.approx(1.875e9)


def test_hf_config_and_dimensions_match_the_preset(tmp_path, capsys):
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096, "hidden_act": "silu",
           "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    a = run_json(capsys, "--hf-config", str(path), "--gpus", "8", "--zero", "3")
    b = run_json(capsys, "--model", "llama-7b", "--gpus", "8", "--zero", "3")
    c = run_json(capsys, "--layers", "32", "--hidden", "4096", "--heads", "32", "--ffn", "11008", "--vocab", "32000",
                 "--seq-len", "4096", "--gpus", "8", "--zero", "3")
    assert a["params"] == b["params"] == c["params"]
    assert c["memory"]["total_bytes"] == pytest.approx(b["memory"]["total_bytes"])
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "gathered_params_bytes"):
        assert a["memory"][key] == b["memory"][key], key
    # the Hugging Face RMSNorm keeps its normalised value in 16 bits, tenfold's in fp32: 2 bytes
    # less per channel, norm and token (two norms a layer)
    tokens = a["micro_batch"] * a["seq_len"]
    per_layer = b["memory"]["activations_per_layer_bytes"] - a["memory"]["activations_per_layer_bytes"]
    assert per_layer == 2 * 2 * 4096 * tokens


def test_hardware_toml(tmp_path, capsys):
    toml = tmp_path / "gpu.toml"
    toml.write_text('name = "my-gpu"\nmemory_gb = 40\nhbm_gbs = 1000\nintra_node_gbs = 100\nnic_gbs = 10\n'
                    '[peak_tflops]\nbf16 = 100\nfp32 = 10\n[sources]\npeak = "my datasheet"\n')
    d = run_json(capsys, "--model", "gpt3-1.3b", "--hardware-file", str(toml), "--gpus", "2")
    assert d["hardware"] == "my-gpu" and d["memory"]["capacity_bytes"] == 40e9
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nmemory_gb = 40\n')
    assert main(["--model", "gpt3-1.3b", "--hardware-file", str(bad)]) == 2
    assert "missing key" in capsys.readouterr().err


def test_search_says_what_fills_the_days_column(capsys):
    assert main(["--search", "--model", "tiny", "--gpus", "2", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "--tokens" in out and " - " in out
    assert main(["--search", "--model", "tiny", "--gpus", "2", "--top", "2", "--tokens", "1e9"]) == 0
    assert "--tokens" not in capsys.readouterr().out
