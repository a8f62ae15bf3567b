"""Mixture of experts (tenfold.models.moe): grouped GEMM vs the loop, dropless routing, capacity,
the balance loss and the aux-loss-free bias, the parameter counts, a training run's expert load."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tenfold.errors import UserError
from tenfold.models import moe as moe_mod
from tenfold.models.adapter import adapt
from tenfold.models.gpt import GPT
from tenfold.models.moe import MoE, balance_loss, finish_router_step, grouped_matmul
from tenfold.models.presets import (
    PUBLISHED_ACTIVE_PARAMS, PUBLISHED_PARAMS, active_param_count, flops_per_token, get_preset, param_count,
)

TINY = get_preset("tiny-moe")


def _moe(**overrides) -> MoE:
    torch.manual_seed(0)
    layer = MoE(TINY.with_overrides(**overrides))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def _expert(layer: MoE, e: int, h: torch.Tensor) -> torch.Tensor:
    ex = layer.experts
    return (F.silu(h @ ex.w1[e]) * (h @ ex.w3[e])) @ ex.w2[e]


def reference_output(layer: MoE, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Token by token: sum over its k experts of weight * expert(token) (+ shared), no sorting, no
    grouped GEMM. With `capacity`, an expert ignores the tokens after its first `capacity`."""
    h = x.reshape(-1, x.shape[-1])
    _, chosen, weights = layer.route(h)
    taken = [0] * layer.n_experts
    out = []
    for t in range(h.shape[0]):
        y = torch.zeros_like(h[t])
        for j in range(layer.top_k):
            e = int(chosen[t, j])
            taken[e] += 1
            if capacity is None or taken[e] <= capacity:
                y = y + weights[t, j] * _expert(layer, e, h[t])
        if layer.shared is not None:
            y = y + layer.shared(h[t])
        out.append(y)
    return torch.stack(out).reshape(x.shape)


def test_grouped_gemm_equals_the_loop_forward_and_backward():
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 8])
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(4, 32, 16, requires_grad=True)
    grads = []
    for impl in ("grouped", "loop"):
        y = grouped_matmul(x, w, counts, impl)
        y.sum().backward()  # a stride-0 gradient: grouped_mm's backward needs it contiguous
        grads.append((y.detach(), x.grad.clone(), w.grad.clone()))
        x.grad = w.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_moe_layer_grouped_equals_loop(monkeypatch):
    layer = _moe()
    x = torch.randn(2, 24, TINY.d_model)
    results = []
    for impl in ("grouped", "loop"):
        monkeypatch.setattr(moe_mod, "EXPERT_IMPL", impl)
        layer.zero_grad()
        y = layer(x)
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_dropless_every_token_reaches_its_k_experts():
    layer = _moe()
    with torch.no_grad():  # a skewed router: most tokens want expert 0, far above any capacity
        layer.router.weight[0] += 3.0
    x = torch.randn(2, 24, TINY.d_model).abs()
    torch.testing.assert_close(layer(x), reference_output(layer, x), rtol=1e-5, atol=1e-5)
    counts = torch.bincount(layer.route(x.reshape(-1, TINY.d_model))[1].reshape(-1), minlength=8)
    assert int(counts.max()) > layer.capacity(48) if layer.capacity_factor else True
    assert int(counts[0]) == 48  # every token chose expert 0, and every one is in the output


def test_capacity_factor_drops_the_overflow_in_token_order():
    layer = _moe(capacity_factor=1.0)
    with torch.no_grad():
        layer.router.weight[0] += 3.0
    x = torch.randn(2, 24, TINY.d_model).abs()
    capacity = layer.capacity(48)
    assert capacity == 12
    y = layer(x)
    torch.testing.assert_close(y, reference_output(layer, x, capacity), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y, reference_output(layer, x), atol=1e-3)  # something was dropped


def test_balance_loss_is_one_when_balanced_and_larger_when_skewed():
    uniform = torch.full((16, 4), 0.25)
    assert float(balance_loss(uniform, torch.tensor([8, 8, 8, 8]))) == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 16)
    assert float(balance_loss(skewed, torch.tensor([16, 8, 4, 4]))) > 1.5


def _imbalance(layer: MoE, x: torch.Tensor) -> float:
    counts = torch.bincount(layer.route(x)[1].reshape(-1), minlength=layer.n_experts).float()
    return float(counts.max() / counts.mean())


