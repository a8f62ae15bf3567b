"""One optimizer step of tenfold's GPT measured by the tensor tracker (engine.memory.measure), for the
memory and recompute tests: `from memory_runs import measure`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tenfold.engine.memory.measure import measure_step_memory
from tenfold.models.gpt import GPT
from tenfold.models.presets import get_preset
from tenfold.techniques.recompute import apply_recompute


def step_fn(model: GPT, opt: torch.optim.Optimizer, micro: list[torch.Tensor], dtype: str = "fp32"):
    def run_step() -> None:
        tokens = sum(mb[:, 1:].numel() for mb in micro)
        for mb in micro:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                logits = model(mb[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), mb[:, 1:].flatten(), reduction="sum") / tokens
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run_step


def measure(preset: str, policy: str, b: int, s: int, accum: int = 1, dtype: str = "fp32", **shape) -> dict:
    torch.manual_seed(0)
    model = GPT(get_preset(preset).with_overrides(**shape))
    apply_recompute(model, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    micro = [torch.randint(0, 256, (b, s + 1), generator=g) for _ in range(accum)]
    run_step = step_fn(model, opt, micro, dtype)
    run_step()  # warm-up: the optimizer states exist from here on (as in every later step)
    return measure_step_memory(model, opt, run_step)
