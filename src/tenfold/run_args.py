"""The flags that make a run's config, and back: `tenfold train` takes them, `tenfold plan` and
`tenfold tune` take the very same ones (`add_run_arguments`), `config_from_args` reads them into
one typed config (TOML file < DeepSpeed JSON < flags < --set), and `train_argv` writes a config
back as the flags that rebuild it (the launch line `tenfold plan` prints).

Below the command line on purpose: the planner, the tune and the ladder use it without importing
`tenfold.cli`. No torch here.
"""

from __future__ import annotations

import argparse

from tenfold.errors import say
from tenfold.choices import LORA_GROUP, flag_help, flag_keys, flags_of_group


def add_run_arguments(p: argparse.ArgumentParser, priced_only: bool = False) -> None:
    """The flags that make a run's config (`config_from_args`): `tenfold train` takes them, and
    `tenfold plan` takes the very same ones to predict that run. `priced_only`: the flags that
    do not change the prediction (output, logging, checkpoints, learning rate, ...) are still
    accepted, so that a train command line plans unchanged, but left out of --help."""

    def only_train(text: str) -> str:
        return argparse.SUPPRESS if priced_only else text

    _run_group(p, only_train)
    _model_group(p)
    _optimization_group(p, only_train)
    _technique_group(p, only_train)
    _lora_group(p)
    _checkpoint_group(p, only_train)


def _run_group(p: argparse.ArgumentParser, only_train) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--config", metavar="FILE.toml", help="TOML config (sections model, data, train, precision, recompute, parallel, checkpoint, log)")
    g.add_argument("--deepspeed", metavar="DS.json", help="a DeepSpeed config, read as DeepSpeed reads it (comments and trailing commas allowed); unsupported keys are named in one warning")
    g.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override any config key (repeatable), e.g. --set train.weight_decay=0.05")
    g.add_argument("--out", help=only_train("output directory (metrics.jsonl, summary.json, tensorboard/, checkpoints/); default runs/tenfold"))
    g.add_argument("--overwrite", action="store_true", default=None, help=only_train("replace the earlier run in --out "
                   "(moved aside, deleted once the new run has saved its first checkpoint or finished); without it a fresh run into "
                   "a folder that holds one is refused"))
    g.add_argument("--no-progress", action="store_true", help=only_train("no live progress bar: plain per-step lines, as when stdout is not a terminal"))
    g.add_argument("--log-every", type=int, metavar="N", help=only_train("metrics rows and plain lines every N steps (default 1); on a terminal, N > 1 also keeps a line every N steps above the bar"))
    g.add_argument("--no-fit-check", action="store_true", help=only_train("start the run even where the planner's "
                   "memory prediction per rank exceeds the memory the rank has (refused by default, before anything is built)"))
    g.add_argument("--wandb", action="store_true", help=only_train("also log to Weights & Biases (needs tenfold[wandb]; WANDB_MODE=offline works without a network)"))


