"""Checkpoints that cannot be turned against their reader, probed as a hostile user would.

Every crafted checkpoint here is "resealed": its manifest is rewritten to match the altered
files, as an attacker who hands you a checkpoint would do, so the sha256 check alone cannot
catch it. Through `tenfold train` / `tenfold export` (the paths users take):

* manifest entries outside the folder (`../../../../dev/zero`, `/dev/zero`, a link to it) are
  refused in well under 5 s, one line, exit 2 (a hash would read them forever);
* DCP `.metadata` whose storage file is `../step_3/__0_0.distcp` is refused (else the run would
  resume "from step 6" with step 3's weights), and a `.metadata` pickle with code is one line;
* `--resume` on a regular file is one line, exit 2;
* a rank state file without `rng.numpy`: `--resume auto` falls back to the previous checkpoint
  naming the file, `--resume PATH` exits 2 (not a KeyError, exit 1); the same for
  every kind of malformed manifest, metadata, rank state and trainer state, with nothing of
  the run changed by a refused checkpoint;
* links planted in OUT/checkpoints (`.tmp-latest`, `.tmp-step_N`, a step folder) are never
  followed, and cleanup never deletes through them;
* a real full disk (a small tmpfs in a private mount namespace) keeps the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import plain_loop as t
from conftest import cli_train, copy_of_run, one_line, private_mount_prefix, text_corpus
from tenfold.engine.outputs import checkpoint as ck
from tenfold.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run trained through `tenfold train` to step 6 with checkpoints at 3 and 6."""
    base = tmp_path_factory.mktemp("hardening")
    data = text_corpus(base)
    out = base / "run"
    assert cli_train(out, data, "--checkpoint-every", "3", "--steps", "6") == 0
    return out, data


@pytest.fixture
def run_copy(saved_run, tmp_path):
    return copy_of_run(saved_run, tmp_path)


def reseal(ckpt: Path, extra: dict | None = None) -> None:
    """Rewrite the manifest so that it matches the (altered) files; `extra` entries as given."""
    mpath = ckpt / "manifest.json"
    manifest = json.loads(mpath.read_text())
    for name in manifest["files"]:
        p = ckpt / name
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["files"].update(extra or {})
    mpath.write_text(json.dumps(manifest))


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """rich wraps the log at the terminal width; one log line per line here."""
    monkeypatch.setenv("COLUMNS", "2000")


def train_cli(out: Path, data: Path, *extra: str) -> int:
    return cli_train(out, data, "--checkpoint-every", "3", *extra)


# --------------------------------------------------------------------------- manifest entries


