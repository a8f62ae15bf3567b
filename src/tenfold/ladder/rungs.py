"""The recipe's rungs as tenfold configs: each rung adds one technique to the one before.

Seed, "30 days -> 3 days": baseline one device fp32 batch 1; (1) fp16 mixed precision;
(2) gradient accumulation; (3) activation checkpointing; (4) data parallel with ZeRO-3;
(5) pipeline parallelism. Every rung trains the same token budget, so the time for the budget
is budget / tokens_per_s and the recipe's "time / 2, / 1.5, x 1.3 ..." become measurable.

A rung is a dict of config overrides (`section -> key -> value`, the same layers
`tenfold.config.build_config` merges) plus the number of local processes. The same overrides
are passed to `tenfold train` as `--set section.key=value` and to the planner, so the run
and the prediction describe one config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

RUNG_NAMES = ("fp32", "mixed", "accum", "recompute", "zero", "pipeline")

# What each rung adds, and the recipe's claim for it.
RUNG_TITLES = {
    "fp32": "fp32, micro-batch 1 (baseline)",
    "mixed": "+ mixed precision",
    "accum": "+ gradient accumulation",
    "recompute": "+ activation checkpointing, larger micro-batch",
    "zero": "+ ZeRO across local ranks",
    "pipeline": "+ pipeline parallelism",
}
SEED_CLAIMS = {
    "fp32": "30 days", "mixed": "time / 2", "accum": "time / 1.5", "recompute": "time x 1.3",
    "zero": "time / 6 (8 GPUs)", "pipeline": "time / 1.2 (8 stages)",
}


@dataclass
class RungSpec:
    """One rung as it will run: config overrides, processes, and why it may not run."""

    index: int
    name: str
    title: str
    nproc: int
    overrides: dict[str, dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    skip: str | None = None  # reason, when the rung cannot run here

    @property
    def knobs(self) -> dict[str, Any]:
        """The ladder-relevant settings, flat (ladder.json's `config`)."""
        t, p = self.overrides["train"], self.overrides["parallel"]
        dp = self.nproc // p["pp_degree"]
        return {
            "precision": self.overrides["precision"]["dtype"], "micro_batch": t["micro_batch"],
            "grad_accum": t["grad_accum"], "global_batch": t["micro_batch"] * t["grad_accum"] * dp,
            "nproc": self.nproc, "dp": dp, "zero_stage": p["zero_stage"], "pp": p["pp_degree"],
            "recompute": self.overrides["recompute"]["policy"], "steps": t["steps"],
        }

    def set_args(self) -> list[str]:
        """`--set section.key=value` for every override (values as TOML literals)."""
        out = []
        for section, keys in self.overrides.items():
            for key, value in keys.items():
                out += ["--set", f"{section}.{key}={_toml(value)}"]
        return out


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


@dataclass
class LadderSetup:
    """Everything the rungs share (resolved from the command line)."""

    seq_len: int
    global_batch: int  # target sequences per optimizer step (the accumulation rung's batch)
    budget_tokens: int  # per rung, a whole number of target global batches
    nproc: int
    pp: int
    zero_stage: int
    ac_policy: str
    mixed_dtype: str  # bf16, or fp16 where the device has no bf16; fp32 where no 16-bit format pays
    mixed_skip: str | None = None  # why the mixed-precision rung is not run here (machine.mixed_precision)
    seed: int = 1337
    eval_seqs: int = 16  # every rung scores the same first validation sequences
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)  # e.g. data.max_bytes for --quick

    @property
    def budget_seqs(self) -> int:
        return self.budget_tokens // self.seq_len


