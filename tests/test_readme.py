"""The README's path, end to end: `make demo`, then every command of every ```bash block of
README.md, in order, as a user would type them from the repository's folder.

The commands are parsed from README.md (and the demo's from the Makefile), so the test breaks
when the README drifts from what the code does. What the test changes, and why:
  * step counts: `--steps N` becomes N // 100 (at least 2) and a train command without one gets
    `--steps 2`; the demo's 200 steps become 2 and "--steps 300 --resume auto" 3, so the resume
    still continues the demo;
  * size: train and ladder commands get a shrunken `tiny` (2 layers, d_model 64, sequences of 32
    tokens, 300 kB of corpus; a Hugging Face config keeps its own shape) and the ladder a small
    token budget and one repeat; a tune the same shrunken model, a 1 s window and a 20 s budget
    (its first trial always runs, so its best.toml exists for the commands after it);
  * `tensorboard --logdir DIR` is not served: the test reads DIR's events instead;
  * `make test` and `make test-py310` run this suite, and `source .venv/bin/activate` becomes PATH.
A ```bash block right after the HTML comment `<!-- readme-test: skip -->` is not run (for
commands that need the user's own model or data); every other block is.

The SLURM example runs too, with stand-ins for `srun` and `scontrol` on one "node" of two CPU
ranks: the same torchrun c10d rendezvous and `tenfold train` line as on a cluster.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SKIP_MARK = "<!-- readme-test: skip"
SHRINK_MODEL = ["--set", "model.n_layers=2", "--set", "model.d_model=64", "--set", "model.n_heads=4",
                "--set", "model.d_ff=128", "--set", "model.max_seq_len=64"]
SHRINK_DATA = ["--seq-len", "32", "--set", "data.max_bytes=300000", "--set", "train.eval_batches=2"]

pytestmark = pytest.mark.slow


def bash_blocks(text: str) -> list[list[str]]:
    """The command lines of every ```bash block, comments and blank lines removed."""
    blocks, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "```bash" or (i > 0 and lines[i - 1].strip().startswith(SKIP_MARK)):
            continue
        block = []
        for body in lines[i + 1:]:
            if body.strip() == "```":
                break
            command = re.split(r"\s+#\s", " " + body)[0].strip()
            if command and not command.startswith("#"):
                block.append(command)
        blocks.append(block)
    return blocks


def readme_commands() -> list[str]:
    return [c for block in bash_blocks((ROOT / "README.md").read_text()) for c in block]


def after_demo_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return bash_blocks(text[text.index("## After the demo"):])[0]


def makefile_demo() -> tuple[list[str], list[str]]:
    """(the demo's commands, the next commands it prints) from the Makefile's demo recipe."""
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    runs, echoed = [], []
    for line in recipe.splitlines()[1:]:
        line = line.strip()
        m = re.match(r'@echo "\s{2}(.+)"$', line)
        if m:
            echoed.append(re.split(r"\s+#\s", m.group(1))[0].strip())
        elif line and not line.startswith("@"):
            runs.append(line.replace("$(VENV)/bin/", ""))
    return runs, echoed


