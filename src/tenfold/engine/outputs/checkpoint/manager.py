"""`CheckpointManager`: periodic, preemption-triggered and final saves, `--resume`, `--keep-last`,
in the shape of torchtitan's `CheckpointManager(states={...})`.

The trainer hands over `states`, a dict of `torch.distributed.checkpoint.stateful.Stateful`
objects under fixed names (`states.training_states` builds it); where each name is stored is
the on-disk format:

    model, optim        -> DCP (.metadata + __R_I.distcp), resharded by DCP on load
    rng, loader         -> rank_RRRRR.json, this rank's own (RANK_STATES)
    everything else     -> trainer_state.json (rank 0 writes it, every rank reads it), and
                           the loader again: the global position a resharded resume takes

Every public method is collective: all ranks call it at the same step boundary.
"""

from __future__ import annotations

import signal
import sys
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

from tenfold.engine.parallel import distributed as d
from tenfold.engine.outputs.checkpoint import layout as lay
from tenfold.engine.outputs.checkpoint import resume as rs
from tenfold.engine.outputs.checkpoint import save_files as disk
from tenfold.engine.outputs.checkpoint.save_files import SLOW_SAVE_ENV  # noqa: F401 (re-exported)
from tenfold.engine.outputs.safe_files import Folder
from tenfold.errors import RunError

DCP_STATES = rs.DCP_STATES
RANK_STATES = rs.RANK_STATES
_RESERVED = ("step", "world_size", "dp_size", "pp_size", "torch_version")

# One process is a supported layout, not an accident: DCP's "assuming the intent is to save/load
# in a single process" warning would print on every save of every single-process run.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")


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


