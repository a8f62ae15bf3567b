"""Shared test helpers: a very small model shape so that CPU tests stay fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# `tiny` shrunk further: the same code paths, a fraction of the FLOPs.
SMALL_MODEL = {"name": "tiny", "n_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 128, "max_seq_len": 64}
SMALL_DATA = {"max_bytes": 300_000, "seq_len": 32}


def small_config(tmp_path: Path, **sections) -> dict:
    """A config dict for a fast run writing into tmp_path; sections override the defaults."""
    cfg = {
        "model": dict(SMALL_MODEL),
        "data": dict(SMALL_DATA),
        "train": {"steps": 3, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 0, "eval_every": 0, "eval_batches": 2},
        "precision": {"dtype": "fp32"},
        "log": {"out": str(tmp_path / "run"), "progress": False, "tensorboard": False},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


SMALL_FLAGS = [
    "--set", "model.n_layers=2", "--set", "model.d_model=64", "--set", "model.n_heads=4",
    "--set", "model.d_ff=128", "--set", "model.max_seq_len=64", "--seq-len", "32",
    "--set", "data.max_bytes=300000", "--no-progress", "--set", "train.eval_batches=2",
]


def table_text(text: str) -> str:
    """A rich table's text with its borders out and wrapped cells joined again."""
    return " ".join(text.replace("│", " ").split())


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def small_cfg(tmp_path):
    return lambda **sections: small_config(tmp_path, **sections)


@pytest.fixture
def one_thread():
    """Tiny shapes: one intra-op thread is faster than two, and immune to a busy 2-core
    machine (OpenMP spin-waits made small steps ~20x slower there). Restored afterwards.
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    torch = pytest.importorskip("torch", reason="training needs torch (make test-py310 runs without it)")

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Module fixtures that start several processes (torchrun or torch.multiprocessing): every test
# using one is a multi-process test. The others carry @pytest.mark.multiprocess themselves.
MULTIPROCESS_FIXTURES = {"two_ranks", "two_rank_results", "tp2", "tp2dp2"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if MULTIPROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multiprocess)


def planned(model, gpus: int = 1, **choices):
    """A run for the planner alone (`tenfold.run.resolve` with check=False: priced even where
    tenfold train would refuse it). `model`: a preset name, a ModelConfig, or a parameter count."""
    from tenfold.models.presets import ModelConfig, get_preset
    from tenfold.run import resolve

    if isinstance(model, (int, float)):
        return resolve(None, gpus, params=float(model), check=False, **choices)
    cfg = model if isinstance(model, ModelConfig) else get_preset(model)
    return resolve(cfg, gpus, check=False, **choices)


def deepspeed_stack(**kw):
    """DeepSpeed's / Megatron's bookkeeping: 16-bit parameters and gradients with fp32 master
    weights (ZeRO's 2 + 2 + 12 bytes per parameter)."""
    from tenfold.run import Stack

    return Stack(master_weights=True, **kw)


def make_read_only(monkeypatch, folder: Path) -> None:
    """Make `folder` behave as on a read-only file system (EROFS on every create, write, rename
    or removal under it, the clean-up of a failed write included), without root or a mount."""
    import builtins
    import errno
    import io
    import os

    root = str(Path(folder).resolve())

    def inside(path) -> bool:
        if isinstance(path, int):
            return False
        return os.path.abspath(os.fsdecode(path)).startswith(root)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    def guarded(real, writes=lambda *a, **k: True):
        def call(path, *args, **kwargs):
            if inside(path) and writes(*args, **kwargs):
                refuse(path)
            return real(path, *args, **kwargs)
        return call

    def writing_mode(mode="r", *a, **k):
        return any(c in str(mode) for c in "wax+")

    def writing_flags(flags=0, *a, **k):
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))

    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", guarded(real_open, writing_mode))
    monkeypatch.setattr(io, "open", guarded(real_open, writing_mode))
    monkeypatch.setattr(os, "open", guarded(os.open, writing_flags))
    for name in ("mkdir", "unlink", "remove", "rmdir"):
        monkeypatch.setattr(os, name, guarded(getattr(os, name)))
    for name in ("replace", "rename"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda src, dst, *a, _real=real, **k:
                            refuse(dst) if inside(src) or inside(dst) else _real(src, dst, *a, **k))
