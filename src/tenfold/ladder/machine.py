"""This machine as the measured ladder and `tenfold tune` see it: local ranks, device, the
mixed-precision dtype.

torch is imported inside these functions: `tenfold ladder --project` and the ladder's option
checks run on the planner alone, without torch.
"""

from __future__ import annotations

import os

from tenfold.host import bf16_pays


def default_nproc() -> int:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def mixed_precision() -> tuple[str, str | None]:
    """The ladder's 16-bit dtype and, where no 16-bit format pays here, why its mixed-precision
    rung is skipped: bf16, fp16 on a device without bf16 autocast, and on a CPU without bf16
    matrix instructions none (bf16 then runs through conversions, fp16 has no fast kernels on
    any CPU), so the rungs after it train in fp32, as `tenfold train`'s `auto` does there."""
    import torch

    from tenfold.techniques.precision import bf16_supported

    device = device_type()
    if not bf16_pays(on_cpu=device == "cpu"):
        return "fp32", ("this CPU has no bf16 matrix instructions (avx512_bf16, amx_bf16): its bf16 matmuls run "
                        "through conversions, many times slower than fp32, and fp16 has no fast CPU kernels; "
                        "the rungs after this one train in fp32")
    return ("bf16" if bf16_supported(torch.device(device)) else "fp16"), None
