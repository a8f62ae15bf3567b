"""tenfold ZeRO vs DeepSpeed ZeRO on a Hugging Face Llama-style model, side by side: tokens/s
and peak resident memory per rank at ZeRO 1, 2 and 3 in fp32 and bf16, as ratios measured in
one run, both ways: at equal numerics and at DeepSpeed's own.

    pip install -e '.[bench]'            # DeepSpeed (optional; the benchmark says so if absent)
    python benchmarks/bench_zero_vs_deepspeed.py                    # both tables, 9 cells
    python benchmarks/bench_zero_vs_deepspeed.py --stages 2 --precisions bf16 --numerics equal

The model is `transformers.LlamaForCausalLM` built from the config dict `LLAMA` below (about
20M parameters; nothing is downloaded), the same random weights for both engines (one seed,
one builder: tenfold.models.hf.build_hf_model), fed the same micro-batches (tenfold's loader),
2 ranks under torchrun (gloo on CPU, one thread per rank), micro-batch 2, gradient accumulation
2, sequence 256, AdamW (same two groups and hyper-parameters), gradient clipping 1.0.
"The same config" is DeepSpeed's JSON keys as a user would pass them:
`zero_optimization.stage`, `bf16.enabled`, batch sizes, clipping; each engine keeps its own
defaults for everything else (bucket sizes, overlap_comm, persistence threshold).

Numerics (`--numerics`), the one default in which the engines differ: the dtype gradients are
reduced in. DeepSpeed's `communication_data_type` defaults to the model dtype (bf16 gradients
are reduced in bf16), tenfold's `parallel.reduce_dtype` to fp32.
  equal      DeepSpeed with `communication_data_type: fp32`, tenfold's default: both reduce in
             fp32 (ZeRO x fp32/bf16 cells)
  deepspeed  DeepSpeed's default, tenfold with `--reduce-dtype bf16`: both reduce bf16
             gradients in bf16 (bf16 cells only; in fp32 DeepSpeed's default is fp32, i.e.
             the equal-numerics cell)
DeepSpeed's bf16 mode holds the model in bf16 (fp32 master weights in its ZeRO optimizer);
tenfold's keeps fp32 weights and runs the forward under autocast (FSDP2 gathers bf16 copies).

Throughput: both engines are built in the SAME two processes and their optimizer steps
alternate (tenfold, DeepSpeed, DeepSpeed, tenfold, ...), so a shared machine's drifting load
slows both alike; `--speed-repeats` such launches per cell, the cells of both tables
interleaved stage by stage. A step's time is the slowest rank's (the job runs at its pace);
tokens/s "best" = global tokens per step / the fastest such step after `--warmup` over all
launches of the cell (best-of: what the engine does when the machine lets it), "median" = the
same over the median step.

Memory: one engine per launch (the two engines' buffers would mix in one process), DeepSpeed
and tenfold launches alternating. Peak memory per rank = the process's peak resident set
(VmHWM, reset once imports and data are in memory) minus its resident set at that moment:
what building the model + engine + training added, allocator slack included, for both alike.
The larger of the ranks is reported.

The first-step loss of each engine is printed beside the table: both train the same model on
the same batch, so they must agree (to bf16 rounding in bf16). The load average (`uptime`) is
printed with every table and every cell.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA = {
    "model_type": "llama", "vocab_size": 8192, "hidden_size": 384, "intermediate_size": 1024,
    "num_hidden_layers": 8, "num_attention_heads": 6, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "hidden_act": "silu",
}
SEED = 7
PRECISIONS = ("fp32", "bf16")
# numerics -> (tenfold parallel.reduce_dtype, DeepSpeed communication_data_type; None: its default)
NUMERICS = {"equal": ("fp32", "fp32"), "deepspeed": ("bf16", None)}
TARGETS = {"equal": (1.10, 1.0), "deepspeed": (1.0, None)}  # (tokens/s ratio >=, peak RSS ratio <=)


# --------------------------------------------------------------------------- rank side


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); return that RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _rss_bytes("VmRSS")


def _tokens(args):
    import numpy as np

    rows = args.global_batch * (args.steps + args.warmup + 1)
    return np.random.default_rng(0).integers(0, LLAMA["vocab_size"], size=(rows, args.seq + 1)).astype(np.int64)


def _tenfold_config(args) -> dict:
    return {
        "model": {"hf_config": args.hf_config},
        "data": {"val_fraction": 0.0},
        "train": {"steps": args.steps + args.warmup, "micro_batch": args.micro, "grad_accum": args.accum,
                  "lr": 1e-3, "warmup_steps": 0, "eval_every": 0, "seed": SEED, "grad_clip": 1.0},
        "precision": {"dtype": args.precision},
        "parallel": {"zero_stage": args.stage, "reduce_dtype": args.reduce_dtype},
        "log": {"out": args.tmp, "progress": False, "tensorboard": False},
        "checkpoint": {"final": False},
    }


def tenfold_stepper(args, data):
    """A function that runs one tenfold optimizer step and returns (seconds, loss)."""
    from tenfold.engine.loop.trainer import Trainer

    t = Trainer(_tenfold_config(args), dataset=data)
    t.setup()

    def step() -> tuple[float, float]:
        mbs = t.loader.next_step()
        t0 = time.perf_counter()
        result = t.train_step(mbs)
        return time.perf_counter() - t0, result.loss

    return step


def deepspeed_stepper(args, data):
    """A function that runs one DeepSpeed optimizer step (all micro-batches) and returns
    (seconds, loss). The micro-batches come from tenfold's loader: the same rows, in the same
    order, on the same rank as tenfold's run."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from tenfold.data.loader import GlobalBatchLoader
    from tenfold.models.hf import build_hf_model
    from tenfold.techniques.optimizer import param_groups

    torch.manual_seed(SEED)
    model = build_hf_model(args.hf_config)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.accum,
        "zero_optimization": {"stage": args.stage}, "gradient_clipping": 1.0,
        "bf16": {"enabled": args.precision == "bf16"},
    }
    if args.ds_communication_dtype != "default":  # DeepSpeed's default is the model dtype (bf16 in bf16)
        ds_config["communication_data_type"] = args.ds_communication_dtype
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = GlobalBatchLoader(data, args.global_batch, args.micro, args.accum, rank, world, seed=SEED)

    def step() -> tuple[float, float]:
        mbs = loader.next_step()
        t0 = time.perf_counter()
        total = 0.0
        for mb in mbs:
            logits = engine(input_ids=mb["input_ids"], use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), mb["labels"].flatten())
            engine.backward(loss)
            engine.step()
            total += float(loss)
        return time.perf_counter() - t0, total / len(mbs)

    return step


