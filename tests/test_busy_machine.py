"""A busy machine and bad input: nothing waits, nothing hangs, nothing is built that cannot fit.

* The CPU peak (MFU's denominator) is measured in a fixed number of short timed GEMMs, stopped
  at a time budget however slow each one runs; only for the dtype the run trains in; never
  before a run's first step, never by --dry-run or a memory prediction; after a run's timings.
* A run whose predicted memory per rank exceeds what the rank has is refused before anything is
  built, naming both figures and the flag that starts it anyway; --dry-run prints the verdict.
* Every user file is read only from a regular file under a size cap: a device, a FIFO or a huge
  file is one line, exit 2.
* Every value is checked in the layer that writes it; empty flag values are refused.
* A Hugging Face run prints nothing before tenfold's header (library noise kept back).
* OpenMP's threads sleep after 1,000 spins instead of 300,000 unless the user set a wait policy:
  a busy core no longer stalls every barrier of a small model's step.

Wall-clock bounds here are generous (a loaded CI machine); what is bounded is asserted by
structure: how many GEMMs ran, when the measurement was called, whether anything was built.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import HERE, SMALL_FLAGS, planned, read_metrics, small_config
from tenfold.cli import main
from tenfold.errors import UserError

LLAMA_TINY = HERE / "data" / "llama-tiny" / "config.json"


@contextmanager
def within(seconds: int):
    """Fail (instead of hanging the suite) when the block runs longer than `seconds`."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    before = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("TENFOLD_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def no_subprocess_measurement(monkeypatch):
    """Any attempt of the planner to measure the CPU peak fails the test."""
    from tenfold.plan import cpu_peak

    def refuse(cmd, **kwargs):
        raise AssertionError(f"measured the peak: {cmd}")

    monkeypatch.setattr(cpu_peak.subprocess, "run", refuse)


# --------------------------------------------------------------------------- the peak, bounded


class FakeMachine:
    """GEMMs that take `flops / rate` seconds on a clock of their own; from call `busy_from` on,
    each takes `busy_s` (another process took the cores in the middle of the measurement)."""

    def __init__(self, rate: float, busy_from: int | None = None, busy_s: float = 0.0):
        self.rate, self.busy_from, self.busy_s = rate, busy_from, busy_s
        self.now, self.calls = 0.0, []

    def clock(self) -> float:
        return self.now

    def gemms(self, dtype: str, n: int):
        def gemm():
            busy = self.busy_from is not None and len(self.calls) >= self.busy_from
            self.calls.append(n)
            self.now += self.busy_s if busy else 2.0 * n**3 / self.rate

        return [gemm, gemm]  # torch.mm and F.linear


def test_the_peak_is_a_fixed_number_of_timed_gemms_with_the_best_kept():
    from tenfold.engine.observe import peak

    fast = FakeMachine(rate=1e12)
    assert peak.measure_peak("fp32", gemms=fast.gemms, clock=fast.clock) == pytest.approx(1e12)
    per_size = 2 * (1 + peak.REPEATS)  # two calls, one warm-up and REPEATS timed each
    assert fast.calls == [n for n in peak.SIZES for _ in range(per_size)]


def test_a_busy_machine_lowers_the_peak_but_cannot_stretch_the_measurement():
    """Every GEMM 50x slower (other processes on the cores): a lower figure, sizes that would
    take too long left out. The cores taken in the middle of the measurement, each GEMM then
    taking 1 s: it still ends at its budget, one GEMM past it at most. A slow dtype stops
    growing its size."""
    from tenfold.engine.observe import peak

    slow = FakeMachine(rate=1e12 / 50)
    assert peak.measure_peak("fp32", gemms=slow.gemms, clock=slow.clock) == pytest.approx(1e12 / 50)
    assert 2048 not in slow.calls  # one 2048 GEMM would take 0.86 s
    taken = FakeMachine(rate=1e12, busy_from=8, busy_s=1.0)  # after the 512 GEMMs
    assert peak.measure_peak("fp32", gemms=taken.gemms, clock=taken.clock) == pytest.approx(1e12)
    assert taken.now <= peak.BUDGET_S + 1.0 + 1.0  # the budget, the warm-up and the GEMM that crossed it
    crawling = FakeMachine(rate=2e9)  # fp16 without matrix instructions: a 2048 GEMM would take 8 s
    peak.measure_peak("fp16", gemms=crawling.gemms, clock=crawling.clock)
    assert 2048 not in crawling.calls and crawling.now <= peak.BUDGET_S + 1.0


