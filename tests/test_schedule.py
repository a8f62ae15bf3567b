"""LR schedules against hand-computed values: tenfold's warmup+cosine/linear/constant and
DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR (formulas in
`deepspeed/runtime/lr_schedules.py`; DeepSpeed's optimizer step s uses iteration s-1)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from tenfold.config import build_config
from tenfold.techniques.optimizer import build_optimizer, clip_grad_norm, param_groups
from tenfold.engine.loop.schedule import build_scheduler, validate_schedule_params
from tenfold.errors import UserError


def _lrs(schedule: str, steps: int, lr: float = 1.0, total: int | None = None, **train) -> list[float]:
    """The lr each optimizer step 0..steps-1 runs with (read from the optimizer itself)."""
    cfg = build_config({"train": {"schedule": schedule, "lr": lr, **train}})
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.train.lr)
    sched = build_scheduler(opt, cfg.train, total_steps=total or steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        assert sched.get_last_lr() == [out[-1]]
        opt.step()
        sched.step()
    return out


def test_cosine_warmup_then_decay_to_min_ratio():
    c = 0.1 + 0.9 * (1 + math.cos(math.pi / 3)) / 2  # p = 1/3
    d = 0.1 + 0.9 * (1 + math.cos(2 * math.pi / 3)) / 2  # p = 2/3
    got = _lrs("cosine", 7, lr=2.0, total=6, warmup_steps=2, min_lr_ratio=0.1)
    want = [2 / 3, 4 / 3, 2.0, 2 * c, 2 * d, 0.2, 0.2]  # the last step reaches lr*min_lr_ratio
    assert got == pytest.approx(want, rel=1e-12)


def test_linear_and_constant():
    assert _lrs("linear", 6, warmup_steps=2, min_lr_ratio=0.1) == pytest.approx(
        [1 / 3, 2 / 3, 1.0, 0.7, 0.4, 0.1], rel=1e-12
    )
    assert _lrs("constant", 4, warmup_steps=2) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0], rel=1e-12)
    assert _lrs("constant", 2, lr=0.5, warmup_steps=0) == [0.5, 0.5]


def test_deepspeed_warmup_lr_default_is_log_warmup():
    p = {"warmup_min_lr": 0.1, "warmup_max_lr": 1.1, "warmup_num_steps": 4}
    got = _lrs("WarmupLR", 7, lr=5.0, schedule_params=p)
    # step 0 = iteration -1 (not started: min), then min + (max-min) * log(it+1)/log(4)
    want = [0.1, 0.1, 0.1 + math.log(2) / math.log(4), 0.1 + math.log(3) / math.log(4), 1.1, 1.1, 1.1]
    assert got == pytest.approx(want, rel=1e-12)


def test_deepspeed_warmup_lr_linear_and_clamped_warmup_and_default_max_is_optimizer_lr():
    # warmup_num_steps=1 is clamped to 2; warmup_max_lr None -> the optimizer's lr
    got = _lrs("WarmupLR", 5, lr=0.8, schedule_params={"warmup_num_steps": 1, "warmup_type": "linear"})
    assert got == pytest.approx([0.0, 0.0, 0.4, 0.8, 0.8], rel=1e-12)


def test_deepspeed_warmup_decay_lr():
    p = {"warmup_max_lr": 1.0, "warmup_num_steps": 2, "total_num_steps": 6, "warmup_type": "linear"}
    got = _lrs("WarmupDecayLR", 10, lr=1.0, schedule_params=p)
    # iterations -1..8: min, 0/2, 1/2, then (6 - it)/(6 - 2), floored at 0
    want = [0.0, 0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    # DeepSpeed's WarmupDecayLR defaults warmup_max_lr to 0.001 (not the optimizer's lr)
    assert validate_schedule_params("WarmupDecayLR", {}, 100)["warmup_max_lr"] == 0.001


def test_deepspeed_warmup_decay_total_defaults_to_run_length():
    p = {"warmup_max_lr": 1.0, "warmup_num_steps": 2, "warmup_type": "linear"}
    assert _lrs("WarmupDecayLR", 7, total=6, schedule_params=p)[-1] == pytest.approx(0.25)


def test_deepspeed_warmup_cosine_lr_in_ratios_of_the_optimizer_lr():
    p = {"total_num_steps": 6, "warmup_num_steps": 2, "warmup_min_ratio": 0.2,
         "cos_min_ratio": 0.1, "warmup_type": "linear"}
    got = _lrs("WarmupCosineLR", 10, lr=2.0, schedule_params=p)

    def cos_ratio(it):  # progress = min(1, (it - W + 1)/(T - W))
        prog = min(1.0, (it - 2 + 1) / 4)
        return 0.1 + 0.9 * (1 + math.cos(math.pi * prog)) / 2

    want = [0.0, 2 * 0.2, 2 * 0.6] + [2 * cos_ratio(it) for it in range(2, 9)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[-1] == pytest.approx(0.2)  # stays at the floor past the end


def test_warmup_cosine_log_default():
    got = _lrs("WarmupCosineLR", 4, lr=1.0, schedule_params={"total_num_steps": 100, "warmup_num_steps": 10})
    assert got == pytest.approx([0.0, 0.0, math.log(2) / math.log(10), math.log(3) / math.log(10)], rel=1e-12)


@pytest.mark.parametrize(
    "schedule, params, match",
    [
        ("WarmupLR", {"warmup_steps": 5}, r"unknown train.schedule_params \['warmup_steps'\].*allowed: warmup_min_lr"),
        ("WarmupLR", {"warmup_type": "cubic"}, "warmup_type='cubic'"),
        ("WarmupLR", {"warmup_num_steps": 0}, "warmup_num_steps=0"),
        ("WarmupLR", {"warmup_max_lr": [0.1, 0.2]}, "lists per param group"),
        ("WarmupDecayLR", {"total_num_steps": -3}, "total_num_steps=-3"),
        ("WarmupCosineLR", {"cos_min_ratio": 2}, "cos_min_ratio=2"),
        ("WarmupCosineLR", {"warmup_min_lr": 0.0}, "allowed: total_num_steps"),
        ("cosine", {"warmup_num_steps": 3}, "not used by schedule 'cosine'"),
    ],
)
def test_bad_schedule_params_are_user_errors_naming_them(schedule, params, match):
    # refused by the config itself, before anything is built, and by build_scheduler
    with pytest.raises(UserError, match=match):
        build_config({"train": {"schedule": schedule, "schedule_params": params}})
    train = SimpleNamespace(**{**build_config({}).train.model_dump(), "schedule": schedule, "schedule_params": params})
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    with pytest.raises(UserError, match=match):
        build_scheduler(opt, train, total_steps=10)


def test_state_dict_is_json_safe_and_resumes_the_curve():
    cfg = build_config({"train": {"schedule": "cosine", "lr": 1.0, "warmup_steps": 3}})
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    a = build_scheduler(opt, cfg.train, 20)
    for _ in range(5):
        opt.step()
        a.step()
    state = json.loads(json.dumps(a.state_dict()))
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    b = build_scheduler(opt2, cfg.train, 20)
    b.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for _ in range(5):
        opt.step(), a.step(), opt2.step(), b.step()
        assert b.get_last_lr() == a.get_last_lr()
    other = build_config({"train": {"schedule": "linear"}})
    with pytest.raises(UserError, match="lr schedule"):
        build_scheduler(opt2, other.train, 20).load_state_dict(state)


# --------------------------------------------------------------------------- optimizer


def test_weight_decay_on_2d_weights_only_and_adamw_settings():
    from tenfold.models.gpt import GPT
    from tenfold.models.presets import ModelConfig

    model = GPT(ModelConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=32, max_seq_len=8, bias=True))
    cfg = build_config({"train": {"weight_decay": 0.3, "beta1": 0.8, "beta2": 0.9, "eps": 1e-6, "lr": 0.01}})
    opt = build_optimizer(model, cfg.train, torch.device("cpu"))
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.3 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
    assert any("emb" in names[id(p)] for p in decay["params"])  # nanoGPT rule: embeddings decay
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-6 and decay["lr"] == 0.01
    assert decay["foreach"] is True
    assert param_groups(torch.nn.Linear(2, 2, bias=False), 0.1)[0]["weight_decay"] == 0.1  # no empty group


def test_clip_grad_norm_reports_pre_clip_norm_and_zero_disables():
    lin = torch.nn.Linear(3, 1, bias=False)
    lin.weight.grad = torch.tensor([[3.0, 4.0, 0.0]])
    assert clip_grad_norm(lin.parameters(), 0.0) == pytest.approx(5.0)
    assert torch.equal(lin.weight.grad, torch.tensor([[3.0, 4.0, 0.0]]))  # 0 = no clipping
    assert clip_grad_norm(lin.parameters(), 1.0) == pytest.approx(5.0)  # pre-clip norm
    torch.testing.assert_close(lin.weight.grad, torch.tensor([[0.6, 0.8, 0.0]]), rtol=1e-5, atol=1e-6)
    assert clip_grad_norm(lin.parameters(), 10.0) == pytest.approx(1.0, rel=1e-5)  # below max: unchanged
    torch.testing.assert_close(lin.weight.grad, torch.tensor([[0.6, 0.8, 0.0]]), rtol=1e-5, atol=1e-6)
