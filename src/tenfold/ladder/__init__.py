"""`tenfold ladder`: the optimization ladder measured on this machine, rung by rung, beside the
planner's forecast: each rung adds one technique to the one before it (the "30 days -> 3 days"
path of fp32 -> mixed precision -> accumulation -> recompute -> ZeRO -> pipeline).

    tenfold ladder --quick --out runs/ladder          # six rungs on `tiny`, minutes on 2 cores
    tenfold ladder --rungs fp32,mixed,recompute       # a subset (later rungs keep the earlier techniques)
    tenfold ladder --project --gpu a100-80gb --gpus 64 --model gpt3-175b   # the same rungs on a fleet

Rungs (cumulative; each trains the same token budget, `tenfold train` in a subprocess):
  0 fp32       one process, fp32, micro-batch 1, one sequence per optimizer step (the baseline)
  1 mixed      + torch.amp autocast: bf16 where supported, else fp16 with dynamic loss scaling;
                 skipped on a CPU without bf16 matrix instructions (the later rungs then fp32)
  2 accum      + gradient accumulation to the target global batch (micro-batch 1)
  3 recompute  + activation checkpointing, micro-batch raised to the largest that fits --memory-budget
  4 zero       + ZeRO (FSDP2) across --nproc local ranks, same global batch
  5 pipeline   + pipeline parallelism (--pp stages) over the same ranks
With --ac auto, rungs 4 and 5 keep only the recompute their per-rank memory still needs: ZeRO
shards the model states and a pipeline stage holds part of the layers, and recompute is a
memory technique, so what they free buys back the recompute's ~1/3 extra forward.
Outputs: a rich table, OUT/ladder.json, OUT/ladder.md, OUT/ladder.png, OUT/rung_<k>_<name>/.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from tenfold.errors import UserError
from tenfold.ladder.machine import default_nproc, mixed_precision
from tenfold.ladder.rungs import RUNG_NAMES
from tenfold.ladder.runner import Ladder

QUICK = {"tokens": 65536, "global_batch": 16, "timeout_s": 300.0, "max_bytes": 3_000_000, "repeats": 2}
FULL = {"tokens": 131072, "global_batch": 32, "timeout_s": 1800.0, "max_bytes": None, "repeats": 1}
DEFAULT_OUT = "runs/ladder"


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ladder", help="measure the optimization ladder (fp32 to ZeRO and pipeline) rung by rung on this machine",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("ladder")
    g.add_argument("--model", help="preset (default tiny; with --project: gpt3-175b)")
    g.add_argument("--nproc", type=int, help="local ranks for the zero and pipeline rungs (default: all GPUs, else all cores)")
    g.add_argument("--tokens", type=float, help=f"token budget per rung (default {FULL['tokens']:,}; --quick {QUICK['tokens']:,}); "
                                                "with --project: training tokens (default 300e9)")
    g.add_argument("--global-batch", type=int, help=f"target sequences per optimizer step (default {FULL['global_batch']}; --quick {QUICK['global_batch']})")
    g.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context)")
    g.add_argument("--memory-budget", help="per-rank memory the recompute rung's micro-batch must fit, e.g. 256MiB, 2GiB "
                                           "(default: twice the planner's peak for micro-batch 1)")
    g.add_argument("--rungs", help=f"comma-separated subset of {','.join(RUNG_NAMES)} (default: all)")
    g.add_argument("--repeats", type=int, help=f"runs of the whole ladder, alternating order; each rung counts its best run "
                                               f"(default {FULL['repeats']}; --quick {QUICK['repeats']})")
    g.add_argument("--quick", action="store_true", help="a small budget that finishes in minutes on 2 CPU cores")
    g.add_argument("--out", help=f"output directory (default {DEFAULT_OUT})")
    g.add_argument("--ac", default="auto", help="recompute policy of the recompute rung and after; auto (default): the least recompute "
                                                "that fits the largest micro-batch, then for the zero and pipeline rungs the least "
                                                "their own per-rank memory still needs (possibly none)")
    g.add_argument("--zero", type=int, default=3, help="ZeRO stage of the zero rung (default 3)")
    g.add_argument("--pp", type=int, help="pipeline stages (default 2; with --project 8)")
    g.add_argument("--timeout", type=float, help="seconds one rung may run before it is stopped and reported as failed")
    g.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override for every rung (e.g. --set model.n_layers=2); the rung's own settings win")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    f = p.add_argument_group("projection (--project)")
    f.add_argument("--project", action="store_true", help="the same rungs on a fleet, from the planner")
    f.add_argument("--gpu", help="the fleet's GPU (planner catalog name; default a100-80gb)")
    f.add_argument("--gpus", type=int, help="the fleet's size (default 64)")
    p.set_defaults(func=run)
    return p


# --------------------------------------------------------------------------- options


def parse_bytes(text: str, flag: str = "--memory-budget") -> int:
    """'256MiB', '2GiB', '1.5GB', '300M', '268435456' -> bytes (binary units for *iB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not m:
        raise UserError(f"{flag} {text!r} is not a size; use e.g. 256MiB, 2GiB or a byte count")
    value, unit, binary = float(m.group(1)), m.group(2), m.group(3)
    scale = (1024 if binary or unit == "" else 1000) ** " kmgt".index(unit or " ")
    n = int(value * scale)
    if n <= 0:
        raise UserError(f"{flag} must be positive, got {text!r}")
    return n


def parse_rungs(text: str | None) -> list[str]:
    if not text:
        return list(RUNG_NAMES)
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in RUNG_NAMES]
    if bad or not names:
        raise UserError(f"--rungs {text!r}: unknown rung(s) {', '.join(bad) or '(none given)'}; allowed: {', '.join(RUNG_NAMES)}")
    return [n for n in RUNG_NAMES if n in names]  # ladder order, whatever order they were given in


