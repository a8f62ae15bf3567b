"""Hugging Face mixture-of-experts families through tenfold (CPU, gloo): tiny Mixtral, Qwen2-MoE and
Qwen3-MoE configs (tests/data/*-tiny, random init, vocab 256) planned with the built model's exact
parameter count, trained, recomputed, sharded by ZeRO-3 over two processes and exported to
safetensors that transformers loads back. Nothing is downloaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="Hugging Face tests need the hf extra: pip install 'tenfold[hf]'")
os.environ["HF_HUB_OFFLINE"] = "1"

from conftest import hf_cli as cli  # noqa: E402
from hf_runs import DATA, hf_config, logits, train  # noqa: E402
from tenfold import Trainer  # noqa: E402
from tenfold.errors import UserError  # noqa: E402

MIXTRAL = DATA / "mixtral-tiny" / "config.json"
FAMILIES = {"mixtral": MIXTRAL, "qwen2_moe": DATA / "qwen2-moe-tiny" / "config.json",
            "qwen3_moe": DATA / "qwen3-moe-tiny" / "config.json"}

pytestmark = pytest.mark.usefixtures("one_thread")


def _experts_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_planned_total_and_active_params_equal_the_built_model(family, capsys):
    from tenfold.cli import main
    from tenfold.models.adapter import adapt
    from tenfold.models.hf import build_hf_model
    from tenfold.models.hf_config import model_from_hf_config
    from tenfold.models.presets import active_param_count, expert_param_count

    model = build_hf_model(hf_config=str(FAMILIES[family]))
    assert model.config.model_type == family
    built = sum(p.numel() for p in model.parameters())
    assert main(["plan", "--hf-config", str(FAMILIES[family]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == built

    shape = model_from_hf_config(str(FAMILIES[family]))
    experts = _experts_modules(model)
    routed = sum(p.numel() for m in experts for p in m.parameters())
    assert len(experts) == model.config.num_hidden_layers and expert_param_count(shape) == routed
    # a token runs k of the E routed experts; everything else (router, shared expert) always
    e, k = shape.n_experts, model.config.num_experts_per_tok
    assert active_param_count(shape) == built - routed + routed * k // e

    a = adapt(model, seq_len=32)
    assert a.param_count == built and len(a.blocks) == model.config.num_hidden_layers
    assert a.block_class in model._no_split_modules and a.flops_formula == "6 x active params + 12 L s d"


def test_qwen_moe_dense_layers_and_gpt_with_hf_only_shapes_are_refused(tmp_path):
    from tenfold.models.gpt import GPT
    from tenfold.models.hf_config import model_from_hf_config

    d = json.loads(FAMILIES["qwen2_moe"].read_text())
    (tmp_path / "config.json").write_text(json.dumps({**d, "mlp_only_layers": [1]}))
    with pytest.raises(UserError, match=r"dense MLP layers.*qwen2_moe.*\[1\].*supported: every layer MoE"):
        model_from_hf_config(str(tmp_path / "config.json"))
    with pytest.raises(UserError, match=r"GPT does not build model.qkv_bias, model.d_shared, model.shared_expert_gate"):
        GPT(model_from_hf_config(str(FAMILIES["qwen2_moe"])))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_moe_learns(tmp_path, family):
    losses = train(tmp_path / family, FAMILIES[family], train={"steps": 30})[1]["losses"]
    assert len(losses) == 30 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < losses[0] - 0.5, losses  # byte-level: ~5.55 at the start


def test_output_router_logits_adds_the_balance_loss_gradient_at_its_coefficient():
    """With output_router_logits the gradient is that of transformers' own objective, the mean
    token loss + router_aux_loss_coef x aux_loss; the returned value stays the token loss sum."""
    import torch.nn.functional as F

    from tenfold.models.adapter import adapt
    from tenfold.models.hf import build_hf_model, load_hf_config

    config = load_hf_config(MIXTRAL)
    config.output_router_logits = True
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().train()
    assert type(model) is type(build_hf_model(hf_config=str(MIXTRAL)))
    seq = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": seq[:, :-1], "labels": seq[:, 1:]}
    n = batch["labels"].numel()
    ours = adapt(model, 16).loss_sum(model, batch)
    (ours / n).backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    out = model(input_ids=batch["input_ids"], use_cache=False)
    token_mean = F.cross_entropy(out.logits.flatten(0, 1).float(), batch["labels"].flatten())
    torch.testing.assert_close(ours / n, token_mean.detach(), rtol=1e-6, atol=1e-6)
    assert out.aux_loss is not None and config.router_aux_loss_coef > 0
    (token_mean + config.router_aux_loss_coef * out.aux_loss).backward()
    router = "model.layers.0.mlp.gate.weight"
    assert got[router].abs().sum() > 0
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-5, atol=1e-7, msg=k)
    model.zero_grad()
    token_mean2 = F.cross_entropy(model(input_ids=batch["input_ids"], use_cache=False).logits.flatten(0, 1).float(),
                                  batch["labels"].flatten())
    token_mean2.backward()
    assert not torch.allclose(model.get_parameter(router).grad, got[router], rtol=1e-3, atol=0)  # the aux term is there


@pytest.mark.parametrize("aux", [False, True], ids=["no-aux", "router-aux"])
def test_every_recompute_policy_matches_none(tmp_path, aux):
    config = MIXTRAL
    if aux:  # transformers' balance loss on: its router logits leave the recomputed blocks
        config = tmp_path / "config.json"
        config.write_text(json.dumps({**json.loads(MIXTRAL.read_text()), "output_router_logits": True, "router_aux_loss_coef": 0.5}))
    ref = train(tmp_path / "none", config, train={"steps": 3})[1]["losses"]
    for policy in ("full", "every:2", "selective:mlp", "op"):
        losses = train(tmp_path / policy.replace(":", "_"), config, train={"steps": 3}, recompute={"policy": policy})[1]["losses"]
        np.testing.assert_allclose(losses, ref, rtol=1e-6, err_msg=policy)
    if aux:  # and it changes the training
        plain = train(tmp_path / "plain", MIXTRAL, train={"steps": 3})[1]["losses"]
        assert plain[0] == ref[0] and abs(plain[-1] - ref[-1]) > 1e-4


# The published checkpoints' layout of the routed experts (one tensor per expert and
# projection): transformers fuses them into 3-D parameters as it loads, and splits them again in
# save_pretrained, so an exported folder has the layout the hub's Mixtral / Qwen MoE folders have.
PUBLISHED_EXPERT_KEY = {"mixtral": "model.layers.0.block_sparse_moe.experts.3.w1.weight",
                        "qwen2_moe": "model.layers.0.mlp.experts.3.gate_proj.weight",
                        "qwen3_moe": "model.layers.0.mlp.experts.3.gate_proj.weight"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_loads_strictly_in_transformers_with_the_trained_logits(tmp_path, family):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tenfold.cli import main

    trainer, summary = train(tmp_path / "run", FAMILIES[family], train={"steps": 3}, checkpoint={"every": 3})
    assert main(["export", str(tmp_path / "run"), "--dtype", "fp32", "--out", str(tmp_path / "exported")]) == 0
    for folder in (tmp_path / "exported", Path(summary["hf_export"])):  # tenfold export; the end-of-run folder
        keys = set()
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                keys |= set(st.keys())
        assert PUBLISHED_EXPERT_KEY[family] in keys
        loaded, info = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        assert sum(p.numel() for p in loaded.parameters()) == trainer.parts.adapter.param_count
        torch.testing.assert_close(logits(loaded), logits(trainer.model), rtol=1e-5, atol=1e-5)

    # --hf-pretrained: the exported folder starts a new run with the trained weights
    again = Trainer(hf_config(tmp_path / "again", FAMILIES[family], model={"hf_config": None, "hf_pretrained": str(folder)}))
    again.setup()
    torch.testing.assert_close(logits(again.model), logits(trainer.model), rtol=1e-5, atol=1e-5)


def test_expert_parallel_needs_an_hf_moe_family():
    from tenfold.config import build_config
    from tenfold.run import resolve_run

    resolve_run(build_config({"model": {"hf_config": str(MIXTRAL)}, "parallel": {"ep_degree": 2}}), 2)
    dense = build_config({"model": {"hf_config": str(DATA / "llama-tiny" / "config.json")}, "parallel": {"ep_degree": 2}})
    with pytest.raises(UserError, match=r"--ep\) 2 needs a mixture-of-experts model.*model_type mixtral, qwen2_moe or qwen3_moe"):
        resolve_run(dense, 2)


def test_trace_of_hf_expert_parallelism_is_refused():
    from tenfold.config import build_config
    from tenfold.engine.preview.trace import check_traceable
    from tenfold.run import resolve_run

    run = resolve_run(build_config({"model": {"hf_config": str(MIXTRAL)}, "parallel": {"ep_degree": 2, "zero_stage": 3},
                                    "precision": {"dtype": "bf16"}}), 2)
    with pytest.raises(UserError, match=r"--trace runs expert parallelism on tenfold's MoE blocks.*mixtral.*--ep 1"):
        check_traceable(run, 2)
    check_traceable(resolve_run(build_config({"model": {"hf_config": str(MIXTRAL)}, "parallel": {"zero_stage": 3},
                                              "precision": {"dtype": "bf16"}}), 2), 2)


def _two_ranks(out: Path, steps: int, *flags: str, config: Path = MIXTRAL) -> dict:
    r = cli("train", "--hf-config", str(config), "--nproc", "2", *flags,
            "--steps", str(steps), "--micro-batch", "2", "--precision", "fp32", "--seq-len", "32", "--lr", "3e-3",
            "--eval-every", "0", "--no-progress", "--out", str(out),
            "--set", "data.max_bytes=200000", "--set", "train.warmup_steps=0", "--set", "train.eval_batches=1",
            "--set", "log.tensorboard=false", "--set", "parallel.param_persistence_threshold=0", timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process reference of the two-rank runs: the same micro-batches (micro 2 x accum 2,
    rank r's rows being micro-batch r), fp32."""
    torch.set_num_threads(1)
    trainer, summary = train(tmp_path_factory.mktemp("one"), MIXTRAL, train={"steps": 5, "micro_batch": 2, "grad_accum": 2})
    return trainer, summary


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--zero", "3"), ("--ep", "2"), ("--ep", "2", "--zero", "3", "--ac", "full")],
                         ids=["zero3", "ep2", "ep2-zero3-full"])
