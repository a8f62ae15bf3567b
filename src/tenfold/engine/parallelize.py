"""The one place where the seed's techniques are applied to a model, in a fixed order.

Order (torchtitan's `parallelize`, engine.md §5.1-5.2): pipeline split -> activation
recompute -> ZeRO/FSDP wrapping. Recompute must wrap blocks before FSDP2 `fully_shard`
takes them over (so that unsharded parameters are re-gathered inside the recomputed
forward), and the pipeline split must come first because each stage shards only what it owns.
Mixed precision is not a wrapper here: autocast is entered in the step (precision.py), and
under FSDP2 the ZeRO module passes a MixedPrecisionPolicy.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tenfold.config import TenfoldConfig
from tenfold.engine.distributed import DistInfo


def parallelize(
    model: nn.Module, cfg: TenfoldConfig, dist: DistInfo, blocks: list[nn.Module] | None = None,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """`blocks`: the model's repeated blocks (tenfold.models.adapter), recomputed and sharded
    one by one; None: tenfold's GPT `model.layers`. `param_dtype`: the 16-bit compute dtype
    (None for fp32); FSDP2 (ZeRO-2/3) then gathers parameters in it and reduces in fp32, over
    fp32 sharded master weights (MixedPrecisionPolicy)."""
    if dist.pp_size > 1:  # [pipeline] split first; each stage then gets recompute + ZeRO alone
        from tenfold.techniques import pipeline

        split = pipeline.split_for_rank(model, cfg, dist)
        parts = [_recompute_and_zero(part, cfg, dist, param_dtype=param_dtype) for part in split.modules]
        return pipeline.build_pipelined_model(split, parts, cfg, dist)
    return _recompute_and_zero(model, cfg, dist, blocks, param_dtype)


def _recompute_and_zero(model: nn.Module, cfg: TenfoldConfig, dist: DistInfo, blocks=None, param_dtype=None) -> nn.Module:
    from tenfold.techniques import recompute, zero

    if cfg.recompute.policy != "none":
        recompute.apply_recompute(model, recompute.parse_policy(cfg.recompute.policy), blocks=blocks)
    return zero.apply_zero(model, cfg.parallel, dist, param_dtype=param_dtype, blocks=blocks)
