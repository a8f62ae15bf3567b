"""Activation recompute: policy grammar, names unchanged, same loss/gradients as no recompute,
and that recompute really recomputes (backward FLOPs)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
import torch.utils.checkpoint

from tenfold.errors import UserError
from tenfold.models.gpt import GPT
from tenfold.models.presets import get_preset
from tenfold.techniques.recompute import apply_recompute, check_supported, describe
from tenfold.terms import RecomputePolicy, split_segments
from tenfold.terms import parse_recompute as parse_policy

POLICIES = ["full", "every:2", "segments:2", "segments:3", "selective", "selective:attention", "selective:mlp", "op"]
DISTINCT = ["full", "every:2", "segments:2", "selective:attention", "selective:mlp", "op"]
# tiny's block structure, shrunk so that each test takes a fraction of a second.
SHAPE = dict(n_layers=4, d_model=32, n_heads=2, d_ff=96, max_seq_len=32)



pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(get_preset("tiny").with_overrides(**{**SHAPE, **overrides}))


def batches(n: int, b: int = 2, s: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (b, s + 1), generator=g) for _ in range(n)]


# --------------------------------------------------------------------------- grammar


@pytest.mark.parametrize("text, expected", [
    ("none", RecomputePolicy("none")),
    ("full", RecomputePolicy("full")),
    (" Full ", RecomputePolicy("full")),
    ("every:3", RecomputePolicy("every", n=3)),
    ("segments:8", RecomputePolicy("segments", n=8)),
    ("selective", RecomputePolicy("selective", target="attention")),
    ("selective:attention", RecomputePolicy("selective", target="attention")),
    ("selective:mlp", RecomputePolicy("selective", target="mlp")),
    ("op", RecomputePolicy("op")),
    (" OP ", RecomputePolicy("op")),
    ("offload", RecomputePolicy("offload")),
])
def test_parse_policy_accepts_every_form(text, expected):
    assert parse_policy(text) == expected
    assert parse_policy(str(expected)) == expected  # the canonical text round-trips


@pytest.mark.parametrize("text", ["every:0", "segments:x", "every:", "every:-1", "segments:2.5", "selective:ffn", "bogus", "", "full:2",
                                  "op:2", "selective:op"])
def test_parse_policy_rejects_malformed(text):
    with pytest.raises(UserError) as e:
        parse_policy(text)
    msg = str(e.value)
    assert repr(text) in msg and "every:N" in msg and "segments:K" in msg and "selective:mlp" in msg and " op," in msg


def test_checkpointed_blocks_semantics():
    # full: every block alone; every:N: one in N (torchtitan's layer SAC counts 1..L)
    assert RecomputePolicy("full").checkpointed_blocks(3) == [[0], [1], [2]]
    assert RecomputePolicy("every", n=2).checkpointed_blocks(5) == [[1], [3]]
    assert RecomputePolicy("every", n=1).checkpointed_blocks(2) == [[0], [1]]
    # segments:K as checkpoint_sequential: K runs of consecutive blocks, last one not checkpointed
    assert split_segments(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert RecomputePolicy("segments", n=2).checkpointed_blocks(4) == [[0, 1]]
    assert RecomputePolicy("segments", n=8).checkpointed_blocks(4) == [[0], [1], [2]]
    assert RecomputePolicy("segments", n=1).checkpointed_blocks(4) == []
    # a count the policy does not divide (the memory test's 6 layers)
    assert RecomputePolicy("segments", n=4).checkpointed_blocks(6) == [[0, 1], [2, 3], [4]]
    assert RecomputePolicy("every", n=4).checkpointed_blocks(6) == [[3]]
    assert RecomputePolicy("none").checkpointed_blocks(4) == []


# --------------------------------------------------------------------------- application


@pytest.mark.parametrize("policy", POLICIES)
def test_parameter_names_and_state_dict_unchanged(policy):
    model = make_model()
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    apply_recompute(model, policy)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == names
    assert describe(model), "no module was marked as recomputed"
    clean = make_model(seed=3)
    clean.load_state_dict(model.state_dict())  # checkpoints stay portable both ways
    model.load_state_dict(clean.state_dict())


def test_applied_where_the_policy_says():
    m = make_model()
    apply_recompute(m, "every:2")
    assert set(describe(m)) == {"layers.1", "layers.3"}
    m = make_model()
    apply_recompute(m, "selective:mlp")
    assert {k for k in describe(m) if k.endswith("mlp")} == {f"layers.{i}.mlp" for i in range(4)}
    m = make_model()
    apply_recompute(m, "op")
    assert describe(m) == {f"layers.{i}": "op" for i in range(4)}
    m = make_model()
    apply_recompute(m, "none")
    assert describe(m) == {}


def test_applying_twice_is_refused():
    m = make_model()
    apply_recompute(m, "full")
    with pytest.raises(UserError, match="already applied"):
        apply_recompute(m, "every:2")


def test_model_without_blocks_needs_blocks_argument():
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(UserError, match="blocks"):
        apply_recompute(nn.ModuleDict({"a": seq}), "full")
    ref = copy.deepcopy(seq)
    apply_recompute(seq, "full", blocks=list(seq))  # explicit blocks: any module
    x = torch.randn(3, 8, requires_grad=True)
    seq(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    ref(x2).square().sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_offload_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: offload is allowed here")
    with pytest.raises(UserError, match="offload.*CUDA"):
        apply_recompute(make_model(), "offload")
    with pytest.raises(UserError, match="CUDA"):
        check_supported(parse_policy("offload"), "cpu")


# --------------------------------------------------------------------------- equivalence


def train(model: GPT, steps: list[list[torch.Tensor]], autocast: torch.dtype | None = None):
    """AdamW steps, each over its micro-batches (token-summed loss / tokens of the step).
    Returns per-step losses and the gradients of the last step (before the update)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], {}
    for micro in steps:
        tokens = sum(mb[:, 1:].numel() for mb in micro)
        total = 0.0
        for mb in micro:
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                logits = model(mb[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), mb[:, 1:].flatten(), reduction="sum") / tokens
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def assert_close_rel(a: dict, b: dict, rel: float):
    for name in a:
        err = (a[name] - b[name]).abs().max() / b[name].abs().max().clamp_min(1e-30)
        assert err <= rel, f"{name}: relative gradient difference {err:.2e} > {rel:.0e}"


