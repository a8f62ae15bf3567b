"""Checkpoints that survive a 3-day run: sharded save/resume through torch.distributed.checkpoint.

Layout of one checkpoint (OUT/checkpoints/step_N/):

    .metadata, __R_I.distcp   DCP: model + optimizer, every rank writes its own shard
                              (`get_model_state_dict`/`get_optimizer_state_dict` give FQN-keyed
                              state for plain, DDP and FSDP2 models alike, so a checkpoint from 2
                              ranks ZeRO-3 loads on one process or 4 ranks ZeRO-1: DCP reshards)
    trainer_state.json        step, counters, LR schedule, loss scaler, data loader position
    rank_00000.json ...       every rank's RNG states (torch CPU/CUDA, numpy, python) + loader
    config.json               the resolved run config
    manifest.json             written LAST: format tag, step, and size + sha256 of every file

Atomicity (the DeepSpeed `latest` tag + torchtitan's layout, made crash-safe): everything is
written under `.tmp-step_N/`; after every rank is done, rank 0 writes the manifest, renames the
folder to `step_N/` and only then replaces `OUT/checkpoints/latest` (a one-line text file)
with `os.replace`. A process killed at any point leaves either the old `latest` pointing at a
complete checkpoint, or the new one: never a half-written folder under a final name.

Modules:
    layout.py       names, `latest`, the manifest and verification (sizes, sha256)
    states.py       RNG streams and JSON state (schedule, scaler, loader, counters) as Stateful
    model_state.py  model and optimizer as Stateful objects for DCP
    reader.py       reading DCP files without running code or leaving the folder
    resume.py       verify -> validate everything -> restore; `--resume auto` fallback
    manager.py      CheckpointManager(out, states={...}): saves, preemption, resume
    save_files.py   one save's folders on disk: manifest, rename into place, prune, failed saves
"""

from tenfold.engine.outputs.checkpoint.layout import (
    CONFIG_FILE,
    FORMAT_TAG,
    FORMAT_VERSION,
    MANIFEST,
    TRAINER_STATE,
    CheckpointError,
    auto_candidates,
    checkpoints_root,
    list_step_dirs,
    load_trainer_state,
    read_json,
    read_latest,
    read_manifest,
    resolve_checkpoint_path,
    verify_checkpoint,
)
from tenfold.engine.outputs.checkpoint.manager import SLOW_SAVE_ENV, CheckpointManager, SaveResult
from tenfold.engine.outputs.checkpoint.reader import SafeLoadPlanner, SafeReader, read_safe_metadata
from tenfold.engine.outputs.checkpoint.states import JsonState, RNGState, training_states

__all__ = [
    "CONFIG_FILE", "FORMAT_TAG", "FORMAT_VERSION", "MANIFEST", "SLOW_SAVE_ENV", "TRAINER_STATE",
    "CheckpointError", "CheckpointManager", "JsonState", "RNGState", "SafeLoadPlanner", "SafeReader",
    "SaveResult", "auto_candidates", "checkpoints_root", "list_step_dirs", "load_trainer_state",
    "read_json", "read_latest", "read_manifest", "read_safe_metadata", "resolve_checkpoint_path",
    "training_states", "verify_checkpoint",
]