class CheckpointManager:
    """Saves and restores `states` under OUT/checkpoints (see the module docstring).

    `config`: the run's TenfoldConfig (written as config.json; a checkpoint of another model is
    refused by name). `dist`: the run's DistInfo (dp/pp sizes recorded in trainer_state.json).
    """

    def __init__(
        self,
        out_dir: str | Path,
        states: dict[str, Any],
        *,
        config: Any = None,
        dist: Any = None,
        every: int = 0,
        keep_last: int | None = None,
        resume: str | None = None,
        async_save: bool = False,
        log: Callable[[str], None] | None = None,
        final: bool = False,
    ):
        clash = sorted(set(states) & set(_RESERVED))
        if clash or "model" not in states:
            raise ValueError(f"checkpoint states need 'model' and may not be named {clash or list(_RESERVED)}")
        self.root = lay.checkpoints_root(out_dir)
        self.states, self.config, self.dist = states, config, dist
        self.every, self.keep_last, self.resume_from = every, keep_last, resume
        self.final = final  # save at the last step even without periodic saves
        self.async_save = async_save
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._pending: _PendingSave | None = None
        self._signalled = False  # set by the signal handler only: never overwritten by the loop
        self._stopping = False  # every rank agreed to stop (preempted())
        self._old_handlers: dict[int, Any] = {}
        self.saves: list[SaveResult] = []
        self.last_saved_step: int | None = None

    @classmethod
    def from_config(cls, cfg, states: dict[str, Any], dist: Any = None, log=None) -> "CheckpointManager":
        c = cfg.checkpoint
        return cls(cfg.log.out, states, config=cfg, dist=dist, every=c.every, keep_last=c.keep_last,
                   resume=c.resume, async_save=c.async_save, log=log, final=c.final)

    def _say(self, msg: str) -> None:
        if d.rank_now() == 0:
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
        if (self._signalled or self._stopping) and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self._signalled = True

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def preempted(self) -> bool:
        """Collective: True on every rank once any rank got SIGTERM/SIGINT, or the `--nproc`
        launcher got one (its stop file). The handler's flag is read, never written here: a
        signal that lands while the ranks agree (its handler runs between two bytecodes of this
        line) is seen at the next step boundary instead of being overwritten by the answer."""
        self._stopping = d.any_rank(self._signalled or d.stop_requested())
        return self._stopping

    # ----------------------------------------------------------------- save

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def after_step(self, step: int, last: bool = False) -> bool:
        """Call at every optimizer-step boundary. Saves when `step % every == 0`, on
        preemption, and at the last step (when periodic saves are on, or `final`). Returns True
        when the loop must stop (preempted)."""
        self._poll_pending()
        stop = self.preempted()
        if (self.due(step) or stop or (last and (self.every > 0 or self.final))) and self.last_saved_step != step:
            self.save(step, wait=stop or last)
            if stop:
                self._say(f"checkpoint: preempted; saved step {step}, exiting")
        elif last or stop:
            self.wait()
        return stop

    def save_final(self, step: int) -> Path:
        """Make sure `step` is checkpointed and on disk (the export at the end of training
        reads it); returns its folder."""
        if self.last_saved_step != step:
            self.save(step, wait=True)
        self.wait()
        return self.root / lay.step_dir_name(step)

    def save(self, step: int, wait: bool = False) -> SaveResult:
        """Write OUT/checkpoints/step_N atomically (see the package docstring)."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at most; finalises the previous async one
        self._refuse_non_finite(step)
        final = self.root / lay.step_dir_name(step)
        tmp = self.root / f"{lay.TMP_PREFIX}{final.name}"
        pending = _PendingSave(step=step, tmp=tmp, final=final, started=t0, blocked_s=0.0)
        try:
            d.on_every_rank(lambda: disk.make_tmp(self.root, tmp.name) if d.rank_now() == 0 else None)
            d.on_every_rank(lambda: self._write_side_files(tmp, step))
            state = {k: self.states[k] for k in DCP_STATES if k in self.states}
            kwargs = {"checkpoint_id": tmp, "process_group": d.side_group(), "no_dist": not d.dist_on()}
            if self.async_save and not wait:
                pending.future = dcp.async_save(state, **kwargs)
            else:
                dcp.save(state, **kwargs)
            disk.slow_save_hook()
        except BaseException as e:
            disk.abandon(self.root, tmp, e)
            raise disk.save_error(self.root, e, tmp) from e
        pending.blocked_s = time.perf_counter() - t0
        self._pending = pending
        if pending.future is None:
            return self._finalize()
        self._say(f"checkpoint: step {step} saving in the background ({pending.blocked_s:.2f} s blocked)")
        return SaveResult(final, step, pending.blocked_s, async_pending=True)

    def _refuse_non_finite(self, step: int) -> None:
        """A NaN never reaches a saved checkpoint: refuse non-finite parameters (local shards,
        agreed on every rank)."""
        names = [b for b in d.all_gather_small(self.states["model"].non_finite_parameter()) if b]
        if names:
            raise RunError(f"refusing to save checkpoint at step {step}: parameter {names[0]} holds NaN/inf")

    def _write_side_files(self, tmp: Path, step: int) -> None:
        rank = d.rank_now()
        with Folder(tmp) as folder:
            mine = {name: self.states[name].state_dict() for name in RANK_STATES if name in self.states}
            folder.create(lay.rank_file(rank), lay.encode_json({"rank": rank, **mine}))
            if rank != 0:
                return
            shared = {name: s.state_dict() for name, s in self.states.items()
                      if name not in DCP_STATES and name not in rs.RANK_ONLY}
            folder.create(lay.TRAINER_STATE, lay.encode_json({
                "step": step, **shared, **self._dist_shape(), "torch_version": torch.__version__,
            }))
            if self.config is not None:
                folder.create(lay.CONFIG_FILE, lay.encode_json(self.config.to_dict()))

    def _dist_shape(self) -> dict:
        world = d.world_now()
        return {"world_size": world, "dp_size": getattr(self.dist, "dp_size", world),
                "pp_size": getattr(self.dist, "pp_size", 1)}

    def _poll_pending(self) -> None:
        """Finalise a background save once it has finished on every rank (collective)."""
        if self._pending is None or self._pending.future is None:
            return
        if not d.any_rank(not self._pending.future.done()):
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
            disk.slow_save_hook()
            total = disk.write_manifest(p.tmp, p.step)
            d.on_every_rank(lambda: disk.publish(self.root, p.tmp, p.final, self.keep_last)
                            if d.rank_now() == 0 else None)
        except BaseException as e:
            disk.abandon(self.root, p.tmp, e)
            raise disk.save_error(self.root, e, p.tmp) from e
        seconds = p.blocked_s if p.future is not None else time.perf_counter() - p.started
        result = SaveResult(p.final, p.step, seconds, total)
        self.saves.append(result)
        self.last_saved_step = p.step
        self._say(
            f"checkpoint: saved {p.final} ({total / 2**20:.1f} MiB, "
            f"{time.perf_counter() - p.started:.2f} s, {seconds:.2f} s blocking)"
        )
        return result

    def close(self) -> None:
        self.wait()
        self.restore_signal_handlers()

    # ----------------------------------------------------------------- resume

    def resume(self) -> dict | None:
        """`--resume auto|PATH`: load a checkpoint into the states and return its
        trainer_state dict (None for a fresh start). auto falls back past bad checkpoints,
        naming each; PATH must be good."""
        if not self.resume_from:
            return None
        if self.resume_from == "auto":
            tstate = rs.resume_auto(self.root, self.states, self.config, self._say)
        else:
            tstate = self.load(lay.resolve_checkpoint_path(self.resume_from))
        if tstate is not None:
            self.last_saved_step = tstate["step"]
        return tstate

    def load(self, path: Path) -> dict:
        """Verify and load one checkpoint into the states (collective); its trainer_state."""
        tstate = rs.load_checkpoint(Path(path), self.states, self.config, self._say)
        self.last_saved_step = tstate["step"]
        return tstate