def _export_within(seconds: float, ckpt: Path, out: Path) -> tuple[int, float]:
    """`tenfold export` in a daemon thread: (exit status, seconds), or a failure when it has not
    finished within `seconds` (a hash reading /dev/zero would never finish)."""
    import threading
    import time

    from tenfold import cli

    result: dict = {}

    def export() -> None:
        t0 = time.perf_counter()
        result["rc"] = cli.main(["export", str(ckpt), "--out", str(out)])
        result["seconds"] = time.perf_counter() - t0

    worker = threading.Thread(target=export, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"tenfold export still running after {seconds} s"
    return result["rc"], result["seconds"]


@pytest.mark.parametrize("entry", ["../dev/zero", "/dev/zero", "link"])
def test_manifest_entry_outside_the_folder_is_refused_fast(run_copy, entry, capsys):
    out, _ = run_copy
    ckpt = out / "checkpoints" / "step_6"
    if entry == "link":
        os.symlink("/dev/zero", ckpt / "zero")
        entry = "zero"
    elif entry.startswith(".."):  # enough '..' to reach / from this folder
        entry = "../" * len(ckpt.parts) + "dev/zero"
    reseal(ckpt, {entry: {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}})
    from tenfold.engine.outputs import export  # noqa: F401 - imported before the clock starts

    capsys.readouterr()
    rc, seconds = _export_within(5.0, ckpt, out / "x.safetensors")
    assert rc == 2 and seconds < 5.0
    err = one_line(capsys.readouterr().err)
    if entry == "zero":  # a plain name: refused when it is looked at (lstat), before any read
        assert f"checkpoint file refused: {ckpt / 'zero'} is a symbolic link" in err, err
    else:  # refused while the manifest is read, before any file is touched
        assert f"malformed checkpoint file {ckpt / 'manifest.json'}: {entry!r} is not a plain file name" in err, err
    assert not (out / "x.safetensors").exists()


# --------------------------------------------------------------------------- DCP metadata


def _metadata(ckpt: Path):
    return ck.SafeReader(ckpt).read_metadata()


def _point_storage_at(ckpt: Path, relative_path: str) -> None:
    metadata = _metadata(ckpt)
    for info in metadata.storage_data.values():
        info.relative_path = relative_path
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(ckpt)


def test_metadata_storage_outside_the_folder_is_refused(run_copy, capsys):
    out, data = run_copy
    step6 = out / "checkpoints" / "step_6"
    _point_storage_at(step6, "../step_3/__0_0.distcp")
    capsys.readouterr()
    assert train_cli(out, data, "--steps", "7", "--resume", str(step6)) == 2
    err = one_line(capsys.readouterr().err)
    assert f"malformed checkpoint file {step6 / '.metadata'}" in err and "not a plain file name" in err
    from tenfold import cli

    assert cli.main(["export", str(step6), "--out", str(out / "x.safetensors")]) == 2
    assert "not a plain file name" in one_line(capsys.readouterr().err)
    assert train_cli(out, data, "--steps", "7", "--resume", "auto") == 0
    log = capsys.readouterr().out
    assert "not a plain file name" in log and "falling back to the previous checkpoint" in log
    assert f"resumed from {out / 'checkpoints' / 'step_3'}" in log


def test_export_of_a_metadata_pickle_with_code_is_one_line(run_copy, capsys, tmp_path):
    from tenfold import cli

    out, _ = run_copy
    ckpt = out / "checkpoints" / "step_6"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    reseal(ckpt)
    capsys.readouterr()
    assert cli.main(["export", str(ckpt), "--out", str(tmp_path / "x.safetensors")]) == 2
    err = one_line(capsys.readouterr().err)
    assert "refusing to load posix.system" in err and str(ckpt / ".metadata") in err
    assert not marker.exists() and not (tmp_path / "x.safetensors").exists()


def test_resume_on_a_regular_file_is_one_line(run_copy, capsys):
    out, data = run_copy
    capsys.readouterr()
    assert train_cli(out, data, "--steps", "7", "--resume", str(data)) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{data} is a file, not a checkpoint" in err


# --------------------------------------------------------------------------- malformed files


def test_rank_state_without_an_entry_falls_back_or_exits_2(run_copy, capsys):
    out, data = run_copy
    step6 = out / "checkpoints" / "step_6"
    rank0 = json.loads((step6 / "rank_00000.json").read_text())
    del rank0["rng"]["numpy"]
    (step6 / "rank_00000.json").write_text(json.dumps(rank0))
    reseal(step6)
    capsys.readouterr()
    assert train_cli(out, data, "--steps", "7", "--resume", str(step6)) == 2
    err = one_line(capsys.readouterr().err)
    assert f"malformed checkpoint file {step6 / 'rank_00000.json'}: rng has no 'numpy' entry" in err
    assert train_cli(out, data, "--steps", "7", "--resume", "auto") == 0
    log = capsys.readouterr().out
    assert "rank_00000.json: rng has no 'numpy' entry; falling back to the previous checkpoint" in log
    assert f"resumed from {out / 'checkpoints' / 'step_3'}" in log


def _edit_json(ckpt: Path, name: str, edit) -> None:
    """Change the JSON file in place (`edit` mutates the loaded data)."""
    path = ckpt / name
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _replace_json(ckpt: Path, name: str, value) -> None:
    (ckpt / name).write_text(json.dumps(value))


def _storage_outside(ckpt: Path) -> None:
    _point_storage_at(ckpt, "../step_3/__0_0.distcp")


DAMAGE = {  # name -> (how the step_6 checkpoint is altered, the file named, what the message says)
    "rank: rng.numpy missing": (lambda c: _edit_json(c, "rank_00000.json", lambda d: d["rng"].pop("numpy")),
                                "rank_00000.json", "rng has no 'numpy' entry"),
    "rank: not an object": (lambda c: _replace_json(c, "rank_00000.json", []),
                            "rank_00000.json", "not a JSON object"),
    "rank: rng not base64": (lambda c: _edit_json(c, "rank_00000.json", lambda d: d["rng"].update(torch_cpu="!!")),
                             "rank_00000.json", "rng.torch_cpu is not valid base64"),
    "rank: rng wrong size": (lambda c: _edit_json(c, "rank_00000.json", lambda d: d["rng"].update(torch_cpu="AAAA")),
                             "rank_00000.json", "rng holds an unusable generator state"),
    "rank: loader entry missing": (lambda c: _edit_json(c, "rank_00000.json", lambda d: d["loader"].pop("samples_seen")),
                                   "rank_00000.json", "loader has no 'samples_seen' entry"),
    "trainer: step a string": (lambda c: _edit_json(c, "trainer_state.json", lambda d: d.update(step="6")),
                               "trainer_state.json", "step '6', manifest says 6"),
    "trainer: scheduler missing": (lambda c: _edit_json(c, "trainer_state.json", lambda d: d.pop("scheduler")),
                                   "trainer_state.json", "no 'scheduler' entry"),
    "trainer: counter a string": (lambda c: _edit_json(c, "trainer_state.json", lambda d: d["state"].update(tokens="x")),
                                  "trainer_state.json", "state.tokens must be integer, not string"),
    "trainer: scale null": (lambda c: _edit_json(c, "trainer_state.json", lambda d: d["scaler"].update(cur_scale=None)),
                            "trainer_state.json", "scaler.cur_scale must be number, not null"),
    "config: not an object": (lambda c: _replace_json(c, "config.json", []),
                              "config.json", "not a JSON object"),
    "metadata: garbage": (lambda c: (c / ".metadata").write_bytes(b"\x80\x04garbage"),
                          ".metadata", "pickle data was truncated"),
    "metadata: a dict": (lambda c: (c / ".metadata").write_bytes(pickle.dumps({})),
                         ".metadata", "it is not DCP checkpoint metadata"),
    "metadata: storage outside": (_storage_outside, ".metadata", "is not a plain file name"),
}
MANIFEST_DAMAGE = {
    "manifest: entry not sized": (lambda m: m["files"].update({".metadata": {"bytes": "x"}}),
                                  "the entry for '.metadata' must be"),
    "manifest: no files": (lambda m: m.pop("files"), "'files' must map file names"),
    "manifest: step a string": (lambda m: m.update(step="6"), "'step' must be a whole number"),
    "manifest: lists itself": (lambda m: m["files"].update({"manifest.json": m["files"][".metadata"]}),
                               "it lists itself"),
    "manifest: metadata unlisted": (lambda m: m["files"].pop(".metadata"), "it does not list .metadata"),
    "manifest: not json": (None, "not valid JSON"),
}


def _damage(ckpt: Path, kind: str) -> tuple[str, str]:
    """Alter the checkpoint as `kind` says; return (file named, expected message part)."""
    if kind in DAMAGE:
        alter, name, expect = DAMAGE[kind]
        alter(ckpt)
        reseal(ckpt)
        return name, expect
    alter, expect = MANIFEST_DAMAGE[kind]
    if alter is None:
        (ckpt / "manifest.json").write_text("{not json")
    else:
        _edit_json(ckpt, "manifest.json", alter)
    return "manifest.json", expect


def _weights(run) -> dict:
    return {k: v.clone() for k, v in run.model.state_dict().items()}


@pytest.mark.parametrize("kind", [*DAMAGE, *MANIFEST_DAMAGE])
def test_malformed_checkpoint_is_named_nothing_changes_and_auto_falls_back(tmp_path, kind):
    t.fresh_run_with_checkpoints(tmp_path, 6, every=3)
    ckpt = tmp_path / "checkpoints" / "step_6"
    name, expect = _damage(ckpt, kind)
    run = t.make_run()
    before = (_weights(run), dict(run.state), run.scheduler.last_epoch, torch.get_rng_state())
    with pytest.raises(UserError) as info:
        t.manager(tmp_path, run, resume=str(ckpt)).resume()
    message = str(info.value)
    assert str(ckpt / name) in message and expect in message and "\n" not in message, message
    weights, counters, epoch, rng = before  # a refused checkpoint changed nothing of the run
    assert run.state == counters and run.scheduler.last_epoch == epoch
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, weights[k]) for k, v in run.model.state_dict().items())
    messages: list[str] = []
    assert t.manager(tmp_path, run, resume="auto", messages=messages).resume()["step"] == 3
    assert any(expect in m and "falling back" in m for m in messages), messages


