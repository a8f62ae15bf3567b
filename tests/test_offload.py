"""ZeRO-Offload (`parallel.offload` / `--offload`) through FSDP2's CPUOffloadPolicy
(techniques/offload.py): on 2 gloo ranks and on one process, against no offload.

On this CPU-only machine the device is the host, so the copies FSDP2 adds are no-ops, but
the run takes the offload code path: the policy is applied to every FSDP2 parameter (read
back from FSDP2's own state), the optimizer is built for host parameters, and on one
process FSDP2 runs on a mesh of one rank. Tolerance rel 1e-6 (measured: equal bit for bit).

Host memory: what the ranks hold at the optimizer step, in host memory under offload: the
fp32 parameter shard, its fp32 gradient and AdamW's two fp32 moments, 16 bytes per
parameter / dp (FSDP2 pads dim 0 to a multiple of dp: within 1%). Offload with hybrid
sharding: tests/test_hsdp.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "workers"))
from conftest import BF16_RTOL, rel_err, torchrun  # noqa: E402
from workers import scale_worker as worker  # noqa: E402
from workers.zero_worker import config, run_steps  # noqa: E402

from tenfold.config import build_config  # noqa: E402
from tenfold.errors import UserError  # noqa: E402
from tenfold.run import resolve_run  # noqa: E402

RTOL = 1e-6
RUNS = ("2-optimizer", "3-optimizer", "3-optimizer+params")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    return {"runs": torchrun("offload", tmp, nproc=2, timeout=600, worker="scale_worker.py"), "tmp": tmp}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process offload runs in a process of their own: they join a process group of one."""
    tmp = tmp_path_factory.mktemp("offload1")
    out = tmp / "offload1.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(HERE / "workers" / "scale_worker.py"), "offload1", str(out)],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())["0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("offload-ref"))
    torch.set_num_threads(1)
    return {"losses": run_steps(worker.fixed_batch(config(3, "fp32", 1, 2, out)), measure_at=None)[1]["losses"],
            "grads": worker.first_step_grads(worker.fixed_batch(config(3, "fp32", 1, 2, out)))}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("run", RUNS)
def test_offload_on_two_ranks_equals_no_offload(two_ranks, reference, run):
    stage = run.split("-")[0]
    for rank in ("0", "1"):
        r = two_ranks["runs"][rank]
        got, plain = r[run], r[f"{stage}-none"]
        assert rel_err(got["losses"], plain["losses"]) < RTOL and rel_err(got["grad_norms"], plain["grad_norms"]) < RTOL
        assert rel_err(got["losses"], reference["losses"]) < RTOL


@pytest.mark.slow
@pytest.mark.multiprocess
def test_offload_bf16_equals_no_offload(two_ranks):
    for rank in ("0", "1"):
        r = two_ranks["runs"][rank]
        assert rel_err(r["3-bf16-optimizer"]["losses"], r["3-bf16-none"]["losses"]) < BF16_RTOL


@pytest.mark.slow
@pytest.mark.multiprocess
def test_offloaded_gradients_equal_one_process(two_ranks, reference):
    got = torch.load(two_ranks["tmp"] / "grads-offload.pt")
    for name, g in reference["grads"].items():
        assert (got[name] - g).abs().max() <= RTOL * g.abs().max(), name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_offload_policy_is_applied(two_ranks):
    """FSDP2's own per-parameter state says offload_to_cpu for every parameter under an
    offload, for none without; the optimizer states sit with the (host) parameters.
    Mutation: offload_policy returning OffloadPolicy() -> `offloaded` is False."""
    for rank in ("0", "1"):
        r = two_ranks["runs"][rank]
        for run in RUNS:
            assert r[f"{run}-layout"]["offloaded"], run
            assert r[f"{run}-layout"]["optimizer_devices"] == ["cpu"]
        for stage in (2, 3):
            assert not r[f"{stage}-none-layout"]["offloaded"]