def _positive(name: str, value, kind=int):
    if value is None:
        return None
    if value <= 0 or (kind is int and int(value) != value):
        raise UserError(f"{name} must be a positive {'integer' if kind is int else 'number'}, got {value}")
    return kind(value)


# --------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out or DEFAULT_OUT)
    if args.project:
        from tenfold.ladder.project import run_project

        args.project_tokens = _positive("--tokens", args.tokens, float)
        args.pp_project = _positive("--pp", args.pp)
        _positive("--gpus", args.gpus)
        _positive("--seq-len", args.seq_len)
        return run_project(args, out_dir)
    for flag in ("gpu", "gpus"):
        if getattr(args, flag) is not None:
            raise UserError(f"--{flag} describes the fleet of --project; the measured ladder runs on this machine (use --nproc)")
    ladder = prepare(args)
    return ladder.run(show_progress=not args.no_progress)


def prepare(args: argparse.Namespace) -> Ladder:
    """Validate every option and the rungs' shared config before anything runs (exit 2)."""
    from tenfold.config import build_config, parse_set_item
    from tenfold.ladder.rungs import LadderSetup, budget_tokens

    preset = QUICK if args.quick else FULL
    rungs = parse_rungs(args.rungs)
    nproc = _positive("--nproc", args.nproc) or default_nproc()
    pp = _positive("--pp", args.pp) or 2
    if args.zero not in (0, 1, 2, 3):
        raise UserError(f"--zero must be 0, 1, 2 or 3, got {args.zero}")
    timeout = _positive("--timeout", args.timeout, float) or preset["timeout_s"]
    repeats = _positive("--repeats", args.repeats) or preset["repeats"]
    layers = [{"model": {"name": args.model or "tiny"}}] + [parse_set_item(s) for s in args.set]
    if args.seq_len is not None:
        layers.append({"data": {"seq_len": _positive("--seq-len", args.seq_len)}})
    if preset["max_bytes"] is not None:  # --quick: read a few MB of the corpus, not all of it
        layers.insert(0, {"data": {"max_bytes": preset["max_bytes"]}})
    base = build_config(*layers)  # UserError (exit 2) for a bad model / --set / seq_len
    _check_ac(args.ac)
    seq = base.seq_len()
    gb = _positive("--global-batch", args.global_batch) or _default_global_batch(preset["global_batch"], nproc, pp)
    tokens = _positive("--tokens", args.tokens, float) or preset["tokens"]
    dtype, mixed_skip = mixed_precision()
    setup = LadderSetup(
        seq_len=seq, global_batch=gb, budget_tokens=budget_tokens(int(tokens), seq, gb), nproc=nproc, pp=pp,
        zero_stage=args.zero, ac_policy=args.ac, mixed_dtype=dtype, mixed_skip=mixed_skip, seed=base.train.seed,
        eval_seqs=gb,
    )
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    return Ladder(setup, layers, rungs, out_dir=Path(args.out or DEFAULT_OUT), memory_budget=budget,
                  timeout_s=timeout, model=base.model.name, command=_command_line(), repeats=repeats)


def _check_ac(policy: str) -> None:
    from tenfold.terms import parse_recompute

    if policy != "auto":
        parse_recompute(policy)  # UserError naming the allowed policies


def _default_global_batch(preferred: int, nproc: int, pp: int) -> int:
    """The preferred batch rounded up to a multiple of the data-parallel ranks of both the
    ZeRO rung (nproc) and the pipeline rung (nproc / pp) so every rung can run it."""
    step = nproc
    return -(-preferred // step) * step


def _command_line() -> str:
    return "tenfold " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "tenfold ladder"
