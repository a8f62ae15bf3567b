"""`tenfold train | plan | ladder | tune | export | data`: the command line.

Only the requested subcommand's module is imported, so `tenfold plan` never imports torch.
Bad input of any kind (flag, config, data file, checkpoint) -> one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util  # find_spec: `import importlib` alone does not load the submodule
import sys

from tenfold import __version__
from tenfold.errors import RunError, TenfoldNote, UserError

# name -> (module with register(subparsers), one-line help). `train` is registered here.
SUBCOMMANDS: dict[str, tuple[str | None, str]] = {
    "train": (None, "train a model with the configured techniques (defaults: tiny, stdlib corpus, bf16)"),
    "plan": ("tenfold.plan.cli", "predict memory and time per GPU for a model, fleet and strategy; search strategies"),
    "ladder": ("tenfold.ladder", "measure the recipe's optimization path step by step on this machine"),
    "tune": ("tenfold.tune", "measure the planner's best strategies here, calibrate the planner, keep the fastest"),
    "export": ("tenfold.engine.export", "write a checkpoint's weights as one safetensors file (+ model config)"),
    "data": ("tenfold.data.prepare", "prepare data: tokenize once into a memory-mapped .bin"),
}

EXAMPLES = """examples:
  tenfold train                                   # tiny on the stdlib corpus, bf16, a few minutes on a CPU
  tenfold train --model small --steps 500 --micro-batch 4 --grad-accum 8
  tenfold train --precision fp16 --deepspeed ds_config.json
  tenfold train --deepspeed ds_config.json --dry-run  # check the config, print the run; build nothing
  tenfold train --nproc 2 --zero 3 --ac full      # two local ranks, ZeRO-3, full recompute
  tenfold train --nproc 4 --tp 2 --zero 3         # tensor parallel pairs, ZeRO-3 across them
  tenfold train --hf-pretrained MODEL_DIR --data train.jsonl   # fine-tune with the model's own tokenizer
  tenfold data prepare corpus/ --out corpus.bin --tokenizer MODEL_DIR
  tenfold plan --model gpt3-175b --gpu a100-80gb --gpus 64 --zero 3 --ac full
  tenfold tune --model small --nproc 2 --budget 600  # measure the best strategies here; writes best.toml
"""


DEBUG_HELP = "on an error, show Python's traceback instead of the one-line message"


class _Parser(argparse.ArgumentParser):
    """argparse with the project's contract for bad flags: one line, exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {escaped(message)} (see {self.prog} --help)\n")
        raise SystemExit(2)