# --------------------------------------------------------------------------- planted links


def test_planted_links_in_checkpoints_are_never_followed(run_copy, tmp_path, capsys):
    out, data = run_copy
    root = out / "checkpoints"
    victim_file, victim_dir = tmp_path / "victim.txt", tmp_path / "victim_dir"
    victim_file.write_text("precious")
    victim_dir.mkdir()
    (victim_dir / "keep.txt").write_text("keep")
    os.symlink(victim_file, root / ".tmp-latest")
    os.symlink(victim_dir, root / ".tmp-step_9")
    capsys.readouterr()
    assert train_cli(out, data, "--steps", "9", "--resume", "auto") == 0
    assert victim_file.read_text() == "precious" and (victim_dir / "keep.txt").read_text() == "keep"
    assert not (root / "latest").is_symlink() and (root / "latest").read_text().strip() == "step_9"
    assert not (root / ".tmp-latest").exists() and not os.path.lexists(root / ".tmp-step_9")
    assert ck.verify_checkpoint(root / "step_9")["step"] == 9


def test_a_linked_step_folder_is_refused_and_auto_falls_back(run_copy, saved_run, tmp_path, capsys):
    out, data = run_copy
    other = tmp_path / "other"
    shutil.copytree(saved_run[0], other)
    root = out / "checkpoints"
    os.symlink(other / "checkpoints" / "step_3", root / "step_12")  # another run's checkpoint
    (root / "latest").write_text("step_12\n")
    capsys.readouterr()
    assert train_cli(out, data, "--steps", "7", "--resume", "auto") == 0
    log = capsys.readouterr().out
    assert f"{root / 'step_12'} is a symbolic link" in log and "falling back" in log
    assert f"resumed from {root / 'step_6'}" in log
    assert train_cli(out, data, "--steps", "7", "--resume", str(root / "step_12")) == 2
    assert "is a symbolic link" in one_line(capsys.readouterr().err)


