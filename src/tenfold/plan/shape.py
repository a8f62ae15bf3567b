"""The model as the planner sees it: a `ModelConfig` (preset, dimensions or HF config.json)
or only a parameter count (`--params N`: model states only, activations unknown)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tenfold.errors import UserError
from tenfold.models.presets import (
    ModelConfig,
    block_param_count,
    embedding_param_count,
    get_preset,
    expert_param_count,
    head_param_count,
    norm_param_count,
    moe_layer_param_count,
    param_count,
)


@dataclass(frozen=True)
class ModelShape:
    cfg: ModelConfig | None  # None: only the parameter count is known
    params: float
    name: str = "custom"

    @property
    def known(self) -> bool:
        return self.cfg is not None


def shape_of(model: "ModelConfig | str | float | int | ModelShape", name: str | None = None) -> ModelShape:
    if isinstance(model, ModelShape):
        return model if name is None else ModelShape(model.cfg, model.params, name)
    if isinstance(model, ModelConfig):
        return ModelShape(model, float(param_count(model)), name or "custom")
    if isinstance(model, str):
        return ModelShape(get_preset(model), float(param_count(get_preset(model))), model)
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        if model <= 0:
            raise UserError(f"--params must be positive, got {model}")
        return ModelShape(None, float(model), name or f"{model:.3g} params")
    raise UserError(f"model must be a preset name, ModelConfig or parameter count, got {model!r}")


@functools.lru_cache(maxsize=4096)
def rank_params(shape: ModelShape, layers: int, first: bool, last: bool, tp: int, pp: int, ep: int = 1) -> float:
    """Parameters held by one pipeline rank before ZeRO sharding: its `layers` blocks, the
    embedding on the first rank, the final norm and output layer on the last (with tied
    embeddings and pp > 1 the last rank keeps its own copy of the embedding matrix, Narayanan
    et al. 2021 section 2 / Megatron `setup_embeddings_and_output_layer`). TP shards matmul
    weights and the vocabulary by t; norm weights are replicated. Without a shape:
    params / (tp x pp). MoE under expert parallelism: 1/ep of each block's routed experts."""
    if not shape.known:
        return shape.params / (tp * pp)
    cfg = shape.cfg
    norm = norm_param_count(cfg)
    n = layers * layer_params(shape, tp, ep)
    if first:
        n += embedding_param_count(cfg) / tp
    if last:
        head = head_param_count(cfg) - norm
        if cfg.tie_embeddings and pp > 1:
            head = cfg.vocab_size * cfg.d_model
        n += head / tp + norm
    return n


def run_rank_params(shape: ModelShape, run, pp_rank: int) -> float:
    """`rank_params` of pipeline rank `pp_rank` of a resolved run (tenfold.run.ResolvedRun),
    with the run's own split of the blocks."""
    return rank_params(shape, run.rank_layers(pp_rank), pp_rank == 0, pp_rank == run.pp - 1, run.tp, run.pp, run.ep)


def layer_params(shape: ModelShape, tp: int, ep: int = 1) -> float:
    """One transformer block's parameters on one TP rank: matmul weights / t, norms whole; an MoE
    layer whole on every tp rank (tenfold.techniques.tensor_parallel.gpt_plan leaves it unsplit),
    its routed experts / ep when expert parallelism splits them."""
    if not shape.known:
        return 0.0
    cfg = shape.cfg
    norm = norm_param_count(cfg)
    moe = _block_moe(cfg)
    experts = _block_experts(cfg)
    return (_block_params(cfg) - 2 * norm - moe) / tp + moe - experts + experts / ep + 2 * norm


@functools.lru_cache(maxsize=1024)
def largest_unit_params(shape: ModelShape, tp: int, ep: int = 1) -> float:
    """The largest FSDP/ZeRO-3 unit gathered at once: one block or the embedding (DeepSpeed's
    `largest_layer_params`; FSDP2 wraps each block and the root). Expert-parallel experts are
    never gathered (the engine's FSDP2 leaves them out)."""
    if not shape.known:
        return 0.0
    cfg = shape.cfg
    experts = _block_experts(cfg) if ep > 1 else 0.0
    moe = _block_moe(cfg)
    return max((_block_params(cfg) - moe) / tp + moe - experts, embedding_param_count(cfg) / tp)


def _block_experts(cfg: ModelConfig) -> float:
    return expert_param_count(cfg) / cfg.n_layers


def _block_moe(cfg: ModelConfig) -> float:
    """One block's MoE layer (router, shared experts, routed experts): not split by tp; 0 when dense."""
    if not cfg.is_moe:
        return 0.0
    return float(moe_layer_param_count(cfg))


@functools.lru_cache(maxsize=256)
def _block_params(cfg: ModelConfig) -> int:
    return block_param_count(cfg)
