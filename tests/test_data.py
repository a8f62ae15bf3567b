"""Data: sources and their bad-input errors, packing/split, BPE, and the loader's order rule
(split-independent: micro x accum x ranks) and resumable position."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tenfold.config import DataSection
from tenfold.data import GlobalBatchLoader, build_data, iter_eval
from tenfold.data.packing import pack_sequences, split_train_val
from tenfold.data.sources import stdlib_python_files
from tenfold.errors import UserError


def _cfg(**kw) -> DataSection:
    return DataSection(**kw)


def _rows(batches: list[dict]) -> torch.Tensor:
    """Micro-batches -> the [B, seq_len + 1] token rows they were made from."""
    return torch.cat([torch.cat([b["input_ids"], b["labels"][:, -1:]], dim=1) for b in batches])


def _global_batch_by_ranks(seqs, micro, accum, dp, steps, seed=3):
    """Rows of each global batch as the concatenation of micro-step j, rank r in (j, r) order,
    each rank driven by its own loader as under torchrun."""
    loaders = [GlobalBatchLoader(seqs, micro * accum * dp, micro, accum, r, dp, seed) for r in range(dp)]
    out = []
    for _ in range(steps):
        per_rank = [ld.next_step() for ld in loaders]
        out.append(_rows([per_rank[r][j] for j in range(accum) for r in range(dp)]))
    return out


@pytest.fixture
def seqs():
    # 37 sequences of 8+1 distinct tokens: row i = tokens i*9 .. i*9+8, so rows identify themselves.
    return np.arange(37 * 9, dtype=np.int64).reshape(37, 9)


# ----------------------------------------------------------------------------- loader order


def test_split_does_not_change_the_global_batch(seqs):
    # 2 epochs' worth (37 // 4 = 9 steps per epoch) so the wrap-around is covered too.
    reference = _global_batch_by_ranks(seqs, micro=4, accum=1, dp=1, steps=20)
    for micro, accum, dp in [(1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 1, 4)]:
        got = _global_batch_by_ranks(seqs, micro, accum, dp, steps=20)
        for step, (a, b) in enumerate(zip(reference, got)):
            assert torch.equal(a, b), f"{micro}x{accum}x{dp} differs at step {step}"


@pytest.mark.multiprocess
def test_two_ranks_union_equals_one_rank(seqs):
    one = GlobalBatchLoader(seqs, 2, 1, 2, seed=5)
    r0, r1 = (GlobalBatchLoader(seqs, 2, 1, 1, dp_rank=r, dp_size=2, seed=5) for r in (0, 1))
    for _ in range(12):
        single = _rows(one.next_step())
        assert torch.equal(single, _rows(r0.next_step() + r1.next_step()))


def test_batch_shapes_dtypes_and_shifted_labels(seqs):
    (batch,) = GlobalBatchLoader(seqs, 4, 4, 1).next_step()
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 8)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])


def test_epoch_is_a_permutation_then_reshuffles(seqs):
    loader = GlobalBatchLoader(seqs, 4, 2, 2, seed=1)
    epoch0 = np.concatenate([loader.next_step() and loader.last_global_indices for _ in range(9)])
    assert len(set(epoch0.tolist())) == 36  # 9 batches of 4 distinct sequences, tail of 1 dropped
    first_of_epoch1 = loader.next_step() and loader.last_global_indices
    assert loader.epoch == 1 and loader.index_in_epoch == 4
    assert not np.array_equal(first_of_epoch1, epoch0[:4])
    assert np.array_equal(epoch0, np.random.default_rng([1, 0]).permutation(37)[:36])


def test_seed_changes_order(seqs):
    a = GlobalBatchLoader(seqs, 4, 4, 1, seed=0).next_step()[0]["input_ids"]
    b = GlobalBatchLoader(seqs, 4, 4, 1, seed=1).next_step()[0]["input_ids"]
    assert not torch.equal(a, b)


# ----------------------------------------------------------------------------- loader resume


def test_state_dict_round_trip_mid_epoch(seqs):
    full = _global_batch_by_ranks(seqs, 2, 2, 1, steps=14, seed=9)
    first = GlobalBatchLoader(seqs, 4, 2, 2, seed=9)
    for _ in range(5):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # must survive JSON
    resumed = GlobalBatchLoader(seqs, 4, 2, 2, seed=9)
    resumed.load_state_dict(state)
    for step in range(5, 14):  # crosses the epoch boundary at step 9
        assert torch.equal(_rows(resumed.next_step()), full[step])


def test_resume_on_a_different_number_of_ranks(seqs):
    full = _global_batch_by_ranks(seqs, 1, 2, 2, steps=12, seed=4)  # 2 ranks, micro 1, accum 2
    ranks = [GlobalBatchLoader(seqs, 4, 1, 2, r, 2, seed=4) for r in range(2)]
    for _ in range(6):
        for ld in ranks:
            ld.next_step()
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()  # the position does not depend on the rank
    single = GlobalBatchLoader(seqs, 4, 4, 1, seed=4)  # resume on 1 process, micro 4
    single.load_state_dict(state)
    four = [GlobalBatchLoader(seqs, 4, 1, 1, r, 4, seed=4) for r in range(4)]  # ... or on 4 ranks
    for ld in four:
        ld.load_state_dict(state)
    for step in range(6, 12):
        assert torch.equal(_rows(single.next_step()), full[step])
        assert torch.equal(_rows([ld.next_step()[0] for ld in four]), full[step])


def test_load_state_refuses_other_data_or_seed(seqs):
    state = GlobalBatchLoader(seqs, 4, 4, 1, seed=0).state_dict()
    with pytest.raises(UserError, match="37 training sequences"):
        GlobalBatchLoader(seqs[:30], 4, 4, 1, seed=0).load_state_dict(state)
    with pytest.raises(UserError, match="train.seed=0"):
        GlobalBatchLoader(seqs, 4, 4, 1, seed=1).load_state_dict(state)


def test_batch_larger_than_dataset_is_a_user_error(seqs):
    with pytest.raises(UserError, match="larger than the training set"):
        GlobalBatchLoader(seqs, 64, 8, 4, 0, 2)


def test_iter_eval_is_deterministic_and_rank_union_matches(seqs):
    single = list(iter_eval(seqs, batch_size=2, max_batches=3))
    assert len(single) == 3
    assert torch.equal(_rows(single), torch.from_numpy(seqs[:6]))
    r0, r1 = (list(iter_eval(seqs, 1, 3, dp_rank=r, dp_size=2)) for r in (0, 1))
    assert torch.equal(_rows([b for pair in zip(r0, r1) for b in pair]), _rows(single))
    short = list(iter_eval(seqs[:3], batch_size=8))  # a small val set is still scored
    assert len(short) == 1 and short[0]["input_ids"].shape[0] == 3


# ----------------------------------------------------------------------------- packing, split


def test_packing_and_val_split_are_disjoint():
    tokens = np.arange(1000, dtype=np.uint16)
    packed = pack_sequences(tokens, 9, "t")  # 100 rows of 10
    train, val = split_train_val(packed, 0.05, "t")
    assert (len(train), len(val)) == (95, 5)
    assert set(train.ravel().tolist()).isdisjoint(val.ravel().tolist())
    assert np.shares_memory(packed, tokens)  # a view: memmaps are never copied


def test_too_little_data_is_a_user_error(tmp_path):
    f = tmp_path / "small.txt"
    f.write_text("hello")
    with pytest.raises(UserError, match="too little data"):
        build_data(_cfg(path=str(f)), seq_len=16, seed=0)
    f.write_text("x" * 20)  # one sequence: nothing left after holding out validation
    with pytest.raises(UserError, match="val_fraction"):
        build_data(_cfg(path=str(f)), seq_len=16, seed=0)
    assert len(build_data(_cfg(path=str(f), val_fraction=0.0), seq_len=16, seed=0).train) == 1


# ----------------------------------------------------------------------------- sources


def test_default_corpus_builds_and_is_nonempty():
    files = stdlib_python_files()
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    bundle = build_data(_cfg(max_bytes=300_000), seq_len=64, seed=0, model_vocab_size=256)
    assert bundle.vocab_size == 256 and bundle.num_tokens >= 300_000
    assert len(bundle.train) > 1000 and len(bundle.val) > 0
    assert bundle.train.dtype == np.uint8
    text = bundle.tokenizer.decode(bundle.train[0])
    assert "import" in text or "def " in text or '"""' in text
    line = bundle.describe()
    assert "python-stdlib" in line and "byte" in line and "\n" not in line


