"""Checkpoints across ranks (2 gloo processes): exact resume with DDP (ZeRO-0), DDP +
ZeroRedundancyOptimizer (ZeRO-1) and FSDP2 `fully_shard` (ZeRO-3), and resharding through DCP: a 2-rank ZeRO-3 checkpoint resumed on one
process and a one-process checkpoint resumed on 2 ranks ZeRO-3 (rel. 1e-4 of the uninterrupted
curve: only the reduction order differs).

One spawn of two ranks runs every multi-rank scenario (process start-up dominates on CPU);
the tests below each check one part of what it recorded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

import plain_loop as t
from tenfold.engine.parallel.distributed import shutdown

WORLD = 2


def _rel_close(a: list[dict], b: list[dict], rel: float) -> bool:
    return [x["step"] for x in a] == [y["step"] for y in b] and all(
        abs(x["loss"] - y["loss"]) <= rel * abs(y["loss"]) for x, y in zip(a, b)
    )


def _exact_resume(out: Path, zero: int, async_save: bool = False) -> dict:
    reference = t.train(t.make_run(torch_dist.get_rank(), WORLD, zero), t.STEPS)
    # async: step 2's save is written in the background while steps 3-4 run; resume from it
    until, every, resume = (4, 2, str(out / "checkpoints" / "step_2")) if async_save else (3, 3, "auto")
    first = t.make_run(torch_dist.get_rank(), WORLD, zero)
    saver = t.manager(out, first, every=every, async_save=async_save)
    t.train(first, until, saver)
    if async_save:
        assert [s.step for s in saver.saves] == [2, 4]
    resumed = t.make_run(torch_dist.get_rank(), WORLD, zero)
    start = t.manager(out, resumed, resume=resume).resume()["step"]
    return {"reference": reference[start:], "resumed": t.train(resumed, t.STEPS)}


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch_dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    root = Path(tmp)
    results: dict = {}
    try:
        results["zero0"] = _exact_resume(root / "zero0", zero=0)
        results["zero1"] = _exact_resume(root / "zero1", zero=1)
        results["zero3"] = _exact_resume(root / "zero3", zero=3)
        results["zero3_async"] = _exact_resume(root / "zero3_async", zero=3, async_save=True)
        # 2 ranks ZeRO-3 -> checkpoint at step 3 (resumed on one process by the parent), and
        # the 2-rank uninterrupted curve without RNG noise (the parent compares against it).
        results["zero3_reference"] = t.train(t.make_run(rank, WORLD, 3, noise=False), t.STEPS)
        two = t.make_run(rank, WORLD, 3, noise=False)
        t.train(two, 3, t.manager(root / "from2", two))
        # one-process checkpoint (written by the parent) -> 2 ranks ZeRO-3
        up = t.make_run(rank, WORLD, 3, noise=False)
        messages: list[str] = []
        t.manager(root / "from1", up, resume="auto", messages=messages).resume()
        results["from1"] = t.train(up, t.STEPS)
        results["from1_messages"] = messages
        results["files_zero3"] = sorted(json.loads(
            (root / "zero3" / "checkpoints" / "step_3" / "manifest.json").read_text())["files"])
    finally:
        shutdown()  # barrier, then destroy: an early destroy can abort the peer (gloo)
    if rank == 0:
        (root / "results.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_dist")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = t.make_run(noise=False)
        reference_1 = t.train(one, t.STEPS)
        one_saved = t.make_run(noise=False)
        t.train(one_saved, 3, t.manager(tmp / "from1", one_saved))
    finally:
        torch.set_num_threads(before)
    mp.start_processes(_worker, args=(str(tmp),), nprocs=WORLD, start_method="spawn", join=True)
    results = json.loads((tmp / "results.json").read_text())
    results["reference_1"] = reference_1
    results["tmp"] = tmp
    return results


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["zero0", "zero1", "zero3", "zero3_async"])
def test_two_ranks_resume_exactly(two_rank_results, zero):
    r = two_rank_results[zero]
    assert [x["step"] for x in r["resumed"]] == ([3, 4, 5, 6] if zero.endswith("async") else [4, 5, 6])
    assert r["resumed"] == r["reference"]  # loss, lr, loss scale bit for bit


@pytest.mark.slow
def test_zero3_checkpoint_has_one_shard_file_per_rank(two_rank_results):
    files = two_rank_results["files_zero3"]
    assert {"__0_0.distcp", "__1_0.distcp", "rank_00000.json", "rank_00001.json"} <= set(files)


@pytest.mark.slow
def test_two_rank_zero3_checkpoint_resumes_on_one_process(two_rank_results, one_thread):
    messages: list[str] = []
    run = t.make_run(noise=False)
    t.manager(two_rank_results["tmp"] / "from2", run, resume="auto", messages=messages).resume()
    assert any("resharding 2 -> 1" in m for m in messages)
    got = t.train(run, t.STEPS)
    assert _rel_close(got, two_rank_results["zero3_reference"][3:], 1e-4)


@pytest.mark.slow
def test_one_process_checkpoint_resumes_on_two_ranks_zero3(two_rank_results):
    assert any("resharding 1 -> 2" in m for m in two_rank_results["from1_messages"])
    assert _rel_close(two_rank_results["from1"], two_rank_results["reference_1"][3:], 1e-4)




@pytest.mark.slow
def test_export_consolidates_two_rank_zero3_checkpoint(two_rank_results):
    """`tenfold export` on one process: the shards of both ranks -> one file, equal to the
    weights the 2-rank run held at step 3 (as resumed on one process)."""
    from safetensors.torch import load_file

    from tenfold.engine.outputs import export

    src = two_rank_results["tmp"] / "from2"
    out = src / "zero3.safetensors"
    export.export_checkpoint(src, out, "fp32")
    run = t.make_run(noise=False)
    t.manager(src, run, resume="auto").resume()
    weights = load_file(str(out))
    state = run.model.state_dict()
    assert set(weights) == set(state)
    assert all(torch.equal(weights[k], state[k]) for k in state)
