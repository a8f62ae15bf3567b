"""Checkpoints that survive a 3-day run: sharded save/resume through torch.distributed.checkpoint.

Layout of one checkpoint (OUT/checkpoints/step_N/):

    .metadata, __R_I.distcp   DCP: model + optimizer, every rank writes its own shard
                              (`get_state_dict` gives FQN-keyed state for plain, DDP and FSDP2
                              models alike, so a checkpoint from 2 ranks ZeRO-3 loads on one
                              process or 4 ranks ZeRO-1: DCP reshards on load)
    trainer_state.json        step, counters, LR schedule, loss scaler, data loader position
    rank_00000.json ...       every rank's RNG states (torch CPU/CUDA, numpy, python) + loader
    config.json               the resolved run config
    manifest.json             written LAST: format tag, step, and size + sha256 of every file

Atomicity (the DeepSpeed `latest` tag + torchtitan's layout, made crash-safe): everything is
written under `.tmp-step_N/`; after every rank is done, rank 0 writes the manifest, renames the
directory to `step_N/` and only then replaces `OUT/checkpoints/latest` (a one-line text file)
with `os.replace`. A process killed at any point leaves either the old `latest` pointing at a
complete checkpoint, or the new one: never a half-written directory under a final name.

Loading never unpickles arbitrary code (engine.md §1d pain point): DCP reads tensors with
`torch.load(weights_only=True)`, but its `.metadata` file is a plain pickle and its non-tensor
items are read with `weights_only=False`; `SafeReader` and `SafeLoadPlanner` close both holes
(an allow-list unpickler for the metadata classes, weights_only=True for the bytes). Everything
else is JSON.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import signal
import sys
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tenfold.errors import RunError, UserError

FORMAT_TAG = "tenfold-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
CONFIG_FILE = "config.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
_HASH_CHUNK = 1 << 22

# One process is a supported layout, not an accident: DCP's "assuming the intent is to save/load
# in a single process" warning would print on every save of every single-process run.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")

# Test hooks (environment variables, read at save time): slow the write down so a test can
# SIGKILL the process in the middle of a save.
SLOW_SAVE_ENV = "TENFOLD_TEST_SLOW_SAVE"


class CheckpointError(UserError):
    """A checkpoint that cannot be used (missing, truncated, corrupt, foreign) or a save that
    failed (full disk). One line naming the file, exit status 2 in the CLI."""


# --------------------------------------------------------------------------- distributed helpers


def _dist_on() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def _rank() -> int:
    return torch_dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return torch_dist.get_world_size() if _dist_on() else 1


_CKPT_GROUP: dict[str, Any] = {}


def _ckpt_group():
    """The gloo group every checkpoint collective runs on (created collectively on first use,
    once per default process group). Two reasons: the ZeRO code tightens the default group's
    timeout after step 1 to max(120 s, 20 x first step), and the slowest rank's write of a large
    checkpoint can take longer, while this group keeps torch's default (30 min); and async saves
    run collectives from a background thread, which must never interleave with the training
    loop's collectives on the default group (torchtitan uses a gloo group for the same reason)."""
    if not _dist_on():
        return None
    default = torch_dist.distributed_c10d._get_default_group()
    if _CKPT_GROUP.get("default") is not default:
        _CKPT_GROUP.update(default=default, group=torch_dist.new_group(backend="gloo"))
    return _CKPT_GROUP["group"]


def _barrier() -> None:
    if _dist_on():
        torch_dist.barrier(group=_ckpt_group())


def _all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (small, JSON-like); one process -> [obj]. Pickle over the process
    group is fine here: the bytes come from our own ranks, not from a file."""
    if not _dist_on():
        return [obj]
    out: list[Any] = [None] * _world()
    torch_dist.all_gather_object(out, obj, group=_ckpt_group())
    return out


def _on_every_rank(fn: Callable[[], Any]) -> Any:
    """Run `fn` on every rank and make a failure on one rank a failure on all of them, so
    that no rank walks on into the next collective while another has given up (a hang)."""
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        error = e
    messages = _all_gather(None if error is None else f"rank {_rank()}: {_first_line(error)}")
    if error is not None:
        raise error
    failed = [m for m in messages if m]
    if failed:
        raise RuntimeError(failed[0])
    return result


def _broadcast(obj: Any) -> Any:
    if not _dist_on():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=0, group=_ckpt_group())
    return box[0]


def _any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one (a MAX all-reduce), so that
    decisions taken at a step boundary (stop, save, skip) are the same on all ranks."""
    if not _dist_on():
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    if torch_dist.get_backend() == "nccl":
        t = t.cuda()
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return bool(t.item() > 0)


