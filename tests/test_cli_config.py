"""Strict config values, `tenfold train --dry-run`, and the one-line contract for every
failure: exit 2 for the user's input, 1 for a run that failed, a traceback only with --debug.
Torch-free: these run under any supported Python without torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tenfold.cli import main


def _run(tmp_path: Path, capsys, *flags: str) -> tuple[int, str, str]:
    code = main(["train", "--dry-run", "--out", str(tmp_path / "never"), *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def _file(tmp_path: Path, name: str, content: str | bytes) -> str:
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(p)


STRICT = [
    # no infinities or NaN in any float, from flags, --set, TOML or DeepSpeed JSON
    (["--lr", "inf"], ["train.lr", "finite"]),
    (["--lr", "nan"], ["train.lr"]),
    (["--set", "train.eps=inf"], ["train.eps", "finite"]),
    (["--set", "train.lr=-inf"], ["train.lr"]),
    (["--set", "precision.loss_scale=nan"], ["precision.loss_scale", "finite"]),
    (["--set", "parallel.timeout_s=inf"], ["parallel.timeout_s", "finite"]),
    (["--set", "train.schedule=WarmupLR", "--set", "train.schedule_params={warmup_max_lr=inf}"], ["warmup_max_lr=inf"]),
    # a boolean is not a number, a number is not a boolean
    (["--set", "parallel.zero_stage=true"], ["parallel.zero_stage", "not true/false"]),
    (["--set", "train.lr=true"], ["train.lr", "not true/false"]),
    (["--set", "log.tensorboard=1"], ["log.tensorboard", "true or false"]),
    (["--set", "model.bias=0"], ["model.bias", "true or false"]),
    (["--set", "parallel.pp_split=[true, 1]"], ["parallel.pp_split", "not true/false"]),
    # a string is not a number, a decimal number is not an integer
    (["--set", "train.steps='2'"], ["train.steps", "not a string"]),
    (["--set", "train.lr='1e-3'"], ["train.lr", "not a string"]),
    (["--set", "train.steps=abc"], ["train.steps", "not a string"]),
    (["--set", "train.steps=2.0"], ["train.steps", "not a decimal number"]),
    (["--set", "parallel.pp_split=[1.0, 3]"], ["parallel.pp_split", "a list of integers"]),
    # no empty names or paths
    (["--set", "log.out=''"], ["log.out", "must not be empty"]),
    (["--set", "data.path=''"], ["data.path", "must not be empty"]),
    (["--set", "recompute.policy=' '"], ["recompute.policy", "must not be empty"]),
    # paths the file system itself refuses
    (["--set", "model.hf_config=" + "x" * 300], ["model.hf_config", "File name too long"]),
    (["--config", "x" * 300], ["cannot read config file", "File name too long"]),
    (["--config", "run\n.toml"], ["config file not found: run\\n.toml"]),  # shown escaped, on one line
]


@pytest.mark.parametrize("flags, needles", STRICT)
def test_loose_values_exit_2_with_one_line(tmp_path, capsys, flags, needles):
    code, out, err = _run(tmp_path, capsys, *flags)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert all(n in err for n in needles), err
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize(
    "toml, needles",
    [
        ("[train]\nlr = inf\n", ["train.lr", "finite"]),
        ("[train]\neps = nan\n", ["train.eps", "finite"]),
        ("[parallel]\nzero_stage = true\n", ["parallel.zero_stage", "not true/false"]),
        ('[train]\nsteps = "2"\n', ["train.steps", "not a string"]),
        ("[train]\nsteps = 2.0\n", ["train.steps", "not a decimal number"]),
        ('[train]\nlr = "3e-4"\n', ["train.lr", "not a string"]),
        ("[data]\npath = ''\n", ["data.path", "must not be empty"]),
    ],
)
def test_loose_values_in_a_toml_config(tmp_path, capsys, toml, needles):
    code, _, err = _run(tmp_path, capsys, "--config", _file(tmp_path, "run.toml", toml))
    assert code == 2 and len(err.splitlines()) == 1 and all(n in err for n in needles), err


@pytest.mark.parametrize(
    "flag, name, content, needle",
    [
        ("--config", "run.toml", b"\x89PNG\r\n\x1a\n\x00\xff binary", "is not UTF-8 text (byte 0x89 on line 1)"),
        ("--config", "run.toml", "[train\nsteps = 3", "malformed TOML"),
        ("--deepspeed", "ds.json", b"\x00\x01\xfe", "is not UTF-8 text"),
        ("--deepspeed", "ds.json", '{\n"gradient_clipping": Infinity\n}', "'gradient_clipping' in"),
        ("--deepspeed", "ds.json", '{"gradient_clipping": Infinity}', "line 1: 'Infinity}' is read as text"),
    ],
)
def test_bad_config_files_are_one_line(tmp_path, capsys, flag, name, content, needle):
    path = _file(tmp_path, name, content)
    code, _, err = _run(tmp_path, capsys, flag, path)
    assert code == 2 and len(err.splitlines()) == 1 and needle in err and path in err, err


def test_a_directory_or_device_as_config_is_one_line(tmp_path, capsys):
    for flag in ("--config", "--deepspeed"):
        code, _, err = _run(tmp_path, capsys, flag, str(tmp_path))
        assert code == 2 and err.endswith("is a directory; expected a text file"), err
        code, _, err = _run(tmp_path, capsys, flag, os.devnull)
        assert code == 2 and "is not a regular file" in err, err


def test_dry_run_prints_the_resolved_run_and_writes_nothing(tmp_path, capsys):
    code, out, err = _run(tmp_path, capsys, "--nproc", "4", "--pp", "2", "--global-batch", "32",
                          "--micro-batch", "8", "--zero", "1", "--ac", "every:2", "--precision", "fp16")
    assert code == 0, err
    assert "32 = 8 x 2 x dp 2 sequences of 256 tokens (8,192 tokens per step)" in out
    assert "4 = pp 2 x dp 2 x tp 1; ZeRO-1; recompute every:2; schedule 1f1b" in out and "precision  fp16" in out
    assert "memory     per rank, predicted (planner): params " in out
    assert not (tmp_path / "never").exists()


def test_reduce_dtype_flag_sets_the_key_and_the_dry_run_shows_it(tmp_path, capsys):
    code, out, err = _run(tmp_path, capsys, "--nproc", "2", "--zero", "2", "--reduce-dtype", "bf16")
    assert code == 0 and "ZeRO-2; recompute none; gradients reduced in bf16" in out, err
    code, out, err = _run(tmp_path, capsys, "--nproc", "2")
    assert code == 0 and "gradients reduced" not in out, err  # fp32, the default, goes without saying
    code, out, err = _run(tmp_path, capsys, "--reduce-dtype", "fp16")
    assert code == 2 and len(err.splitlines()) == 1 and "parallel.reduce_dtype" in err and "'fp32' or 'bf16'" in err


def test_dry_run_checks_what_the_run_would_refuse(tmp_path, capsys):
    for flags, needle in (
        (["--micro-batch", "2", "--grad-accum", "4", "--global-batch", "16"], "16 must equal"),
        (["--ac", "every:x"], "every:x"),
        (["--nproc", "3", "--pp", "2"], "must divide"),
        (["--seq-len", "4096"], "max_seq_len"),
        (["--set", "train.schedule=WarmupLR", "--set", "train.schedule_params={warmup_steps=3}"], "warmup_steps"),
    ):
        code, out, err = _run(tmp_path, capsys, *flags)
        assert code == 2 and len(err.splitlines()) == 1 and needle in err and out == "", (flags, err)


def test_dry_run_needs_no_torch_and_no_time(tmp_path):
    """A dry run imports neither torch nor the data (a subprocess: this one may hold torch)."""
    script = (
        "import sys, time; t = time.perf_counter(); from tenfold.cli import main; "
        f"rc = main(['train', '--dry-run', '--model', 'gpt3-125m', '--out', {str(tmp_path / 'x')!r}]); "
        "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]; "
        "print(f'{time.perf_counter() - t:.2f}')"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.splitlines()[-1]) < 5.0  # ~0.3 s when the machine is quiet


def test_anything_that_escapes_validation_is_one_line_and_debug_shows_it(tmp_path, capsys, monkeypatch):
    import tenfold.engine.preview.dry_run as run_shape

    def boom(cfg):
        raise ValueError("a bug\nwith two lines")

    monkeypatch.setattr(run_shape, "dry_run", boom)
    code, _, err = _run(tmp_path, capsys)
    assert code == 1 and err == "tenfold: error: unexpected ValueError: a bug with two lines (rerun with --debug for the traceback)"
    for argv in (["train", "--dry-run", "--debug"], ["--debug", "train", "--dry-run"]):
        with pytest.raises(ValueError, match="a bug"):
            main(argv)

    def unwritable(cfg):
        raise PermissionError(13, "Permission denied", "/srv/runs/x/metrics.jsonl")

    monkeypatch.setattr(run_shape, "dry_run", unwritable)
    code, _, err = _run(tmp_path, capsys)
    assert (code, err) == (1, "tenfold: error: Permission denied: /srv/runs/x/metrics.jsonl")


def test_debug_is_accepted_after_any_subcommand(capsys):
    assert main(["plan", "--model", "tiny", "--gpu", "a100-80gb", "--json", "--debug"]) == 0
    assert '"fits"' in capsys.readouterr().out


def test_cpu_plan_without_torch_says_what_measures_the_peak(monkeypatch, tmp_path, capsys):
    from tenfold.plan import cpu_peak

    monkeypatch.setenv("TENFOLD_CACHE_DIR", str(tmp_path))  # no cached peak
    monkeypatch.setattr(cpu_peak, "torch_version", lambda: "none")
    assert main(["plan", "--model", "tiny", "--gpu", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "measured with torch, which is not installed" in err and "--gpu a100-80gb" in err, err


def test_keys_with_control_characters_stay_on_one_line(tmp_path, capsys):
    path = _file(tmp_path, "ds.json", '{"wand\\nb": 1, "fp16": {"enabled": True}}')
    code, _, err = _run(tmp_path, capsys, "--deepspeed", path)
    assert code == 0 and len(err.splitlines()) == 2, err  # the notice, then the warning
    assert err.splitlines()[1].endswith("(ignored): wand\\nb")


def test_strict_numbers_still_take_every_honest_spelling(tmp_path, capsys):
    """Integers for integer keys from flags, --set and TOML; an integer where a float is wanted;
    DeepSpeed's 5e8-style integers (read by the DeepSpeed reader, not as decimals)."""
    toml = _file(tmp_path, "run.toml", "[train]\nsteps = 7\nlr = 1\n[parallel]\nreduce_bucket_size = 500000000\n")
    ds = _file(tmp_path, "ds.json", '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": '
                                    '{"stage": 1, "reduce_bucket_size": 5e8}}')
    code, out, err = _run(tmp_path, capsys, "--config", toml, "--deepspeed", ds, "--set", "train.seed=3", "--lr", "2")
    assert code == 0, err
    from tenfold.cli import build_parser, config_from_args

    argv = ["train", "--config", toml, "--deepspeed", ds, "--steps", "5", "--set", "train.warmup_steps=2"]
    cfg = config_from_args(build_parser(argv).parse_args(argv))
    assert (cfg.train.steps, cfg.train.lr, cfg.train.warmup_steps) == (5, 1.0, 2)
    assert cfg.parallel.reduce_bucket_size == 500_000_000 and cfg.train.micro_batch == 2


