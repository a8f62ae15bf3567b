"""`tenfold export`: DCP checkpoint -> one safetensors file + model config JSON, round-tripped
into a fresh model (same logits), from one process and (in test_checkpoint_dist.py) from a
2-rank ZeRO-3 checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import plain_loop as t

pytestmark = pytest.mark.usefixtures("one_thread")
from tenfold import cli
from tenfold.config import TrainSection, build_config
from tenfold.engine.outputs import export
from tenfold.engine.loop.schedule import build_scheduler
from tenfold.models.gpt import GPT
from tenfold.models.presets import ModelConfig



def _trained(tmp_path, model_overrides: dict | None = None):
    run = t.make_run(noise=False)
    if model_overrides:
        cfg = build_config({"model": {**t.MODEL, **model_overrides}})
        torch.manual_seed(0)
        run.model, run.cfg = GPT(cfg.model_config_resolved()), cfg
        run.optimizer = torch.optim.AdamW(run.model.parameters(), lr=1e-2)
        run.scheduler = build_scheduler(run.optimizer, TrainSection(steps=t.STEPS), t.STEPS)
    t.train(run, 3, t.manager(tmp_path, run))
    return run


def _model_from_export(st_path, cfg_path, dtype=torch.float32) -> GPT:
    info = json.loads(cfg_path.read_text())
    fields = {k: v for k, v in info["model"].items() if k != "name"}
    model = GPT(ModelConfig(**fields)).to(dtype)
    model.load_state_dict(load_file(str(st_path)), strict=True)
    return model


def test_export_fp32_round_trip_same_logits(tmp_path):
    run = _trained(tmp_path)
    out = tmp_path / "export" / "model.safetensors"
    summary = export.export_checkpoint(tmp_path, out, "fp32")
    assert summary["step"] == 3 and out.is_file()
    cfg_path = tmp_path / "export" / "model.config.json"
    info = json.loads(cfg_path.read_text())
    assert info["dtype"] == "fp32" and info["model"]["d_model"] == 32 and info["step"] == 3
    with safe_open(str(out), "pt") as f:
        assert json.loads(f.metadata()["tenfold"])["step"] == 3
        assert not any(k.startswith(("model.", "optim")) for k in f.keys())  # bare names, no optimizer
    ids = torch.randint(0, t.MC.vocab_size, (2, t.SEQ))
    with torch.no_grad():
        assert torch.equal(_model_from_export(out, cfg_path)(ids), run.model(ids))


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_export_16bit_is_the_cast_weights(tmp_path, dtype, torch_dtype):
    run = _trained(tmp_path)
    out = tmp_path / f"m_{dtype}.safetensors"
    export.export_checkpoint(tmp_path / "checkpoints" / "step_3", out, dtype)
    weights = load_file(str(out))
    for name, p in run.model.state_dict().items():
        assert weights[name].dtype == torch_dtype
        assert torch.equal(weights[name], p.to(torch_dtype))
    model = _model_from_export(out, tmp_path / f"m_{dtype}.config.json", torch_dtype)
    ids = torch.randint(0, t.MC.vocab_size, (2, t.SEQ))
    with torch.no_grad():
        ref = run.model.to(torch_dtype)(ids)
        assert torch.equal(model(ids), ref)


def test_export_tied_embeddings(tmp_path):
    run = _trained(tmp_path, {"tie_embeddings": True})
    out = tmp_path / "tied.safetensors"
    export.export_checkpoint(tmp_path, out, "fp32")
    assert "output.weight" not in load_file(str(out))  # the tied matrix once, as tok_emb.weight
    model = _model_from_export(out, tmp_path / "tied.config.json")  # strict: the head is taken from it
    assert model.output.weight is model.tok_emb.weight
    ids = torch.randint(0, t.MC.vocab_size, (2, t.SEQ))
    with torch.no_grad():
        assert torch.equal(model(ids), run.model(ids))


def test_tied_copies_that_differ_are_a_damaged_checkpoint(tmp_path):
    """A pipelined tied model checkpoints two copies (first and last stage), which training keeps
    equal: copies that differ are not exported as either."""
    from tenfold.engine.outputs.checkpoint.layout import CheckpointError

    emb = torch.ones(4, 2)
    weights = {"tok_emb.weight": emb, "output.weight": emb.clone(), "norm.weight": torch.ones(2)}
    assert set(export.one_tied_weight(dict(weights), True, "tenfold", tmp_path)) == {"tok_emb.weight", "norm.weight"}
    assert set(export.one_tied_weight(dict(weights), False, "tenfold", tmp_path)) == set(weights)
    weights["output.weight"][0, 0] = 2.0
    with pytest.raises(CheckpointError, match=r"the tied weights tok_emb.weight and output.weight differ \(max 1\)"):
        export.one_tied_weight(weights, True, "tenfold", tmp_path)


def test_cli_export_and_bad_input(tmp_path, capsys):
    _trained(tmp_path)
    assert cli.main(["export", str(tmp_path), "--dtype", "bf16"]) == 0
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "model.config.json").is_file()
    assert "step 3" in capsys.readouterr().out
    shard = next((tmp_path / "checkpoints" / "step_3").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    assert cli.main(["export", str(tmp_path), "--out", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"truncated or altered checkpoint file {shard}" in err
    assert not (tmp_path / "x.safetensors").exists()
    assert cli.main(["export", str(tmp_path / "missing")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_an_fp16_runs_own_export_is_fp16(small_cfg):
    """checkpoint.export_16bit writes the run's own 16-bit dtype: fp16 stays fp16."""
    from safetensors import safe_open

    from tenfold.engine.loop.trainer import Trainer

    cfg = small_cfg(precision={"dtype": "fp16"}, checkpoint={"export_16bit": True}, train={"steps": 1})
    summary = Trainer(cfg).fit()
    with safe_open(summary["export"], "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"F16"}, dtypes


def test_export_writes_only_what_out_names_and_replaces_nothing_without_overwrite(tmp_path, capsys):
    """Exported into another run's folder: NAME.safetensors, NAME.config.json, NAME.tokenizer/
    and nothing else (that run's own tokenizer/ untouched); a second export to the same --out is
    refused before any work, and --overwrite replaces it."""
    source, other = tmp_path / "a", tmp_path / "b"
    _trained(source)
    (source / "tokenizer").mkdir()
    (source / "tokenizer" / "tokenizer.json").write_text('{"tokenizer": "a"}')
    (other / "tokenizer").mkdir(parents=True)
    (other / "tokenizer" / "tokenizer.json").write_text('{"tokenizer": "b"}')
    before = set(other.iterdir())
    out = other / "x.safetensors"
    assert cli.main(["export", str(source), "--out", str(out)]) == 0
    assert set(other.iterdir()) - before == {out, other / "x.config.json", other / "x.tokenizer"}
    assert (other / "x.tokenizer" / "tokenizer.json").read_text() == '{"tokenizer": "a"}'
    assert (other / "tokenizer" / "tokenizer.json").read_text() == '{"tokenizer": "b"}'
    assert f"tokenizer {other / 'x.tokenizer'}" in capsys.readouterr().out
    stamp = out.stat().st_mtime_ns
    assert cli.main(["export", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already exist; pass --overwrite" in err and str(out) in err, err
    assert out.stat().st_mtime_ns == stamp
    (other / "x.tokenizer" / "stale.txt").write_text("from another tokenizer")
    assert cli.main(["export", str(source), "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in (other / "x.tokenizer").iterdir()) == ["tokenizer.json"]
    # into the run's own folder: its tokenizer/ is beside the weights already, no copy
    assert cli.main(["export", str(source)]) == 0
    assert not (source / "model.tokenizer").exists() and f"tokenizer {source / 'tokenizer'}" in capsys.readouterr().out
