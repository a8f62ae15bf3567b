"""Rank-side half of the ZeRO tests: run by `python -m torch.distributed.run` from
tests/test_zero.py and tests/test_distributed.py, never by pytest itself (no test functions).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/zero_worker.py MODE OUT.json

Every rank builds the `Trainer` on the same random token array and runs steps; rank 0
writes one JSON file with what every rank saw (losses, memory per rank, skip flags).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

MODEL = {"name": "tiny", "n_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 128, "max_seq_len": 32}
SEQ, ROWS, STEPS = 32, 64, 4


def token_array(seed: int = 0) -> np.ndarray:
    """Learnable rows (an arithmetic progression mod 50 from a random start) so that the loss
    falls and a wrong gradient shows in the curve."""
    starts = np.random.default_rng(seed).integers(0, 50, size=(ROWS, 1))
    return ((starts + 3 * np.arange(SEQ + 1)) % 50).astype(np.int64)


def config(stage: int, dtype: str, micro: int, accum: int, out: str, **parallel) -> dict:
    return {
        "model": dict(MODEL),
        "data": {"seq_len": SEQ, "val_fraction": 0.0},
        "train": {"steps": STEPS, "micro_batch": micro, "grad_accum": accum, "lr": 1e-2,
                  "warmup_steps": 0, "eval_every": 0, "seed": 7, "grad_clip": 1.0},
        "precision": {"dtype": dtype},
        # threshold 0: every FSDP2 unit of this small model is resharded at stage 3 (with
        # DeepSpeed's default 1e5 all of them would stay gathered, making stage 3 = stage 2)
        "parallel": {"zero_stage": stage, "param_persistence_threshold": 0, **parallel},
        "log": {"out": out, "progress": False, "tensorboard": False},
    }


def run_steps(cfg, measure_at: int | None = 1, steps: int = STEPS):
    """Losses of STEPS steps, plus this rank's model-state bytes at the optimizer step, the
    memory engineer's `measure_step_memory` of step `measure_at` (0-based), the collectives
    of the last step counted, and its reductions as the backend ran them (`reductions`)."""
    from tenfold.engine.memory.measure import measure_step_memory
    from tenfold.engine.loop.trainer import Trainer
    from tenfold.techniques import zero

    t = Trainer(cfg, dataset=token_array())
    t.setup()
    at_step: dict = {}
    t.optimizer.register_step_pre_hook(lambda *_: at_step.update(zero.model_state_bytes(t.model, t.optimizer)))
    losses, grad_norms, measured, collectives, reductions = [], [], None, {}, []
    for i in range(steps):
        mbs = t.loader.next_step()
        box = []
        if i == measure_at:
            measured = measure_step_memory(t.model, t.optimizer, lambda: box.append(t.train_step(mbs)), t.dist.device)
        else:
            last = i == steps - 1
            with counted_collectives(collectives if last else {}), backend_reductions(reductions if last else None):
                box.append(t.train_step(mbs))
        losses.append(box[0].loss)
        grad_norms.append(box[0].grad_norm)
    return t, {"losses": losses, "grad_norms": grad_norms, "state_bytes": dict(at_step), "measured": measured,
               "collectives": collectives, "reductions": reductions}


COUNTED = ("all_gather_single", "reduce_scatter_single", "broadcast", "all_reduce")  # what FSDP2 calls


class counted_collectives:
    """Count the torch.distributed collectives FSDP2, ZeroRedundancyOptimizer and tenfold call
    from Python while the block runs (DDP's bucket all-reduces run in C++, uncounted)."""

    def __init__(self, counts: dict):
        self.counts = counts

    def __enter__(self):
        import torch.distributed as dist

        self.saved = {name: getattr(dist, name) for name in COUNTED}
        for name, fn in self.saved.items():
            setattr(dist, name, self._counting(name, fn))

    def _counting(self, name, fn):
        def call(*args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self.saved.items():
            setattr(dist, name, fn)


class backend_reductions:
    """The reductions the process group itself ran while the block runs, as torch.profiler
    records them (`gloo:all_reduce`, `nccl:reduce_scatter`, ...: the backend's own events, so
    DDP's C++ bucket all-reduces are seen as well as FSDP2's and a comm hook's): one
    [name, dtype, numel] per call. `out` None: nothing is recorded."""

    def __init__(self, out: list | None):
        self.out = out

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True) if self.out is not None else None
        if self.prof is not None:
            self.prof.__enter__()

    def __exit__(self, *exc):
        if self.prof is None:
            return
        self.prof.__exit__(*exc)
        for e in self.prof.events():
            backend, _, op = e.name.partition(":")
            if backend in ("gloo", "nccl") and "reduce" in op and e.input_dtypes:
                self.out.append([e.name, e.input_dtypes[0], int(np.prod(e.input_shapes[0]))])


def mode_equivalence(out_dir: str) -> dict:
    """Each stage, fp32 and bf16, micro 1 x accum 2 per rank; memory measured in fp32."""
    results = {}
    for dtype in ("fp32", "bf16"):
        for stage in (0, 1, 2, 3):
            _, r = run_steps(config(stage, dtype, 1, 2, out_dir), measure_at=1 if dtype == "fp32" else None)
            results[f"{stage}-{dtype}"] = r
    # ZeRO-2 with one FSDP2 unit per block (a 1-element bucket) instead of CPU's grouped blocks
    results["2-fp32-per-block"] = run_steps(config(2, "fp32", 1, 2, out_dir, reduce_bucket_size=1), measure_at=None)[1]
    for stage in (2, 3):  # recompute wraps the blocks before FSDP2 shards them (parallelize's order)
        cfg = config(stage, "fp32", 1, 2, out_dir)
        cfg["recompute"] = {"policy": "full"}
        results[f"{stage}-fp32-ac"] = run_steps(cfg, measure_at=None)[1]
    results["init_sync"] = init_sync()
    results["fp16_overflow"] = mode_fp16_overflow(out_dir)
    for stage in (2, 3):  # FSDP2's MixedPrecisionPolicy: bf16 all-gather/compute, fp32 shards
        with forced_param_dtype(torch.bfloat16):
            _, r = run_steps(config(stage, "bf16", 1, 2, out_dir))
        results[f"{stage}-bf16-params"] = r
    return results


def init_sync() -> dict:
    """Ranks that initialise DIFFERENTLY (seeded by rank) must all train rank 0's weights
    after apply_zero: DDP broadcasts them, for FSDP2 apply_zero does."""
    from tenfold.config import ParallelSection
    from tenfold.engine.parallel.distributed import init_distributed
    from tenfold.models.gpt import GPT
    from tenfold.models.presets import get_preset
    from tenfold.techniques import zero

    info = init_distributed()
    m = dict(MODEL)
    shape = get_preset(m.pop("name")).with_overrides(**m)
    out = {}
    for stage in (0, 2, 3):
        torch.manual_seed(100 + info.rank)
        model = GPT(shape)
        before = float(sum(p.double().sum() for p in model.parameters()))
        wrapped = zero.apply_zero(model, ParallelSection(zero_stage=stage), info)
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in zero.unwrap(wrapped).parameters()]
        out[str(stage)] = {"before": before, "after": float(sum(p.double().sum() for p in full))}
    return out