def _add_train_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help=SUBCOMMANDS["train"][1], description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
    )
    add_run_arguments(p)
    once = p.add_mutually_exclusive_group()
    once.add_argument("--dry-run", action="store_true", help="check the config and print the run it resolves to "
                      "(batch, precision, model, processes, predicted memory per rank); build, read and write nothing")
    once.add_argument("--memory-report", action="store_true", help="print the per-module memory of one step and exit")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    p.set_defaults(func=run_train)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that make a run's config (`config_from_args`): `tenfold train` takes them, and
    `tenfold plan` takes the very same ones to predict that run."""
    g = p.add_argument_group("run")
    g.add_argument("--config", metavar="FILE.toml", help="TOML config (sections model, data, train, precision, recompute, parallel, checkpoint, log)")
    g.add_argument("--deepspeed", metavar="DS.json", help="a DeepSpeed config, read as DeepSpeed reads it (comments and trailing commas allowed); unsupported keys are named in one warning")
    g.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override any config key (repeatable), e.g. --set train.weight_decay=0.05")
    g.add_argument("--out", help="output directory (metrics.jsonl, summary.json, tensorboard/, checkpoints/); default runs/tenfold")
    g.add_argument("--overwrite", action="store_true", default=None, help="replace the earlier run in --out "
                   "(moved aside, deleted once the new run has saved its first checkpoint or finished); without it a fresh run into "
                   "a folder that holds one is refused")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar: plain per-step lines, as when stdout is not a terminal")
    g.add_argument("--log-every", type=int, metavar="N", help="metrics rows and plain lines every N steps (default 1); on a terminal, N > 1 also keeps a line every N steps above the bar")
    g.add_argument("--wandb", action="store_true", help="also log to Weights & Biases (needs tenfold[wandb]; WANDB_MODE=offline works without a network)")
    m = p.add_argument_group("model and data")
    m.add_argument("--model", help="preset: tiny, small, gpt3-125m ... gpt3-175b, llama-7b/13b/70b (default tiny)")
    m.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context)")
    m.add_argument("--data", help="text / JSONL / .bin / parquet file or directory, a datasets save_to_disk folder, or hf:NAME (default: this Python's stdlib sources)")
    m.add_argument("--data-format", help="text | jsonl | prompt-completion | chat | bin (default: detected from the data)")
    m.add_argument("--tokenizer", help="byte | bpe | a tokenizer.json or Hugging Face tokenizer folder (default: byte, or the --hf-pretrained folder's own)")
    m.add_argument("--streaming", action="store_true", default=None, help="read the data lazily (larger than memory); resumes exactly")
    m.add_argument("--hf-config", metavar="config.json", help="a Hugging Face causal LM from its config.json (random init, no download; needs tenfold[hf])")
    m.add_argument("--hf-pretrained", metavar="DIR", help="a local Hugging Face folder with config.json + *.safetensors weights")
    m.add_argument("--blocks", metavar="ClassName", help="the model's repeated block class for recompute and ZeRO (default: found automatically)")
    t = p.add_argument_group("optimization")
    t.add_argument("--steps", type=int, help="optimizer steps (default 200)")
    t.add_argument("--micro-batch", type=int, help="sequences per micro-batch per rank (default 8)")
    t.add_argument("--grad-accum", type=int, help="micro-batches accumulated per optimizer step")
    t.add_argument("--global-batch", type=int, help="sequences per optimizer step over all ranks")
    t.add_argument("--lr", type=float, help="peak learning rate (default 2e-3)")
    t.add_argument("--seed", type=int, help="seed for init and data order (default 1337)")
    t.add_argument("--eval-every", type=int, help="validation loss every N steps (0: at the end only)")
    t.add_argument("--on-nan", help="non-finite loss in bf16/fp32: stop (default) or skip")
    x = p.add_argument_group("techniques")
    x.add_argument("--precision", help="fp32 | bf16 (default) | fp16 (dynamic loss scaling)")
    x.add_argument("--ac", help="activation recompute: none | full | every:N | segments:K | selective[:attention|:mlp] | offload")
    x.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each transformer block (compile time reported on its own; default off: "
                   "see docs/compile.md for where it pays)")
    x.add_argument("--zero", type=int, help="ZeRO stage 0-3 across data-parallel ranks")
    x.add_argument("--nproc", type=int, help="start N local ranks (a torchrun shortcut)")
    x.add_argument("--watchdog", type=float, metavar="FACTOR", help="multi-process runs: a step that runs past FACTOR x "
                   "the median step (and parallel.watchdog_min_s, 30 s) stops the job, naming the rank that stalled "
                   "(default 10; 0: off)")
    x.add_argument("--pp", type=int, help="pipeline stages")
    x.add_argument("--tp", type=int, help="tensor-parallel ranks: each layer's matrices split over N ranks (must divide the heads)")
    x.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="split norms and the residual stream by sequence over the tp ranks (default: on when --tp > 1)")
    x.add_argument("--pp-schedule", help="gpipe | 1f1b | interleaved | zero-bubble")
    x.add_argument("--virtual-stages", type=int, help="stages per rank for interleaved schedules")
    x.add_argument("--pp-split", type=_int_list, metavar="N,N,...", help="transformer blocks per pipeline stage, e.g. 1,3 (default: even, embedding and head weighted as one block each)")
    c = p.add_argument_group("checkpoints")
    c.add_argument("--checkpoint-every", type=int, help="save every N steps (0: never)")
    c.add_argument("--keep-last", type=int, help="keep only the newest K checkpoints")
    c.add_argument("--resume", help="auto (newest complete checkpoint in --out) or a checkpoint path")
    c.add_argument("--no-final-checkpoint", action="store_true", help="do not save a checkpoint at the last step (saved by default)")


# flag -> (section, key)
_TRAIN_FLAGS = {
    "out": ("log", "out"), "overwrite": ("log", "overwrite"), "watchdog": ("parallel", "watchdog"), "model": ("model", "name"), "seq_len": ("data", "seq_len"), "data": ("data", "path"),
    "data_format": ("data", "format"), "tokenizer": ("data", "tokenizer"), "streaming": ("data", "streaming"),
    "hf_config": ("model", "hf_config"), "hf_pretrained": ("model", "hf_pretrained"), "blocks": ("model", "blocks"),
    "steps": ("train", "steps"), "micro_batch": ("train", "micro_batch"), "grad_accum": ("train", "grad_accum"),
    "global_batch": ("train", "global_batch"), "lr": ("train", "lr"), "seed": ("train", "seed"),
    "eval_every": ("train", "eval_every"), "on_nan": ("train", "on_nan"), "compile": ("train", "compile"), "precision": ("precision", "dtype"),
    "ac": ("recompute", "policy"), "zero": ("parallel", "zero_stage"), "nproc": ("parallel", "nproc"),
    "pp": ("parallel", "pp_degree"), "pp_schedule": ("parallel", "pp_schedule"),
    "tp": ("parallel", "tp_degree"), "sequence_parallel": ("parallel", "sequence_parallel"),
    "virtual_stages": ("parallel", "virtual_stages"), "pp_split": ("parallel", "pp_split"),
    "checkpoint_every": ("checkpoint", "every"),
    "keep_last": ("checkpoint", "keep_last"), "resume": ("checkpoint", "resume"), "log_every": ("log", "log_every"),
}
# store_true flags -> (section, key, value when given)
_SWITCHES = {
    "no_progress": ("log", "progress", False), "wandb": ("log", "wandb", True),
    "no_final_checkpoint": ("checkpoint", "final", False),
}


def _int_list(text: str) -> list[int]:
    """`--pp-split 1,3` -> [1, 3] (argparse turns the ValueError into a one-line exit 2)."""
    return [int(x) for x in text.split(",")]


def config_from_args(args: argparse.Namespace):
    """Layers, lowest precedence first: TOML file < DeepSpeed JSON < flags < --set."""
    from tenfold.config import build_config, load_toml, parse_set_item

    layers: list[dict] = []
    if args.config:
        layers.append(load_toml(args.config))
    if args.deepspeed:
        from tenfold.deepspeed_json import load_deepspeed_json, unsupported_warning

        ds = load_deepspeed_json(args.deepspeed)
        for notice in ds.notices:
            say("note", notice)
        warning = unsupported_warning(args.deepspeed, ds.unsupported)
        if warning:
            say("warning", warning)
        layers.append(ds.layer)
    flags: dict = {}
    for name, (section, key) in _TRAIN_FLAGS.items():
        value = getattr(args, name, None)
        if value is not None:
            flags.setdefault(section, {})[key] = value
    for name, (section, key, value) in _SWITCHES.items():
        if getattr(args, name, False):
            flags.setdefault(section, {})[key] = value
    layers.append(flags)
    layers.extend(parse_set_item(item) for item in args.set)
    return build_config(*layers)


def train_argv(cfg, always: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """The flags that make `config_from_args` build exactly `cfg` (`tenfold plan` prints them as
    a launch line): every value that differs from the default, and those of `always` (section ->
    keys), as its flag where there is one, else `--set section.key=value`. `parallel.nproc` is the
    launcher's (--nproc / torchrun)."""
    from tenfold.config import TenfoldConfig, toml_literal

    flag_of = {key: name for name, key in _TRAIN_FLAGS.items()}
    default = TenfoldConfig().model_dump(mode="json")
    out: list[str] = []
    for section, values in cfg.model_dump(mode="json").items():
        for key, value in values.items():
            shown = key in (always or {}).get(section, ()) and value is not None
            if (value == default[section][key] and not shown) or (section, key) == ("parallel", "nproc"):
                continue
            flag = flag_of.get((section, key))
            if (section, key) == ("log", "progress"):
                out.append("--no-progress")
            elif flag is not None and not isinstance(value, (bool, dict, type(None))):
                text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
                out += [f"--{flag.replace('_', '-')}", text]
            else:
                out += ["--set", f"{section}.{key}={toml_literal(value)}"]
    return out


