"""Checkpoint and resume through tenfold's own trainer:

* `tenfold train ... --checkpoint-every 3 --steps 6` equals `--steps 3` followed by
  `--steps 6 --resume auto` in the same --out (rel. 1e-6 on the losses of steps 4-6; they
  come out bit-identical in fp32);
* a 2-rank ZeRO-3 checkpoint resumes on one process within rel. 1e-4;
* 2 ranks ZeRO-1 and ZeRO-3 (tenfold's own wrapping) and pp=2: stop at 3, resume to 6 ==
  uninterrupted, bit for bit;
* SIGTERM mid-run saves once at the next step boundary and exits 0; --keep-last; export_16bit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from conftest import CLI_MODEL_SHAPE, cli_train, text_corpus
from tenfold.engine.outputs import checkpoint as ck

MODEL = {"name": "tiny", "n_layers": 2, "d_model": 32, "n_heads": 2, "d_ff": 64, "vocab_size": 64, "max_seq_len": 16}
CLI_MODEL = [f"--set=model.{k}={v}" for k, v in CLI_MODEL_SHAPE.items()]


pytestmark = pytest.mark.usefixtures("one_thread")


def _metrics_losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _rel_close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def test_done_when_cli_resume_auto_equals_uninterrupted(tmp_path):
    data = text_corpus(tmp_path)
    full, split = tmp_path / "full", tmp_path / "split"
    assert cli_train(full, data, "--checkpoint-every", "3", "--steps", "6") == 0
    assert cli_train(split, data, "--checkpoint-every", "3", "--steps", "3") == 0
    assert ck.read_latest(split / "checkpoints") == split / "checkpoints" / "step_3"
    assert cli_train(split, data, "--checkpoint-every", "3", "--steps", "6", "--resume", "auto") == 0
    want, got = _metrics_losses(full), _metrics_losses(split)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # metrics.jsonl is appended across the two runs
    assert _rel_close([got[s] for s in (4, 5, 6)], [want[s] for s in (4, 5, 6)], 1e-6)
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]  # in fact bit for bit
    summary = json.loads((split / "summary.json").read_text())
    assert summary["final"]["steps"] == 6 and len(summary["losses"]) == 6
    # the resumed run re-built its schedule for 6 steps and continued it from step 3
    lr = {json.loads(l)["step"]: json.loads(l)["lr"] for l in (split / "metrics.jsonl").read_text().splitlines()}
    lr_full = {json.loads(l)["step"]: json.loads(l)["lr"] for l in (full / "metrics.jsonl").read_text().splitlines()}
    assert lr == lr_full


def test_cli_keep_last_and_bad_resume_path(tmp_path, capsys):
    data = text_corpus(tmp_path)
    out = tmp_path / "run"
    assert cli_train(out, data, "--checkpoint-every", "1", "--keep-last", "2", "--steps", "4") == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_3", "step_4"]
    capsys.readouterr()
    assert cli_train(out, data, "--steps", "6", "--resume", str(tmp_path / "nope")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "checkpoint not found" in err


def test_export_16bit_at_end_of_training(tmp_path):
    from safetensors.torch import load_file

    data = text_corpus(tmp_path)
    out = tmp_path / "run"
    assert cli_train(out, data, "--steps", "2", "--set", "checkpoint.export_16bit=true") == 0
    weights = load_file(str(out / "model.safetensors"))
    assert weights and all(w.dtype == torch.bfloat16 for w in weights.values())
    assert (out / "checkpoints" / "step_2").is_dir()  # the export reads the final checkpoint
    assert json.loads((out / "summary.json").read_text())["export"] == str(out / "model.safetensors")


SIGTERM_SCRIPT = """
import sys, time
from tenfold import cli
import tenfold.engine.outputs.checkpoint as ck
real = ck.CheckpointManager.after_step
def slow_after_step(self, step, last=False):
    if step == 2:
        print("STEP2", flush=True)
        time.sleep(1.0)   # the parent's SIGTERM lands here, inside the loop
    return real(self, step, last)
