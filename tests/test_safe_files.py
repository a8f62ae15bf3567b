"""engine/outputs/safe_files.Folder: files in a run folder are never reached through a link.

Each test plants what a hostile user of a shared filesystem could (a link at the name tenfold
writes or reads, a FIFO, a device, a name with '..') and checks that the link's target is
untouched, nothing blocks, and the refusal is one UserError line.
"""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from tenfold.engine.outputs.safe_files import Folder, UnsafeFileError, check_plain_name
from tenfold.errors import UserError


@pytest.fixture
def victim(tmp_path):
    """A file and a folder outside the run folder that a planted link points at."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("precious")
    (outside / "dir").mkdir()
    (outside / "dir" / "keep.txt").write_text("keep")
    return outside


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.mark.parametrize("name", ["..", ".", "", "../x", "/etc/passwd", "a/b", "x\0y", 3, None])
def test_only_plain_names(tmp_path, name):
    with pytest.raises(UnsafeFileError, match="not a plain file name"):
        check_plain_name(name, tmp_path)
    assert issubclass(UnsafeFileError, UserError)


def test_write_atomic_replaces_planted_links_without_writing_through(run_dir, victim):
    os.symlink(victim / "precious.txt", run_dir / "summary.json")
    os.symlink(victim / "precious.txt", run_dir / ".summary.json.tmp")
    with Folder(run_dir) as folder:
        folder.write_atomic("summary.json", b"{}")
    assert (victim / "precious.txt").read_text() == "precious"
    assert not (run_dir / "summary.json").is_symlink() and (run_dir / "summary.json").read_text() == "{}"
    assert not os.path.lexists(run_dir / ".summary.json.tmp")


def test_open_append_refuses_a_link(run_dir, victim):
    os.symlink(victim / "precious.txt", run_dir / "metrics.jsonl")
    with Folder(run_dir) as folder, pytest.raises(UnsafeFileError, match="metrics.jsonl is a symbolic link"):
        folder.open_append("metrics.jsonl")
    assert (victim / "precious.txt").read_text() == "precious"
    (run_dir / "metrics.jsonl").unlink()
    with Folder(run_dir) as folder:
        with folder.open_append("metrics.jsonl") as f:
            f.write('{"step": 1}\n')
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_reads_refuse_links_fifos_devices_and_oversize(run_dir, victim):
    os.symlink(victim / "precious.txt", run_dir / "link")
    os.mkfifo(run_dir / "fifo")  # an open() for reading would block until a writer comes
    os.symlink("/dev/zero", run_dir / "zero")
    (run_dir / "big").write_bytes(b"x" * 100)
    with Folder(run_dir) as folder:
        with pytest.raises(UnsafeFileError, match="link is a symbolic link"):
            folder.read_bytes("link", 1000)
        with pytest.raises(UnsafeFileError, match="fifo is a FIFO"):
            folder.read_bytes("fifo", 1000)
        with pytest.raises(UnsafeFileError, match="zero is a symbolic link"):
            folder.sha256("zero", 0)
        with pytest.raises(UnsafeFileError, match="big is 100 bytes; at most 10 expected"):
            folder.read_bytes("big", 10)
        assert folder.read_bytes("big", 100) == b"x" * 100
        assert folder.sha256("big", 100) == hashlib.sha256(b"x" * 100).hexdigest()
        with pytest.raises(UnsafeFileError):  # declared smaller than the file: not read past it
            folder.sha256("big", 99)
    with Folder("/dev") as dev, pytest.raises(UnsafeFileError, match="null is a device"):
        dev.read_bytes("null", 10)


def test_a_folder_that_is_a_link_is_refused_unless_followed_on_purpose(run_dir, victim):
    os.symlink(victim / "dir", run_dir / "step_9")
    with Folder(run_dir) as folder, pytest.raises(UnsafeFileError, match="step_9 is a symbolic link"):
        folder.subfolder("step_9")
    with pytest.raises(UnsafeFileError, match="is a symbolic link"):
        Folder(run_dir / "step_9")
    with Folder(run_dir / "step_9", follow=True) as followed:  # a link the user made, e.g. to scratch
        assert followed.names() == ["keep.txt"]


def test_remove_never_deletes_through_a_link(run_dir, victim):
    (run_dir / "tree").mkdir()
    os.symlink(victim / "dir", run_dir / "tree" / "inner_link")
    os.symlink(victim / "precious.txt", run_dir / "tree" / "file_link")
    os.symlink(victim / "dir", run_dir / "top_link")
    with Folder(run_dir) as folder:
        folder.remove("tree")
        folder.remove("top_link")
        folder.remove("missing")  # nothing there: fine
    assert sorted(os.listdir(run_dir)) == []
    assert (victim / "dir" / "keep.txt").read_text() == "keep"
    assert (victim / "precious.txt").read_text() == "precious"


def test_a_fifo_in_place_of_a_file_never_blocks(run_dir):
    os.mkfifo(run_dir / "metrics.jsonl")
    done = threading.Event()

    def append() -> None:
        with Folder(run_dir) as folder, pytest.raises(UnsafeFileError, match="metrics.jsonl is a FIFO"):
            folder.open_append("metrics.jsonl")
        done.set()

    worker = threading.Thread(target=append, daemon=True)
    worker.start()
    assert done.wait(5.0), "opening a FIFO blocked"
