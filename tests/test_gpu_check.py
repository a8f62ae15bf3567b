"""benchmarks/gpu_check.py: its CPU-side logic (arguments, which checks run, the JSON it
writes) here; the GPU run itself only where CUDA is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import gpu_check  # noqa: E402

torch = pytest.importorskip("torch", reason="gpu_check imports torch")


def test_arguments_and_bad_values():
    args = gpu_check.parse_args([])
    assert (args.model, args.steps, args.budget_s, args.out) == ("gpt3-1.3b", 300, 480.0, "gpu_check.json")
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--steps", "0"])
    assert e.value.code == 2


def test_checks_follow_the_gpus():
    args = gpu_check.parse_args(["--steps", "50"])
    one = ["single", "offload", "offload_optimizer"]
    assert [c["name"] for c in gpu_check.plan_checks(args, 1, True)] == one
    assert [c["name"] for c in gpu_check.plan_checks(args, 1, True, fp8=True)] == [*one, "fp8"]
    assert [c["name"] for c in gpu_check.plan_checks(args, 2, False)] == [*one, "zero3", "zero3_bf16_reduce", "hf_pp"]
    checks = gpu_check.plan_checks(args, 8, True, fp8=True)
    assert [(c["name"], c["nproc"]) for c in checks] == [("single", 1), ("offload", 1), ("offload_optimizer", 1),
                                                         ("fp8", 1), ("zero3", 8),
                                                         ("zero3_bf16_reduce", 8), ("tp", 8), ("hf_pp", 2), ("hsdp", 8)]
    cmd = gpu_check.train_command(args, checks[4], "/tmp/x")
    assert cmd[1:4] == ["-m", "tenfold", "train"] and "--nproc" in cmd and cmd[-2:] == ["--zero", "3"]
    assert cmd[cmd.index("--precision") + 1] == "bf16" and cmd[cmd.index("--steps") + 1] == "100"


def test_every_check_is_a_run_tenfold_accepts(tmp_path):
    """Each check's command, through `tenfold train --dry-run`'s resolver (no GPU needed)."""
    from tenfold.cli import build_parser
    from tenfold.run import resolve_run
    from tenfold.run_args import config_from_args

    args = gpu_check.parse_args(["--seq-len", "256", "--micro-batch", "2"])
    for check in gpu_check.plan_checks(args, 8, True, fp8=True):
        argv = gpu_check.train_command(args, check, str(tmp_path / check["name"]))[3:]
        cfg = config_from_args(build_parser(argv).parse_args(argv))
        run = resolve_run(cfg, check["nproc"])
        assert run.world_size == check["nproc"], check["name"]
    assert (tmp_path / "hf_pp" / "hf_config.json").is_file()


def test_train_command_is_accepted_by_tenfold():
    """Every flag it passes exists in `tenfold train` (the CLI's own parser)."""
    from tenfold.cli import build_parser

    args = gpu_check.parse_args([])
    checks = {c["name"]: c for c in gpu_check.plan_checks(args, 2, False)}
    cmd = gpu_check.train_command(args, checks["zero3"], "/tmp/x")
    parsed = build_parser(cmd[3:]).parse_args(cmd[3:])
    assert parsed.zero == 3 and parsed.nproc == 2
    cmd = gpu_check.train_command(args, checks["offload_optimizer"], "/tmp/x")
    parsed = build_parser(cmd[3:]).parse_args(cmd[3:])
    assert (parsed.zero, parsed.offload) == (2, "optimizer")


def test_a_check_record_from_a_summary():
    summary = {"final": {"tokens_per_s": 1000.0, "mfu": 0.5},
               "memory": {"peak_mem_bytes": 100, "predicted": {"peak_bytes": 105}}}
    rec = gpu_check.check_result({"name": "single", "nproc": 1}, ["tenfold"], "ok", 12.3, summary)
    assert set(rec) == gpu_check.CHECK_KEYS
    assert rec["memory_error"] == pytest.approx(0.05) and rec["targets"] == {"mfu": True, "memory": True}
    failed = gpu_check.check_result({"name": "tp", "nproc": 2}, ["tenfold"], "timeout", 480.0, None)
    assert failed["mfu"] is None and failed["targets"] == {"mfu": None, "memory": None}


def test_without_cuda_it_writes_why_nothing_ran(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    report = gpu_check.main(["--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["checks"] == [] and "no CUDA" in report["skipped"]
    gpu_check.validate_report(report)
    with pytest.raises(ValueError, match="schema"):
        gpu_check.validate_report({**report, "schema": "other"})
    with pytest.raises(ValueError, match="lacks"):
        gpu_check.validate_report({**report, "checks": [{"name": "single"}]})


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the check trains a ~1B model in bf16")
def test_gpu_check_on_this_gpu(tmp_path):
    report = gpu_check.main(["--out", str(tmp_path / "gpu.json"), "--steps", "30", "--multi-steps", "10"])
    assert all(c["status"] == "ok" for c in report["checks"]), report