def test_text_file_round_trips_bytes(tmp_path):
    f = tmp_path / "poem.txt"
    body = "Ünïcödé line\n" * 40
    f.write_text(body, encoding="utf-8")
    bundle = build_data(_cfg(path=str(f), val_fraction=0.1), seq_len=15, seed=0)
    stream = np.concatenate([bundle.train.ravel(), bundle.val.ravel()])
    assert bytes(stream.tolist()) == body.encode()[: len(stream)]


def test_directory_reads_all_files_sorted_with_document_separator(tmp_path):
    (tmp_path / "b.txt").write_text("B" * 30)
    (tmp_path / "a.txt").write_text("A" * 30)
    (tmp_path / "empty.txt").write_text("")  # skipped inside a folder
    (tmp_path / ".hidden").write_text("H" * 30)
    bundle = build_data(_cfg(path=str(tmp_path), val_fraction=0.0), seq_len=60, seed=0)
    assert bytes(bundle.train[0].tolist()) == b"A" * 30 + b"\0" + b"B" * 30


def test_jsonl_field_and_bad_line(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text("\n".join(json.dumps({"body": f"document {i} " * 5}) for i in range(20)) + "\n")
    bundle = build_data(_cfg(path=str(f), jsonl_field="body"), seq_len=32, seed=0)
    assert bundle.tokenizer.decode(bundle.train[0]).startswith("document 0 document 0")
    with pytest.raises(UserError, match="no field 'text'"):
        build_data(_cfg(path=str(f)), seq_len=32, seed=0)
    f.write_text('{"text": "fine"}\n\n{"text": broken}\n')
    with pytest.raises(UserError, match=r"docs\.jsonl:3: invalid JSON"):
        build_data(_cfg(path=str(f)), seq_len=32, seed=0)
    f.write_text('{"text": 5}\n')
    with pytest.raises(UserError, match=r":1: field 'text' must be a string"):
        build_data(_cfg(path=str(f)), seq_len=32, seed=0)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_memmap(tmp_path, dtype):
    top = 60_000 if dtype == "uint16" else 100_000  # uint32 holds ids past 65535
    tokens = (np.arange(2000, dtype=np.int64) * 37 % top).astype(dtype)
    f = tmp_path / "tokens.bin"
    tokens.tofile(f)
    bundle = build_data(_cfg(path=str(f), bin_dtype=dtype), seq_len=19, seed=0, model_vocab_size=top)
    assert isinstance(bundle.train.base, np.memmap) or isinstance(bundle.train, np.memmap)
    assert bundle.train.dtype == np.dtype(dtype) and bundle.vocab_size == top
    assert np.array_equal(bundle.train.ravel(), tokens[: bundle.train.size])
    (batch,) = GlobalBatchLoader(bundle.train, 4, 4, 1).next_step()
    assert int(batch["input_ids"].max()) < top
    with pytest.raises(UserError, match=r"token id \d+ at position \d+ is >= the model's vocabulary size 256"):
        build_data(_cfg(path=str(f), bin_dtype=dtype), seq_len=19, seed=0, model_vocab_size=256)


def test_bin_with_wrong_dtype_size(tmp_path):
    f = tmp_path / "odd.bin"
    f.write_bytes(b"\x01\x02\x03")
    with pytest.raises(UserError, match="not a multiple of 2"):
        build_data(_cfg(path=str(f)), seq_len=4, seed=0)


def test_missing_and_empty_files_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(UserError, match=f"not found: {missing}"):
        build_data(_cfg(path=str(missing)), seq_len=8, seed=0)
    for name in ("empty.txt", "empty.jsonl", "empty.bin"):
        f = tmp_path / name
        f.write_bytes(b"")
        with pytest.raises(UserError, match=f"empty: {f}"):
            build_data(_cfg(path=str(f)), seq_len=8, seed=0)
    folder = tmp_path / "nothing"
    folder.mkdir()
    with pytest.raises(UserError, match="no data files"):
        build_data(_cfg(path=str(folder)), seq_len=8, seed=0)


def test_tokenizer_vocab_above_model_vocab_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TENFOLD_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(UserError, match="model.vocab_size"):
        build_data(_cfg(tokenizer="bpe", bpe_vocab_size=300, max_bytes=50_000), 32, 0, model_vocab_size=256)


# ----------------------------------------------------------------------------- BPE


def test_bpe_builds_deterministically_round_trips_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("TENFOLD_CACHE_DIR", str(tmp_path / "cache"))
    cfg = _cfg(tokenizer="bpe", bpe_vocab_size=512, max_bytes=200_000)
    bundle = build_data(cfg, seq_len=64, seed=0)
    assert bundle.vocab_size == 512 and bundle.tokenizer.name == "bpe"
    text = "def f(x):\n    return x ** 2  # ünïcode ok\n"
    assert bundle.tokenizer.decode(bundle.tokenizer.encode(text)) == text
    assert len(bundle.tokenizer.encode(text)) < len(text.encode())  # it compresses
    assert int(bundle.train.max()) < 512
    cached = list((tmp_path / "cache" / "bpe").iterdir())
    assert len(cached) == 1
    (cached[0] / "tokens.npy").unlink()  # force a retrain: must give the same tokens
    again = build_data(cfg, seq_len=64, seed=0)
    assert np.array_equal(again.train, bundle.train) and np.array_equal(again.val, bundle.val)
    assert (cached[0] / "tokens.npy").is_file()  # the damaged entry was rewritten
    from_cache = build_data(cfg, seq_len=64, seed=0)
    assert np.array_equal(from_cache.train, bundle.train)
