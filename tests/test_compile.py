"""`--compile`: torch.compile per block, in torchtitan's order, compile time on its own, the
same loss curve as eager, and one clear line where it cannot compile.

The runs that really compile go through the CLI in a fresh process each: dynamo's cache lives
in the process, so a second compile of the same block in one test process would be served from
the cache (no compile time, nothing tested)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import SMALL_FLAGS, table_text, tenfold_child
from tenfold.engine.observe.steady import StepTime, steady_state
from tenfold.errors import UserError
from tenfold.techniques import compile as tc

pytestmark = pytest.mark.usefixtures("one_thread")

# Three fp32 steps of the tests' small model; no validation split (an evaluation would compile
# the blocks a second time, for eval mode under no_grad, and double the test's time).
FLAGS = [*SMALL_FLAGS, "--precision", "fp32", "--steps", "3", "--seed", "7", "--set", "data.val_fraction=0"]
# Inductor fuses the elementwise ops around the matmuls (which stay ATen/oneDNN calls); in fp32
# the fused kernels may sum in another order, so the curves agree to float rounding, not bits.
FP32_REL = 1e-5
# bf16: the fused kernels keep fp32 intermediates that eager rounds to bf16 between ops.
BF16_REL = 2e-2


def train(out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return tenfold_child("train", *FLAGS, *extra, "--out", str(out), timeout=600,
                         env={"OMP_NUM_THREADS": "1", **(env or {})})


def summary(out: Path, *extra: str) -> dict:
    proc = train(out, *extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((out / "summary.json").read_text())
    result["stdout"] = proc.stdout
    return result


def assert_same_curve(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert x == pytest.approx(y, rel=rel)


# --------------------------------------------------------------------------- no compiling


def small_trainer(tmp_path: Path, compile: bool = True, **sections):
    from conftest import small_config
    from tenfold.engine.loop.trainer import Trainer

    trainer = Trainer(small_config(tmp_path, train={"compile": compile}, **sections))
    trainer.setup()  # builds and parallelizes; torch.compile is lazy, nothing compiles yet
    return trainer


def test_parallelize_compiles_every_block_after_recompute(tmp_path):
    """The composition point compiles each block, and the compiled forward wraps recompute's
    checkpointed forward (TP -> recompute -> compile -> FSDP2, torchtitan's order)."""
    from tenfold.techniques.recompute import _MARK as RECOMPUTED

    assert tc.compiled_blocks(small_trainer(tmp_path).model) == ["layers.0", "layers.1"]
    model = small_trainer(tmp_path, recompute={"policy": "full"}).model
    assert tc.compiled_blocks(model) == ["layers.0", "layers.1"]
    for block in model.layers.values():
        assert getattr(block, RECOMPUTED, None) == "full"
        inner = block.forward._torchdynamo_orig_callable  # what torch.compile wraps
        assert inner.__wrapped__.__func__ is type(block).forward  # recompute's wrapper, then the block


def test_compile_off_leaves_blocks_eager(tmp_path):
    trainer = small_trainer(tmp_path, compile=False)
    assert tc.compiled_blocks(trainer.model) == []
    assert "forward" not in vars(trainer.model.layers["0"])


def test_names_unchanged_and_twice_refused():
    from tenfold.models.gpt import GPT
    from tenfold.models.presets import get_preset

    model = GPT(get_preset("tiny").with_overrides(n_layers=2, d_model=32, n_heads=2, d_ff=64, max_seq_len=16))
    before = list(model.state_dict())
    tc.apply_compile(model)
    assert list(model.state_dict()) == before
    with pytest.raises(UserError, match="already applied"):
        tc.apply_compile(model)


def test_compile_time_is_taken_out_of_warm_up_and_rate():
    """A first step of 30 s of which 29 s compiling is a 1 s step: no warm-up, and the
    steady rate counts it at 1 s."""
    times = [StepTime(1, 30.0, 100, compile_s=29.0), StepTime(2, 1.0, 100), StepTime(3, 1.0, 100)]
    s = steady_state(times)
    assert s["warmup_steps"] == 0 and s["steady_s"] == pytest.approx(3.0)
    assert s["tokens_per_s"] == pytest.approx(100.0)


def test_disabled_clock_reports_none():
    assert tc.CompileClock(False).report() is None and tc.CompileClock(False).seconds() == 0.0


def test_no_cxx_compiler_is_one_line_exit_2(tmp_path):
    """Inductor builds CPU kernels with a C++ compiler: without one, exit 2 before anything is
    written, naming the flag and the way out."""
    out = tmp_path / "run"
    proc = train(out, "--compile", env={"CXX": "/no/such/c++"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "C++ compiler" in lines[0] and "--compile" in lines[0], proc.stderr
    assert not out.exists()


def test_check_supported_names_triton_on_cuda(monkeypatch):
    import torch.utils._triton

    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    with pytest.raises(UserError, match="Triton"):
        tc.check_supported("cuda")


def test_compile_failure_is_one_line():
    from torch._dynamo.exc import Unsupported

    from tenfold.errors import RunError

    with pytest.raises(RunError, match="torch.compile failed .*run without --compile"):
        with tc.compile_failures(True):
            raise Unsupported("cannot trace this\nmore detail")
    with pytest.raises(ValueError):  # the model's own errors pass through
        with tc.compile_failures(True):
            raise ValueError("model bug")


def test_tensor_parallel_compile_is_refused_before_ranks_start(tmp_path):
    """Compiled tp blocks fail in backward on this torch: one line, exit 2, before any rank."""
    out = tmp_path / "run"
    proc = train(out, "--compile", "--nproc", "2", "--tp", "2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--compile" in lines[0] and "tensor parallelism" in lines[0], proc.stderr
    assert not out.exists()


def test_plan_takes_the_flag():
    from tenfold.cli import main

    assert main(["plan", "--model", "tiny", "--compile", "--json"]) in (0, None)


# --------------------------------------------------------------------------- compiling


@pytest.mark.slow
def test_one_process_matches_eager_and_reports_compile_time(tmp_path):
    """fp32, 3 steps: the compiled run's losses equal eager's (rel FP32_REL); summary.json and
    the summary table report the compile time, which is > 0 only if the blocks really compiled."""
    eager = summary(tmp_path / "eager")
    compiled = summary(tmp_path / "compiled", "--compile")
    assert_same_curve(compiled["losses"], eager["losses"], FP32_REL)
    assert eager["final"]["compile_s"] is None and "torch.compile" not in eager["stdout"]
    assert compiled["final"]["compile_s"] > 0.5  # seconds spent compiling, on its own
    assert "s compiling (not in the warm-up or tokens/s)" in table_text(compiled["stdout"])
    assert compiled["config"]["train"]["compile"] is True


@pytest.mark.slow
def test_with_recompute_bf16_matches_eager(tmp_path):
    """--ac full --compile in bf16 against eager bf16 without recompute (rel BF16_REL)."""
    eager = summary(tmp_path / "eager", "--precision", "bf16")
    compiled = summary(tmp_path / "compiled", "--precision", "bf16", "--ac", "full", "--compile")
    assert_same_curve(compiled["losses"], eager["losses"], BF16_REL)
    assert compiled["final"]["compile_s"] > 0.5


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero3_two_ranks_matches_one_process_eager(tmp_path):
    """FSDP2 (ZeRO-3) over compiled blocks on 2 ranks == one eager process, same global batch."""
    eager = summary(tmp_path / "eager", "--micro-batch", "4")
    compiled = summary(tmp_path / "zero3", "--micro-batch", "2", "--nproc", "2", "--zero", "3", "--compile")
    assert_same_curve(compiled["losses"], eager["losses"], FP32_REL)
    assert compiled["final"]["compile_s"] > 0.5



@pytest.mark.multiprocess
@pytest.mark.slow
def test_pipeline_stages_compile_and_match_eager(tmp_path):
    """Each pipeline stage's blocks compiled (2 stages, 1F1B) == one eager process."""
    micro = ["--micro-batch", "2", "--grad-accum", "2"]
    eager = summary(tmp_path / "eager", *micro)
    compiled = summary(tmp_path / "compiled", "--nproc", "2", "--compile", "--pp", "2", *micro)
    assert_same_curve(compiled["losses"], eager["losses"], FP32_REL)
    assert compiled["final"]["compile_s"] > 0.5
