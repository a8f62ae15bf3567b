"""Published LoRA and QLoRA memory figures the planner is held against (docs/planner.md,
"LoRA and QLoRA"; tests/test_plan_lora.py), and the QLoRA paper's headline beside a QLoRA plan.

Nothing here is fitted: each row prices the published setup with the planner's own terms
(plan/lora.py) and reports the error, with what the source does differently where it does.

Sources: Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs" (§2 "Memory
Requirement of Parameter-Efficient Finetuning", §3 "Double Quantization", Table 6's Memory
column, App. B's hyperparameters: r 64, alpha 16, adapters on all linear layers, dropout 0.05
at 33B/65B, gradient checkpointing, paged AdamW; Fig. 6's breakdown at batch 1 and 512
tokens); Touvron et al. 2023 (LLaMA, Table 2: the 7B-65B shapes).
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenfold.lora_terms import LoraSpec, nf4_bytes_per_param
from tenfold.models.presets import ModelConfig
from tenfold.models.specs import spec_for
from tenfold.plan import lora as lora_plan
from tenfold.plan.api import predict_memory
from tenfold.run import ResolvedRun, resolve

QLORA = "Dettmers et al. 2023 (QLoRA)"
# LLaMA 1 (Touvron et al. 2023, Table 2): layers, width, heads, the SwiGLU width of the released weights
LLAMA = {
    "7B": ModelConfig(n_layers=32, d_model=4096, n_heads=32, d_ff=11008, vocab_size=32000, max_seq_len=2048),
    "13B": ModelConfig(n_layers=40, d_model=5120, n_heads=40, d_ff=13824, vocab_size=32000, max_seq_len=2048),
    "33B": ModelConfig(n_layers=60, d_model=6656, n_heads=52, d_ff=17920, vocab_size=32000, max_seq_len=2048),
    "65B": ModelConfig(n_layers=80, d_model=8192, n_heads=64, d_ff=22016, vocab_size=32000, max_seq_len=2048),
}
# Llama 3.1 (Meta's config.json files): layers, width, heads, kv heads, SwiGLU width; vocabulary 128256
LLAMA31 = {
    "8B": ModelConfig(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=128256,
                      max_seq_len=8192),
    "70B": ModelConfig(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=128256,
                       max_seq_len=8192),
    "405B": ModelConfig(n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, d_ff=53248, vocab_size=128256,
                        max_seq_len=8192),
}
TORCHTUNE = "torchtune README, \"Memory and training speed\" (batch 2, packed to 2048 tokens, compiled)"
_QVO_MLP = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (row, model, GPUs, adapters, published GiB); the adapters, recompute and sharding are the recipes' configs
# (recipes/configs/llama3_1/{8B_lora_single_device, 8B_qlora_single_device, 70B_lora, 405B_qlora}.yaml)
TORCHTUNE_ROWS = (
    ("Llama 3.1 8B LoRA, 1x 4090", "8B", 1, LoraSpec(8, 16.0, targets=_QVO_MLP), 16.2),
    ("Llama 3.1 8B QLoRA, 1x 4090", "8B", 1, LoraSpec(8, 16.0, targets=("k_proj",) + _QVO_MLP, base="nf4"), 7.4),
    ("Llama 3.1 70B LoRA, 8x A100", "70B", 8, LoraSpec(16, 32.0, targets=_QVO_MLP), 27.6),
    ("Llama 3.1 405B QLoRA, 8x A100", "405B", 8, LoraSpec(16, 32.0, targets=_QVO_MLP, base="nf4"), 44.8e9 / 2**30),
)
TORCHTUNE_WHY = ("torchtune's chunked cross-entropy keeps the bf16 logits (2 b s V) where tenfold's loss holds fp32 "
                 "log-probabilities, their gradient and the logits' gradient at the start of its backward (12 b s V: "
                 "5.9 GiB at Llama 3's vocabulary, batch 2 x 2048); "
                 "torch.compile fuses the eager elementwise tensors tenfold's style counts and torchao's NF4 "
                 "dequantization, whose eager intermediates tenfold prices ((8 + 3 x 2) bytes per value of the "
                 "largest weight: 11.4 GiB at 405B)")
PAPER_ADAPTERS = LoraSpec(rank=64, alpha=16.0, dropout=0.05, base="nf4")  # App. B, 33B and 65B
PAPER_SETTING = {"micro_batch": 1, "grad_accum": 1, "global_batch": None, "seq_len": 512, "recompute": "full"}


def paper_run(model: ModelConfig, precision: str = "bf16") -> ResolvedRun:
    """One GPU, QLoRA as the paper trains it: micro-batch 1 of 512 tokens (Fig. 6), gradient
    checkpointing, r 64 adapters on every Linear."""
    return resolve(model, 1, precision=precision, lora=PAPER_ADAPTERS, check=False, **PAPER_SETTING)


def base_bytes(model: ModelConfig) -> float:
    """The frozen base as QLoRA holds it: the blocks' Linears in NF4, the rest in bf16."""
    run = paper_run(model)
    counts = lora_plan.layer_counts(model, run)
    return lora_plan.frozen_bytes(run.params, model.n_layers, counts, "bf16")


