"""What the techniques need from ANY model, found in one place.

tenfold's GPT, a Hugging Face causal LM and a user's own `nn.Module` all go through
`adapt(model, ...)`, which returns a `ModelAdapter`:

  blocks          the repeated block modules, in call order: recompute wraps them
                  (`apply_recompute(model, policy, blocks=...)`) and ZeRO-2/3 makes each one an
                  FSDP2 unit (`fully_shard` per block, then the root; torchtitan's `apply_fsdp`)
  embedding       the input embedding module (for FLOPs, reports)
  output          the output projection (for FLOPs: its matmul is work per token even if tied)
  param_count     unique parameters (tied weights counted once), for reports and the planner
  flops_per_token model FLOPs per trained token (forward + backward), MFU's numerator
  loss_sum        (model, batch) -> sum of token losses of one micro-batch, in fp32

Block detection (`find_blocks`): the children of the largest `nn.ModuleList` /
`nn.ModuleDict` whose children are all of one class ("largest" = most parameters; that is the
transformer stack in every decoder-only LM: GPT's `layers`, Llama's `model.layers`, GPT-2's
`transformer.h`). `blocks="ClassName"` (`--blocks`, config `model.blocks`) names the class
instead: every module of that class, in registration order.

Loss: tenfold's labels are ALREADY shifted (labels[t] is the token after input_ids[t]) and the
loss of a step is the token-weighted sum over the whole global batch
(tenfold.techniques.accumulation). A Hugging Face model given `labels=` would shift them a
second time and return a per-micro-batch mean, so we never pass labels: we take
`model(input_ids=..., use_cache=False).logits` and sum the token losses ourselves with
`tenfold.models.loss.token_loss_sum`. (`use_cache=False`: no KV cache is built in training; with recompute a cache
would be written twice.)

Top level imports torch only (no transformers): `tenfold.models.hf` is imported lazily.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from tenfold.errors import TenfoldNote, UserError
from tenfold.models.gpt import GPT
from tenfold.models.loss import replicated_value, token_loss_sum
from tenfold.models.moe import with_hf_router_aux_loss, with_router_aux_loss
from tenfold.models.presets import flops_per_token as preset_flops_per_token
from tenfold.models.specs import ModelSpec, spec_for
from tenfold.terms import IGNORE_INDEX

LossFn = Callable[[nn.Module, dict], Any]


@dataclass
class ModelAdapter:
    kind: str  # "tenfold" | "hf" | "user"
    blocks: list[nn.Module]
    block_class: str | None
    embedding: nn.Module | None
    output: nn.Module | None
    param_count: int
    flops_per_token: float
    flops_formula: str
    user_loss_fn: LossFn | None = None
    hf_model_type: str = ""  # a Hugging Face model's config.model_type ("llama", ...)

    @property
    def spec(self) -> ModelSpec:
        """What differs for this model's family (tenfold.models.specs)."""
        return spec_for(self.kind)

    # ------------------------------------------------------------------ loss

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """Sum of the token losses of one micro-batch, in fp32. `model` is the module the
        trainer calls (possibly a DDP wrapper, whose forward hooks must run)."""
        if self.user_loss_fn is not None:
            out = self.user_loss_fn(model, batch)
            loss_sum = out[0] if isinstance(out, (tuple, list)) else out
            return replicated_value(loss_sum).float()
        if self.spec.hugging_face:  # position_ids: packed fine-tuning rows (tenfold.data.examples)
            extra = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
            out = model(input_ids=batch["input_ids"], use_cache=False, **extra)
        elif "positions" in batch:  # context parallelism: this rank's tokens and where they sit
            out = model(batch["input_ids"], positions=batch["positions"])
        else:
            out = model(batch["input_ids"])
        loss_sum = token_loss_sum(logits_of(out), batch["labels"])
        # Mixture-of-experts layers' balance losses join the gradient, weighted per target token.
        n_targets = int((batch["labels"] != IGNORE_INDEX).sum())
        if spec_for(self.kind).hugging_face:
            coef = getattr(getattr(getattr(model, "module", model), "config", None), "router_aux_loss_coef", 0.0)
            return with_hf_router_aux_loss(loss_sum, getattr(out, "aux_loss", None), coef or 0.0, n_targets)
        return with_router_aux_loss(loss_sum, model, n_targets)

    # ------------------------------------------------------------------ checks

    def require_blocks(self, what: str) -> list[nn.Module]:
        """The blocks, or a UserError saying that `what` needs them."""
        if not self.blocks:
            raise UserError(
                f"{what} needs the model's repeated blocks, and none were found in this "
                f"{self.kind} model: no nn.ModuleList/ModuleDict holds children of one class. "
                "Name the block class with --blocks ClassName (config model.blocks), "
                "or turn the technique off"
            )
        return self.blocks

    def describe(self) -> str:
        what = f"{len(self.blocks)} x {self.block_class}" if self.blocks else "no repeated blocks"
        return f"{self.kind} model, {self.param_count / 1e6:.2f}M params, blocks: {what}"


