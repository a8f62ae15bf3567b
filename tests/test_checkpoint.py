"""Checkpoints on one process: exact resume, atomic saves, faults (corrupt, truncated, foreign,
full disk, kill -9 mid-save), safe loading, --keep-last, NaN never saved.

The loop is plain_loop.py (every piece of training state, all three RNGs in the gradient, so a
resume that forgot any piece of state gives a different curve). The trainer-level checks
(`tenfold train ... --resume auto`) are in test_checkpoint_trainer.py.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from plain_loop import GLOBAL_BATCH, MODEL, SEQ, STEPS, fresh_run_with_checkpoints, make_run, manager, train, train_step
from tenfold.config import build_config
from tenfold.engine.outputs import checkpoint as ck
from tenfold.engine.outputs.checkpoint import manager as manager_module
from tenfold.engine.outputs.checkpoint import states as states_module
from tenfold.errors import RunError, UserError
from tenfold.models.gpt import GPT
from tenfold.models.presets import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- exact resume


def test_resume_matches_uninterrupted_exactly(tmp_path):
    reference = train(make_run(), STEPS)
    assert len({r["scale"] for r in reference}) > 1, "the loss scale must move for the test to mean something"
    assert len({r["lr"] for r in reference}) > 1
    first = make_run()
    train(first, 3, manager(tmp_path, first))
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_3"
    resumed = make_run()  # fresh objects, different RNG position than at step 3
    tstate = manager(tmp_path, resumed, resume="auto").resume()
    assert tstate["step"] == 3 and resumed.state == {"step": 3, "tokens": 3 * GLOBAL_BATCH * SEQ}
    rest = train(resumed, STEPS)
    assert [r["step"] for r in rest] == [4, 5, 6]
    for got, want in zip(rest, reference[3:]):
        assert got == want  # loss, lr and loss scale bit for bit (fp32, same ops)


def test_resume_without_rng_state_would_differ(tmp_path):
    """The exact test above can fail: dropping the RNG restore changes the curve."""
    reference = train(make_run(), STEPS)
    fresh_run_with_checkpoints(tmp_path, 3)
    resumed = make_run()
    m = manager(tmp_path, resumed, resume="auto")
    original = states_module.restore_rng_state
    states_module.restore_rng_state = lambda state: None
    try:
        m.resume()
    finally:
        states_module.restore_rng_state = original
    rest = train(resumed, STEPS)
    assert abs(rest[-1]["loss"] - reference[-1]["loss"]) > 1e-4  # the noise stream was not restored


def test_resume_auto_without_checkpoint_starts_fresh(tmp_path):
    messages: list[str] = []
    assert manager(tmp_path, make_run(), resume="auto", messages=messages).resume() is None
    assert any("starting fresh" in m for m in messages)


def test_resume_from_explicit_path_and_run_dir(tmp_path):
    fresh_run_with_checkpoints(tmp_path, 6, every=2)
    run = make_run()
    assert manager(tmp_path, run, resume=str(tmp_path / "checkpoints" / "step_4")).resume()["step"] == 4
    assert ck.resolve_checkpoint_path(tmp_path) == tmp_path / "checkpoints" / "step_6"
    with pytest.raises(UserError, match="checkpoint not found"):
        manager(tmp_path, make_run(), resume=str(tmp_path / "nope")).resume()


# --------------------------------------------------------------------------- layout, keep-last


def test_layout_manifest_and_keep_last(tmp_path):
    fresh_run_with_checkpoints(tmp_path, 6, every=1, keep_last=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_5", "step_6"]
    ckpt = root / "step_6"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format"] == ck.FORMAT_TAG and manifest["step"] == 6
    names = set(manifest["files"])
    assert {".metadata", "trainer_state.json", "rank_00000.json"} <= names
    assert any(n.endswith(".distcp") for n in names)
    for rel, info in manifest["files"].items():
        assert (ckpt / rel).stat().st_size == info["bytes"]
    tstate = json.loads((ckpt / "trainer_state.json").read_text())
    assert tstate["scheduler"]["last_epoch"] == 6 and tstate["scaler"]["kind"] == "dynamic"
    assert tstate["loader"]["samples_seen"] == 6 * GLOBAL_BATCH


def test_saving_the_same_step_again_replaces_it(tmp_path):
    fresh_run_with_checkpoints(tmp_path, 3)
    fresh_run_with_checkpoints(tmp_path, 3)  # a second fresh run into the same OUT
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_3"]
    ck.verify_checkpoint(tmp_path / "checkpoints" / "step_3")


# --------------------------------------------------------------------------- faults


def _two_checkpoints(tmp_path) -> Path:
    fresh_run_with_checkpoints(tmp_path, 6, every=3)
    return tmp_path / "checkpoints"


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete_manifest", "foreign_tag", "delete_shard"])
def test_bad_checkpoint_named_and_auto_falls_back(tmp_path, damage):
    root = _two_checkpoints(tmp_path)
    bad = root / "step_6"
    shard = next(bad.glob("*.distcp"))
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        expect = f"corrupt checkpoint file {shard}"
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
        expect = f"truncated or altered checkpoint file {shard}"
    elif damage == "delete_manifest":
        (bad / "manifest.json").unlink()
        expect = "foreign DCP checkpoint"
    elif damage == "foreign_tag":
        (bad / "manifest.json").write_text(json.dumps({"format": "something-else"}))
        expect = f"not a tenfold checkpoint (format tag is not 'tenfold-checkpoint'): {bad / 'manifest.json'}"
    else:
        shard.unlink()
        expect = f"checkpoint file missing: {shard}"
    with pytest.raises(UserError) as info:
        manager(tmp_path, make_run(), resume=str(bad)).resume()
    assert expect in str(info.value)
    assert "\n" not in str(info.value)
    messages: list[str] = []
    run = make_run()
    tstate = manager(tmp_path, run, resume="auto", messages=messages).resume()
    assert tstate["step"] == 3
    assert any(expect in m and "falling back" in m for m in messages)


def test_all_checkpoints_bad_is_an_error_not_a_fresh_start(tmp_path):
    root = _two_checkpoints(tmp_path)
    for d in ("step_3", "step_6"):
        (root / d / "trainer_state.json").write_text("{broken")
    with pytest.raises(UserError, match="no usable checkpoint"):
        manager(tmp_path, make_run(), resume="auto").resume()


def test_checkpoint_of_another_model_is_refused(tmp_path):
    fresh_run_with_checkpoints(tmp_path, 3)
    other = make_run()
    other.model = GPT(ModelConfig(n_layers=2, d_model=48, n_heads=2, vocab_size=64, max_seq_len=16))
    other.optimizer = torch.optim.AdamW(other.model.parameters(), lr=1e-2)
    with pytest.raises(UserError, match=r"step_3 does not fit this model/optimizer: Size mismatch"):
        manager(tmp_path, other, resume="auto").resume()
    other.cfg = build_config({"model": {**MODEL, "d_model": 48}})  # with a config: named fields
    with pytest.raises(UserError, match=r"step_3 holds a different model: d_model=32 \(run: 48\)"):
        manager(tmp_path, other, resume=str(tmp_path / "checkpoints" / "step_3")).resume()


def test_metadata_pickle_with_code_is_refused(tmp_path):
    """DCP's .metadata is a plain pickle; ours is read with an allow-list unpickler."""
    fresh_run_with_checkpoints(tmp_path, 3)
    ckpt = tmp_path / "checkpoints" / "step_3"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UserError, match=r"malformed checkpoint file .*\.metadata: refusing to load posix.system"):
        ck.SafeReader(ckpt).read_metadata()
    # through the normal path the manifest's checksum already catches it:
    with pytest.raises(UserError, match=r"altered checkpoint file .*step_3/\.metadata"):
        manager(tmp_path, make_run(), resume=str(ckpt)).resume()
    assert not marker.exists()