@dataclass(frozen=True)
class Case:
    name: str
    published: float  # bytes, or bits per parameter
    predicted: float
    unit: str
    source: str
    why: str = ""  # what the source counts differently

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1.0


def cases() -> list[Case]:
    """The published figures and the planner's prediction for each."""
    dq_saving = 4.5 - 8 * nf4_bytes_per_param(4.0)  # constants: 32/64 bits -> 8/64 + 32/(64 x 256)
    out = [
        Case("double quantization saving", 0.373, dq_saving, "bits/param", f"{QLORA} §3", "exact: the same formula"),
        Case("LLaMA 7B 4-bit base (FLAN v2 run)", 5048e6, base_bytes(LLAMA["7B"]), "bytes", f"{QLORA} §2",
             "measured GPU memory of the loaded model; the planner counts the weights alone"),
    ]
    for size, gb in (("7B", 5e9), ("13B", 10e9), ("33B", 21e9), ("65B", 41e9)):
        out.append(Case(f"Guanaco {size} 4-bit model", gb, base_bytes(LLAMA[size]), "bytes", f"{QLORA} Table 6",
                        "rounded to GB; the table does not say what it counts beyond the weights (its 16-bit rows are "
                        "2 bytes per parameter)"))
    capacity = 48e9
    fit = predict_memory(paper_run(LLAMA["65B"]), "a100-80gb").allocated_bytes
    out.append(Case("LLaMA 65B QLoRA on one 48 GB GPU", capacity, fit, "bytes", f"{QLORA} abstract, §1, Fig. 6",
                    "the paper's adapters are bf16 and its AdamW states paged to the host when memory runs out; "
                    "tenfold keeps fp32 adapters and their states on the GPU (+4 bytes per adapter parameter, "
                    "AdamW's 8 bytes resident)"))
    for name, size, gpus, spec, gib in TORCHTUNE_ROWS:
        run = resolve(LLAMA31[size], gpus, precision="bf16", micro_batch=2, seq_len=2048, recompute="full",
                      zero_stage=3 if gpus > 1 else 0, lora=spec, model_kind="hf", hf_model_type="llama", check=False)
        predicted = predict_memory(run, "a100-80gb").allocated_bytes
        out.append(Case(name, gib * 2**30, predicted, "bytes", TORCHTUNE, TORCHTUNE_WHY))
    return out


def paper_note(run: ResolvedRun, hardware) -> str | None:
    """For a QLoRA plan of a known shape: the paper's headline, and this model in the paper's
    setting on this hardware."""
    if run.lora is None or run.lora.base != "nf4" or run.model is None or not spec_for(run.model_kind).architecture_known:
        return None
    m = predict_memory(paper_run(run.model, run.precision), hardware)
    fits = "fits" if m.total_bytes <= m.capacity_bytes else "does not fit"
    return (f"{QLORA}: LLaMA 65B fine-tuned on one 48 GB GPU; this model in the paper's setting (micro-batch 1, "
            f"512 tokens, --ac full, r 64 on every Linear): {m.total_bytes / 2**30:.1f} GiB per GPU, {fits} in "
            f"{m.capacity_bytes / 2**30:.1f} GiB")
