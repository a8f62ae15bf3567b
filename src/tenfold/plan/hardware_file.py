"""`--hardware-file FILE.toml`: a machine the catalog lacks, or the one `tenfold tune` calibrated.

The file is typed as strictly as a run config (tenfold.config): every number finite, every
physical quantity (memory, bandwidth, peak) positive, an efficiency in (0, 1], a count an
integer, `shared_compute` true or false, text where text is meant; a string is never read as a
number, nor a number as text. A wrong value is one line naming the key and what it takes; an
unknown key is refused with the keys allowed.

    name = "my-gpu"                 memory_gb = 80      hbm_gbs = 2039
    intra_node_gbs = 300            nic_gbs = 25        [peak_tflops] bf16 = 312, fp32 = 19.5
    optional: gpus_per_node, sm_count, latencies (s), efficiencies, matmul_fraction, host_link_gbs,
    host_memory_gb, runtime_overhead_gb, shared_compute, [achieved_matmul_tflops], step_overhead_s,
    microbatch_overhead_s, [sources]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tenfold.config import tomllib
from tenfold.errors import UserError
from tenfold.textfiles import read_text

Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
Share = Annotated[float, Field(gt=0, le=1)]
DTYPES = ("fp32", "bf16", "fp16")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


class PerDtype(_Strict):
    """TFLOP/s per dtype (a dtype left out is not supported / not measured); fp8: the dense
    float8 matmul peak (`tenfold train --fp8`)."""

    fp32: Positive | None = None
    bf16: Positive | None = None
    fp16: Positive | None = None
    fp8: Positive | None = None


class HardwareFile(_Strict):
    name: Annotated[str, Field(min_length=1)]
    memory_gb: Positive
    hbm_gbs: Positive
    intra_node_gbs: Positive
    nic_gbs: Positive
    peak_tflops: PerDtype
    gpus_per_node: Annotated[int, Field(gt=0)] | None = None
    sm_count: Annotated[int, Field(ge=0)] | None = None
    intra_latency_s: NonNegative | None = None
    inter_latency_s: NonNegative | None = None
    collective_latency_s: NonNegative | None = None
    bus_efficiency: Share | None = None
    gemm_efficiency: Share | None = None
    matmul_fraction: Share | None = None
    host_link_gbs: Positive | None = None
    host_memory_gb: Positive | None = None
    runtime_overhead_gb: NonNegative | None = None
    shared_compute: bool | None = None
    achieved_matmul_tflops: PerDtype = PerDtype()
    step_overhead_s: NonNegative | None = None
    microbatch_overhead_s: NonNegative | None = None
    sources: dict[str, str] = {}


# What each kind of value takes, for the one-line message (by key; the rest by their type).
_TAKES = {"name": "a non-empty text", "gpus_per_node": "a positive integer", "sm_count": "a non-negative integer",
          "shared_compute": "true or false", "sources": "a table of texts (key = \"where the figure comes from\")",
          "peak_tflops": "a table of fp32, bf16, fp16, fp8 = positive TFLOP/s",
          "achieved_matmul_tflops": "a table of fp32, bf16, fp16 = positive TFLOP/s"}
for _key in ("memory_gb", "hbm_gbs", "intra_node_gbs", "nic_gbs", "host_link_gbs", "host_memory_gb"):
    _TAKES[_key] = "a finite positive number"
for _key in ("intra_latency_s", "inter_latency_s", "collective_latency_s", "runtime_overhead_gb", "step_overhead_s",
             "microbatch_overhead_s"):
    _TAKES[_key] = "a finite non-negative number"
for _key in ("bus_efficiency", "gemm_efficiency", "matmul_fraction"):
    _TAKES[_key] = "a number in (0, 1]"
REQUIRED = ("name", "memory_gb", "hbm_gbs", "intra_node_gbs", "nic_gbs", "peak_tflops")


def _message(err: ValidationError, where: str) -> str:
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    if first["type"] == "missing":
        missing = [str(e["loc"][0]) for e in err.errors() if e["type"] == "missing" and len(e["loc"]) == 1]
        return f"{where}: missing key(s) {', '.join(missing or loc)}; required: {', '.join(REQUIRED)}"
    if first["type"] == "extra_forbidden":
        if len(loc) > 1:
            return f"{where}: [{loc[0]}] takes {', '.join(PerDtype.model_fields)}, not {loc[-1]!r}"
        return f"{where}: unknown key {loc[0]!r}; allowed: {', '.join(HardwareFile.model_fields)}"
    key = loc[0]
    name = f"[{key}] {loc[1]}" if len(loc) > 1 and key in ("peak_tflops", "achieved_matmul_tflops") else ".".join(loc)
    takes = "a finite positive number (TFLOP/s)" if name.startswith("[") else _TAKES.get(key, "another value")
    if key == "sources" and len(loc) > 1:
        takes = "text"
    return f"{where}: {name} must be {takes}, got {first.get('input')!r}"


def read_hardware_file(path: str | os.PathLike) -> HardwareFile:
    """The file, parsed and typed, or one UserError line."""
    where = f"--hardware-file {path}"
    text = read_text(path, "--hardware-file")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{where}: invalid TOML ({exc})") from None
    try:
        parsed = HardwareFile.model_validate(data)
    except ValidationError as err:
        raise UserError(_message(err, where)) from None
    if not any(getattr(parsed.peak_tflops, d) for d in DTYPES):
        raise UserError(f"{where}: [peak_tflops] needs at least one of fp32, bf16, fp16")
    return parsed


# Optional keys: name -> Hardware field of the same name, or (field, scale to the field's unit).
PLAIN_KEYS = ("gpus_per_node", "intra_latency_s", "inter_latency_s", "collective_latency_s", "bus_efficiency",
              "gemm_efficiency", "matmul_fraction", "sm_count", "step_overhead_s", "microbatch_overhead_s")
SCALED_KEYS = {"host_link_gbs": ("host_link_bw", 1e9), "host_memory_gb": ("host_memory_bytes", 1e9),
               "runtime_overhead_gb": ("runtime_overhead_bytes", 1e9)}