def run_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.dry_run:
        from tenfold.engine.run_shape import dry_run

        return dry_run(cfg)
    from tenfold.engine.distributed import launched_by_torchrun

    if cfg.parallel.nproc > 1 and not launched_by_torchrun():
        from tenfold.engine.launch import run_under_torchrun

        return run_under_torchrun(args.argv, cfg.parallel.nproc, cfg)
    from tenfold.engine.trainer import Trainer

    trainer = Trainer(cfg)
    if args.memory_report:
        return trainer.memory_report()
    trainer.fit()
    return 0


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tenfold",
        description="tenfold: predict, then train transformers faster on fewer GPUs.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
    )
    parser.add_argument("--version", action="version", version=f"tenfold {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}", parser_class=_Parser)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        if name == "train":
            _add_train_parser(sub)
        elif name == wanted and module is not None and _module_exists(module):
            importlib.import_module(module).register(sub)
        else:  # listed in --help; registered fully only when asked for (keeps `plan` torch-free)
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    if not argv:
        parser.print_help()
        return 0
    args, extra = parser.parse_known_args(argv)
    if "--debug" in extra:  # accepted after any subcommand, not only where it is declared
        extra.remove("--debug")
        args.debug = True
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = argv  # the launcher re-runs this very command under torchrun
    if not args.debug:
        warnings_as_lines()
    if not hasattr(args, "func"):
        print(f"tenfold: error: `tenfold {args.command}` is not available in this build", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except Exception as e:  # noqa: BLE001 - reported as one line below
        if args.debug:
            raise
        return _one_line(e)
    except KeyboardInterrupt:
        print("tenfold: interrupted", file=sys.stderr)
        return 130


def escaped(text: str) -> str:
    """`text` with its control characters shown escaped (a key or path typed with a newline
    in it stays on one line)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def say(kind: str, message: object) -> None:
    """One line on stderr: `tenfold: <kind>: <message>`."""
    print(f"tenfold: {kind}: {escaped(str(message))}", file=sys.stderr)


def warnings_as_lines() -> None:
    """Python warnings as one line each: tenfold's own advice (`TenfoldNote`) as `tenfold: note:
    ...`, a library's as `tenfold: warning: ... (Category, file:line)`; never Python's two-line
    format with the source line (--debug keeps it). Library warnings a user cannot act on are
    filtered where they arise (engine/memory.py, engine/checkpoint/manager.py)."""
    import os
    import warnings

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        text = " ".join(str(message).split())
        if issubclass(category, TenfoldNote):
            say("note", text)
        else:
            say("warning", f"{text} ({category.__name__}, {os.path.basename(filename)}:{lineno})")

    warnings.showwarning = show


def _one_line(e: BaseException) -> int:
    """Every failure ends as one line on stderr and an exit status: 2 for the user's input,
    1 for a run that failed; --debug shows the traceback instead. A rank started by `--nproc`
    hands its line to the launcher, which prints it once for all the ranks (engine/launch.py)."""
    if isinstance(e, UserError):
        kind, text, code = "error", str(e), 2
    elif isinstance(e, RunError):
        kind, text, code = "run stopped", str(e), 1
    elif isinstance(e, OSError) and e.filename is not None:  # a file system failure names its path
        kind, text, code = "error", f"{e.strerror or e}: {e.filename}", 1
    else:
        detail = " ".join(str(e).split())[:300] or "(no message)"
        kind, text, code = "error", f"unexpected {type(e).__name__}: {detail} (rerun with --debug for the traceback)", 1
    line = f"tenfold: {kind}: {escaped(text)}"
    from tenfold.engine.launch import told_the_launcher  # torch-free

    if not told_the_launcher(line):
        print(line, file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
