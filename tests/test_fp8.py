"""FP8 training (techniques/fp8.py, torchao float8): a converted Linear computes the scaled
float8 product forward and backward; the blocks' Linears are converted and the embedding, the
head and Linears with a dimension not a multiple of 16 are not; a CPU without --fp8-emulate is
refused in one line; `tiny` trains to within 2% of bf16; ZeRO-3 with FSDP2's float8
all-gather on 2 gloo ranks tracks one process.

On this CPU the float8 matmuls are torch's CPU `torch._scaled_mm` (--fp8-emulate): the same
casts, scales and fp32 accumulation as on an H100, without the speed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import SMALL_FLAGS, read_metrics, small_config, torchrun
from tenfold import capabilities
from tenfold.cli import main
from tenfold.techniques import fp8

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "workers"))
import zero_worker  # noqa: E402
import fp8_worker  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# --------------------------------------------------------------------------- numerics of one layer


def quantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` through float8 `dtype` with one dynamic scale for the whole tensor (finfo.max / amax,
    the tensorwise recipe), back in fp32: the values a float8 matmul multiplies."""
    scale = torch.finfo(dtype).max / t.abs().max().double().clamp(min=1e-12)
    return (t.double() * scale).float().to(dtype).double().div(scale).float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.fixture
def one_layer():
    """A 64 -> 32 Linear converted the way training converts it, its fp32 twin, and inputs and
    output gradients whose magnitudes sit far below 1 (amax ~4e-3 and ~4e-7): cast to float8
    without a scale they would mostly underflow (e4m3's smallest subnormal is 2**-9 = 2e-3,
    e5m2's 2**-16 = 1.5e-5), so the test sees whether the scales are applied."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 32, bias=False)  # as tenfold's blocks (model.bias false); a bias would swamp x W
    twin = nn.Linear(64, 32, bias=False)
    twin.load_state_dict(layer.state_dict())
    block = nn.Sequential(layer)
    names = fp8.apply_fp8(block, [block], CPU, emulate=True, fsdp_all_gather=False)
    assert names == ["0"] and type(block[0]).__name__ == "Float8Linear"
    x = torch.randn(48, 64) * 1e-3
    grad_out = torch.randn(48, 32) * 1e-7
    return block, twin, x, grad_out


def test_the_inputs_need_their_scales(one_layer):
    _, _, x, grad_out = one_layer
    assert (x.to(E4M3).float() == 0).float().mean() > 0.5
    assert (grad_out.to(E5M2).float() == 0).float().mean() > 0.9


def test_a_converted_linear_computes_the_scaled_float8_product(one_layer):
    """Forward: x and W each cast to e4m3 with their own scale, multiplied, unscaled. The
    output is within bf16 rounding of that product, and clearly closer to it than to the exact
    fp32 product (so the layer did compute in float8)."""
    block, twin, x, _ = one_layer
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x)
    w = twin.weight.detach()
    float8_product = F.linear(quantized(x, E4M3), quantized(w, E4M3))
    exact = F.linear(x, w)
    assert rel(out, float8_product) < 5e-3
    assert rel(float8_product, exact) > 3 * rel(out, float8_product)


def test_its_gradients_are_the_scaled_float8_products(one_layer):
    """Backward: the output gradient cast to e5m2 with its own scale, times the e4m3 weight
    (input gradient) and the e4m3 input (weight gradient)."""
    block, twin, x, grad_out = one_layer
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x)
    out.backward(grad_out.to(out.dtype))
    go, w = quantized(grad_out.to(out.dtype).float(), E5M2), quantized(twin.weight.detach(), E4M3)
    expected_dx, expected_dw = go @ w, go.t() @ quantized(x.detach(), E4M3)
    assert rel(x.grad, expected_dx) < 1e-2
    assert rel(block[0].weight.grad, expected_dw) < 1e-2
    exact_dx = grad_out @ twin.weight.detach()
    assert rel(expected_dx, exact_dx) > 2 * rel(x.grad, expected_dx)


# --------------------------------------------------------------------------- what is converted


def test_blocks_are_converted_and_the_first_and_last_layers_stay_bf16(tmp_path):
    """The training path (Trainer.setup -> parallelize): the attention projections (64 x 64)
    run in float8, the MLP (d_ff 72, not a multiple of 16) cannot and stays nn.Linear, and so
    do the token embedding and the output head."""
    from tenfold.engine.loop.trainer import Trainer

    cfg = small_config(tmp_path, model={"d_ff": 72}, precision={"dtype": "bf16", "fp8": True, "fp8_emulate": True})
    t = Trainer(cfg)
    t.setup()
    kinds = {name: type(m).__name__ for name, m in t.model.named_modules() if isinstance(m, nn.Linear)}
    for i in (0, 1):
        for proj in ("wq", "wk", "wv", "wo"):
            assert kinds[f"layers.{i}.attn.{proj}"] == "Float8Linear"
        for proj in ("w1", "w2", "w3"):
            assert kinds[f"layers.{i}.mlp.{proj}"] == "Linear"
    assert kinds["output"] == "Linear" and type(t.model.tok_emb) is nn.Embedding
    assert set(t.model.state_dict()) == set(_plain_state_keys(cfg))  # checkpoints keep nn.Linear's keys


def _plain_state_keys(cfg: dict) -> list[str]:
    from tenfold.config import build_config
    from tenfold.models.gpt import GPT

    return list(GPT(build_config(cfg).model_config_resolved()).state_dict())


# --------------------------------------------------------------------------- refusals


def _train(tmp_path: Path, capsys, *flags: str) -> tuple[int, list[str]]:
    code = main(["train", "--out", str(tmp_path / "run"), "--steps", "1", *SMALL_FLAGS, *flags])
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_cpu_without_emulation_is_refused_in_one_line(tmp_path, capsys):
    code, err = _train(tmp_path, capsys, "--fp8")
    assert code == 2 and len(err) == 1
    assert "float8 matmuls" in err[0] and "compute capability >= 8.9" in err[0] and "--fp8-emulate" in err[0]
    assert not (tmp_path / "run").exists()  # nothing half-written


@pytest.mark.parametrize("flags, words", [
    (["--precision", "fp8"], "FP8 is not a dtype here: pass --fp8"),
    (["--fp8", "--fp8-emulate", "--precision", "fp32"], "use --precision bf16 --fp8"),
    (["--fp8", "--fp8-emulate", "--precision", "fp16"], "use --precision bf16 --fp8"),
    (["--fp8-emulate"], "it needs precision.fp8 (--fp8)"),
    (["--fp8", "--fp8-emulate", "--set", "model.d_model=72"], "nothing would run in float8"),
])
def test_what_cannot_run_is_refused_in_one_line(tmp_path, capsys, flags, words):
    code, err = _train(tmp_path, capsys, *flags)
    assert code == 2 and len(err) == 1 and words in err[0], err


def test_tensor_parallel_fp8_is_outside_the_capability_table():
    from tenfold.config import build_config
    from tenfold.run import resolve_run

    cfg = build_config({"precision": {"fp8": True}, "parallel": {"tp_degree": 2}})
    found = capabilities.problems(resolve_run(cfg, 2, check=False))
    assert len(found) == 1 and "torchao's float8 tensor-parallel styles" in found[0]
    assert capabilities.problems(resolve_run(build_config({"precision": {"fp8": True}}), 1)) == []


# --------------------------------------------------------------------------- training


@pytest.mark.slow
def test_tiny_trains_within_2_percent_of_bf16_after_50_steps(tmp_path):
    """`tiny` (4 blocks, d_model 256), 50 steps on short sequences with --fp8 --fp8-emulate and
    without: the fp8 run trained with every block Linear a torchao Float8Linear (and the
    embedding and head not), its losses are not the bf16 run's (float8 matmuls really ran) and
    the loss over its last 5 steps is within 2% of the bf16 run's.
    Mutation: apply_fp8 converting nothing (FP8 silently off) -> no Float8Linear, and losses
    equal to bf16's bit for bit."""
    from torchao.float8.float8_linear import Float8Linear

    from tenfold.engine.loop.trainer import Trainer

    def trained(fp8_on: bool) -> tuple[Trainer, list[float]]:
        cfg = small_config(tmp_path / str(fp8_on), model={"name": "tiny"}, data={"seq_len": 32},
                           train={"steps": 50, "micro_batch": 4, "warmup_steps": 5},
                           precision={"dtype": "bf16", "fp8": fp8_on, "fp8_emulate": fp8_on},
                           checkpoint={"final": False})
        cfg["model"] = {"name": "tiny"}
        trainer = Trainer(cfg)
        trainer.fit()
        return trainer, [row["loss"] for row in read_metrics(Path(cfg["log"]["out"]))]

    (plain, bf16), (converted, float8) = trained(False), trained(True)
    block_linears = [n for b in plain.model.layers.values() for n, m in b.named_modules() if fp8.convertible(m)]
    fp8_layers = [n for n, m in converted.model.named_modules() if isinstance(m, Float8Linear)]
    assert len(block_linears) == 4 * 7 and len(fp8_layers) == len(block_linears)  # wq wk wv wo w1 w3 w2 per block
    assert not any(isinstance(m, Float8Linear) for m in (converted.model.tok_emb, converted.model.output))
    assert len(float8) == len(bf16) == 50 and float8 != bf16
    assert sum(float8[-5:]) < 0.9 * 5 * 5.55  # it learned (ln 256 = 5.55 at the start)
    assert abs(sum(float8[-5:]) - sum(bf16[-5:])) / sum(bf16[-5:]) < 0.02, (float8[-5:], bf16[-5:])