def logits_of(output: Any) -> torch.Tensor:
    """Logits from a forward's output: a tensor, an object with `.logits` (Hugging Face
    ModelOutput), or a tuple/list whose first element is the logits."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise UserError(
        f"the model's forward returned {type(output).__name__}, not logits (b, s, vocab); "
        "return a tensor or an object with .logits, or pass loss_fn=(model, batch) -> "
        "(sum of token losses, number of targets) to Trainer"
    )


# --------------------------------------------------------------------------- blocks


def _block_candidates(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """(container FQN, children) of every ModuleList/ModuleDict whose children share one class."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            children = list(m.values()) if isinstance(m, nn.ModuleDict) else list(m)
            if children and len({type(c) for c in children}) == 1:
                out.append((name, children))
    return out


def _numel(modules: list[nn.Module]) -> int:
    seen: set[int] = set()
    n = 0
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
    return n


def repeated_classes(model: nn.Module) -> list[str]:
    """Class names that occur more than once among the model's submodules (for messages)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if m is not model and any(True for _ in m.parameters()):
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    return sorted(n for n, c in counts.items() if c > 1)


def find_blocks(model: nn.Module, class_name: str | None = None) -> list[nn.Module]:
    """The repeated blocks of `model` in call order (see the module docstring); [] if none."""
    if class_name:
        blocks = [m for m in model.modules() if m is not model and type(m).__name__ == class_name]
        if not blocks:
            raise UserError(
                f"model.blocks (--blocks) {class_name!r}: no module of that class in "
                f"{type(model).__name__}; classes that repeat: {', '.join(repeated_classes(model)) or 'none'}"
            )
        nested = [b for b in blocks if any(o is not b and _contains(o, b) for o in blocks)]
        if nested:
            raise UserError(
                f"model.blocks (--blocks) {class_name!r}: blocks of that class are nested inside "
                "each other; name the outer block class"
            )
        return blocks
    candidates = [(n, c) for n, c in _block_candidates(model) if _numel(c) > 0]
    if not candidates:
        return []
    # Largest by parameters; ties (e.g. an empty list) broken by the number of children.
    _, children = max(candidates, key=lambda nc: (_numel(nc[1]), len(nc[1])))
    return children


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


# --------------------------------------------------------------------------- FLOPs


def _embedding_and_output(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    get_in = getattr(model, "get_input_embeddings", None)  # Hugging Face PreTrainedModel
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_in) and callable(get_out):
        try:
            return get_in(), get_out()
        except (NotImplementedError, AttributeError):
            pass
    if hasattr(model, "tok_emb") and hasattr(model, "output"):  # tenfold's GPT
        return model.tok_emb, model.output
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    emb = embeddings[0] if embeddings else None
    out = None
    if emb is not None:  # the last Linear whose output size is the vocabulary
        heads = [m for m in linears if m.out_features == emb.num_embeddings]
        out = heads[-1] if heads else None
    return emb, out


def _hidden_size(model: nn.Module, embedding: nn.Module | None) -> int | None:
    hf_cfg = getattr(model, "config", None)
    for key in ("hidden_size", "n_embd", "d_model"):
        v = getattr(hf_cfg, key, None)
        if isinstance(v, int):
            return v
    return getattr(embedding, "embedding_dim", None)


def estimate_flops_per_token(
    blocks: list[nn.Module], output: nn.Module | None, n_params: int, embedding: nn.Module | None,
    seq_len: int, d_model: int | None, attention: bool,
) -> tuple[float, str]:
    """Model FLOPs per trained token, the convention of `tenfold.models.presets.flops_per_token`:
    6 x (block parameters + output projection) (Kaplan et al. 2020) + 12 L s d for attention
    scores and values (PaLM App. B) when the blocks are attention blocks. For tenfold's GPT this
    equals `presets.flops_per_token` exactly (tests). Without blocks: 6 x non-embedding params."""
    out_w = getattr(output, "weight", None)
    out_numel = out_w.numel() if isinstance(out_w, torch.Tensor) else 0
    if blocks:
        n_matmul = _numel(blocks) + out_numel
        flops = 6.0 * n_matmul
        formula = "6 x (block params + output projection)"
        if attention and d_model:
            flops += 12.0 * len(blocks) * seq_len * d_model
            formula += " + 12 L s d"
        return flops, formula
    emb_w = getattr(embedding, "weight", None)
    emb_numel = emb_w.numel() if isinstance(emb_w, torch.Tensor) else 0
    tied = out_w is not None and emb_w is not None and out_w is emb_w
    n = n_params - emb_numel + (out_numel if tied else 0)
    return 6.0 * n, "6 x non-embedding params (Kaplan)"


# --------------------------------------------------------------------------- entry point


def model_kind(model: nn.Module) -> str:
    if isinstance(model, GPT):
        return "tenfold"
    if _is_hf_causal_lm(model):
        return "hf"
    return "user"


def _is_hf_causal_lm(model: nn.Module) -> bool:
    # Without importing transformers: a PreTrainedModel subclass has `config` with a
    # `model_type` and the `get_output_embeddings` / `save_pretrained` API.
    cfg = getattr(model, "config", None)
    return (
        any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)
        and hasattr(cfg, "model_type") and hasattr(model, "save_pretrained")
    )


def adapt(
    model: nn.Module, seq_len: int, blocks: str | None = None, loss_fn: LossFn | None = None
) -> ModelAdapter:
    """Inspect `model` once; see the module docstring. `blocks` names the block class."""
    kind = model_kind(model)
    spec = spec_for(kind)
    if spec.block_path and not blocks:
        found = list(model.get_submodule(spec.block_path).values())  # GPT.forward calls them in this order
    else:
        found = find_blocks(model, blocks)
    if spec.hugging_face and not blocks:
        _check_against_no_split_modules(model, found)
    embedding, output = _embedding_and_output(model)
    n_params = sum(p.numel() for p in model.parameters())  # parameters() yields tied ones once
    flops, formula = estimate_flops_per_token(
        found, output, n_params, embedding, seq_len, _hidden_size(model, embedding),
        attention=spec.architecture_known,
    )
    moe = moe_shape(model, spec)
    if moe is not None:  # a token runs k of the E experts: active parameters
        flops, formula = preset_flops_per_token(moe, seq_len), "6 x active params + 12 L s d"
    return ModelAdapter(
        kind=kind, blocks=found, block_class=type(found[0]).__name__ if found else None,
        embedding=embedding, output=output, param_count=n_params, flops_per_token=flops,
        flops_formula=formula, user_loss_fn=loss_fn,
        hf_model_type=str(getattr(model.config, "model_type", "")).lower() if spec.hugging_face else "",
    )


def moe_shape(model: nn.Module, spec: ModelSpec):
    """The ModelConfig of a mixture-of-experts model (tenfold's MoE GPT, or a Hugging Face MoE
    family: Mixtral, Qwen2-MoE, Qwen3-MoE), else None."""
    if spec.own_moe_blocks:
        return model.cfg if model.cfg.is_moe else None
    return hf_moe_shape(model) if spec.hugging_face else None


def hf_moe_shape(model: nn.Module):
    """The ModelConfig of a Hugging Face mixture-of-experts model (tenfold.models.hf_config's
    MOE_FAMILIES), read from its config; None for any other model."""
    from tenfold.models.hf_config import MOE_FAMILIES, model_from_hf_dict

    config = getattr(model, "config", None)
    if str(getattr(config, "model_type", "")).lower() not in MOE_FAMILIES:
        return None
    return model_from_hf_dict(config.to_dict(), type(model).__name__, "the model's config")


def _check_against_no_split_modules(model: nn.Module, found: list[nn.Module]) -> None:
    """Hugging Face models name their block class in `_no_split_modules` (accelerate's FSDP
    auto-wrap uses it as `transformer_layer_cls_to_wrap`). If our structural guess is not one of
    them, say so rather than silently sharding the wrong unit."""
    declared = set(getattr(model, "_no_split_modules", None) or ())
    if not declared or (found and type(found[0]).__name__ in declared):
        return

    guess = type(found[0]).__name__ if found else "none"
    warnings.warn(
        f"{type(model).__name__} declares its blocks as {sorted(declared)} (_no_split_modules) but the "
        f"largest list of one class holds {guess}; using {guess}. Pass --blocks ClassName to choose",
        TenfoldNote, stacklevel=3,
    )
