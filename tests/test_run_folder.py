"""The run folder (`--out`) belongs to one run, is checked before any work, and is written
without following links (engine/outputs/folder.py), through `tenfold train` / `tenfold export`:

* a fresh run into an --out that holds an earlier run exits 2 naming --resume auto and
  --overwrite, before data or model are built, and changes nothing (no metrics appended, no
  step_2 overwritten, `latest` not moved back); --overwrite moves the earlier run aside,
  deletes it only after the new run's first step, and puts it back if the new run fails first;
* on resume metrics.jsonl is cut back to the resumed step (also after a real kill -9), so
  every step appears once;
* --out that is a file, under a file, in /proc or on a read-only file system; --resume that is
  a device, a FIFO or a dangling link; --data that is a device or a FIFO; export --out that is
  a folder or cannot be written: one line, exit 2, before any work;
* links planted at metrics.jsonl, summary.json, tensorboard, tokenizer and at the scratch names
  are refused or replaced, never followed, and --overwrite never deletes through them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import cli_train, copy_of_run, one_line, private_mount_prefix, text_corpus
from tenfold import cli
from tenfold.engine.outputs import checkpoint as ck

pytestmark = pytest.mark.usefixtures("one_thread")
ASIDE_PREFIX = ".tenfold-replaced-"  # engine/outputs/folder.py: where --overwrite puts the earlier run


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # one log line per line


@pytest.fixture
def no_build(monkeypatch):
    """The checks must come first: building the data fails the test."""
    import tenfold.data

    def built(*args, **kwargs):
        raise AssertionError("the data was built before the run folder was checked")

    monkeypatch.setattr(tenfold.data, "build_data", built)


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """A finished run: 4 steps, checkpoints at 2 and 4."""
    base = tmp_path_factory.mktemp("run_folder")
    data = text_corpus(base)
    out = base / "run"
    assert train(out, data, "--steps", "4") == 0
    return out, data


@pytest.fixture
def run_copy(earlier, tmp_path):
    return copy_of_run(earlier, tmp_path)


def train(out: Path, data: Path, *extra: str) -> int:
    return cli_train(out, data, "--checkpoint-every", "2", *extra)


def steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def steps_so_far(out: Path) -> list[int]:
    """`steps` of a run that is still writing (or was killed while writing): a last row not yet
    complete is left out."""
    path = out / "metrics.jsonl"
    lines = path.read_text().split("\n") if path.exists() else []
    return [json.loads(line)["step"] for line in lines[:-1]]  # the text after the last newline is unfinished


def snapshot(folder: Path) -> dict:
    """Every entry below `folder`: file bytes, link targets, folders."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = ("link", os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


def error_line(capsys) -> str:
    return one_line(capsys.readouterr().err)


# --------------------------------------------------------------------------- one run per folder


def test_a_fresh_run_into_an_earlier_run_is_refused_and_changes_nothing(run_copy, no_build, capsys):
    out, data = run_copy
    before = snapshot(out)
    capsys.readouterr()
    assert train(out, data, "--steps", "2") == 2
    err = error_line(capsys)
    assert f"--out {out} holds an earlier run (metrics.jsonl, summary.json, checkpoints/step_4, checkpoints/latest)" in err
    assert "continue it with --resume auto, or replace it with --overwrite" in err
    assert snapshot(out) == before


def test_overwrite_keeps_the_earlier_run_aside_until_the_first_checkpoint(run_copy, monkeypatch, capsys):
    from tenfold.engine.loop.trainer import Trainer

    out, data = run_copy
    real, seen = Trainer.train_step, []

    def each_step_sees_the_folder(self, micro_batches):
        asides = [p for p in out.iterdir() if p.name.startswith(ASIDE_PREFIX)]
        checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").exists() else []
        seen.append(([steps(p) for p in asides], checkpoints))
        return real(self, micro_batches)

    monkeypatch.setattr(Trainer, "train_step", each_step_sees_the_folder)
    assert train(out, data, "--steps", "3", "--overwrite") == 0
    # steps 1 and 2: the earlier run aside, whole; step 3: the new run has its step_2, the old one is gone
    assert seen == [([[1, 2, 3, 4]], []), ([[1, 2, 3, 4]], []), ([], ["latest", "step_2"])]
    assert steps(out) == [1, 2, 3]
    assert sorted(p.name for _, p in ck.list_step_dirs(out / "checkpoints")) == ["step_2", "step_3"]
    assert not [p for p in out.iterdir() if p.name.startswith(ASIDE_PREFIX)]