class forced_param_dtype:
    """Make `parallelize` hand `param_dtype` to apply_zero (whatever it passes itself)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        from tenfold.techniques import zero

        self.orig = zero.apply_zero
        zero.apply_zero = lambda *a, param_dtype=None, **kw: self.orig(*a, param_dtype=self.dtype, **kw)

    def __exit__(self, *exc):
        from tenfold.techniques import zero

        zero.apply_zero = self.orig


def mode_reduce_dtype(out_dir: str) -> dict:
    """Each stage and precision, micro 1 x accum 2 per rank: tenfold's default reduction, and
    a DeepSpeed JSON with `communication_data_type: bf16` read as `--deepspeed` reads it."""
    from tenfold.config import build_config
    from tenfold.deepspeed_json import load_deepspeed_json

    results = {}
    for stage in (0, 1, 2, 3):
        for dtype in ("fp32", "bf16"):
            ds = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"},
                  "communication_data_type": "bf16"}
            path = os.path.join(out_dir, f"ds-{stage}-{dtype}-{os.environ.get('RANK', '0')}.json")
            with open(path, "w") as f:
                json.dump(ds, f)
            base = config(stage, dtype, 1, 2, out_dir)
            results[f"{stage}-{dtype}"] = run_steps(build_config(base), measure_at=None)[1]
            results[f"{stage}-{dtype}-ds-bf16"] = run_steps(
                build_config(base, load_deepspeed_json(path).layer), measure_at=None)[1]
    return results


def mode_memory(out_dir: str) -> dict:
    """Model states per rank at each stage (fp32, one micro-batch, two steps: the second is
    measured, when the optimizer states exist), for the 1/N checks on larger worlds."""
    return {str(s): run_steps(config(s, "fp32", 1, 1, out_dir), measure_at=1, steps=2)[1] for s in (0, 1, 2, 3)}


def mode_fp16_overflow(out_dir: str) -> dict:
    """fp16 at stage 0 and 3: rank 1 alone gets an inf gradient at step 2 (index 1)."""
    from tenfold.engine.loop.trainer import Trainer

    results = {}
    for stage in (0, 3):
        t = Trainer(config(stage, "fp16", 1, 2, out_dir), dataset=token_array())
        t.setup()
        rows = []
        for i in range(3):
            loss, tokens = t.accumulate_gradients(t.loader.next_step())
            if i == 1 and t.dist.rank == 1:
                p = next(p for p in t.model.parameters() if p.grad is not None)
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                g.view(-1)[0] = float("inf")
            before = [p.detach().clone() for p in t.model.parameters()]
            r = t.apply_gradients(loss, tokens)
            changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, t.model.parameters()))
            rows.append({"skipped": r.skipped, "scale": t.scaler.scale, "weights_changed": changed})
        results[str(stage)] = rows
    return results


def mode_timeout(out_dir: str) -> dict:
    """After `tighten_timeouts(3 s)`, a collective that one rank never joins raises on the
    other within the bound instead of hanging for `parallel.timeout_s`."""
    import torch.distributed as dist

    from tenfold.engine.parallel.distributed import init_distributed, tighten_timeouts

    info = init_distributed(1, 600.0)
    tighten_timeouts(info, 3.0)
    if info.rank == 1:
        time.sleep(12)  # a hung rank
        os._exit(0)
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
        outcome = "no error"
    except Exception as e:  # gloo: "Timed out waiting ... for recvValue to finish"
        outcome = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return {"elapsed_s": time.perf_counter() - t0, "outcome": outcome, "os_exit": True}


def main() -> None:
    mode, out_path = sys.argv[1], sys.argv[2]
    out_dir = os.path.dirname(out_path)
    result = {"equivalence": mode_equivalence, "memory": mode_memory, "reduce_dtype": mode_reduce_dtype,
              "fp16_overflow": mode_fp16_overflow, "timeout": mode_timeout}[mode](out_dir)
    if result.pop("os_exit", False):  # the peer is gone; write and leave without a barrier
        with open(out_path, "w") as f:
            json.dump({"0": result}, f)
        os._exit(0)
    write_per_rank(result, out_path)


def write_per_rank(result: dict, out_path: str) -> None:
    """Rank 0 writes every rank's `result` as {rank: result} (a collective: every rank calls it)."""
    from tenfold.engine.parallel.distributed import gather_to_main, init_distributed

    info = init_distributed()
    per_rank = gather_to_main(result, info)
    if info.is_main:
        with open(out_path, "w") as f:
            json.dump({str(r): v for r, v in enumerate(per_rank)}, f)


if __name__ == "__main__":
    main()
