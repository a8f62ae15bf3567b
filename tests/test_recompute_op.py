"""Per-op selective recompute (`--ac op`, torchtitan's op SAC): a block keeps exactly the tensors
`tenfold.terms.op_saved_tensors` lists (what the planner counts), recomputes exactly every second
matmul, trains exactly as no recompute (one process; two gloo ranks under ZeRO-0, ZeRO-3, tensor
and pipeline parallelism), and its activation memory lies between `full` and `none`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy

from conftest import torchrun
from tenfold.models.gpt import GPT
from tenfold.models.presets import get_preset
from tenfold.techniques import recompute_ops
from tenfold.techniques.recompute import apply_recompute, describe
from tenfold.terms import op_saved_tensors

HERE = Path(__file__).parent
LLAMA = HERE / "data" / "llama-tiny" / "config.json"
SHAPE = dict(n_layers=3, d_model=64, n_heads=4, d_ff=96, max_seq_len=32)
GPT3_STYLE = dict(norm="layernorm", mlp="gelu", pos="learned", bias=True, tie_embeddings=True)
B, S = 2, 16

pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(get_preset("tiny").with_overrides(**{**SHAPE, **overrides}))


def token_batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- what a block keeps


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), else the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


class StorageLog(TorchDispatchMode):
    """Weak references to the storage of every tensor an op makes during a block's forward (of
    a DTensor, the storage of this rank's local tensor)."""

    def __init__(self):
        super().__init__()
        self.block: int | None = None
        self.made: list[tuple[int, StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.block is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    t = _local(t)
                    st = t.untyped_storage()
                    self.made.append((self.block, StorageWeakRef(st), st.nbytes(), t.element_size()))
        return out


def _storages(tree) -> set[int]:
    return {StorageWeakRef(_local(t).untyped_storage()).cdata for t in tree_flatten(tree)[0]
            if isinstance(t, torch.Tensor)}


def kept_per_block(model, blocks, forward) -> list[list[tuple[int, int]]]:
    """(elements, bytes per element) of each storage a block made in its forward and still holds
    once the whole forward is done: what it keeps for backward besides its input (parameters,
    buffers, block inputs and outputs left out). `forward()` runs the model and returns the loss,
    which stays alive while the storages are read."""
    log = StorageLog()
    skip = _storages(list(model.parameters()) + list(model.buffers()))
    hooks = []
    for i, block in enumerate(blocks):
        def pre(mod, args, kwargs, i=i):
            skip.update(_storages((args, kwargs)))
            log.block = i

        def post(mod, args, kwargs, out, i=i):
            skip.update(_storages(out))
            log.block = None

        hooks += [block.register_forward_pre_hook(pre, with_kwargs=True),
                  block.register_forward_hook(post, with_kwargs=True)]
    with log:
        loss = forward()
    for h in hooks:
        h.remove()
    kept: list[list[tuple[int, int]]] = [[] for _ in blocks]
    seen = set()
    for i, ref, nbytes, item in log.made:
        if ref.expired() or ref.cdata in skip or ref.cdata in seen:
            continue
        seen.add(ref.cdata)
        kept[i].append((nbytes // item, item))
    del loss
    return [sorted(k) for k in kept]


def documented(model_cfg, tokens: int, half: bool, tp: int = 1, sequence_parallel: bool = False) -> list[tuple[int, int]]:
    return sorted((int(t.per_token * tokens), 4 if t.fp32 or not half else 2)
                  for t in op_saved_tensors(model_cfg, tp, sequence_parallel))


def gpt_forward(model: GPT, half: bool, tp: int = 1):
    from tenfold.techniques.tensor_parallel import loss_context

    x = token_batch()

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):  # autocast's weight cache ends here
            logits = model(x[:, :-1])
        with loss_context(tp):  # vocabulary-split logits under tensor parallelism
            return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())

    return forward


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 2}, GPT3_STYLE], ids=["llama", "gqa", "gpt3"])
def test_each_block_keeps_exactly_the_documented_tensors(overrides, half):
    model = make_model(**overrides)
    apply_recompute(model, "op")
    blocks = list(model.layers.values())
    kept = kept_per_block(model, blocks, gpt_forward(model, half))
    want = documented(model.cfg, B * S, half)
    assert len(want) == (6 if model.cfg.mlp == "swiglu" else 5)
    assert kept == [want] * len(blocks)