def budget_tokens(requested: int, seq_len: int, global_batch: int) -> int:
    """Round the budget up to whole global batches so every rung sees the same tokens."""
    per_batch = seq_len * global_batch
    return max(1, math.ceil(requested / per_batch)) * per_batch


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def base_overrides(setup: LadderSetup, steps: int, micro_batch: int, grad_accum: int) -> dict:
    """Settings every rung shares: the same data, seed, schedule shape and validation set."""
    warmup = min(10, steps // 10)  # the default 10 warmup steps would be most of a short rung
    o: dict[str, dict[str, Any]] = {
        "train": {
            "steps": steps, "micro_batch": micro_batch, "grad_accum": grad_accum, "seed": setup.seed,
            "warmup_steps": warmup, "eval_every": 0,
            # eval_batches x micro_batch = eval_seqs: the same validation sequences in every rung
            "eval_batches": max(1, setup.eval_seqs // micro_batch),
        },
        "data": {"seq_len": setup.seq_len},
        "precision": {"dtype": "fp32"},
        "recompute": {"policy": "none"},
        "parallel": {"zero_stage": 0, "pp_degree": 1},
        "log": {"tensorboard": False, "progress": False},
        "checkpoint": {"final": False},  # a measurement, not a model to keep
    }
    for section, keys in setup.extra.items():
        o.setdefault(section, {}).update(keys)
    return o


def _steps(setup: LadderSetup, seqs_per_step: int) -> int:
    return max(1, setup.budget_seqs // seqs_per_step)


def fp32_rung(setup: LadderSetup) -> RungSpec:
    o = base_overrides(setup, _steps(setup, 1), 1, 1)
    return RungSpec(0, "fp32", RUNG_TITLES["fp32"], 1, o,
                    ["one process, fp32, one sequence per optimizer step"])


def mixed_rung(setup: LadderSetup) -> RungSpec:
    o = base_overrides(setup, _steps(setup, 1), 1, 1)
    dtype = "bf16" if setup.mixed_skip else setup.mixed_dtype  # a skipped rung names what it would run
    o["precision"]["dtype"] = dtype
    note = (f"torch.amp autocast to {dtype}, fp32 master weights and optimizer"
            + (" + dynamic loss scaling" if dtype == "fp16" else ""))
    return RungSpec(1, "mixed", f"{RUNG_TITLES['mixed']} ({dtype})", 1, o, [note], setup.mixed_skip)


def accum_rung(setup: LadderSetup) -> RungSpec:
    g = setup.global_batch
    o = base_overrides(setup, _steps(setup, g), 1, g)
    o["precision"]["dtype"] = setup.mixed_dtype
    return RungSpec(2, "accum", f"{RUNG_TITLES['accum']} (x{g})", 1, o,
                    [f"{g} micro-batches of 1 per optimizer step (global batch {g})"])


def recompute_rung(setup: LadderSetup, micro_batch: int, choice_note: str) -> RungSpec:
    g = setup.global_batch
    o = base_overrides(setup, _steps(setup, g), micro_batch, g // micro_batch)
    o["precision"]["dtype"] = setup.mixed_dtype
    o["recompute"]["policy"] = setup.ac_policy
    return RungSpec(3, "recompute", f"+ activation checkpointing ({setup.ac_policy}), micro-batch {micro_batch}",
                    1, o, [choice_note])


def zero_rung(setup: LadderSetup, micro_batch: int) -> RungSpec:
    """Rung 3 on `nproc` data-parallel ranks: same global batch, split across ranks."""
    g, n = setup.global_batch, setup.nproc
    skip = None
    if n < 2:
        skip = f"ZeRO shards over data-parallel ranks and --nproc is {n}; it needs at least 2"
    elif g % n:
        skip = f"the global batch {g} is not a multiple of --nproc {n}; pass --global-batch as a multiple of {n}"
    per_rank = max(1, g // n)
    mb = max(d for d in divisors(per_rank) if d <= micro_batch)
    o = base_overrides(setup, _steps(setup, g), mb, max(1, per_rank // mb))
    o["precision"]["dtype"] = setup.mixed_dtype
    o["recompute"]["policy"] = setup.ac_policy
    o["parallel"]["zero_stage"] = setup.zero_stage
    title = f"+ ZeRO-{setup.zero_stage} on {n} local ranks"
    notes = [f"{n} ranks x micro-batch {mb} x {max(1, per_rank // mb)} accumulation = global batch {g}"]
    return RungSpec(4, "zero", title, n, o, notes, skip)


def pipeline_rung(setup: LadderSetup, micro_batch: int) -> RungSpec:
    """Rung 4 with the ranks arranged as pp stages x (nproc / pp) data-parallel replicas."""
    g, n, pp = setup.global_batch, setup.nproc, setup.pp
    skip = None
    if n < 2 or pp < 2:
        skip = (f"a pipeline needs at least 2 stages on 2 processes; here --nproc {n}, --pp {pp}")
    elif n % pp:
        skip = f"--pp {pp} does not divide --nproc {n}"
    dp = max(1, n // pp)
    if skip is None and g % (dp * pp):
        skip = f"the global batch {g} cannot give every stage {pp} micro-batches on {dp} replica(s)"
    per_rank = max(1, g // dp)
    # at least pp micro-batches per step (else a stage idles all step); 2 x pp halves the bubble
    # (p - 1) / m (GPipe / 1F1B, Narayanan et al. 2021 §2.2) where the batch allows it
    fitting = [d for d in divisors(per_rank) if d <= micro_batch and per_rank // d >= pp] or [1]
    two_pp = [d for d in fitting if per_rank // d >= 2 * pp]
    mb = max(two_pp or fitting)
    m = per_rank // mb
    zero = setup.zero_stage if dp > 1 else 0
    o = base_overrides(setup, _steps(setup, g), mb, m)
    o["precision"]["dtype"] = setup.mixed_dtype
    o["recompute"]["policy"] = setup.ac_policy
    o["parallel"]["zero_stage"] = zero
    o["parallel"]["pp_degree"] = pp
    notes = [f"{pp} stages x {dp} replica(s); {m} micro-batches of {mb} per step, bubble (p-1)/m = {(pp - 1) / m:.0%}"]
    if dp == 1 and setup.zero_stage:
        notes.append(f"ZeRO off: one data-parallel replica (--nproc {n} / --pp {pp}) has nothing to shard over")
    title = f"+ pipeline, {pp} stages" + (f" x ZeRO-{zero} on {dp} replicas" if zero else "")
    return RungSpec(5, "pipeline", title, n, o, notes, skip)
