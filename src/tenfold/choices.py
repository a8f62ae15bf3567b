"""The run choices, one row each: the resolver's keyword (and ResolvedRun's attribute), the
config key it is read from and written back to, the command-line flag that sets it, its
default and the values it may take. tenfold.run builds its defaults (`CHOICES`),
`choices_from_config`, `config_for_run` and `ResolvedRun.choices` from this table, and
tenfold.run_args its flag -> config key map. A new choice is one row here plus the rule that
uses it (the resolver's check, the technique).

No torch, no other tenfold layer: every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenfold.terms import DEFAULT_PRECISION, OFFLOADS, PIPELINE_SCHEDULES, PRECISION_CHOICES, REDUCE_DTYPES, ZERO_STAGES


@dataclass(frozen=True)
class Choice:
    name: str  # the resolver's keyword, ResolvedRun's attribute
    key: str | None  # "section.field" in the config, or a whole "section"; None: derived, not configured
    flag: str | None  # the command-line flag (tenfold train / plan); None: config only
    default: object = None
    allowed: tuple | None = None  # None: checked by its own rule (tenfold.run, tenfold.layout)

    @property
    def flag_dest(self) -> str | None:
        """argparse's attribute for the flag (`--pp-schedule` -> pp_schedule)."""
        return self.flag[2:].replace("-", "_") if self.flag else None


RUN_CHOICES = (
    Choice("precision", "precision.dtype", "--precision", DEFAULT_PRECISION, PRECISION_CHOICES),
    Choice("fp8", "precision.fp8", "--fp8", False),
    Choice("fp8_emulate", "precision.fp8_emulate", "--fp8-emulate", False),
    Choice("micro_batch", "train.micro_batch", "--micro-batch"),
    Choice("grad_accum", "train.grad_accum", "--grad-accum"),
    Choice("global_batch", "train.global_batch", "--global-batch"),
    Choice("compile", "train.compile", "--compile", False),
    Choice("seq_len", "data.seq_len", "--seq-len"),
    Choice("recompute", "recompute.policy", "--ac", "none"),
    Choice("zero_stage", "parallel.zero_stage", "--zero", 0, ZERO_STAGES),
    Choice("offload", "parallel.offload", "--offload", "none", OFFLOADS),
    Choice("shard_group", "parallel.shard_group_size", "--shard-group"),
    Choice("reduce_dtype", "parallel.reduce_dtype", "--reduce-dtype", "fp32", REDUCE_DTYPES),
    Choice("reduce_bucket_size", "parallel.reduce_bucket_size", None),
    Choice("param_persistence_threshold", "parallel.param_persistence_threshold", None, 100_000),
    Choice("contiguous_gradients", "parallel.contiguous_gradients", None, True),
    Choice("overlap_comm", "parallel.overlap_comm", None),
    Choice("pp", "parallel.pp_degree", "--pp", 1),
    Choice("tp", "parallel.tp_degree", "--tp", 1),
    Choice("cp", "parallel.cp_degree", "--cp", 1),
    Choice("ep", "parallel.ep_degree", "--ep", 1),  # expert parallelism: splits the dp ranks (tenfold.layout)
    Choice("pp_schedule", "parallel.pp_schedule", "--pp-schedule", "1f1b", PIPELINE_SCHEDULES),
    Choice("virtual_stages", "parallel.virtual_stages", "--virtual-stages"),
    Choice("pp_split", "parallel.pp_split", "--pp-split"),
    Choice("sequence_parallel", "parallel.sequence_parallel", "--sequence-parallel"),
    Choice("lora", "lora", "--lora"),  # the [lora] table as a tenfold.lora_terms.LoraSpec
    Choice("model_kind", None, None, "tenfold"),  # from model.hf_config / hf_pretrained
    Choice("hf_model_type", None, None, ""),  # a Hugging Face model's config.json model_type
)
BY_NAME = {c.name: c for c in RUN_CHOICES}


def flag_keys() -> dict[str, tuple[str, str]]:
    """{flag's argparse attribute: (section, field)} for the choices with a flag and a field."""
    return {c.flag_dest: tuple(c.key.split(".")) for c in RUN_CHOICES  # type: ignore[misc]
            if c.flag_dest and c.key and "." in c.key}
