"""Expert parallelism (techniques/expert_parallel.py) on gloo: two ranks with the experts split
over ep 2 against one process holding every expert, under ZeRO-0 (DDP) and ZeRO-3 (FSDP2).

The ranks run tests/workers/moe_worker.py under torchrun (the Trainer, micro 2 x accum 1 x dp 2);
the reference runs here with the same global batch in the same micro-batches (micro 2 x accum 2:
rank r's rows are the one process's micro-batch r, tenfold.data.loader's order rule), so each
micro-batch's router balance loss is computed over the same tokens. fp32: only the order of the
floating-point sums differs (the all-to-all regroups rows; the dp average)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from conftest import rel_err, torchrun  # noqa: E402
from workers import moe_worker as worker  # noqa: E402

RTOL = 1e-6


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return torchrun("equivalence", tmp_path_factory.mktemp("ep2"), worker="moe_worker.py", timeout=400)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    return worker.run_steps(worker.config(0, 2, 2, str(tmp_path_factory.mktemp("ref"))))


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", ["0", "3"])
def test_ep2_matches_one_process_losses_and_first_step_gradients(two_ranks, reference, stage):
    for rank in ("0", "1"):
        got = two_ranks[rank][stage]
        assert rel_err(got["losses"], reference["losses"]) < RTOL, (got["losses"], reference["losses"])
        assert rel_err(got["grad_norms"], reference["grad_norms"]) < 10 * RTOL
        assert got["grads"].keys() == reference["grads"].keys()
        for name, ref in reference["grads"].items():
            scale = max(abs(v) for v in ref)
            worst = max(abs(a - b) for a, b in zip(got["grads"][name], ref))
            assert worst <= RTOL * scale + 1e-9, (name, worst, scale)
        assert got["loads"] == reference["loads"]  # every rank logs the global assignments
    assert reference["losses"][-1] < reference["losses"][0] - 0.3  # it learns