def test_the_kept_tensor_check_sees_a_wrong_policy(monkeypatch):
    """The check above is not vacuous: a policy that saves nothing, everything, or every matmul
    (no every-second rule) keeps a different list."""
    want = documented(make_model().cfg, B * S, False)
    real = recompute_ops.op_policy
    matmuls, _ = recompute_ops._ops()

    def kept_with(factory) -> list[list[tuple[int, int]]]:
        monkeypatch.setattr(recompute_ops, "op_policy", factory)
        model = make_model()
        apply_recompute(model, "op")
        return kept_per_block(model, list(model.layers.values()), gpt_forward(model, False))

    def save_every_matmul():
        rest = real()
        return lambda ctx, func, *a, **k: CheckpointPolicy.MUST_SAVE if func in matmuls else rest(ctx, func, *a, **k)

    assert kept_with(real) == [want] * SHAPE["n_layers"]
    nothing = kept_with(lambda: lambda ctx, func, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
    everything = kept_with(lambda: lambda ctx, func, *a, **k: CheckpointPolicy.MUST_SAVE)
    every_matmul = kept_with(save_every_matmul)
    assert nothing[0] == [] and len(everything[0]) > len(want) and len(every_matmul[0]) == len(want) + 3


@pytest.fixture
def fake_tp_rank():
    """Rank 0 of a tensor-parallel group of 2 on torch's fake process group (collectives move
    nothing, every tensor has the shape the real rank's has): the tp mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_the_planner_list_matches_under_tensor_parallelism(fake_tp_rank, sequence_parallel, half):
    """Measured on one rank of tp 2 (tenfold's tensor-parallel plan, then op recompute, as the
    engine applies them): each block keeps this rank's shard of the column-split outputs (wq,
    wv, w1, attention output and logsumexp halved), the row-split w2's full-width partial sum,
    and with sequence parallelism the two reduce-scatter outputs: the planner's list for tp 2.
    Mutations: w2's output divided by tp, or the reduce-scatter outputs left out of
    tenfold.terms.op_saved_tensors -> the lists differ."""
    from tenfold.techniques.tensor_parallel import apply_tensor_parallel, gpt_plan

    model = make_model()
    apply_tensor_parallel(model, fake_tp_rank, gpt_plan(model, sequence_parallel))
    apply_recompute(model, "op")
    blocks = list(model.layers.values())
    kept = kept_per_block(model, blocks, gpt_forward(model, half, tp=2))
    want = documented(model.cfg, B * S, half, tp=2, sequence_parallel=sequence_parallel)
    assert kept == [want] * len(blocks)
    assert want != documented(model.cfg, B * S, half)  # tp 2 keeps another list than one process


def test_hugging_face_llama_block_keeps_the_same_list():
    """A Llama decoder layer runs its matmuls in tenfold's order (q, k, v, o, gate, up, down), so
    the planner's list for its shape (models/hf_config.py) is what op keeps there too."""
    pytest.importorskip("transformers")
    from tenfold.models.adapter import adapt
    from tenfold.models.hf import build_hf_model
    from tenfold.models.hf_config import model_from_hf_config

    torch.manual_seed(0)
    model = build_hf_model(hf_config=str(LLAMA))
    blocks = adapt(model, seq_len=S).blocks
    apply_recompute(model, "op", blocks=blocks)
    x = token_batch()
    kept = kept_per_block(model, blocks, lambda: model(input_ids=x[:, :-1], use_cache=False).logits.sum())
    assert kept == [documented(model_from_hf_config(str(LLAMA)), B * S, False)] * len(blocks)


# --------------------------------------------------------------------------- what it recomputes


