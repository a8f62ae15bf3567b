"""The model adapter (tenfold.models.adapter): blocks, FLOPs, loss and clear errors for any
model, and a user's own module through the Python API on 2 gloo ranks (ZeRO-2 + recompute).

Run as a script under torchrun, this file is the 2-rank worker of `test_user_module_two_ranks`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from tenfold.errors import UserError
from tenfold.engine.parallelize import check_techniques
from tenfold.models.adapter import adapt, find_blocks, logits_of
from tenfold.models.gpt import GPT
from tenfold.models.presets import ModelConfig, flops_per_token, param_count

VOCAB, SEQ = 64, 16


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- a user's model


class MyBlock(nn.Module):
    """The user's own block class (residual MLP; no attention)."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class MyLM(nn.Module):
    def __init__(self, n_blocks: int = 4, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.stack = nn.ModuleList(MyBlock(d) for _ in range(n_blocks))
        self.extras = nn.ModuleList([nn.Linear(d, d)])  # a smaller list of one class: not the blocks
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.stack:
            h = b(h)
        return self.head(self.extras[0](h))


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        return self.head(self.emb(ids))


def token_rows(n: int = 96, seed: int = 0) -> np.ndarray:
    """Packed rows (n, SEQ + 1) with structure to learn: each row counts up modulo VOCAB."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, size=(n, 1))
    return ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int64)


def user_loss_fn(model, batch):
    from tenfold.models.loss import token_loss_sum

    logits = model(batch["input_ids"])
    return token_loss_sum(logits, batch["labels"]), int((batch["labels"] != -100).sum())


def api_config(out: Path, blocks: str | None = None, **parallel) -> dict:
    return {
        "model": {"blocks": blocks},
        "train": {"steps": 4, "micro_batch": 4, "global_batch": 8, "lr": 1e-2, "warmup_steps": 0,
                  "eval_every": 0, "eval_batches": 1},
        "precision": {"dtype": "fp32"},
        "recompute": {"policy": "every:2"},
        "parallel": {"zero_stage": 2, **parallel},
        "data": {"val_fraction": 0.1},
        "log": {"out": str(out), "progress": False, "tensorboard": False},
    }


# --------------------------------------------------------------------------- unit tests


def test_gpt_goes_through_the_same_adapter():
    cfg = ModelConfig(n_layers=3, d_model=32, n_heads=4, vocab_size=VOCAB, max_seq_len=32, d_ff=64)
    model = GPT(cfg)
    a = adapt(model, seq_len=32)
    assert a.kind == "tenfold"
    assert a.blocks == list(model.layers.values())
    assert find_blocks(model) == list(model.layers.values())  # auto-detection finds the same
    assert a.embedding is model.tok_emb and a.output is model.output
    assert a.param_count == param_count(cfg)
    assert a.flops_per_token == flops_per_token(cfg, 32)  # the planner's formula, exactly


def test_blocks_found_automatically_and_by_name():
    model = MyLM()
    assert find_blocks(model) == list(model.stack)  # the largest list of one class
    assert find_blocks(model, "MyBlock") == list(model.stack)
    assert find_blocks(model, "Linear")[0] is model.stack[0].mlp[0]
    with pytest.raises(UserError, match=r"'Nope'.*MyBlock"):
        find_blocks(model, "Nope")
    with pytest.raises(UserError, match="nested"):
        find_blocks(_Nested(), "Inner")
    a = adapt(model, SEQ)
    assert a.kind == "user" and a.block_class == "MyBlock" and len(a.blocks) == 4
    # 6 x (block params + output projection), no attention term for a user's module
    n_blocks = sum(p.numel() for b in model.stack for p in b.parameters())
    assert a.flops_per_token == 6.0 * (n_blocks + model.head.weight.numel())


class Inner(nn.Module):
    def __init__(self, nest: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.child = Inner(False) if nest else None


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Inner(True)


def test_logits_of_accepts_tensor_object_and_tuple():
    t = torch.zeros(1, 2, 3)
    assert logits_of(t) is t
    assert logits_of((t, None)) is t
    assert logits_of(type("Out", (), {"logits": t})()) is t
    with pytest.raises(UserError, match="loss_fn"):
        logits_of({"x": 1})


def _run(**sections):
    """The resolved run of a config (on as many processes as its pipeline has stages)."""
    from tenfold.config import build_config
    from tenfold.run import resolve_run

    cfg = build_config(sections)
    return resolve_run(cfg, cfg.parallel.pp_degree, check=False)


@pytest.mark.parametrize("policy", ["full", "every:2", "segments:2", "selective:mlp"])
def test_recompute_needs_blocks(policy):
    a = adapt(NoBlocks(), SEQ)
    assert a.blocks == []
    with pytest.raises(UserError, match=r"--blocks ClassName"):
        check_techniques(a, _run(recompute={"policy": policy}))


def test_zero3_needs_blocks_and_pipeline_needs_tenfold_gpt():
    a = adapt(NoBlocks(), SEQ)
    with pytest.raises(UserError, match=r"zero_stage 3.*--blocks"):
        check_techniques(a, _run(parallel={"zero_stage": 3}))
    check_techniques(a, _run(parallel={"zero_stage": 2}))  # one FSDP2 unit (the root) is fine
    with pytest.raises(UserError, match=r"pp_degree 2.*cannot be split"):
        check_techniques(adapt(MyLM(), SEQ), _run(parallel={"pp_degree": 2}))


def test_selective_attention_on_a_block_without_attention_core():
    a = adapt(MyLM(), SEQ)
    check_techniques(a, _run(recompute={"policy": "selective:mlp"}))  # MyBlock.mlp exists
    with pytest.raises(UserError, match=r"selective:attention.*Possible for this model: selective:mlp, full"):
        check_techniques(a, _run(recompute={"policy": "selective"}))


def test_trainer_refuses_full_recompute_without_blocks(tmp_path):
    from tenfold import Trainer

    cfg = api_config(tmp_path / "run")
    cfg["recompute"] = {"policy": "full"}
    with pytest.raises(UserError, match="recompute.policy 'full'"):
        Trainer(cfg, model=NoBlocks(), dataset=token_rows()).setup()


def test_recompute_every_2_on_a_user_module_matches_no_recompute(tmp_path):
    """Single process: the user's blocks are found, every second one is recomputed, and the
    loss curve is unchanged (recompute must not change the math)."""
    from tenfold import Trainer
    from tenfold.techniques.recompute import describe

    losses = {}
    for policy in ("none", "every:2"):
        cfg = api_config(tmp_path / policy)
        cfg["recompute"] = {"policy": policy}
        torch.manual_seed(0)
        trainer = Trainer(cfg, model=MyLM(), dataset=token_rows(), loss_fn=user_loss_fn)
        losses[policy] = trainer.fit()["losses"]
        if policy != "none":
            assert sorted(describe(trainer.model)) == ["stack.1", "stack.3"]
    assert losses["none"][-1] < losses["none"][0]
    np.testing.assert_allclose(losses["every:2"], losses["none"], rtol=1e-6)


# --------------------------------------------------------------------------- 2 ranks


def _run_worker(out: Path) -> None:
    """One rank of the 2-rank run: MyLM through tenfold.Trainer, ZeRO-2, recompute every:2."""
    from torch.distributed.fsdp import FSDPModule

    from tenfold import Trainer
    from tenfold.techniques.recompute import describe

    torch.manual_seed(0)
    # The block class named (config model.blocks); the single-process tests find it automatically.
    trainer = Trainer(api_config(out, blocks="MyBlock"), model=MyLM(), dataset=token_rows(), loss_fn=user_loss_fn)
    summary = trainer.fit()
    facts = {
        "losses": summary["losses"],
        "fsdp_blocks": [isinstance(b, FSDPModule) for b in trainer.parts.adapter.blocks],
        "fsdp_root": isinstance(trainer.model, FSDPModule),
        "recomputed": sorted(describe(trainer.model)),
        "world": trainer.dist.world_size,
    }
    (out / f"facts.{trainer.dist.rank}.json").write_text(json.dumps(facts))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_user_module_two_ranks_zero2_recompute_matches_one_process(tmp_path):
    from tenfold import Trainer

    torch.manual_seed(0)
    ref = Trainer(api_config(tmp_path / "one"), model=MyLM(), dataset=token_rows(), loss_fn=user_loss_fn).fit()

    out = tmp_path / "two"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         __file__, str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    facts = [json.loads((out / f"facts.{r}.json").read_text()) for r in (0, 1)]
    for f in facts:
        assert f["world"] == 2
        assert f["fsdp_blocks"] == [True] * 4 and f["fsdp_root"]  # one FSDP2 unit per user block
        assert f["recomputed"] == ["stack.1", "stack.3"]
        np.testing.assert_allclose(f["losses"], ref["losses"], rtol=1e-4)
    assert ref["losses"][-1] < ref["losses"][0]


if __name__ == "__main__":  # the torchrun worker
    _run_worker(Path(sys.argv[1]))