def test_two_ranks_match_one_process(tmp_path, one_process, flags):
    """`tenfold train --hf-config mixtral-tiny --nproc 2` with ZeRO-3 (persistence threshold 0:
    every block, experts and router included, resharded after forward) or with the experts split
    over ep 2 (two per rank, tokens exchanged by all-to-all): every step's loss equals the one
    process's to 1e-6, and the export (each expert gathered once) has its logits."""
    from transformers import AutoModelForCausalLM

    trainer, ref = one_process
    two = _two_ranks(tmp_path / "two", 5, *flags)
    assert two["hardware"]["world_size"] == 2 and two["batch"]["global_batch"] == ref["batch"]["global_batch"]
    np.testing.assert_allclose(two["losses"], ref["losses"], rtol=1e-6)
    assert ref["losses"][-1] < ref["losses"][0]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "hf", local_files_only=True)
    torch.testing.assert_close(logits(loaded), logits(trainer.model), rtol=1e-5, atol=1e-5)
    if flags[:2] == ("--ep", "2"):  # the checkpoint holds each rank's two experts as one chunk of four
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(str(tmp_path / "two" / "checkpoints" / "step_5")).read_metadata().state_dict_metadata
        experts = meta["model.model.layers.0.mlp.experts.gate_up_proj"]
        assert experts.size[0] == 4 and sorted(c.offsets[0] for c in experts.chunks) == [0, 2]
        if "--zero" not in flags:  # attention stays whole on every rank (DDP)
            assert len(meta["model.model.layers.0.self_attn.q_proj.weight"].chunks) == 1


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_ep2_matches_one_process(tmp_path, family):
    """The Qwen families under ep 2: Qwen2-MoE's shared expert and its gate stay data-parallel
    beside the split routed experts; Qwen3-MoE's q/k norms likewise."""
    ref = train(tmp_path / "one", FAMILIES[family], train={"steps": 4, "micro_batch": 2, "grad_accum": 2})[1]
    two = _two_ranks(tmp_path / "two", 4, "--ep", "2", config=FAMILIES[family])
    np.testing.assert_allclose(two["losses"], ref["losses"], rtol=1e-6)
    meta_dir = tmp_path / "two" / "checkpoints" / "step_4"
    from torch.distributed.checkpoint import FileSystemReader

    experts = FileSystemReader(str(meta_dir)).read_metadata().state_dict_metadata["model.model.layers.1.mlp.experts.down_proj"]
    assert sorted(c.offsets[0] for c in experts.chunks) == [0, 2]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_ep2_checkpoint_resumes_on_one_process(tmp_path):
    """Saved at step 2 by two ranks holding two experts each, resumed by one process holding all
    four: step 3 gives the two-rank run's loss (DCP holds each expert once)."""
    two = _two_ranks(tmp_path / "two", 3, "--ep", "2", "--checkpoint-every", "2")
    resumed = train(tmp_path / "one", MIXTRAL, train={"steps": 3, "micro_batch": 2, "grad_accum": 2},
                    checkpoint={"resume": str(tmp_path / "two" / "checkpoints" / "step_2")})[1]
    np.testing.assert_allclose(resumed["losses"][-1], two["losses"][2], rtol=1e-6)
    assert two["losses"][2] != two["losses"][1]
