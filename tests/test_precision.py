"""Mixed precision: DeepSpeed's DynamicLossScaler semantics (deepspeed/runtime/fp16/loss_scaler.py), the skip-step
rule, loss-scaling equivalence, a tiny fp16 run, and the global overflow vote over 2 ranks."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tenfold.engine.parallel.distributed import shutdown
from tenfold import host, terms
from tenfold.config import build_config
from tenfold.techniques.optimizer import build_optimizer, clip_grad_norm
from tenfold.engine.loop.schedule import build_scheduler
from tenfold.errors import UserError
from tenfold.models.gpt import GPT
from tenfold.models.presets import ModelConfig
from tenfold.techniques import precision
from tenfold.techniques.precision import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    LossScaler,
    Precision,
    autocast_context,
    build_loss_scaler,
    build_precision,
    Update,
    finish_step,
    grads_have_inf_or_nan,
    resolve_dtype,
)

CPU = torch.device("cpu")


# --------------------------------------------------------------------------- the scaler


def test_hysteresis_delays_the_first_backoff_then_every_overflow_halves():
    s = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, delayed_shift=2)
    s.update(True)  # hysteresis 2 -> 1, scale kept
    assert (s.scale, s.cur_hysteresis, s.skipped_steps) == (2.0**16, 1, 1)
    assert "hysteresis is 2" in s.last_message
    s.update(True)  # hysteresis used up -> halve
    assert (s.scale, s.skipped_steps) == (2.0**15, 2)
    s.update(False)  # a clean step does NOT refill hysteresis (consecutive_hysteresis=False)
    s.update(True)
    assert s.scale == 2.0**14  # DeepSpeed #931: keeps halving until the next growth


def test_consecutive_hysteresis_refills_on_every_clean_step():
    s = DynamicLossScaler(init_scale=2.0**16, delayed_shift=2, consecutive_hysteresis=True)
    for _ in range(5):
        s.update(True)  # uses up hysteresis
        s.update(False)  # refills it
    assert s.scale == 2.0**16 and s.skipped_steps == 5
    s.update(True)
    s.update(True)  # two consecutive overflows: now it halves
    assert s.scale == 2.0**15


def test_growth_after_scale_window_clean_iterations():
    w = 3
    s = DynamicLossScaler(init_scale=8.0, scale_window=w, delayed_shift=1)
    s.update(True)  # overflow at iteration 0 -> 4, last_overflow_iter = 0
    assert s.scale == 4.0
    # clean iteration i has stable_interval = i - 0 - 1; growth when it is a positive
    # multiple of w: iterations 4 and 7 (hand-computed from §2.9)
    scales = []
    for _ in range(7):
        s.update(False)
        scales.append(s.scale)
    assert scales == [4.0, 4.0, 4.0, 8.0, 8.0, 8.0, 16.0]
    # from a fresh start last_overflow_iter = -1: growth at iterations 3 and 6
    f = DynamicLossScaler(init_scale=1.0, scale_window=w)
    grown = []
    for _ in range(7):
        f.update(False)
        grown.append(f.scale)
    assert grown == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 4.0]


def test_growth_refills_hysteresis():
    s = DynamicLossScaler(init_scale=4.0, scale_window=2, delayed_shift=2)
    s.update(True)  # hysteresis -> 1
    s.update(False)
    s.update(False)
    s.update(False)  # stable_interval 2 -> grow, hysteresis back to 2
    assert s.scale == 8.0 and s.cur_hysteresis == 2
    s.update(True)
    assert s.scale == 8.0  # absorbed by the refilled hysteresis


def test_min_loss_scale_is_respected_and_raises_like_deepspeed():
    s = DynamicLossScaler(init_scale=6.0, min_scale=4.0, delayed_shift=1)
    s.update(True)
    assert s.scale == 4.0  # max(6/2, 4): clamped at the floor, not 3
    with pytest.raises(LossScaleAtMinimumError, match="already at minimum"):
        s.update(True)
    quiet = DynamicLossScaler(init_scale=4.0, min_scale=4.0, delayed_shift=1, raise_error_at_min_scale=False)
    for _ in range(3):
        quiet.update(True)
    assert quiet.scale == 4.0 and quiet.skipped_steps == 3


def test_static_scale_never_moves_but_overflow_still_counts():
    s = LossScaler(128.0)
    assert s.scale_loss(torch.tensor(2.0)).item() == 256.0
    s.update(True)
    s.update(False)
    assert s.scale == 128.0 and s.skipped_steps == 1


def test_state_round_trips_through_json_and_continues_identically():
    pattern = [True, False, True, True] + [False] * 9 + [True, False, False]
    a = DynamicLossScaler(init_scale=2.0**10, scale_window=4, delayed_shift=2)
    for ov in pattern[:6]:
        a.update(ov)
    b = DynamicLossScaler(init_scale=1.0, scale_window=4, delayed_shift=2)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for ov in pattern[6:]:
        a.update(ov)
        b.update(ov)
        assert a.state_dict() == b.state_dict()
    with pytest.raises(UserError, match="loss scaler"):
        LossScaler(1.0).load_state_dict(a.state_dict())


def test_build_loss_scaler_follows_deepspeed_create_loss_scaler():
    cfg = build_config({"precision": {"dtype": "fp16"}})
    s = build_loss_scaler(cfg.precision, "fp16")
    assert isinstance(s, DynamicLossScaler) and s.scale == 2.0**16
    assert (s.scale_window, s.delayed_shift, s.min_scale, s.consecutive_hysteresis) == (1000, 2, 1.0, False)
    cfg = build_config({"precision": {"dtype": "fp16", "loss_scale": 512, "initial_scale_power": 3}})
    static = build_loss_scaler(cfg.precision, "fp16")
    assert not static.dynamic and static.scale == 512.0
    cfg = build_config({"precision": {"dtype": "fp16", "raise_error_at_min_scale": False}})
    assert build_loss_scaler(cfg.precision, "fp16").raise_error_at_min_scale is False
    for name in ("bf16", "fp32"):
        noop = build_loss_scaler(cfg.precision, name)
        assert not noop.dynamic and noop.scale == 1.0


# --------------------------------------------------------------------------- dtype policy


def test_resolve_dtype_validates_and_warns_once_for_fp16_on_cpu(monkeypatch):
    with pytest.raises(UserError, match="fp17"):
        resolve_dtype("fp17", CPU)
    monkeypatch.setattr(precision, "_warned_fp16_on_cpu", False)
    with pytest.warns(UserWarning, match="fp16 on a CPU is very slow"):
        assert resolve_dtype("fp16", CPU) == "fp16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_dtype("fp16", CPU) == "fp16"  # no second warning
    monkeypatch.setattr(precision, "bf16_supported", lambda device: False)
    with pytest.warns(UserWarning, match="bf16 autocast is not supported"):
        assert resolve_dtype("bf16", CPU) == "fp32"


def test_cpu_bf16_matrix_instructions_are_read_from_the_flags_line(tmp_path):
    def cpuinfo(flags: str) -> Path:
        path = tmp_path / f"cpuinfo-{len(list(tmp_path.iterdir()))}"
        path.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 {flags}\n\n")
        return path

    assert host.cpu_has_bf16_matmul(cpuinfo("avx2 avx512f avx512_bf16"))
    assert host.cpu_has_bf16_matmul(cpuinfo("avx2 amx_tile amx_bf16"))
    assert not host.cpu_has_bf16_matmul(cpuinfo("avx2 avx512f avx512_vnni"))  # AVX-512 alone is not enough
    assert not host.cpu_has_bf16_matmul(tmp_path / "absent")


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_auto_precision_is_bf16_on_gpus_and_fast_cpus_else_fp32(monkeypatch, fast_bf16):
    monkeypatch.setattr(host, "cpu_has_bf16_matmul", lambda: fast_bf16)
    assert terms.resolve_precision("auto", on_cpu=False) == "bf16"
    assert terms.resolve_precision("auto", on_cpu=True) == ("bf16" if fast_bf16 else "fp32")
    assert terms.resolve_precision("auto", on_cpu=True, fp8=True) == "bf16"  # FP8 runs inside bf16 autocast
    for name in ("fp32", "bf16", "fp16"):  # a named precision is kept as given
        assert terms.resolve_precision(name, on_cpu=True) == name
    with pytest.raises(UserError, match="fp17"):
        terms.resolve_precision("fp17", on_cpu=True)


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_the_trainer_computes_in_the_precision_auto_picks(small_cfg, monkeypatch, fast_bf16):
    """The default config (`auto`) on this CPU: the Trainer's autocast dtype and the layout it
    reports follow the CPU's bf16 instructions; a named precision is not touched."""
    from tenfold.engine.loop.trainer import Trainer

    monkeypatch.setattr(host, "cpu_has_bf16_matmul", lambda: fast_bf16)
    assert build_config({}).precision.dtype == "auto"  # the default
    t = Trainer(small_cfg(precision={"dtype": "auto"}))
    t.setup()
    expected = "bf16" if fast_bf16 else "fp32"
    assert t.parts.precision.name == expected and t.parts.run.precision == expected
    assert (t.parts.precision.compute_dtype is torch.bfloat16) == fast_bf16
    named = Trainer(small_cfg(precision={"dtype": "bf16"}))
    named.setup()
    assert named.parts.precision.name == "bf16"


