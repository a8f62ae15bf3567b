"""`tenfold train | plan | ladder | tune | export | data`: the command line.

Only the requested subcommand's module is imported, so `tenfold plan` never imports torch.
Bad input of any kind (flag, config, data file, checkpoint) -> one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util  # find_spec: `import importlib` alone does not load the submodule
import os
import sys

from tenfold import __version__
from tenfold.errors import RunError, TenfoldNote, UserError, escaped, say
from tenfold.quiet import VERBOSE_ENV, hush_libraries, verbose
from tenfold.run_args import add_run_arguments, config_from_args

# name -> (module with register(subparsers), one-line help). `train` is registered here.
SUBCOMMANDS: dict[str, tuple[str | None, str]] = {
    "train": (None, "train a model with the configured techniques (defaults: tiny, stdlib corpus, bf16)"),
    "plan": ("tenfold.plan.cli", "predict memory and time per GPU for a model, fleet and strategy; search strategies"),
    "ladder": ("tenfold.ladder", "measure the optimization ladder (fp32 to ZeRO and pipeline) rung by rung on this machine"),
    "tune": ("tenfold.tune", "measure the planner's best strategies here, calibrate the planner, keep the fastest"),
    "export": ("tenfold.engine.outputs.export", "write a checkpoint's weights as one safetensors file (+ model config)"),
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
VERBOSE_HELP = (f"show the libraries' own warnings and log lines (torch, torchao, transformers), kept back by "
                f"default; {VERBOSE_ENV}=1 does the same")


class _Parser(argparse.ArgumentParser):
    """argparse with the project's contract for bad flags: one line, exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {escaped(message)} (see {self.prog} --help)\n")
        raise SystemExit(2)

    def _get_values(self, action, arg_strings):  # every value of every flag and argument passes here
        """An empty value (`--emit ""`, `--config ""`) is refused: taken as given it reads as
        "not given" and is silently ignored, or names the current folder."""
        if not isinstance(action, argparse._SubParsersAction) and any(not s.strip() for s in arg_strings):
            name = "/".join(action.option_strings) or action.metavar or action.dest
            self.error(f"argument {name}: expected a value, got an empty string")
        return super()._get_values(action, arg_strings)


def _add_train_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help=SUBCOMMANDS["train"][1], description=f"tenfold train: {SUBCOMMANDS['train'][1]}.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
    )
    add_run_arguments(p)
    once = p.add_mutually_exclusive_group()
    once.add_argument("--dry-run", action="store_true", help="check the config and print the run it resolves to "
                      "(batch, precision, model, processes, predicted memory per rank); build, read and write nothing")
    once.add_argument("--memory-report", action="store_true", help="print the per-module memory of one step and exit")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.dry_run:
        from tenfold.engine.preview.dry_run import dry_run

        return dry_run(cfg)
    from tenfold.engine.preview.dry_run import check_fit, world_size  # torch-free
    from tenfold.engine.parallel.torchrun_env import launched_by_torchrun

    if cfg.parallel.nnodes > 1 and not launched_by_torchrun():
        raise UserError(multinode_refusal(cfg, args.argv))
    check_fit(cfg, world_size(cfg))  # before torch is imported: a run too large for this machine is one line
    if cfg.parallel.nproc > 1 and not launched_by_torchrun():
        from tenfold.engine.parallel.launch import run_under_torchrun

        return run_under_torchrun(args.argv, cfg.parallel.nproc, cfg)
    from tenfold.engine.loop.trainer import Trainer

    trainer = Trainer(cfg)
    if args.memory_report:
        return trainer.memory_report()
    trainer.fit()
    return 0


def multinode_refusal(cfg, argv: list[str]) -> str:
    """Why a run planned for several nodes does not start from one command, and the command that
    starts it (torchrun on every node)."""
    import shlex

    from tenfold.plan.advice import RENDEZVOUS

    par = cfg.parallel
    rest = [a for a in argv[argv.index("train") + 1:]] if "train" in argv else []
    line = shlex.join(["torchrun", "--nnodes", str(par.nnodes), "--nproc-per-node", str(par.nproc), *RENDEZVOUS,
                       "-m", "tenfold", "train", *rest])
    return (f"parallel.nnodes = {par.nnodes}: this run spans {par.nnodes} nodes x {par.nproc} processes; start it "
            f"on every node with: {line} (HEAD = the first node's hostname); --dry-run checks it here")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tenfold",
        description="tenfold: predict, then train transformers faster on fewer GPUs.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
    )
    parser.add_argument("--version", action="version", version=f"tenfold {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
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


# libgomp's threads spin up to 300,000 times at each barrier before they sleep; when another
# process holds a core, the spinning threads take the time the late thread needs, and a small
# model's step gets several times slower. At 1,000 spins a busy 2-core box trained `tiny` 1.5x
# faster and an idle one equally fast (docs/benchmarks.md, "A busy machine").
OPENMP_SPINCOUNT = "1000"


def openmp_threads_sleep_sooner() -> None:
    """Set GOMP_SPINCOUNT for this process and the ranks it starts, before torch loads libgomp,
    unless the user chose an OpenMP wait policy."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    if not argv:
        parser.print_help()
        return 0
    args, extra = parser.parse_known_args(argv)
    for flag in ("--debug", "--verbose"):  # accepted after any subcommand, not only where declared
        if flag in extra:
            extra.remove(flag)
            setattr(args, flag.removeprefix("--"), True)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = argv  # the launcher re-runs this very command under torchrun
    openmp_threads_sleep_sooner()
    if not verbose(getattr(args, "verbose", False)):
        hush_libraries()  # before any subcommand imports torch, torchao or transformers
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


def warnings_as_lines() -> None:
    """Python warnings as one line each: tenfold's own advice (`TenfoldNote`) as `tenfold: note:
    ...`, a library's as `tenfold: warning: ... (Category, file:line)`; never Python's two-line
    format with the source line (--debug keeps it). Library warnings a user cannot act on are
    filtered where they arise (engine/memory/measure.py, engine/outputs/checkpoint/manager.py)."""
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
    hands its line to the launcher, which prints it once for all the ranks (engine/parallel/launch.py)."""
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
    from tenfold.engine.parallel.launch import told_the_launcher  # torch-free

    if not told_the_launcher(line):
        print(line, file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
