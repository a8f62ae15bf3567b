"""`tenfold plan`: per-GPU memory, step time, MFU and days for the run `tenfold train` would do
with the same flags; `--search` for the fastest strategy train can run; `--ladder` for the
the recipe's path.

`tenfold plan` reads exactly what `tenfold train` reads (every train flag, `--config`,
`--deepspeed`, `--set`, resolved by the same code), plus the fleet (`--gpu`, `--gpus` =
train's `--nproc` unless given, `--gpus-per-node`, `--hardware-file`), shape flags for a model
without a config (`--params`, `--layers/--hidden/...`) and what-ifs train does not run
(other stacks' bookkeeping).

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

USAGE = __doc__.split("\n\n`register")[0]  # the user's part of this docstring
GiB = 2**30
DIMENSIONS = ("layers", "hidden", "heads", "vocab")  # a whole shape; with --kv-heads/--ffn/--mlp/--norm
SHAPE_KEYS = {"layers": "n_layers", "hidden": "d_model", "heads": "n_heads", "kv_heads": "n_kv_heads",
              "ffn": "d_ff", "vocab": "vocab_size", "mlp": "mlp", "norm": "norm"}
# Planner flags that change the strategy or the stack the prediction describes.
WHAT_IFS = ("master_weights", "grads_fp32", "dropout", "flash_attention",
            "overlap_comm", "activation_style", "tokens", "achieved_tflops")


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
    from tenfold.cli import add_run_arguments

    add_run_arguments(p)  # train's own flags: the run to predict
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
                   help="--search: also rank strategies tenfold train cannot run (offload, tied embeddings pipelined, ...), marked")
    o.add_argument("--emit", metavar="FILE.toml", help="write the plan (with --search: the fastest runnable one) as a "
                   "config that `tenfold train --config FILE` runs unchanged")
    o.add_argument("--ladder", action="store_true", help="the recipe's optimization path, rung by rung")


def _add_what_ifs(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("what-ifs (the planner prices them; tenfold train does not run them)")
    w.add_argument("--master-weights", action=argparse.BooleanOptionalAction, default=False,
                   help="16-bit params + fp32 master copy (DeepSpeed, Megatron); default: fp32 params under autocast, as tenfold trains")
    w.add_argument("--grads-fp32", action="store_true", help="fp32 gradients (Megatron main grads)")
    w.add_argument("--dropout", action="store_true", help="the model uses dropout (GPT-2/3 style)")
    w.add_argument("--flash-attention", action=argparse.BooleanOptionalAction, default=True)
    w.add_argument("--overlap-comm", action=argparse.BooleanOptionalAction, default=True)
    w.add_argument("--activation-style", choices=("tenfold", "megatron"), default="tenfold",
                   help="tenfold: eager PyTorch + autocast, fp32 loss tensors (default); megatron: fused kernels "
                        "(Korthikanti et al. 2022)")
    w.add_argument("--tokens", type=_number, help="training tokens, for days and GPU-hours")
    w.add_argument("--achieved-tflops", type=_number, help="per-GPU hardware TFLOP/s (Narayanan's X) instead of the time model")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="predict memory, step time, MFU and days; search strategies",
                              description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


# --------------------------------------------------------------------------- the run to predict


@dataclass
class Target:
    """What `tenfold plan` predicts: the config (train's), its resolved run (None for --params),
    the model as the planner sees it, the fleet size and the strategy (what-ifs applied)."""

    cfg: Any
    run: Any
    model: Any
    gpus: int
    strategy: Any
    model_kind: str = "tenfold"
    hf_model_type: str = ""  # a Hugging Face model's model_type (which have a tensor-parallel plan)


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


def resolve_target(args) -> Target:
    """The run `tenfold train` would do with these flags, on `--gpus` (default train's --nproc)."""
    from tenfold.cli import config_from_args
    from tenfold.plan.for_run import strategy_for_config, strategy_for_run
    from tenfold.run import hf_model_type, model_kind, resolve_run

    a = argparse.Namespace(**vars(args))
    seq_for_params = None
    if a.params:  # the config's own model does not apply: keep --seq-len for the planner
        seq_for_params, a.seq_len = a.seq_len, None
    a.set = [*_shape_overrides(a), *a.set]  # the user's own --set still wins
    cfg = config_from_args(a)
    gpus = a.gpus or cfg.parallel.nproc
    what_ifs = {k: getattr(a, k) for k in WHAT_IFS}
    if a.params:
        return Target(cfg, None, a.params, gpus, replace(strategy_for_config(cfg, seq_for_params), **what_ifs))
    if a.search:
        # The search varies the layout (tp, pp, ZeRO, recompute, micro-batch) at a fixed global
        # batch: the one given, else the one train would use with these flags.
        glob = cfg.train.global_batch or resolve_run(cfg, gpus, check=False).global_batch
        # Sequence parallelism as train would run each tp > 1 layout: on unless switched off.
        base = replace(strategy_for_config(cfg, cfg.seq_len()), global_batch=glob, micro_batch=None, grad_accum=None,
                       sequence_parallel=cfg.parallel.sequence_parallel is not False, **what_ifs)
        return Target(cfg, None, _shape(a, cfg, cfg.model.build()), gpus, base, model_kind(cfg), hf_model_type(cfg))
    # Priced even when train would refuse it (marked, Plan.unsupported).
    run = resolve_run(cfg, gpus, check=False)
    return Target(cfg, run, _shape(a, cfg, run.model), gpus, replace(strategy_for_run(run), **what_ifs), run.model_kind,
                  hf_model_type(cfg))


def _shape(args, cfg, model):
    from tenfold.plan.shape import shape_of

    label = "custom" if args.layers else (cfg.model.hf_pretrained or cfg.model.hf_config or cfg.model.name)
    if not args.layers and set(cfg.model.model_dump(exclude_defaults=True,
                                                    exclude={"name", "blocks", "hf_config", "hf_pretrained"})):
        label += " (modified)"
    return shape_of(model, name=label)


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
    target = resolve_target(args)
    if args.search:
        return _run_search(args, target, hw)
    return _run_plan(args, target, hw)


def _run_plan(args, t: Target, hw) -> int:
    from tenfold.plan.api import largest_micro_batch, predict
    from tenfold.plan.for_run import strategy_problems

    plan = predict(t.model, hw, t.gpus, t.strategy)
    if t.run is not None:
        plan.unsupported = strategy_problems(t.strategy, t.run.model, t.gpus, t.run.grad_accum, t.model_kind,
                                             t.hf_model_type)
        plan.max_micro_batch = largest_micro_batch(t.model, hw, t.gpus, t.strategy)
    if args.emit and t.run is None:
        raise UserError("--emit writes a config tenfold train runs: give a model (--model, --hf-config or dimensions), not --params")
    advice = _advise(args, t, plan, hw) if t.run is not None and not plan.unsupported else None
    if args.emit and advice is None:
        raise UserError(f"--emit {args.emit}: tenfold train cannot run this plan: {'; '.join(plan.unsupported)}; nothing written")
    if args.plot:
        from tenfold.plan.plot import plot_memory

        plot_memory(plan, args.plot)
    if args.json:
        print(json.dumps({**plan.to_dict(), "run": _run_section(t, plan, advice)}, indent=1, default=_json_default))
        return 0
    from tenfold.plan import report

    report.print_plan(plan, hw, explain=args.explain)
    report.print_run(_run_section(t, plan, advice))
    return 0


@dataclass
class Advice:
    cfg: Any  # the config train runs
    run: Any  # as train resolves it
    launch: str
    emitted: str | None = None


def _advise(args, t: Target, plan, hw) -> Advice:
    """`plan` as train runs it: the config, the launch line, and the --emit file if asked for."""
    from tenfold.plan import advice
    from tenfold.plan.for_run import stack_departures

    cfg, run = advice.config_for_plan(t.cfg, plan, hw.gpus_per_node)
    if not args.emit:
        return Advice(cfg, run, advice.launch_line(cfg, plan.gpus, hw.gpus_per_node))
    other = stack_departures(t.strategy)
    if other:  # the file's predicted figures would describe another stack than the run it holds
        raise UserError(f"--emit {args.emit}: this plan is priced as another training stack ({', '.join(other)}); "
                        "drop those flags to write what tenfold train runs; nothing written")
    launch = advice.launch_line(cfg, plan.gpus, hw.gpus_per_node, config_file=args.emit)
    advice.write_emit(args.emit, advice.emitted_toml(cfg, plan, launch, _replan_line(args, plan.gpus)))
    return Advice(cfg, run, launch, args.emit)


def _replan_line(args, gpus: int) -> str:
    fleet = ["--hardware-file", args.hardware_file] if args.hardware_file else ["--gpu", args.gpu]
    fleet += ["--gpus", str(gpus)] + (["--gpus-per-node", str(args.gpus_per_node)] if args.gpus_per_node else [])
    return shlex.join(["tenfold", "plan", "--config", args.emit, *fleet])


def _run_section(t: Target, plan, advice: Advice | None) -> dict | None:
    """The run as `tenfold train` reports it at its start (summary.json's `batch` and
    `memory.predicted`), how to launch it, or why train cannot."""
    if t.run is None:
        return None
    from tenfold.plan.for_run import memory_by_category, stack_departures

    run = advice.run if advice else t.run
    return {
        "processes": plan.gpus, "dp": plan.dp, "batch": run.batch_summary(),
        "memory_predicted": memory_by_category(plan.memory), "steps": t.cfg.train.steps,
        "steps_time_s": t.cfg.train.steps * plan.step_time_s, "unsupported": plan.unsupported,
        "other_stack": stack_departures(t.strategy), "launch": advice.launch if advice else None,
        "emitted": advice.emitted if advice else None,
    }


def _json_default(o):
    if hasattr(o, "__dict__"):
        return vars(o)
    return str(o)


def _run_search(args, t: Target, hw) -> int:
    from tenfold.plan import report
    from tenfold.plan.search import search

    result = search(t.model, hw, t.gpus, t.strategy, top_k=args.top,
                    offloads=("none", "optimizer") if args.include_unsupported else ("none",),
                    include_unsupported=args.include_unsupported, model_kind=t.model_kind,
                    hf_model_type=t.hf_model_type)
    best = next((p for p in result.best if not p.unsupported), None)
    if args.emit and best is None:
        raise UserError(f"--emit {args.emit}: no strategy tenfold train can run fits (see the search without --emit); "
                        "nothing written")
    advice = _advise(args, t, best, hw) if best is not None else None
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
    if args.params:
        return args.params
    if not (args.model or args.hf_config or args.hf_pretrained or args.layers or args.config or args.set):
        return "gpt3-175b"
    from tenfold.cli import config_from_args
    from tenfold.plan.shape import shape_of

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
