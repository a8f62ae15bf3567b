"""Where a steady-state training step spends its time: torch.profiler over a few steps of one
process, each operator's self time put in one bucket, printed as a table.

    python benchmarks/profile_step.py                    # small, bf16, micro 8, seq 256, eager
    python benchmarks/profile_step.py --compile          # the same with --compile
    python benchmarks/profile_step.py --model tiny --precision fp32 --steps 3

Buckets (self CPU time of the main thread, so nothing is counted twice; intra-op threads work
inside the operator that started them):
  matmul        aten mm/addmm/bmm/linear and oneDNN's linear (forward and backward)
  attention     the SDPA kernel and its backward (flash attention for CPU)
  elementwise   everything else that computes: norms, activations, residual adds, softmax and
                cross-entropy of the loss, dtype casts, embedding, and inductor's fused kernels
                (under --compile they run inside the compiled region)
  optimizer     gradient clipping, AdamW and zero_grad (whatever runs in the step's
                apply-gradients phase, every operator included)
  overhead      framework: autograd engine bookkeeping, views/reshapes/allocations, dispatcher
                and Python time between operators (the step's wall time minus the above)
MFU is model FLOPs/s over the measured bf16/fp32 GEMM peak (tenfold.engine.peak); "matmul
efficiency" divides the matmul FLOPs (6N per token, the parameter matmuls) by the matmul
bucket's time: how close the GEMMs themselves come to the peak.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench_compile import add_shape_arguments  # benchmarks/ is the script's own folder on sys.path
from tenfold.engine.run_outputs import device_peak

OPT_SCOPE = "tenfold: apply gradients"
BUCKETS = ("matmul", "attention", "elementwise", "optimizer", "overhead")
MATMUL = re.compile(r"^(aten::(mm|addmm|bmm|baddbmm|matmul|linear|_addmm_activation)|mkldnn::_linear|"
                    r"aten::mkldnn_linear|onednn|aten::_mkl)")
ATTENTION = re.compile(r"scaled_dot_product|flash_attention|_efficient_attention")
# No arithmetic: views, allocations, bookkeeping; their self time is framework overhead.
NO_MATH = re.compile(r"^aten::(view|_unsafe_view|reshape|as_strided|t|transpose|permute|expand|empty|empty_like|"
                     r"empty_strided|detach|alias|slice|select|split|unsqueeze|squeeze|contiguous|size|stride|"
                     r"lift_fresh|resolve_conj|resolve_neg|is_nonzero|item|_local_scalar_dense|result_type|"
                     r"set_|unbind|chunk|narrow|zeros_like|new_empty|new_empty_strided)$")


def bucket(name: str) -> str:
    if MATMUL.search(name):
        return "matmul"
    if ATTENTION.search(name):
        return "attention"
    if name.startswith(("aten::", "cpp_fused", "Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph",
                        "inductor")) and not NO_MATH.match(name):
        return "elementwise"
    return "overhead"


def trainer_for(a) -> "object":
    from tenfold.engine.trainer import Trainer

    cfg = {"model": {"name": a.model}, "data": {"seq_len": a.seq_len, "val_fraction": 0.0},
           "precision": {"dtype": a.precision},
           "train": {"steps": 1000, "micro_batch": a.micro_batch, "grad_accum": 1, "compile": a.compile},
           "log": {"out": tempfile.mkdtemp(prefix="profile_step-"), "progress": False, "tensorboard": False}}
    trainer = Trainer(cfg)
    trainer.setup()
    apply = trainer.apply_gradients

    def scoped(*args, **kwargs):
        with record_function(OPT_SCOPE):
            return apply(*args, **kwargs)

    trainer.apply_gradients = scoped  # every operator of clip + AdamW + zero_grad lands in "optimizer"
    return trainer


def shares(prof, wall_s: float) -> dict[str, float]:
    """Seconds per bucket: self time of each operator; an operator under the apply-gradients
    scope counts as optimizer; what the profiler saw no operator in is overhead."""
    seconds: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.name.startswith("ProfilerStep"):
            continue
        under_opt, p = e.name == OPT_SCOPE, e.cpu_parent
        while p is not None and not under_opt:
            under_opt, p = p.name == OPT_SCOPE, p.cpu_parent
        seconds["optimizer" if under_opt else bucket(e.name)] += e.self_cpu_time_total / 1e6
    seconds["overhead"] += max(wall_s - sum(seconds.values()), 0.0)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p)
    p.add_argument("--warmup", type=int, default=4, help="steps before profiling (compile and warm-up)")
    p.add_argument("--steps", type=int, default=3, help="steps profiled")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--peak-gflops", type=float, help="the GEMM peak for MFU (default: tenfold.engine.peak's cached "
                   "measurement, which is wrong if it was taken on a busy machine)")
    a = p.parse_args()
    trainer = trainer_for(a)
    for _ in range(a.warmup):
        trainer.train_step(trainer.loader.next_step())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            trainer.train_step(trainer.loader.next_step())
        wall = time.perf_counter() - t0
    seconds = shares(prof, wall)
    step = wall / a.steps
    tokens = trainer.parts.run.tokens_per_step
    peak = a.peak_gflops * 1e9 if a.peak_gflops else (
        device_peak(trainer.dist, trainer.parts.precision.name)[0] or float("nan"))
    mfu = trainer.parts.adapter.flops_per_token * tokens / step / peak
    matmul_eff = 6 * trainer.parts.adapter.param_count * tokens / (seconds["matmul"] / a.steps) / peak
    print(f"# {a.model} {a.precision} micro {a.micro_batch} seq {a.seq_len}, {'compiled' if a.compile else 'eager'}, "
          f"{torch.get_num_threads()} threads, {a.steps} steps profiled after {a.warmup}; load {os.getloadavg()[0]:.2f}")
    print(f"step {step:.3f} s under the profiler, {tokens / step:,.0f} tok/s, MFU {mfu:.1%} of {peak / 1e9:,.0f} GFLOP/s; "
          f"matmul efficiency {matmul_eff:.1%}")
    print(f"| {'bucket':<12} | {'s/step':>7} | {'share':>6} |")
    print(f"|{'-' * 14}|{'-' * 9}|{'-' * 8}|")
    total = sum(seconds.values())
    for b in BUCKETS:
        print(f"| {b:<12} | {seconds[b] / a.steps:>7.3f} | {seconds[b] / total:>6.1%} |")
    print("\ntop operators by self time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))


if __name__ == "__main__":
    main()