# --------------------------------------------------------------------------- safe loading


_SAFE_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # maps a layout *name* to torch.strided etc.
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """The Python docs' "restricting globals" unpickler: only DCP's metadata dataclasses,
    torch.Size and dtypes may be constructed; anything else (os.system, ...) is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read with the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner reads non-tensor items (optimizer param_groups: lr, betas, ...) with
    `torch.load(weights_only=False)`; these are floats, tuples and strings, so weights_only=True
    loads them just as well and refuses code."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# --------------------------------------------------------------------------- RNG and JSON state


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def capture_rng_state() -> dict:
    """This process's RNG states as JSON: torch CPU (+ every CUDA device), numpy, `random`."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch_cpu": _b64(torch.get_rng_state().numpy().tobytes()),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss},
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = [_b64(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    cpu = torch.frombuffer(bytearray(_unb64(state["torch_cpu"])), dtype=torch.uint8)
    torch.set_rng_state(cpu)
    npst = state["numpy"]
    np.random.set_state((npst["kind"], np.array(npst["keys"], dtype=np.uint32), npst["pos"],
                         npst["has_gauss"], npst["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        cuda = [torch.frombuffer(bytearray(_unb64(s)), dtype=torch.uint8) for s in state["torch_cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def _jsonable_state(obj: Any) -> Any:
    """`state_dict()` of a scheduler/scaler/loader, a dataclass or a dict, as plain JSON data."""
    if obj is None:
        return None
    if hasattr(obj, "state_dict"):
        obj = obj.state_dict()
    elif dataclasses.is_dataclass(obj):
        obj = dataclasses.asdict(obj)
    elif not isinstance(obj, dict):
        obj = dict(vars(obj))
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint state must be JSON-serialisable: {e}") from None


def _restore_jsonable(obj: Any, data: Any) -> None:
    if obj is None or data is None:
        return
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(data)
    elif isinstance(obj, dict):
        obj.clear()
        obj.update(data)
    else:
        for k, v in data.items():
            setattr(obj, k, v)


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: Path) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint file {path}: not valid JSON ({e})") from None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _digest(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- layout helpers


def checkpoints_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Final-named checkpoint directories under `root`, newest first (tmp dirs excluded)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def read_latest(root: Path) -> Path | None:
    try:
        name = (root / LATEST).read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return root / name if STEP_DIR.match(name) else None


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f"{TMP_PREFIX}{LATEST}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)  # atomic on POSIX: readers see the old or the new name
    _fsync_dir(root)


def is_checkpoint_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file() or (path / ".metadata").is_file()


# --------------------------------------------------------------------------- verification


def _file_list(ckpt: Path) -> list[str]:
    return sorted(
        str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def read_manifest(ckpt: Path) -> dict:
    """The manifest, or a CheckpointError saying why this is not a complete tenfold checkpoint."""
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint not found: {ckpt} is not a directory")
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        if (ckpt / ".metadata").is_file():
            raise CheckpointError(
                f"not a tenfold checkpoint (foreign DCP checkpoint, no {MANIFEST}): {ckpt}"
            )
        raise CheckpointError(f"incomplete checkpoint (no {MANIFEST}; the save did not finish): {ckpt}")
    manifest = _read_json(mpath)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_TAG:
        raise CheckpointError(f"not a tenfold checkpoint (format tag is not {FORMAT_TAG!r}): {mpath}")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"unsupported checkpoint version {manifest.get('version')!r} in {mpath} "
            f"(this tenfold reads version {FORMAT_VERSION})"
        )
    return manifest


def _check_one_file(ckpt: Path, rel: str, expected: dict) -> str | None:
    path = ckpt / rel
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"checkpoint file missing: {path}"
    if size != expected["bytes"]:
        return f"truncated or altered checkpoint file {path}: {size} bytes, manifest says {expected['bytes']}"
    if sha256_file(path) != expected["sha256"]:
        return f"corrupt checkpoint file {path}: sha256 differs from {ckpt / MANIFEST}"
    return None


def verify_checkpoint(ckpt: Path, collective: bool = True) -> dict:
    """Check the manifest and every file's size and sha256. Collective when distributed: the
    files are hashed round-robin across ranks and the verdict is the same on every rank.
    `collective=False`: this process checks every file alone (export, tools)."""
    rank, world = (_rank(), _world()) if collective else (0, 1)
    try:
        manifest = read_manifest(ckpt)
        error = None
    except CheckpointError as e:
        manifest, error = None, str(e)
    errors = [error] if error else []
    if manifest is not None:
        files = sorted(manifest.get("files", {}).items())
        errors += [e for rel, exp in files[rank::world] if (e := _check_one_file(ckpt, rel, exp))]
    everyone = [e for errs in _all_gather(errors) for e in errs] if collective else errors
    if everyone:
        raise CheckpointError(sorted(everyone)[0])
    assert manifest is not None
    return manifest


# --------------------------------------------------------------------------- the state we save


# Optimizer state keyed per parameter FQN ("state.layers.0.attn.wq.weight.exp_avg",
# "param_groups.layers.0.attn.wq.weight.lr"), as torchtitan does: pipeline ranks hold different
# parameters, and a nested `param_groups` list would collide across them in DCP (one rank's
# list wins); flattened keys are disjoint per stage and reshard across pp/dp/ZeRO changes.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _local_optimizers(optimizer) -> list:
    """The optimizer(s) whose state this rank holds. ZeRO-1's ZeroRedundancyOptimizer keeps
    this rank's partition in `.optim` (whole parameters); saving that one per rank gives
    disjoint FQN keys, so DCP reshards ZeRO-1 like any other layout. (The wrapper's lr comes
    back through the LR schedule's load_state_dict.)"""
    if optimizer is None:
        return []
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return [optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer]


def _model_and_optim_state(model: torch.nn.Module, optimizer) -> dict:
    optims = _local_optimizers(optimizer)
    msd, osd = get_state_dict(model, optims, options=STATE_DICT_OPTIONS)
    state = {"model": msd}
    if optimizer is not None:
        state["optim"] = osd
    return state


def assert_finite_model(model: torch.nn.Module, step: int) -> None:
    """A NaN never reaches a saved checkpoint: refuse to save non-finite parameters (local
    shards, agreed on every rank)."""
    bad = None
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.numel() and not bool(torch.isfinite(local).all()):
                bad = name
                break
    names = [b for b in _all_gather(bad) if b]
    if names:
        raise RunError(
            f"refusing to save checkpoint at step {step}: parameter {names[0]} holds NaN/inf"
        )


@dataclass
class SaveResult:
    path: Path
    step: int
    seconds: float  # wall time the training loop was blocked
    bytes_written: int = 0
    async_pending: bool = False


@dataclass
class _PendingSave:
    step: int
    tmp: Path
    final: Path
    started: float
    blocked_s: float
    future: Future | None = None


def _trainer_parts(trainer: Any) -> dict:
    return {name: getattr(trainer, name, None) for name in ("scheduler", "scaler", "loader", "state")}


def _trainer_config(trainer: Any):
    """The run's TenfoldConfig (`Trainer.cfg`; `.config` for other duck-typed holders)."""
    return getattr(trainer, "cfg", None) or getattr(trainer, "config", None)


def _config_dict(trainer: Any) -> dict | None:
    cfg = _trainer_config(trainer)
    if cfg is None:
        return None
    return cfg.to_dict() if hasattr(cfg, "to_dict") else _jsonable_state(cfg)


def _dist_shape(trainer: Any) -> dict:
    info = getattr(trainer, "dist", None)
    return {
        "world_size": _world(),
        "dp_size": getattr(info, "dp_size", _world()),
        "pp_size": getattr(info, "pp_size", 1),
    }


class CheckpointManager:
    """Periodic, preemption-triggered and final saves, `--resume`, `--keep-last`.

    `trainer` is duck-typed: `.model`, `.optimizer` and optionally `.scheduler`, `.scaler`,
    `.loader` (objects with state_dict/load_state_dict whose state is JSON data), `.state`
    (dict or dataclass with at least `step`), `.cfg` (TenfoldConfig), `.dist` (DistInfo).
    Every public method is collective: all ranks call it at the same step boundary.
    """

    def __init__(
        self,
        out_dir: str | Path,
        every: int = 0,
        keep_last: int | None = None,
        resume: str | None = None,
        async_save: bool = False,
        log: Callable[[str], None] | None = None,
        final: bool = False,
    ):
        self.root = checkpoints_root(out_dir)
        self.every, self.keep_last, self.resume_from = every, keep_last, resume
        self.final = final  # save at the last step even without periodic saves
        self.async_save = async_save
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._pending: _PendingSave | None = None
        self._preempt = False
        self._old_handlers: dict[int, Any] = {}
        self.saves: list[SaveResult] = []
        self.last_saved_step: int | None = None

    @classmethod
    def from_config(cls, cfg, log=None) -> "CheckpointManager":
        c = cfg.checkpoint
        return cls(cfg.log.out, every=c.every, keep_last=c.keep_last, resume=c.resume,
                   async_save=c.async_save, log=log, final=c.final)

    def _say(self, msg: str) -> None:
        if _rank() == 0:
            self.log(msg)

    # ----------------------------------------------------------------- preemption

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT (cluster preemption, Ctrl-C) set a flag; the loop saves once at the
        next step boundary and exits cleanly. A second SIGINT interrupts at once."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                return

    def _on_signal(self, signum, frame) -> None:
        if self._preempt and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self._preempt = True

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def preempted(self) -> bool:
        """Collective: True on every rank once any rank got SIGTERM/SIGINT."""
        self._preempt = _any_rank(self._preempt)
        return self._preempt

    # ----------------------------------------------------------------- save

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def after_step(self, step: int, trainer: Any, last: bool = False) -> bool:
        """Call at every optimizer-step boundary. Saves when `step % every == 0`, on
        preemption, and at the last step (when periodic saves are on, or `final`). Returns True
        when the loop must stop (preempted)."""
        self._poll_pending()
        stop = self.preempted()
        if (self.due(step) or stop or (last and (self.every > 0 or self.final))) and self.last_saved_step != step:
            self.save(step, trainer, wait=stop or last)
            if stop:
                self._say(f"checkpoint: preempted; saved step {step}, exiting")
        elif last or stop:
            self.wait()
        return stop

    def save(self, step: int, trainer: Any, wait: bool = False) -> SaveResult:
        """Write OUT/checkpoints/step_N atomically (see module docstring)."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at most; finalises the previous async one
        assert_finite_model(trainer.model, step)
        final = self.root / step_dir_name(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        pending = _PendingSave(step=step, tmp=tmp, final=final, started=t0, blocked_s=0.0)
        try:
            _on_every_rank(lambda: self._make_tmp(tmp) if _rank() == 0 else None)
            _on_every_rank(lambda: self._write_side_files(tmp, step, trainer))
            state = _model_and_optim_state(trainer.model, trainer.optimizer)
            if self.async_save and not wait:
                pending.future = dcp.async_save(state, checkpoint_id=tmp, process_group=_ckpt_group(),
                                                no_dist=not _dist_on())
            else:
                dcp.save(state, checkpoint_id=tmp, process_group=_ckpt_group(), no_dist=not _dist_on())
            _slow_save_hook()
        except BaseException as e:
            self._abandon(tmp, e)
            raise self._save_error(e, tmp) from e
        pending.blocked_s = time.perf_counter() - t0
        self._pending = pending
        if pending.future is None:
            return self._finalize()
        result = SaveResult(final, step, pending.blocked_s, async_pending=True)
        self._say(f"checkpoint: step {step} saving in the background ({pending.blocked_s:.2f} s blocked)")
        return result

    def _make_tmp(self, tmp: Path) -> None:
        self._clean_stale_tmp()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()

    def _write_side_files(self, tmp: Path, step: int, trainer: Any) -> None:
        parts = _trainer_parts(trainer)
        rank = _rank()
        _write_json(tmp / f"rank_{rank:05d}.json", {
            "rank": rank, "rng": capture_rng_state(), "loader": _jsonable_state(parts["loader"]),
        })
        if rank == 0:
            _write_json(tmp / TRAINER_STATE, {
                "step": step,
                "state": _jsonable_state(parts["state"]),
                "scheduler": _jsonable_state(parts["scheduler"]),
                "scaler": _jsonable_state(parts["scaler"]),
                "loader": _jsonable_state(parts["loader"]),
                **_dist_shape(trainer),
                "torch_version": torch.__version__,
            })
            config = _config_dict(trainer)
            if config is not None:
                _write_json(tmp / CONFIG_FILE, config)

    def _poll_pending(self) -> None:
        """Finalise a background save once it has finished on every rank (collective)."""
        if self._pending is None or self._pending.future is None:
            return
        if not _any_rank(not self._pending.future.done()):
            self._finalize()

    def wait(self) -> SaveResult | None:
        """Block until the in-flight save (if any) is complete and renamed."""
        if self._pending is None:
            return None
        return self._finalize()

    def _finalize(self) -> SaveResult:
        p = self._pending
        assert p is not None
        self._pending = None
        try:
            if p.future is not None:
                p.future.result()
            _slow_save_hook()
            total = self._write_manifest(p)
            _on_every_rank(lambda: self._publish(p) if _rank() == 0 else None)
        except BaseException as e:
            self._abandon(p.tmp, e)
            raise self._save_error(e, p.tmp) from e
        seconds = p.blocked_s if p.future is not None else time.perf_counter() - p.started
        result = SaveResult(p.final, p.step, seconds, total)
        self.saves.append(result)
        self.last_saved_step = p.step
        self._say(
            f"checkpoint: saved {p.final} ({total / 2**20:.1f} MiB, "
            f"{time.perf_counter() - p.started:.2f} s, {seconds:.2f} s blocking)"
        )
        return result

    def _write_manifest(self, p: _PendingSave) -> int:
        _barrier()  # every rank's files are on disk
        names = _broadcast(_file_list(p.tmp) if _rank() == 0 else None)
        mine = names[_rank():: _world()]
        digests = _on_every_rank(lambda: {rel: _digest(p.tmp / rel) for rel in mine})
        merged: dict = {}
        for part in _all_gather(digests):
            merged.update(part)

        def write() -> None:
            if _rank() == 0:
                _write_json(p.tmp / MANIFEST, {
                    "format": FORMAT_TAG, "version": FORMAT_VERSION, "step": p.step,
                    "world_size": _world(), "files": merged,
                })
                _fsync_dir(p.tmp)

        _on_every_rank(write)
        return sum(v["bytes"] for v in merged.values())

    def _publish(self, p: _PendingSave) -> None:
        """Rank 0: rename .tmp-step_N -> step_N, then update `latest`, then prune."""
        if p.final.exists():  # an older run in this OUT saved the same step: replace it
            trash = self.root / f"{TMP_PREFIX}old-{p.final.name}"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(p.final, trash)
            os.rename(p.tmp, p.final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(p.tmp, p.final)
        _fsync_dir(self.root)
        _write_latest(self.root, p.final.name)
        self._prune(keep=p.final)

    def _prune(self, keep: Path) -> None:
        if not self.keep_last:
            return
        for i, (_, path) in enumerate(list_step_dirs(self.root)):
            if i >= self.keep_last and path != keep:
                shutil.rmtree(path, ignore_errors=True)

    def _clean_stale_tmp(self) -> None:
        """Leftovers of a save that was killed: never a valid checkpoint, safe to remove."""
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith(TMP_PREFIX) and p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)

    def _abandon(self, tmp: Path, err: BaseException) -> None:
        """A failed save: remove the partial directory; the previous checkpoint and `latest`
        were never touched. (After Ctrl-C-twice no barrier: the other ranks may not come.)"""
        if not isinstance(err, (KeyboardInterrupt, SystemExit)):
            try:
                _barrier()
            except Exception:  # noqa: BLE001 - best effort; the error being reported is `err`
                pass
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _save_error(self, e: BaseException, tmp: Path) -> BaseException:
        if isinstance(e, (KeyboardInterrupt, SystemExit, UserError)):
            return e
        os_err = _find_os_error(e)
        previous = read_latest(self.root)
        keep = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        if os_err is not None:
            what = os.strerror(os_err.errno) if os_err.errno else str(os_err)
            return CheckpointError(
                f"checkpoint save to {tmp} failed: {what} (errno {os_err.errno}); removed the "
                f"partial save; {keep}" + ("; free disk space or set --out elsewhere" if os_err.errno == errno.ENOSPC else "")
            )
        return CheckpointError(
            f"checkpoint save to {tmp} failed: {_first_line(_inner_error(e))}; removed the partial save; {keep}"
        )

    def close(self) -> None:
        self.wait()
        self.restore_signal_handlers()

    def export_16bit(self, trainer: Any, out_dir: str | Path) -> dict | None:
        """`checkpoint.export_16bit` (DeepSpeed's stage3_gather_16bit_weights_on_model_save):
        make sure the final step is checkpointed, then rank 0 consolidates it into
        OUT/model.safetensors through the same code as `tenfold export` (so sharded, ZeRO-3
        and pipeline runs all export the same way). Collective; returns the export summary
        on rank 0."""
        from tenfold.engine.export import export_after_training

        step = _trainer_state_step(trainer)
        if self.last_saved_step != step:
            self.save(step, trainer, wait=True)
        self.wait()
        cfg = _trainer_config(trainer)
        precision = getattr(getattr(cfg, "precision", None), "dtype", "bf16")
        final = self.root / step_dir_name(step)
        return _on_every_rank(
            lambda: export_after_training(out_dir, final, precision, log=self.log) if _rank() == 0 else None
        )

    # ----------------------------------------------------------------- resume

    def resume(self, trainer: Any) -> dict | None:
        """`--resume auto|PATH`: load the checkpoint into `trainer` and return its
        trainer_state dict (None for a fresh start). auto falls back past bad checkpoints."""
        if not self.resume_from:
            return None
        if self.resume_from == "auto":
            return self._resume_auto(trainer)
        path = resolve_checkpoint_path(self.resume_from)
        return self.load(path, trainer)

    def _resume_auto(self, trainer: Any) -> dict | None:
        candidates = auto_candidates(self.root)
        if not candidates:
            self._say(f"checkpoint: --resume auto: no checkpoint in {self.root}, starting fresh")
            return None
        failures = []
        for path in candidates:
            try:
                return self.load(path, trainer)
            except CheckpointError as e:
                failures.append(str(e))
                self._say(f"checkpoint: {e}; falling back to the previous checkpoint")
        raise CheckpointError(
            f"--resume auto: no usable checkpoint in {self.root} ({len(failures)} tried); "
            f"newest problem: {failures[0]}"
        )

    def load(self, path: Path, trainer: Any) -> dict:
        t0 = time.perf_counter()
        verify_checkpoint(path)
        tstate = _read_json(path / TRAINER_STATE)
        _check_same_model(path, trainer)
        state = _model_and_optim_state(trainer.model, trainer.optimizer)
        try:
            dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(),
                     process_group=_ckpt_group(), no_dist=not _dist_on())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(
                f"checkpoint {path} does not fit this model/optimizer: {_first_line(_inner_error(e))}"
            ) from None
        optims = _local_optimizers(trainer.optimizer)
        set_state_dict(trainer.model, optims, model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}), options=STATE_DICT_OPTIONS)
        self._restore_side_state(path, tstate, trainer)
        self.last_saved_step = tstate["step"]
        self._say(
            f"checkpoint: resumed from {path} (step {tstate['step']}, saved on "
            f"{tstate.get('world_size', '?')} rank(s), {time.perf_counter() - t0:.2f} s)"
        )
        return tstate

    def _restore_side_state(self, path: Path, tstate: dict, trainer: Any) -> None:
        parts = _trainer_parts(trainer)
        _restore_jsonable(parts["scheduler"], tstate.get("scheduler"))
        _restore_jsonable(parts["scaler"], tstate.get("scaler"))
        _restore_jsonable(parts["state"], tstate.get("state"))
        same_shape = tstate.get("world_size") == _world()
        rank_file = path / f"rank_{_rank():05d}.json"
        if same_shape and rank_file.is_file():
            per_rank = _read_json(rank_file)
            restore_rng_state(per_rank["rng"])
            _restore_jsonable(parts["loader"], per_rank.get("loader"))
        else:
            # Resharded resume: there is no RNG stream of "this rank" in the old run; rank r
            # continues rank (r mod old_world)'s stream. The data position is global (the loader
            # state of rank 0) so no sample is repeated or skipped.
            old = (_rank() % int(tstate.get("world_size", 1)))
            restore_rng_state(_read_json(path / f"rank_{old:05d}.json")["rng"])
            _restore_jsonable(parts["loader"], tstate.get("loader"))
            self._say(
                f"checkpoint: resharding {tstate.get('world_size')} -> {_world()} ranks through DCP"
            )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _inner_error(e: BaseException) -> BaseException:
    """DCP wraps every rank's failure in a CheckpointException whose `failures` maps rank ->
    (exception, traceback); the first rank's exception says what went wrong."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return e


def _find_os_error(e: BaseException | None) -> OSError | None:
    """The OSError (ENOSPC, EACCES, ...) behind a failed save, if there is one."""
    seen = 0
    while e is not None and seen < 10:
        e = _inner_error(e)
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def _slow_save_hook() -> None:
    delay = os.environ.get(SLOW_SAVE_ENV)
    if delay:
        time.sleep(float(delay))


def _check_same_model(path: Path, trainer: Any) -> None:
    """A checkpoint of another model is 'foreign': say which model fields differ."""
    cfg = _trainer_config(trainer)
    cfile = path / CONFIG_FILE
    if cfg is None or not hasattr(cfg, "model_config_resolved") or not cfile.is_file():
        return
    saved = _read_json(cfile)
    try:
        from tenfold.config import build_config

        saved_model = build_config({"model": saved.get("model", {})}).model_config_resolved().to_dict()
    except UserError as e:
        raise CheckpointError(f"checkpoint config {cfile} is not valid: {e}") from None
    ours = cfg.model_config_resolved().to_dict()
    diff = sorted(k for k in ours if ours[k] != saved_model.get(k))
    if diff:
        detail = ", ".join(f"{k}={saved_model.get(k)!r} (run: {ours[k]!r})" for k in diff[:4])
        raise CheckpointError(f"checkpoint {path} holds a different model: {detail} (from {cfile})")


def auto_candidates(root: Path) -> list[Path]:
    """What `latest` names, then the older step_N (descending), then any newer ones. Older
    first because a newer step_N than `latest` belongs to a trajectory the user abandoned by
    resuming from an earlier checkpoint (or to a save that died between rename and `latest`)."""
    steps = list_step_dirs(root)
    latest = read_latest(root)
    if latest is None or not latest.is_dir():
        return [p for _, p in steps]
    n = int(STEP_DIR.match(latest.name).group(1))
    return [latest] + [p for s, p in steps if s < n] + [p for s, p in steps if s > n]


def resolve_checkpoint_path(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (OUT) / its checkpoints folder, whose
    `latest` (or newest step_N) is taken."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint not found: {p}")
    if is_checkpoint_dir(p) or STEP_DIR.match(p.name):
        return p
    for root in (p / "checkpoints", p):
        candidates = auto_candidates(root)
        if candidates:
            return candidates[0]
    raise CheckpointError(f"no checkpoint in {p} (expected {p}/checkpoints/step_N or a step_N directory)")


def load_trainer_state(path: Path) -> dict:
    return _read_json(path / TRAINER_STATE)


def _trainer_state_step(trainer: Any) -> int:
    state = getattr(trainer, "state", None)
    return int(state["step"] if isinstance(state, dict) else state.step)