def test_autocast_keeps_fp32_master_weights():
    lin = nn.Linear(8, 8)
    with autocast_context("bf16", CPU):
        y = lin(torch.randn(2, 8))
    assert y.dtype == torch.bfloat16 and lin.weight.dtype == torch.float32
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32  # grads (and AdamW states) stay fp32
    with autocast_context("fp32", CPU):
        assert lin(torch.randn(2, 8)).dtype == torch.float32


# --------------------------------------------------------------------------- equivalence


def _tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layers=1, d_model=32, n_heads=2, vocab_size=64, max_seq_len=16)
    return GPT(cfg)


def _lm_loss(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def test_scaled_then_unscaled_grads_equal_plain_grads_exactly_in_fp32():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = _tiny_gpt()
    _lm_loss(plain, ids).backward()
    scaled = _tiny_gpt()
    scaler = DynamicLossScaler(init_scale=2.0**12)
    scaler.scale_loss(_lm_loss(scaled, ids)).backward()
    scaler.unscale_grads_(scaled.parameters())
    for a, b in zip(_grads(plain), _grads(scaled)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)  # power-of-2 scale: exact in fp32


@pytest.mark.parametrize("dtype_name, tol", [("bf16", 1.5e-2), ("fp16", 2e-3)])
def test_autocast_grads_match_fp32_within_the_dtype_tolerance(dtype_name, tol):
    """Tolerance: relative error of the whole gradient vector; bf16 has 8 mantissa bits
    (~4e-3 per op), fp16 has 11 (~5e-4); measured 3.4e-3 and 4.1e-4 here, so ~4x margin."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    ref = _tiny_gpt()
    ref_loss = _lm_loss(ref, ids)
    ref_loss.backward()
    model = _tiny_gpt()
    scaler = build_loss_scaler(build_config({}).precision, dtype_name) if dtype_name == "bf16" else DynamicLossScaler()
    with autocast_context(dtype_name, CPU):
        loss = _lm_loss(model, ids)
    scaler.scale_loss(loss).backward()
    scaler.unscale_grads_(model.parameters())
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < tol
    g_ref = torch.cat([g.flatten() for g in _grads(ref)])
    g = torch.cat([g.flatten() for g in _grads(model)])
    assert ((g - g_ref).norm() / g_ref.norm()).item() < tol


# --------------------------------------------------------------------------- the step


def _step_setup(dtype: str = "fp16"):
    cfg = build_config({"precision": {"dtype": dtype}, "train": {"lr": 1e-2, "warmup_steps": 0}})
    model = _tiny_gpt()
    opt = build_optimizer(model, cfg.train, CPU)
    sched = build_scheduler(opt, cfg.train, total_steps=10)
    return cfg, model, opt, sched, build_precision(dtype, cfg.precision, CPU)


def _finish(opt, sched, precision, model, max_norm, loss=1.0):
    """The trainer's step tail (Trainer.apply_gradients calls exactly this function)."""
    params = list(model.parameters())
    return finish_step(Update(opt, sched, precision, lambda m: clip_grad_norm(params, m), max_norm), params, loss, 32)


def test_forced_overflow_skips_the_step_everywhere_it_matters():
    cfg, model, opt, sched, precision = _step_setup()
    scaler = precision.scaler
    before = [p.detach().clone() for p in model.parameters()]
    ids = torch.randint(0, 64, (2, 16))
    scaler.scale_loss(_lm_loss(model, ids)).backward()
    next(model.parameters()).grad.view(-1)[3] = math.inf  # an overflow in one element
    lr_before = sched.get_last_lr()
    r = _finish(opt, sched, precision, model, cfg.train.grad_clip)
    assert r.skipped and math.isnan(r.grad_norm) and r.loss_scale == 2.0**16
    assert r.message.startswith("OVERFLOW! Skipping step")
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # weights unchanged
    assert all(p.grad is None for p in model.parameters())  # the inf never reaches the weights
    assert len(opt.state) == 0  # AdamW moments untouched
    assert sched.last_epoch == 0 and sched.get_last_lr() == lr_before  # LR schedule not advanced
    assert scaler.skipped_steps == 1 and scaler.scale == 2.0**16  # hysteresis 2 absorbs the first
    # second overflow: hysteresis used up -> the scale halves
    scaler.scale_loss(_lm_loss(model, ids)).backward()
    next(model.parameters()).grad.view(-1)[0] = math.nan
    assert _finish(opt, sched, precision, model, 1.0).skipped
    assert scaler.skipped_steps == 2 and scaler.scale == 2.0**15
    # a clean step goes through: weights move, schedule advances
    scaler.scale_loss(_lm_loss(model, ids)).backward()
    r = _finish(opt, sched, precision, model, 1.0)
    assert not r.skipped and r.grad_norm > 0 and sched.last_epoch == 1
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _train_steps(dtype: str, steps: int) -> tuple[list, nn.Module, Precision]:
    """`steps` steps of the trainer's own step tail on periodic sequences (learnable in a few
    steps): the StepResult of each step, the model and the precision."""
    cfg, model, opt, sched, precision = _step_setup(dtype)
    data = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0)).repeat(1, 2)
    results = []
    for _ in range(steps):
        with autocast_context(dtype, CPU):
            loss = _lm_loss(model, data)
        precision.scaler.scale_loss(loss).backward()
        results.append(_finish(opt, sched, precision, model, 1.0, loss.item()))
    return results, model, precision