def test_overwrite_that_fails_before_its_first_checkpoint_keeps_the_earlier_run_and_says_where(
        run_copy, monkeypatch, capsys):
    """The new run fails at step 2 (a non-finite loss, say), before any checkpoint: the earlier
    run is still there, whole, and the note names the folder it is in."""
    from tenfold.engine.loop.trainer import Trainer
    from tenfold.errors import RunError

    out, data = run_copy
    before, real, calls = snapshot(out), Trainer.train_step, []

    def fails_at_step_2(self, micro_batches):
        calls.append(1)
        if len(calls) == 2:
            raise RunError("non-finite loss at step 2")
        return real(self, micro_batches)

    monkeypatch.setattr(Trainer, "train_step", fails_at_step_2)
    capsys.readouterr()
    assert train(out, data, "--steps", "4", "--overwrite") == 1
    (aside,) = [p for p in out.iterdir() if p.name.startswith(ASIDE_PREFIX)]
    assert snapshot(aside) == before  # the earlier run, byte for byte
    assert steps(out) == [1]  # and what the failed run did, where it ran
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (f"tenfold: note: --overwrite: this run stopped before its first checkpoint; the run it "
                      f"replaced is kept, whole, in {aside} (move its entries back to use it again)"), err
    assert err[1] == "tenfold: run stopped: non-finite loss at step 2" and len(err) == 2, err


def test_overwrite_without_checkpoints_replaces_the_earlier_run_once_finished(run_copy, monkeypatch):
    from tenfold.engine.loop.trainer import Trainer

    out, data = run_copy
    real, seen = Trainer.train_step, []

    def each_step(self, micro_batches):
        seen.append(len([p for p in out.iterdir() if p.name.startswith(ASIDE_PREFIX)]))
        return real(self, micro_batches)

    monkeypatch.setattr(Trainer, "train_step", each_step)
    assert cli_train(out, data, "--steps", "2", "--overwrite", "--no-final-checkpoint") == 0
    assert seen == [1, 1] and not [p for p in out.iterdir() if p.name.startswith(ASIDE_PREFIX)]
    assert steps(out) == [1, 2] and not (out / "checkpoints").exists()


def test_overwrite_that_fails_before_its_first_step_puts_the_earlier_run_back(run_copy, monkeypatch, capsys):
    from tenfold.engine.loop.trainer import Trainer

    out, data = run_copy
    before = snapshot(out)

    def fails(self, micro_batches):
        raise RuntimeError("the new run fails in its first step")

    monkeypatch.setattr(Trainer, "train_step", fails)
    assert train(out, data, "--steps", "2", "--overwrite") == 1
    assert snapshot(out) == before


def test_a_new_run_that_fails_before_its_first_step_leaves_no_folder(tmp_path, monkeypatch):
    from tenfold.engine.loop.trainer import Trainer

    data = text_corpus(tmp_path)

    def fails(self, micro_batches):
        raise RuntimeError("no first step")

    monkeypatch.setattr(Trainer, "train_step", fails)
    assert train(tmp_path / "new", data, "--steps", "2") == 1
    assert not (tmp_path / "new").exists()  # so the retry is not refused as "an earlier run"


def test_overwrite_and_resume_together_are_refused(run_copy, no_build, capsys):
    out, data = run_copy
    capsys.readouterr()
    assert train(out, data, "--overwrite", "--resume", "auto") == 2
    assert "--overwrite starts a new run in --out and --resume continues the one there" in error_line(capsys)


# --------------------------------------------------------------------------- resume: every step once