def test_full_disk_reports_error_keeps_previous_and_removes_tmp(tmp_path, monkeypatch):
    fresh_run_with_checkpoints(tmp_path, 3)
    run = make_run()
    m = manager(tmp_path, run, resume="auto")
    m.resume()
    real_save = manager_module.dcp.save

    def save_then_disk_full(state, checkpoint_id, **kwargs):
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(manager_module.dcp, "save", save_then_disk_full)
    train_step(run)
    with pytest.raises(UserError) as info:
        m.save(4)
    msg = str(info.value)
    assert "No space left on device" in msg and "step_3 is intact" in msg
    monkeypatch.setattr(manager_module.dcp, "save", real_save)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_3"]
    assert ck.read_latest(root) == root / "step_3"
    assert manager(tmp_path, make_run(), resume="auto").resume()["step"] == 3


def test_nan_weights_are_never_saved(tmp_path):
    run = make_run()
    train(run, 1)
    with torch.no_grad():
        run.model.layers["0"].mlp.w1.weight[0, 0] = float("nan")
    with pytest.raises(RunError, match=r"step 1: parameter layers.0.mlp.w1.weight holds NaN"):
        manager(tmp_path, run).save(1)
    assert not (tmp_path / "checkpoints" / "step_1").exists()


KILL_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import plain_loop as t
    out = Path({out!r})
    run = t.make_run()
    t.train(run, 3, t.manager(out, run))       # step_3 complete
    print("READY", flush=True)
    import os
    os.environ[t.ck.SLOW_SAVE_ENV] = "60"
    t.train(run, 6, t.manager(out, run))       # step_6 save is slowed down and killed
    """
)


def test_kill_9_during_save_leaves_previous_checkpoint(tmp_path):
    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "READY"
    # The child's second manager writes step_6 slowly: wait for its tmp dir, then SIGKILL.
    tmp = tmp_path / "checkpoints" / ".tmp-step_6"
    deadline = time.time() + 60
    while not tmp.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert tmp.exists(), "the save of step 6 never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    root = tmp_path / "checkpoints"
    assert ck.read_latest(root) == root / "step_3"
    assert not (root / "step_6").exists()
    reference = train(make_run(), STEPS)  # (make_run seeds the global RNGs: before resume)
    run = make_run()
    assert manager(tmp_path, run, resume="auto").resume()["step"] == 3
    assert train(run, STEPS) == reference[3:]
    # the next save clears the leftover of the killed one
    manager(tmp_path, run).save(6)
    assert not tmp.exists() and (root / "step_6").is_dir()


# --------------------------------------------------------------------------- preemption


def test_sigterm_saves_at_next_step_boundary_and_stops(tmp_path):
    run = make_run()
    m = manager(tmp_path, run, every=0)
    m.install_signal_handlers()
    try:
        train_step(run)
        assert not m.after_step(1)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives "during" step 2
        train_step(run)
        assert m.after_step(2) is True
    finally:
        m.close()
    root = tmp_path / "checkpoints"
    assert ck.read_latest(root) == root / "step_2"
    assert signal.getsignal(signal.SIGTERM) is not m._on_signal


def test_a_signal_that_lands_while_the_ranks_agree_is_kept(tmp_path, monkeypatch):
    """The handler can run between the collective's answer and its assignment: the flag it sets
    survives that answer (False, from the other ranks) and stops the run at the next boundary."""
    run = make_run()
    m = manager(tmp_path, run, every=0)
    m.install_signal_handlers()
    agreed = manager_module.d.any_rank

    def signal_during_agreement(flag):
        os.kill(os.getpid(), signal.SIGTERM)  # handled before this function returns
        return False  # the other ranks, asked before the signal, say "go on"

    try:
        train_step(run)
        monkeypatch.setattr(manager_module.d, "any_rank", signal_during_agreement)
        assert not m.after_step(1)
        monkeypatch.setattr(manager_module.d, "any_rank", agreed)
        train_step(run)
        assert m.after_step(2) is True
    finally:
        m.close()
    assert ck.read_latest(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step_2"


def test_async_save_snapshot_is_exact(tmp_path):
    """Background save: training goes on while step 3 is written; resume is still exact."""
    reference = train(make_run(), STEPS)
    run = make_run()
    m = manager(tmp_path, run, async_save=True)
    train(run, 5, m)  # step 3 async, finalised later; the last step saves synchronously
    assert [s.step for s in m.saves] == [3, 5]
    resumed = make_run()
    manager(tmp_path, resumed, resume=str(tmp_path / "checkpoints" / "step_3")).resume()
    assert train(resumed, STEPS) == reference[3:]


def test_auto_candidates_order(tmp_path):
    root = tmp_path / "checkpoints"
    for n in (1, 2, 3, 5):
        (root / f"step_{n}").mkdir(parents=True)
    assert [p.name for p in ck.auto_candidates(root)] == ["step_5", "step_3", "step_2", "step_1"]
    (root / "latest").write_text("step_2\n")  # resumed from step 2 after step 5 was written
    assert [p.name for p in ck.auto_candidates(root)] == ["step_2", "step_1", "step_5", "step_3"]
