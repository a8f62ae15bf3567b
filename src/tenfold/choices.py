"""The run choices, one row each: the resolver's keyword (and ResolvedRun's attribute), the
config key it is read from and written back to, the command-line flag that sets it, its
default, the values it may take and what each one means. tenfold.run builds its defaults
(`CHOICES`), `choices_from_config`, `config_for_run` and `ResolvedRun.choices` from this table,
tenfold.config its fields' defaults and allowed values, and tenfold.run_args the flags, their
help (`flag_help`: the allowed values and the default written from the row) and the flag ->
config key map. A new choice is one row here plus the rule that uses it (the resolver's check,
the technique).

No torch, no other tenfold layer: every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenfold.terms import (DEFAULT_MICRO_BATCH, DEFAULT_PRECISION, OFFLOADS, PIPELINE_SCHEDULES, PRECISION_CHOICES, REDUCE_DTYPES,
                           ZERO_STAGES)


@dataclass(frozen=True)
class Choice:
    name: str  # the resolver's keyword, ResolvedRun's attribute
    key: str | None  # "section.field" in the config, or a whole "section"; None: derived, not configured
    flag: str | None  # the command-line flag (tenfold train / plan); None: config only
    default: object = None
    allowed: tuple | None = None  # None: checked by its own rule (tenfold.run, tenfold.layout)
    help: str = ""  # what the flag sets; `flag_help` adds the allowed values and the default
    value: str = "str"  # the flag's value: int | str | int_list | switch (no value) | on-off (--x / --no-x)
    meaning: tuple[tuple[object, str], ...] = ()  # (allowed value, what it does) where a value needs a word
    default_text: str | None = None  # the help's default where `default` is derived (None: unset)
    group: str = "techniques"  # the --help section the flag is listed in
    metavar: str | None = None

    @property
    def flag_dest(self) -> str | None:
        """argparse's attribute for the flag (`--pp-schedule` -> pp_schedule)."""
        return self.flag[2:].replace("-", "_") if self.flag else None


def flag_help(c: Choice) -> str:
    """The flag's --help text: what it sets, its allowed values (each with its meaning, where it
    has one) and its default, all from the row."""
    text = c.help
    if c.allowed:
        meanings = dict(c.meaning)
        values = " | ".join(f"{v} ({meanings[v]})" if v in meanings else str(v) for v in c.allowed)
        text = f"{text}: {values}" if text else values
    if c.default_text is not None:
        return f"{text} (default: {c.default_text})"
    default = _shown(c.default)
    return f"{text} (default {default})" if default is not None else text


