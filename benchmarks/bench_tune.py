"""`tenfold tune` against `tenfold ladder --quick`, back to back on this machine, and the same
search driven by DeepSpeed's autotuner where it runs.

    python benchmarks/bench_tune.py [--model small] [--nproc 2] [--budget 600] [--out runs/bench_tune]
    pip install -e '.[bench]'    # optional: DeepSpeed and tabulate for the DeepSpeed part (says why it is skipped otherwise)

Reported (printed as a Markdown block for docs/benchmarks.md, and OUT/bench_tune.json):
* tune's best measured tokens/s / the ladder's best rung (both best-of-runs, steady state);
* candidates tried vs candidates that fit;
* the median |predicted / measured - 1| over the tried candidates, before and after calibration
  (and leave-one-out: each trial predicted by a fit to the others);
* DeepSpeed's autotuner (`deepspeed --autotuning tune`) on the same model and processes, up to
  the same global batch, for the same budget (--deepspeed-timeout): its experiments, the time
  they took, the tokens/s its own profiler measured; or the reason it cannot run here;
* the 1-minute load average before and after each part: the machine may be shared.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

DS_SCRIPT = '''\
"""tenfold's GPT under DeepSpeed, written the way DeepSpeed's autotuner expects a user's script."""
import argparse

import deepspeed
import numpy as np
import torch
import torch.nn.functional as F