class MatmulsInBackward(TorchDispatchMode):
    """Names of the Linears whose forward matmul kernel runs while the mode is on: an operand is
    the Linear's weight transposed (`x @ W.t()`; backward multiplies by W itself or by the
    input). A kept matmul's output comes from the checkpoint's cache, so no kernel runs."""

    def __init__(self, model):
        super().__init__()
        self.ran: list[str] = []
        self.weights = {m.weight.data_ptr(): (name, m.weight.t().stride())
                        for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in recompute_ops._ops()[0]:
            for a in args:
                name, stride = self.weights.get(a.data_ptr(), (None, None)) if isinstance(a, torch.Tensor) else (None, None)
                if name is not None and a.stride() == stride:
                    self.ran.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overrides", [{}, GPT3_STYLE], ids=["llama", "gpt3"])
def test_recomputes_exactly_every_second_matmul(overrides):
    """Backward reruns the 2nd, 4th and 6th matmul of each block (wk, wo, and a SwiGLU MLP's w3),
    never a kept one. A GELU MLP's 6th matmul is its last op, w2: torch's default early stop (as
    in training) ends the recompute once backward has what it needs, before w2's output."""
    x = token_batch()
    model = make_model(**overrides)
    apply_recompute(model, "op")
    loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    with MatmulsInBackward(model) as seen:
        loss.backward()
    rerun = ("attn.wk", "attn.wo", "mlp.w3") if model.cfg.mlp == "swiglu" else ("attn.wk", "attn.wo")
    want = [f"layers.{i}.{m}" for i in reversed(range(SHAPE["n_layers"])) for m in rerun]
    assert seen.ran == want


# --------------------------------------------------------------------------- equivalence, one process


def train_steps(model, steps: int, half: bool) -> tuple[list[float], list[dict]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for _ in range(steps):
        loss = gpt_forward(model, half)()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("overrides", [{}, GPT3_STYLE], ids=["llama", "gpt3"])
def test_same_loss_and_gradients_as_no_recompute(overrides, half):
    ref_losses, ref_grads = train_steps(make_model(**overrides), 3, half)
    model = make_model(**overrides)
    apply_recompute(model, "op")
    assert set(describe(model)) == {f"layers.{i}" for i in range(SHAPE["n_layers"])}
    losses, grads = train_steps(model, 3, half)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for step, ref in zip(grads, ref_grads):
        for name, g in ref.items():
            assert (step[name] - g).abs().max() <= 1e-6 * g.abs().max(), name


# --------------------------------------------------------------------------- memory


def measured_activations(policy: str, dtype: str, preset: str = "tiny", b: int = 4, s: int = 128) -> int:
    from memory_runs import measure

    return measure(preset, policy, b, s, dtype=dtype)["activations_bytes"]


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_activation_memory_between_full_and_none(dtype):
    """The engine's tracker on `tiny` (4 x 128 tokens): full < op < none, and op keeps at least
    the documented tensors of every block beyond what full keeps."""
    got = {p: measured_activations(p, dtype) for p in ("none", "op", "full")}
    assert got["full"] < got["op"] < got["none"], got
    cfg = get_preset("tiny")
    per_token = sum(t.per_token * (4 if t.fp32 or dtype == "fp32" else 2) for t in op_saved_tensors(cfg))
    assert got["op"] - got["full"] >= (cfg.n_layers - 1) * 4 * 128 * per_token, got


# --------------------------------------------------------------------------- two ranks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    return torchrun("op", tmp_path_factory.mktemp("op"), timeout=900, worker="recompute_worker.py")


LAYOUTS = ["zero0-fp32", "zero3-fp32", "zero3-bf16", "tp2-fp32", "tp2-sp-fp32", "pp2-fp32"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_op_equals_no_recompute_with_memory_between(two_ranks, layout):
    """2 gloo ranks, 3 steps of micro 4 x accum 2: op's loss and every gradient (whole, gathered
    from shards) within 1e-6 of none's at every step, on each rank; activation memory measured
    by the engine's tracker at step 2 strictly between full and none."""
    for rank in ("0", "1"):
        r = two_ranks[rank][layout]
        assert r["recomputed_modules"] == (1 if layout.startswith("pp2") else 2)  # every block of the rank
        assert r["grad_count"] > 0 and r["losses"][-1] < r["losses"][0]
        assert r["loss_rel"] <= 1e-6 and r["grad_rel"] <= 1e-6, r
        mem = r["activations_bytes"]
        assert mem["full"] < mem["op"] < mem["none"], mem
