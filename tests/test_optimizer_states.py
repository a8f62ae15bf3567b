"""Optimizer states allocated at setup (techniques/optimizer.py::allocate_states) are those
of a fresh optimizer: training from them is bit-identical to AdamW's lazy first step."""

from __future__ import annotations

import pytest
import torch

from tenfold.techniques.optimizer import allocate_states, param_groups

pytestmark = pytest.mark.usefixtures("one_thread")


def _model_and_batches(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    batches = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(4)]
    return model, batches


def _train(allocate: bool, lr=1e-2):
    model, batches = _model_and_batches()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=lr, betas=(0.9, 0.95), foreach=True)
    if allocate:
        before = [p.detach().clone() for p in model.parameters()]
        allocate_states(opt)
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # weights untouched
        assert all(p.grad is None for p in model.parameters())
        assert opt.param_groups[0]["lr"] == lr  # the learning rate restored
        assert all(float(s["step"]) == 0 for s in opt.state.values())
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def test_allocated_states_train_bit_identically_to_lazy_ones():
    """Exact equality (not a tolerance): the allocation step changes no weight and the states
    it leaves are zeros at step 0. Mutation: leaving the step counters at 1 changes Adam's
    bias correction and every weight after the first step."""
    lazy_model, lazy_opt = _train(allocate=False)
    model, opt = _train(allocate=True)
    for a, b in zip(lazy_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    for p_lazy, p in zip(lazy_model.parameters(), model.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(lazy_opt.state[p_lazy][key], opt.state[p][key]), key


def test_states_exist_before_the_first_step_and_are_left_alone_once_there():
    model, _ = _model_and_batches()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    allocate_states(opt)
    assert len(opt.state) == len(list(model.parameters()))
    for s in opt.state.values():
        assert not s["exp_avg"].any() and not s["exp_avg_sq"].any()
    opt.state[next(iter(opt.state))]["exp_avg"].fill_(3.0)
    allocate_states(opt)  # already there: nothing is reset
    assert float(opt.state[next(iter(opt.state))]["exp_avg"][0].flatten()[0]) == 3.0


def test_other_optimizers_are_not_stepped():
    model, _ = _model_and_batches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    allocate_states(opt)
    assert not opt.state


def test_the_trainer_allocates_them_at_setup(small_cfg):
    from tenfold.engine.loop.trainer import Trainer

    t = Trainer(small_cfg())
    t.setup()
    assert len(t.optimizer.state) == len([p for p in t.model.parameters() if p.requires_grad])
    assert all(float(s["step"]) == 0 for s in t.optimizer.state.values())


@pytest.mark.parametrize("shape", [{}, {"bias": True, "norm": "layernorm", "pos": "learned", "mlp": "gelu"}])
def test_the_trainer_decays_matmul_weights_and_embeddings_only(small_cfg, shape):
    """Named by role, not by the shape rule under test: norm gains and biases get no weight
    decay, the matmul weights and the embeddings get train.weight_decay."""
    from tenfold.engine.loop.trainer import Trainer

    t = Trainer(small_cfg(model={"name": "tiny", "n_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 128,
                                 "max_seq_len": 64, **shape}, train={"weight_decay": 0.07}))
    t.setup()
    decay_of = {id(p): g["weight_decay"] for g in t.optimizer.param_groups for p in g["params"]}
    names = dict(t.model.named_parameters())
    assert len(decay_of) == len(names)  # every trainable parameter in exactly one group
    free = [n for n in names if "norm" in n or n.endswith(".bias")]
    assert free and (not shape or any(n.endswith(".bias") for n in free))
    assert any("emb" in n for n in names if n not in free)
    for name, p in names.items():
        assert decay_of[id(p)] == (0.0 if name in free else 0.07), name