def test_tiny_fp16_run_trains_without_nan_and_the_loss_falls():
    """25 fp16 steps (autocast fp16, loss scale 2^16) against the same 25 steps in fp32: every
    step is taken at 2^16, each step's loss and unscaled gradient norm follow the fp32 run within
    fp16's tolerance (measured: loss 1.1e-4 absolute, norm 7e-5 relative), the loss falls as
    fp32's does (4.13 -> 1.86), and the weights end where fp32's do (relative distance 2e-2;
    measured 5e-3).
    Mutations: gradients not unscaled (finish_step) -> norms 65,536x; the step skipped or the
    scale halved without an overflow -> steps missing; fp16 autocast off -> the losses equal fp32's."""
    fp16, model16, precision = _train_steps("fp16", 25)
    fp32, model32, _ = _train_steps("fp32", 25)
    assert [r.skipped for r in fp16] == [False] * 25 and precision.scaler.skipped_steps == 0
    assert all(r.loss_scale == 2.0**16 for r in fp16)
    assert all(math.isfinite(r.loss) and math.isfinite(r.grad_norm) for r in fp16)
    for a, b in zip(fp16, fp32):
        assert a.loss == pytest.approx(b.loss, rel=2e-3, abs=1e-3)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=2e-3)
    assert any(a.loss != b.loss for a, b in zip(fp16, fp32))  # fp16 really ran
    assert sum(r.loss for r in fp16[-3:]) / 3 < 0.5 * fp16[0].loss
    w16, w32 = (torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (model16, model32))
    assert ((w16 - w32).norm() / w32.norm()).item() < 2e-2  # measured 5e-3

