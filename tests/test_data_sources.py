"""Data sources beyond plain files (CPU, nothing downloaded): Hugging Face `datasets` folders
and parquet files, the streaming path and its exact resume, and `tenfold data prepare`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import read_metrics, small_config
from tenfold import Trainer
from tenfold.config import DataSection
from tenfold.data import StreamingLoader, build_data
from tenfold.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


def _docs(n: int = 60) -> list[str]:
    return [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 31}" for j in range(8 + i % 9)) for i in range(n)]


@pytest.fixture
def text_jsonl(tmp_path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs()))
    return path


@pytest.fixture
def pc_jsonl(tmp_path) -> Path:
    path = tmp_path / "pc.jsonl"
    rows = [{"prompt": f"question {i}? ", "completion": f"answer {i % 7}."} for i in range(60)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(bundle) -> np.ndarray:
    """All rows of an in-memory bundle, or of a streamed one read in order."""
    if bundle.stream is None:
        rows = bundle.train
        return np.asarray(rows.tokens if hasattr(rows, "tokens") else rows)
    rows = [r[0] if isinstance(r, tuple) else r for r, _ in bundle.stream.read(bundle.stream.start)]
    return np.stack(rows)


def _batch_rows(batches: list[dict]) -> torch.Tensor:
    return torch.cat([torch.cat([b["input_ids"], b["labels"][:, -1:]], dim=1) for b in batches])


# --------------------------------------------------------------------------- streaming rows


@pytest.mark.parametrize("fixture", ["text_jsonl", "pc_jsonl"])
def test_streamed_rows_equal_the_in_memory_rows(fixture, request):
    path = request.getfixturevalue(fixture)
    memory = build_data(DataSection(path=str(path), val_fraction=0), 16, 0)
    streamed = build_data(DataSection(path=str(path), val_fraction=0, streaming=True), 16, 0)
    assert streamed.train is None and streamed.format == memory.format
    np.testing.assert_array_equal(_rows(streamed), _rows(memory))


def test_streaming_holds_out_every_kth_record(text_jsonl):
    bundle = build_data(DataSection(path=str(text_jsonl), val_fraction=0.25, streaming=True), 16, 0)
    val_text = b"".join(bytes(r) for r in np.asarray(bundle.val, dtype=np.uint8)).decode()
    train_text = b"".join(bytes(r) for r in _rows(bundle).astype(np.uint8)).decode()
    assert "document 3:" in val_text and "document 7:" in val_text and "document 3:" not in train_text
    assert "document 0:" in train_text and "document 0:" not in val_text


def test_streaming_loader_resumes_mid_block_exactly_on_another_split(text_jsonl):
    """A loader restored from a state saved mid-block (2 ranks x 1 micro-batch) continues with
    the rows an uninterrupted 1-rank loader sees, across a block and an epoch boundary."""
    bundle = build_data(DataSection(path=str(text_jsonl), val_fraction=0, streaming=True), 8, 0)
    n_rows = len(_rows(bundle))

    def loader(micro, accum, rank, dp):
        return StreamingLoader(bundle.stream, micro * accum * dp, micro, accum, rank, dp, seed=5, block_rows=7)

    whole = loader(2, 1, 0, 1)
    reference = [_batch_rows(whole.next_step()) for _ in range(n_rows)]  # > one epoch
    first = [loader(1, 1, r, 2) for r in range(2)]
    for _ in range(5):
        [ld.next_step() for ld in first]
    state = json.loads(json.dumps(first[0].state_dict()))
    assert state["index_in_block"] not in (0, 7)  # really mid-block
    resumed = loader(2, 1, 0, 1)
    resumed.load_state_dict(state)
    for k in range(5, n_rows):
        assert torch.equal(_batch_rows(resumed.next_step()), reference[k]), k
    assert resumed.epoch >= 1
    from collections import Counter

    epoch_rows = Counter(tuple(r.tolist()) for r in torch.cat(reference[: n_rows // 2]))
    stream_rows = Counter(tuple(r.tolist()) for r in _rows(bundle))
    assert sum(epoch_rows.values()) == 2 * (n_rows // 2) and not epoch_rows - stream_rows  # each row once per epoch


def test_streamed_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """A `datasets` save_to_disk folder, streamed: 6 steps straight, and 3 + resume + 3 give the
    same losses (the checkpoint stores the stream position)."""
    datasets = pytest.importorskip("datasets", reason="needs the data extra: pip install 'tenfold[data]'")
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": _docs(200)}).save_to_disk(str(folder))
    data = {"path": str(folder), "streaming": True, "shuffle_block": 16, "max_bytes": None}
    full = Trainer(small_config(tmp_path / "full", data=data, train={"steps": 6}, checkpoint={"every": 3})).fit()
    resumed = Trainer(small_config(tmp_path / "resumed", data=data, train={"steps": 6},
                                   checkpoint={"resume": str(tmp_path / "full" / "run" / "checkpoints" / "step_3")})).fit()
    np.testing.assert_allclose(resumed["losses"][-3:], full["losses"][-3:], rtol=1e-6)
    assert [m["step"] for m in read_metrics(tmp_path / "resumed" / "run")] == [4, 5, 6]
    state = json.loads((tmp_path / "full" / "run" / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert state["loader"]["kind"] == "stream" and state["loader"]["samples_seen"] == 3 * 4


# --------------------------------------------------------------------------- datasets


def test_save_to_disk_folder_and_parquet_give_the_jsonl_rows_and_train(tmp_path, text_jsonl):
    datasets = pytest.importorskip("datasets", reason="needs the data extra: pip install 'tenfold[data]'")
    ds = datasets.Dataset.from_dict({"text": _docs()})
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "docs.parquet"))
    os.environ.setdefault("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    reference = build_data(DataSection(path=str(text_jsonl)), 16, 0)
    for path in (tmp_path / "saved", tmp_path / "docs.parquet"):
        bundle = build_data(DataSection(path=str(path)), 16, 0)
        np.testing.assert_array_equal(np.asarray(bundle.train), np.asarray(reference.train))
    summary = Trainer(small_config(tmp_path / "run", data={"path": str(tmp_path / "saved")})).fit()
    assert len(summary["losses"]) == 3 and all(np.isfinite(summary["losses"]))
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(UserError, match="no split 'validation'.*train, test"):
        build_data(DataSection(path=str(tmp_path / "dict"), split="validation"), 16, 0)


def test_a_dataset_name_not_in_the_cache_is_an_error_not_a_download(tmp_path, monkeypatch):
    pytest.importorskip("datasets", reason="needs the data extra: pip install 'tenfold[data]'")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_home" / "datasets"))
    with pytest.raises(UserError, match="hf:tenfold-no-such-dataset.*local datasets cache"):
        build_data(DataSection(path="hf:tenfold-no-such-dataset"), 16, 0)


# --------------------------------------------------------------------------- data prepare


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`tenfold ARGS` in this process (the CLI's own main: parse, call, exit status)."""
    import contextlib
    import io

    from tenfold.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's own errors
            code = int(e.code)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_prepared_bin_trains_exactly_like_tokenizing_on_the_fly(tmp_path, text_jsonl):
    r = _cli("data", "prepare", str(text_jsonl), "--out", str(tmp_path / "docs.bin"), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "docs.bin" in r.stdout and "docs.json" in r.stdout
    info = json.loads((tmp_path / "docs.json").read_text())
    assert info["dtype"] == "uint16" and info["documents"] == 60 and info["tokenizer"]["name"] == "byte"
    fly = build_data(DataSection(path=str(text_jsonl)), 16, 0)
    prepared = build_data(DataSection(path=str(tmp_path / "docs.bin")), 16, 0, model_vocab_size=256)
    np.testing.assert_array_equal(np.asarray(prepared.train), np.asarray(fly.train))
    assert prepared.tokenizer.name == "byte"  # FILE.json names it
    losses = []
    for name, path in (("fly", text_jsonl), ("bin", tmp_path / "docs.bin")):
        cfg = small_config(tmp_path / name, data={"path": str(path), "max_bytes": None, "seq_len": 16})
        losses.append(Trainer(cfg).fit()["losses"])
    np.testing.assert_array_equal(losses[0], losses[1])


def test_data_prepare_bad_input_exits_2_and_writes_nothing(tmp_path, pc_jsonl, text_jsonl):
    r = _cli("data", "prepare", str(pc_jsonl), "--out", str(tmp_path / "pc.bin"), "--no-progress")
    assert r.returncode == 2 and "prompt-completion" in r.stderr and "Traceback" not in r.stderr
    r = _cli("data", "prepare", str(text_jsonl), "--out", str(tmp_path / "x.txt"))
    assert r.returncode == 2 and ".bin" in r.stderr
    assert not list(tmp_path.glob("*.bin")) and not list(tmp_path.glob(".*tmp"))
    r = _cli("data")
    assert r.returncode == 2 and "prepare" in r.stderr


def test_bin_from_another_tokenizer_is_refused(tmp_path, text_jsonl):
    from tenfold.data.prepare import prepare

    prepare(str(text_jsonl), tmp_path / "docs.bin", progress=True)  # the progress bar drawn (not a terminal here)
    bpe_dir = tmp_path / "tok"
    from tenfold.data.tokenizer import BPETokenizer

    BPETokenizer.train(_docs(), 300).save(bpe_dir)
    with pytest.raises(UserError, match="prepared with the tokenizer byte"):
        build_data(DataSection(path=str(tmp_path / "docs.bin"), tokenizer=str(bpe_dir)), 16, 0)


def test_a_bin_file_needs_no_tokenizer_and_fits_a_small_vocabulary(tmp_path):
    """The default byte tokenizer is not checked against a .bin run's model (ids < 100 here)."""
    (np.arange(2000) % 100).astype(np.uint16).tofile(tmp_path / "ids.bin")
    bundle = build_data(DataSection(path=str(tmp_path / "ids.bin")), 16, 0, model_vocab_size=100)
    assert bundle.tokenizer.name == "pre-tokenized" and bundle.vocab_size == 100


def test_data_prepare_replaces_nothing_without_overwrite(tmp_path, text_jsonl):
    """An existing FILE.bin, or someone's FILE.json beside it, is refused before any work;
    --overwrite replaces them."""
    out = tmp_path / "docs.bin"
    (tmp_path / "docs.json").write_text('{"mine": true}\n')
    r = _cli("data", "prepare", str(text_jsonl), "--out", str(out), "--no-progress")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{tmp_path / 'docs.json'} already exists; pass --overwrite" in r.stderr
    assert not out.exists() and json.loads((tmp_path / "docs.json").read_text()) == {"mine": True}
    r = _cli("data", "prepare", str(text_jsonl), "--out", str(out), "--no-progress", "--overwrite")
    assert r.returncode == 0, r.stderr
    first = out.read_bytes()
    r = _cli("data", "prepare", str(text_jsonl), "--out", str(out), "--no-progress")
    assert r.returncode == 2 and "docs.bin and" in r.stderr and "already exist;" in r.stderr
    assert out.read_bytes() == first


def test_data_prepare_into_a_read_only_folder_names_the_flag(tmp_path, text_jsonl, monkeypatch):
    from conftest import make_read_only

    (tmp_path / "ro").mkdir()
    make_read_only(monkeypatch, tmp_path / "ro")
    for out in (tmp_path / "ro" / "docs.bin", tmp_path / "ro" / "sub" / "docs.bin"):
        r = _cli("data", "prepare", str(text_jsonl), "--out", str(out), "--no-progress")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith(f"tenfold: error: data prepare --out {out}:") and "Read-only file system" in r.stderr
