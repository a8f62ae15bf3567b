"""Whether PyTorch's tensor tracker works in this torch (tenfold.engine.memory.tensor_tracker measures with it).

`torch.distributed._tools.mem_tracker` is private PyTorch API: it may be missing or changed in a
release tenfold was not tested with (pyproject.toml names the tested range). One tiny step runs
under it first, once per process; without it a run trains on and says memory was not measured.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tenfold.engine.memory.tensor_tracker import measure_cpu

_TRACKER_PROBE: tuple[bool, str | None] | None = None


class _ProbeModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 4))  # no random init: the run's RNG stream is untouched

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def tracker_available() -> tuple[bool, str | None]:
    """(True, None) when torch's tensor tracker works here, else (False, why)."""
    global _TRACKER_PROBE
    if _TRACKER_PROBE is None:
        probe = _ProbeModule()
        opt = torch.optim.SGD(probe.parameters(), lr=0.1)

        def step() -> None:
            probe(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

        try:
            measure_cpu(probe, opt, step, torch.device("cpu"))
            _TRACKER_PROBE = (True, None)
        except Exception as e:  # noqa: BLE001 - any failure of private API means "not usable"
            _TRACKER_PROBE = (False, f"torch {torch.__version__} has no usable torch.distributed._tools.mem_tracker "
                                     f"({type(e).__name__}: {str(e).strip()[:120]})")
    return _TRACKER_PROBE