def test_grads_have_inf_or_nan_single_process():
    lin = nn.Linear(4, 4)
    assert not grads_have_inf_or_nan(lin.parameters())  # no grads at all
    lin(torch.randn(2, 4)).sum().backward()
    assert not grads_have_inf_or_nan(lin.parameters())
    lin.bias.grad[1] = -math.inf
    assert grads_have_inf_or_nan(lin.parameters())


# --------------------------------------------------------------------------- 2 ranks (gloo)


def _two_rank_worker(rank: int, store_path: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        out: dict = {}
        torch.manual_seed(0)  # same weights on both ranks
        lin = nn.Linear(4, 4)
        lin(torch.randn(3, 4)).sum().backward()
        out["clean"] = grads_have_inf_or_nan(lin.parameters())
        if rank == 1:
            lin.weight.grad[0, 0] = math.inf
        out["one_rank_inf"] = grads_have_inf_or_nan(lin.parameters())
        # FSDP2 (DTensor) grads: one rank's local shard gets the NaN
        from torch.distributed._composable.fsdp import fully_shard

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        full_norm_model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        full_norm_model.load_state_dict(model.state_dict())
        fully_shard(model)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        model(x).pow(2).sum().backward()
        out["dtensor_grad"] = type(model[0].weight.grad).__name__
        # reference: the DP-averaged gradient norm of the unsharded model, computed locally
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        for xr in xs:
            (full_norm_model(xr).pow(2).sum() / 2).backward()
        out["ref_norm"] = torch.nn.utils.get_total_norm([p.grad for p in full_norm_model.parameters()]).item()
        out["fsdp_norm"] = clip_grad_norm(list(model.parameters()), max_norm=0.0)
        out["fsdp_clipped_to"] = out["fsdp_norm"] / 4
        clip_grad_norm(list(model.parameters()), max_norm=out["fsdp_clipped_to"])  # DTensor grads * coef
        out["fsdp_norm_after_clip"] = clip_grad_norm(list(model.parameters()), max_norm=0.0)
        out["fsdp_clean"] = grads_have_inf_or_nan(model.parameters())
        if rank == 1:
            model[1].weight.grad.to_local().view(-1)[0] = math.nan
        out["fsdp_one_rank_nan"] = grads_have_inf_or_nan(model.parameters())
        with open(f"{results}.{rank}", "w") as f:
            json.dump(out, f)
    finally:
        shutdown()  # barrier, then destroy: an early destroy can abort the peer (gloo)


@pytest.mark.multiprocess
def test_overflow_vote_is_global_over_two_gloo_ranks_and_clip_norm_is_global_under_fsdp2():
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "out")
        mp.spawn(_two_rank_worker, args=(os.path.join(tmp, "store"), results), nprocs=2, join=True)
        outs = [json.load(open(f"{results}.{r}")) for r in range(2)]
    for out in outs:
        assert out["clean"] is False and out["one_rank_inf"] is True  # rank 1's inf skips rank 0 too
        assert out["dtensor_grad"] == "DTensor"
        assert out["fsdp_clean"] is False and out["fsdp_one_rank_nan"] is True
        # torch's clip_grad_norm_/get_total_norm on DTensor grads = the global norm (FSDP2
        # averages grads over ranks, hence the /2 in the reference)
        assert out["fsdp_norm"] == pytest.approx(out["ref_norm"], rel=1e-5)
        assert out["fsdp_norm_after_clip"] == pytest.approx(out["fsdp_clipped_to"], rel=1e-4)  # coef has +1e-6
    assert outs[0]["fsdp_norm"] == outs[1]["fsdp_norm"]


