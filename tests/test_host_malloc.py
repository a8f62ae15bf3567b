"""glibc malloc kept from returning freed memory to the kernel (engine/memory/host_malloc.py): a
buffer freed and allocated again is not faulted in again. Each case runs in a fresh process
(the setting is process-wide and lasts until exit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, resource, sys
import torch
from tenfold.engine.memory import host_malloc
applied = host_malloc.tune_malloc()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
per_round = []
for _ in range(6):  # 24 buffers of 4 MiB live together, then freed: a training step's activations
    before = faults()
    buffers = [torch.ones(1 << 20) for _ in range(24)]
    del buffers
    per_round.append(faults() - before)
print(json.dumps({"applied": applied, "faults": per_round}))
"""

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"),
    reason="the allocator setting applies to glibc only",
)


def _probe(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TENFOLD_MALLOC"}
    if env_value is not None:
        env["TENFOLD_MALLOC"] = env_value
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@glibc_only
def test_freed_buffers_are_reused_without_page_faults():
    """96 MiB (24,576 pages) are faulted in on the first round; from the fourth on, the freed
    buffers are reused in place. (glibc's defaults fault them in again on some or all rounds,
    depending on what else sits at the top of the heap, so the default case is not asserted
    on its counts.) Mutation: no mallopt call -> `applied` is None."""
    tuned = _probe(None)
    assert tuned["applied"] == {"M_MMAP_THRESHOLD": 32 << 20, "M_TRIM_THRESHOLD": (1 << 31) - 1}
    assert tuned["faults"][0] > 20_000
    assert max(tuned["faults"][3:]) < 1_000, tuned


@glibc_only
def test_tenfold_malloc_default_leaves_glibc_alone():
    assert _probe("default")["applied"] is None


@glibc_only
def test_the_trainer_tunes_malloc_on_cpu(small_cfg):
    from tenfold.engine.memory import host_malloc
    from tenfold.engine.loop.trainer import Trainer

    Trainer(small_cfg()).setup()
    if os.environ.get("TENFOLD_MALLOC", "").lower() != "default":
        assert host_malloc.tune_malloc() is not None
