"""Shared test helpers: a very small model shape so that CPU tests stay fast, and the ways the
tests start `tenfold` (in this process, in a child process, under torchrun). Torch-free at
import, as the Python 3.10 run (make test-py310) loads this file without torch; test modules
import these helpers with `from conftest import ...`, never from one another."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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


# --------------------------------------------------------------------------- running tenfold

HERE = Path(__file__).parent
TENFOLD = [sys.executable, "-m", "tenfold", "train"]
RUN_FLAGS = SMALL_FLAGS + ["--seed", "7", "--set", "train.eval_every=0"]

# Tolerances of a multi-process run against one process: fp32 rel 1e-5 (only the order of the
# fp32 reductions differs); bf16 rel 2e-3 (autocast rounds matmul inputs to an 8-bit mantissa,
# 2^-8 = 3.9e-3 per element, and the ranks round their half-batch sums differently).
FP32_RTOL, BF16_RTOL = 1e-5, 2e-3


def tenfold_child(*args: str, timeout: int = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m tenfold ARGS` in a child process, output captured; `env` adds variables."""
    return subprocess.run([sys.executable, "-m", "tenfold", *args], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def hf_cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """`tenfold ARGS` in a child process with the Hugging Face hub offline and one OpenMP thread."""
    return tenfold_child(*args, timeout=timeout, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})


def train_summary(out: Path, *flags: str, timeout: int = 400) -> dict:
    """`tenfold train` of the small model (fp32, seed 7, micro-batch 2) in a child process; its
    summary.json. `flags` add --steps, --grad-accum, the parallel layout."""
    proc = tenfold_child("train", "--seed", "7", "--precision", "fp32", "--micro-batch", "2",
                         "--out", str(out), *SMALL_FLAGS, *flags, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def torchrun(mode: str, tmp_path: Path, nproc: int = 2, timeout: int = 240, worker: str = "zero_worker.py") -> dict:
    """tests/workers/WORKER MODE under torchrun on `nproc` local ranks; the JSON rank 0 writes."""
    out = tmp_path / f"{mode}-{nproc}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(HERE / "workers" / worker), mode, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def rel_err(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


CLI_MODEL_SHAPE = {"n_layers": 2, "d_model": 32, "n_heads": 2, "d_ff": 64, "max_seq_len": 16}


def text_corpus(folder: Path) -> Path:
    """A 6000-word text file of code-like words (numpy's seeded generator): a corpus in seconds."""
    import numpy as np

    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "x", "y", "(", ")", ":"]
    path = folder / "corpus.txt"
    path.write_text(" ".join(rng.choice(words, size=6000)))
    return path


def copy_of_run(run: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of a module-scoped run folder (links kept as links) and its corpus."""
    out, data = run
    copy = tmp_path / "run"
    shutil.copytree(out, copy, symlinks=True)
    return copy, data


def cli_train(out: Path, data: Path, *extra: str) -> int:
    """`tenfold train` in this process: a 2-layer model, fp32, seq 16, micro-batch 2 x accum 2."""
    from tenfold import cli

    return cli.main([
        "train", "--out", str(out), "--data", str(data), "--seq-len", "16", "--micro-batch", "2",
        "--grad-accum", "2", "--precision", "fp32", "--eval-every", "0", "--lr", "1e-2",
        "--no-progress", "--set", "log.tensorboard=false",
        *[f"--set=model.{k}={v}" for k, v in CLI_MODEL_SHAPE.items()], *extra,
    ])


def one_line(text: str) -> str:
    """The single non-empty line of `text` (a user error), with no traceback."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def private_mount_prefix() -> list[str] | None:
    """A command prefix that runs a child in its own mount namespace where it may mount a
    tmpfs (root, or an unprivileged user namespace); None when neither is permitted."""
    if not shutil.which("unshare"):
        return None
    for prefix in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                               capture_output=True, timeout=30)
        if probe.returncode == 0:
            return prefix
    return None


def child_pids(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def rank_of(pid: int) -> int | None:
    """The RANK a process was started with (torchrun sets it), None when unreadable."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


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
