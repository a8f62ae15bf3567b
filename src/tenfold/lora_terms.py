"""Low-rank adapters (LoRA, Hu et al. 2021) and the 4-bit NF4 base of QLoRA (Dettmers et al.
2023) in the words the engine and the planner share: what a run asks for (`LoraSpec`), which of
a block's Linears an adapter goes on, which frozen weights NF4 can hold, and the bytes NF4 takes.
One rule each, so that what `tenfold plan` prices is what `tenfold train` builds.

No torch here: the planner reads this module on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenfold.errors import UserError
from tenfold.models.specs import spec_for  # torch-free
from tenfold.terms import runs_on_fsdp2

LORA_BASES = ("compute", "nf4")  # the frozen base: in the run's compute dtype, or 4-bit NormalFloat
ALL_LINEAR = "all-linear"  # PEFT's word for every Linear of the blocks (not the output layer)
# QLoRA §3 (Dettmers et al. 2023): 4-bit NF4 values in blocks of 64, each block's absmax
# constant quantized again to 8 bits in blocks of 256 constants ("double quantization"),
# the second-level constants in the weight's own 16-bit dtype (torchao's NF4Tensor).
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
NF4_QUANTUM = NF4_BLOCK * NF4_SCALER_BLOCK  # elements a quantized weight (and each of its shards) is a multiple of


@dataclass(frozen=True)
class LoraSpec:
    """What a LoRA run asks for: W x + (alpha / r) B A x on the `targets` Linears of every block,
    A (r x in) and B (out x r) trained, W frozen; `base`: the frozen weights in the compute
    dtype or in NF4."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = (ALL_LINEAR,)
    base: str = "compute"

    @property
    def scaling(self) -> float:
        """LoRA's alpha / r (Hu et al. 2021 §4.1; PEFT's `scaling`)."""
        return self.alpha / self.rank

    @property
    def all_linear(self) -> bool:
        return ALL_LINEAR in self.targets

    def text(self) -> str:
        """`LoRA r 8, alpha 16, all-linear` (`; base NF4` for QLoRA): the layout line's words."""
        what = "QLoRA" if self.base == "nf4" else "LoRA"
        drop = f", dropout {self.dropout:g}" if self.dropout else ""
        return f"{what} r {self.rank}, alpha {self.alpha:g}{drop}, {', '.join(self.targets)}"


def lora_spec(section) -> LoraSpec | None:
    """The config's `[lora]` table as a spec; None when LoRA is off (rank 0). alpha unset is
    2 x rank, torchtune's ratio (alpha 16 at rank 8 in its LoRA recipes)."""
    if not section.rank:
        return None
    alpha = section.alpha if section.alpha is not None else 2.0 * section.rank
    return LoraSpec(section.rank, float(alpha), float(section.dropout), tuple(section.target_modules), section.base)


# --------------------------------------------------------------------------- a block's Linears


def block_linear_names(kind: str, hf_model_type: str = "", mlp: str = "swiglu") -> dict[str, tuple[str, ...]] | None:
    """{module name: roles} of one block's Linears for a model family; None when tenfold does not
    know the family's names (a user's own module, another Hugging Face family): tenfold.models.specs."""
    return spec_for(kind).linear_names(hf_model_type, mlp)


def check_targets(spec: LoraSpec, kind: str, hf_model_type: str = "", mlp: str = "swiglu") -> None:
    """Every target names a Linear of the model's blocks (where tenfold knows the family's names;
    the engine checks any other model against its real modules)."""
    names = block_linear_names(kind, hf_model_type, mlp)
    if names is None or spec.all_linear:
        return
    unknown = [t for t in spec.targets if t not in names]
    if unknown:
        raise UserError(f"lora.target_modules (--lora-targets) {', '.join(map(repr, unknown))}: not a Linear of "
                        f"this model's blocks; allowed: {ALL_LINEAR}, {', '.join(names)}")


def adapted_roles(spec: LoraSpec, kind: str, hf_model_type: str = "", mlp: str = "swiglu") -> tuple[str, ...]:
    """The roles (q, k, v, o, gate, up, down) of the Linears that get an adapter in every block.
    A family whose names tenfold does not know is priced as all-linear."""
    names = block_linear_names(kind, hf_model_type, mlp)
    all_roles = ("q", "k", "v", "o", "gate", "up", "down") if mlp == "swiglu" else ("q", "k", "v", "o", "up", "down")
    if names is None or spec.all_linear:
        return all_roles
    chosen = {role for t in spec.targets for role in names.get(t, ())}
    return tuple(r for r in all_roles if r in chosen)


def role_shapes(d_model: int, kv_width: int, ffn: int) -> dict[str, tuple[int, int]]:
    """(in, out) features of each role's Linear."""
    return {"q": (d_model, d_model), "k": (d_model, kv_width), "v": (d_model, kv_width), "o": (d_model, d_model),
            "gate": (d_model, ffn), "up": (d_model, ffn), "down": (ffn, d_model)}


# --------------------------------------------------------------------------- NF4


def nf4_quantizable(rows: int, cols: int) -> bool:
    """Whether a (rows x cols) weight can be held in NF4 as QLoRA lays it out: whole blocks of 64
    values and whole groups of 256 block constants. Smaller or odd weights stay in the compute
    dtype. The rule does not depend on the layout, so a run quantizes the same weights on any
    number of ranks."""
    return rows * cols % NF4_QUANTUM == 0


def nf4_shardable(rows: int, cols: int, shards: int) -> bool:
    """Whether FSDP2 can cut an NF4 weight into `shards` row slices (torchao's NF4Tensor splits
    only on whole 64 x 256-value groups)."""
    return rows % shards == 0 and (rows // shards) * cols % NF4_QUANTUM == 0


def nf4_unshardable(cfg, spec: LoraSpec, shards: int) -> list[str]:
    """`q (128 x 128)`, ... for the block weights NF4 holds (a ModelConfig's shapes) that `shards`
    ZeRO row slices would cut inside a group; [] where each slice is whole groups."""
    if spec.base != "nf4" or shards <= 1:
        return []
    shapes = role_shapes(cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.ffn_dim)
    roles = ("q", "k", "v", "o", "gate", "up", "down") if cfg.mlp == "swiglu" else ("q", "k", "v", "o", "up", "down")
    out = []
    for role in roles:
        cols, rows = shapes[role]
        if nf4_quantizable(rows, cols) and not nf4_shardable(rows, cols, shards):
            out.append(f"{role} ({rows} x {cols})")
    return out


def nf4_bytes_per_param(scale_bytes: float = 2.0) -> float:
    """QLoRA §3, "Double Quantization": 4 bits per value, plus 8 bits per block of 64 for the
    quantized block constant, plus one second-level constant (here in the 16-bit dtype of the
    weight, `scale_bytes`; the paper's are fp32) per 256 blocks: 0.5 + 1/64 + 2/16384 bytes,
    4.127 bits per parameter with fp32 constants as in the paper, against 4.5 bits with one fp32
    constant per block and no double quantization."""
    return 0.5 + 1.0 / NF4_BLOCK + scale_bytes / NF4_QUANTUM


def nf4_shards(run) -> int:
    """Row slices FSDP2 cuts each frozen weight of `run` (a tenfold.run.ResolvedRun) into: the
    shard group under ZeRO-2/3 (FSDP2 keeps parameters sharded between uses at both stages),
    else 1 (DDP and one rank hold whole weights)."""
    return run.shard_size if runs_on_fsdp2(run.zero_stage, run.tp, run.dp, run.offload) and run.dp > 1 else 1
