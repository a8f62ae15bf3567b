"""Low-rank adapters (`--lora RANK`, config `[lora]`; Hu et al. 2021, "LoRA: Low-Rank Adaptation
of Large Language Models") through Hugging Face PEFT's LoRA layers.

An adapted Linear computes W x + (alpha / r) B A dropout(x): W is frozen, A (r x in, PEFT's
Kaiming-uniform init) and B (out x r, zeros, so training starts from the base model exactly)
are the only trained weights. Which Linears: those of the model's blocks named by
`lora.target_modules` (module names, or `all-linear`: every Linear of the blocks, not the output
layer, as PEFT's `all-linear` and the QLoRA paper, §4: adapters on every linear layer match
full fine-tuning). The rest of the model is frozen too (embedding, norms, head).

The frozen base is kept in the compute dtype (bf16/fp16 under mixed precision: half the bytes
of fp32, and no autocast copy of it is made) and has no gradients and no optimizer states; the
adapters are trained as every tenfold parameter is, fp32 master weights under autocast (PEFT's
default, `autocast_adapter_dtype=True`). PEFT casts an adapter's input to the adapter's dtype;
that is switched off (`cast_input_dtype_enabled`), so under autocast A reads the 16-bit input
the base reads, instead of keeping an fp32 copy of it for backward.

Order (engine/parallel/parallelize.py): first, on the whole model on every rank (the adapters' random
init then draws what one process draws), before the pipeline split, the NF4 base
(techniques/nf4.py), recompute, compile and ZeRO, which wrap the converted model as any other.
PEFT's names stay: `...wq.base_layer.weight` (frozen), `...wq.lora_A.default.weight`; checkpoints
hold only the adapters (engine/outputs/checkpoint/model_state.py) and the base's identity (`base_identity`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from tenfold.errors import UserError
from tenfold.lora_terms import LoraSpec
from tenfold.quiet import import_quietly

FLAG = "lora.rank (--lora)"
ADAPTER = "default"  # PEFT's adapter name inside the model; the saved format leaves it out
ADAPTER_PARTS = (".lora_A.", ".lora_B.")


def peft_library():
    """PEFT, imported without torchao's import-time log lines."""
    return import_quietly("peft", f"{FLAG} needs PEFT: pip install 'tenfold[lora]'")


def is_adapter(name: str) -> bool:
    """Whether a parameter name (FQN) is an adapter's A or B."""
    return any(part in name for part in ADAPTER_PARTS)


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear, or transformers' Conv1D (GPT-2's Linears), which PEFT adapts too."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def adapted_module_names(model: nn.Module, blocks: list[nn.Module], spec: LoraSpec) -> list[str]:
    """The FQNs of the blocks' Linears that `spec.targets` names (by the module's own name, the
    last part of its FQN, as PEFT matches), or all of them for `all-linear`."""
    inside = {id(m) for block in blocks for m in block.modules()}
    linears = [name for name, m in model.named_modules() if id(m) in inside and _is_linear(m)]
    if not linears:
        raise UserError(f"{FLAG}: the model's blocks hold no Linear layer to adapt")
    if spec.all_linear:
        return linears
    leaves = {name.rsplit(".", 1)[-1] for name in linears}
    unknown = [t for t in spec.targets if t not in leaves]
    if unknown:
        raise UserError(f"lora.target_modules (--lora-targets) {', '.join(map(repr, unknown))}: no Linear of that name "
                        f"in the model's blocks; allowed: all-linear, {', '.join(sorted(leaves))}")
    return [name for name in linears if name.rsplit(".", 1)[-1] in spec.targets]


def lora_config(spec: LoraSpec, targets: list[str], task_type: str | None = None, base: str | None = None):
    """PEFT's LoraConfig for `spec` on the `targets` modules (FQNs, or module names)."""
    peft = peft_library()
    return peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                           bias="none", task_type=task_type, base_model_name_or_path=base)


@dataclass
class LoraSummary:
    """What `apply_lora` did, for the run's header and summary.json."""

    adapted: int  # Linears with an adapter
    trainable: int  # adapter parameters
    frozen: int  # base parameters
    nf4: tuple[int, int] | None = None  # QLoRA: (block Linears in NF4, frozen block Linears)

    def line(self, spec: LoraSpec) -> str:
        share = 100.0 * self.trainable / max(self.trainable + self.frozen, 1)
        text = (f"{spec.text()}: adapters on {self.adapted} Linears, {self.trainable:,} trainable parameters "
                f"({share:.2f}% of {self.trainable + self.frozen:,})")
        if self.nf4 is not None:
            text += (f"; the frozen base in NF4: {self.nf4[0]} of {self.nf4[1]} block Linears (whole 64 x 256-value "
                     "groups), the rest in the compute dtype")
        return text


def apply_lora(model: nn.Module, spec: LoraSpec, blocks: list[nn.Module], compute_dtype: torch.dtype | None) -> LoraSummary:
    """Put PEFT's LoRA layers on the targeted Linears of `blocks` (in place), freeze everything
    else and keep the frozen weights in `compute_dtype` (None: as they are, fp32)."""
    peft = peft_library()
    targets = adapted_module_names(model, blocks, spec)
    try:
        peft.inject_adapter_in_model(lora_config(spec, targets), model, adapter_name=ADAPTER)
    except ValueError as e:  # PEFT's own refusal of a module it cannot adapt
        raise UserError(f"{FLAG}: PEFT cannot adapt this model: {e}") from None
    trainable = frozen = 0
    for name, p in model.named_parameters():
        train = is_adapter(name)
        p.requires_grad_(train)
        if train:
            trainable += p.numel()
        else:
            frozen += p.numel()
            if compute_dtype is not None and p.is_floating_point() and p.dtype != compute_dtype:
                p.data = p.data.to(compute_dtype)
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):  # a PEFT layer: A reads the input as the base does
            module.cast_input_dtype_enabled = False
    return LoraSummary(adapted=len(targets), trainable=trainable, frozen=frozen)


@torch.no_grad()
def base_identity(model: nn.Module) -> str:
    """sha256 over every parameter and persistent buffer of the model as built, before any
    conversion (name, dtype, shape and bytes, in name order): what a LoRA checkpoint records and
    a resume or a merge checks, so that adapters are never put on another base than the one
    they were trained on."""
    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict(keep_vars=True).items()):
        t = t.detach()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.contiguous().cpu().view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model state dict's adapters under PEFT's saved names: `base_model.model.` + the FQN
    without the adapter name (`layers.0.attn.wq.lora_A.default.weight` ->
    `base_model.model.layers.0.attn.wq.lora_A.weight`), the keys of `adapter_model.safetensors`."""
    return {"base_model.model." + k.replace(f".{ADAPTER}.", "."): v for k, v in state.items() if is_adapter(k)}


def model_state_from_adapter(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `adapter_state`: PEFT's saved names back to the model's FQNs."""
    out = {}
    for key, value in saved.items():
        name = key.removeprefix("base_model.model.")
        for part in ADAPTER_PARTS:
            name = name.replace(part, f"{part}{ADAPTER}.")
        out[name] = value
    return out
