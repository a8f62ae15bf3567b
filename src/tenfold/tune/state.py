"""What a tune has done, kept in OUT/tune.json and rewritten after every run, so that running
the same command again resumes: a run that finished (measured or failed) is never run again,
a run that was interrupted is.

A tune folder belongs to one setup: the user's config without the strategy a tune varies (model,
data, optimizer, sequence length, global batch), the number of processes and the device. A
second tune of another setup into the same folder is refused (its trials measured another run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenfold.errors import UserError
from tenfold.textfiles import read_text
from tenfold.tune.trial import Run

MAX_STATE_BYTES = 64 * 2**20  # one entry per trial: kilobytes each

VERSION = 1
# Config keys a tune varies or sets per trial: not part of the setup a tune folder belongs to.
VARIED = {"train": ("micro_batch", "grad_accum", "steps", "eval_every", "eval_batches"),
          "precision": ("dtype",), "recompute": ("policy",),
          "parallel": ("zero_stage", "pp_degree", "pp_schedule", "virtual_stages", "pp_split", "tp_degree")}
PER_RUN_SECTIONS = ("log", "checkpoint")


@dataclass
class Trial:
    id: str  # t1, t2, ... in the order the trials first ran
    key: str
    name: str
    baseline: bool
    knobs: dict[str, Any]
    folder: str
    predicted_before: float  # the planner's tokens/s with the machine's prior constants
    predicted_peak_bytes: float | None  # the planner's per-rank peak
    runs: list[Run] = field(default_factory=list)
    predicted_after: float | None = None  # with the final calibration

    @property
    def finished_runs(self) -> list[Run]:
        return [r for r in self.runs if r.status != "running"]

    @property
    def measured(self) -> list[Run]:
        return [r for r in self.runs if r.status == "measured" and r.tokens_per_s]

    @property
    def status(self) -> str:
        if self.measured:
            return "measured"
        done = self.finished_runs
        return done[0].status if done else "pending"

    @property
    def reason(self) -> str | None:
        done = self.finished_runs
        return None if self.measured or not done else done[0].reason

    @property
    def tokens_per_s(self) -> float | None:
        """The best of the measured runs: other work on a shared machine only slows a run, so
        the best of a few estimates the undisturbed speed (as the ladder counts its rungs)."""
        rates = [r.tokens_per_s for r in self.measured]
        return max(rates) if rates else None

    @property
    def peak_bytes_per_rank(self) -> list[int]:
        for r in self.finished_runs:
            if r.peak_bytes_per_rank:
                return r.peak_bytes_per_rank
        return []

    @property
    def peak_is_rss(self) -> bool:
        """The peak is the process's resident set (the tensor tracker could not follow the run),
        not its tracked tensors: not the quantity the planner predicts."""
        run = next((r for r in self.finished_runs if r.peak_bytes_per_rank), None)
        return run is not None and "RSS" in (run.peak_source or "")

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k != "runs"}
        d.update(status=self.status, reason=self.reason, tokens_per_s=self.tokens_per_s,
                 tokens_per_s_runs=[r.tokens_per_s for r in self.measured],
                 peak_bytes_per_rank=self.peak_bytes_per_rank, peak_is_rss=self.peak_is_rss,
                 runs=[r.to_dict() for r in self.runs])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trial":
        names = ("id", "key", "name", "baseline", "knobs", "folder", "predicted_before", "predicted_peak_bytes",
                 "predicted_after")
        runs = [Run(**{k: v for k, v in r.items() if k in Run.__dataclass_fields__}) for r in d.get("runs", [])]
        return cls(**{k: d.get(k) for k in names}, runs=runs)


def fingerprint(cfg, nproc: int, device: str, global_batch: int, seq_len: int) -> dict[str, Any]:
    """The setup a tune folder belongs to (module docstring)."""
    d = cfg.model_dump(mode="json")
    for section in PER_RUN_SECTIONS:
        d.pop(section, None)
    for section, keys in VARIED.items():
        for key in keys:
            d.get(section, {}).pop(key, None)
    d["parallel"].pop("nproc", None)
    return {"config": d, "nproc": nproc, "device": device, "global_batch": global_batch, "seq_len": seq_len}


def load(path: Path, expected: dict[str, Any]) -> list[Trial]:
    """The trials of an earlier tune in the same folder (none for a new folder); an interrupted
    run is dropped, to run again."""
    if not path.exists():
        return []
    try:
        data = json.loads(read_text(path, "tune.json", MAX_STATE_BYTES))
        saved, trials = data["setup"], [Trial.from_dict(t) for t in data["trials"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a tune.json this version can resume ({type(e).__name__}: {e}); "
                        "use another --out or remove it") from None
    if saved != expected:
        what = ", ".join(k for k in expected if saved.get(k) != expected[k])
        raise UserError(f"{path.parent}: holds a tune of another setup (different {what}); its trials do not "
                        "measure this run. Use another --out, or remove the folder to start over")
    for t in trials:
        t.runs = t.finished_runs
    return [t for t in trials if t.runs]


def save(path: Path, document: dict[str, Any]) -> None:
    """Whole or not at all: a temporary file, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(document, indent=1, default=str))
    tmp.replace(path)