# --------------------------------------------------------------------------- ZeRO-3 on two ranks


@pytest.fixture(scope="module")
def two_rank_fp8(tmp_path_factory):
    return torchrun("zero", tmp_path_factory.mktemp("fp8zero"), timeout=400, worker="fp8_worker.py")


@pytest.fixture(scope="module")
def one_process_fp8(tmp_path_factory):
    """The same global batch in one process: micro 2 x accum 2."""
    out = str(tmp_path_factory.mktemp("fp8ref"))
    return zero_worker.run_steps(fp8_worker.fp8_config(0, 2, 2, out), measure_at=None, steps=fp8_worker.STEPS)[1]


PP_RTOL = 1e-6  # measured: losses identical, gradient norms within 6e-8


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", ["0", "3"])
def test_fp8_zero_on_two_ranks_tracks_one_process(two_rank_fp8, one_process_fp8, stage):
    """Step 1 (the same weights everywhere): loss within 1e-4 and gradient norm within 1e-3 of
    one process. The float8 casts then differ in the last bit here and there (each rank scales
    its own half of the activations; under ZeRO-3 FSDP2 gathers 16-bit norms and biases), and
    Adam turns such differences into full-size steps: steps 2-4 stay within 2%, the size of
    float8's own difference from bf16 on this model (0.7% at step 4)."""
    run, ref = two_rank_fp8[stage], one_process_fp8
    assert run["float8_linears"] == 14  # 7 per block, the head excluded
    assert _rel(run["losses"][0], ref["losses"][0]) < 1e-4
    assert _rel(run["grad_norms"][0], ref["grad_norms"][0]) < 1e-3
    assert max(_rel(a, b) for a, b in zip(run["losses"], ref["losses"])) < 2e-2


