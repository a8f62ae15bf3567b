"""Pipeline runs for the tests: the plain single-process reference loop, and the same training
through tenfold's composition point (engine.parallelize) on gloo ranks started with
torch.multiprocessing, with their loss curves, gradient norms, eval sums and first-step
gradients to compare. Imported by the pipeline tests with `from pipeline_harness import ...`."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import torch
import torch.nn.functional as F

from tenfold.engine.parallel.distributed import shutdown
from tenfold.models.gpt import GPT
from tenfold.models.presets import get_preset
from tenfold.techniques import pipeline_runner
from tenfold.terms import IGNORE_INDEX

# A narrow `tiny` (same 4 layers, byte vocabulary) so the multi-process runs take seconds.
CFG = get_preset("tiny").with_overrides(d_model=64, n_heads=4, d_ff=128, max_seq_len=16)
SEQ, ROWS, STEPS, SEED, LR = 16, 8, 3, 7, 1e-2  # ROWS: sequences per global batch


def batch_for_step(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: ROWS x SEQ ids and targets, some targets ignored (-100)
    so micro-batches carry different token counts and a wrong normalisation shows."""
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, CFG.vocab_size, (ROWS, SEQ + 1), generator=g)
    ids, tgt = seq[:, :-1].clone(), seq[:, 1:].clone()
    n_pad = torch.randint(0, SEQ // 2, (ROWS,), generator=g)
    for r in range(ROWS):
        if n_pad[r]:
            tgt[r, -int(n_pad[r]):] = IGNORE_INDEX
    return ids, tgt


def reference_run(dtype: torch.dtype = torch.float32, steps: int = STEPS, hf: str | None = None,
                  tie: bool = False, layers: int | None = None) -> dict:
    """The plain single-process loop: micro-batches of 2 rows, token-weighted loss,
    global-norm clipping at 1.0, AdamW; tenfold's GPT (`tie`: with tied embeddings; `layers`
    blocks instead of CFG's), or the Hugging Face model of the config.json `hf`. One thread:
    these shapes gain nothing from more, and on a busy 2-core machine two threads made it 25x
    slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(dtype, steps, hf, tie, layers)
    finally:
        torch.set_num_threads(threads)


def new_model(hf: str | None = None, tie: bool = False, layers: int | None = None) -> torch.nn.Module:
    """The seeded model a case trains: tenfold's GPT (`tie`: tied embeddings; `layers` blocks), or
    a Hugging Face one from a config.json."""
    torch.manual_seed(SEED)
    if hf is None:
        return GPT(CFG.with_overrides(tie_embeddings=tie, n_layers=layers or CFG.n_layers))
    from tenfold.models.hf import build_hf_model

    return build_hf_model(hf_config=hf)


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, GPT):
        return model(ids)
    return model(input_ids=ids, use_cache=False).logits


def _reference_run(dtype: torch.dtype, steps: int, hf: str | None, tie: bool, layers: int | None) -> dict:
    from tenfold.techniques.optimizer import build_optimizer, clip_grad_norm

    model = new_model(hf, tie, layers)
    opt = build_optimizer(model, run_config({"pp": 1, "schedule": "1f1b", "m": 4}, 1).train, torch.device("cpu"))
    losses, norms, grads = [], [], {}
    for step in range(steps):
        ids, tgt = batch_for_step(step)
        tokens = int((tgt != IGNORE_INDEX).sum())
        total = 0.0
        for i in range(0, ROWS, 2):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                logits = logits_of(model, ids[i:i + 2])
            ce = F.cross_entropy(logits.float().flatten(0, 1), tgt[i:i + 2].flatten(), reduction="sum")
            (ce / tokens).backward()
            total += float(ce.detach())
        if step == 0:  # a tied weight under both its names, as the pipeline stages hold it
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        norms.append(clip_grad_norm(list(model.parameters()), 1.0))
        opt.step()
        opt.zero_grad()
        losses.append(total / tokens)
    ids, tgt = batch_for_step(99)
    with torch.no_grad():
        logits = logits_of(model, ids)
    eval_sum = float(F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), reduction="sum"))
    return {"loss": losses, "grad_norm": norms, "eval_sum": eval_sum, "grads": grads}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cases: list[dict], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from tenfold.engine.parallel.distributed import init_distributed

    results = []
    try:
        for case in cases:
            results.append(run_case(init_distributed(case["pp"], tp_size=case.get("tp", 1)), case, out))
    except Exception as e:  # surface the rank's error in the parent's assertion
        results.append({"error": f"rank {rank}: {type(e).__name__}: {e}"})
        raise
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        shutdown()  # barrier, then destroy: an early destroy can abort the peer (gloo)


def run_case(d, case: dict, out: str | None = None) -> dict:
    """One training run through the pipeline, wrapped by the trainer's own composition point
    (engine.parallelize: split -> tp -> recompute -> ZeRO on the dp axis -> stages + schedule).
    The first step's gradients go to OUT/grads-case{i}-rank{r}.pt (full tensors by FQN, from the
    first dp and tp rank of each stage)."""
    from tenfold.engine.parallel.parallelize import parallelize
    from tenfold.run import resolve_run
    from tenfold.techniques import zero
    from tenfold.techniques.precision import LossScaler, build_precision

    cfg = run_config(case, d.dp_size)
    run = resolve_run(cfg, d.world_size)
    compute_dtype = build_precision(run.precision, cfg.precision, d.device).compute_dtype
    kind = "hf" if case.get("hf") else "tenfold"
    model = new_model(case.get("hf"), case.get("tie", False), case.get("layers"))
    pm = parallelize(model, run, d, param_dtype=compute_dtype, kind=kind)
    opt = zero.build_optimizer_for(pm, cfg.train, cfg.parallel, d)
    dp_group = d.mesh["dp"].get_group()
    rows = ROWS // d.dp_size
    losses, norms, bubbles = [], [], []
    for step in range(STEPS):
        ids, tgt = batch_for_step(step)
        mine = slice(d.dp_rank * rows, (d.dp_rank + 1) * rows)
        mb = rows // case["m"]
        micro = [{"input_ids": ids[mine][i:i + mb], "labels": tgt[mine][i:i + mb]} for i in range(0, rows, mb)]
        scale = case.get("loss_scale", 1.0)  # fp16's loss scale: applied in the stage loss
        res = pm.train_step(micro, loss_scale=scale, dp_group=dp_group)
        LossScaler(scale).unscale_grads_(list(pm.parameters()))
        if d.tp_size > 1:
            from tenfold.techniques.tensor_parallel import settle_gradients

            settle_gradients(list(pm.parameters()))
        if step == 0 and out is not None:
            save_full_grads(pm, d, Path(out, f"grads-{case_id(case)}-rank{d.rank}.pt"))
        norms.append(zero.clip_grad_norm(pm, 1.0, extra_groups=(d.mesh["pp"].get_group(),)))  # the engine's clip
        opt.step()
        opt.zero_grad()
        losses.append(res.loss)
        bubbles.append(res.bubble)
    ids, tgt = batch_for_step(99)
    eval_sum = pm.eval_loss_sum([{"input_ids": ids, "labels": tgt}])
    names = pipeline_runner.gather_per_rank(sorted(n for n, _ in pm.named_parameters()))
    return {"loss": losses, "grad_norm": norms, "eval_sum": eval_sum, "bubble": bubbles,
            "names": sorted(set(sum(names, []))), "report": pm.report(d), "tied_copies_differ_by": tied_gap(pm)}


def tied_gap(pm) -> float | None:
    """Largest difference between the tied embedding's two copies (the first stage's embedding,
    the last stage's head) after training, on the ranks holding them; None elsewhere. Collective
    over each embedding group."""
    tied = getattr(pm, "tied", None)
    if tied is None or not tied.local:
        return None
    import torch.distributed as dist

    w = pm.get_parameter(tied.local[0]).detach()
    w = (w.full_tensor() if hasattr(w, "full_tensor") else w).clone()
    peer = [torch.empty_like(w) for _ in range(2)]
    dist.all_gather(peer, w, group=tied.group)
    return float((peer[0] - peer[1]).abs().max())


def case_id(case: dict) -> str:
    """A file-name-safe name of a case (no glob characters)."""
    text = "-".join(f"{k}{v}" for k, v in sorted(case.items()) if k != "hf")
    hf = f"-{Path(case['hf']).parent.name}-{Path(case['hf']).stem}" if case.get("hf") else ""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text + hf)


def save_full_grads(model: torch.nn.Module, d, path: Path) -> None:
    """Every gradient of this rank's stages as a full tensor (collective over dp and tp:
    every rank calls it); the first dp and tp rank of each stage writes them."""
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    if d.dp_rank == 0 and d.tp_rank == 0:
        torch.save(grads, path)


def load_full_grads(out: Path, case: dict) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob(f"grads-{case_id(case)}-rank*.pt")):
        part = torch.load(f)
        assert not set(part) & set(grads), f"a parameter's gradient on two stages: {set(part) & set(grads)}"
        grads.update(part)
    return grads


def assert_same_grads(got: dict, want: dict, rtol: float, atol: float, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}: {m}")


def run_config(case: dict, dp_size: int):
    from tenfold.config import build_config

    model = {"hf_config": case["hf"]} if case.get("hf") else {
        "name": "tiny", "d_model": 64, "n_heads": 4, "d_ff": 128, "max_seq_len": SEQ,
        "tie_embeddings": case.get("tie", False), "n_layers": case.get("layers", CFG.n_layers)}
    return build_config({
        "model": model,
        "data": {"seq_len": SEQ},
        "train": {"micro_batch": ROWS // dp_size // case["m"], "grad_accum": case["m"], "lr": LR},
        "precision": {"dtype": case.get("dtype", "fp32")},
        "recompute": {"policy": case.get("ac", "none")},
        "parallel": {"pp_degree": case["pp"], "pp_schedule": case["schedule"], "zero_stage": case.get("zero", 0),
                     "virtual_stages": case.get("v", 1), "pp_split": case.get("split"),
                     "tp_degree": case.get("tp", 1)},
    })


def launch(world: int, cases: list[dict], tmp_path) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, _free_port(), cases, str(tmp_path)), nprocs=world, join=True)
    return json.loads(Path(tmp_path, "rank0.json").read_text())


def assert_close_curve(got: list[float], want: list[float], rel: float, what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(g, w, rel_tol=rel), f"{what} step {step}: {g} vs {w} (rel {abs(g - w) / abs(w):.2e})"


# Tied embeddings: the first step's global gradient norm within 1e-6 of one process (it counts the
# tied weight once; counted twice it is 22% higher on the tiny GPT, docs/pipeline.md). Later steps' norms
# within 1e-4: the two copies' gradients are summed in another order than one process sums the one
# Parameter's, and AdamW's first updates are about lr x sign(g) whatever |g|, so an element where
# the embedding's and the head's contributions nearly cancel can step the other way (measured:
# 1.6e-5 at step 2 on llama pp 2 x tp 2, every gradient 5e-5 apart, the loss still 2e-8 apart).
TIED_FIRST_NORM_RTOL, TIED_LATER_NORM_RTOL = 1e-6, 1e-4


def assert_tied_norms(got: list[float], want: list[float], what: str) -> None:
    assert_close_curve(got[:1], want[:1], TIED_FIRST_NORM_RTOL, f"{what} first grad norm")
    assert_close_curve(got[1:], want[1:], TIED_LATER_NORM_RTOL, f"{what} grad norm")


# FSDP2's bf16 parameters (norm weights and embedding too) against autocast's fp32 ones: the loss
# curve within 1e-3 (measured 2e-4), the gradients only ~1.5% alike, so not compared. Stages
# that sent bf16 bytes into fp32 p2p buffers were off by 2e-3 at the first step (NaN on
# Hugging Face Llama).
FSDP_BF16_RTOL = 1e-3


def assert_matches_fsdp_bf16(res: dict, bf16_reference: dict, what: str) -> None:
    assert_close_curve(res["loss"], bf16_reference["loss"], FSDP_BF16_RTOL, f"{what} loss")
    assert math.isclose(res["eval_sum"], bf16_reference["eval_sum"], rel_tol=FSDP_BF16_RTOL), what
