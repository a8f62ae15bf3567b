"""The model's hand-written pieces against their textbook forms (tenfold/models/gpt.py).

RoPE and RMSNorm were rewritten for speed (one kernel / one copy where there were several);
these tests hold them to the plain formulas they replaced."""

import torch

from tenfold.models.gpt import LayerNorm, RMSNorm, apply_rope, rope_tables


def pairwise_rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Su et al. 2021, Eq. (34): pair i of position m turns by m * theta^(-2i/d)."""
    hd, s = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(s, dtype=torch.float64), inv_freq)
    cos, sin = ang.cos().float(), ang.sin().float()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def test_rope_equals_the_pairwise_formula_bit_for_bit_in_fp32():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 40, 16)
    cos, sin = rope_tables(16, 64, 10000.0)
    assert torch.equal(apply_rope(x, cos, sin), pairwise_rope(x))


def test_rope_gradient_equals_the_pairwise_formula():
    torch.manual_seed(1)
    x = torch.randn(2, 2, 12, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 2, 12, 8, dtype=torch.float64)
    cos, sin = rope_tables(8, 12, 10000.0)
    (ours,) = torch.autograd.grad(apply_rope(x, cos.double(), sin.double()), x, g)
    ref_x = x.detach().clone().requires_grad_()
    hd, s = 8, 12
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    x1, x2 = ref_x[..., 0::2], ref_x[..., 1::2]
    ref = torch.stack((x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()), -1).flatten(-2)
    (theirs,) = torch.autograd.grad(ref, ref_x, g)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)  # tables are fp32-rounded


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(2)
    q, k = torch.randn(16), torch.randn(16)
    cos, sin = rope_tables(16, 32, 10000.0)
    at = lambda v, pos: apply_rope(v.expand(1, 1, 32, 16).contiguous(), cos, sin)[0, 0, pos]  # noqa: E731
    assert torch.allclose(at(q, 5) @ at(k, 2), at(q, 20) @ at(k, 17), atol=1e-4)
    assert not torch.allclose(at(q, 5) @ at(k, 2), at(q, 5) @ at(k, 4), atol=1e-4)


def test_rmsnorm_equals_the_formula_in_fp32_and_keeps_bf16():
    torch.manual_seed(3)
    norm = RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32) + 0.5)
    x = torch.randn(4, 7, 32) * 3
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert torch.allclose(norm(x), ref, rtol=1e-6, atol=1e-6)
    xb = x.bfloat16()
    yb = norm(xb)
    assert yb.dtype == torch.bfloat16  # computed in fp32, returned in the input's dtype
    assert torch.allclose(yb.float(), ref, rtol=1e-2, atol=1e-2)
    # gradients (input and weight) equal the formula's
    x.requires_grad_()
    g = torch.randn_like(x)
    ours = torch.autograd.grad(norm(x), (x, norm.weight), g)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    theirs = torch.autograd.grad(ref, (x, norm.weight), g)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_rmsnorm_under_autocast_feeds_its_linears_the_same_16bit_values():
    """The norm's own 16-bit cast (one copy for wq/wk/wv) against autocast casting its fp32
    output per Linear, as before: identical forward, gradients equal to bf16 rounding."""
    from tenfold.models.gpt import Block
    from tenfold.models.presets import get_preset

    cfg = get_preset("tiny").with_overrides(n_layers=1, d_model=64, n_heads=4, d_ff=128, max_seq_len=32)
    torch.manual_seed(4)
    block = Block(cfg)
    cos, sin = rope_tables(cfg.head_dim, 32, cfg.rope_theta)
    x = torch.randn(2, 32, 64)

    def run(per_linear_casts: bool):
        if per_linear_casts:  # the norm returns fp32, autocast casts it at each Linear
            for norm in (block.norm1, block.norm2):
                norm.forward = lambda t, n=norm: torch.nn.functional.rms_norm(t.float(), (t.shape[-1],), n.weight.float(), n.eps)
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = block(xi, cos, sin)
        y.float().pow(2).mean().backward()
        grads = [xi.grad] + [p.grad.clone() for p in block.parameters()]
        block.zero_grad(set_to_none=True)
        for norm in (block.norm1, block.norm2):
            norm.__dict__.pop("forward", None)
        return y.detach(), grads

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert block.norm1(x).dtype == torch.bfloat16
    y_ours, g_ours = run(False)
    y_ref, g_ref = run(True)
    assert torch.equal(y_ours, y_ref)
    for a, b in zip(g_ours, g_ref):  # the 3 (2) branch gradients now add in bf16: ~bf16 eps apart
        assert (a - b).norm() <= 4e-3 * b.norm(), ((a - b).norm() / b.norm()).item()


def test_layernorm_computes_in_fp32_and_casts_its_output_once():
    """tenfold's LayerNorm equals nn.LayerNorm in fp32 (values and gradients, bit for bit), and
    under autocast with a 16-bit input it normalises the fp32 copy of its input (what it keeps
    for backward: the fp32 input and fp32 statistics) and returns one 16-bit output."""
    torch.manual_seed(5)
    ref = torch.nn.LayerNorm(32)
    ours = LayerNorm(32)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(32) + 0.5)
        ref.bias.copy_(torch.randn(32))
    ours.load_state_dict(ref.state_dict())
    x = (torch.randn(4, 7, 32) * 3).requires_grad_()
    g = torch.randn(4, 7, 32)
    assert torch.equal(ours(x), ref(x))
    for a, b in zip(torch.autograd.grad(ours(x), (x, ours.weight, ours.bias), g),
                    torch.autograd.grad(ref(x), (x, ref.weight, ref.bias), g)):
        assert torch.equal(a, b)

    xb = x.detach().bfloat16().requires_grad_()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        yb = ours(xb)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, ref(xb.detach().float()).bfloat16())
    assert {t.dtype for t in kept if t.dim() == 3} == {torch.float32}  # the fp32 input, mean and 1/std
    assert any(t.shape == xb.shape for t in kept)


def test_param_count_equals_the_built_model_for_every_block_kind():
    """The planner's `param_count` (pure Python) against the parameters GPT really allocates
    (tied weights counted once), over the switches that change the count."""
    from tenfold.models.gpt import GPT
    from tenfold.models.presets import ModelConfig, param_count

    base = dict(n_layers=2, d_model=32, n_heads=4, vocab_size=64, max_seq_len=16, d_ff=48)
    variants = [{}, {"bias": True}, {"tie_embeddings": True}, {"n_kv_heads": 2}, {"mlp": "gelu", "norm": "layernorm", "pos": "learned"},
                {"mlp": "gelu", "norm": "layernorm", "pos": "learned", "bias": True, "tie_embeddings": True}]
    for extra in variants:
        cfg = ModelConfig(**base, **extra)
        model = GPT(cfg)
        assert param_count(cfg) == sum(p.numel() for p in model.parameters()), extra
