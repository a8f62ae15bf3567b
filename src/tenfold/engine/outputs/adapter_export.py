"""`tenfold export` of a LoRA run's checkpoint (engine/outputs/export.py hands it over): the adapters as a
PEFT folder (default OUT/adapter), or with `--merge` the trained model with the adapters merged
into its base, as tenfold's export writes any model of its kind (a Hugging Face model: a
`save_pretrained` folder, default OUT/hf; tenfold's GPT: NAME.safetensors + NAME.config.json).

Merging rebuilds the base as the run built it (the same `--hf-pretrained` folder, or the same
config and `train.seed`), refuses a base whose sha256 differs from the one the checkpoint
records (engine/loop/lora_run.py), converts it as the run did (the frozen weights in the compute
dtype, NF4 where QLoRA put them: the function the adapters were trained against), loads the
adapters, turns NF4 back into the compute dtype and lets PEFT merge W + (alpha / r) B A into
each adapted Linear in fp32 (`LoraLayer.merge`), before the weights are cast to `--dtype`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from tenfold.config import TenfoldConfig
from tenfold.engine.outputs.checkpoint import layout as lay
from tenfold.engine.loop.lora_run import ADAPTER_FOLDER, write_adapter_folder  # noqa: F401 (export.py names it)
from tenfold.errors import UserError
from tenfold.lora_terms import lora_spec
from tenfold.models.adapter import find_blocks
from tenfold.models.gpt import GPT
from tenfold.models.hf import build_hf_model
from tenfold.techniques import lora, nf4
from tenfold.techniques.precision import DTYPES


def is_lora_run(saved: dict) -> bool:
    """Whether a checkpoint's config.json is a LoRA run's."""
    return bool(saved.get("lora", {}).get("rank"))


def adapter_weights(weights: dict[str, torch.Tensor], ckpt: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's `model.*` entries, which for a LoRA run are its adapters."""
    found = {k: v for k, v in weights.items() if lora.is_adapter(k)}
    if not found:
        raise lay.CheckpointError(f"checkpoint {ckpt} holds no adapter weights (no lora_A/lora_B entries)")
    return found


def write_adapters(weights: dict, cfg: TenfoldConfig, out_dir: Path, dtype: str) -> dict:
    """The adapters as a PEFT folder, in `dtype`."""
    spec = lora_spec(cfg.lora)
    hf = bool(cfg.model.hf_config or cfg.model.hf_pretrained)
    write_adapter_folder(weights, spec, out_dir, hf=hf, base_path=cfg.model.hf_pretrained or cfg.model.hf_config,
                         dtype=DTYPES[dtype])
    return {"format": "peft-lora", "num_params": sum(v.numel() for v in weights.values()), "safetensors": str(out_dir),
            "config": str(out_dir / "adapter_config.json")}


def rebuild_base(cfg: TenfoldConfig) -> nn.Module:
    """The run's base model as `tenfold train` built it (seeded the same way), in fp32 on CPU."""
    from tenfold.engine.loop.parts import seed_everything

    seed_everything(cfg.train.seed)
    m = cfg.model
    if m.hf_config or m.hf_pretrained:
        return build_hf_model(m.hf_config, m.hf_pretrained)
    return GPT(cfg.model.build())


def merged_model(weights: dict, cfg: TenfoldConfig, record: dict, ckpt: Path) -> nn.Module:
    """The base rebuilt and checked, converted as the run did, the adapters loaded and merged."""
    model = rebuild_base(cfg)
    identity = lora.base_identity(model)
    if identity != record.get("base_sha256"):
        raise UserError(
            f"export --merge: the base this run's config builds (sha256 {identity[:12]}...) is not the one the "
            f"adapters of {ckpt} were trained on ({str(record.get('base_sha256'))[:12]}...): the --hf-pretrained "
            "folder or the model has changed since; merge with the base it was trained on")
    spec = lora_spec(cfg.lora)
    blocks = find_blocks(model, cfg.model.blocks) if cfg.model.blocks else _default_blocks(model)
    compute = None if _compute_dtype(cfg) == torch.float32 else _compute_dtype(cfg)
    lora.apply_lora(model, spec, blocks, compute)
    if spec.base == "nf4":
        nf4.apply_nf4(model, blocks)
    result = model.load_state_dict(weights, strict=False)
    missing = [k for k in result.missing_keys if lora.is_adapter(k)]
    if missing or result.unexpected_keys:
        raise lay.CheckpointError(f"checkpoint {ckpt}: the adapters do not fit the rebuilt model "
                                  f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})")
    nf4.dequantize_in_place(model)
    return merge_adapters(model.float())


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.layers.values()) if isinstance(model, GPT) else find_blocks(model)


def _compute_dtype(cfg: TenfoldConfig) -> torch.dtype:
    """The dtype the run kept its frozen base in: its precision (auto resolved as train did)."""
    from tenfold.run import resolve_run

    return DTYPES[resolve_run(cfg, 1, check=False).precision]


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Every PEFT LoRA layer merged into its base Linear (PEFT's `LoraLayer.merge`: W + (alpha /
    r) B A) and replaced by it, so the model has its plain architecture and parameter names."""
    layers = [(name, m) for name, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    for name, layer in layers:
        layer.merge(safe_merge=True)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model


def check_merge_allowed(lora_run: bool, merge: bool) -> None:
    if merge and not lora_run:
        raise UserError("export --merge merges a LoRA run's adapters into its base; this checkpoint is a full "
                        "run's (every weight trained): export it without --merge")
