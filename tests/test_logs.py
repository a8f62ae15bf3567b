"""Logs a user reads: plain per-step lines off a terminal, --log-every, TensorBoard without
duplicate tags (and without a resumed run's repeated steps), Weights & Biases offline, and the
closing list of every written path."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import sys
import time
from pathlib import Path

import pytest

from conftest import SMALL_FLAGS, read_metrics, small_config
from tenfold.cli import main
from tenfold.config import build_config
from tenfold.engine.observe.metrics import STEP_TAGS, VAL_LOSS_TAG
from tenfold.engine.observe.step_log import StepLog, plain_line, process_peak_label
from tenfold.engine.loop.trainer import Trainer
from tenfold.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

LINE = re.compile(
    r"^step (\d+)/(\d+) \| loss \d+\.\d{4} \| lr \d\.\d\de[-+]\d\d \| [\d,]+ tok/s \| (MFU [\d.]+% \| )?"
    r"peak RSS [\d.]+ [KMG]iB \| [\d.]+ s/step( \| val loss \d+\.\d{4})? \| eta \d+s$"
)


def _train(tmp_path, *flags: str) -> Path:
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--precision", "fp32", "--eval-every", "0",
                 "--set", "log.tensorboard=false", *SMALL_FLAGS, *flags]) == 0
    return out


def _step_lines(text: str) -> list[re.Match]:
    return [m for m in (LINE.match(line) for line in text.splitlines()) if m]


def test_plain_lines_every_step_when_stdout_is_not_a_terminal(tmp_path, capsys):
    """capsys is not a terminal: one line per step with every figure, nothing wrapped."""
    _train(tmp_path, "--steps", "3")
    out = capsys.readouterr().out
    steps = [int(m.group(1)) for m in _step_lines(out)]
    assert steps == [1, 2, 3], out
    header = next(line for line in out.splitlines() if line.startswith("tenfold train"))
    assert "3 steps | 1 process(es) on cpu" in header  # the header is one line, not wrapped at 80


def test_log_every_thins_lines_and_rows_and_keeps_the_last_step(tmp_path, capsys):
    out_dir = _train(tmp_path, "--steps", "5", "--log-every", "2")
    lines = _step_lines(capsys.readouterr().out)
    assert [int(m.group(1)) for m in lines] == [2, 4, 5]
    assert [r["step"] for r in read_metrics(out_dir)] == [2, 4, 5]


def _console(terminal: bool):
    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=terminal, width=200)


ROW = {"step": 4, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 1234.0, "mfu": 0.123, "peak_mem_bytes": 3 * 2**20,
       "step_time_s": 0.5, "elapsed_s": 2.0, "loss_scale": 1.0, "skipped": 0}


def test_a_terminal_gets_the_bar_and_lines_only_with_log_every():
    quiet = StepLog(_console(True), 10, 0, every=1, progress=True)
    assert quiet.bar is not None and not quiet.lines
    periodic = StepLog(_console(True), 10, 0, every=4, progress=True)
    assert periodic.bar is not None and periodic.lines
    plain = StepLog(_console(False), 10, 0, every=1, progress=True)  # not a terminal: never a bar
    assert plain.bar is None and plain.lines
    no_progress = StepLog(_console(True), 10, 0, every=1, progress=False)
    assert no_progress.bar is None and no_progress.lines
    assert StepLog(None, 10, 0, every=1, progress=True).lines is False  # other ranks: silent


def test_plain_line_figures_and_eta():
    log = StepLog(_console(False), 10, 0, every=1, progress=False)
    log.update({**ROW, "step": 2, "elapsed_s": 1.0})
    log.update({**ROW, "step": 4, "elapsed_s": 2.0})
    assert log.eta_s(4) == pytest.approx(3.0)  # 6 steps left at 0.5 s of wall time each
    text = log.console.file.getvalue()
    assert "step 4/10 | loss 2.5000 | lr 1.00e-03 | 1,234 tok/s | MFU 12.3% | peak RSS 3.00 MiB | 0.50 s/step" in text
    assert "| peak allocated 3.00 MiB |" in plain_line(ROW, 10, None, process_peak_label("cuda"))
    fp16 = plain_line({**ROW, "mfu": None, "loss_scale": 65536.0, "skipped": 2}, 10, None)
    assert "MFU" not in fp16 and "loss scale 65536" in fp16 and "2 skipped" in fp16 and "eta" not in fp16


def _tb_scalars(folder: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_one_tag_per_quantity(tmp_path):
    cfg = small_config(tmp_path, log={"tensorboard": True}, train={"steps": 4, "eval_every": 2})
    Trainer(build_config(cfg)).fit()
    scalars = _tb_scalars(tmp_path / "run" / "tensorboard")
    assert scalars[VAL_LOSS_TAG] == [2, 4]
    assert not [t for t in scalars if t.endswith("val_loss")]  # not repeated under train/
    for tag in ("train/loss", "train/lr", "perf/tokens_per_s", "memory/peak_bytes"):
        assert scalars[tag] == [1, 2, 3, 4], tag
    assert len(set(STEP_TAGS.values())) == len(STEP_TAGS)
    assert "final/tokens_per_s" in scalars and "final/warmup_s" in scalars


def test_a_resumed_run_repeats_no_step_in_metrics_or_tensorboard(tmp_path):
    """Resume from step 2 of a run that reached step 3: the old step 3 goes from metrics.jsonl
    and TensorBoard hides it (purge_step); steps 3 and 4 of the new attempt stay."""
    first = small_config(tmp_path, log={"tensorboard": True}, train={"steps": 3},
                         checkpoint={"every": 2})
    Trainer(build_config(first)).fit()
    out = tmp_path / "run"
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    resumed = small_config(tmp_path, log={"tensorboard": True}, train={"steps": 4},
                           checkpoint={"resume": str(out / "checkpoints" / "step_2")})
    Trainer(build_config(resumed)).fit()
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert _tb_scalars(out / "tensorboard")["train/loss"] == [1, 2, 3, 4]


def test_a_fresh_run_in_a_used_folder_keeps_only_its_own_rows(tmp_path):
    """A fresh run into a folder that holds a run is refused (engine/outputs/folder.py); replacing
    it with log.overwrite leaves only the new run's rows."""
    cfg = small_config(tmp_path, train={"steps": 2})
    Trainer(build_config(cfg)).fit()
    with pytest.raises(UserError, match="holds an earlier run"):
        Trainer(build_config(cfg)).fit()
    Trainer(build_config({**cfg, "log": {**cfg["log"], "overwrite": True}})).fit()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_closing_lines_name_every_written_path(tmp_path, capsys):
    out = _train(tmp_path, "--steps", "2")
    text = capsys.readouterr().out
    listed = text[text.index("wrote:"):].splitlines()[1:]
    paths = [Path(line.split()[0]) for line in listed if line.startswith("  ")]
    assert {p.name for p in paths} >= {"summary.json", "metrics.jsonl", "step_2"}
    assert all(p.exists() for p in paths)
    assert (out / "checkpoints" / "step_2").is_dir()  # the final checkpoint, saved by default