def _model_group(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model and data")
    m.add_argument("--model", help="preset: tiny, small, gpt3-125m ... gpt3-175b, llama-7b/13b/70b (default tiny)")
    m.add_argument("--data", help="text / JSONL / .bin / parquet file or directory, a datasets save_to_disk folder, or hf:NAME (default: this Python's stdlib sources)")
    m.add_argument("--data-format", help="text | jsonl | prompt-completion | chat | bin (default: detected from the data)")
    m.add_argument("--tokenizer", help="byte | bpe | a tokenizer.json or Hugging Face tokenizer folder (default: byte, or the --hf-pretrained folder's own)")
    m.add_argument("--streaming", action="store_true", default=None, help="read the data lazily (larger than memory); resumes exactly")
    m.add_argument("--hf-config", metavar="config.json", help="a Hugging Face causal LM from its config.json (random init, no download; needs tenfold[hf])")
    m.add_argument("--hf-pretrained", metavar="DIR", help="a local Hugging Face folder with config.json + *.safetensors weights")
    m.add_argument("--blocks", metavar="ClassName", help="the model's repeated block class for recompute and ZeRO (default: found automatically)")
    _choice_flags(m, "model and data")


def _optimization_group(p: argparse.ArgumentParser, only_train) -> None:
    t = p.add_argument_group("optimization")
    t.add_argument("--steps", type=int, help="optimizer steps (default 200)")
    t.add_argument("--lr", type=float, help=only_train("peak learning rate (default 2e-3)"))
    t.add_argument("--seed", type=int, help=only_train("seed for init and data order (default 1337)"))
    t.add_argument("--eval-every", type=int, help=only_train("validation loss every N steps (0: at the end only)"))
    t.add_argument("--on-nan", help=only_train("non-finite loss in bf16/fp32: stop (default) or skip"))
    _choice_flags(t, "optimization")


def _technique_group(p: argparse.ArgumentParser, only_train) -> None:
    x = p.add_argument_group("techniques")
    _choice_flags(x, "techniques")
    x.add_argument("--nproc", type=int, help="start N local ranks (a torchrun shortcut)")
    x.add_argument("--watchdog", type=float, metavar="FACTOR", help=only_train("multi-process runs: a step that runs past FACTOR x "
                   "the median step (and parallel.watchdog_min_s, 30 s) stops the job, naming the rank that stalled "
                   "(default 10; 0: off)"))


def _choice_flags(group, name: str) -> None:
    """The run choices' flags listed under --help section `name`, each as its row says
    (tenfold.choices: the value it takes, its help with the allowed values and the default)."""
    for c in flags_of_group(name):
        kwargs: dict = {"help": flag_help(c)}
        if c.value == "switch":
            kwargs.update(action="store_true", default=None)
        elif c.value == "on-off":
            kwargs.update(action=argparse.BooleanOptionalAction, default=None)
        else:
            kwargs["type"] = {"int": int, "str": str, "int_list": _int_list}[c.value]
        if c.metavar:
            kwargs["metavar"] = c.metavar
        group.add_argument(c.flag, **kwargs)


def _lora_group(p: argparse.ArgumentParser) -> None:
    lo = p.add_argument_group(LORA_GROUP)
    _choice_flags(lo, LORA_GROUP)
    lo.add_argument("--qlora", type=int, nargs="?", const=-1, metavar="RANK", help="LoRA on a frozen base in 4-bit "
                    "NF4 with double quantization (Dettmers et al. 2023); RANK defaults to --lora's, else 8")
    lo.add_argument("--lora-alpha", type=float, metavar="A", help="adapter scale alpha / RANK (default 2 x RANK)")
    lo.add_argument("--lora-dropout", type=float, metavar="P", help="dropout on the adapters' input (default 0)")
    lo.add_argument("--lora-targets", type=_str_list, metavar="NAME,...", help="the Linears to adapt, by module name "
                    "(wq,wv; q_proj,v_proj) or all-linear (default: every Linear of the blocks)")
    lo.add_argument("--lora-base", choices=("compute", "nf4"), help="the frozen base: compute (the run's dtype, "
                    "default) | nf4 (QLoRA, as --qlora)")


def _checkpoint_group(p: argparse.ArgumentParser, only_train) -> None:
    c = p.add_argument_group("checkpoints")
    c.add_argument("--checkpoint-every", type=int, help=only_train("save every N steps (0: never)"))
    c.add_argument("--keep-last", type=int, help=only_train("keep only the newest K checkpoints"))
    c.add_argument("--resume", help=only_train("auto (newest complete checkpoint in --out) or a checkpoint path"))
    c.add_argument("--no-final-checkpoint", action="store_true", help=only_train("do not save a checkpoint at the last step (saved by default)"))


# flag -> (section, key): the run choices' (tenfold.choices), and the other settings'
_TRAIN_FLAGS = {
    **flag_keys(),
    "out": ("log", "out"), "overwrite": ("log", "overwrite"), "watchdog": ("parallel", "watchdog"),
    "model": ("model", "name"), "data": ("data", "path"), "data_format": ("data", "format"),
    "tokenizer": ("data", "tokenizer"), "streaming": ("data", "streaming"), "hf_config": ("model", "hf_config"),
    "hf_pretrained": ("model", "hf_pretrained"), "blocks": ("model", "blocks"), "steps": ("train", "steps"),
    "lr": ("train", "lr"), "seed": ("train", "seed"), "eval_every": ("train", "eval_every"),
    "on_nan": ("train", "on_nan"), "nproc": ("parallel", "nproc"), "lora": ("lora", "rank"),
    "lora_alpha": ("lora", "alpha"), "lora_dropout": ("lora", "dropout"),
    "lora_targets": ("lora", "target_modules"), "lora_base": ("lora", "base"),
    "checkpoint_every": ("checkpoint", "every"), "keep_last": ("checkpoint", "keep_last"),
    "resume": ("checkpoint", "resume"), "log_every": ("log", "log_every"),
}
# store_true flags -> (section, key, value when given)
_SWITCHES = {
    "no_progress": ("log", "progress", False), "wandb": ("log", "wandb", True),
    "no_final_checkpoint": ("checkpoint", "final", False), "no_fit_check": ("train", "fit_check", False),
}


def _int_list(text: str) -> list[int]:
    """`--pp-split 1,3` -> [1, 3] (argparse turns the ValueError into a one-line exit 2)."""
    return [int(x) for x in text.split(",")]


def _str_list(text: str) -> list[str]:
    """`--lora-targets wq,wv` -> ["wq", "wv"]."""
    return [x.strip() for x in text.split(",")]


QLORA_DEFAULT_RANK = 8  # PEFT's LoraConfig and torchtune's recipes


def _qlora_flags(args: argparse.Namespace, flags: dict, below: list[dict]) -> None:
    """`--qlora [RANK]`: LoRA on an NF4 base, at RANK, else the rank --lora or the config
    files give, else 8."""
    rank = getattr(args, "qlora", None)
    if rank is None:
        return
    lora = flags.setdefault("lora", {})
    lora["base"] = "nf4"
    if rank != -1:
        lora["rank"] = rank
    elif not lora.get("rank") and not any(layer.get("lora", {}).get("rank") for layer in below):
        lora["rank"] = QLORA_DEFAULT_RANK


def config_from_args(args: argparse.Namespace):
    """Layers, lowest precedence first: TOML file < DeepSpeed JSON < flags < --set."""
    from tenfold.config import build_config, load_toml, parse_set_item

    layers: list[dict] = []
    sources: list[str | None] = []  # named in a message about a value that layer holds
    if args.config:
        layers.append(load_toml(args.config))
        sources.append(f"config file {args.config}")
    if args.deepspeed:
        from tenfold.deepspeed_json import load_deepspeed_json, unsupported_warning

        ds = load_deepspeed_json(args.deepspeed)
        for notice in ds.notices:
            say("note", notice)
        warning = unsupported_warning(args.deepspeed, ds.unsupported)
        if warning:
            say("warning", warning)
        layers.append(ds.layer)
        sources.append(f"DeepSpeed config {args.deepspeed}")
    flags: dict = {}
    for name, (section, key) in _TRAIN_FLAGS.items():
        value = getattr(args, name, None)
        if value is not None:
            flags.setdefault(section, {})[key] = value
    for name, (section, key, value) in _SWITCHES.items():
        if getattr(args, name, False):
            flags.setdefault(section, {})[key] = value
    _qlora_flags(args, flags, layers)
    layers.append(flags)
    layers.extend(parse_set_item(item) for item in args.set)
    return build_config(*layers, sources=tuple(sources))


LAUNCHER_KEYS = {("parallel", "nproc"), ("parallel", "nnodes")}


def train_argv(cfg, always: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """The flags that make `config_from_args` build exactly `cfg` (`tenfold plan` prints them as
    a launch line): every value that differs from the default, and those of `always` (section ->
    keys), as its flag where there is one, else `--set section.key=value`. The processes
    (`parallel.nproc`, `parallel.nnodes`) are the launcher's: --nproc, or torchrun's own flags."""
    from tenfold.config import TenfoldConfig, toml_literal

    flag_of = {key: name for name, key in _TRAIN_FLAGS.items()}
    default = TenfoldConfig().model_dump(mode="json")
    out: list[str] = []
    for section, values in cfg.model_dump(mode="json").items():
        for key, value in values.items():
            shown = key in (always or {}).get(section, ()) and value is not None
            if (value == default[section][key] and not shown) or (section, key) in LAUNCHER_KEYS:
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
