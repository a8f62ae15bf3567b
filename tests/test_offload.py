"""ZeRO-Offload (`parallel.offload` / `--offload`, techniques/offload.py) on 2 gloo ranks and on
one process, against no offload: `optimizer` (HostAdamW: the parameter shards and gradients on
the device, AdamW's states and update in host memory) and `optimizer+params` (FSDP2's
CPUOffloadPolicy: every model state on the host).

On this CPU-only machine the device is the host, so the copies are no-ops, but each run
takes its offload's code path: the policy is applied (read back from FSDP2's own state) for
`optimizer+params` only, `optimizer` trains through HostAdamW (its states and host buffers
counted), and on one process FSDP2 runs on a mesh of one rank. Tolerance rel 1e-6 (measured:
equal bit for bit).

Host memory per rank at the optimizer step, 16 bytes per parameter / dp either way (FSDP2
pads dim 0 to a multiple of dp: within 1%): `optimizer+params` the fp32 parameter shard, its
fp32 gradient and AdamW's two fp32 moments; `optimizer` the two moments and HostAdamW's
parameter and gradient buffers, while the device keeps the 4 + 4 bytes of parameter and
gradient shards. Offload with hybrid sharding: tests/test_hsdp.py.
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
    """`optimizer+params`: FSDP2's own per-parameter state says offload_to_cpu for every
    parameter; `optimizer`: it does not (the shards stay on the device) and the optimizer is
    HostAdamW with its states in host memory; without offload neither.
    Mutations: offload_policy giving `optimizer` the CPUOffloadPolicy, or OffloadPolicy() to
    `optimizer+params` -> `offloaded` wrong; `optimizer` built as a plain AdamW -> the class."""
    for rank in ("0", "1"):
        r = two_ranks["runs"][rank]
        for run in RUNS:
            layout = r[f"{run}-layout"]
            assert layout["offloaded"] == run.endswith("optimizer+params"), run
            assert layout["optimizer_class"] == ("HostAdamW" if run.endswith("-optimizer") else "AdamW"), run
            assert layout["optimizer_devices"] == ["cpu"]
        for stage in (2, 3):
            assert not r[f"{stage}-none-layout"]["offloaded"]
            assert r[f"{stage}-none-layout"]["optimizer_class"] == "AdamW"


def _n_params() -> int:
    from tenfold.models.gpt import GPT

    cfg = build_config(config(3, "fp32", 1, 2, "."))
    return sum(p.numel() for p in GPT(cfg.model.build()).parameters())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_host_memory_per_rank_is_16_bytes_per_parameter_over_dp(two_ranks):
    """Measured at the optimizer step: `optimizer+params` holds fp32 params + fp32 grads + 2
    fp32 moments on the host (tenfold.techniques.zero.model_state_bytes of its host shards);
    `optimizer` holds the 2 moments and HostAdamW's parameter and gradient buffers on the host
    (HostAdamW.host_bytes) and keeps the 4 + 4 bytes of parameter and gradient shards on the
    device: 16 B x params / 2 ranks on the host either way. The planner prices both so
    (plan.memory: cpu_bytes, and `optimizer`'s device parameters and gradients).
    Mutation: HostAdamW without its gradient buffers (the update on the device's gradients)
    -> 12 B; the planner pricing `optimizer` as `optimizer+params` -> device states 0."""
    from tenfold.plan.for_run import predict_run

    n = _n_params()
    for rank in ("0", "1"):
        runs = two_ranks["runs"][rank]
        for run in RUNS:
            b = runs[run]["state_bytes"]
            if run.endswith("-optimizer"):
                assert runs[f"{run}-layout"]["host_bytes"] == pytest.approx(16 * n / 2, rel=0.01), run
                assert b["params_bytes"] + b["grads_bytes"] == pytest.approx(8 * n / 2, rel=0.01), (run, b)
            else:
                assert b["params_bytes"] + b["grads_bytes"] + b["optimizer_bytes"] == pytest.approx(16 * n / 2, rel=0.01)
    for offload in ("optimizer", "optimizer+params"):
        cfg = build_config(worker.fixed_batch(config(3, "fp32", 1, 2, "."), offload=offload))
        planned = predict_run(resolve_run(cfg, 2), "a100-80gb").memory
        assert planned.cpu_bytes == pytest.approx(16 * n / 2, rel=0.01), offload
        device = planned.params_bytes + planned.grads_bytes + planned.optimizer_bytes
        assert device == (pytest.approx(8 * n / 2, rel=0.01) if offload == "optimizer" else 0), offload


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_offloaded_optimizer_resumes_exactly(two_ranks):
    """ZeRO-2 with `--offload optimizer` on 2 ranks, stopped at step 2 and resumed through
    torch.distributed.checkpoint: steps 3-4 equal the uninterrupted run bit for bit, with the
    offload and resumed without it (HostAdamW's states are DTensors like any FSDP2
    optimizer's). Mutation: HostAdamW's states not keyed by the model's own parameters (its
    `state` left empty) -> the checkpoint holds no moments and the run fails."""
    r = two_ranks["runs"]["0"]
    full = r["offload-full"]
    assert len(full) == 4 and r["offload-resumed"][2:] == full[2:]
    assert rel_err(r["offload-resumed-plain"][2:], full[2:]) < RTOL


@pytest.mark.slow
def test_offload_on_one_process_equals_no_offload(one_process, reference):
    """ZeRO-Offload's single-device case: FSDP2 on a mesh of one rank, each offload's path."""
    for run in ("2-optimizer", "3-optimizer+params"):
        assert rel_err(one_process[run]["losses"], reference["losses"]) < RTOL
        layout = one_process[f"{run}-layout"]
        assert layout["mesh"] == [0] and layout["local_share"] == 1.0
        assert layout["offloaded"] == (run == "3-optimizer+params")
        assert layout["optimizer_class"] == ("HostAdamW" if run == "2-optimizer" else "AdamW")


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("parallel, needle", [
    ({"zero_stage": 1, "offload": "optimizer"}, "parallel.offload 'optimizer' (--offload) offloads FSDP2's "
                                                "sharded states: needs --zero 2 or 3, got 1"),
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
    """`optimizer+params` runs FSDP2's CPUOffloadPolicy and steps on host parameters;
    `optimizer` keeps FSDP2's parameters on the device (no offload policy)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from tenfold.config import ParallelSection
    from tenfold.techniques.offload import offload_policy, offloads_optimizer_only, optimizer_device

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not isinstance(offload_policy(ParallelSection(), cpu), CPUOffloadPolicy)
    section = ParallelSection(zero_stage=3, offload="optimizer+params")
    assert isinstance(offload_policy(section, cpu), CPUOffloadPolicy)
    assert offload_policy(section, cpu).pin_memory is False  # pinning needs a CUDA device
    assert offload_policy(section, cuda).pin_memory is True
    assert optimizer_device(section, cuda) == cpu and not offloads_optimizer_only(section)
    section = ParallelSection(zero_stage=2, offload="optimizer")
    assert not isinstance(offload_policy(section, cuda), CPUOffloadPolicy)
    assert optimizer_device(section, cuda) == cuda and offloads_optimizer_only(section)
    assert optimizer_device(ParallelSection(), cuda) == cuda


def test_host_adamw_is_adamw_with_its_states_on_the_host():
    """HostAdamW on plain parameters, one process: the same parameters as torch's AdamW after
    3 steps (bit for bit), its states host tensors keyed by the model's own parameters, its
    learning rate read from its own groups at every step (a schedule's change applies), and a
    state_dict that loads back into a fresh one.
    Mutations: the updated shard not copied back; the group's lr not passed to the inner
    optimizer -> the parameters differ from AdamW's."""
    from tenfold.techniques.offload import HostAdamW

    torch.manual_seed(0)
    a = torch.nn.Linear(8, 4)
    b = torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    plain = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=True)
    host = HostAdamW(b.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for model, opt in ((a, plain), (b, host)):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
            for g in opt.param_groups:
                g["lr"] = 1e-2 / (step + 2)  # what an LR schedule does between steps
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert set(host.state) == set(b.parameters()) and all(s["exp_avg"].device.type == "cpu" for s in host.state.values())
    again = HostAdamW(b.parameters(), lr=1e-2)
    again.load_state_dict(host.state_dict())
    for p in b.parameters():
        assert torch.equal(again.state[p]["exp_avg_sq"], host.state[p]["exp_avg_sq"])
        assert again.inner.state[again._twins[p]] is again.state[p]  # the inner update sees the loaded moments
    assert host.host_bytes() == 16 * sum(p.numel() for p in b.parameters())  # 2 moments + 2 buffers, fp32


def test_cuda_ranks_reduce_host_tensors_over_gloo_when_offloading():
    from tenfold.engine.parallel.distributed import backend_for

    assert backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for(torch.device("cuda", 0), True) == "cuda:nccl,cpu:gloo"
    assert backend_for(torch.device("cpu"), True) == "gloo"
