"""Warm-up and steady state: the summary's tokens/s is the rate once the step time has settled.

The first steps of a run are slower than the rest (allocator growth, oneDNN / cuBLAS kernel
selection, first-touch page faults, lazy initialisation). Averaging them in under-states what
the run sustains, so the summary reports them on their own:

  * the step measured for memory (it runs under a tensor tracker, several times slower) is set
    aside and neither counted in warm-up nor in steady state;
  * reference = the median time of the second half of the remaining steps;
  * warm-up = the leading steps each slower than SETTLE x the reference: it ends at the first
    step within 25% of the reference, even if a later step is slow again (noise is steady
    state too);
  * steady-state tokens/s = the tokens of the steps after the warm-up / their summed step time.

Step times are the optimizer steps themselves (forward, backward, optimizer); evaluation and
checkpoint saves happen between steps and are not in them (summary's wall_s has everything).
With torch.compile, the seconds a step spent compiling (techniques/compile.py's clock) are taken
out of that step's time: compile time is reported on its own, neither as warm-up nor in the rate.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

SETTLE = 1.25  # a step within 25% of the steady reference time has settled


@dataclass(frozen=True)
class StepTime:
    step: int
    seconds: float
    tokens: int
    instrumented: bool = False  # ran under the memory tracker: not representative
    compile_s: float = 0.0  # of `seconds`, spent in torch.compile (reported on its own)

    @property
    def running_s(self) -> float:  # the step without its compile time
        return self.seconds - self.compile_s


def steady_state(times: list[StepTime]) -> dict:
    """{warmup_steps, warmup_s, steady_from_step, steady_steps, steady_s, tokens_per_s,
    reference_step_s, memory_measurement_s} for the steps of this run (module docstring)."""
    plain = [t for t in times if not t.instrumented]
    instrumented_s = sum(t.running_s for t in times if t.instrumented)
    if not plain:
        return {"warmup_steps": 0, "warmup_s": 0.0, "steady_from_step": None, "steady_steps": 0, "steady_s": 0.0, "tokens_per_s": None,
                "reference_step_s": None, "memory_measurement_s": instrumented_s}
    reference = statistics.median(t.running_s for t in plain[len(plain) // 2:])
    warm = 0
    while warm < len(plain) - 1 and plain[warm].running_s > SETTLE * reference:
        warm += 1
    steady = plain[warm:]
    steady_s = sum(t.running_s for t in steady)
    return {
        "warmup_steps": warm, "warmup_s": sum(t.running_s for t in plain[:warm]),
        "steady_from_step": steady[0].step, "steady_steps": len(steady), "steady_s": steady_s,
        "tokens_per_s": sum(t.tokens for t in steady) / steady_s if steady_s > 0 else None,
        "reference_step_s": reference, "memory_measurement_s": instrumented_s,
    }
