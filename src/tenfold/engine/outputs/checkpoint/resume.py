"""Loading a checkpoint into a run's states: verify, validate everything, then restore.

Order matters. First the manifest and every file's size and sha256 (collective); then every
JSON file and the DCP metadata are read and validated against the states (on every rank,
with one verdict), before anything is restored; only then does DCP load model and optimizer
and the JSON states restore. A malformed checkpoint is therefore one `CheckpointError` naming
the file, raised on every rank with nothing changed, and `--resume auto` falls back to the
previous checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed.checkpoint as dcp

from tenfold.config import build_config
from tenfold.engine.parallel import distributed as d
from tenfold.engine.outputs.checkpoint import layout as lay
from tenfold.engine.outputs.checkpoint.reader import SafeLoadPlanner, SafeReader, inner_error, read_safe_metadata
from tenfold.engine.outputs.safe_files import Folder
from tenfold.errors import UserError

DCP_STATES = ("model", "optim")  # .metadata + __R_I.distcp
RANK_STATES = ("rng", "loader")  # rank_RRRRR.json: this rank's own stream / position
RANK_ONLY = ("rng",)  # no global copy in trainer_state.json (there is no "global" RNG stream)
_MISSING = object()


def _listed_json(folder: Folder, name: str, manifest: dict) -> dict:
    """A JSON object file the manifest lists (so its size and hash were verified)."""
    if name not in manifest["files"]:
        raise lay.CheckpointError(f"checkpoint file missing: {folder.path / name} (not in the manifest)")
    data = lay.read_json_in(folder, name)
    if not isinstance(data, dict):
        raise lay.CheckpointError(f"malformed checkpoint file {folder.path / name}: not a JSON object")
    return data


def _trainer_state(folder: Folder, manifest: dict) -> dict:
    tstate = _listed_json(folder, lay.TRAINER_STATE, manifest)
    where = folder.path / lay.TRAINER_STATE
    if tstate.get("step") != manifest["step"] or type(tstate.get("step")) is not int:
        raise lay.CheckpointError(
            f"malformed checkpoint file {where}: step {tstate.get('step')!r}, manifest says {manifest['step']}"
        )
    world = tstate.setdefault("world_size", manifest["world_size"])
    if type(world) is not int or world < 1:
        raise lay.CheckpointError(f"malformed checkpoint file {where}: world_size {world!r} is not a rank count")
    return tstate


def check_same_model(folder: Folder, config: Any, manifest: dict) -> None:
    """A checkpoint of another model is 'foreign': say which model fields differ."""
    if config is None or not hasattr(config, "model_config_resolved") or lay.CONFIG_FILE not in manifest["files"]:
        return
    cfile = folder.path / lay.CONFIG_FILE
    saved = _listed_json(folder, lay.CONFIG_FILE, manifest).get("model", {})
    try:
        saved_model = build_config({"model": saved}).model_config_resolved().to_dict()
    except UserError as e:
        raise lay.CheckpointError(f"checkpoint config {cfile} is not valid: {e}") from None
    ours = config.model_config_resolved().to_dict()
    diff = sorted(k for k in ours if ours[k] != saved_model.get(k))
    if diff:
        detail = ", ".join(f"{k}={saved_model.get(k)!r} (run: {ours[k]!r})" for k in diff[:4])
        raise lay.CheckpointError(f"checkpoint {folder.path} holds a different model: {detail} (from {cfile})")


def _saved_parts(folder: Folder, manifest: dict, tstate: dict, states: dict) -> dict[str, tuple[Any, str]]:
    """{state name: (saved data, file it came from)} for every JSON state. Same world size:
    rank states from this rank's file. Resharded: a rank state with a global copy in
    trainer_state.json takes that (the loader's global position), the others rank
    (r mod old world)'s (its RNG streams)."""
    old_world = tstate["world_size"]
    same = old_world == d.world_now()
    own = lay.rank_file(d.rank_now() if same else d.rank_now() % old_world)
    per_rank: dict | None = None
    parts = {}
    for name in states:
        if name in DCP_STATES:
            continue
        if name in RANK_STATES and (same or name not in tstate):
            per_rank = per_rank if per_rank is not None else _listed_json(folder, own, manifest)
            source, value = own, per_rank.get(name, _MISSING)
        else:
            source, value = lay.TRAINER_STATE, tstate.get(name, _MISSING)
        if value is _MISSING:
            raise lay.CheckpointError(f"malformed checkpoint file {folder.path / source}: no {name!r} entry")
        if value is not None:  # None: saved by a run without this part
            parts[name] = (value, source)
    return parts


def _validated(path: Path, manifest: dict, states: dict, config: Any) -> tuple[dict, dict]:
    """Read and check everything JSON and the DCP metadata; change nothing."""
    with lay.open_checkpoint(path) as folder:
        tstate = _trainer_state(folder, manifest)
        check_same_model(folder, config, manifest)
        parts = _saved_parts(folder, manifest, tstate, states)
        for name, (value, source) in parts.items():
            check = getattr(states[name], "validate", None)
            try:
                if check is not None:
                    check(value)
            except (ValueError, TypeError) as e:
                raise lay.CheckpointError(f"malformed checkpoint file {folder.path / source}: {e}") from None
    read_safe_metadata(path, set(manifest["files"]))
    return tstate, parts


def _load_dcp(path: Path, manifest: dict, states: dict) -> None:
    state = {k: states[k] for k in DCP_STATES if k in states}
    try:
        dcp.load(state, storage_reader=SafeReader(path, set(manifest["files"])), planner=SafeLoadPlanner(),
                 process_group=d.side_group(), no_dist=not d.dist_on())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        inner = inner_error(e)
        if isinstance(inner, UserError):
            raise lay.CheckpointError(str(inner)) from None
        raise lay.CheckpointError(
            f"checkpoint {path} does not fit this model/optimizer: {d.first_line(inner)}"
        ) from None


def _restore(path: Path, parts: dict, states: dict) -> None:
    for name, (value, source) in parts.items():
        try:
            states[name].load_state_dict(value)
        except UserError:
            raise  # the run's settings differ (other data, another loss scaler): say so as is
        except (KeyError, TypeError, ValueError) as e:
            raise lay.CheckpointError(f"malformed checkpoint file {path / source}: {name}: {e}") from None


def load_checkpoint(path: Path, states: dict, config: Any, say: Callable[[str], None]) -> dict:
    """Verify, validate, then load one checkpoint into `states` (collective); its trainer_state."""
    t0 = time.perf_counter()
    manifest = lay.verify_checkpoint(path)
    tstate, parts = d.on_every_rank(lambda: _validated(path, manifest, states, config),
                                    peer_error=lay.CheckpointError)
    _load_dcp(path, manifest, states)
    d.on_every_rank(lambda: _restore(path, parts, states), peer_error=lay.CheckpointError)
    if tstate["world_size"] != d.world_now():
        say(f"checkpoint: resharding {tstate['world_size']} -> {d.world_now()} ranks through DCP")
    say(
        f"checkpoint: resumed from {path} (step {tstate['step']}, saved on "
        f"{tstate['world_size']} rank(s), {time.perf_counter() - t0:.2f} s)"
    )
    return tstate


def resume_auto(root: Path, states: dict, config: Any, say: Callable[[str], None]) -> dict | None:
    """`--resume auto`: the newest good checkpoint; each bad one is named and skipped."""
    candidates = lay.auto_candidates(root)
    if not candidates:
        say(f"checkpoint: --resume auto: no checkpoint in {root}, starting fresh")
        return None
    failures = []
    for path in candidates:
        try:
            return load_checkpoint(path, states, config, say)
        except lay.CheckpointError as e:
            failures.append(str(e))
            say(f"checkpoint: {e}; falling back to the previous checkpoint")
    raise lay.CheckpointError(
        f"--resume auto: no usable checkpoint in {root} ({len(failures)} tried); "
        f"newest problem: {failures[0]}"
    )