STEPPERS = {"tenfold": tenfold_stepper, "deepspeed": deepspeed_stepper}


def _run_interleaved(args, data) -> dict:
    """Both engines in these processes, steps alternating: throughput only. Every timed
    step's seconds on this rank (the driver takes the slowest rank's per step)."""
    steppers = {name: make(args, data) for name, make in STEPPERS.items()}
    times: dict[str, list[float]] = {name: [] for name in steppers}
    first_loss: dict[str, float] = {}
    for i in range(args.steps + args.warmup):
        for name in (("tenfold", "deepspeed") if i % 2 == 0 else ("deepspeed", "tenfold")):
            seconds, loss = steppers[name]()
            times[name].append(seconds)
            first_loss.setdefault(name, loss)
    profiles = {f"{k}_profile": profile_steps(step, args.profile) for k, step in steppers.items()} if args.profile else {}
    return {**{f"{k}_step_s": v[args.warmup:] for k, v in times.items()},
            **{f"{k}_first_loss": v for k, v in first_loss.items()}, **profiles}


# The collectives' own operators and the waits on them (c10d's dispatcher ops, gloo's and
# DeepSpeed's comm ops, FSDP2's and ZeroRedundancyOptimizer's calls into them).
COMMUNICATION = re.compile(r"^(c10d|gloo|nccl|deepspeed[._]comm)|all_?reduce|all_?gather|reduce_?scatter|"
                           r"\bwait\b|record_param_comms|shm_", re.IGNORECASE)