def test_no_final_checkpoint_flag(tmp_path):
    out = _train(tmp_path, "--steps", "2", "--no-final-checkpoint")
    assert not (out / "checkpoints").exists()


# --------------------------------------------------------------------------- Weights & Biases


class _FakeRun:
    def __init__(self, **kwargs):
        self.kwargs, self.logged, self.summary, self.finished = kwargs, [], {}, False
        self.dir = str(Path(kwargs["dir"]) / "wandb" / "fake-run" / "files")

    def log(self, data, step):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


class _FakeWandb:
    """A stand-in module: what tenfold calls on `wandb` (init, then run.log/summary/finish)."""

    def __init__(self, fail: Exception | None = None):
        self.runs, self.fail = [], fail

    def init(self, **kwargs):
        if self.fail is not None:
            raise self.fail
        self.runs.append(_FakeRun(**kwargs))
        return self.runs[-1]


def test_wandb_gets_every_logged_step_and_the_final_figures(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = small_config(tmp_path, train={"steps": 3, "eval_every": 3}, log={"wandb": True, "wandb_project": "p"})
    Trainer(build_config(cfg)).fit()
    (run,) = fake.runs
    assert run.kwargs["project"] == "p" and run.kwargs["dir"] == str(tmp_path / "run")
    assert run.kwargs["config"]["train"]["steps"] == 3
    steps = [s for s, d in run.logged if "train/loss" in d]
    assert steps == [1, 2, 3]
    assert [s for s, d in run.logged if VAL_LOSS_TAG in d] == [3]
    assert run.summary["final/tokens_per_s"] > 0 and run.finished


def test_wandb_gets_the_output_folder_as_an_absolute_path(tmp_path, monkeypatch):
    """A relative --out reaches W&B resolved against the run's working directory, so that its
    files land under OUT whatever folder W&B's background process works in."""
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.chdir(tmp_path)
    cfg = small_config(tmp_path, train={"steps": 1}, log={"wandb": True, "out": "relative"})
    Trainer(build_config(cfg)).fit()
    (run,) = fake.runs
    assert run.kwargs["dir"] == str(tmp_path / "relative")


def test_wandb_that_cannot_start_does_not_stop_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", _FakeWandb(fail=RuntimeError("api_key not configured (no-tty)")))
    cfg = small_config(tmp_path, train={"steps": 2}, log={"wandb": True})
    assert Trainer(build_config(cfg)).fit()["final"]["steps"] == 2
    assert "wandb: not started (api_key not configured (no-tty))" in capsys.readouterr().out


def test_wandb_without_the_package_exits_2_before_writing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importlib.util.find_spec -> None
    out = tmp_path / "never"
    assert main(["train", "--out", str(out), "--wandb", *SMALL_FLAGS]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'tenfold[wandb]'" in err
    assert not out.exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="the wandb package is not installed (pip install 'tenfold[wandb]'); the fake-module tests cover the code path")
def test_wandb_offline_run_directory(tmp_path, monkeypatch):
    """The real package, no network: WANDB_MODE=offline writes OUT/wandb/offline-run-*/run-*.wandb
    holding the logged keys."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = small_config(tmp_path, train={"steps": 2}, log={"wandb": True})
    Trainer(build_config(cfg)).fit()
    (run_dir,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    (records,) = run_dir.glob("run-*.wandb")
    keys = (b"train/loss", b"perf/tokens_per_s", b"final/tokens_per_s")
    deadline = time.monotonic() + 60  # W&B's writer process may finish the file after run.finish()
    while not all(k in records.read_bytes() for k in keys) and time.monotonic() < deadline:
        time.sleep(0.5)
    data = records.read_bytes()
    for key in keys:
        assert key in data, key
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final"]["steps"] == 2