def _n_params() -> int:
    from tenfold.models.gpt import GPT

    cfg = build_config(config(3, "fp32", 1, 2, "."))
    return sum(p.numel() for p in GPT(cfg.model.build()).parameters())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_host_memory_per_rank_is_16_bytes_per_parameter_over_dp(two_ranks):
    """Measured at the optimizer step (tenfold.techniques.zero.model_state_bytes, local
    shards): fp32 params + fp32 grads + 2 fp32 moments = 16 B x params / 2 ranks. The
    planner prices `optimizer+params` the same (plan.memory: cpu_bytes)."""
    from tenfold.plan.for_run import predict_run

    n = _n_params()
    for rank in ("0", "1"):
        for run in RUNS:
            b = two_ranks["runs"][rank][run]["state_bytes"]
            host = b["params_bytes"] + b["grads_bytes"] + b["optimizer_bytes"]
            assert host == pytest.approx(16 * n / 2, rel=0.01), (run, b)
    cfg = build_config(worker.fixed_batch(config(3, "fp32", 1, 2, "."), offload="optimizer+params"))
    planned = predict_run(resolve_run(cfg, 2), "a100-80gb").memory.cpu_bytes
    assert host == pytest.approx(planned, rel=0.01)


@pytest.mark.slow
def test_offload_on_one_process_equals_no_offload(one_process, reference):
    """ZeRO-Offload's single-device case: FSDP2 on a mesh of one rank, the policy applied."""
    for run in ("2-optimizer", "3-optimizer+params"):
        assert rel_err(one_process[run]["losses"], reference["losses"]) < RTOL
        layout = one_process[f"{run}-layout"]
        assert layout["offloaded"] and layout["mesh"] == [0] and layout["local_share"] == 1.0


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("parallel, needle", [
    ({"zero_stage": 1, "offload": "optimizer"}, "parallel.offload 'optimizer' (--offload) runs through FSDP2's "
                                                "CPUOffloadPolicy: needs --zero 2 or 3, got 1"),
    ({"zero_stage": 0, "offload": "optimizer+params"}, "needs --zero 2 or 3, got 0"),
    ({"zero_stage": 2, "offload": "optimizer+params"}, "needs --zero 3 (only stage 3 partitions parameters)"),
])
def test_offload_needs_fsdp2_stages_in_train_and_plan_alike(parallel, needle):
    from tenfold import capabilities

    cfg = build_config({"parallel": parallel})
    with pytest.raises(UserError) as e:
        resolve_run(cfg, 2)
    assert needle in str(e.value)
    assert capabilities.problems(resolve_run(cfg, 2, check=False)) == [str(e.value)]


def test_offload_values_that_run():
    for stage, offload in ((2, "optimizer"), (3, "optimizer"), (3, "optimizer+params"), (0, "none")):
        for world in (1, 2):
            run = resolve_run(build_config({"parallel": {"zero_stage": stage, "offload": offload}}), world)
            assert run.offload == run.layout()["offload"] == offload


def test_the_policy_for_each_value():
    from torch.distributed.fsdp import CPUOffloadPolicy

    from tenfold.config import ParallelSection
    from tenfold.techniques.offload import offload_policy, optimizer_device

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not isinstance(offload_policy(ParallelSection(), cpu), CPUOffloadPolicy)
    for value in ("optimizer", "optimizer+params"):
        section = ParallelSection(zero_stage=3, offload=value)
        assert isinstance(offload_policy(section, cpu), CPUOffloadPolicy)
        assert offload_policy(section, cpu).pin_memory is False  # pinning needs a CUDA device
        assert offload_policy(section, cuda).pin_memory is True
        assert optimizer_device(section, cuda) == cpu
    assert optimizer_device(ParallelSection(), cuda) == cuda


def test_cuda_ranks_reduce_host_tensors_over_gloo_when_offloading():
    from tenfold.engine.distributed import backend_for

    assert backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for(torch.device("cuda", 0), True) == "cuda:nccl,cpu:gloo"
    assert backend_for(torch.device("cpu"), True) == "gloo"
