"""A decoder-only transformer in one readable file (nanoGPT's spirit, LLaMA's blocks).

Pre-norm blocks: x + Attention(Norm(x)), then x + MLP(Norm(x)). RMSNorm or LayerNorm,
RoPE or learned positions, SwiGLU or GELU MLP, grouped-query attention, optional biases
and tied embeddings, all chosen by `ModelConfig` (tenfold/models/presets.py, whose
`param_count` matches this module exactly). Attention is `F.scaled_dot_product_attention`
with `is_causal=True`, so no s x s mask is materialised (flash/memory-efficient kernels).

The attention core and the MLP are their own submodules (`Block.attn.core`, `Block.mlp`)
so that selective recompute can wrap exactly them (Korthikanti et al. 2022).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tenfold.errors import UserError
from tenfold.models.moe import MoE
from tenfold.models.presets import ModelConfig


def _norm_output(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A norm's fp32 result as the layers after it read it. Only Linears read a norm's output:
    under autocast it is cast to 16 bits once here, where autocast would cast the fp32 output
    again for each of wq/wk/wv (w1/w3) and keep every copy for backward (docs/precision.md)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return y.to(torch.get_autocast_dtype(device))
    return y.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability under autocast, as LLaMA does. F.rms_norm runs
        # pow/mean/rsqrt/mul inside ATen, dispatched once from Python instead of five times
        # (docs/benchmarks.md, "Optimization ladder after the bf16 step work").
        return _norm_output(F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps), x)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in fp32 whatever the input's dtype, its output cast once
    (`_norm_output`). CUDA's autocast runs layer_norm in fp32 and returns fp32, which each
    following Linear casts again; CPU's autocast runs it in 16 bits. Here both devices compute
    and keep the same tensors: the fp32 input, mean and 1/std, one 16-bit output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return _norm_output(F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps), x)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return LayerNorm(cfg.d_model, eps=cfg.norm_eps)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for rotary embeddings (Su et al. 2021), shape (seq_len, head_dim).

    Pairs are interleaved, (x0, x1), (x2, x3), ...: pair i turns by angle pos * theta^(-2i/hd).
    Each angle's cos is stored twice, `cos[..., 2i] = cos[..., 2i+1]`, and its sin with the
    sign of the rotation, `sin[..., 2i] = -sin_i`, `sin[..., 2i+1] = +sin_i`, so that
    `apply_rope` is two multiplies and an add over whole rows."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    cos = angles.cos().repeat_interleave(2, dim=-1)
    sin = torch.stack((-angles.sin(), angles.sin()), dim=-1).flatten(-2)
    return cos.float(), sin.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x (b, h, s, hd): (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin).

    Written as x * cos + swap_pairs(x) * signed_sin: the same products and sums as the
    pairwise form, so equal to it bit for bit in fp32 (tests/test_gpt.py), but with one
    copy instead of strided slices and a stack; on CPU the bf16 forward+backward of RoPE
    became 2.4x faster."""
    s = x.shape[-2]
    cos, sin = cos[:s].to(x.dtype), sin[:s].to(x.dtype)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos + swapped * sin


class AttentionCore(nn.Module):
    """softmax(QK^T/sqrt(d))V: no parameters, the part selective recompute targets."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.use_rope = cfg.pos == "rope"
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.wk = nn.Linear(cfg.d_model, kv_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.d_model, kv_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        # (..., -1, head_dim): under tensor parallelism wq/wk/wv give this rank whole heads,
        # n_heads/tp of them (and kv_heads/tp), so the head count is read from the output.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.core(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        ff = cfg.ffn_dim
        self.w1 = nn.Linear(cfg.d_model, ff, bias=cfg.bias)
        if self.swiglu:  # Shazeer 2020: W2(silu(W1 x) * W3 x)
            self.w3 = nn.Linear(cfg.d_model, ff, bias=cfg.bias)
        self.w2 = nn.Linear(ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg)
        # A mixture-of-experts block keeps the name `mlp` for its feed-forward part, so that
        # selective recompute (selective:mlp) and the checkpoint layout treat both alike.
        self.mlp = MoE(cfg) if cfg.is_moe else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


def _head_from_tied_embedding(module, state_dict, prefix, *args) -> None:
    """A tied GPT's weights may name the shared matrix once, as `tok_emb.weight` (tenfold export
    writes it once, as Hugging Face's save_pretrained does): the head takes it from there."""
    head, embedding = prefix + "output.weight", prefix + "tok_emb.weight"
    if head not in state_dict and embedding in state_dict:
        state_dict[head] = state_dict[embedding]


class GPT(nn.Module):
    """Token ids (b, s) -> logits (b, s, vocab). Blocks live in `self.layers` (a ModuleDict
    keyed "0".."L-1", torchtitan's convention) so a pipeline stage can delete the blocks it
    does not own and keep every parameter's name, and so checkpoints stay portable."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.hf_only_fields():
            raise UserError(f"tenfold's GPT does not build model.{', model.'.join(cfg.hf_only_fields())} "
                            "(shapes of Hugging Face families): train such a model with --hf-config")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.pos == "learned" else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = make_norm(cfg)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_emb.weight
            self.register_load_state_dict_pre_hook(_head_from_tied_embedding)
        if cfg.pos == "rope":
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual output projections scaled by
        1/sqrt(2L) (Radford et al. 2019), norms at 1, biases at 0."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
                continue
            s = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else std
            p.normal_(0.0, s, generator=generator)
        for name, buffer in self.named_buffers():
            if name.endswith("expert_bias"):  # the aux-loss-free router bias starts at 0
                buffer.zero_()
        if self.cfg.pos == "rope":  # buffers are recomputed, never loaded
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: where the tokens sit in their sequences, one 1-D tensor for every row
        (context parallelism hands each rank two chunks of every sequence); None: 0..s-1."""
        h = self.embed(input_ids, positions)
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None and cos is not None:
            cos, sin = cos[positions], sin[positions]
        for block in self.layers.values():
            h = block(h, cos, sin)
        return self.head(h)

    # Pieces a pipeline stage calls on its own (embedding on the first stage, head on the last).
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_emb(input_ids)
        if self.pos_emb is not None:
            # positions as a (1, s) batch, so that a sequence-parallel split of the lookup
            # (dim 1) cuts them where it cuts the tokens
            if positions is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            h = h + self.pos_emb(positions[None])
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))
