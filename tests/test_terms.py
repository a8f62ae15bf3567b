"""The words planner and engine share (tenfold.terms): the planner counts exactly the blocks the
engine recomputes, and both resolve a batch triplet and a schedule the same way."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from tenfold.config import build_config
from tenfold.errors import UserError
from tenfold.plan.flops import recomputed_layers
from tenfold.plan.memory import _block_recompute_bytes
from tenfold.run import resolve_run
from tenfold.techniques.recompute import apply_recompute
from tenfold.terms import parse_recompute, resolve_batch, virtual_stages_for

from conftest import planned

POLICIES = ["full", *(f"every:{n}" for n in range(1, 7)), *(f"segments:{k}" for k in range(1, 7)),
            "selective", "selective:mlp", "op", "none"]


class CountingBlock(nn.Module):
    """A block that counts how often its forward runs (a recomputed block runs twice)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.attn = nn.Module()
        self.attn.core = nn.Identity()
        self.mlp = nn.Identity()
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        return self.mlp(self.attn.core(torch.tanh(self.lin(h))))


class Stack(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): CountingBlock() for i in range(n)})

    def forward(self, h):
        for block in self.layers.values():
            h = block(h)
        return h


def engine_recomputed_blocks(policy: str, n_layers: int) -> list[int]:
    """The blocks whose forward the engine really runs twice in one forward + backward."""
    model = Stack(n_layers)
    apply_recompute(model, policy)
    model(torch.randn(3, 2, requires_grad=True)).sum().backward()
    calls = [b.calls for b in model.layers.values()]
    assert set(calls) <= {1, 2}, calls
    return [i for i, c in enumerate(calls) if c == 2]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("policy", POLICIES)
def test_planner_counts_the_blocks_the_engine_recomputes(policy):
    parsed = parse_recompute(policy)
    for n_layers in range(1, 49):
        engine = engine_recomputed_blocks(policy, n_layers)
        assert parsed.recomputed_blocks(n_layers) == engine, (policy, n_layers)
        # op reruns only the ops its policy does not save (priced by op_rerun_flops_per_token),
        # so no block counts as a whole second forward.
        whole = 0 if parsed.kind == "op" else len(engine)
        assert recomputed_layers(parsed, n_layers) == whole, (policy, n_layers)


def test_planner_memory_keeps_one_input_per_checkpointed_group():
    # every:4 on 6 layers: the engine wraps block 3 only, so 1 input kept + 5 full layers.
    kept, working = _block_recompute_bytes(parse_recompute("every:4"), 6, full=10.0, ckpt=1.0)
    assert kept == 1 * 1.0 + 5 * 10.0
    # segments:3 on 7 layers: groups [0,1,2], [3,4]; the last [5,6] runs normally.
    kept, working = _block_recompute_bytes(parse_recompute("segments:3"), 7, full=10.0, ckpt=1.0)
    assert kept == 2 * 1.0 + 2 * 10.0
    # recomputing group [0,1,2] while group [3,4]'s input is already freed: 1 input + 3 layers
    assert kept + working == max(kept, 1.0 + 3 * 10.0, 2.0 + 2 * 10.0)


@pytest.mark.parametrize("micro,accum,glob,dp,want", [
    (None, None, None, 1, (8, 1, 8)),
    (None, None, 64, 8, (8, 1, 64)),     # the global batch alone: micro-batch up to 8
    (None, None, 12, 1, (6, 2, 12)),     # ... the largest divisor of 12 up to 8
    (2, None, 16, 2, (2, 4, 16)),
    (None, 4, 16, 2, (2, 4, 16)),
    (2, 4, None, 2, (2, 4, 16)),
    (4, None, None, 3, (4, 1, 12)),
    (None, 2, None, 1, (8, 2, 16)),
])
def test_batch_triplet_rule(micro, accum, glob, dp, want):
    assert tuple(resolve_batch(micro, accum, glob, dp)) == want


@pytest.mark.parametrize("glob,dp,pp,rounds,want", [
    (1536, 64, 16, False, (1, 24, 1536)),  # GPT-3's batch on 64 dp ranks: 24 micro-batches feed 16 stages
    (1536, 64, 4, False, (6, 4, 1536)),    # 4 stages take a larger micro-batch
    (1536, 64, 16, True, (8, 3, 1536)),    # interleaved: no divisor up to 8 gives a multiple of 16: the plain rule
    (64, 2, 4, True, (8, 4, 64)),
    (48, 2, 4, True, (6, 4, 48)),          # 24 per rank: 8 would leave 3 micro-batches, 6 leaves 4
    (8, 2, 8, False, (4, 1, 8)),           # too few sequences for 8 stages: the plain rule, the check names it
])
def test_a_derived_micro_batch_feeds_the_pipeline(glob, dp, pp, rounds, want):
    assert tuple(resolve_batch(None, None, glob, dp, pp, rounds_of_pp=rounds)) == want


@pytest.mark.parametrize("args", [(2, 4, 16, 1), (3, None, 16, 1), (None, 3, 16, 2), (True, None, None, 1), (0, None, None, 1)])
def test_batch_triplet_refuses_what_does_not_add_up(args):
    with pytest.raises(UserError):
        resolve_batch(*args)


@pytest.mark.parametrize("train,gpus", [({"global_batch": 64}, 8), ({"micro_batch": 2, "global_batch": 24}, 4),
                                        ({"grad_accum": 4}, 2), ({}, 1)])
def test_planner_and_resolver_apply_the_same_triplet_rule(train, gpus):
    run = resolve_run(build_config({"train": train}), gpus)
    r = planned(1e9, gpus, **train)  # a run the planner builds without a config (tenfold plan --params)
    assert (r.micro_batch, r.grad_accum, r.global_batch) == tuple(run.batch)


def test_plan_cli_batch_matches_train(capsys):
    from tenfold.plan.cli import main

    assert main(["--model", "tiny", "--gpus", "8", "--global-batch", "64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    run = resolve_run(build_config({"train": {"global_batch": 64}}), 8)
    assert (plan["micro_batch"], plan["grad_accum"]) == (run.micro_batch, run.grad_accum) == (8, 1)


def test_virtual_stages_default_is_shared():
    assert virtual_stages_for("interleaved", None) == 2 == virtual_stages_for("zero-bubble", None)
    assert virtual_stages_for("1f1b", None) == 1
    cfg = build_config({"parallel": {"pp_degree": 2, "pp_schedule": "interleaved"}, "train": {"grad_accum": 4}})
    assert resolve_run(cfg, 2).virtual_stages == 2
    r = planned("tiny", 2, pp=2, pp_schedule="interleaved", grad_accum=4)
    assert r.virtual_stages == 2 and r.stage_layers == resolve_run(cfg, 2).stage_layers == (1, 2, 1, 0)
    with pytest.raises(UserError, match="needs an interleaved schedule"):
        virtual_stages_for("1f1b", 3)