def test_a_run_measures_only_its_dtype_and_only_after_its_timings(tmp_path, empty_cache, monkeypatch):
    """Empty cache: the run starts without a figure (no MFU in its step rows, none waited for),
    measures fp32 alone once its last step is done and its wall time taken, and reports MFU."""
    from tenfold.engine.observe import peak
    from tenfold.engine.loop.trainer import Trainer

    from tenfold.engine.outputs import records as run_outputs

    calls, events = [], []
    trainer = Trainer(small_config(tmp_path, train={"steps": 3}))
    monkeypatch.setattr(peak, "measure_peak", lambda dtype: calls.append((dtype, trainer.state.step))
                        or events.append("measured") or 1e15)
    finish = run_outputs.finish
    monkeypatch.setattr(run_outputs, "finish", lambda fit, last, wall: events.append("wall time taken")
                        or finish(fit, last, wall))
    summary = trainer.fit()
    assert calls == [("fp32", 3)]  # once, the run's dtype, after its last step
    assert events == ["wall time taken", "measured"]  # outside every throughput figure
    assert all(r["mfu"] is None for r in read_metrics(tmp_path / "run"))  # not measured yet while it ran
    assert summary["final"]["mfu"] is not None and summary["hardware"]["peak_flops_per_device"] == 1e15
    entry = json.loads((empty_cache / "cpu_peak.json").read_text())[peak.cpu_key()]
    assert {d for d in ("fp32", "bf16", "fp16") if d in entry} == {"fp32"}
    calls.clear()
    Trainer(small_config(tmp_path, train={"steps": 1}, log={"overwrite": True})).fit()
    assert calls == []  # the next run: cached


def test_plan_measures_only_the_dtype_it_prices_and_memory_never(empty_cache, monkeypatch):
    from tenfold.plan import cpu_peak
    from tenfold.plan.api import predict, predict_memory
    from tenfold.plan.hardware import get_hardware

    commands = []

    def child(cmd, **kwargs):
        commands.append(cmd)
        assert kwargs["timeout"] == cpu_peak.SUBPROCESS_TIMEOUT_S
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps({cmd[cmd.index("--dtype") + 1]: 5e10}), stderr="")

    monkeypatch.setattr(cpu_peak.subprocess, "run", child)
    run = planned("tiny", 1, precision="bf16", micro_batch=8, seq_len=256)
    hw = get_hardware("cpu")
    predict_memory(run, hw)
    assert commands == []  # memory needs no peak
    plan = predict(run, hw)
    assert len(commands) == 1 and commands[0][-4:] == ["--dtype", "bf16", "--threads", str(os.cpu_count())]
    assert plan.tokens_per_s > 0 and hw.peak_flops == {"bf16": 5e10}
    predict(run, hw)
    assert len(commands) == 1  # once per process


