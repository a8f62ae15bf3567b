"""Hugging Face causal LMs through tenfold (CPU, gloo): a tiny Llama and a tiny GPT-2 built from
config.json (tests/data/*-tiny, vocab 256 for the byte-level default corpus), trained with
every technique that applies, compared with the plain single-process run, exported to the
save_pretrained layout and loaded back with transformers. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="Hugging Face tests need the hf extra: pip install 'tenfold[hf]'")
os.environ["HF_HUB_OFFLINE"] = "1"  # belt and braces: tenfold never asks the hub anyway

from transformers import AutoModelForCausalLM  # noqa: E402

from conftest import hf_cli as cli  # noqa: E402
from hf_runs import GPT2, LLAMA, hf_config, logits, train  # noqa: E402
from tenfold import Trainer  # noqa: E402
from tenfold.errors import UserError  # noqa: E402

CONFIGS = {"llama": LLAMA, "gpt2": GPT2}


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- shape and planner


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_plan_hf_config_param_count_equals_built_model(name, capsys):
    from tenfold.cli import main
    from tenfold.models.adapter import adapt
    from tenfold.models.hf import build_hf_model

    model = build_hf_model(hf_config=str(CONFIGS[name]))
    built = sum(p.numel() for p in model.parameters())
    assert main(["plan", "--hf-config", str(CONFIGS[name]), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["params"]
    assert planned == built
    a = adapt(model, seq_len=32)
    assert a.kind == "hf" and a.param_count == built
    assert a.block_class == {"llama": "LlamaDecoderLayer", "gpt2": "GPT2Block"}[name]
    assert a.block_class in model._no_split_modules  # HF's own name for its blocks agrees
    assert len(a.blocks) == model.config.num_hidden_layers
    assert a.output is model.get_output_embeddings()


def test_adapter_loss_is_the_token_sum_on_already_shifted_labels():
    """tenfold's labels are shifted already; HF's own loss (labels=input_ids) shifts inside.
    Both must give the same mean on the same next-token targets: the adapter does not shift twice."""
    from tenfold.models.adapter import adapt
    from tenfold.models.hf import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model(hf_config=str(LLAMA))
    seq = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": seq[:, :-1], "labels": seq[:, 1:]}
    ours = adapt(model, 16).loss_sum(model, batch) / batch["labels"].numel()
    theirs = model(input_ids=seq, labels=seq, use_cache=False).loss  # HF: shift inside, mean
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- techniques, one process


def test_every_recompute_policy_matches_none_and_selective_attention_is_refused(tmp_path):
    ref = train(tmp_path / "none", LLAMA, train={"steps": 2})[1]["losses"]
    for policy in ("full", "every:2", "segments:2", "selective:mlp", "op"):
        losses = train(tmp_path / policy.replace(":", "_"), LLAMA, train={"steps": 2}, recompute={"policy": policy})[1]["losses"]
        np.testing.assert_allclose(losses, ref, rtol=1e-6, err_msg=policy)
    # refused when the run is resolved, by the engine's capability table (tenfold.capabilities)
    with pytest.raises(UserError, match=r"selective:attention.*Hugging Face model's blocks.*use selective:mlp"):
        Trainer(hf_config(tmp_path / "sel", LLAMA, recompute={"policy": "selective"})).setup()


def test_accumulation_equals_one_big_batch(tmp_path):
    big = train(tmp_path / "big", GPT2, train={"steps": 3, "micro_batch": 4, "grad_accum": 1})[1]["losses"]
    acc = train(tmp_path / "acc", GPT2, train={"steps": 3, "micro_batch": 2, "grad_accum": 2})[1]["losses"]
    np.testing.assert_allclose(acc, big, rtol=1e-5)


@pytest.mark.parametrize("dtype,name", [("bf16", "llama"), ("fp16", "gpt2")])
def test_mixed_precision_trains(tmp_path, dtype, name):
    steps = 6 if dtype == "bf16" else 3
    _, summary = train(tmp_path / dtype, CONFIGS[name], train={"steps": steps, "grad_accum": 2, "micro_batch": 2, "lr": 1e-2},
                       precision={"dtype": dtype}, recompute={"policy": "full"})
    losses = summary["losses"]
    assert len(losses) == steps and all(np.isfinite(losses))
    if dtype == "bf16":
        assert losses[-1] < losses[0] - 0.1  # it learns (byte-level: ~5.5 -> below 5.4)


def test_pipeline_and_unknown_blocks_are_user_errors(tmp_path):
    from tenfold.config import build_config
    from tenfold.engine.parallel.parallelize import check_techniques
    from tenfold.models.adapter import adapt
    from tenfold.models.hf import build_hf_model
    from tenfold.run import resolve_run

    two_stages = resolve_run(build_config({"parallel": {"pp_degree": 2}}), 2, check=False)
    check_techniques(adapt(build_hf_model(hf_config=str(LLAMA)), 32), two_stages)
    a = adapt(build_hf_model(hf_config=str(GPT2)), 32)  # not of the Llama layout the split cuts
    with pytest.raises(UserError, match=r"pp_degree 2.*model_types llama, mistral, qwen2.*'gpt2' cannot be split"):
        check_techniques(a, two_stages)
    with pytest.raises(UserError, match=r"'Nope'.*LlamaDecoderLayer"):
        Trainer(hf_config(tmp_path / "b", LLAMA, model={"blocks": "Nope"})).setup()
    with pytest.raises(UserError, match=r"model.n_layers cannot be combined with model.hf_config"):
        build_config({"model": {"hf_config": str(LLAMA), "n_layers": 2}})


def test_cli_bad_hf_input_exits_2(tmp_path):
    out = ("--out", str(tmp_path / "run"))  # not the default runs/tenfold, which `make demo` fills
    r = cli("train", "--hf-config", str(tmp_path / "missing.json"), "--steps", "1", "--no-progress", *out)
    assert r.returncode == 2 and "--hf-config" in r.stderr and "missing.json" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(LLAMA.read_text())
    r = cli("train", "--hf-pretrained", str(tmp_path / "empty"), "--steps", "1", "--no-progress", *out)
    assert r.returncode == 2 and "no *.safetensors" in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- export and reload


def test_export_loads_in_transformers_with_the_same_logits_and_resumes_as_pretrained(tmp_path):
    trainer, summary = train(tmp_path / "run", GPT2, train={"steps": 3})
    folder = Path(summary["hf_export"])
    assert {"config.json", "model.safetensors"} <= {p.name for p in folder.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert loaded.config.architectures == ["GPT2LMHeadModel"]
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied
    torch.testing.assert_close(logits(loaded), logits(trainer.model), rtol=0, atol=0)

    # --hf-pretrained: the exported folder is the start of a new run, weights and all
    again = Trainer(hf_config(tmp_path / "again", GPT2, model={"hf_config": None, "hf_pretrained": str(folder)}))
    again.setup()
    torch.testing.assert_close(logits(again.model), logits(loaded), rtol=0, atol=0)


# --------------------------------------------------------------------------- 2 ranks


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_two_ranks_zero3_full_recompute_match_one_process(tmp_path, name):
    """`tenfold train --hf-config ... --nproc 2 --zero 3 --ac full`
    gives the single-process loss curve (fp32, rel 1e-4) and its export loads in transformers
    with the single-process model's logits. persistence threshold 0: every block is really
    resharded after forward and re-gathered inside the recomputed forward."""
    steps = 5
    one, ref = train(tmp_path / "one", CONFIGS[name], train={"steps": steps, "micro_batch": 4})
    out = tmp_path / "two"
    r = cli("train", "--hf-config", str(CONFIGS[name]), "--nproc", "2", "--zero", "3", "--ac", "full",
            "--steps", str(steps), "--micro-batch", "2", "--precision", "fp32", "--seq-len", "32", "--lr", "3e-3",
            "--eval-every", "0", "--no-progress", "--out", str(out),
            "--set", "data.max_bytes=200000", "--set", "train.warmup_steps=0", "--set", "train.eval_batches=1",
            "--set", "log.tensorboard=false", "--set", "parallel.param_persistence_threshold=0")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    two = json.loads((out / "summary.json").read_text())
    assert two["hardware"]["world_size"] == 2 and two["batch"]["global_batch"] == ref["batch"]["global_batch"]
    np.testing.assert_allclose(two["losses"], ref["losses"], rtol=1e-4)
    assert ref["losses"][-1] < ref["losses"][0]

    loaded = AutoModelForCausalLM.from_pretrained(out / "hf", local_files_only=True)
    torch.testing.assert_close(logits(loaded), logits(one.model), rtol=1e-3, atol=1e-4)


# --------------------------------------------------------------------------- checkpoints


def test_checkpoint_resume_and_tenfold_export_of_an_hf_run(tmp_path):
    """An HF run goes through the DCP checkpoint manager like tenfold's GPT: a checkpoint
    restores the exact weights into a fresh trainer, and `tenfold export` writes it as a
    save_pretrained folder (bf16 here) that transformers loads with the trained logits."""
    from tenfold.cli import main
    from tenfold.engine.outputs.checkpoint import CheckpointManager
    from tenfold.engine.loop.fit import checkpoint_states

    trainer, _ = train(tmp_path / "run", LLAMA, train={"steps": 2})
    manager = CheckpointManager(tmp_path / "run", checkpoint_states(trainer.parts, trainer.state), config=trainer.cfg)
    saved = manager.save(2, wait=True)
    manager.close()

    fresh = Trainer(hf_config(tmp_path / "run2", LLAMA))  # untrained: the initial weights
    fresh.setup()
    assert not torch.equal(logits(fresh.model), logits(trainer.model))
    CheckpointManager(tmp_path / "run2", checkpoint_states(fresh.parts, fresh.state), config=fresh.cfg).load(Path(saved.path))
    torch.testing.assert_close(logits(fresh.model), logits(trainer.model), rtol=0, atol=0)

    assert main(["export", str(tmp_path / "run"), "--dtype", "bf16", "--out", str(tmp_path / "exported")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True)
    assert loaded.dtype == torch.bfloat16 and loaded.config.architectures == ["LlamaForCausalLM"]
    torch.testing.assert_close(logits(loaded).float(), logits(trainer.model), rtol=0.05, atol=0.05)


def test_resumed_hf_run_equals_uninterrupted_and_export_16bit_writes_a_folder(tmp_path):
    full = train(tmp_path / "full", GPT2, checkpoint={"every": 2, "export_16bit": True})[1]
    assert (tmp_path / "full" / "model" / "config.json").is_file()  # export_16bit: OUT/model/ (bf16)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "model", local_files_only=True).dtype == torch.bfloat16
    resumed = train(tmp_path / "resumed", GPT2,
                    checkpoint={"resume": str(tmp_path / "full" / "checkpoints" / "step_2")})[1]
    np.testing.assert_allclose(resumed["losses"][-2:], full["losses"][-2:], rtol=1e-6)


def test_an_hf_model_object_through_the_python_api(tmp_path):
    """`Trainer(config, model=<a transformers model>)`: recognised as HF (loss from .logits,
    blocks = decoder layers), recomputed and exported like --hf-config."""
    from tenfold.models.hf import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model(hf_config=str(LLAMA))
    cfg = hf_config(tmp_path / "api", LLAMA, train={"steps": 2}, recompute={"policy": "every:2"})
    del cfg["model"]
    trainer = Trainer(cfg, model=model)
    summary = trainer.fit()
    assert trainer.parts.adapter.kind == "hf" and len(trainer.parts.adapter.blocks) == 3
    assert summary["model"]["name"] == "LlamaForCausalLM" and all(np.isfinite(summary["losses"]))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "api" / "hf", local_files_only=True)
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)
