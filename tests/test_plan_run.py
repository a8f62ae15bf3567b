"""One plan, one run: `tenfold plan` reads what `tenfold train` reads and predicts that run; its
advice runs (the capability table, the launch line, `--emit`)."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tenfold import capabilities
from tenfold.cli import build_parser, main
from tenfold.run_args import config_from_args, train_argv
from tenfold.config import ParallelSection, PrecisionSection, TrainSection, build_config, config_toml
from tenfold.engine.memory.measure import predicted_memory
from tenfold.errors import UserError
from tenfold.plan import advice
from tenfold.plan.for_run import memory_line
from tenfold.plan.search import search
from tenfold.run import resolve_run
from tenfold.techniques.precision import build_precision

from conftest import SMALL_FLAGS

DATA = Path(__file__).parent / "data"
SMALL_DATA = ["--set", "data.max_bytes=300000"]

# `tenfold train` command lines: models, precisions, recompute policies, ZeRO stages, pipeline
# schedules, accumulation, a TOML config, a DeepSpeed JSON, --set, a Hugging Face config.json.
TRAIN_FLAGS = [
    [],
    ["--model", "small", "--precision", "fp32", "--micro-batch", "4"],
    ["--precision", "fp16", "--ac", "full", "--micro-batch", "2", "--grad-accum", "4"],
    ["--ac", "every:2", "--seq-len", "128"],
    ["--model", "small", "--ac", "segments:2"],
    ["--ac", "selective"],
    ["--ac", "selective:mlp", "--precision", "fp32"],
    ["--ac", "offload", "--micro-batch", "2"],
    ["--nproc", "2", "--zero", "1"],
    ["--nproc", "2", "--zero", "2", "--global-batch", "32"],
    ["--nproc", "4", "--zero", "3", "--ac", "full", "--micro-batch", "2"],
    ["--nproc", "2", "--pp", "2", "--grad-accum", "4", "--micro-batch", "2"],
    ["--nproc", "4", "--pp", "2", "--zero", "1", "--grad-accum", "4"],
    ["--nproc", "2", "--pp", "2", "--pp-schedule", "gpipe", "--grad-accum", "2"],
    ["--nproc", "2", "--pp", "2", "--pp-schedule", "interleaved", "--grad-accum", "4"],
    ["--nproc", "4", "--pp", "2", "--pp-schedule", "zero-bubble", "--zero", "2", "--grad-accum", "4"],
    ["--nproc", "2", "--pp", "2", "--pp-split", "1,3", "--grad-accum", "2"],
    ["--model", "llama-7b", "--nproc", "8", "--zero", "3", "--ac", "full", "--micro-batch", "1", "--seq-len", "2048"],
    ["--model", "gpt3-125m", "--nproc", "2", "--zero", "2", "--precision", "fp16", "--micro-batch", "4", "--seq-len", "1024"],
    ["--set", "model.n_layers=6", "--set", "model.d_model=128", "--ac", "every:3", "--global-batch", "12"],
    ["--config", "{toml}"],
    ["--config", "{toml}", "--set", "parallel.zero_stage=1", "--ac", "none"],
    ["--deepspeed", str(DATA / "ds_seed.json"), "--nproc", "2", "--micro-batch", "2"],
    ["--hf-config", str(DATA / "llama-tiny" / "config.json"), "--nproc", "2", "--zero", "3", "--seq-len", "64"],
    ["--hf-config", str(DATA / "llama-tiny" / "config.json"), "--nproc", "2", "--tp", "2", "--seq-len", "64"],
    ["--hf-config", str(DATA / "llama-tiny" / "config.json"), "--ac", "every:1", "--grad-accum", "2", "--seq-len", "64"],
    ["--hf-config", str(DATA / "gpt2-tiny" / "config.json"), "--nproc", "2", "--zero", "1", "--ac", "selective:mlp"],
    ["--nproc", "2", "--tp", "2"],
    ["--nproc", "4", "--tp", "2", "--zero", "1", "--micro-batch", "2"],
    ["--nproc", "4", "--tp", "2", "--no-sequence-parallel", "--ac", "full"],
    ["--nproc", "8", "--tp", "2", "--pp", "2", "--zero", "3", "--grad-accum", "2"],
    ["--nproc", "8", "--pp", "4", "--zero", "3", "--grad-accum", "4", "--set", "model.n_layers=6"],
    ["--nproc", "2", "--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "3", "--grad-accum", "4",
     "--set", "model.n_layers=10"],
    ["--nproc", "4", "--pp", "2", "--pp-split", "3,1", "--zero", "2", "--grad-accum", "2", "--ac", "every:2"],
    ["--nproc", "3", "--global-batch", "24", "--precision", "fp32"],
    ["--nproc", "2", "--zero", "2", "--set", "parallel.reduce_bucket_size=1000000", "--grad-accum", "3"],
    ["--model", "small", "--nproc", "4", "--zero", "3", "--ac", "segments:3", "--seq-len", "512", "--micro-batch", "1"],
    ["--hf-config", str(DATA / "llama-tiny" / "config.json"), "--nproc", "4", "--pp", "2", "--zero", "3", "--grad-accum", "2",
     "--seq-len", "64"],
    ["--hf-config", str(DATA / "llama-tiny" / "config.json"), "--nproc", "2", "--pp", "2", "--pp-split", "1,2",
     "--grad-accum", "4", "--precision", "fp32", "--seq-len", "64"],
    ["--ac", "op"],
    ["--model", "small", "--precision", "fp32", "--ac", "op", "--grad-accum", "2"],
    ["--nproc", "4", "--zero", "3", "--shard-group", "2", "--ac", "op"],
    ["--nproc", "2", "--zero", "3", "--offload", "optimizer+params"],
    ["--nproc", "2", "--zero", "2", "--offload", "optimizer", "--reduce-dtype", "bf16"],
    ["--fp8", "--fp8-emulate", "--micro-batch", "4"],
]


@pytest.fixture
def run_toml(tmp_path) -> str:
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "small"\n[train]\nmicro_batch = 2\ngrad_accum = 2\n[recompute]\npolicy = "full"\n'
                    '[parallel]\nzero_stage = 3\nnproc = 2\n[precision]\ndtype = "fp32"\n')
    return str(path)


def plan_json(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def train_prediction(argv: list[str]) -> tuple[dict, dict, dict]:
    """What `tenfold train <argv>` prints at its start, through the code train runs: its parser,
    `config_from_args`, `resolve_run` on the processes it starts, the prediction RunMemory makes
    with the precision the device runs, and the layout summary.json records."""
    args = build_parser(["train", *argv]).parse_args(["train", *argv])
    cfg = config_from_args(args)
    run = resolve_run(cfg, cfg.parallel.nnodes * cfg.parallel.nproc)
    cpu = torch.device("cpu")
    return predicted_memory(run, cpu, build_precision(run.precision, cfg.precision, cpu).name), run.batch_summary(), run.layout()


def _flags(flags, run_toml) -> list[str]:
    return [run_toml if f == "{toml}" else f for f in flags]


@pytest.mark.parametrize("flags", TRAIN_FLAGS, ids=lambda f: " ".join(Path(x).name for x in f) or "defaults")
def test_plan_json_repeats_the_prediction_train_announces(capsys, run_toml, flags):
    """`tenfold plan --json`'s run section and what `tenfold train` prints at its start (both the
    planner's, through two front ends); the plan against the run itself: test_plan_batch_and_layout_are_the_traced_runs
    and tests/test_trace.py."""
    flags = _flags(flags, run_toml)
    memory, batch, layout = train_prediction(flags)
    run = plan_json(capsys, *flags, "--gpu", "cpu")["run"]  # the machine train runs on: `auto` precision alike
    assert run["memory_predicted"] == memory
    assert run["batch"] == batch
    assert run["layout"] == layout  # processes, ZeRO as it runs, recompute, schedule, blocks per stage, ...
    assert run["unsupported"] == [] and run["other_stack"] == []


@pytest.mark.parametrize("flags", TRAIN_FLAGS, ids=lambda f: " ".join(Path(x).name for x in f) or "defaults")
def test_plan_config_file_repeats_the_prediction_train_config_file_announces(tmp_path, capsys, run_toml, flags):
    """The same runs as one config file: `tenfold plan --config X` and `tenfold train --config X`."""
    cfg = config_from_args(build_parser(["train"]).parse_args(["train", *_flags(flags, run_toml)]))
    path = tmp_path / "x.toml"
    path.write_text(config_toml(cfg))
    memory, batch, layout = train_prediction(["--config", str(path)])
    run = plan_json(capsys, "--config", str(path), "--gpu", "cpu")["run"]
    assert (run["memory_predicted"], run["batch"], run["layout"]) == (memory, batch, layout)
    assert len(TRAIN_FLAGS) >= 30


TRACED = [  # TRAIN_FLAGS the trace runs (FSDP2, tensor parallel or one process): one per technique family
    ["--nproc", "4", "--zero", "3", "--ac", "full", "--micro-batch", "2"],
    ["--nproc", "2", "--pp", "2", "--pp-schedule", "gpipe", "--grad-accum", "2"],
    ["--nproc", "4", "--pp", "2", "--pp-split", "3,1", "--zero", "2", "--grad-accum", "2", "--ac", "every:2"],
    ["--hf-config", str(DATA / "llama-tiny" / "config.json"), "--nproc", "2", "--tp", "2", "--seq-len", "64"],
    ["--nproc", "4", "--zero", "3", "--shard-group", "2", "--ac", "op"],
    ["--precision", "fp16", "--ac", "full", "--micro-batch", "2", "--grad-accum", "4"],
]


@pytest.mark.parametrize("flags", TRACED, ids=lambda f: " ".join(Path(x).name for x in f))
def test_plan_batch_and_layout_are_the_traced_runs(capsys, flags):
    """`tenfold plan --trace`: the batch and layout the plan prices are the ones the engine's own
    set-up built and its step ran (micro-batches of that size, that many, over that mesh)."""
    assert flags in TRAIN_FLAGS
    plan = plan_json(capsys, *flags, "--gpu", "h100-sxm", "--trace")
    run, trace = plan["run"], plan["trace"]
    assert {k: trace["batch"][k] for k in run["batch"]} == run["batch"]
    assert trace["batch"]["dp"] == run["dp"] == trace["layout"]["dp"]
    assert (trace["layout"]["pp"], trace["layout"]["tp"], trace["layout"]["processes"]) == (
        run["layout"]["pp"], run["layout"]["tp"], run["processes"])


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_plan_and_a_real_run_agree_one_process(tmp_path, capsys, one_thread):
    flags = [*SMALL_FLAGS, *SMALL_DATA, "--precision", "bf16", "--ac", "full", "--micro-batch", "2", "--grad-accum", "2"]
    assert main(["train", *flags, "--steps", "2", "--out", str(tmp_path / "run"), "--eval-every", "0"]) == 0
    started = " ".join(capsys.readouterr().out.split())
    s = _summary(tmp_path / "run")
    run = plan_json(capsys, *flags)["run"]
    assert run["memory_predicted"] == s["memory"]["predicted"] and run["batch"] == s["batch"]
    assert main(["plan", *flags]) == 0  # the rich report prints the line train printed at its start
    printed = " ".join(capsys.readouterr().out.split())
    line = " ".join(memory_line(s["memory"]["predicted"]).split())
    assert line in printed and line in started


@pytest.mark.multiprocess
@pytest.mark.slow
def test_done_when_search_emit_then_train(tmp_path, capsys):
    """`tenfold plan --search --emit run.toml` on this machine, then `tenfold train --config
    run.toml --nproc 2 --steps 2` trains; `plan --config run.toml` predicts that very run."""
    toml = tmp_path / "run.toml"
    out = tmp_path / "out"
    flags = [*SMALL_FLAGS, *SMALL_DATA, "--out", str(out)]
    d = plan_json(capsys, *flags, "--gpu", "cpu", "--gpus", "2", "--search", "--emit", str(toml))
    assert d["emitted"] == str(toml) and d["launch"] == f"tenfold train --nproc 2 --config {toml}"
    assert not d["best"][0]["unsupported"]
    proc = subprocess.run([sys.executable, "-m", "tenfold", "train", "--config", str(toml), "--nproc", "2", "--steps", "2"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = _summary(out)
    assert s["final"]["steps"] == 2 and s["hardware"]["world_size"] == 2
    run = plan_json(capsys, "--config", str(toml))["run"]  # --gpus: the file's nproc
    assert run["processes"] == 2
    assert run["memory_predicted"] == s["memory"]["predicted"] and run["batch"] == s["batch"]
    best = d["best"][0]
    assert (s["batch"]["micro_batch"], s["batch"]["global_batch"]) == (best["micro_batch"], best["global_batch"])
    assert s["config"]["parallel"]["zero_stage"] == best["strategy"]["zero_stage"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_plan_and_a_real_pipeline_run_agree(tmp_path, capsys):
    flags = [*SMALL_FLAGS, *SMALL_DATA, "--precision", "fp32", "--nproc", "2", "--pp", "2", "--grad-accum", "2",
             "--micro-batch", "2", "--ac", "every:1"]
    out = tmp_path / "pp"
    proc = subprocess.run([sys.executable, "-m", "tenfold", "train", *flags, "--steps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = _summary(out)
    run = plan_json(capsys, *flags)["run"]
    assert run["memory_predicted"] == s["memory"]["predicted"] and run["batch"] == s["batch"]


# --------------------------------------------------------------------------- runnable advice


def test_nothing_unsupported_is_ranked_by_default(capsys):
    argv = ["--search", "--model", "llama-7b", "--gpu", "h100-sxm", "--gpus", "16", "--global-batch", "256", "--top", "50"]
    d = plan_json(capsys, *argv)
    assert d["best"] and all(p["unsupported"] == [] for p in d["best"])
    base = build_config({"model": {"name": "llama-7b"}, "train": {"global_batch": 256}})
    for p in search(resolve_run(base, 16, check=False), "h100-sxm", top_k=20).best:
        cfg, run = advice.config_for_plan(base, p.run, 8)  # resolved with the engine's own check
        assert run.layout() == p.run.layout() == p.strategy
    every = plan_json(capsys, *argv, "--include-unsupported")
    offloaded = [p for p in every["best"] if p["strategy"]["offload"] != "none"]
    assert offloaded and all(p["strategy"]["offload"] != "none" for p in every["best"] if p["unsupported"])
    # train offloads through FSDP2 (ZeRO-2/3): those run, an offloaded ZeRO-1 is marked
    assert all(bool(p["unsupported"]) == (p["strategy"]["zero_stage"] < 2) for p in offloaded)


def test_tied_embeddings_are_pipelined_by_the_advice(capsys):
    """GPT-3 ties its embeddings: the search ranks pipelined layouts as runnable (the first and
    the last stage each keep a copy, techniques/tied_embeddings.py), none marked."""
    d = plan_json(capsys, "--search", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "64", "--top", "400")
    piped = [p for p in d["best"] if p["strategy"]["pp"] > 1]
    assert piped and not any(p["unsupported"] for p in piped)


def test_a_hugging_face_search_pipelines_it_but_never_wraps_its_attention_core(capsys):
    """Hugging Face Llama blocks are cut into pipeline stages (3 layers on 3 GPUs: pp 3 is
    ranked), and attention-core recompute, which needs tenfold's attn.core module, is not."""
    argv = ["--search", "--hf-config", str(DATA / "llama-tiny" / "config.json"), "--gpu", "a100-80gb", "--gpus", "3",
            "--seq-len", "64", "--top", "200"]
    d = plan_json(capsys, *argv)
    assert d["best"] and all(p["strategy"]["recompute"] != "selective:attention" for p in d["best"])
    assert any(p["strategy"]["pp"] == 3 for p in d["best"])
    assert "--hf-config" in d["launch"]