def test_dry_run_of_an_emitted_fleet_config_measures_nothing(tmp_path, empty_cache, no_subprocess_measurement, capsys):
    fleet = tmp_path / "FLEET.toml"
    assert main(["plan", "--model", "llama-70b", "--gpu", "h100-sxm", "--gpus", "64", "--search",
                 "--emit", str(fleet)]) == 0
    capsys.readouterr()
    with within(30):
        assert main(["train", "--config", str(fleet), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "memory     per rank, predicted (planner)" in out
    fit = next(line for line in out.splitlines() if line.startswith("  fit "))
    assert "does not fit here:" in fit and "per rank available" in fit and "--no-fit-check" in fit
    assert list(empty_cache.iterdir()) == []  # no measurement, no cache file


def test_with_a_busy_loop_and_no_cache_the_first_step_comes_before_any_measurement(tmp_path):
    """The issue's case: `python3 -c "while True: pass"` beside `tenfold train --steps 4` with an
    empty cache folder. The memory prediction and step 1 print before the peak is measured
    (the cache file appears only after the last step); the bound on time is generous."""
    cache = tmp_path / "cache"
    cache.mkdir()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    env = {**os.environ, "TENFOLD_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "tenfold", "train", "--steps", "4", "--out", str(tmp_path / "run"), *SMALL_FLAGS]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, float] = {}
    try:
        with within(300):
            for line in child.stdout:
                if line.startswith("memory per rank, predicted") and "memory" not in seen:
                    seen["memory"] = time.perf_counter() - start
                if line.startswith("step 1/4"):
                    seen["step 1"] = time.perf_counter() - start
                    assert not (cache / "cpu_peak.json").exists()  # nothing measured before the first step
            assert child.wait() == 0
    finally:
        busy.kill()
        child.kill()
        busy.wait()
    assert seen["memory"] <= seen["step 1"] < 120, seen
    assert (cache / "cpu_peak.json").exists()  # measured after the run's steps, for the next run


# --------------------------------------------------------------------------- fit before building


def tiny_host(monkeypatch, gib: float = 2**-10):
    from tenfold.plan import room

    monkeypatch.setattr(room, "host_memory", lambda: (gib * 2**30, "test limit"))


def test_a_run_that_cannot_fit_is_refused_before_torch_builds_anything(tmp_path, monkeypatch, capsys):
    """A 10,000,000-layer Hugging Face config: one line naming both figures and the flag, exit 2,
    and neither the Trainer nor the model is ever constructed."""
    import tenfold.engine.loop.trainer as trainer_module

    config = json.loads(LLAMA_TINY.read_text()) | {"num_hidden_layers": 10_000_000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))

    def built(*args, **kwargs):
        raise AssertionError("the run was built")

    monkeypatch.setattr(trainer_module, "Trainer", built)
    with within(30):
        code = main(["train", "--hf-config", str(path), "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "does not fit here" in err and "GiB per rank predicted" in err and "per rank available" in err
    assert "--no-fit-check" in err and not (tmp_path / "run").exists()


def test_the_trainer_checks_the_fit_before_the_data_and_the_model(tmp_path, monkeypatch):
    """The same check where the Trainer is used as a library (and on a GPU, where the command
    line cannot see the device's memory): nothing built; train.fit_check = false starts it."""
    from tenfold.engine.loop import parts
    from tenfold.engine.loop.trainer import Trainer

    tiny_host(monkeypatch)
    monkeypatch.setattr(parts, "build_data", lambda *a, **k: (_ for _ in ()).throw(AssertionError("data built")))
    with pytest.raises(UserError, match=r"does not fit here: .* per rank predicted .*1.00 MiB per rank available "
                                        r"\(1.00 MiB of host memory, test limit\).*--no-fit-check"):
        Trainer(small_config(tmp_path)).setup()
    with pytest.raises(AssertionError, match="data built"):  # past the check
        Trainer(small_config(tmp_path, train={"fit_check": False})).setup()


def test_dry_run_prints_the_verdict_train_refuses_with(tmp_path, monkeypatch, capsys):
    tiny_host(monkeypatch)
    flags = ["--nproc", "2", "--out", str(tmp_path / "run")]
    assert main(["train", "--dry-run", *flags]) == 0
    fit = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  fit "))
    figures = fit.split("does not fit here: ")[1].split(";")[0]
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err
    assert figures in err  # the same figures
    assert "512.00 KiB per rank available (1.00 MiB of host memory, test limit, shared by 2 local ranks)" in err
    tiny_host(monkeypatch, gib=64)
    assert main(["train", "--dry-run", *flags]) == 0
    assert "  fit        fits here: " in capsys.readouterr().out


# --------------------------------------------------------------------------- bad input, one line


def fifo(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    os.mkfifo(path)  # an open() for reading would wait for a writer
    return str(path)


def big_file(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    with path.open("wb") as f:
        f.truncate(64 * 2**20)  # sparse: 64 MiB that cost nothing
    return str(path)


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    hpz = tmp_path / "ds.json"
    hpz.write_text('{"zero_optimization": {"stage": 3, "zero_hpz_partition_size": -2}}')
    steps = tmp_path / "steps.toml"
    steps.write_text('[train]\nsteps = "2"\n')
    out = ["--out", str(tmp_path / "run")]
    return {
        "plan --hf-config /dev/zero": (["plan", "--hf-config", "/dev/zero", "--gpu", "a100-80gb"], "not a regular file"),
        "train --hf-config /dev/zero": (["train", "--hf-config", "/dev/zero", "--dry-run"], "not a regular file"),
        "a FIFO config": (["train", "--config", fifo(tmp_path, "run.toml"), "--dry-run"], "not a regular file"),
        "a FIFO DeepSpeed config": (["train", "--deepspeed", fifo(tmp_path, "ds-fifo.json"), "--dry-run"], "not a regular file"),
        "a huge config": (["train", "--config", big_file(tmp_path, "big.toml"), "--dry-run"], "larger than 4 MiB"),
        "a huge HF config": (["plan", "--hf-config", big_file(tmp_path, "big.json")], "larger than 4 MiB"),
        "zero_hpz_partition_size -2": (["train", "--deepspeed", str(hpz), "--dry-run", *out],
                                       "'zero_optimization.zero_hpz_partition_size' in"),
        "a file's steps beside --steps": (["train", "--config", str(steps), "--steps", "3", "--dry-run", *out],
                                          f"config file {steps}: invalid value '2' for train.steps"),
    }


def bounded_child(args: list[str], seconds: int = 60) -> tuple[subprocess.CompletedProcess, float]:
    """`args` in a child process that may neither hang the suite nor take the machine's memory
    (a read of /dev/zero grows without end): 2 GiB of address space, `seconds` at most."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=seconds, preexec_fn=limit)
    return proc, time.perf_counter() - start


@pytest.mark.parametrize("case", ["plan --hf-config /dev/zero", "train --hf-config /dev/zero", "a FIFO config",
                                  "a FIFO DeepSpeed config", "a huge config", "a huge HF config",
                                  "zero_hpz_partition_size -2", "a file's steps beside --steps"])
def test_bad_input_is_one_line_and_exit_2_at_once(tmp_path, case):
    """The command as a user types it: exit 2, one line, no torch imported (seconds, not the
    minutes a read of /dev/zero or a wait on a FIFO would take; the bound is generous)."""
    argv, needle = bad_inputs(tmp_path)[case]
    proc, seconds = bounded_child(["-m", "tenfold", *argv])
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert seconds < 30, seconds


@pytest.mark.parametrize("argv", [["plan", "--emit", ""], ["train", "--config", "", "--dry-run"],
                                  ["plan", "--hardware-file", ""], ["train", "--out=", "--dry-run"]])
def test_an_empty_flag_value_is_refused_not_read_as_absent(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    flag = next(a for a in argv if a.startswith("--")).rstrip("=")
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert f"argument {flag}: expected a value, got an empty string" in err, err


def test_tokenizer_files_are_read_bounded(tmp_path):
    """A FIFO given as the tokenizer, or standing in a tokenizer folder, is one line at once (in
    a child: the tokenizers library's own read of a FIFO would block where no signal reaches)."""
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    os.mkfifo(folder / "tokenizer_config.json")
    for path, needle in ((fifo(tmp_path, "tokenizer.json"), "tokenizer.json is not a regular file"),
                         (str(folder), "tokenizer_config.json is not a regular file")):
        script = ("import sys\nfrom tenfold.errors import UserError\nfrom tenfold.data.hf_tokenizer import load_tokenizer_path\n"
                  f"try:\n    load_tokenizer_path({path!r})\nexcept UserError as e:\n    sys.exit(str(e))\n")
        proc, _ = bounded_child(["-c", script])
        assert proc.returncode == 1 and needle in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- library noise


def test_a_hugging_face_run_prints_nothing_before_tenfolds_header(tmp_path):
    pytest.importorskip("transformers")
    cmd = [sys.executable, "-m", "tenfold", "train", "--hf-config", str(LLAMA_TINY), "--steps", "1",
           "--out", str(tmp_path / "run"), "--seq-len", "32", "--set", "data.max_bytes=300000", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "TENFOLD_VERBOSE"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.strip() == "", proc.stderr  # torchao's and torch's import-time lines kept back
    assert proc.stdout.splitlines()[0].startswith("tenfold train "), proc.stdout[:1000]


def test_library_noise_is_hidden_and_tenfolds_own_warnings_and_library_errors_are_not(monkeypatch, caplog):
    import logging
    import warnings

    from tenfold import quiet
    from tenfold.errors import TenfoldNote

    for name in quiet.NOISY_LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)  # restored afterwards
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.hush_libraries()
        logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")
        logging.getLogger("torch.utils._pytree").warning("<enum 'KernelPreference'> is an Enum subclass")
        warnings.warn("register_constant() on Enum subclasses is deprecated", FutureWarning)
        warnings.warn("torch.jit.script is deprecated", DeprecationWarning)
        warnings.warn("fp16 on a CPU is very slow", TenfoldNote)
        logging.getLogger("torchao").error("a library error")
    assert [str(w.message) for w in seen] == ["fp16 on a CPU is very slow"]
    assert [r.getMessage() for r in caplog.records] == ["a library error"]
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    assert quiet.verbose()
    monkeypatch.setenv(quiet.VERBOSE_ENV, "0")
    assert not quiet.verbose() and quiet.verbose(True)


# --------------------------------------------------------------------------- OpenMP's waits

@pytest.mark.parametrize("user_env", [{}, {"GOMP_SPINCOUNT": "50000"}, {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_the_command_line_lets_openmp_threads_sleep_sooner_unless_the_user_chose(user_env):
    """GOMP_SPINCOUNT must be in the environment before torch loads libgomp: the command line
    sets it before any subcommand imports torch, and leaves a user's OpenMP wait setting alone."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(user_env)
    probe = ("import os, sys\n"
             "from tenfold.cli import main\n"
             "assert 'torch' not in sys.modules, 'torch loaded before the OpenMP setting'\n"
             "main(['plan', '--model', 'tiny', '--gpu', 'a100-80gb', '--json'])\n"
             "print('GOMP_SPINCOUNT=' + os.environ.get('GOMP_SPINCOUNT', 'unset'), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = user_env.get("GOMP_SPINCOUNT", "unset" if user_env else "1000")
    assert out.stderr.strip().splitlines()[-1] == f"GOMP_SPINCOUNT={expected}"
