"""The foundation: one-process training, accumulation equivalence, outputs, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import SMALL_FLAGS, read_metrics, small_config
from tenfold.cli import main
from tenfold.config import build_config
from tenfold.engine.metrics import REQUIRED_KEYS
from tenfold.engine.trainer import Trainer


def _grads_for_split(tmp_path, rows: torch.Tensor, labels: torch.Tensor, micro: int) -> tuple[float, dict]:
    """Gradients of one global batch split into micro-batches of `micro` rows."""
    t = Trainer(build_config(small_config(tmp_path)))
    t.setup()
    mbs = [
        {"input_ids": rows[i : i + micro], "labels": labels[i : i + micro]}
        for i in range(0, len(rows), micro)
    ]
    loss, _ = t.accumulate_gradients(mbs)
    return loss, {n: p.grad.clone() for n, p in t.model.named_parameters()}


def _padded_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (4, 32), generator=g)
    labels = torch.randint(0, 256, (4, 32), generator=g)
    # Unequal numbers of targets per sequence: padding at the end of rows 1 and 3.
    labels[1, 5:] = -100
    labels[3, 20:] = -100
    return rows, labels


def test_accumulation_equals_one_big_batch_with_padding(tmp_path):
    rows, labels = _padded_batch()
    reference_loss, reference = _grads_for_split(tmp_path, rows, labels, micro=4)  # 4 x 1
    for micro in (2, 1):  # 2 x 2 and 1 x 4
        loss, grads = _grads_for_split(tmp_path, rows, labels, micro=micro)
        assert loss == pytest.approx(reference_loss, rel=1e-6)
        for name, g in grads.items():
            # Relative error of the whole tensor (norm), 1e-6: fp32 sums in another order
            # differ by ~2e-7 here; a wrong normalisation is off by whole percents.
            rel = float((g - reference[name]).norm() / reference[name].norm())
            assert rel < 1e-6, (name, rel)


def test_mean_of_micro_batch_means_would_differ(tmp_path):
    """Guard that the padded batch actually exercises token weighting: the naive average of
    per-micro-batch means (the 2024 bug) gives a different loss."""
    rows, labels = _padded_batch()
    loss, _ = _grads_for_split(tmp_path, rows, labels, micro=4)
    t = Trainer(build_config(small_config(tmp_path)))
    t.setup()
    with torch.no_grad():
        means = [float(t.forward_loss({"input_ids": rows[i:i+1], "labels": labels[i:i+1]}))
                 / int((labels[i] != -100).sum()) for i in range(4)]
    assert abs(sum(means) / 4 - loss) > 1e-3


def test_micro_batch_split_gives_same_loss_curve(tmp_path):
    """1 x 4 and 4 x 1 (micro-batch x accumulation) see the same data and give the same
    per-step losses (fp32)."""
    curves = []
    for micro, accum in ((4, 1), (1, 4), (2, 2)):
        cfg = small_config(tmp_path / f"{micro}x{accum}", train={"micro_batch": micro, "grad_accum": accum, "steps": 4})
        curves.append(Trainer(build_config(cfg)).fit()["losses"])
    for curve in curves[1:]:
        assert curve == pytest.approx(curves[0], rel=1e-5)


def test_outputs_and_metrics_schema(tmp_path):
    cfg = small_config(tmp_path, log={"tensorboard": True}, train={"steps": 3, "eval_every": 2})
    summary = Trainer(build_config(cfg)).fit()
    out = tmp_path / "run"
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key in REQUIRED_KEYS:
            assert key in r, key
        assert r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0 and r["skipped"] == 0
        assert r["loss_scale"] == 1.0 and r["lr"] > 0
    assert "val_loss" in records[1] and "val_loss" in records[2]
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["final"]["steps"] == 3 and on_disk["config"]["train"]["steps"] == 3
    assert on_disk["final"]["loss"] == pytest.approx(summary["final"]["loss"])
    assert any((out / "tensorboard").iterdir())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_training_lowers_the_loss(tmp_path, dtype):
    cfg = small_config(tmp_path, precision={"dtype": dtype}, train={"steps": 25, "micro_batch": 8, "warmup_steps": 2})
    losses = Trainer(build_config(cfg)).fit()["losses"]
    assert all(map(lambda x: x == x, losses))  # no NaN
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0]


def test_user_module_and_array_dataset(tmp_path):
    """The Python API trains a user's own module on a user's token array."""

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(64, 64)

        def forward(self, ids):
            return self.table(ids)

    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 8, (200, 1), generator=g)
    data = (base + torch.arange(17)) % 64  # a predictable sequence: next = current + 1
    cfg = small_config(tmp_path, train={"steps": 20, "lr": 0.1, "micro_batch": 8})
    summary = Trainer(build_config(cfg), model=Bigram(), dataset=data.numpy()).fit()
    assert summary["losses"][-1] < 0.7 * summary["losses"][0]
    assert summary["batch"]["seq_len"] == 16


BAD_INPUTS = [
    (["--precision", "fp17"], "precision.dtype"),
    (["--micro-batch", "2", "--grad-accum", "4", "--global-batch", "16"], "16 must equal --micro-batch x --grad-accum x data-parallel size = 2 x 4 x 1"),
    (["--lr", "-1"], "train.lr"),
    (["--lr", "0"], "train.lr"),
    (["--steps", "0"], "train.steps"),
    (["--steps", "-3"], "train.steps"),
    (["--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    (["--seq-len", "4096"], "max_seq_len"),
    (["--model", "gpt5"], "unknown model preset"),
    (["--set", "train.nope=1"], "train.nope"),
]


@pytest.mark.parametrize("flags,needle", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, flags, needle):
    out = tmp_path / "never"
    code = main(["train", "--out", str(out), "--no-progress", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()  # nothing half-written


def test_bad_files_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[train\nsteps = 3")
    bad_json = tmp_path / "ds.json"
    bad_json.write_text('{"train_batch_size": 8,, }')
    for flags, needle in (
        (["--data", str(empty)], str(empty)),
        (["--config", str(bad_toml)], "bad.toml"),
        (["--deepspeed", str(bad_json)], "ds.json"),
    ):
        out = tmp_path / "never"
        assert main(["train", "--out", str(out), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
        assert not out.exists()


def test_cli_end_to_end_subprocess(tmp_path):
    """The real console entry: exit status, files, and a falling loss."""
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "tenfold", "train", "--steps", "6", "--micro-batch", "4", "--out", str(out),
         "--precision", "fp32", *SMALL_FLAGS],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "summary" in proc.stdout
    records = read_metrics(out)
    assert len(records) == 6
    bad = subprocess.run([sys.executable, "-m", "tenfold", "train", "--precision", "fp17"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_the_validation_loss_is_the_mean_over_the_target_tokens_of_the_eval_batches(tmp_path):
    """Trainer.evaluate on prompt/completion rows, whose batches hold unequal numbers of targets:
    the summed token losses over all target tokens, not a mean of per-batch means nor a sum."""
    import torch.nn.functional as F

    from tenfold.data import iter_eval

    cfg = small_config(tmp_path, data={"path": "examples/sft_sample.jsonl", "max_bytes": None, "seq_len": 64,
                                       "val_fraction": 0.3}, train={"eval_batches": 3, "micro_batch": 2})
    t = Trainer(build_config(cfg))
    t.setup()
    batches = list(iter_eval(t.parts.data.val, 2, 3))
    counts = [int((b["labels"] != -100).sum()) for b in batches]
    assert len(batches) == 3 and len(set(counts)) > 1, counts
    with torch.no_grad():
        sums = [float(F.cross_entropy(t.model(b["input_ids"]).flatten(0, 1).float(), b["labels"].flatten(),
                                      ignore_index=-100, reduction="sum")) for b in batches]
    expected = sum(sums) / sum(counts)
    assert abs(sum(s / c for s, c in zip(sums, counts)) / 3 - expected) > 1e-3  # the naive mean would differ
    assert t.evaluate() == pytest.approx(expected, rel=1e-5)
