"""`tenfold plan`: per-GPU memory, step time, MFU and days for a model, fleet and strategy;
`--search` for the fastest strategy that fits; `--ladder` for the seed's path.

`register(subparsers)` plugs into tenfold's CLI; `main(argv)` runs standalone
(`python -m tenfold.plan.cli ...`). Bad input raises `UserError` (exit status 2)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from tenfold.errors import UserError
from tenfold.terms import DEFAULT_PIPELINE_SCHEDULE, PIPELINE_SCHEDULES, PRECISIONS, RECOMPUTE_FORMS

GiB = 2**30


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
    m = p.add_argument_group("model (one of: --model, dimensions, --hf-config, --params)")
    m.add_argument("--model", help="preset name (tenfold.models.presets.PRESETS)")
    m.add_argument("--params", type=_number, help="parameter count only: model states, no activations")
    m.add_argument("--hf-config", help="a Hugging Face config.json")
    m.add_argument("--layers", type=_count)
    m.add_argument("--hidden", type=_count)
    m.add_argument("--heads", type=_count)
    m.add_argument("--kv-heads", type=_count)
    m.add_argument("--ffn", type=_count)
    m.add_argument("--vocab", type=_count)
    m.add_argument("--mlp", choices=("swiglu", "gelu"))
    m.add_argument("--norm", choices=("rmsnorm", "layernorm"))
    m.add_argument("--seq-len", type=_count)
    h = p.add_argument_group("hardware")
    h.add_argument("--gpu", default="a100-80gb", help="catalog name, 'cpu' (this machine, measured) or a .toml file")
    h.add_argument("--hardware-file", help="user-defined hardware (TOML); overrides --gpu")
    h.add_argument("--gpus", type=_count, default=None, help="number of GPUs (default 1; --ladder: 64)")
    h.add_argument("--gpus-per-node", type=_count)
    h.add_argument("--memory-gb", type=_number, help="override the device memory (GB = 1e9 bytes), e.g. a budget")
    s = p.add_argument_group("strategy")
    s.add_argument("--precision", choices=PRECISIONS, default="bf16")
    s.add_argument("--micro-batch", type=_count, help="sequences per micro-batch per data-parallel rank (default: 8, or global batch / dp)")
    s.add_argument("--global-batch", type=_count)
    s.add_argument("--grad-accum", type=_count)
    s.add_argument("--ac", default="none", help=f"activation recompute: {RECOMPUTE_FORMS}")
    s.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    s.add_argument("--offload", choices=("none", "optimizer", "optimizer+params"), default="none")
    s.add_argument("--tp", type=_count, default=1)
    s.add_argument("--pp", type=_count, default=1)
    s.add_argument("--pp-schedule", choices=PIPELINE_SCHEDULES, default=DEFAULT_PIPELINE_SCHEDULE)
    s.add_argument("--virtual-stages", type=_count, help="stages per device for interleaved schedules (default 2)")
    s.add_argument("--flash-attention", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--sequence-parallel", action="store_true",
                   help="Korthikanti et al. 2022 sequence parallelism (tenfold train turns it on with --tp > 1; "
                        "off here by default, as in Narayanan et al. 2021's runs)")
    s.add_argument("--dropout", action="store_true", help="the model uses dropout (GPT-2/3 style)")
    s.add_argument("--master-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="16-bit params + fp32 master copy (ZeRO/DeepSpeed); --no-master-weights: fp32 params + autocast")
    s.add_argument("--grads-fp32", action="store_true", help="fp32 gradients (Megatron main grads)")
    s.add_argument("--overlap-comm", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--activation-style", choices=("tenfold", "megatron"), default="tenfold",
                   help="tenfold: eager PyTorch + autocast, fp32 loss tensors (default); megatron: fused kernels "
                        "(Korthikanti et al. 2022)")
    s.add_argument("--tokens", type=_number, help="training tokens, for days and GPU-hours")
    s.add_argument("--achieved-tflops", type=_number, help="per-GPU hardware TFLOP/s (Narayanan's X) instead of the time model")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object")
    o.add_argument("--explain", action="store_true", help="every formula with its source")
    o.add_argument("--plot", metavar="FILE.png", help="draw the memory breakdown (and --search candidates)")
    o.add_argument("--search", action="store_true", help="the fastest strategies that fit")
    o.add_argument("--top", type=_count, default=5, help="--search: how many to show")
    o.add_argument("--ladder", action="store_true", help="the seed's optimization path, rung by rung")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="predict memory, step time, MFU and days; search strategies",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def _model(args):
    from tenfold.models.presets import ModelConfig, get_preset
    from tenfold.models.hf_config import model_from_hf_config

    dims = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab")}
    given = [n for n, v in (("--model", args.model), ("--params", args.params), ("--hf-config", args.hf_config),
                            ("dimensions", any(v is not None for v in dims.values()))) if v]
    if len(given) > 1:
        raise UserError(f"give one model: {' and '.join(given)} were both given")
    if args.params:
        return args.params
    if args.hf_config:
        cfg = model_from_hf_config(args.hf_config)
    elif args.model:
        cfg = get_preset(args.model)
    elif any(v is not None for v in dims.values()):
        missing = [f"--{k}" for k, v in dims.items() if v is None]
        if missing:
            raise UserError(f"model dimensions need {', '.join(missing)} as well")
        cfg = ModelConfig(n_layers=args.layers, d_model=args.hidden, n_heads=args.heads, vocab_size=args.vocab,
                          max_seq_len=args.seq_len or 2048, n_kv_heads=args.kv_heads, d_ff=args.ffn,
                          mlp=args.mlp or "swiglu", norm=args.norm or "rmsnorm")
        return cfg
    else:
        return None
    over = {"n_kv_heads": args.kv_heads, "d_ff": args.ffn, "mlp": args.mlp, "norm": args.norm}
    if args.seq_len and args.seq_len > cfg.max_seq_len and cfg.pos == "rope":
        over["max_seq_len"] = args.seq_len  # RoPE has no learned table to outgrow
    from tenfold.plan.shape import shape_of

    name = args.model or args.hf_config
    if any(v is not None for v in over.values()):
        name += " (modified)"
    return shape_of(cfg.with_overrides(**over), name=name)


def _strategy(args):
    from tenfold.plan.strategy import Strategy

    return Strategy(
        precision=args.precision, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
        global_batch=args.global_batch, seq_len=args.seq_len, ac=args.ac, zero=args.zero, offload=args.offload,
        tp=args.tp, pp=args.pp, pp_schedule=args.pp_schedule,
        virtual_stages=args.virtual_stages,
        flash_attention=args.flash_attention, sequence_parallel=args.sequence_parallel, tokens=args.tokens,
        achieved_tflops=args.achieved_tflops, master_weights=args.master_weights, grads_fp32=args.grads_fp32,
        overlap_comm=args.overlap_comm, dropout=args.dropout, activation_style=args.activation_style,
    )


def run(args) -> int:
    """Entry point for `tenfold plan` (argparse namespace in, exit status out)."""
    from tenfold.plan.hardware import get_hardware

    hw = get_hardware(args.hardware_file or args.gpu)
    if args.memory_gb:
        from dataclasses import replace

        hw = replace(hw, memory_bytes=args.memory_gb * 1e9, name=f"{hw.name} ({args.memory_gb:g} GB)")
    if args.ladder:
        return _run_ladder(args, hw)
    model = _model(args)
    if model is None:
        raise UserError("tenfold plan needs a model: --model NAME, --params N, --hf-config FILE or --layers/--hidden/--heads/--vocab")
    gpus = args.gpus or 1
    strategy = _strategy(args)
    if args.search:
        return _run_search(args, model, hw, gpus, strategy)
    from tenfold.plan.api import largest_micro_batch, predict

    plan = predict(model, hw, gpus, strategy, gpus_per_node=args.gpus_per_node)
    if not isinstance(model, float):  # a shape is known: say how far the micro-batch could go
        plan.max_micro_batch = largest_micro_batch(model, hw, gpus, strategy, gpus_per_node=args.gpus_per_node)
    if args.plot:
        from tenfold.plan.plot import plot_memory

        plot_memory(plan, args.plot)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1, default=_json_default))
        return 0
    from tenfold.plan import report

    report.print_plan(plan, hw, explain=args.explain)
    return 0


def _json_default(o):
    if hasattr(o, "__dict__"):
        return vars(o)
    return str(o)


def _run_search(args, model, hw, gpus, strategy) -> int:
    from tenfold.plan import report
    from tenfold.plan.search import search

    result = search(model, hw, gpus, strategy, top_k=args.top, gpus_per_node=args.gpus_per_node)
    if args.plot:
        from tenfold.plan.plot import plot_search

        plot_search(result, args.plot)
    if args.json:
        print(json.dumps({"evaluated": result.evaluated, "fitting": result.fitting,
                          "best": [p.to_dict() for p in result.best]}, indent=1, default=_json_default))
        return 0
    report.print_search(result, hw, gpus)
    return 0


def _run_ladder(args, hw) -> int:
    from tenfold.plan import report
    from tenfold.plan.ladder import ladder_dict, run_ladder

    model = _model(args) or "gpt3-175b"
    rungs = run_ladder(model, hw,
                       gpus_node=args.gpus_per_node or min(8, hw.gpus_per_node), gpus_final=args.gpus or 64,
                       pp=args.pp if args.pp > 1 else 8, tokens=args.tokens or 300e9, seq_len=args.seq_len)
    if args.plot:
        from tenfold.plan.plot import plot_ladder

        plot_ladder(rungs, args.plot)
    if args.json:
        print(json.dumps(ladder_dict(rungs), indent=1, default=_json_default))
        return 0
    report.print_ladder(rungs)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tenfold plan", description=__doc__,
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
