"""FP8 training (`--fp8`, config `[precision] fp8 = true`): float8 matmuls through torchao.

What runs in float8: every `nn.Linear` inside the transformer blocks whose two dimensions are
multiples of 16 is swapped for torchao's `Float8Linear` (`torchao.float8.convert_to_float8_training`,
the tensorwise recipe with dynamic scaling: each matmul operand is cast to float8 with the scale
finfo.max / amax of that very tensor, e4m3 for weights and activations, e5m2 for output
gradients; Micikevicius et al. 2022, "FP8 Formats for Deep Learning"). The matmuls run as
`torch._scaled_mm` with fp32 accumulation; everything else (norms, attention core, softmax, the
loss) runs in bf16 autocast as without --fp8, over the same fp32 master weights.

What stays in bf16: the embedding and the output head (everything outside the blocks), as
torchao's float8 README advises for the first and last layers and torchtitan does (its
`filter_fqns=["output"]`), and a Linear with a dimension not a multiple of 16, which float8
tensor cores cannot take (torchtitan's `module_filter_fn`).

FSDP2 (ZeRO-2/3 on several ranks): `enable_fsdp_float8_all_gather` casts each weight shard to
float8 before the all-gather, so parameters travel and sit unsharded at 1 byte per element
instead of 2, and after every optimizer step `precompute_float8_dynamic_scale_for_fsdp`
computes all weight scales in one all-reduce instead of one per weight (torchao's
float8 README, torchtitan's `Float8Converter.post_optimizer_hook`).

Order (engine/parallel/parallelize.py, torchtitan's): conversion comes first, before tensor
parallelism, recompute, compile and FSDP2, which then wrap the converted modules. State-dict
keys are those of nn.Linear, so checkpoints and exports do not change.

Devices: float8 matmuls need CUDA compute capability 8.9 or newer (Ada, Hopper, Blackwell).
Elsewhere --fp8 is refused unless --fp8-emulate asks for the numerics without the speed (for
tests): on a CPU torch's own CPU `torch._scaled_mm` runs the same float8 matmuls; on an older
CUDA GPU torchao's `emulate=True` multiplies the float8 values in fp32.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from tenfold.errors import UserError
from tenfold.quiet import import_quietly

FLAG = "precision.fp8 (--fp8)"
MIN_CAPABILITY = (8, 9)  # the first CUDA architecture with float8 tensor cores (Ada)
# torch._scaled_mm and float8 tensor cores need both matrix dimensions to be multiples of 16.
DIM_MULTIPLE = 16


def has_fp8_matmuls(device: torch.device) -> bool:
    """Whether `device` multiplies float8 matrices in hardware (NVIDIA, compute capability >= 8.9)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def check_supported(device: torch.device, emulate: bool) -> None:
    """Refuse (UserError, before anything is converted or written) FP8 where it cannot run: no
    torchao, or a device without float8 matmuls unless emulation was asked for."""
    if not emulate and not has_fp8_matmuls(device):
        what = "a CPU" if device.type == "cpu" else _device_words(device)
        raise UserError(
            f"{FLAG} needs float8 matmuls (NVIDIA compute capability >= 8.9: H100, H200, B200, L40S, RTX 4090); "
            f"this run is on {what}. Train without --fp8 (bf16), or add --fp8-emulate to check FP8 numerics slowly"
        )
    _torchao_float8()


def _device_words(device: torch.device) -> str:
    if torch.version.hip is not None:
        return f"{torch.cuda.get_device_name(device)} (ROCm)"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def _torchao_float8():
    """torchao.float8, imported without its import-time log lines."""
    return import_quietly("torchao.float8", f"{FLAG} needs torchao: pip install 'tenfold[fp8]'")


def float8_config(device: torch.device, emulate: bool, fsdp_all_gather: bool) -> Any:
    """torchao's tensorwise dynamic-scaling recipe; float8 all-gather under FSDP2; emulated
    matmuls only on a CUDA GPU without float8 tensor cores (a CPU runs torch._scaled_mm)."""
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name("tensorwise")
    emulated = emulate and device.type == "cuda" and not has_fp8_matmuls(device)
    return replace(config, enable_fsdp_float8_all_gather=fsdp_all_gather, emulate=emulated)


def convertible(module: nn.Module) -> bool:
    """A Linear float8 tensor cores can take: both dimensions multiples of 16."""
    return (type(module) is nn.Linear and module.in_features % DIM_MULTIPLE == 0
            and module.out_features % DIM_MULTIPLE == 0)


def apply_fp8(model: nn.Module, blocks: list[nn.Module], device: torch.device, emulate: bool,
              fsdp_all_gather: bool) -> list[str]:
    """Swap the blocks' Linears for torchao Float8Linears in place (the embedding, the head and
    any module outside `blocks` stay as they are). Returns the converted modules' names."""
    float8 = _torchao_float8()
    inside = {id(m) for block in blocks for m in block.modules() if convertible(m)}
    if not inside and blocks:  # (a pipeline stage may hold no block: only the embedding or the head)
        raise UserError(f"{FLAG}: the model's blocks have no Linear layer with both dimensions multiples of "
                        f"{DIM_MULTIPLE}; nothing would run in float8. Train without --fp8")
    names = [name for name, m in model.named_modules() if id(m) in inside]
    float8.convert_to_float8_training(
        model, config=float8_config(device, emulate, fsdp_all_gather),
        module_filter_fn=lambda module, _fqn: id(module) in inside,
    )
    return names


def uses_float8_all_gather(model: nn.Module) -> bool:
    """Whether FSDP2 all-gathers some of the model's weights in float8 (its shards are torchao's
    float8-aware weight tensors)."""
    if "torchao.float8" not in sys.modules:  # no float8 weight without torchao's float8 imported
        return False
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return any(isinstance(getattr(p, "_local_tensor", None), WeightWithDynamicFloat8CastTensor)
               for p in model.parameters())


def precompute_scales_after_steps(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Under float8 all-gather: after each optimizer step, every weight's float8 scale in one
    all-reduce (torchao's `precompute_float8_dynamic_scale_for_fsdp`), which the next forward's
    all-gathers then use instead of reducing each weight's amax on its own. A skipped step
    leaves the weights and so the scales as they were."""
    if not uses_float8_all_gather(model):
        return
    float8 = _torchao_float8()
    optimizer.register_step_post_hook(lambda *_: float8.precompute_float8_dynamic_scale_for_fsdp(model))