def test_single_plan_prints_its_launch_line_or_why_not(capsys):
    run = plan_json(capsys, "--model", "llama-7b", "--gpu", "h100-sxm", "--gpus", "16", "--zero", "3", "--ac", "full")["run"]
    assert run["launch"].startswith("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d")
    assert "-m tenfold train --model llama-7b" in run["launch"] and "--zero 3 --pp 1" in run["launch"]
    run = plan_json(capsys, "--model", "llama-7b", "--gpus", "8", "--master-weights")["run"]
    assert run["other_stack"] == ["master_weights=True"] and run["launch"] is None
    assert "priced as another training stack" in run["unsupported"][0]


@pytest.mark.parametrize("gpus,per_node,expected", [(1, 8, (1, 1)), (8, 8, (1, 8)), (16, 8, (2, 8)), (12, 8, (2, 6)),
                                                    (10, 8, (2, 5)), (7, 4, (7, 1))])
def test_nodes_split_the_gpus_evenly(gpus, per_node, expected):
    assert advice.nodes_for(gpus, per_node) == expected


def test_launch_line_runs_the_config_exactly():
    cfg = build_config({"model": {"name": "small", "n_layers": 4}, "train": {"lr": 3e-4, "schedule": "WarmupLR", "schedule_params": {"warmup_max_lr": 1e-3}},
                        "data": {"path": "my corpus/train.jsonl"}, "parallel": {"nproc": 4, "pp_degree": 2, "pp_split": [1, 3]},
                        "log": {"progress": False, "out": "runs/a b"}})
    line = advice.launch_line(cfg, 4, 8)
    assert line.startswith("tenfold train --nproc 4 ")
    import shlex

    argv = shlex.split(line)[2:]
    back = config_from_args(build_parser(["train", *argv]).parse_args(["train", *argv]))
    assert back == cfg
    assert train_argv(build_config({})) == []


