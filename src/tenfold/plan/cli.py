"""`tenfold plan`: per-GPU memory, step time, MFU and days for the run `tenfold train` would do
with the same flags; `--search` for the fastest strategy train can run; `--ladder` for the
optimization ladder on a fleet (fp32, then mixed precision, gradient accumulation, recompute,
ZeRO-3 across nodes, a pipeline: the days and memory each rung buys), rung by rung.

`tenfold plan` reads exactly what `tenfold train` reads (every train flag, `--config`,
`--deepspeed`, `--set`, resolved by the same code), plus the fleet (`--gpu`, `--gpus` =
train's `--nproc` unless given, `--gpus-per-node`, `--hardware-file`), shape flags for a model
without a config (`--params`, `--layers/--hidden/...`) and what-ifs train does not run
(other stacks' bookkeeping). Train's flags that change nothing predicted here (`--out`,
`--resume`, `--wandb`, checkpoints, logging, learning rate, seed) are accepted and kept in the
launch line, and not listed below.

`register(subparsers)` plugs into tenfold's CLI; `main(argv)` runs standalone
(`python -m tenfold.plan.cli ...`). Bad input raises `UserError` (exit status 2)."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import dataclass, replace
from typing import Any

from tenfold.errors import UserError
from tenfold.run_args import add_run_arguments

USAGE = __doc__.split("\n\n`register")[0]  # the user's part of this docstring
GiB = 2**30
DIMENSIONS = ("layers", "hidden", "heads", "vocab")  # a whole shape; with --kv-heads/--ffn/--mlp/--norm
SHAPE_KEYS = {"layers": "n_layers", "hidden": "d_model", "heads": "n_heads", "kv_heads": "n_kv_heads",
              "ffn": "d_ff", "vocab": "vocab_size", "mlp": "mlp", "norm": "norm"}
# Planner flags that price another training stack than tenfold's (tenfold.run.Stack).
STACK_FLAGS = ("master_weights", "grads_fp32", "dropout", "flash_attention", "overlap_comm", "activation_style")


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 7.5e9, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _count(text: str) -> int:
    v = _number(text)
    if v != int(v):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(v)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p, priced_only=True)  # train's own flags: the run to predict
    m = p.add_argument_group("a model without a preset or config.json (instead of --model / --hf-config)")
    m.add_argument("--params", type=_number, help="parameter count only: model states, no activations, no --search")
    m.add_argument("--layers", type=_count, help="with --hidden, --heads, --vocab: a whole shape (= --set model.n_layers=N ...)")
    m.add_argument("--hidden", type=_count)
    m.add_argument("--heads", type=_count)
    m.add_argument("--kv-heads", type=_count, help="also modifies a preset (= --set model.n_kv_heads=N)")
    m.add_argument("--ffn", type=_count, help="also modifies a preset (= --set model.d_ff=N)")
    m.add_argument("--vocab", type=_count)
    m.add_argument("--mlp", choices=("swiglu", "gelu"))
    m.add_argument("--norm", choices=("rmsnorm", "layernorm"))
    h = p.add_argument_group("fleet")
    h.add_argument("--gpu", default="a100-80gb", help="catalog name, 'cpu' (this machine, measured) or a .toml file")
    h.add_argument("--hardware-file", help="user-defined hardware (TOML); overrides --gpu")
    h.add_argument("--gpus", type=_count, default=None, help="number of GPUs (default: --nproc, i.e. 1; --ladder: 64)")
    h.add_argument("--gpus-per-node", type=_count)
    h.add_argument("--memory-gb", type=_number, help="override the device memory (GB = 1e9 bytes), e.g. a budget")
    _add_what_ifs(p)
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object")
    o.add_argument("--explain", action="store_true", help="every formula with its source")
    o.add_argument("--plot", metavar="FILE.png", help="draw the memory breakdown (and --search candidates)")
    o.add_argument("--search", action="store_true", help="the fastest strategies tenfold train can run that fit")
    o.add_argument("--top", type=_count, default=5, help="--search: how many to show")
    o.add_argument("--include-unsupported", action="store_true",
                   help="--search: also rank strategies tenfold train cannot run (offload at ZeRO-0/1, another training stack, ...), marked")
    o.add_argument("--trace", action="store_true",
                   help="also run the engine's own set-up and one optimizer step on fake tensors over a fake process "
                        "group of the full world (one rank per pipeline stage, on this CPU) and print the traced "
                        "per-rank memory terms and collectives beside the plan's, with the difference")
    o.add_argument("--emit", metavar="FILE.toml", help="write the plan (with --search: the fastest runnable one) as a "
                   "config that `tenfold train --config FILE` runs unchanged")
    o.add_argument("--ladder", action="store_true", help="the optimization ladder on a fleet, rung by rung: fp32, mixed "
                   "precision, gradient accumulation, recompute, ZeRO-3, pipeline (default --gpus 64)")


def _add_what_ifs(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("other training stacks (the planner prices them; tenfold train runs its own)")
    w.add_argument("--master-weights", action=argparse.BooleanOptionalAction, default=False,
                   help="16-bit params + fp32 master copy (DeepSpeed, Megatron); default: fp32 params under autocast, as tenfold trains")
    w.add_argument("--grads-fp32", action="store_true", help="fp32 gradients (Megatron main grads)")
    w.add_argument("--dropout", action="store_true", help="the model uses dropout (GPT-2/3 style)")
    w.add_argument("--flash-attention", action=argparse.BooleanOptionalAction, default=True)
    w.add_argument("--overlap-comm", action=argparse.BooleanOptionalAction, default=True)
    w.add_argument("--activation-style", choices=("tenfold", "megatron"), default="tenfold",
                   help="tenfold: eager PyTorch + autocast, fp32 loss tensors (default); megatron: fused kernels "
                        "(Korthikanti et al. 2022)")
    f = p.add_argument_group("forecast")
    f.add_argument("--tokens", type=_number, help="training tokens: fills the days and GPU-hours columns")
    f.add_argument("--achieved-tflops", type=_number, help="per-GPU hardware TFLOP/s (Narayanan's X) instead of the time model")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="predict memory, step time, MFU and days; search strategies",
                              description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


# --------------------------------------------------------------------------- the run to predict


@dataclass
class Target:
    """What `tenfold plan` predicts: the config (train's), the run it resolves to on the fleet
    (`tenfold.run.ResolvedRun`, the one train builds; model None for --params), the model's
    label, and the user's sequence-parallel request (what --search keeps)."""

    cfg: Any
    run: Any
    name: str
    gpus: int
    from_params: bool = False  # --params: only a parameter count, no config model
    sequence_parallel: bool | None = None


def _shape_overrides(args) -> list[str]:
    """The planner's shape flags as train's `--set model.KEY=VALUE` items: `--layers 32 ...` is a
    whole shape (ModelConfig's defaults: RoPE, no biases, untied, context --seq-len or 2048);
    `--kv-heads/--ffn/--mlp/--norm` alone modify the configured model."""
    from tenfold.config import toml_literal
    from tenfold.models.presets import ModelConfig

    dims = {k: getattr(args, k) for k in DIMENSIONS}
    named = [n for n, v in (("--model", args.model), ("--hf-config", args.hf_config), ("--hf-pretrained", args.hf_pretrained),
                            ("--params", args.params), ("dimensions", any(v is not None for v in dims.values()))) if v]
    if len(named) > 1:
        raise UserError(f"give one model: {' and '.join(named)} were both given")
    values = {key: getattr(args, flag) for flag, key in SHAPE_KEYS.items()}
    if named == ["dimensions"]:
        missing = [f"--{k}" for k, v in dims.items() if v is None]
        if missing:
            raise UserError(f"model dimensions need {', '.join(missing)} as well")
        shape = ModelConfig(n_layers=args.layers, d_model=args.hidden, n_heads=args.heads, vocab_size=args.vocab,
                            max_seq_len=args.seq_len or 2048, n_kv_heads=args.kv_heads, d_ff=args.ffn,
                            mlp=args.mlp or "swiglu", norm=args.norm or "rmsnorm")
        values.update(d_ff=shape.ffn_dim, mlp=shape.mlp, norm=shape.norm, max_seq_len=shape.max_seq_len, pos=shape.pos,
                      bias=shape.bias, tie_embeddings=shape.tie_embeddings)
    return [f"model.{k}={toml_literal(v)}" for k, v in values.items() if v is not None]


def resolve_target(args, on_cpu: bool) -> Target:
    """The run `tenfold train` would do with these flags, on `--gpus` (default: the config's
    processes, nnodes x nproc) of the planned hardware (`on_cpu`: this machine's CPU)."""
    from dataclasses import replace as dc_replace

    from tenfold.run import Stack, resolve_run
    from tenfold.run_args import config_from_args

    a = argparse.Namespace(**vars(args))
    seq_for_params = None
    if a.params:  # the config's own model does not apply: keep --seq-len for the planner
        seq_for_params, a.seq_len = a.seq_len, None
    a.set = [*_shape_overrides(a), *extended_context(a), *a.set]  # the user's own --set still wins
    cfg = config_from_args(a)
    gpus = a.gpus or cfg.parallel.nnodes * cfg.parallel.nproc
    stack = Stack(**{k: getattr(a, k) for k in STACK_FLAGS})
    if getattr(a, "search", False):
        run = _search_base(cfg, gpus, on_cpu)
    else:
        run = resolve_run(cfg, gpus, check=False, on_cpu=on_cpu)  # priced even when train would refuse it (Plan.unsupported)
    changes = {"stack": stack} if stack != run.stack else {}
    if a.params:
        changes.update(seq_len=seq_for_params or 2048)
    if changes:
        run = run.with_(check=False, **changes)
    if a.params:
        run = dc_replace(run, model=None, params=float(a.params))
    return Target(cfg, run, _label(a, cfg), gpus, bool(a.params), cfg.parallel.sequence_parallel)


def extended_context(args) -> list[str]:
    """A RoPE model planned at a --seq-len past its context is a context extension (Llama 3's
    long-context stage trains its 8K model at 128K, arXiv:2407.21783 section 3.4.2): its
    model.max_seq_len is raised to the sequence (the rotary tables follow it; `--emit` writes
    it), as a `--set` item. Learned positions have no such extension: train refuses them."""
    from tenfold.run_args import config_from_args

    if not args.seq_len or args.params:
        return []
    probe = argparse.Namespace(**{**vars(args), "seq_len": None})
    cfg = config_from_args(probe)
    model = cfg.model.build()
    if args.seq_len <= model.max_seq_len or model.pos != "rope" or cfg.model.hf_config or cfg.model.hf_pretrained:
        return []
    return [f"model.max_seq_len={args.seq_len}"]


def _search_base(cfg, gpus: int, on_cpu: bool):
    """What --search varies the layout of: the config's model, precision and sequence length at
    the global batch given (else the one train would use on `gpus`), on one process (the search
    sets the processes, the layout and the micro-batch itself)."""
    from tenfold.run import choices_from_config, resolve, resolve_run

    glob = cfg.train.global_batch or resolve_run(cfg, gpus, check=False, on_cpu=on_cpu).global_batch
    choices = {**choices_from_config(cfg), "pp": 1, "tp": 1, "pp_schedule": "1f1b", "virtual_stages": None,
               "pp_split": None, "zero_stage": 0, "offload": "none", "sequence_parallel": None,
               "micro_batch": None, "grad_accum": None, "global_batch": glob}
    return resolve(cfg.model.build(), 1, check=False, on_cpu=on_cpu, **choices)


def _label(args, cfg) -> str:
    if args.params:
        return f"{args.params:.3g} params"
    label = "custom" if args.layers else (cfg.model.hf_pretrained or cfg.model.hf_config or cfg.model.name)
    if not args.layers and set(cfg.model.model_dump(exclude_defaults=True,
                                                    exclude={"name", "blocks", "hf_config", "hf_pretrained"})):
        label += " (modified)"
    return label


# --------------------------------------------------------------------------- running


def _hardware(args):
    from tenfold.plan.hardware import get_hardware, with_gpus_per_node

    hw = with_gpus_per_node(get_hardware(args.hardware_file or args.gpu), args.gpus_per_node)
    if args.memory_gb:
        hw = replace(hw, memory_bytes=args.memory_gb * 1e9, name=f"{hw.name} ({args.memory_gb:g} GB)")
    return hw


def run(args) -> int:
    """Entry point for `tenfold plan` (argparse namespace in, exit status out)."""
    hw = _hardware(args)
    if args.ladder:
        return _run_ladder(args, hw)
    target = resolve_target(args, on_cpu=hw.shared_compute)
    other = target.run.stack.departures()
    if args.emit and other:  # the file would describe another stack than the run it holds
        raise UserError(f"--emit {args.emit}: this plan is priced as another training stack ({', '.join(other)}); "
                        "drop those flags to write what tenfold train runs; nothing written")
    if args.search:
        return _run_search(args, target, hw)
    return _run_plan(args, target, hw)


def _run_plan(args, t: Target, hw) -> int:
    from tenfold import capabilities
    from tenfold.plan.api import largest_micro_batch, predict
    from tenfold.plan.lora_reference import paper_note

    plan = predict(t.run, hw, name=t.name, tokens=args.tokens, achieved_tflops=args.achieved_tflops)
    if not t.from_params:
        plan.unsupported = capabilities.problems(t.run)
        plan.max_micro_batch = largest_micro_batch(t.run, hw)
        plan.notes += [n for n in [paper_note(t.run, hw)] if n]
    if args.emit and t.from_params:
        raise UserError("--emit writes a config tenfold train runs: give a model (--model, --hf-config or dimensions), not --params")
    advice = _advise(args, t, t.run, plan, hw) if not t.from_params and not plan.unsupported else None
    if args.emit and advice is None:
        raise UserError(f"--emit {args.emit}: tenfold train cannot run this plan: {'; '.join(plan.unsupported)}; nothing written")
    if args.plot:
        from tenfold.plan.plot import plot_memory

        plot_memory(plan, args.plot)
    traced = _trace(args, t, plan, advice) if getattr(args, "trace", False) else None
    if args.json:
        extra = {"trace": traced} if traced is not None else {}
        print(json.dumps({**plan.to_dict(), "run": _run_section(t, plan, advice), **extra}, indent=1,
                         default=_json_default))
        return 0
    from tenfold.plan import report

    report.print_plan(plan, hw, explain=args.explain)
    report.print_run(_run_section(t, plan, advice))
    if traced is not None:
        from tenfold.engine.preview.trace_report import print_comparison

        print_comparison(traced)
    return 0


def _trace(args, t: Target, plan, advice) -> dict:
    """`--trace`: the run train would do, traced (tenfold.engine.preview.trace), beside this plan."""
    from tenfold.engine.preview.trace import check_traceable, trace_run
    from tenfold.engine.preview.trace_report import compare, planned_stage
    from tenfold.plan.for_run import memory_by_category
    from tenfold.run_args import train_argv

    if t.from_params or advice is None:
        why = "--params describes no model to build" if t.from_params else "; ".join(plan.unsupported)
        raise UserError(f"--trace runs what tenfold train runs, and it cannot run this plan: {why}")
    run = advice.run
    check_traceable(run, run.grad_ranks)
    flags = train_argv(advice.cfg)
    stage = planned_stage(plan.memory.stage, run.pp)
    # The first and the last stage (embedding, output layer and loss) and the one the plan
    # describes; the others differ from one of them only by the micro-batches they hold.
    traces = trace_run(flags, run.world_size, run.pp, run.grad_ranks, run.tp, stages=sorted({0, stage, run.pp - 1}))
    # The planner states collective bytes for the tensor-parallel group (plan/tp_traffic.py), the
    # cp group (plan/cp_traffic.py), the ep group's all-to-alls (plan/moe.py) and the dp groups
    # (plan/dp_time.py, for the slowest stage: compared without a pipeline); tp bytes are
    # compared where tp is all there is, the others with their traced groups'.
    planned_bytes = plan.tp_bytes_per_step if run.grad_ranks == 1 and run.pp == 1 else None
    planned_dp = plan.time.dp_bytes if run.grad_ranks > 1 and run.pp == 1 and run.ep == 1 and run.cp == 1 else None
    return compare(memory_by_category(plan.memory), traces, stage, planned_bytes,
                   plan.cp_bytes_per_step if run.cp > 1 else None, plan.ep_bytes_per_step if run.ep > 1 else None,
                   planned_dp)


@dataclass
class Advice:
    cfg: Any  # the config train runs
    run: Any  # as train resolves it
    launch: str
    emitted: str | None = None


def _advise(args, t: Target, run, plan, hw) -> Advice:
    """`run` as train runs it: the config, the launch line, and the --emit file if asked for."""
    from tenfold.plan import advice

    cfg, run = advice.config_for_plan(t.cfg, run, hw.gpus_per_node)
    if not args.emit:
        return Advice(cfg, run, advice.launch_line(cfg, run.world_size, hw.gpus_per_node))
    launch = advice.launch_line(cfg, run.world_size, hw.gpus_per_node, config_file=args.emit)
    advice.write_emit(args.emit, advice.emitted_toml(cfg, plan, launch, _replan_line(args, run.world_size)))
    return Advice(cfg, run, launch, args.emit)


def _replan_line(args, gpus: int) -> str:
    fleet = ["--hardware-file", args.hardware_file] if args.hardware_file else ["--gpu", args.gpu]
    fleet += ["--gpus", str(gpus)] + (["--gpus-per-node", str(args.gpus_per_node)] if args.gpus_per_node else [])
    return shlex.join(["tenfold", "plan", "--config", args.emit, *fleet])


def _run_section(t: Target, plan, advice: Advice | None) -> dict | None:
    """The run as `tenfold train` reports it at its start (summary.json's `batch` and
    `memory.predicted`), how to launch it, or why train cannot."""
    if t.from_params:
        return None
    from tenfold.plan.for_run import memory_by_category

    run = advice.run if advice else t.run
    return {
        "processes": plan.gpus, "dp": plan.dp, "batch": run.batch_summary(), "layout": run.layout(),
        "layout_line": run.layout_line(), "memory_predicted": memory_by_category(plan.memory),
        "steps": t.cfg.train.steps, "steps_time_s": t.cfg.train.steps * plan.step_time_s,
        "unsupported": plan.unsupported, "other_stack": run.stack.departures(),
        "launch": advice.launch if advice else None, "emitted": advice.emitted if advice else None,
    }


def _json_default(o):
    if hasattr(o, "__dict__"):
        return vars(o)
    return str(o)


def _run_search(args, t: Target, hw) -> int:
    from tenfold.plan import report
    from tenfold.plan.search import OFFLOAD_CHOICES, search

    result = search(t.run, hw, top_k=args.top, offloads=OFFLOAD_CHOICES, include_unsupported=args.include_unsupported,
                    name=t.name, sequence_parallel=t.sequence_parallel, gpus=t.gpus, tokens=args.tokens)
    best = next((p for p in result.best if not p.unsupported), None)
    if args.emit and best is None:
        raise UserError(f"--emit {args.emit}: no strategy tenfold train can run fits (see the search without --emit); "
                        "nothing written")
    advice = _advise(args, t, best.run, best, hw) if best is not None else None
    if args.plot:
        from tenfold.plan.plot import plot_search

        plot_search(result, args.plot)
    if args.json:
        print(json.dumps({"evaluated": result.evaluated, "fitting": result.fitting, "unsupported": result.unsupported,
                          "global_batch": result.global_batch, "best": [p.to_dict() for p in result.best],
                          "launch": advice.launch if advice else None, "emitted": advice.emitted if advice else None},
                         indent=1, default=_json_default))
        return 0
    report.print_search(result, hw, t.gpus, advice)
    return 0


def _ladder_model(args):
    """The ladder's model: the one given (as `tenfold plan` reads it), else GPT-3 175B."""
    from tenfold.plan.shape import shape_of

    if args.params:
        return args.params
    if not (args.model or args.hf_config or args.hf_pretrained or args.layers or args.config or args.set):
        return "gpt3-175b"
    from tenfold.run_args import config_from_args

    a = argparse.Namespace(**vars(args))
    a.set = [*_shape_overrides(a), *a.set]
    cfg = config_from_args(a)
    return shape_of(cfg.model.build(), name="custom" if a.layers else (cfg.model.hf_config or cfg.model.name))


def _run_ladder(args, hw) -> int:
    from tenfold.plan import report
    from tenfold.plan.ladder import ladder_dict, run_ladder

    rungs = run_ladder(_ladder_model(args), hw,
                       gpus_node=args.gpus_per_node or min(8, hw.gpus_per_node), gpus_final=args.gpus or 64,
                       pp=args.pp if args.pp and args.pp > 1 else 8, tokens=args.tokens or 300e9, seq_len=args.seq_len)
    if args.plot:
        from tenfold.plan.plot import plot_ladder

        plot_ladder(rungs, args.plot)
    if args.json:
        print(json.dumps(ladder_dict(rungs), indent=1, default=_json_default))
        return 0
    report.print_ladder(rungs)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tenfold plan", description=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UserError as exc:
        print(f"tenfold plan: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