def _scaled_steps(args: list[str]) -> list[str]:
    if "--steps" in args:
        i = args.index("--steps") + 1
        return [*args[:i], str(max(2, int(args[i]) // 100)), *args[i + 1:]]
    return [*args, "--steps", "2"]


def _fast(args: list[str]) -> list[str]:
    """`tenfold` arguments with the test's small sizes (module docstring)."""
    sub = args[0]
    if sub == "train" and "--memory-report" in args:
        return [*args, *SHRINK_MODEL, *SHRINK_DATA]
    if sub == "train":
        model = [] if "--hf-config" in args or "--hf-pretrained" in args else SHRINK_MODEL
        return [*_scaled_steps(args), *model, *SHRINK_DATA, "--set", "train.eval_every=0"]
    if sub == "ladder" and "--project" not in args:
        return [*args, "--tokens", "256", "--global-batch", "2", "--seq-len", "32", "--repeats", "1",
                *SHRINK_MODEL, "--set", "data.max_bytes=300000", "--set", "train.eval_batches=1"]
    if sub == "tune":  # the last --budget wins
        return [*args, "--budget", "20", "--window", "1", *SHRINK_MODEL, *SHRINK_DATA]
    return args


def _env(extra: dict | None = None) -> dict:
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "WANDB_SILENT": "true"}
    env.update(extra or {})
    return env


def _check_tensorboard(args: list[str], cwd: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(cwd / args[args.index("--logdir") + 1]))
    acc.Reload()
    assert "train/loss" in acc.Tags()["scalars"], acc.Tags()


def run_command(command: str, cwd: Path) -> None:
    """Run one README command the way the module docstring says (`a && b`: a, then b)."""
    if " && " in command:
        for part in command.split(" && "):
            run_command(part, cwd)
        return
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    program, args = words[0], words[1:]
    if program == "make":
        assert args == ["demo"] or args[0].startswith("test"), command
        if args == ["demo"]:  # `make test*`: test suites, this test among them
            for demo in makefile_demo()[0]:
                run_command(demo, cwd)
        return
    if program == "source":
        assert (VENV_BIN / "activate").is_file() or not (ROOT / ".venv").exists()
        return
    if program == "tensorboard":
        return _check_tensorboard(args, cwd)
    if program == "tenfold":
        argv = [sys.executable, "-m", "tenfold", *_fast(args)]
    elif program == "torchrun":
        m = args.index("-m")
        argv = [str(VENV_BIN / "torchrun"), *args[:m + 2], *_fast(args[m + 2:])]
    else:
        raise AssertionError(f"the README test does not know how to run {program!r}: {command}")
    proc = subprocess.run(argv, cwd=cwd, env=_env(env), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{command}\n-> {' '.join(argv)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _workdir(tmp_path: Path) -> Path:
    """A folder that looks like the repository to the commands (docs/, examples/, tests/data)
    but keeps their outputs (runs/, model.safetensors) out of the real one."""
    work = tmp_path / "repo"
    work.mkdir()
    for name in ("docs", "examples", "tests"):
        (work / name).symlink_to(ROOT / name)
    return work


def test_the_demo_prints_the_readmes_next_commands():
    runs, echoed = makefile_demo()
    assert runs == ["tenfold train --overwrite"]  # make demo twice: the second replaces the first demo run
    assert echoed == after_demo_block(), "make demo's next commands and README's 'After the demo' differ"


def test_readme_commands_run_in_order_after_the_demo(tmp_path):
    commands = readme_commands()
    assert commands[0] == "make demo" and len(commands) > 20
    work = _workdir(tmp_path)
    for command in commands:
        run_command(command, work)
    assert (work / "model.safetensors").is_file()  # the export right after the demo's resume
    assert (work / "runs" / "tenfold" / "checkpoints" / "step_3").is_dir()  # demo (2) + resume (3)


def test_slurm_example_launches_torchrun_rendezvous(tmp_path):
    """examples/slurm_multinode.sbatch on one node with two CPU ranks: `srun` runs its command
    once, `scontrol show hostnames` names this host."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (shims / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    for shim in shims.iterdir():
        shim.chmod(0o755)
    config = tmp_path / "run.toml"
    config.write_text((ROOT / "examples" / "run.toml").read_text().replace("steps = 200", "steps = 2"))
    env = _env({"PATH": f"{shims}{os.pathsep}{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
                "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1", "SLURM_JOB_ID": "42",
                "SLURM_JOB_NAME": "tenfold-test", "GPUS_PER_NODE": "2", "OUT": str(tmp_path / "out"),
                "CONFIG": str(config), "RDZV_PORT": str(29500 + os.getpid() % 1000), "OMP_NUM_THREADS": "1"})
    script = ROOT / "examples" / "slurm_multinode.sbatch"
    # the test's small sizes, appended to the script's tenfold line
    text = script.read_text().replace("--resume auto", "--resume auto " + " ".join(SHRINK_MODEL + SHRINK_DATA))
    (tmp_path / "job.sbatch").write_text(text)
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 process(es)" in proc.stdout and (tmp_path / "out" / "checkpoints" / "step_2").is_dir()
    assert re.search(r"^step 2/2 \|", proc.stdout, re.M)  # plain lines: a job log is not a terminal