def profile_steps(step, n: int) -> dict[str, float]:
    """Seconds per step in each bucket of benchmarks/profile_step.py (matmul, attention,
    elementwise, overhead), with the collectives' operators taken out as `communication`;
    what no operator accounts for (Python, waits the profiler does not see) is overhead."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    from profile_step import bucket  # benchmarks/ is the script's own folder on sys.path

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        wall = time.perf_counter() - t0
    seconds: dict[str, float] = defaultdict(float)
    for e in prof.events():
        seconds["communication" if COMMUNICATION.search(e.name) else bucket(e.name)] += e.self_cpu_time_total / 1e6
    seconds["overhead"] += max(wall - sum(seconds.values()), 0.0)
    return {k: v / n for k, v in {"wall": wall, **seconds}.items()}


def rank_main(args) -> None:
    import torch  # noqa: F401  (imports before the RSS baseline)

    import tenfold.engine.loop.trainer  # noqa: F401

    import deepspeed  # noqa: F401  (every launch imports it: the same RSS baseline)
    import torch.distributed as dist
    import transformers  # noqa: F401

    data = _tokens(args)
    base = _reset_peak_rss()
    if args.engine == "interleaved":
        result = _run_interleaved(args, data)
    else:
        step = STEPPERS[args.engine](args, data)
        times = [step()[0] for _ in range(args.steps + args.warmup)]
        result = {"step_s": statistics.median(times[args.warmup:]), "peak_rss_bytes": _rss_bytes("VmHWM") - base}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, result)
    if dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps(out))


# --------------------------------------------------------------------------- driver


def load_text() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f}"


def launch(engine: str, cell: dict, args, tmp: str) -> dict | None:
    stage, precision, numerics = cell["stage"], cell["precision"], cell["numerics"]
    reduce_dtype, ds_comm = cell["reduce_dtype"], cell["ds_communication_dtype"] or "default"
    out = Path(tmp) / f"{engine}-{stage}-{precision}-{numerics}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           __file__, "--rank-side", "--engine", engine, "--stage", str(stage), "--precision", precision,
           "--json", str(out), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--micro", str(args.micro), "--accum", str(args.accum), "--seq", str(args.seq),
           "--hf-config", args.hf_config, "--tmp", tmp, "--ds-communication-dtype", ds_comm,
           "--reduce-dtype", reduce_dtype, "--profile", str(args.profile)]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"{engine} ZeRO-{stage} {precision} ({numerics}) failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    ranks = json.loads(out.read_text())
    if engine == "interleaved":  # per step, the slowest rank's time: the job runs at its pace
        steps = {e: [max(r[f"{e}_step_s"][i] for r in ranks) for i in range(args.steps)] for e in STEPPERS}
        profiles = {f"{e}_profile": [r[f"{e}_profile"] for r in ranks] for e in STEPPERS if f"{e}_profile" in ranks[0]}
        return {"steps": steps, **profiles, **{f"{e}_first_loss": ranks[0][f"{e}_first_loss"] for e in STEPPERS}}
    tokens = args.global_batch * args.seq
    return {"tokens_per_s": tokens / max(r["step_s"] for r in ranks),
            "peak_bytes_per_rank": max(r["peak_rss_bytes"] for r in ranks)}


def measure_speed(cell: dict, args, tmp: str) -> dict | None:
    """`--speed-repeats` interleaved launches; every timed step pooled per engine."""
    pooled: dict[str, list[float]] = {e: [] for e in STEPPERS}
    first = None
    for _ in range(args.speed_repeats):
        got = launch("interleaved", cell, args, tmp)
        if got is None:
            return None
        first = first or got
        for e in STEPPERS:
            pooled[e] += got["steps"][e]
    tokens = args.global_batch * args.seq
    return {**{f"{e}_best": tokens / min(v) for e, v in pooled.items()},
            **{f"{e}_median": tokens / statistics.median(v) for e, v in pooled.items()},
            **{k: v for k, v in first.items() if k.endswith(("_first_loss", "_profile"))}}


def measure_memory(cell: dict, args, tmp: str) -> dict | None:
    """One engine per launch, DeepSpeed and tenfold alternating, `--repeats` of each, median."""
    rss: dict[str, list[int]] = {e: [] for e in STEPPERS}
    for i in range(args.repeats):
        for engine in (("deepspeed", "tenfold") if i % 2 == 0 else ("tenfold", "deepspeed")):
            got = launch(engine, cell, args, tmp)
            if got is None:
                return None
            rss[engine].append(got["peak_bytes_per_rank"])
    return {f"{e}_peak_rss_bytes": statistics.median(v) for e, v in rss.items()}


def measure_cell(cell: dict, args, tmp: str) -> dict | None:
    load = load_text()
    speed = measure_speed(cell, args, tmp)
    memory = measure_memory(cell, args, tmp) if speed is not None and not args.skip_memory else {}
    if speed is None or memory is None:
        return None
    return {**cell, **speed, **memory, "load": f"{load} -> {load_text()}"}


def cells_for(args) -> list[dict]:
    """Stage by stage, every (numerics, precision) cell of both tables, so that the two
    tables see the same stretch of the machine's load."""
    cells = []
    for stage in args.stages:
        for numerics in args.numerics:
            for precision in args.precisions:
                if numerics == "deepspeed" and precision != "bf16":
                    continue  # DeepSpeed reduces fp32 gradients in fp32: the equal-numerics cell
                reduce_dtype, ds_comm = NUMERICS[numerics]
                cells.append({"stage": stage, "precision": precision, "numerics": numerics,
                              "reduce_dtype": reduce_dtype, "ds_communication_dtype": ds_comm})
    return cells