# --------------------------------------------------------------------------- through the trainer


@pytest.mark.usefixtures("one_thread")
def test_an_overflow_on_the_training_path_logs_deepspeeds_message(small_cfg, caplog):
    """fp16 from a start scale of 2**40 overflows: the trainer's own step skips and says so."""
    from tenfold.engine.loop.trainer import Trainer

    cfg = small_cfg(precision={"dtype": "fp16", "initial_scale_power": 40}, train={"steps": 2})
    with caplog.at_level(logging.WARNING, logger="tenfold"):
        summary = Trainer(cfg).fit()
    assert summary["final"]["skipped_steps"] >= 1
    skips = [r.getMessage() for r in caplog.records if "OVERFLOW! Skipping step" in r.getMessage()]
    assert skips and "Attempted loss scale: 1.09951e+12" in skips[0], [r.getMessage() for r in caplog.records]


@pytest.mark.usefixtures("one_thread")
def test_fp16_gradients_are_unscaled_before_the_norm_and_the_step(small_cfg):
    """A static loss scale of 2**10 must not show in the reported gradient norm or the update:
    the same run at scale 1 gives the same norms and losses (clip far above the norm, so
    clipping cannot hide a scaled gradient; AdamW's scale invariance would hide it from the
    loss alone, the norm cannot hide it)."""
    from tenfold.engine.loop.trainer import Trainer

    def run(scale: float, name: str) -> list[dict]:
        cfg = small_cfg(precision={"dtype": "fp16", "loss_scale": scale}, train={"steps": 3, "grad_clip": 1e6},
                        log={"out": str(Path(cfg_root) / name), "progress": False, "tensorboard": False})
        Trainer(cfg).fit()
        return [json.loads(line) for line in (Path(cfg_root) / name / "metrics.jsonl").read_text().splitlines()]

    cfg_root = small_cfg()["log"]["out"]
    scaled, plain = run(2.0**10, "scaled"), run(1.0, "plain")
    for a, b in zip(scaled, plain, strict=True):
        assert not a["skipped"] and not b["skipped"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-2), (a, b)
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3)