@pytest.mark.multiprocess
def test_fp8_pipeline_stages_match_one_process(two_rank_fp8, one_process_fp8):
    """pp 2: each stage converts its own block and runs the one process's micro-batches, so
    every float8 scale is the same as there."""
    run, ref = two_rank_fp8["pp2"], one_process_fp8
    assert run["float8_linears"] == 7  # rank 0's stage: one block
    assert max(_rel(a, b) for a, b in zip(run["losses"], ref["losses"])) < PP_RTOL
    assert max(_rel(a, b) for a, b in zip(run["grad_norms"], ref["grad_norms"])) < PP_RTOL


@pytest.mark.multiprocess
def test_zero3_gathers_float8_weights_with_precomputed_scales(two_rank_fp8):
    """ZeRO-3's shards are torchao's float8-gathered weights, and after the steps each holds a
    scale precomputed in the optimizer's post-step hook; DDP (ZeRO-0) has neither."""
    assert two_rank_fp8["3"]["float8_all_gather"] and two_rank_fp8["3"]["precomputed_scales"] == 14
    assert not two_rank_fp8["0"]["float8_all_gather"] and two_rank_fp8["0"]["precomputed_scales"] == 0


# --------------------------------------------------------------------------- the planner's figures


@pytest.mark.parametrize("gpu, dense_tflops", [("h100-sxm", 1979), ("h100-pcie", 1513), ("h200", 1979), ("b200", 4500)])
def test_fp8_matmul_peaks_are_the_datasheets_dense_figures(gpu, dense_tflops):
    """Datasheets print FP8 'with sparsity'; the catalog keeps the dense half, which on these
    GPUs is twice their dense bf16 peak (to the datasheets' rounding: 1979 vs 2 x 989)."""
    from tenfold.plan.hardware import get_hardware

    hw = get_hardware(gpu)
    assert hw.peak("fp8") == dense_tflops * 1e12
    assert hw.peak("fp8") == pytest.approx(2 * hw.peak("bf16"), rel=2e-3)
    assert "sparsity" in hw.sources["fp8"]


@pytest.mark.parametrize("gpu", ["a100", "a100-40gb", "v100"])
def test_gpus_without_float8_tensor_cores_have_no_fp8_peak(gpu):
    from tenfold.errors import UserError
    from tenfold.plan.hardware import get_hardware, gpu_peak_flops_for_device

    with pytest.raises(UserError, match=r"^--fp8: .* has no float8 matmul peak .*GPUs with one: h100-sxm"):
        get_hardware(gpu).peak("fp8")
    assert gpu_peak_flops_for_device(f"NVIDIA {gpu.upper()}", "fp8") is None


def test_a_hardware_file_carries_the_fp8_peak(tmp_path):
    from tenfold.plan.hardware import get_hardware, hardware_toml, load_hardware_toml

    path = tmp_path / "h200.toml"
    path.write_text(hardware_toml(get_hardware("h200")))
    assert load_hardware_toml(path).peak("fp8") == 1979e12
