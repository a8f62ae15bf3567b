"""Context parallelism (techniques/context_parallel.py): the load-balanced layout and the
attention across cp ranks against plain causal attention (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from conftest import torchrun
from tenfold.errors import UserError
from tenfold.techniques.context_parallel import local_positions, local_batch, shard_sequence, unshard_sequence


def test_head_tail_layout():
    # 2 x cp chunks of 2; rank r holds chunk r and chunk 2cp-1-r
    assert local_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert local_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert local_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]


@pytest.mark.parametrize("cp", [2, 4])
def test_layout_balances_causal_work(cp):
    """Every rank's queries see the same number of (query, key) pairs under a causal mask."""
    s = 8 * cp
    work = [int((local_positions(s, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work


def test_shard_unshard_round_trip():
    x = torch.arange(2 * 24).view(2, 24)
    for cp in (1, 2, 3):
        parts = [shard_sequence(x, cp, r) for r in range(cp)]
        assert torch.equal(unshard_sequence(parts), x)
        assert sorted(torch.cat([local_positions(24, cp, r) for r in range(cp)]).tolist()) == list(range(24))


def test_local_batch_cuts_tokens_labels_and_positions():
    batch = {"input_ids": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8) + 100}
    out = local_batch(batch, 2, 1)
    assert out["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert out["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert out["positions"].tolist() == [2, 3, 4, 5]
    assert out["position_ids"].tolist() == [[2, 3, 4, 5]] * 2


def test_sequence_must_split_into_two_cp_chunks():
    with pytest.raises(UserError, match="multiple of 4"):
        local_positions(10, 2, 0)


@pytest.mark.multiprocess
def test_context_attention_equals_causal_attention(tmp_path):
    """2 cp ranks: gathered outputs and q/k/v gradients equal one process's causal SDPA."""
    diffs = torchrun("attention", tmp_path, nproc=2, worker="cp_worker.py")
    scale = diffs.pop("scale")
    assert scale > 0.1
    for name, d in diffs.items():
        assert d < 1e-6, (name, d)