# --------------------------------------------------------------------------- --emit


def test_emit_writes_a_config_plan_and_train_read_back(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    flags = ["--model", "small", "--nproc", "2", "--zero", "3", "--ac", "every:2", "--global-batch", "16", "--lr", "1e-3"]
    first = plan_json(capsys, *flags, "--emit", str(toml))
    assert first["run"]["emitted"] == str(toml) and toml.read_text().startswith(advice.EMIT_MARK)
    again = plan_json(capsys, "--config", str(toml))
    assert again["run"]["memory_predicted"] == first["run"]["memory_predicted"]
    assert again["run"]["batch"] == first["run"]["batch"] and again["run"]["processes"] == 2
    emitted = config_from_args(build_parser(["train"]).parse_args(["train", "--config", str(toml)]))
    given = config_from_args(build_parser(["train", *flags]).parse_args(["train", *flags]))
    assert emitted.train.lr == 1e-3 and emitted.parallel.zero_stage == 3 and emitted.recompute.policy == "every:2"
    assert resolve_run(emitted, 2).batch_summary() == resolve_run(given, 2).batch_summary()
    assert plan_json(capsys, *flags, "--emit", str(toml))["run"]["emitted"] == str(toml)  # its own file: rewritten


@pytest.mark.parametrize("extra,needle", [
    (["--hf-config", str(Path(__file__).parent / "data" / "gpt2-tiny" / "config.json"), "--tp", "2", "--gpus", "2"],
     "cannot run this plan: parallel.tp_degree (--tp) 2: Hugging Face model_type 'gpt2' has no tensor-parallel plan"),
    (["--params", "1e9"], "give a model"),
    (["--master-weights"], "priced as another training stack (master_weights=True)"),
    (["--search", "--activation-style", "megatron"], "priced as another training stack (activation_style=megatron)"),
])
def test_emit_refuses_what_train_cannot_run(tmp_path, capsys, extra, needle):
    toml = tmp_path / "run.toml"
    argv = (["--model", "small"] if not {"--params", "--hf-config"} & set(extra) else []) + extra
    assert main(["plan", *argv, "--emit", str(toml)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and not toml.exists()


def _same_memory_but_the_buffers(planned_line: str, dry_run_out: str) -> bool:
    """The dry run's memory line is the plan's, term by term and at its peak, but for FSDP2's
    all-gather buffers in `gathered params` (and so `total`): the dry run prices the engine of the
    machine it runs on, which on a CPU issues one unit's gather ahead where a GPU holds two
    (tenfold.plan.gathered.all_gather_buffer)."""
    line = next(x for x in dry_run_out.splitlines() if "predicted (planner)" in x)
    kept = lambda text: [t for t in text.split(" | ") if not t.split()[0] in ("gathered", "total")]  # noqa: E731
    return kept(line.split("predicted (planner): ")[1]) == kept(planned_line.split("predicted (planner): ")[1])


@pytest.mark.parametrize("model,gpu,gpus,extra,nodes", [
    ("llama-70b", "h100-sxm", 64, [], 8),
    ("gpt3-175b", "a100-80gb", 1024, ["--global-batch", "1536"], 128),
])
def test_a_fleet_plan_emits_a_config_train_accepts_on_that_fleet(tmp_path, capsys, monkeypatch, model, gpu, gpus,
                                                                 extra, nodes):
    """`plan --search --emit` for a multi-node fleet writes nodes x processes per node and the
    torchrun line; `train --config FILE --dry-run` on a rank of that job (torchrun's environment)
    accepts it and prints the plan's memory line; one command cannot start it."""
    toml = tmp_path / "fleet.toml"
    d = plan_json(capsys, "--model", model, "--gpu", gpu, "--gpus", str(gpus), *extra, "--search", "--emit", str(toml))
    assert d["launch"].startswith(f"torchrun --nnodes {nodes} --nproc-per-node {gpus // nodes} ")
    emitted = config_from_args(build_parser(["train"]).parse_args(["train", "--config", str(toml)]))
    assert (emitted.parallel.nnodes, emitted.parallel.nproc) == (nodes, gpus // nodes)
    planned_line = next(x for x in toml.read_text().splitlines() if x.startswith("# memory per rank"))[2:]
    best = d["best"][0]
    assert planned_line == memory_line(memory_by_category_of(best))
    if model == "gpt3-175b":  # GPT-3 ties its embeddings: its fastest layouts are pipelined and run
        assert best["strategy"]["pp"] > 1 and not best["unsupported"], best["strategy"]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(gpus), "LOCAL_WORLD_SIZE": str(gpus // nodes),
                       "MASTER_ADDR": "head", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    assert main(["train", "--config", str(toml), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert _same_memory_but_the_buffers(planned_line, out) and f"{gpus} = pp" in out
    monkeypatch.setenv("WORLD_SIZE", str(gpus // 2))  # half the planned processes: refused, named
    assert main(["train", "--config", str(toml), "--dry-run"]) == 2
    assert f"{gpus} processes planned, but torchrun started {gpus // 2}" in capsys.readouterr().err
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key)
    assert main(["train", "--config", str(toml), "--dry-run"]) == 0  # nnodes x nproc without torchrun
    assert _same_memory_but_the_buffers(planned_line, capsys.readouterr().out)
    assert main(["train", "--config", str(toml), "--out", str(tmp_path / "never")]) == 2
    assert f"start it on every node with: torchrun --nnodes {nodes}" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


LLAMA3_405B = ["--layers", "126", "--hidden", "16384", "--heads", "128", "--kv-heads", "8", "--ffn", "53248",
               "--vocab", "128256", "--seq-len", "8192"]


@pytest.mark.parametrize("how", [
    ["--search", "--global-batch", "2048"],  # the search's pick
    ["--tp", "8", "--pp", "16", "--pp-schedule", "interleaved", "--virtual-stages", "4", "--ac", "full", "--zero", "2",
     "--micro-batch", "1", "--global-batch", "2048"],  # Llama 3's own layout, as the search ranks it
])
def test_an_uneven_pipeline_emits_a_config_train_accepts(tmp_path, capsys, monkeypatch, how):
    """126 layers on pp stages that do not divide them: the emitted file leaves the split to
    train (no parallel.pp_split), whose resolver makes the plan's split by the same rule
    (tenfold.terms.layer_counts); `train --config FILE --dry-run` on a rank of the 16,384-GPU job
    prints the plan's blocks per stage and memory line."""
    from tenfold.terms import layer_counts

    toml = tmp_path / "405b.toml"
    d = plan_json(capsys, *LLAMA3_405B, "--gpu", "h100-sxm", "--gpus", "16384", *how, "--emit", str(toml))
    plan = d["best"][0] if "--search" in how else d
    split = plan["strategy"]["stage_layers"]
    assert split == layer_counts(126, len(split)) and not plan["unsupported"]
    assert 126 % plan["strategy"]["pp"] or "--search" in how  # the pick is pp 8 today, uneven too
    assert "pp_split" not in toml.read_text()
    for key, value in {"RANK": "5", "LOCAL_RANK": "5", "WORLD_SIZE": "16384", "LOCAL_WORLD_SIZE": "8",
                       "MASTER_ADDR": "head", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    assert main(["train", "--config", str(toml), "--dry-run"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"blocks per stage {'/'.join(map(str, split))};" in out
    assert memory_line(memory_by_category_of(plan)).removeprefix("memory ") in out


def memory_by_category_of(plan: dict) -> dict:
    """`tenfold.plan.for_run.memory_by_category` of a plan as `--json` prints it."""
    from tenfold.plan.api import MemoryBreakdown
    from tenfold.plan.for_run import memory_by_category

    fields = {k: v for k, v in plan["memory"].items() if k != "peak_bytes"}
    return memory_by_category(MemoryBreakdown(**fields))


def test_emit_never_overwrites_a_file_it_did_not_write(tmp_path, capsys):
    mine = tmp_path / "run.toml"
    mine.write_text('[model]\nname = "small"\n')
    assert main(["plan", "--model", "tiny", "--emit", str(mine)]) == 2
    assert "was not written by tenfold plan" in capsys.readouterr().err
    assert mine.read_text() == '[model]\nname = "small"\n'
    assert main(["plan", "--model", "tiny", "--emit", str(tmp_path / "no" / "run.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [mine]


# --------------------------------------------------------------------------- the capability table


def test_the_table_is_what_the_config_accepts():
    assert set(capabilities.ENGINE.pipeline_schedules) == set(typing.get_args(ParallelSection.model_fields["pp_schedule"].annotation))
    # the config also takes `auto`, which resolves to one of the engine's precisions
    assert {"auto", *capabilities.ENGINE.precisions} == set(typing.get_args(PrecisionSection.model_fields["dtype"].annotation))
    for stage in capabilities.ENGINE.zero_stages:
        build_config({"parallel": {"zero_stage": stage}})
    with pytest.raises(UserError):
        build_config({"parallel": {"zero_stage": max(capabilities.ENGINE.zero_stages) + 1}})
    # Tensor parallelism is runnable exactly when tenfold train has a tensor-parallel degree.
    assert capabilities.ENGINE.tensor_parallel == ("tp_degree" in ParallelSection.model_fields)
    assert capabilities.ENGINE.compile == ("compile" in TrainSection.model_fields)
    assert set(capabilities.ENGINE.offload) == set(typing.get_args(ParallelSection.model_fields["offload"].annotation))
    assert capabilities.ENGINE.hybrid_shard == ("shard_group_size" in ParallelSection.model_fields)


def test_train_refuses_what_the_table_refuses(tmp_path, capsys):
    tied = build_config({"model": {"name": "tiny", "tie_embeddings": True}, "parallel": {"pp_degree": 2},
                         "train": {"grad_accum": 2}})
    assert resolve_run(tied, 2).pp == 2  # tied embeddings pipeline (techniques/tied_embeddings.py)
    narrow = replace(capabilities.ENGINE, zero_stages=(0, 1))
    run = resolve_run(build_config({"parallel": {"zero_stage": 3}}), 2)
    assert capabilities.problems(run) == [] and "ZeRO stage 3" in capabilities.problems(run, narrow)[0]
    hf = resolve_run(build_config({"parallel": {"pp_degree": 2}, "train": {"grad_accum": 2},
                                   "recompute": {"policy": "selective:attention"}}), 2, check=False)
    hf = replace(hf, model_kind="hf")
    assert len(capabilities.problems(hf)) == 2
    for argv, needle in ((["--offload", "optimizer"], "parallel.offload 'optimizer' (--offload) offloads FSDP2"),
                         (["--set", "parallel.offload=nvme"], "invalid value 'nvme' for parallel.offload"),
                         (["--nproc", "4", "--zero", "3", "--shard-group", "3"], "must divide the 4 data-parallel ranks"),
                         (["--nproc", "4", "--zero", "1", "--shard-group", "2"], "needs --zero 2 or 3, got 1")):
        try:
            code = main(["train", "--out", str(tmp_path / "never"), *argv])
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "never").exists()
