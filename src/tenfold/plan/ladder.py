"""`--ladder`: the recipe's "30 days -> 3 days" path, rung by rung, as the planner sees it, beside
the recipe's own claimed figures, with a note wherever they disagree and why.

The recipe's scenario: GPT-3 175B, A100 80GB; baseline one GPU in fp32 at batch 1;
then fp16 mixed precision (claimed /2), gradient accumulation x8 (/1.5), activation
checkpointing every 12 layers (x1.3), 8 GPUs with ZeRO-3 (/6), pipeline parallelism with 8
stages (/1.2): 30 -> 15 -> 10 -> 13 -> 2.2 -> 1.8 days, "about 3 days in practice". Its final
configuration (64 GPUs, fp16, effective batch 4096, a checkpoint every 24 layers, ZeRO-3,
8 pipeline stages) claims 5.5 + 5.5 + 22 + ~30 = ~63 GB per GPU. The recipe never says how many
tokens its days are for; the planner uses 300B (GPT-3's budget) and compares multipliers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tenfold.plan.api import Plan, predict
from tenfold.plan.hardware import get_hardware
from tenfold.plan.shape import shape_of
from tenfold.run import ResolvedRun, Stack, resolve

GiB = 2**30


@dataclass(frozen=True)
class SeedClaim:
    days: float | None
    factor: str  # the recipe's multiplier for this rung, as printed
    factor_value: float | None  # time multiplier vs the previous rung (days_new / days_old)
    memory_gb: float | None  # the recipe's per-GPU (or single-GPU total) memory claim, GB
    memory_text: str


SEED_CLAIMS = [
    SeedClaim(30, "baseline", 1.0, 3000, "~3000 GB (700 params + 700 grads + 1400 Adam + ~200 activations)"),
    SeedClaim(15, "/2", 0.5, 2200, "~2200 GB, 'saves about 25%' (350 + 350 + 1400 + ~100)"),
    SeedClaim(10, "/1.5", 1 / 1.5, None, "'does not increase memory'"),
    SeedClaim(13, "x1.3", 1.3, None, "activations ~100 GB -> ~8 GB (checkpoint every 12 layers)"),
    SeedClaim(2.2, "/6", 1 / 6, None, "'N-fold saving' from ZeRO-3"),
    SeedClaim(1.8, "/1.2", 1 / 1.2, None, "(none)"),
    SeedClaim(3, "'about 3 days'", None, 63, "~63 GB/GPU: 5.5 params + 5.5 grads + 22 optimizer + ~30 activations"),
]


@dataclass
class Rung:
    name: str
    run: ResolvedRun
    plan: Plan | None = None
    factor: float | None = None  # planner's time multiplier vs previous rung (step time per token)
    seed: SeedClaim | None = None
    notes: list[str] = field(default_factory=list)


    @property
    def gpus(self) -> int:
        return self.run.world_size


def seed_rungs(model, gpus_node: int = 8, gpus_final: int = 64, pp: int = 8, seq_len: int = 2048,
               half: str = "fp16", device: str = "GPU") -> list[Rung]:
    """The recipe's rungs for `model` (a ModelConfig, or a parameter count): its 'checkpoint
    every 12 layers' of 96 is checkpoint_sequential with L/12 segments (8 for GPT-3), its
    'every 24' L/24 (4)."""
    shape = shape_of(model)
    n_layers = shape.cfg.n_layers if shape.cfg else 96
    seg_a = max(2, min(n_layers, round(n_layers / 12)))
    seg_b = max(2, min(n_layers, round(n_layers / 24)))
    # The recipe trains GPT-3 with DeepSpeed (16-bit params + fp32 master weights, Megatron-style
    # fused kernels, 16-bit activations).
    stack = Stack(master_weights=True, activation_style="megatron")

    def run(gpus: int, **choices) -> ResolvedRun:
        return resolve(shape.cfg, gpus, params=shape.params, seq_len=seq_len, stack=stack, check=False, **choices)

    base = dict(precision="fp32", micro_batch=1, grad_accum=1)
    mp = {**base, "precision": half}
    acc = {**mp, "grad_accum": 8}
    ckpt = {**acc, "recompute": f"segments:{seg_a}"}
    zero3 = {**ckpt, "zero_stage": 3}
    pipe = {**zero3, "pp": pp}
    # the recipe's final configuration: effective batch 4096, a checkpoint every 24 layers
    final = {**pipe, "recompute": f"segments:{seg_b}", "grad_accum": None, "global_batch": 4096}
    plural = "s" if gpus_node > 1 else ""
    return [
        Rung(f"1 {device}, fp32, batch 1", run(1, **base)),
        Rung(f"+ {half} mixed precision", run(1, **mp)),
        Rung("+ grad accumulation x8", run(1, **acc)),
        Rung(f"+ checkpoint every {n_layers // seg_a} layers", run(1, **ckpt)),
        Rung(f"+ {gpus_node} {device}{plural}, ZeRO-3", run(gpus_node, **zero3)),
        Rung(f"+ pipeline {pp} stages", run(gpus_final, **pipe)),
        Rung(f"final: batch 4096, ckpt/{n_layers // seg_b}", run(gpus_final, **final)),
    ]


def run_ladder(model="gpt3-175b", hardware="a100-80gb", gpus_node: int = 8, gpus_final: int = 64, pp: int = 8,
               tokens: float = 300e9, seq_len: int | None = None, with_seed: bool | None = None) -> list[Rung]:
    shape = shape_of(model)
    hw = get_hardware(hardware)
    seq = seq_len or (shape.cfg.max_seq_len if shape.cfg else 2048)
    if with_seed is None:
        with_seed = (shape.name == "gpt3-175b" and hw.name == "a100-80gb" and gpus_final == 64
                     and gpus_node == 8 and pp == 8)
    # The recipe says fp16; elsewhere use bf16 where the hardware runs it at least as fast.
    half = "fp16" if with_seed or (hw.peak_flops.get("bf16") or 0) < (hw.peak_flops.get("fp16") or 0) else "bf16"
    rungs = seed_rungs(shape, gpus_node, gpus_final, pp, seq, half, "rank" if hw.shared_compute else "GPU")
    prev = None
    for i, rung in enumerate(rungs):
        rung.plan = predict(rung.run, hw, name=shape.name, tokens=tokens)
        if prev is not None and i < len(rungs) - 1:
            rung.factor = (rung.plan.train_days or 0) / (prev.plan.train_days or 1)
        if with_seed:
            rung.seed = SEED_CLAIMS[i]
            rung.notes = _notes(i, rung, prev)
        prev = rung
    return rungs


def _gib(x: float) -> str:
    return f"{x / GiB:,.0f} GiB"


def _notes(i: int, rung: Rung, prev: Rung | None) -> list[str]:
    """Why the planner and the recipe disagree (only where they do)."""
    p = rung.plan
    m = p.memory
    out: list[str] = []
    if i == 0:
        out.append(f"absolute time: the recipe's 30 days cannot be 300B tokens on one A100 in fp32: "
                   f"the planner gives {p.train_days:,.0f} days (Narayanan et al.: GPT-3 on one V100 ~288 years)")
        out.append(f"memory {_gib(m.total_bytes)} vs the recipe's ~3000 GB: agrees (16 B/param x 175B = 2.8 TB of model states)")
    elif i == 1:
        out.append(f"speed: x{prev.plan.train_days / p.train_days:.1f}, not x2: the A100's fp16 tensor-core peak is 312 "
                   f"TFLOP/s vs 19.5 fp32 (PyTorch's default fp32 matmuls do not use TF32)")
        out.append(f"memory: model states stay 16 B/param ({_gib(m.model_states_bytes)}): the recipe omits the 4 B/param fp32 "
                   f"master weights (ZeRO §3.1: 2 + 2 + 12); only activations halve, so the saving is "
                   f"{1 - m.total_bytes / prev.plan.memory.total_bytes:.0%}, not 25%")
    elif i == 2:
        out.append(f"speed: x{prev.plan.train_days / p.train_days:.2f}, not x1.5: accumulation does not make a token cheaper; "
                   f"it only amortises the optimizer step over 8 micro-batches")
        out.append("memory: agrees (activations are freed after each micro-batch's backward)")
    elif i == 3:
        out.append(f"time x{rung.factor:.2f} vs the recipe's x1.3: checkpoint_sequential with 8 segments re-runs 7 of 8 segments' "
                   f"forward (x(1 + 7/8 x 1/3) ~ 1.29)")
        out.append(f"activations {_gib(m.activations_bytes)} (from {_gib(prev.plan.memory.activations_bytes)}): the last segment "
                   f"(12 layers) runs without a checkpoint, so it is 12/96 of the layers plus 7 layer inputs, not 1/12")
    elif i == 4:
        out.append(f"does not fit: 2.8 TB of model states over 8 GPUs is {_gib(m.model_states_bytes)} per GPU > 80 GB; "
                   f"175B needs >= 35 A100-80GB for model states alone (or --offload optimizer+params)"
                   if not p.fits else "fits")
        out.append(f"speed x{1 / rung.factor:.1f} faster vs the recipe's /6: ZeRO-3 moves 3Ψ per micro-batch "
                   f"({p.time.dp_comm_s:.1f} s/step of collectives, {p.time.dp_comm_exposed_s:.1f} s exposed)")
    elif i == 5:
        out.append(f"bubble: with m = {p.grad_accum} micro-batches and p = {p.strategy['pp']} stages the bubble adds (p-1)/m = "
                   f"{p.time.bubble_fraction:.0%} to the step ({p.time.bubble_s / p.step_time_s:.0%} of it idles); "
                   f"the recipe's /1.2 needs m >> p. Planner: x{1 / rung.factor:.1f} from 8x the GPUs")
        out.append(f"memory {_gib(m.total_bytes)} per GPU on the {m.stage} stage ({'fits' if p.fits else 'does not fit'})")
    elif i == 6:
        seed_states = 5.5 + 5.5 + 22
        held = ""
        if p.strategy["pp"] > 1 and p.strategy["zero_runs_as"] >= 2:
            held = ("; and under pipelining each rank keeps its stage's unreduced gradients and unsharded 16-bit "
                    "parameters from micro-batch to micro-batch (torch.distributed.pipelining reduces once per step), "
                    "so ZeRO-3 shards only the optimizer states")
        out.append(f"memory: model states {m.model_states_bytes / 1e9:.1f} GB vs the recipe's {seed_states:.0f} GB: "
                   f"ZeRO's 16 B/param x 175B / 64 = 43.75 GB (+ the first stage's embedding); the recipe's 1400 GB of "
                   f"optimizer states omit the fp32 master weights (2100 GB / 64 = 33 GB, not 22){held}")
        out.append(f"activations {m.activations_bytes / 1e9:.1f} GB vs ~30 GB; total {m.total_bytes / 1e9:.1f} GB vs ~63 GB "
                   f"({'fits' if p.fits else 'does not fit'})")
        out.append(f"time: {p.train_days:,.0f} days for 300B tokens at {p.mfu:.0%} MFU; the recipe's ~3 days assumes 50% of "
                   f"peak and an unstated token count (3 days at 50% MFU on 64 A100 would be "
                   f"{3 * 86400 * 64 * 312e12 * 0.5 / (6 * 175e9) / 1e9:.1f}B tokens)")
    return out


def ladder_dict(rungs: list[Rung]) -> dict:
    return {
        "rungs": [
            {
                "name": r.name, "gpus": r.gpus, "strategy": r.plan.strategy, "fits": r.plan.fits,
                "total_bytes": r.plan.memory.total_bytes, "model_states_bytes": r.plan.memory.model_states_bytes,
                "activations_bytes": r.plan.memory.activations_bytes, "step_time_s": r.plan.step_time_s,
                "tokens_per_s": r.plan.tokens_per_s, "mfu": r.plan.mfu, "train_days": r.plan.train_days,
                "factor_vs_previous": r.factor,
                "seed": None if r.seed is None else {
                    "days": r.seed.days, "factor": r.seed.factor, "memory_gb": r.seed.memory_gb, "memory": r.seed.memory_text,
                },
                "notes": r.notes,
            }
            for r in rungs
        ]
    }