@functools.lru_cache(maxsize=None)
def reference_run(accum: int, autocast: torch.dtype | None):
    """The plain model's losses and last gradients (computed once per setting)."""
    return train(make_model(), steps_for(accum), autocast)


def steps_for(accum: int) -> list[list[torch.Tensor]]:
    data = batches(3 * accum)
    return [data[i * accum:(i + 1) * accum] for i in range(3)]


@pytest.mark.parametrize("policy", DISTINCT)
@pytest.mark.parametrize("accum", [1, 2])
def test_same_loss_and_gradients_as_no_recompute_fp32(policy, accum):
    ref_losses, ref_grads = reference_run(accum, None)
    model = make_model()
    apply_recompute(model, policy)
    losses, grads = train(model, steps_for(accum))
    # fp32 on CPU: the recomputed forward runs the very same kernels; rel 1e-6.
    for got, want in zip(losses, ref_losses):
        assert got == pytest.approx(want, rel=1e-6)
    assert_close_rel(grads, ref_grads, 1e-6)


@pytest.mark.parametrize("policy", ["full", "segments:2", "selective:attention", "selective:mlp", "op"])
def test_same_loss_and_gradients_under_bf16_autocast(policy):
    ref_losses, ref_grads = reference_run(1, torch.bfloat16)
    model = make_model()
    apply_recompute(model, policy)
    losses, grads = train(model, steps_for(1), autocast=torch.bfloat16)
    # Non-reentrant checkpoint restores the autocast state, so the recompute casts and rounds
    # exactly as the first forward. Tolerance: rel 1e-3 on the loss and 1e-2 on gradients
    # (bf16 keeps 8 significant bits: a recompute in a different dtype or order would show
    # up far above that; on this CPU the results are in fact bit-identical).
    for got, want in zip(losses, ref_losses):
        assert got == pytest.approx(want, rel=1e-3)
    assert_close_rel(grads, ref_grads, 1e-2)