HEADER = ("| ZeRO | precision | reduced in | tok/s best (t / DS) | **tok/s ratio** best | median | "
          "MiB/rank (t / DS) | **memory ratio** | first loss (t / DS) | load 1/5/15 min |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def row_text(c: dict) -> str:
    mib = 2**20
    best = c["tenfold_best"] / c["deepspeed_best"]
    median = c["tenfold_median"] / c["deepspeed_median"]
    if "tenfold_peak_rss_bytes" in c:
        t_rss, d_rss = c["tenfold_peak_rss_bytes"], c["deepspeed_peak_rss_bytes"]
        mem, mem_ratio = f"{t_rss / mib:,.0f} / {d_rss / mib:,.0f}", f"**{t_rss / d_rss:.2f}x**"
    else:
        mem, mem_ratio = "not measured", ""
    return (f"| {c['stage']} | {c['precision']} | {c['reduce_dtype']} | "
            f"{c['tenfold_best']:,.0f} / {c['deepspeed_best']:,.0f} | **{best:.2f}x** | {median:.2f}x | {mem} | "
            f"{mem_ratio} | {c['tenfold_first_loss']:.4f} / {c['deepspeed_first_loss']:.4f} | {c['load']} |")


def misses(c: dict) -> list[str]:
    speed_min, mem_max = TARGETS[c["numerics"]]
    out = []
    if c["tenfold_best"] / c["deepspeed_best"] < speed_min:
        out.append(f"tokens/s < {speed_min:.2f}x")
    if mem_max is not None and "tenfold_peak_rss_bytes" in c and c["tenfold_peak_rss_bytes"] > mem_max * c["deepspeed_peak_rss_bytes"]:
        out.append(f"peak RSS > {mem_max:.2f}x")
    return out


def print_profiles(cells: list[dict]) -> None:
    """Seconds per step by bucket, rank 0 and rank 1, for every cell profiled (`--profile`)."""
    rows = [c for c in cells if "tenfold_profile" in c]
    if not rows:
        return
    keys = ("wall", "matmul", "attention", "elementwise", "communication", "overhead")
    print("\n### Where a step goes (torch.profiler, s/step, rank 0 / rank 1)\n")
    print("| ZeRO | precision | numerics | engine | " + " | ".join(keys) + " |")
    print("|---|---|---|---|" + "---|" * len(keys))
    for c in rows:
        for e in STEPPERS:
            r0, r1 = c[f"{e}_profile"]
            cols = " | ".join(f"{r0.get(k, 0.0):.3f} / {r1.get(k, 0.0):.3f}" for k in keys)
            print(f"| {c['stage']} | {c['precision']} | {c['numerics']} | {e} | {cols} |")


def print_tables(cells: list[dict]) -> None:
    titles = {"equal": "Equal numerics: both reduce in fp32 (DeepSpeed communication_data_type fp32; "
                       "target >= 1.10x tokens/s at <= 1.0x peak RSS)",
              "deepspeed": "DeepSpeed's numerics: both reduce bf16 gradients in bf16 (DeepSpeed's default; "
                           "tenfold --reduce-dtype bf16; target >= 1.0x tokens/s)"}
    for numerics, title in titles.items():
        rows = [c for c in cells if c["numerics"] == numerics]
        if not rows:
            continue
        print(f"\n### {title}\n\n{HEADER}")
        for c in rows:
            print(row_text(c))
        missed = [f"ZeRO-{c['stage']} {c['precision']}: {', '.join(misses(c))}" for c in rows if misses(c)]
        print("\nmissed: " + ("; ".join(missed) if missed else "none"))


def driver(args) -> None:
    try:
        import deepspeed
    except ImportError:
        sys.exit("DeepSpeed is not installed: pip install -e '.[bench]' (or pip install deepspeed)")
    import torch

    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
          f"deepspeed {deepspeed.__version__}, {args.nproc} ranks x {max(1, (os.cpu_count() or 1) // args.nproc)} "
          f"thread(s), {os.cpu_count()} CPU cores")
    print(f"# uptime at the start: {uptime}")
    print(f"# Hugging Face {LLAMA['model_type']} {json.dumps({k: v for k, v in LLAMA.items() if k != 'model_type'})}")
    print(f"# micro-batch {args.micro}/rank, accumulation {args.accum}, seq {args.seq}, {args.steps} timed steps "
          f"after {args.warmup} warm-up x {args.speed_repeats} interleaved launches, memory launches x{args.repeats} "
          f"per engine\n")
    print("| numerics " + HEADER.replace("\n|", "\n|---|", 1))
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        args.hf_config = str(Path(tmp) / "config.json")
        Path(args.hf_config).write_text(json.dumps(LLAMA))
        for cell in cells_for(args):
            got = measure_cell(cell, args, tmp)
            if got is None:
                print(f"| {cell['numerics']} | {cell['stage']} | {cell['precision']} | failed | | | | | | | |", flush=True)
                continue
            cells.append(got)
            print(f"| {got['numerics']} " + row_text(got), flush=True)
    print_tables(cells)
    print_profiles(cells)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"\n# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, uptime at the end: {uptime}")
    if args.out_json:
        Path(args.out_json).write_text(json.dumps({"model": LLAMA, "cells": cells}, indent=1))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--numerics", nargs="+", default=list(NUMERICS), choices=list(NUMERICS),
                   help="equal: both reduce in fp32; deepspeed: both reduce bf16 gradients in bf16 (bf16 cells)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps (after --warmup) per launch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro", type=int, default=2, help="sequences per rank per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--speed-repeats", type=int, default=2, help="interleaved throughput launches per cell (best-of)")
    p.add_argument("--repeats", type=int, default=1, help="memory launches per engine and cell")
    p.add_argument("--skip-memory", action="store_true", help="throughput only")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed steps, N more steps of each engine under torch.profiler: seconds per "
                        "step in matmul, attention, elementwise, communication, overhead (first launch of each cell)")
    p.add_argument("--out-json", help="also write every cell's figures to this JSON file")
    p.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=["tenfold", "deepspeed", "interleaved"], help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    p.add_argument("--precision", choices=PRECISIONS, help=argparse.SUPPRESS)
    p.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--ds-communication-dtype", choices=["default", "fp32", "bf16"], default="default",
                   help=argparse.SUPPRESS)
    p.add_argument("--hf-config", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    args.global_batch = args.micro * args.accum * world
    return args


def main() -> None:
    args = parse_args()
    rank_main(args) if args.rank_side else driver(args)


if __name__ == "__main__":
    main()
