"""Rank-side half of the FP8 + ZeRO tests: run by `python -m torch.distributed.run` from
tests/test_fp8.py, never by pytest itself (no test functions).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/fp8_worker.py zero OUT.json

Every rank trains the ZeRO worker's small model on its token array with --fp8 --fp8-emulate
at ZeRO-0 (DDP: each rank casts the full fp32 weights itself), ZeRO-3 (FSDP2: float8
all-gather of the shards) and as 2 pipeline stages (each converts its own block); rank 0
writes what each run saw.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zero_worker  # noqa: E402

STEPS = 4


def fp8_config(stage: int, micro: int, accum: int, out: str, **parallel) -> dict:
    cfg = zero_worker.config(stage, "bf16", micro, accum, out, **parallel)
    cfg["precision"].update(fp8=True, fp8_emulate=True)
    return cfg


def run(stage: int, micro: int, accum: int, out: str, **parallel) -> dict:
    """Losses and gradient norms of STEPS steps, what the model's float8 layers look like, and
    whether each float8-gathered weight holds a precomputed scale after the steps."""
    from torchao.float8.float8_linear import Float8Linear

    from tenfold.techniques import zero
    from tenfold.techniques.fp8 import uses_float8_all_gather

    t, r = zero_worker.run_steps(fp8_config(stage, micro, accum, out, **parallel), measure_at=None, steps=STEPS)
    model = zero.unwrap(t.model)
    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    scales = [getattr(getattr(m.weight, "_local_tensor", None), "_precomputed_scale", None) for m in linears]
    return {"losses": r["losses"], "grad_norms": r["grad_norms"], "float8_linears": len(linears),
            "float8_all_gather": uses_float8_all_gather(model),
            "precomputed_scales": sum(s is not None for s in scales)}


def mode_zero(out_dir: str) -> dict:
    results = {str(stage): run(stage, 1, 2, out_dir) for stage in (0, 3)}
    results["pp2"] = run(0, 2, 2, out_dir, pp_degree=2)  # the one process's micro-batches, split by stage
    return results


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    from tenfold.engine.parallel.distributed import init_distributed, shutdown

    info = init_distributed()
    results = {"zero": mode_zero}[mode](os.path.dirname(out))
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    shutdown()


if __name__ == "__main__":
    main()
