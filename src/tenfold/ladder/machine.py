"""This machine as the measured ladder and `tenfold tune` see it: local ranks, device, the
mixed-precision dtype.

torch is imported inside these functions: `tenfold ladder --project` and the ladder's option
checks run on the planner alone, without torch.
"""

from __future__ import annotations

import os


def default_nproc() -> int:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def mixed_dtype() -> str:
    import torch

    from tenfold.techniques.precision import bf16_supported

    return "bf16" if bf16_supported(torch.device(device_type())) else "fp16"
