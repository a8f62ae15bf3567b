"""The one place where the seed's techniques are applied to a model, in a fixed order.

Order (torchtitan's `parallelize`, engine.md §5.1-5.2): pipeline split -> activation
recompute -> ZeRO/FSDP wrapping. Recompute must wrap blocks before FSDP2 `fully_shard`
takes them over (so that unsharded parameters are re-gathered inside the recomputed
forward), and the pipeline split must come first because each stage shards only what it owns.
Mixed precision is not a wrapper here: autocast is entered in the step (precision.py), and
under FSDP2 the ZeRO module passes a MixedPrecisionPolicy.
"""

from __future__ import annotations

import torch.nn as nn

from tenfold.config import TenfoldConfig
from tenfold.engine.distributed import DistInfo


def parallelize(model: nn.Module, cfg: TenfoldConfig, dist: DistInfo) -> nn.Module:
    from tenfold.techniques import recompute, zero

    if cfg.recompute.policy != "none":
        recompute.apply_recompute(model, recompute.parse_policy(cfg.recompute.policy))
    return zero.apply_zero(model, cfg.parallel, dist, param_dtype=None)
