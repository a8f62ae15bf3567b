"""The engine's side of a LoRA run (techniques/lora.py, techniques/nf4.py): the frozen base's
identity, agreed by every rank, recorded in each checkpoint and checked on resume; and the
adapters written as a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`, what
`peft.PeftModel.from_pretrained(base, folder)` loads) at the end of the run.

A checkpoint of a LoRA run holds the adapters and their AdamW states only (DCP `model.*` and
`optim.*` entries of the trained parameters; engine/outputs/checkpoint/model_state.py) and, in
trainer_state.json, `lora`: the spec and the sha256 of the base as it was built (before the
compute-dtype cast and NF4). A resume rebuilds the base the same way (the same
`--hf-pretrained` folder, or the same config and seed) and refuses a checkpoint whose base
differs; `tenfold export --merge` checks it the same way before merging.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tenfold.engine.outputs.checkpoint.layout import CheckpointError
from tenfold.engine.parallel.distributed import DistInfo, all_gather_small
from tenfold.errors import UserError
from tenfold.lora_terms import LoraSpec, nf4_quantizable
from tenfold.run import ResolvedRun
from tenfold.techniques import lora
from tenfold.techniques.lora import LoraSummary

ADAPTER_FOLDER = "adapter"  # OUT/adapter: the PEFT folder a LoRA run writes at its end
WEIGHTS_FILE = "adapter_model.safetensors"  # PEFT's names (peft.utils.constants)


@dataclass
class LoraRun:
    spec: LoraSpec
    base_sha256: str  # tenfold.techniques.lora.base_identity of the model as built
    summary: LoraSummary | None = None  # set once the adapters are on (engine/parallel/parallelize.py)

    def record(self) -> dict:
        """trainer_state.json's `lora` entry."""
        return {"base_sha256": self.base_sha256, **asdict(self.spec)}


def prepare(model: nn.Module, run: ResolvedRun, dist: DistInfo) -> LoraRun | None:
    """The base's identity, before any conversion, the same on every rank (each rank built its
    own copy: from the same folder, or the same config and seed); None for a full run."""
    if run.lora is None:
        return None
    identity = lora.base_identity(model)
    others = set(all_gather_small(identity))
    if len(others) > 1:
        raise UserError(f"{lora.FLAG}: the ranks built different base models ({len(others)} distinct sha256 over "
                        "the weights); every rank must load the same --hf-pretrained folder or build the same seeded model")
    return LoraRun(run.lora, identity)


class LoraCheckpointState:
    """The `lora` entry of a checkpoint (a JSON state): what the adapters were trained on."""

    def __init__(self, lora_run: LoraRun):
        self.lora_run = lora_run

    def state_dict(self) -> dict:
        return self.lora_run.record()

    def validate(self, saved: Any) -> None:
        if not isinstance(saved, dict) or not isinstance(saved.get("base_sha256"), str):
            raise ValueError("lora has no 'base_sha256' entry")
        ours = self.lora_run.record()
        if saved["base_sha256"] != ours["base_sha256"]:
            raise CheckpointError(
                f"the checkpoint's adapters were trained on another base model (sha256 {saved['base_sha256'][:12]}...; "
                f"this run's base: {ours['base_sha256'][:12]}...): resume with the --hf-pretrained folder (or the model "
                "config and train.seed) that run used")
        changed = [k for k in ("rank", "alpha", "dropout", "targets", "base")
                   if json.dumps(saved.get(k)) != json.dumps(ours[k])]
        if changed:
            detail = ", ".join(f"{k} {saved.get(k)!r} (run: {ours[k]!r})" for k in changed)
            raise CheckpointError(f"the checkpoint's adapters differ from this run's [lora]: {detail}")

    def load_state_dict(self, saved: dict) -> None:
        """Nothing to restore: the adapters themselves come back through DCP."""


# --------------------------------------------------------------------------- the adapter folder


def full_adapter_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The adapters, unsharded, on CPU, under the model's FQNs: on every rank (FSDP2 gathers
    them), on rank 0 only for a pipelined model (its stages send theirs). Collective."""
    inner = getattr(model, "module", model)  # DDP
    gather = getattr(inner, "full_state_dict", None)
    if callable(gather):  # techniques/pipeline_runner.PipelinedModel
        state = gather(trainable_only=True)
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(inner, options=options)
    return None if state is None else {k: v.detach().cpu() for k, v in state.items() if lora.is_adapter(k)}


def write_adapter_folder(state: dict[str, torch.Tensor], spec: LoraSpec, out_dir: Path, *, hf: bool,
                         base_path: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """`state` (adapters under the model's FQNs) as a PEFT folder: adapter_model.safetensors
    under PEFT's saved names and adapter_config.json from PEFT's own LoraConfig (task type
    CAUSAL_LM for a Hugging Face model, so PeftModel.from_pretrained gives one that generates)."""
    targets = sorted({k.split(".lora_", 1)[0].rsplit(".", 1)[-1] for k in state})
    config = lora.lora_config(spec, targets, task_type="CAUSAL_LM" if hf else None, base=base_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    tensors = {k: v.to(dtype or v.dtype).contiguous() for k, v in lora.adapter_state(state).items()}
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir


def save_adapter_at_end(model: nn.Module, lora_run: LoraRun, out_dir: Path, *, is_main: bool, hf: bool,
                        base_path: str | None) -> Path | None:
    """OUT/adapter at the end of a LoRA run (every rank calls it; rank 0 writes)."""
    state = full_adapter_state(model)
    if not is_main or state is None:
        return None
    return write_adapter_folder(state, lora_run.spec, out_dir / ADAPTER_FOLDER, hf=hf, base_path=base_path)


def adapted(lora_run: LoraRun, adapter, summary: LoraSummary) -> None:
    """Once the adapters are on (before any split): the summary, and the model FLOPs per token
    of a LoRA step (tenfold.lora_terms.lora_flops_per_token): a frozen matmul costs its forward
    and the backward to its input, 4 x its parameters, not 6 (no weight gradient); an adapter
    the full 6 x its parameters."""
    if lora_run.spec.base == "nf4":
        linears = [m.weight.shape for b in adapter.blocks for m in b.modules()
                   if type(m) is nn.Linear and not m.weight.requires_grad]
        summary.nf4 = (sum(nf4_quantizable(*shape) for shape in linears), len(linears))
    lora_run.summary = summary
    out_w = getattr(adapter.output, "weight", None)
    out = out_w.numel() if isinstance(out_w, torch.Tensor) else 0
    base = adapters = 0
    for block in adapter.blocks:
        for name, p in block.named_parameters():
            if lora.is_adapter("." + name):
                adapters += p.numel()
            else:
                base += p.numel()
    adapter.flops_per_token += -2.0 * (base + out) + 6.0 * adapters
    adapter.flops_formula = adapter.flops_formula.replace("6 x (block params + output projection)",
                                                          "4 x (frozen block params + output) + 6 x adapter params")