def test_resume_cuts_the_metrics_back_to_the_resumed_step(run_copy, capsys):
    out, data = run_copy
    root = out / "checkpoints"
    shutil.rmtree(root / "step_4")  # as if killed during step 5, before step 4's checkpoint was kept
    (root / "latest").write_text("step_2\n")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 3.1')  # a row cut short by the kill
    capsys.readouterr()
    assert train(out, data, "--steps", "6", "--resume", "auto") == 0
    assert "metrics: 3 row(s) after step 2 removed from metrics.jsonl" in capsys.readouterr().out
    assert steps(out) == [1, 2, 3, 4, 5, 6]


KILLED = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from conftest import cli_train
    from pathlib import Path
    sys.exit(cli_train(Path({out!r}), Path({data!r}), "--checkpoint-every", "3", "--steps", "100000"))
    """
)


def test_every_step_once_after_a_real_kill_and_resume(tmp_path):
    data = text_corpus(tmp_path)
    out = tmp_path / "run"
    script = KILLED.format(tests=str(Path(__file__).parent), out=str(out), data=str(data))
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # killed once 8 steps are logged and the last is not a checkpoint step (checkpoints every 3),
        # so the steps after the last checkpoint have rows: the run would need a whole step and a
        # save between this read and the kill to leave none
        deadline = time.time() + 120
        while len(logged := steps_so_far(out)) < 8 or logged[-1] % 3 == 0:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    logged, saved = steps_so_far(out)[-1], int(ck.read_latest(out / "checkpoints").name.split("_")[1])
    assert logged > saved  # the kill left rows of steps that the resume redoes
    assert train(out, data, "--checkpoint-every", "3", "--steps", str(logged + 2), "--resume", "auto") == 0
    assert steps(out) == list(range(1, logged + 3))


# --------------------------------------------------------------------------- paths checked first


def _long_name(tmp_path: Path) -> str:
    return str(tmp_path / ("x" * 300))


@pytest.mark.parametrize("where, expected", [
    ("a_file", "is a file, not a folder; give a folder (created when missing)"),
    ("a_file/run", "is under {tmp}/a_file, which is a file, not a folder"),
    ("/proc/tenfold-run", "cannot be written: creating a folder in /proc fails"),
    ("long", "File name too long"),
])
@pytest.mark.parametrize("nproc", [1, 2])
def test_out_that_cannot_be_a_folder_is_one_line_before_any_work(tmp_path, no_build, capsys, where, expected, nproc):
    (tmp_path / "a_file").write_text("mine")
    out = _long_name(tmp_path) if where == "long" else where if where.startswith("/") else str(tmp_path / where)
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert cli_train(Path(out), tmp_path / "a_file", "--nproc", str(nproc)) == 2  # --nproc 2: the launcher, once
    err = error_line(capsys)
    assert err.startswith("tenfold: error: --out ") and expected.format(tmp=tmp_path) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and (tmp_path / "a_file").read_text() == "mine"


READ_ONLY = textwrap.dedent(
    """
    import subprocess, sys
    sys.path.insert(0, {tests!r})
    from conftest import cli_train
    from pathlib import Path
    import tenfold.data
    def built(*a, **k):
        raise AssertionError("data built")
    tenfold.data.build_data = built
    mnt = Path({mnt!r})
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mnt)], check=True)
    sys.exit(cli_train(mnt / "run", Path({data!r})))
    """
)


def test_out_on_a_read_only_file_system_is_one_line_before_any_work(tmp_path):
    prefix = private_mount_prefix()
    if prefix is None:
        pytest.skip("cannot mount a read-only tmpfs here (needs root or unprivileged user namespaces + unshare)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = READ_ONLY.format(tests=str(Path(__file__).parent), mnt=str(mnt), data=str(text_corpus(tmp_path)))
    proc = subprocess.run([*prefix, sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert one_line(proc.stderr) == (f"tenfold: error: --out {mnt}/run cannot be written: creating a folder in "
                                          f"{mnt} fails (Read-only file system); choose a writable place")


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind", ["device", "fifo", "dangling link"])
def test_resume_that_is_not_a_folder_is_one_line_before_any_work(tmp_path, no_build, capsys, kind):
    data = text_corpus(tmp_path)
    if kind == "device":
        path, expected = Path(os.devnull), f"--resume {os.devnull} is a device, FIFO or socket, not a checkpoint"
    elif kind == "fifo":
        path = _fifo(tmp_path)
        expected = f"--resume {path} is a device, FIFO or socket, not a checkpoint"
    else:
        path = tmp_path / "gone"
        os.symlink(tmp_path / "nowhere", path)
        expected = f"checkpoint not found: --resume {path} is a symbolic link to {tmp_path / 'nowhere'}, which does not exist"
    capsys.readouterr()
    assert cli_train(tmp_path / "run", data, "--resume", str(path)) == 2
    assert expected in error_line(capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["device", "fifo", "link"])
def test_export_of_what_is_not_a_checkpoint_folder_is_one_line(earlier, tmp_path, capsys, kind):
    if kind == "link":
        path = tmp_path / "run_link"
        os.symlink(earlier[0], path)
        expected = f"export {path} is a symbolic link; tenfold does not read checkpoints through links: give the folder itself"
    else:
        path = Path(os.devnull) if kind == "device" else _fifo(tmp_path)
        expected = f"export {path} is a device, FIFO or socket, not a checkpoint"
    capsys.readouterr()
    assert cli.main(["export", str(path), "--out", str(tmp_path / "x.safetensors")]) == 2
    assert expected in error_line(capsys)


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_data_that_is_a_device_or_fifo_is_one_line(tmp_path, capsys, kind):
    path = Path(os.devnull) if kind == "device" else _fifo(tmp_path)
    capsys.readouterr()
    assert cli_train(tmp_path / "run", path) == 2
    assert f"data.path: {path} is not a regular file or a folder; give a data file or a folder of them" in error_line(capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where, expected", [
    ("folder", "export --out {out} is a folder; give a file name, e.g. {out}/model.safetensors"),
    ("a_file/x.safetensors", "export --out {out}: its folder {tmp}/a_file is a file, not a folder"),
    ("/proc/x.safetensors", "export --out {out}: its folder /proc cannot be written"),
])
def test_export_out_is_checked_before_any_work(earlier, tmp_path, monkeypatch, capsys, where, expected):
    from tenfold.engine.outputs.checkpoint import layout

    def verified(*args, **kwargs):
        raise AssertionError("the checkpoint was hashed before --out was checked")

    monkeypatch.setattr(layout, "verify_checkpoint", verified)
    (tmp_path / "folder").mkdir()
    (tmp_path / "a_file").write_text("mine")
    out = where if where.startswith("/") else str(tmp_path / where)
    capsys.readouterr()
    assert cli.main(["export", str(earlier[0]), "--out", out]) == 2
    assert expected.format(out=out, tmp=tmp_path) in error_line(capsys)


def test_export_never_writes_through_a_planted_scratch_link(earlier, tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / ".model.safetensors.tmp")
    os.symlink(victim, tmp_path / ".model.config.json.tmp")
    assert cli.main(["export", str(earlier[0]), "--out", str(tmp_path / "model.safetensors")]) == 0
    assert victim.read_text() == "precious"
    assert not os.path.lexists(tmp_path / ".model.safetensors.tmp") and (tmp_path / "model.safetensors").is_file()


# --------------------------------------------------------------------------- planted links


def _victims(tmp_path: Path) -> tuple[Path, Path]:
    victim_file, victim_dir = tmp_path / "victim.txt", tmp_path / "victim_dir"
    victim_file.write_text("precious\n")
    victim_dir.mkdir()
    (victim_dir / "keep.txt").write_text("keep")
    return victim_file, victim_dir


def _plant(out: Path, name: str, target: Path) -> None:
    path = out / name
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    os.symlink(target, path)


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "tensorboard", "tokenizer", "model.safetensors"])
def test_a_link_where_the_run_writes_is_refused(run_copy, tmp_path, capsys, name):
    out, data = run_copy
    victim_file, victim_dir = _victims(tmp_path)
    _plant(out, name, victim_dir if name in ("tensorboard", "tokenizer") else victim_file)
    capsys.readouterr()
    assert train(out, data, "--steps", "5", "--resume", "auto", "--set", "log.tensorboard=true") == 2
    err = error_line(capsys)
    assert f"{out / name} is a symbolic link; tenfold does not follow links in a run folder" in err, err
    assert victim_file.read_text() == "precious\n" and sorted(p.name for p in victim_dir.iterdir()) == ["keep.txt"]


def test_links_at_scratch_names_are_replaced_never_followed(run_copy, tmp_path, capsys):
    out, data = run_copy
    victim_file, victim_dir = _victims(tmp_path)
    for name in ("summary.json.tmp", ".metrics.jsonl.tmp"):
        os.symlink(victim_file, out / name)
    os.symlink(victim_dir, out / ".tokenizer.tmp")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5')  # a cut row: metrics.jsonl is rewritten through its scratch name
    assert train(out, data, "--steps", "5", "--resume", "auto") == 0
    assert victim_file.read_text() == "precious\n" and sorted(p.name for p in victim_dir.iterdir()) == ["keep.txt"]
    for name in ("summary.json.tmp", ".metrics.jsonl.tmp", ".tokenizer.tmp"):
        assert not os.path.lexists(out / name), name
    assert (out / "tokenizer" / "tokenizer.json").is_file() and not (out / "tokenizer").is_symlink()
    assert steps(out) == [1, 2, 3, 4, 5] and json.loads((out / "summary.json").read_text())["final"]["steps"] == 5


def test_overwrite_never_deletes_through_a_link(run_copy, tmp_path):
    out, data = run_copy
    victim_file, victim_dir = _victims(tmp_path)
    _plant(out, "tensorboard", victim_dir)
    _plant(out, "metrics.jsonl", victim_file)
    os.symlink(victim_dir, out / "checkpoints" / "step_1")
    assert train(out, data, "--steps", "2", "--overwrite") == 0
    assert victim_file.read_text() == "precious\n" and sorted(p.name for p in victim_dir.iterdir()) == ["keep.txt"]
    assert steps(out) == [1, 2] and not (out / "metrics.jsonl").is_symlink()


def test_the_metrics_writer_itself_never_writes_through_a_link(tmp_path):
    """Behind the up-front refusal: a link planted after the check is not followed either."""
    from tenfold.engine.observe.metrics import MetricsWriter
    from tenfold.engine.outputs.safe_files import UnsafeFileError

    victim_file, victim_dir = _victims(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim_file, out / "metrics.jsonl")
    with pytest.raises(UnsafeFileError, match="metrics.jsonl is a symbolic link"):
        MetricsWriter(out, enabled=True, tensorboard=False)
    (out / "metrics.jsonl").unlink()
    os.symlink(victim_dir, out / "tensorboard")
    with pytest.raises(UnsafeFileError, match="tensorboard is not a folder"):
        MetricsWriter(out, enabled=True, tensorboard=True)
    assert victim_file.read_text() == "precious\n" and sorted(p.name for p in victim_dir.iterdir()) == ["keep.txt"]


def test_overwrite_keeps_a_checkpoints_link_and_replaces_what_is_behind_it(run_copy, tmp_path, monkeypatch):
    """OUT/checkpoints may be your link to a scratch disk: it stays, the old checkpoints behind
    it go (and come back if the new run fails before its first step)."""
    from tenfold.engine.loop.trainer import Trainer

    out, data = run_copy
    scratch = tmp_path / "scratch"
    shutil.move(out / "checkpoints", scratch)
    os.symlink(scratch, out / "checkpoints")
    before, behind, real = snapshot(out), snapshot(scratch), Trainer.train_step

    def fails(self, micro_batches):
        raise RuntimeError("no first step")

    monkeypatch.setattr(Trainer, "train_step", fails)
    assert train(out, data, "--steps", "2", "--overwrite") == 1
    assert snapshot(out) == before and snapshot(scratch) == behind
    monkeypatch.setattr(Trainer, "train_step", real)
    assert train(out, data, "--steps", "2", "--overwrite") == 0
    assert (out / "checkpoints").is_symlink() and sorted(p.name for p in scratch.iterdir()) == ["latest", "step_2"]
    assert steps(out) == [1, 2] and not [p for p in out.iterdir() if p.name.startswith(ASIDE_PREFIX)]