def test_the_cli_shows_tenfolds_own_notes_as_notes_not_python_source_lines(tmp_path, capsys, monkeypatch):
    """`precision.py:337: UserWarning: fp16 on a CPU is very slow` and the source line under it
    become one line, `tenfold: note: ...`."""
    from conftest import SMALL_FLAGS
    from tenfold.cli import main

    monkeypatch.setattr(precision, "_warned_fp16_on_cpu", False)
    args = ["train", "--precision", "fp16", "--steps", "1", "--set", "checkpoint.final=false",
            "--set", "log.tensorboard=false", *SMALL_FLAGS]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main([*args, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    notes = [ln for ln in err.splitlines() if "fp16 on a CPU is very slow" in ln]
    assert len(notes) == 1 and notes[0].startswith("tenfold: note: fp16 on a CPU is very slow"), err
    assert "UserWarning" not in err and "precision.py" not in err and "warnings.warn" not in err, err


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("clip", [0.01, 0.0])
def test_a_trainer_step_clips_to_train_grad_clip(small_cfg, clip):
    """On the Trainer's own step: the gradients AdamW steps with have the global norm
    train.grad_clip when they were larger (0: DeepSpeed's "no clipping", the norm as computed);
    the row reports the norm before clipping."""
    from tenfold.engine.loop.trainer import Trainer

    t = Trainer(small_cfg(train={"grad_clip": clip}))
    t.setup()
    at_step = []

    def norm_at_step(optimizer, args, kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        at_step.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    t.optimizer.register_step_pre_hook(norm_at_step)
    result = t.train_step(t.loader.next_step())
    assert len(at_step) == 1 and result.grad_norm > 0.05  # far above 0.01: clipping has work to do
    expected = clip if clip else result.grad_norm
    assert at_step[0] == pytest.approx(expected, rel=1e-4), (at_step, result.grad_norm)
