"""Rank-side half of the tensor-parallel tests: run by `python -m torch.distributed.run` from
tests/test_tensor_parallel.py, never by pytest itself (no test functions).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/tp_worker.py MODE OUT.json

MODE tp2 (2 ranks, tp 2, dp 1): many cases, one launch (process start dominates on CPU).
MODE tp2dp2 (4 ranks): tp 2 x dp 2 at every ZeRO stage, and tp 2 x pp 2.
Every case runs the Trainer on the same learnable token rows as tests/test_zero.py;
rank 0 writes one JSON file with what every rank saw.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from zero_worker import config, run_steps, token_array  # noqa: E402

LLAMA = os.path.join(os.path.dirname(__file__), "..", "data", "llama-tiny", "config.json")


def tied_llama() -> str:
    """llama-tiny with tied input and output embeddings (as Qwen2's small models ship)."""
    with open(LLAMA) as f:
        config = {**json.load(f), "tie_word_embeddings": True}
    path = os.path.join(tempfile.gettempdir(), f"llama-tiny-tied-{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


# Every architectural branch of tenfold's GPT that TP touches: GPT-3 style blocks (LayerNorm
# with biases, GELU, learned positions, tied embeddings) besides the default Llama style.
GPT3_STYLE = {"norm": "layernorm", "mlp": "gelu", "pos": "learned", "bias": True, "tie_embeddings": True}


def tp_config(dtype: str = "fp32", micro: int = 2, accum: int = 2, zero: int = 0, sp: bool | None = None,
              model: dict | None = None, tp: int = 2, **sections) -> dict:
    cfg = config(zero, dtype, micro, accum, OUT, tp_degree=tp, sequence_parallel=sp)
    cfg["data"]["val_fraction"] = 0.125  # 8 of the 64 rows: the validation loss goes through TP too
    cfg["train"]["eval_batches"] = 8  # every validation row, whatever the micro-batch
    if model and "hf_config" in model:
        cfg["model"] = dict(model)  # the config.json is the whole shape
    else:
        cfg["model"].update(model or {})
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def reference_config(cfg: dict, world: int) -> dict:
    """The same run on one process: no tp, the dp ranks' micro-batches folded into one."""
    ref = copy.deepcopy(cfg)
    par = cfg["parallel"]
    dp = world // (par.get("pp_degree", 1) * par["tp_degree"])
    ref["parallel"] = {"zero_stage": 0}
    ref["train"]["micro_batch"] = cfg["train"]["micro_batch"] * dp
    return ref


class UserLM(nn.Module):
    """A user's own module (not tenfold's GPT, not Hugging Face) with its own TP plan."""

    def __init__(self, vocab: int = 256, d: int = 32, hidden: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(h + self.down(torch.nn.functional.gelu(self.up(h))))


def user_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def user_model() -> UserLM:
    torch.manual_seed(3)
    return UserLM()


def run_user(cfg: dict, plan: dict | None) -> dict:
    from tenfold.engine.loop.trainer import Trainer

    t = Trainer(cfg, model=user_model(), dataset=token_array(), tp_plan=plan)
    t.setup()
    return {"losses": [t.train_step(t.loader.next_step()).loss for _ in range(3)]}


def comm_bytes(cfg: dict) -> dict:
    """Bytes on the tp group in step 2, measured (engine/observe/comm_bytes.py)."""
    from tenfold.engine.observe.comm_bytes import CollectiveBytes
    from tenfold.engine.loop.trainer import Trainer

    t = Trainer(cfg, dataset=token_array())
    t.setup()
    t.train_step(t.loader.next_step())
    batches = t.loader.next_step()
    with CollectiveBytes() as c:
        t.train_step(batches)
    group = t.dist.mesh["tp"].get_group().group_name
    return {"ring_bytes": c.ring_bytes(group), "by_kind": c.by_kind(group)}


def tp_rng_draws() -> list[float]:
    """What torch's random stream gives after setup (dropout inside a TP region draws here)."""
    from tenfold.engine.loop.trainer import Trainer

    t = Trainer(tp_config(), dataset=token_array())
    t.setup()
    return torch.rand(3).tolist()


def fp16_overflow() -> list[dict]:
    """fp16 under tp 2: rank 1 alone gets an inf in its gradient shard at step 2."""
    from tenfold.engine.loop.trainer import Trainer

    t = Trainer(tp_config("fp16", 1, 2), dataset=token_array())
    t.setup()
    rows = []
    for i in range(3):
        loss, tokens = t.accumulate_gradients(t.loader.next_step())
        if i == 1 and t.dist.rank == 1:
            p = t.model.layers["0"].attn.wq.weight
            p.grad.to_local().view(-1)[0] = float("inf")
        before = [p.to_local().clone() for p in t.model.parameters()]
        r = t.apply_gradients(loss, tokens)
        changed = any(not torch.equal(a, p.to_local()) for a, p in zip(before, t.model.parameters()))
        rows.append({"skipped": r.skipped, "scale": t.scaler.scale, "weights_changed": changed})
    return rows


def run_case(cfg: dict, measure_at: int | None = None) -> dict:
    """3 steps (losses, gradient norms, model-state bytes, memory of step `measure_at`), then
    the validation loss."""
    t, result = run_steps(cfg, measure_at=measure_at, steps=3)
    return {**result, "val_loss": t.evaluate()}


def mode_tp2() -> dict:
    out: dict = {}
    for name, cfg in TP2_CASES.items():
        out[name] = run_case(cfg, measure_at=1 if name == "gqa-sp" else None)
    for name, cfg in COMM_CASES.items():
        out[f"comm-{name}"] = comm_bytes(cfg)
    out["user"] = run_user(tp_config(), user_plan())
    out["rng"] = tp_rng_draws()
    out["fp16_overflow"] = fp16_overflow()
    return out


def mode_tp2dp2() -> dict:
    return {name: run_case(cfg, measure_at=1 if name.startswith("zero") else None)
            for name, cfg in TP2DP2_CASES.items()}


OUT = tempfile.gettempdir()  # log.out: setup and train_step write nothing there
GQA = {"n_kv_heads": 2}
TP2_CASES = {
    "gqa-sp": tp_config(model=GQA),  # RoPE + grouped-query heads split, sequence parallel
    "no-sp": tp_config(sp=False),
    "bf16-sp": tp_config("bf16"),
    "gpt3-style": tp_config(model=GPT3_STYLE),
    "recompute": tp_config(recompute={"policy": "full"}),
    "hf-llama": tp_config(model={"hf_config": LLAMA}),
    "hf-llama-tied": tp_config(model={"hf_config": tied_llama()}),
}
COMM_CASES = {
    "gqa-sp": tp_config(model=GQA),
    "no-sp-bf16": tp_config("bf16", sp=False),
    "recompute-every2": tp_config(recompute={"policy": "every:2"}),
    "gpt3-style": tp_config(model=GPT3_STYLE),
}
TP2DP2_CASES = {
    **{f"zero{z}": tp_config(micro=1, zero=z) for z in (0, 1, 2, 3)},
    "pp2": tp_config(parallel={"pp_degree": 2}),
}


def main() -> None:
    mode, out_path = sys.argv[1], sys.argv[2]
    result = {"tp2": mode_tp2, "tp2dp2": mode_tp2dp2}[mode]()
    from tenfold.engine.parallel.distributed import gather_to_main, init_distributed, shutdown

    info = init_distributed()
    per_rank = gather_to_main(result, info)
    if info.is_main:
        with open(out_path, "w") as f:
            json.dump({str(r): v for r, v in enumerate(per_rank)}, f)
    shutdown()


if __name__ == "__main__":
    main()
