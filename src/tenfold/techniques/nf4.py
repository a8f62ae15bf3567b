"""QLoRA's frozen base in 4-bit NormalFloat (`--qlora`, `--lora-base nf4`; Dettmers et al. 2023,
"QLoRA: Efficient Finetuning of Quantized LLMs") through torchao's `NF4Tensor`.

Every frozen Linear weight of the blocks (adapted or not, as bitsandbytes' `load_in_4bit`
quantizes every Linear but the output layer) becomes `torchao.quantization.to_nf4(weight)`:
4-bit NF4 values in blocks of 64 with double-quantized block constants (8-bit, in groups of
256), QLoRA's layout (tenfold.lora_terms.nf4_bytes_per_param). The embedding, norms and output
layer stay in the compute dtype. A weight whose size is not a whole number of 64 x 256 element
groups stays in the compute dtype too (`lora_terms.nf4_quantizable`); the rule ignores the layout,
so one run quantizes the same weights on any number of ranks, and a layout whose ZeRO shards
would cut a group is refused (tenfold.capabilities).

In the forward and in the backward each NF4 weight is dequantized to the activations' dtype for
its matmul (torchao's `linear_nf4`: the gradient flows to the input, never to the weight), so the
adapters train in the compute dtype over the 4-bit base. FSDP2 shards NF4 weights as they are
(torchao implements FSDP2's all-gather hooks for them): ZeRO-2/3 gather 4-bit bytes, as
torchtune's QLoRA recipes do. torchao's NF4 runs on CPUs too (bitsandbytes' 4-bit kernels need
CUDA for most paths).

Order (engine/parallel/parallelize.py): after the adapters (techniques/lora.py) and the pipeline split,
on each stage's own blocks, before recompute, compile and ZeRO.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tenfold.errors import UserError
from tenfold.lora_terms import nf4_quantizable, nf4_shardable
from tenfold.quiet import import_quietly

FLAG = "lora.base nf4 (--qlora)"


def torchao_quantization():
    return import_quietly("torchao.quantization", f"{FLAG} needs torchao: pip install 'tenfold[lora]'")


def is_nf4(t: torch.Tensor) -> bool:
    """Whether `t` (a parameter or its local shard) is torchao's NF4Tensor."""
    return type(t).__name__ == "NF4Tensor"


def _frozen_linears(blocks: list[nn.Module]) -> list[nn.Linear]:
    """The blocks' nn.Linear modules with a frozen 2-D weight (PEFT's `base_layer` inside an
    adapted Linear, and every Linear left without an adapter)."""
    return [m for block in blocks for m in block.modules()
            if type(m) is nn.Linear and not m.weight.requires_grad and not is_nf4(m.weight)]


@torch.no_grad()
def apply_nf4(model: nn.Module, blocks: list[nn.Module], shards: int = 1) -> list[str]:
    """Replace the blocks' frozen Linear weights by their NF4 form, in place, where QLoRA's block
    layout fits the weight; `shards`: the ZeRO row slices FSDP2 will cut each into, which must be
    whole groups too (UserError). Returns the names of the quantized Linears (the rest stay in
    their dtype)."""
    to_nf4 = torchao_quantization().to_nf4
    names = {id(m): name for name, m in model.named_modules()}
    done = []
    for linear in _frozen_linears(blocks):
        rows, cols = linear.weight.shape
        if not nf4_quantizable(rows, cols):
            continue
        if not nf4_shardable(rows, cols, shards):
            raise UserError(f"{FLAG} under ZeRO-2/3 over {shards} ranks: FSDP2 would cut {names[id(linear)]} "
                            f"({rows} x {cols}) inside NF4's 64 x 256-value groups; use fewer ranks per shard "
                            "group (--shard-group) or --zero 0/1")
        linear.weight = nn.Parameter(to_nf4(linear.weight.detach().contiguous()), requires_grad=False)
        done.append(names[id(linear)])
    return done


def nf4_nbytes(t: torch.Tensor) -> int:
    """Bytes an NF4 weight really holds: the packed 4-bit values, the 8-bit block constants, the
    second-level constants, their mean and the 16-entry code book."""
    parts = (t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4)
    return sum(p.numel() * p.element_size() for p in parts)


@torch.no_grad()
def dequantize_in_place(model: nn.Module) -> int:
    """Every NF4 weight of `model` back to a plain tensor in its dtype (what the adapters were
    trained against: merging adapters into this gives the trained model's function). Returns
    how many were dequantized."""
    count = 0
    for module in model.modules():
        weight = module._parameters.get("weight")  # its own (a PEFT layer's `weight` is its base layer's)
        if weight is not None and is_nf4(weight):
            module.weight = nn.Parameter(weight.get_original_weight(), requires_grad=False)
            count += 1
    return count