def _shown(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


LORA_GROUP = "low-rank adapters (LoRA, QLoRA: docs/lora.md)"  # the --help section of the adapter flags

RUN_CHOICES = (
    Choice("precision", "precision.dtype", "--precision", DEFAULT_PRECISION, PRECISION_CHOICES,
           help="compute precision (FP8: --fp8)",
           meaning=(("auto", "bf16 on GPUs and on CPUs with bf16 matrix instructions, else fp32"),
                    ("fp16", "dynamic loss scaling"))),
    Choice("fp8", "precision.fp8", "--fp8", False, value="switch",
           help="float8 matmuls in the transformer blocks (torchao; the embedding, head and the rest stay bf16); "
                "needs an H100/H200/B200-class GPU (compute capability >= 8.9)"),
    Choice("fp8_emulate", "precision.fp8_emulate", "--fp8-emulate", False, value="switch",
           help="allow --fp8 without float8 matmuls (CPU, older GPUs): the same numerics, slowly; for tests"),
    Choice("micro_batch", "train.micro_batch", "--micro-batch", value="int", group="optimization",
           help="sequences per micro-batch per rank", default_text=f"{DEFAULT_MICRO_BATCH} when no batch size is given"),
    Choice("grad_accum", "train.grad_accum", "--grad-accum", value="int", group="optimization",
           help="micro-batches accumulated per optimizer step"),
    Choice("global_batch", "train.global_batch", "--global-batch", value="int", group="optimization",
           help="sequences per optimizer step over all ranks"),
    Choice("compile", "train.compile", "--compile", False, value="on-off",
           help="torch.compile each transformer block (compile time reported on its own; docs/compile.md says "
                "where it pays)"),
    Choice("seq_len", "data.seq_len", "--seq-len", value="int", group="model and data",
           help="tokens per sequence", default_text="the model's context"),
    Choice("recompute", "recompute.policy", "--ac", "none",
           help="activation recompute: none | full | every:N | segments:K | selective[:attention|:mlp] | op "
                "(per-op: keep every other matmul's and attention's outputs, recompute the rest) | offload "
                "(saved activations in host memory)"),
    Choice("zero_stage", "parallel.zero_stage", "--zero", 0, ZERO_STAGES, value="int",
           help="ZeRO stage across data-parallel ranks"),
    Choice("offload", "parallel.offload", "--offload", "none", OFFLOADS,
           help="ZeRO-Offload with --zero 2/3",
           meaning=(("optimizer", "AdamW's states and step in host memory, the parameters on the device"),
                    ("optimizer+params", "--zero 3: sharded weights and gradients in host memory too; docs/zero.md"))),
    Choice("shard_group", "parallel.shard_group_size", "--shard-group", value="int", metavar="N",
           help="hybrid sharding (HSDP) with --zero 2/3: shard inside groups of N data-parallel ranks (e.g. one "
                "node), replicate across groups", default_text="all dp ranks"),
    Choice("reduce_dtype", "parallel.reduce_dtype", "--reduce-dtype", "fp32", REDUCE_DTYPES,
           help="dtype data-parallel gradients are reduced in",
           meaning=(("bf16", "DeepSpeed's communication_data_type: half the bytes, partial sums rounded to bf16"),)),
    Choice("reduce_bucket_size", "parallel.reduce_bucket_size", None),
    Choice("param_persistence_threshold", "parallel.param_persistence_threshold", None, 100_000),
    Choice("contiguous_gradients", "parallel.contiguous_gradients", None, True),
    Choice("overlap_comm", "parallel.overlap_comm", None),
    Choice("pp", "parallel.pp_degree", "--pp", 1, value="int", metavar="N", help="pipeline stages"),
    Choice("tp", "parallel.tp_degree", "--tp", 1, value="int", metavar="N",
           help="tensor-parallel ranks: each layer's matrices split over N ranks (must divide the heads)"),
    Choice("cp", "parallel.cp_degree", "--cp", 1, value="int", metavar="N",
           help="context-parallel ranks: each sequence split over N ranks (load-balanced for the causal mask), "
                "attention across them; for long sequences (docs/context_parallel.md)"),
    # expert parallelism: splits the dp ranks (tenfold.layout)
    Choice("ep", "parallel.ep_degree", "--ep", 1, value="int", metavar="N",
           help="expert-parallel ranks: each MoE layer's experts split over N of the data-parallel ranks, tokens "
                "exchanged by all-to-all (must divide dp and the experts)"),
    Choice("pp_schedule", "parallel.pp_schedule", "--pp-schedule", "1f1b", PIPELINE_SCHEDULES,
           help="pipeline schedule"),
    Choice("virtual_stages", "parallel.virtual_stages", "--virtual-stages", value="int", metavar="N",
           help="stages per rank for interleaved schedules", default_text="2 for interleaved schedules, else 1"),
    Choice("pp_split", "parallel.pp_split", "--pp-split", value="int_list", metavar="N,N,...",
           help="transformer blocks per pipeline stage, e.g. 1,3",
           default_text="even, embedding and head weighted as one block each"),
    Choice("sequence_parallel", "parallel.sequence_parallel", "--sequence-parallel", value="on-off",
           help="split norms and the residual stream by sequence over the tp ranks", default_text="on when --tp > 1"),
    # the [lora] table as a tenfold.lora_terms.LoraSpec
    Choice("lora", "lora", "--lora", value="int", metavar="RANK", group=LORA_GROUP,
           help="train rank-RANK adapters on the blocks' Linears, the base frozen in the compute dtype (Hu et al. "
                "2021; PEFT's format)"),
    Choice("model_kind", None, None, "tenfold"),  # from model.hf_config / hf_pretrained
    Choice("hf_model_type", None, None, ""),  # a Hugging Face model's config.json model_type
)
BY_NAME = {c.name: c for c in RUN_CHOICES}


def default_of(name: str) -> object:
    """A choice's default (the config field's)."""
    return BY_NAME[name].default


def allowed_of(name: str) -> tuple:
    """A choice's allowed values (the config field's Literal)."""
    allowed = BY_NAME[name].allowed
    assert allowed is not None, name
    return allowed


def flag_keys() -> dict[str, tuple[str, str]]:
    """{flag's argparse attribute: (section, field)} for the choices with a flag and a field."""
    return {c.flag_dest: tuple(c.key.split(".")) for c in RUN_CHOICES  # type: ignore[misc]
            if c.flag_dest and c.key and "." in c.key}


def flags_of_group(group: str) -> list[Choice]:
    """The choices with a flag listed in --help section `group`, in the table's order."""
    return [c for c in RUN_CHOICES if c.flag and c.group == group]