ck.CheckpointManager.after_step = slow_after_step
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_saves_once_and_exits_cleanly(tmp_path):
    data = text_corpus(tmp_path)
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--data", str(data), "--seq-len", "16", "--micro-batch", "2",
            "--precision", "fp32", "--eval-every", "0", "--no-progress", "--set", "log.tensorboard=false",
            *CLI_MODEL, "--steps", "50"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        if line.strip() == "STEP2":
            break
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    root = out / "checkpoints"
    assert [p.name for _, p in ck.list_step_dirs(root)] == ["step_2"]  # saved once, at the boundary
    assert ck.read_latest(root) == root / "step_2"
    assert "preempted; saved step 2" in stdout + stderr
    assert json.loads((out / "summary.json").read_text())["final"]["steps"] == 2


# --------------------------------------------------------------------------- 2 ranks


def _config(out: Path, steps: int, **parallel) -> dict:
    return {
        "model": MODEL,
        "train": {"steps": steps, "global_batch": 8, "micro_batch": 2, "lr": 1e-2, "eval_every": 0, "seed": 0},
        "precision": {"dtype": "fp32"},
        "parallel": parallel,
        "checkpoint": {"every": 3},
        "log": {"out": str(out), "tensorboard": False, "progress": False},
    }


def _dataset() -> np.ndarray:
    return np.random.default_rng(0).integers(0, MODEL["vocab_size"], size=(64, 17))


def _fit(config: dict) -> list[float]:
    from tenfold.engine.loop.trainer import Trainer

    return Trainer(config, dataset=_dataset()).fit()["losses"]