from tenfold.models.gpt import GPT
from tenfold.models.presets import get_preset

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=8)
p = deepspeed.add_config_arguments(p)
args = p.parse_args()
torch.manual_seed(0)
cfg = get_preset("{model}")
model = GPT(cfg)
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
rng = np.random.default_rng(0)
for _ in range(args.steps * engine.gradient_accumulation_steps()):
    x = torch.from_numpy(rng.integers(0, cfg.vocab_size, (engine.train_micro_batch_size_per_gpu(), cfg.max_seq_len + 1)))
    loss = F.cross_entropy(engine(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten())
    engine.backward(loss)
    engine.step()
'''


def load_avg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def timed(cmd: list[str], log: Path, env: dict | None = None, timeout: float | None = None, cwd: Path | None = None) -> dict:
    """Run `cmd` with its output in `log`; its exit status (None: stopped at `timeout`), wall time
    and the load around it. Stopped means every process it started: DeepSpeed's launcher and its
    ranks outlive a killed parent (tenfold.ladder.measure stops them as it stops a rung)."""
    from tenfold.ladder.measure import _stop_group

    before, start = load_avg(), time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            rc = None
    return {"command": " ".join(cmd), "rc": rc, "wall_s": round(time.perf_counter() - start, 1),
            "load_avg": [before, load_avg()], "log": str(log)}


def run_tune(args, out: Path) -> dict:
    part = timed([sys.executable, "-m", "tenfold", "tune", "--model", args.model, "--nproc", str(args.nproc),
                  "--budget", str(args.budget), "--out", str(out / "tune"), "--no-progress"], out / "tune.log")
    doc = json.loads((out / "tune" / "tune.json").read_text())
    cal = doc["calibration"] or {}
    part.update(best=doc["best"], candidates=doc["candidates"], stop_reason=doc["stop_reason"],
                trials=[{k: t[k] for k in ("id", "name", "status", "tokens_per_s", "tokens_per_s_runs",
                                             "predicted_before", "predicted_after")} for t in doc["trials"]],
                error_before=cal.get("median_abs_error_before"), error_after=cal.get("median_abs_error_after"),
                error_leave_one_out=cal.get("median_abs_error_leave_one_out"), constants=cal.get("constants"))
    return part


def run_ladder(args, out: Path) -> dict:
    part = timed([sys.executable, "-m", "tenfold", "ladder", "--quick", "--model", args.model, "--nproc", str(args.nproc),
                  "--out", str(out / "ladder"), "--no-progress"], out / "ladder.log")
    rungs = json.loads((out / "ladder" / "ladder.json").read_text())["rungs"]
    measured = [r for r in rungs if r.get("tokens_per_s")]
    best = max(measured, key=lambda r: r["tokens_per_s"]) if measured else None
    part["rungs"] = [{k: r.get(k) for k in ("name", "status", "tokens_per_s", "tokens_per_s_runs", "config")} for r in rungs]
    part["best"] = None if best is None else {"rung": best["name"], "tokens_per_s": best["tokens_per_s"]}
    return part


def deepspeed_missing() -> str | None:
    """Why DeepSpeed's autotuner cannot start here, or None: it needs deepspeed and `tabulate`
    (its `autotuning` extra, in tenfold's `bench` extra)."""
    for name in ("deepspeed", "tabulate"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (pip install -e '.[bench]')"
    return None


def run_deepspeed(args, out: Path, global_batch: int, precision: str, seq_len: int) -> dict:
    """`deepspeed --autotuning tune` over micro-batch and ZeRO stage, up to the same global batch,
    for the tune's own budget (what it has measured by then counts). On a CPU DeepSpeed counts NUMA
    nodes as devices, so LOCAL_SIZE says how many ranks; its launcher must be on PATH (the
    autotuner starts each experiment with `deepspeed`). Without `pdsh` each experiment's clean-up
    (deepspeed/autotuning/scheduler.py: `pdsh ... pkill -f NAME`) raises FileNotFoundError in its
    thread after the experiment has written its metrics; the search goes on."""
    missing = deepspeed_missing()
    if missing:
        return {"ran": False, "reason": missing}
    ds = out / "deepspeed"
    ds.mkdir(parents=True, exist_ok=True)
    (ds / "ds_train.py").write_text(DS_SCRIPT.format(model=args.model))
    config = {"train_batch_size": global_batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "bf16": {"enabled": precision == "bf16"},
              "autotuning": {"enabled": True, "fast": True, "results_dir": str(ds / "results"), "exps_dir": str(ds / "exps"),
                             "max_train_batch_size": global_batch, "start_profile_step": 2, "end_profile_step": 4}}
    (ds / "ds.json").write_text(json.dumps(config, indent=1))
    env = dict(os.environ, LOCAL_SIZE=str(args.nproc), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    part = timed(["deepspeed", "--autotuning", "tune", "--num_gpus", str(args.nproc), "ds_train.py", "--deepspeed",
                  "--deepspeed_config", "ds.json"], out / "deepspeed.log", env=env,
                 timeout=args.deepspeed_timeout or args.budget, cwd=ds)
    results = _ds_results(ds / "results", seq_len)
    part.update(ran=bool(results), pdsh=shutil.which("pdsh") is not None, measured=results,
                experiments=len(list((ds / "exps").glob("*.json"))) if (ds / "exps").is_dir() else 0)
    optimal = ds / "results" / "ds_config_optimal.json"
    if optimal.is_file():
        part["optimal"] = json.loads(optimal.read_text())
    if not results:
        part["reason"] = _last_error(out / "deepspeed.log")
    return part


def _ds_results(results: Path, seq_len: int) -> dict[str, dict]:
    """Each finished experiment: tokens/s from its own profiler (`throughput` is the global batch
    per step's fwd + bwd + step time, deepspeed/runtime/engine.py _autotuning_exit) and the
    global batch it ran at (the autotuner varies it up to max_train_batch_size)."""
    out = {}
    for path in sorted(results.glob("*/metrics.json")) if results.is_dir() else []:
        m = json.JSONDecoder().raw_decode(path.read_text())[0]  # one object per rank, rank 0 first
        cfg = json.loads((path.parent / "ds_config.json").read_text())
        out[path.parent.name] = {"tokens_per_s": round(m["throughput"] * seq_len, 1),
                                 "zero": cfg.get("zero_optimization", {}).get("stage"),
                                 "micro_batch": cfg.get("train_micro_batch_size_per_gpu"),
                                 "grad_accum": cfg.get("gradient_accumulation_steps")}
    return out


def _last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if "Error" in ln or "error" in ln]
    return lines[-1][:300] if lines else "no experiment finished (see deepspeed.log)"


def report(result: dict) -> str:
    t, lad, ds = result["tune"], result.get("ladder"), result.get("deepspeed")
    lines = [f"Machine: {result['machine']}. Command: `{result['command']}`.", ""]
    c = t["candidates"]
    best = t["best"] or {}
    lines.append(f"- tune: best {best.get('name')} at {best.get('tokens_per_s', 0):,.0f} tok/s, {c['tried']} of "
                 f"{c['fitting']} fitting candidates tried ({c['tried'] / max(1, c['fitting']):.0%}), "
                 f"{t['wall_s']:,.0f} s, load {t['load_avg']}; stopped: {t['stop_reason']}")
    fmt = (lambda x: "-" if x is None else f"{x:.1%}")
    lines.append(f"- planner error, median over the tried candidates: {fmt(t['error_before'])} before, "
                 f"{fmt(t['error_after'])} after calibration, {fmt(t['error_leave_one_out'])} leave-one-out")
    if lad and lad.get("best"):
        ratio = best.get("tokens_per_s", 0) / lad["best"]["tokens_per_s"]
        lines.append(f"- ladder --quick: best rung {lad['best']['rung']} at {lad['best']['tokens_per_s']:,.0f} tok/s, "
                     f"{lad['wall_s']:,.0f} s, load {lad['load_avg']}; **tune / ladder = {ratio:.2f}**")
    if ds:
        if ds.get("ran"):
            shown = ", ".join(f"{k} {v['tokens_per_s']:,.0f}" for k, v in ds["measured"].items())
            top = max(v["tokens_per_s"] for v in ds["measured"].values())
            stopped = "stopped at the budget" if ds["rc"] is None else f"exit status {ds['rc']}"
            lines.append(f"- DeepSpeed autotuner: {len(ds['measured'])} of {ds['experiments']} experiments measured in "
                         f"{ds['wall_s']:,.0f} s ({stopped}), load {ds['load_avg']}; tok/s by its own profiler (fwd + "
                         f"bwd + step, names zN_gasG_tmbspgM): {shown}; its best / tune's best = "
                         f"{top / max(1e-9, best.get('tokens_per_s', 0)):.2f}")
        else:
            lines.append(f"- DeepSpeed autotuner: did not run: {ds['reason']}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--budget", type=float, default=600)
    p.add_argument("--out", default="runs/bench_tune")
    p.add_argument("--skip-ladder", action="store_true")
    p.add_argument("--skip-deepspeed", action="store_true")
    p.add_argument("--deepspeed-timeout", type=float, help="seconds DeepSpeed's autotuner may run (default: --budget)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from tenfold.plan.hardware import cpu_model_name

    result = {"machine": f"{cpu_model_name()}, {os.cpu_count()} cores", "command": "python " + " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result["tune"] = run_tune(args, out)
    if not args.skip_ladder:
        result["ladder"] = run_ladder(args, out)
    if not args.skip_deepspeed:
        knobs = next(t for t in json.loads((out / "tune" / "tune.json").read_text())["trials"] if t["baseline"])["knobs"]
        seq = json.loads((out / "tune" / "tune.json").read_text())["setup"]["seq_len"]
        result["deepspeed"] = run_deepspeed(args, out, knobs["global_batch"], knobs["precision"], seq)
    (out / "bench_tune.json").write_text(json.dumps(result, indent=1))
    print(textwrap.dedent(report(result)))


if __name__ == "__main__":
    main()
