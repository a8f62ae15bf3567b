"""`tenfold train --nproc N` (engine/parallel/launch.py) and the failure handling of
engine/parallel/distributed.py: the real CLI under torchrun's agent on gloo.

* a DeepSpeed JSON (tests/data/ds_seed.json: ZeRO-3 + fp16 + clipping) runs unchanged on 2
  ranks and gives the one-process loss curve (fp16: rel 5e-3, the loss is computed from fp16 matmuls whose
  rounding differs when each rank sees half the batch);
* an inconsistent batch triplet exits 2 with DeepSpeed's message, before any rank starts; a
  user error found inside the ranks exits 2 too, each rank's line prefixed with its rank;
* a rank killed mid-run makes the job exit non-zero within a bound, naming the rank;
* after `tighten_timeouts`, a rank that hangs makes the others raise within the bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from conftest import RUN_FLAGS, TENFOLD, child_pids, rank_of, read_metrics, tenfold_child  # noqa: E402

DS_SEED = HERE / "data" / "ds_seed.json"


def tenfold(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    return tenfold_child("train", *args, timeout=timeout, env={"PYTHONUNBUFFERED": "1"})


@pytest.mark.multiprocess
@pytest.mark.slow
def test_seed_deepspeed_json_on_two_ranks_matches_one_process(tmp_path):
    common = ["--deepspeed", str(DS_SEED), "--steps", "3", "--grad-accum", "2", *RUN_FLAGS]
    one = tenfold([*common, "--micro-batch", "2", "--out", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-4000:]
    two = tenfold([*common, "--nproc", "2", "--micro-batch", "1", "--out", str(tmp_path / "two")])
    assert two.returncode == 0, two.stderr[-6000:]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["config"]["parallel"]["zero_stage"] == 3
    assert summary["config"]["parallel"]["nproc"] == 2
    assert summary["config"]["precision"]["dtype"] == "fp16"
    assert summary["hardware"]["world_size"] == 2
    assert summary["batch"]["global_batch"] == 4  # 1 x 2 x dp 2, DeepSpeed's rule
    a = [m["loss"] for m in read_metrics(tmp_path / "one")]
    b = [m["loss"] for m in read_metrics(tmp_path / "two")]
    assert len(a) == len(b) == 3
    assert max(abs(x - y) / x for x, y in zip(a, b)) < 5e-3, (a, b)
    # only rank 0 writes the shared files and prints the summary
    assert two.stdout.count("tenfold train: summary") == 1
    # memory.measured_per_rank: one entry per rank with memory.measured's keys; at ZeRO-3 each
    # rank holds half of the one-process parameters, gradients and optimizer states
    one_measured = json.loads((tmp_path / "one" / "summary.json").read_text())["memory"]["measured"]
    per_rank = summary["memory"]["measured_per_rank"]
    assert len(per_rank) == 2
    for m in per_rank:
        assert set(m) == set(one_measured)
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert m[key] == pytest.approx(one_measured[key] / 2, rel=0.02), key


@pytest.mark.multiprocess
@pytest.mark.slow
def test_inconsistent_batch_triplet_exits_2(tmp_path):
    r = tenfold(["--nproc", "2", "--global-batch", "5", "--micro-batch", "1", "--grad-accum", "2",
                 "--steps", "1", *RUN_FLAGS, "--out", str(tmp_path / "bad")], timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count("5 must equal --micro-batch x --grad-accum x data-parallel size = 1 x 2 x 2") == 1  # checked once, before any rank starts
    assert not (tmp_path / "bad").exists()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_refusal_on_every_rank_is_one_line(tmp_path):
    """Both ranks refuse the missing data file: the launcher prints the refusal once, as one
    process does, without torchelastic's `E... failed (exitcode: 2)` records."""
    missing = tmp_path / "missing.txt"
    r = tenfold(["--nproc", "2", "--data", str(missing), "--steps", "1", "--out", str(tmp_path / "bad")], timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [f"tenfold: error: data.path: file or directory not found: {missing}"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the rank processes through /proc (Linux)")
def test_killed_rank_stops_the_job_with_a_message(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        TENFOLD + ["--nproc", "2", "--zero", "2", "--steps", "100000", "--micro-batch", "1",
                   *RUN_FLAGS, "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.time() + 180
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, "no step within 180 s"
            time.sleep(0.5)
        victim = next(p for p in child_pids(proc.pid) if rank_of(p) == 1)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        _, stderr = proc.communicate(timeout=60)
        took = time.time() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, None)
    assert took < 60
    assert "rank 1 failed first: killed by SIGKILL" in stderr, stderr[-3000:]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tightened_timeout_bounds_a_hung_rank(tmp_path):
    out = tmp_path / "timeout.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "workers" / "zero_worker.py"), "timeout", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0 = json.loads(out.read_text())["0"]
    assert rank0["outcome"] != "no error"
    assert rank0["elapsed_s"] < 10, rank0  # the 3 s bound, not the 600 s default (the peer sleeps 12 s)


# --------------------------------------------------------------------------- units


def test_rank_argv_replaces_nproc_which_torchrun_rejects():
    from tenfold.engine.parallel.launch import rank_argv, torchrun_argv

    assert rank_argv(["train", "--nproc", "2", "--zero", "3"], 2) == ["train", "--zero", "3", "--set", "parallel.nproc=2"]
    assert rank_argv(["train", "--nproc=4"], 4) == ["train", "--set", "parallel.nproc=4"]
    argv = torchrun_argv(["train", "--nproc", "2"], 2)
    assert argv[:7] == ["--standalone", "--nproc-per-node", "2", "--signals-to-handle", "SIGHUP,SIGQUIT", "-m", "tenfold"]
    from torch.distributed.run import parse_args

    args = parse_args(argv)  # torchrun's own parser accepts it
    assert args.nproc_per_node == "2" and args.training_script == "tenfold"


class _Failure:
    def __init__(self, exitcode, message="", sig=None, timestamp=1_700_000_000):
        self.exitcode, self.message, self._sig, self.timestamp = exitcode, message, sig, timestamp

    def signal_name(self):
        return self._sig


class _ChildFailed:
    def __init__(self, failures, first):
        self.failures, self._first = failures, first

    def get_first_failure(self):
        return self._first, self.failures[self._first]


def test_report_failure_names_ranks_and_keeps_user_error_status():
    import io

    from tenfold.engine.parallel.launch import report_failure

    buf = io.StringIO()
    err = _ChildFailed({0: _Failure(-15, sig="SIGTERM"), 1: _Failure(-9, sig="SIGKILL")}, first=1)
    assert report_failure(err, buf) == 1
    assert buf.getvalue().splitlines()[0] == "tenfold: rank 1 failed first: killed by SIGKILL"
    buf = io.StringIO()
    err = _ChildFailed({0: _Failure(2, {"message": "UserError: bad batch", "extraInfo": {}})}, first=0)
    assert report_failure(err, buf) == 2
    assert "exit status 2: UserError: bad batch" in buf.getvalue()


def test_the_same_line_from_every_rank_is_printed_once_and_different_ones_per_rank():
    import io

    from tenfold.engine.parallel.launch import report_failure

    same = "tenfold: error: data.path: file or directory not found: x.txt"
    buf = io.StringIO()
    err = _ChildFailed({0: _Failure(2, same), 1: _Failure(2, same), 2: _Failure(-15, sig="SIGTERM")}, first=0)
    assert report_failure(err, buf) == 2 and buf.getvalue() == same + "\n"
    buf = io.StringIO()
    err = _ChildFailed({0: _Failure(1, "tenfold: run stopped: non-finite loss at step 3"),
                        1: _Failure(1, "tenfold: error: Read-only file system: /ckpt", timestamp=1_600_000_000)}, first=1)
    assert report_failure(err, buf) == 1
    assert buf.getvalue().splitlines() == ["tenfold: rank 1 failed first: exit status 1: error: Read-only file system: /ckpt",
                                           "tenfold: rank 0: exit status 1: run stopped: non-finite loss at step 3"]


def test_a_rank_the_launcher_started_hands_its_line_over_instead_of_printing_it(tmp_path, monkeypatch, capsys):
    from tenfold.cli import main
    from tenfold.engine.parallel.launch import LAUNCHED_ENV

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv(LAUNCHED_ENV, "1")
    assert main(["train", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == ""
    record = json.loads(error_file.read_text())["message"]
    assert record["message"] == f"tenfold: error: data.path: file or directory not found: {tmp_path / 'missing.txt'}"
    monkeypatch.delenv(LAUNCHED_ENV)  # under a plain torchrun: every rank says it itself
    assert main(["train", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("tenfold: error: data.path")


def test_stderr_lines_are_prefixed_with_the_rank():
    import io

    from tenfold.engine.parallel.distributed import _RankPrefixed

    buf = io.StringIO()
    s = _RankPrefixed(buf, "[rank 1] ", already="[rank1]:")
    s.write("one\ntw")
    s.write("o\n[rank1]: torch's own line\n")
    assert buf.getvalue() == "[rank 1] one\n[rank 1] two\n[rank1]: torch's own line\n"


def test_tightened_timeout_is_bounded():
    from tenfold.engine.parallel.distributed import tightened_timeout_s

    assert tightened_timeout_s(1.0, 600.0) == 120.0  # the floor
    assert tightened_timeout_s(10.0, 600.0) == 200.0  # 20 x the first step
    assert tightened_timeout_s(100.0, 600.0) == 600.0  # never above parallel.timeout_s


def test_preflight_checks_the_triplet_with_the_launch_size():
    from tenfold.config import build_config
    from tenfold.engine.parallel.launch import preflight
    from tenfold.errors import UserError

    cfg = build_config({"train": {"global_batch": 5, "micro_batch": 1, "grad_accum": 2}})
    with pytest.raises(UserError, match="5 must equal --micro-batch x --grad-accum x data-parallel size = 1 x 2 x 2"):
        preflight(cfg, 2)
    preflight(build_config({"train": {"global_batch": 4, "micro_batch": 1, "grad_accum": 2}}), 2)