def _rank_worker(rank: int, tmp: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    root = Path(tmp)
    res = {}
    res["zero3_3"] = _fit(_config(root / "zero3", 3, zero_stage=3))
    # through tenfold's own ZeRO wrapping: stop at 3, resume to 6 on the same layout
    step3 = str(root / "zero3" / "checkpoints" / "step_3")
    res["zero3_full"] = _fit(_config(root / "zero3_full", 6, zero_stage=3))
    res["zero3_resumed"] = _fit({**_config(root / "zero3_resumed", 6, zero_stage=3), "checkpoint": {"every": 3, "resume": step3}})
    res["zero1_full"] = _fit(_config(root / "zero1_full", 6, zero_stage=1))
    _fit(_config(root / "zero1", 3, zero_stage=1))
    res["zero1_resumed"] = _fit({**_config(root / "zero1", 6, zero_stage=1), "checkpoint": {"every": 3, "resume": "auto"}})
    res["pp_full"] = _fit(_config(root / "pp_full", 6, pp_degree=2))
    _fit(_config(root / "pp_split", 3, pp_degree=2))
    res["pp_resumed"] = _fit({**_config(root / "pp_split", 6, pp_degree=2), "checkpoint": {"every": 3, "resume": "auto"}})
    if rank == 0:
        (root / "results.json").write_text(json.dumps(res))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_trainer")
    mp.start_processes(_rank_worker, args=(str(tmp), _free_port()), nprocs=2, start_method="spawn", join=True)
    return tmp, json.loads((tmp / "results.json").read_text())


@pytest.mark.slow
def test_done_when_two_rank_zero3_checkpoint_resumes_on_one_process(two_rank_runs, tmp_path):
    tmp, res = two_rank_runs
    reference = _fit(_config(tmp_path / "one", 6))
    assert _rel_close(res["zero3_3"], reference[:3], 1e-4)
    resumed = _fit({**_config(tmp / "zero3", 6), "checkpoint": {"every": 3, "resume": "auto"}})
    assert len(resumed) == 6
    assert _rel_close(resumed[3:], reference[3:], 1e-4)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_two_ranks_zero_resume_equals_uninterrupted(two_rank_runs, zero):
    _, res = two_rank_runs
    resumed, full = res[f"zero{zero}_resumed"], res[f"zero{zero}_full"]
    assert len(resumed) == 6 and resumed[3:] == full[3:]


@pytest.mark.slow
def test_pipeline_pp2_resume_equals_uninterrupted(two_rank_runs):
    tmp, res = two_rank_runs
    assert len(res["pp_resumed"]) == 6
    assert res["pp_resumed"][3:] == res["pp_full"][3:]
    manifest = json.loads((tmp / "pp_split" / "checkpoints" / "step_6" / "manifest.json").read_text())
    assert manifest["world_size"] == 2


# --------------------------------------------------------------------------- --on-nan


def _nan_at(step: int):
    """A loss_fn whose loss is NaN on optimizer step `step` (one micro-batch per step)."""
    calls = {"n": 0}

    def loss_fn(model, batch):
        from tenfold.models.loss import token_loss_sum

        calls["n"] += 1
        loss = token_loss_sum(model(batch["input_ids"]), batch["labels"])
        return (loss * float("nan") if calls["n"] == step else loss), int(batch["labels"].numel())

    return loss_fn


def _nan_config(out: Path, on_nan: str) -> dict:
    cfg = _config(out, 4)
    cfg["train"].update(global_batch=2, micro_batch=2, on_nan=on_nan)
    cfg["checkpoint"] = {"every": 1}
    return cfg


def _all_finite(ckpt: Path) -> bool:
    from tenfold.engine.outputs.export import consolidated_model_state

    return all(bool(torch.isfinite(t).all()) for t in consolidated_model_state(ckpt).values())


def test_on_nan_skip_keeps_nan_out_of_checkpoints(tmp_path):
    from tenfold.engine.loop.trainer import Trainer

    summary = Trainer(_nan_config(tmp_path, "skip"), dataset=_dataset(), loss_fn=_nan_at(2)).fit()
    assert summary["final"]["skipped_steps"] == 1 and summary["final"]["steps"] == 4
    steps = [p for _, p in ck.list_step_dirs(tmp_path / "checkpoints")]
    assert len(steps) == 4 and all(_all_finite(p) for p in steps)
    state = ck.load_trainer_state(tmp_path / "checkpoints" / "step_2")
    assert state["state"]["skipped"] == 1 and state["scheduler"]["last_epoch"] == 1  # no LR step


def test_on_nan_stop_names_the_step_and_keeps_last_good_checkpoint(tmp_path):
    from tenfold.engine.loop.trainer import Trainer
    from tenfold.errors import RunError

    with pytest.raises(RunError, match="at step 3"):
        Trainer(_nan_config(tmp_path, "stop"), dataset=_dataset(), loss_fn=_nan_at(3)).fit()
    root = tmp_path / "checkpoints"
    assert ck.read_latest(root) == root / "step_2" and _all_finite(root / "step_2")
    assert not (root / "step_3").exists()


def test_fp16_loss_scale_and_schedule_continue(tmp_path):
    """The dynamic loss scaler (window 2: its scale moves every other step) and the LR
    warm-up continue across --resume exactly as in the uninterrupted run."""
    data = text_corpus(tmp_path)
    fp16 = ["--precision", "fp16", "--set", "precision.loss_scale_window=2",
            "--set", "precision.initial_scale_power=4", "--checkpoint-every", "3"]
    full, split = tmp_path / "full", tmp_path / "split"
    assert cli_train(full, data, *fp16, "--steps", "6") == 0
    assert cli_train(split, data, *fp16, "--steps", "3") == 0
    assert cli_train(split, data, *fp16, "--steps", "6", "--resume", "auto") == 0

    def rows(out):
        return {r["step"]: (r["loss"], r["lr"], r["loss_scale"]) for r in
                map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}

    want, got = rows(full), rows(split)
    assert len({v[2] for v in want.values()}) > 1  # the scale did move
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]