@pytest.mark.parametrize("flag", ["--hf-pretrained", "--hf-config"])
def test_a_missing_hugging_face_model_names_the_flag_typed(tmp_path, capsys, flag):
    missing = str(tmp_path / "missing")
    code, _, err = _run(tmp_path, capsys, flag, missing)
    assert code == 2 and err == f"tenfold: error: {flag} not found: {missing}", err
    assert main(["plan", flag, missing]) == 2
    assert capsys.readouterr().err.strip() == err
    (tmp_path / "list.json").write_text("[1]")
    code, _, err = _run(tmp_path, capsys, flag, str(tmp_path / "list.json"))
    assert code == 2 and err.startswith(f"tenfold: error: {flag} ") and "expected a JSON object" in err, err


def test_plan_emit_into_a_read_only_folder_names_the_flag(tmp_path, capsys, monkeypatch):
    """EROFS on the write and on the clean-up of the scratch file: one line naming --emit, exit 2."""
    from conftest import make_read_only

    (tmp_path / "ro").mkdir()
    make_read_only(monkeypatch, tmp_path / "ro")
    target = tmp_path / "ro" / "plan.toml"
    assert main(["plan", "--model", "tiny", "--gpu", "a100", "--emit", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"tenfold: error: --emit {target}: cannot write it (Read-only file system); choose a writable place"


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_train_help_opens_with_what_train_does(capsys):
    out = _help(capsys, "train")
    description = out.split("\n\n")[1]  # after argparse's usage block
    assert description.startswith("tenfold train: train a model"), description
    assert "plan | ladder" not in out


def test_plan_help_lists_only_what_plan_prices(capsys):
    out = _help(capsys, "plan")
    for flag in ("--zero", "--micro-batch", "--gpu", "--tokens", "--search"):
        assert flag in out, flag
    for flag in ("--out", "--wandb", "--resume", "--overwrite", "--checkpoint-every", "--log-every", "--lr"):
        assert f"{flag} " not in out and f"{flag}\n" not in out and f"[{flag}" not in out, flag
    assert "the\nthe" not in out and "recipe" not in out
    # still accepted: a train command line plans unchanged
    assert main(["plan", "--model", "tiny", "--out", "runs/x", "--wandb", "--resume", "auto", "--lr", "1e-3",
                 "--json"]) == 0