def test_keep_last_never_deletes_through_a_link(tmp_path):
    victim = tmp_path / "victim_dir"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    root = tmp_path / "out" / "checkpoints"
    root.mkdir(parents=True)
    os.symlink(victim, root / "step_1")
    t.fresh_run_with_checkpoints(tmp_path / "out", 4, every=2, keep_last=1)
    assert (victim / "keep.txt").read_text() == "keep" and (root / "step_1").is_symlink()
    assert sorted(p.name for _, p in ck.list_step_dirs(root)) == ["step_4"]


# --------------------------------------------------------------------------- a real full disk


FULL_DISK = textwrap.dedent(
    """
    import json, os, subprocess, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    import plain_loop as t
    from tenfold.errors import UserError
    mnt = Path({mnt!r})
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size={size}", "tmpfs", str(mnt)], check=True)
    run = t.make_run()
    t.train(run, 3, t.manager(mnt, run))           # step_3 fits
    result = {{}}
    try:
        t.train(run, 6, t.manager(mnt, run))       # step_6 does not: the disk is full
    except UserError as e:
        result["error"] = str(e)
    root = mnt / "checkpoints"
    result["entries"] = sorted(os.listdir(root))
    result["resumed"] = t.manager(mnt, t.make_run(), resume="auto").resume()["step"]
    print(json.dumps(result))
    """
)


def test_real_full_disk_keeps_the_previous_checkpoint(tmp_path):
    prefix = private_mount_prefix()
    if prefix is None:
        pytest.skip("cannot mount a small tmpfs here (needs root or unprivileged user namespaces + unshare)")
    size = sum(f.stat().st_size for f in _one_checkpoint(tmp_path / "probe").iterdir())
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = FULL_DISK.format(tests=str(Path(__file__).parent), mnt=str(mnt), size=int(size * 1.5) + 65536)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*prefix, sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "No space left on device (errno 28)" in result["error"] and "step_3 is intact" in result["error"]
    assert result["entries"] == ["latest", "step_3"]  # the partial save was removed
    assert result["resumed"] == 3


def _one_checkpoint(out: Path) -> Path:
    t.fresh_run_with_checkpoints(out, 3)
    return out / "checkpoints" / "step_3"
