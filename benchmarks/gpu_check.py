"""The GPU check: does tenfold reach its targets on this CUDA machine? One command, at most
8 minutes, one JSON file.

    python benchmarks/gpu_check.py [--out gpu_check.json] [--model gpt3-1.3b] [--steps 300]
    make gpu-check

What it runs, each as a plain `tenfold train` (the path users take), bf16, on random-order
default data, the final checkpoint and exports off:

  single   the ~1B preset (`gpt3-1.3b`) on one GPU for `--steps` steps: steady-state MFU
           against the GPU's datasheet bf16 dense peak (tenfold.plan.hardware), and
           `torch.cuda.max_memory_allocated` beside the planner's predicted peak
  zero3    the same model, ZeRO-3 (FSDP2) over every local GPU with NCCL (2 or more GPUs)
  zero3_bf16_reduce  the same with gradients reduced in bf16 (`--reduce-dtype bf16`, FSDP2's
           reduce_dtype: DeepSpeed's default numerics), half the steps
  tp       tensor parallelism over every local GPU (2 or more GPUs, when this tenfold has
           `--tp`; with ZeRO-3 in the data-parallel dimension it is the same launch shape)
  hsdp     hybrid sharding: ZeRO-3 in shard groups of half the GPUs (4 or more GPUs)
  offload  ZeRO-Offload on one GPU: FSDP2's CPUOffloadPolicy, parameters and optimizer on the host
  offload_optimizer  `--offload optimizer` on one GPU (ZeRO-2): AdamW's states and step on the
           host (HostAdamW), the parameter shards on the GPU
  fp8      float8 matmuls in the blocks (torchao), on a GPU with FP8 tensor cores (capability 8.9+)
  hf_pp    a Hugging Face Llama (a ~1B config.json written here, random weights) in 2 pipeline
           stages with ZeRO-1 (2 or more GPUs)

Targets (H100-class GPU): MFU >= 45%, predicted peak memory within 10% of the
measured one. Each check gets what is left of the 8-minute budget (`--budget-s`); one that
runs out is recorded as `timeout`, the others still run. Without CUDA nothing is trained: the
file records why (CI runs only the argument and schema checks, tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCHEMA = "tenfold.gpu_check/1"
MFU_TARGET = 0.45
MEMORY_TOLERANCE = 0.10
CHECK_KEYS = {"name", "nproc", "command", "status", "wall_s", "tokens_per_s", "mfu", "peak_mem_bytes",
              "predicted_peak_bytes", "memory_error", "targets"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check.json", help="the JSON file written (default: %(default)s)")
    p.add_argument("--model", default="gpt3-1.3b", help="a tenfold preset of about 1B parameters")
    p.add_argument("--steps", type=int, default=300, help="steps of the single-GPU run")
    p.add_argument("--multi-steps", type=int, default=100, help="steps of the ZeRO-3 and TP runs")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of all checks")
    args = p.parse_args(argv)
    for name in ("steps", "multi_steps", "micro_batch", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.budget_s <= 0:
        p.error("--budget-s must be positive")
    return args


def tenfold_has_tp() -> bool:
    from tenfold.config import ParallelSection

    return "tp_degree" in ParallelSection.model_fields


# A ~1B Llama (transformers' LlamaForCausalLM config) for the Hugging Face pipeline check.
HF_LLAMA_1B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
               "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
               "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def plan_checks(args: argparse.Namespace, n_gpus: int, has_tp: bool, fp8: bool = False) -> list[dict]:
    """(name, nproc, extra flags, steps) of each check this machine can run. `fp8`: the GPU has
    FP8 tensor cores."""
    short = max(1, args.multi_steps // 2)
    checks = [{"name": "single", "nproc": 1, "flags": [], "steps": args.steps},
              {"name": "offload", "nproc": 1, "flags": ["--zero", "3", "--offload", "optimizer+params"], "steps": short},
              {"name": "offload_optimizer", "nproc": 1, "flags": ["--zero", "2", "--offload", "optimizer"], "steps": short}]
    if fp8:
        checks.append({"name": "fp8", "nproc": 1, "flags": ["--fp8"], "steps": args.multi_steps})
    if n_gpus >= 2:
        checks.append({"name": "zero3", "nproc": n_gpus, "flags": ["--zero", "3"], "steps": args.multi_steps})
        checks.append({"name": "zero3_bf16_reduce", "nproc": n_gpus, "flags": ["--zero", "3", "--reduce-dtype", "bf16"],
                       "steps": short})
        if has_tp:
            checks.append({"name": "tp", "nproc": n_gpus, "flags": ["--tp", str(n_gpus)], "steps": args.multi_steps})
        checks.append({"name": "hf_pp", "nproc": 2, "flags": ["--pp", "2", "--zero", "1", "--grad-accum", "4"],
                       "steps": short, "hf_config": HF_LLAMA_1B})
    if n_gpus >= 4 and n_gpus % 2 == 0:
        checks.append({"name": "hsdp", "nproc": n_gpus, "flags": ["--zero", "3", "--shard-group", str(n_gpus // 2)],
                       "steps": args.multi_steps})
    return checks


def train_command(args: argparse.Namespace, check: dict, out_dir: str) -> list[str]:
    if check.get("hf_config"):  # the model from a config.json written beside the run
        config = Path(out_dir) / "hf_config.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(check["hf_config"]))
        model = ["--hf-config", str(config)]
    else:
        model = ["--model", args.model]
    accum = [] if "--grad-accum" in check["flags"] else ["--grad-accum", "1"]
    cmd = [sys.executable, "-m", "tenfold", "train", *model, "--precision", "bf16",
           "--steps", str(check["steps"]), "--micro-batch", str(args.micro_batch), *accum,
           "--seq-len", str(args.seq_len), "--out", out_dir, "--no-progress",
           "--set", "train.eval_every=0", "--set", "train.eval_batches=1", "--set", "log.tensorboard=false"]
    if check["nproc"] > 1:
        cmd += ["--nproc", str(check["nproc"])]
    return cmd + check["flags"]


def check_result(check: dict, command: list[str], status: str, wall_s: float, summary: dict | None) -> dict:
    """One check's record (CHECK_KEYS) from tenfold's summary.json."""
    final = (summary or {}).get("final", {})
    memory = (summary or {}).get("memory", {})
    measured = memory.get("peak_mem_bytes")
    predicted = (memory.get("predicted") or {}).get("peak_bytes")
    error = (predicted - measured) / measured if measured and predicted else None
    mfu = final.get("mfu")
    return {
        "name": check["name"], "nproc": check["nproc"], "command": " ".join(command), "status": status,
        "wall_s": round(wall_s, 1), "tokens_per_s": final.get("tokens_per_s"), "mfu": mfu,
        "peak_mem_bytes": measured, "predicted_peak_bytes": predicted, "memory_error": error,
        "targets": {"mfu": None if mfu is None else mfu >= MFU_TARGET,
                    "memory": None if error is None else abs(error) <= MEMORY_TOLERANCE},
    }


def run_check(args: argparse.Namespace, check: dict, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        command = train_command(args, check, out_dir)
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=max(timeout_s, 1.0))
            status = "ok" if proc.returncode == 0 else "failed"
            if status == "failed":
                print(f"{check['name']} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        except subprocess.TimeoutExpired:
            status = "timeout"
        summary_path = Path(out_dir) / "summary.json"
        summary = json.loads(summary_path.read_text()) if status == "ok" and summary_path.is_file() else None
        return check_result(check, command, status, time.perf_counter() - start, summary)


def validate_report(report: dict) -> None:
    """Raise ValueError unless `report` has the shape this script writes."""
    for key in ("schema", "date", "host", "cuda", "checks"):
        if key not in report:
            raise ValueError(f"gpu_check report: missing {key!r}")
    if report["schema"] != SCHEMA:
        raise ValueError(f"gpu_check report: schema {report['schema']!r}, expected {SCHEMA!r}")
    if not report["cuda"] and not report.get("skipped"):
        raise ValueError("gpu_check report: no CUDA and no reason why nothing ran")
    for check in report["checks"]:
        missing = CHECK_KEYS - set(check)
        if missing:
            raise ValueError(f"gpu_check report: check {check.get('name')!r} lacks {sorted(missing)}")
        if check["status"] not in ("ok", "failed", "timeout"):
            raise ValueError(f"gpu_check report: status {check['status']!r}")


def machine(torch) -> dict:
    cuda = torch.cuda.is_available()
    return {"schema": SCHEMA, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
            "torch": torch.__version__, "cuda": cuda, "gpus": torch.cuda.device_count() if cuda else 0,
            "gpu": torch.cuda.get_device_name(0) if cuda else None}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    report = {**machine(torch), "targets": {"mfu": MFU_TARGET, "memory_tolerance": MEMORY_TOLERANCE}, "checks": []}
    if not report["cuda"]:
        report["skipped"] = "no CUDA device: nothing trained (the check needs an NVIDIA GPU and a CUDA build of torch)"
        print(f"gpu_check: {report['skipped']}")
    else:
        deadline = time.perf_counter() + args.budget_s
        fp8 = torch.cuda.get_device_capability(0) >= (8, 9)
        for check in plan_checks(args, report["gpus"], tenfold_has_tp(), fp8):
            report["checks"].append(run_check(args, check, deadline - time.perf_counter()))
            print(json.dumps(report["checks"][-1]), flush=True)
    validate_report(report)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"gpu_check: wrote {args.out}")
    return report


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