# --------------------------------------------------------------------------- recompute happens


def forward_backward_flops(model: GPT, x: torch.Tensor) -> tuple[int, int, dict]:
    with FlopCounterMode(display=False) as fwd:
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops(), fwd.get_flop_counts()


def fwd_flops(counts: dict, names: list[str]) -> int:
    return sum(sum(counts[n].values()) for n in names)


BLOCKS = [f"GPT.layers.{i}" for i in range(4)]


def test_full_recompute_adds_one_forward_of_the_blocks_to_backward():
    x = batches(1)[0]
    f0, b0, counts = forward_backward_flops(make_model(), x)
    model = make_model()
    apply_recompute(model, "full")
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        f1, b1, _ = forward_backward_flops(model, x)
    assert f1 == f0  # the forward itself is unchanged
    assert b0 == pytest.approx(2 * f0, rel=0.01)  # backward = 2 x forward (Kaplan)
    assert b1 - b0 == fwd_flops(counts, BLOCKS)  # + exactly one forward of every block
    assert fwd_flops(counts, BLOCKS) > 0.8 * f0  # ... which is most of a forward (the head is the rest)
    # torch's default early stop ends each recompute once the last tensor backward needs is
    # back: the block's final projection (mlp.w2, whose output nobody saved) is not rerun.
    _, b2, _ = forward_backward_flops(model, x)
    assert b2 - b0 == fwd_flops(counts, BLOCKS) - fwd_flops(counts, [f"{b}.mlp.w2" for b in BLOCKS])


@pytest.mark.parametrize("policy, recomputed", [
    ("every:2", ["GPT.layers.1", "GPT.layers.3"]),
    ("segments:2", ["GPT.layers.0", "GPT.layers.1"]),
    ("selective:mlp", [f"GPT.layers.{i}.mlp" for i in range(4)]),
])
def test_partial_policies_recompute_exactly_their_part(policy, recomputed):
    x = batches(1)[0]
    _, b0, counts = forward_backward_flops(make_model(), x)
    model = make_model()
    apply_recompute(model, policy)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        _, b1, _ = forward_backward_flops(model, x)
    assert b1 - b0 == fwd_flops(counts, recomputed) > 0


class OpCounter(TorchDispatchMode):
    def __init__(self, needle: str):
        super().__init__()
        self.needle, self.count = needle, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.needle in str(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy, expected", [("none", 0), ("selective:attention", 4), ("selective:mlp", 0), ("full", 4)])
def test_selective_attention_reruns_the_attention_core_in_backward(policy, expected):
    # FlopCounterMode does not count the CPU SDPA kernel, so count the SDPA forward calls
    # that backward makes (one per recomputed attention core; its own backward op differs).
    x = batches(1)[0]
    model = make_model()
    apply_recompute(model, policy)
    loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    with OpCounter("scaled_dot_product") as ops:
        loss.backward()
    sdpa_backward_ops = 4  # one backward kernel per layer, always there
    assert ops.count - sdpa_backward_ops == expected


# --------------------------------------------------------------------------- with ZeRO-3


@pytest.mark.multiprocess
@pytest.mark.slow
def test_segments_under_zero3_on_two_ranks_matches_one_process(tmp_path):
    """segments:K makes the first block of a segment run the others (which then pass their
    input through): FSDP2 must still gather each block's shard in the forward and in the
    recompute. Through the real CLI: --nproc 2 --zero 3 == one process (fp32, rel 1e-5)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import SMALL_FLAGS

    flags = [*SMALL_FLAGS, "--set", "model.n_layers=4", "--precision", "fp32", "--steps", "3", "--seed", "7",
             "--grad-accum", "2", "--ac", "segments:2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    losses = {}
    for name, extra in (("one", ["--micro-batch", "2"]), ("two", ["--micro-batch", "1", "--nproc", "2", "--zero", "3"])):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "tenfold", "train", *flags, *extra, "--out", str(out)],
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        losses[name] = json.loads((out / "summary.json").read_text())["losses"]
    for a, b in zip(losses["two"], losses["one"]):
        assert a == pytest.approx(b, rel=1e-5)