def test_balance_loss_pulls_a_skewed_router_towards_balance():
    layer = _moe()
    with torch.no_grad():
        layer.router.weight[0] += 0.05
    x = torch.randn(256, TINY.d_model) + 0.5  # tokens that share a direction the router favours
    before = _imbalance(layer, x)
    opt = torch.optim.SGD(layer.router.parameters(), lr=1.0)
    for _ in range(30):
        scores, chosen, _ = layer.route(x)
        loss = balance_loss(scores, torch.bincount(chosen.reshape(-1), minlength=8))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = _imbalance(layer, x)
    assert before > 2.5 and after < 1.3, (before, after)


def test_aux_loss_free_bias_pulls_the_choice_towards_balance():
    layer = _moe(router_bias_rate=0.01, router_aux_loss_coef=0.0)
    with torch.no_grad():
        layer.router.weight[0] += 0.05
    x = torch.randn(4, 64, TINY.d_model) + 0.5
    before = _imbalance(layer, x.reshape(-1, TINY.d_model))
    weights_before = layer.route(x.reshape(-1, TINY.d_model))[0]
    for _ in range(60):
        layer(x)
        finish_router_step(layer)
    after = _imbalance(layer, x.reshape(-1, TINY.d_model))
    assert before > 2.5 and after < 1.3, (before, after)
    # the bias changes the choice only: the router's probabilities are untouched
    torch.testing.assert_close(layer.route(x.reshape(-1, TINY.d_model))[0], weights_before)


def test_the_aux_loss_gradient_is_coef_per_target_token():
    cfg = TINY.with_overrides(router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = {"input_ids": torch.randint(0, 256, (2, 16)), "labels": torch.randint(0, 256, (2, 16))}
    batch["labels"][0, :5] = -100
    adapter = adapt(model, 16)
    loss = adapter.loss_sum(model, batch)
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain = F.cross_entropy(model(batch["input_ids"]).reshape(-1, 256), batch["labels"].reshape(-1), reduction="sum")
    aux = sum(m.aux_loss for m in moe_mod.moe_layers(model))
    assert float(loss.detach()) == pytest.approx(float(plain), rel=1e-6)  # the logged loss is the LM loss
    (plain + 0.5 * 27 * aux).backward()
    for a, p in zip(got, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)


def test_recompute_counts_the_load_once():
    layer = _moe()
    x = torch.randn(2, 24, TINY.d_model, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert float(layer.load.sum()) == 48 * 2
    assert finish_router_step(layer) == [[int(v) for v in torch.bincount(
        layer.route(x.reshape(-1, TINY.d_model))[1].reshape(-1), minlength=8)]]


def test_parameter_counts_match_the_module_and_the_published_sizes():
    for overrides in ({}, {"n_shared_experts": 0, "capacity_factor": 1.25}, {"experts_per_token": 1}):
        cfg = TINY.with_overrides(**overrides)
        assert param_count(cfg) == sum(p.numel() for p in GPT(cfg).parameters())
    for name in ("mixtral-8x7b",):
        cfg = get_preset(name)
        assert param_count(cfg) == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)
        assert active_param_count(cfg) == pytest.approx(PUBLISHED_ACTIVE_PARAMS[name], rel=0.01)
    # MFU's numerator counts the active parameters: 8 experts top-2 -> well under the total
    cfg = get_preset("mixtral-8x7b")
    assert flops_per_token(cfg, 4096) < 6 * param_count(cfg) / 2.5
    assert adapt(GPT(TINY), 64).flops_per_token == flops_per_token(TINY, 64)


def test_bad_moe_settings_are_refused():
    with pytest.raises(UserError, match="experts_per_token"):
        TINY.with_overrides(experts_per_token=9)
    with pytest.raises(UserError, match="SwiGLU"):
        TINY.with_overrides(mlp="gelu")


def test_tiny_moe_trains_and_logs_the_expert_load(tmp_path):
    from conftest import small_config

    from tenfold import Trainer

    cfg = small_config(tmp_path, model={"name": "tiny-moe", "n_layers": 2, "d_model": 64, "max_seq_len": 64},
                       train={"steps": 4, "micro_batch": 4, "grad_accum": 2, "lr": 3e-3, "warmup_steps": 0,
                              "eval_every": 0, "eval_batches": 2})
    Trainer(cfg).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:  # 2 micro-batches x 4 rows x 32 tokens, each to 2 experts, in each of 2 blocks
        assert [sum(layer) for layer in row["expert_load"]] == [2 * 4 * 32 * 2] * 2
    assert rows[-1]["loss"] < rows[0]["loss"]
