"""Model converters: the techniques that swap a model's modules or weights for others before any
wrapper takes it (torchtitan's ModelConverter: a list built from the run, each converting the
model in place before `parallelize`, each with a hook after the optimizer step).

    Float8Converter   the blocks' Linears -> torchao Float8Linear (--fp8, techniques/fp8.py)
    NF4Converter      the blocks' frozen Linear weights -> NF4 (QLoRA's base, techniques/nf4.py)

Both convert per pipeline stage, on what the stage keeps (tenfold.engine.parallel.parallelize),
NF4 first: the frozen base is quantized where float8 would otherwise take its Linears (the two
are not combined: tenfold.capabilities). Low-rank adapters are a conversion too, but of the whole
model before the pipeline split, so that their random init draws what one process draws
(techniques/lora.py); they are not in this list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn

from tenfold.lora_terms import nf4_shards
from tenfold.run import ResolvedRun
from tenfold.techniques import fp8, nf4


class ModelConverter(Protocol):
    def convert(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """Convert `model` (a whole model or one pipeline stage) in place; `blocks`: its repeated blocks."""

    def after_optimizer_built(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        """Hook the optimizer of the wrapped model (e.g. after each step)."""


@dataclass(frozen=True)
class Float8Converter:
    device: torch.device
    emulate: bool  # float8 numerics without float8 matmuls (CPU, older GPUs)
    fsdp_all_gather: bool  # FSDP2 all-gathers the float8 weights (ZeRO-2/3 over several dp ranks)

    def convert(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        fp8.apply_fp8(model, blocks, self.device, self.emulate, fsdp_all_gather=self.fsdp_all_gather)

    def after_optimizer_built(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        fp8.precompute_scales_after_steps(optimizer, model)  # under FSDP2: the scales in one all-reduce


@dataclass(frozen=True)
class NF4Converter:
    shards: int  # the ZeRO row slices FSDP2 cuts each weight into (whole NF4 groups each)

    def convert(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        nf4.apply_nf4(model, blocks, self.shards)

    def after_optimizer_built(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        return None


def converters_for(run: ResolvedRun, device: torch.device, dp_size: int) -> list[ModelConverter]:
    """The run's converters, in the order they apply."""
    out: list[ModelConverter] = []
    if run.lora is not None and run.lora.base == "nf4":
        out.append(NF4Converter(nf4_shards(run)))
    if run.fp8:
        out.append(Float8Converter(device, run.fp8_emulate, fsdp_all_gather=run.zero_stage >= 2 and dp_size > 1))
    return out
