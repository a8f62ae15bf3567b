"""tenfold.choices: every row of the run-choice table reaches its flag, its config key and the
resolved run, and a run written back as a config (`config_for_run`) resolves to the same run."""

from __future__ import annotations

import pytest

from tenfold.choices import RUN_CHOICES
from tenfold.config import TenfoldConfig, build_config
from tenfold.run import CHOICES, ResolvedRun, choices_from_config, config_for_run, resolve_run

WORLD = 8
# A value other than the default for each configured choice, with what it needs beside it.
SAMPLES = {
    "precision": ({"precision": {"dtype": "fp32"}}, "fp32"),
    "fp8": ({"precision": {"fp8": True}}, True),
    "fp8_emulate": ({"precision": {"fp8": True, "fp8_emulate": True}}, True),
    "micro_batch": ({"train": {"micro_batch": 2}}, 2),
    "grad_accum": ({"train": {"grad_accum": 3}}, 3),
    "global_batch": ({"train": {"global_batch": 32}}, 32),
    "compile": ({"train": {"compile": True}}, True),
    "seq_len": ({"data": {"seq_len": 64}}, 64),
    "recompute": ({"recompute": {"policy": "full"}}, "full"),
    "zero_stage": ({"parallel": {"zero_stage": 3}}, 3),
    "offload": ({"parallel": {"zero_stage": 3, "offload": "optimizer"}}, "optimizer"),
    "shard_group": ({"parallel": {"zero_stage": 3, "shard_group_size": 4}}, 4),
    "reduce_dtype": ({"parallel": {"reduce_dtype": "bf16"}}, "bf16"),
    "reduce_bucket_size": ({"parallel": {"reduce_bucket_size": 1000}}, 1000),
    "param_persistence_threshold": ({"parallel": {"param_persistence_threshold": 5}}, 5),
    "contiguous_gradients": ({"parallel": {"contiguous_gradients": False}}, False),
    "overlap_comm": ({"parallel": {"overlap_comm": False}}, False),
    "pp": ({"parallel": {"pp_degree": 2}, "train": {"grad_accum": 2}}, 2),
    "tp": ({"parallel": {"tp_degree": 2}}, 2),
    "cp": ({"parallel": {"cp_degree": 2}}, 2),
    "ep": ({"model": {"name": "tiny-moe"}, "parallel": {"ep_degree": 2}}, 2),
    "pp_schedule": ({"parallel": {"pp_degree": 2, "pp_schedule": "gpipe"}, "train": {"grad_accum": 2}}, "gpipe"),
    "virtual_stages": ({"parallel": {"pp_degree": 2, "pp_schedule": "interleaved", "virtual_stages": 2},
                        "train": {"grad_accum": 2}}, 2),
    "pp_split": ({"parallel": {"pp_degree": 2, "pp_split": [1, 3]}, "train": {"grad_accum": 2}}, (1, 3)),
    "sequence_parallel": ({"parallel": {"tp_degree": 2, "sequence_parallel": False}}, False),
    "lora": ({"lora": {"rank": 4}}, 4),
}


def _run_value(run: ResolvedRun, name: str):
    value = run.choices()[name]
    if name == "recompute":
        return str(value)
    if name == "lora":
        return value.rank
    return value


def test_the_resolver_takes_every_row_and_only_them():
    assert set(CHOICES) == {c.name for c in RUN_CHOICES} | {"stack"}  # the planner's training stack
    assert {c.name: c.default for c in RUN_CHOICES}.items() <= CHOICES.items()


@pytest.mark.parametrize("row", [c for c in RUN_CHOICES if c.key and "." in c.key], ids=lambda c: c.name)
def test_each_row_default_is_the_configs(row):
    section, name = row.key.split(".")
    assert getattr(getattr(TenfoldConfig(), section), name) == row.default


@pytest.mark.parametrize("row", [c for c in RUN_CHOICES if c.flag], ids=lambda c: c.name)
def test_each_flag_exists_and_sets_its_key(row):
    from tenfold.cli import build_parser
    from tenfold.run_args import config_from_args

    argv = ["train", row.flag]
    parser = build_parser(argv)
    train = parser._subparsers._group_actions[0].choices["train"]
    action = next(a for a in train._actions if row.flag in a.option_strings)
    assert action.dest == row.flag_dest
    if row.allowed:  # each allowed value through the flag lands at the row's key
        section, name = row.key.split(".")
        for value in row.allowed:
            args = parser.parse_args(["train", row.flag, str(value)])
            assert getattr(getattr(config_from_args(args), section), name) == value


@pytest.mark.parametrize("row", [c for c in RUN_CHOICES if c.flag], ids=lambda c: c.name)
def test_each_flag_help_is_written_from_its_row(row):
    """tenfold train --help and tenfold plan --help list each choice's allowed values and default
    as its row holds them (one table: a value added to the row appears in the help)."""
    from tenfold.choices import flag_help
    from tenfold.cli import build_parser

    for command in ("train", "plan"):
        sub = build_parser([command])._subparsers._group_actions[0].choices[command]
        action = next(a for a in sub._actions if row.flag in a.option_strings)
        assert action.help == flag_help(row)
    for value in row.allowed or ():
        assert str(value) in flag_help(row)
    if row.default_text or row.default not in (None, False):
        assert "(default" in flag_help(row)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_configured_choice_reaches_the_run_and_back(name):
    """The config's value reaches ResolvedRun under the row's name (choices_from_config), and
    `config_for_run` writes it into a default config, which resolves to the same run. Mutation:
    config_for_run skipping a row -> that row's default comes back."""
    overrides, expected = SAMPLES[name]
    cfg = build_config(overrides)
    assert choices_from_config(cfg)[name] is not None
    run = resolve_run(cfg, WORLD, check=False, on_cpu=False)
    assert _run_value(run, name) == expected
    base = build_config({"model": overrides["model"]} if "model" in overrides else {})  # the defaults (and the model)
    again = resolve_run(config_for_run(base, run), WORLD, check=False, on_cpu=False)
    assert again.choices() == run.choices()
    assert again == run


def test_every_configured_row_has_a_sample():
    assert {c.name for c in RUN_CHOICES if c.key} == set(SAMPLES)
