"""Hardware catalog: dense peak FLOP/s per dtype, memory, bandwidths, each with its source.

Conventions (stated once, used everywhere):
- `peak_flops[dtype]` is the DENSE (no 2:4 sparsity) tensor-core peak for bf16/fp16 and the
  plain FP32 (non-TF32) peak for fp32, because PyTorch runs fp32 matmuls without TF32 by
  default (`torch.backends.cuda.matmul.allow_tf32 = False` since 1.12). `None` = unsupported.
  `peak_flops["fp8"]` is the dense float8 (e4m3/e5m2) tensor-core peak with fp32 accumulation,
  what `torch._scaled_mm` runs for `tenfold train --fp8`; datasheets print it "with sparsity",
  twice the dense figure, which is halved here. GPUs without float8 tensor cores (before
  compute capability 8.9: V100, A100) have none.
- `memory_bytes` is the device capacity in bytes (the "80 GB" of an A100 is 80 GiB).
- `intra_node_bw` is the per-GPU, one-direction NVLink/fabric bandwidth in bytes/s (NVLink3
  on A100 is 600 GB/s bidirectional = 300 GB/s each way). `nic_bw` is the per-GPU network
  bandwidth (one 200 Gb/s HDR NIC per GPU on a DGX A100 = 25 GB/s).
- Collectives reach `bus_efficiency` (0.8, an assumption) of those link rates: NVIDIA's
  nccl-tests report ~230 GB/s all-reduce bus bandwidth on an 8xA100 NVLink3 node (~0.77).
  Latencies are NCCL's own tuning model (`src/graph/tuning.cc`, Simple protocol, ring): 8.4 us
  per collective, 3.4 us per NVLink hop, 9.6 us per network hop.
- `matmul_fraction` is the Maximum Achievable Matmul FLOPS (MAMF: the best of a brute-force
  search over GEMM shapes, bf16, mean of 100 runs) over the datasheet peak, as measured in Stas
  Bekman's "Machine Learning Engineering" (github.com/stas00/ml-engineering,
  compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table"): A100 SXM
  271.2 of 312 TFLOP/s, H100 SXM 794.5 of 989 (H200 the same), B200 1745 of 2250, MI300X 668.4
  of 1300. Datasheet peaks are clock x units; no GEMM reaches them, and the newer the chip the
  further below it stays. Where no measurement is published the A100 SXM's share is assumed.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from tenfold.errors import UserError
from tenfold.plan.cpu_peak import MEASURED_DTYPES, cached_peak, cpu_model_name, machine_threads, measured_peak, read_cache
from tenfold.plan.cpu_peak import cache_path as cpu_peak_path
from tenfold.plan.hardware_file import DTYPES, PLAIN_KEYS, SCALED_KEYS, read_hardware_file

GiB = 2**30
PEAK_DTYPES = ("fp32", "bf16", "fp16", "fp8")  # the keys of Hardware.peak_flops (fp8: float8 matmuls, --fp8)
GB = 1e9
TFLOPS = 1e12

# One GEMM-efficiency ceiling for all GPUs, as a share of the chip's Maximum Achievable Matmul
# FLOPS (MAMF, below): what a large, well-shaped transformer GEMM in a training step reaches of
# the best isolated matmul. Calibrated ONLY on Narayanan et al. 2021 Table 1 (A100; see
# tenfold/plan/calibration.py and docs/planner.md); the shape, roofline and communication
# effects are modelled, not fitted. A GPU's ceiling of its datasheet peak is this times its
# `matmul_fraction` (A100 SXM: 0.816 x 0.869 = 0.709).
GEMM_SHARE_OF_MAMF = 0.816
A100_MAMF_FRACTION = 271.2 / 312  # the default where no MAMF is published


@dataclass(frozen=True, eq=False)  # hashed by identity: the planner caches per-hardware results
class Hardware:
    name: str
    peak_flops: dict[str, float | None]  # dense FLOP/s per dtype: fp32, bf16, fp16, fp8 (float8 matmuls)
    memory_bytes: float
    hbm_bw: float  # bytes/s
    intra_node_bw: float  # bytes/s, per GPU, one direction
    nic_bw: float  # bytes/s, per GPU, one direction
    gpus_per_node: int = 8
    intra_latency_s: float = 3.4e-6  # per ring step over NVLink (NCCL tuning.cc, Simple protocol)
    inter_latency_s: float = 9.6e-6  # per ring step across the network (idem)
    collective_latency_s: float = 8.4e-6  # once per collective (NCCL's base latency, ring/Simple)
    host_link_bw: float = 25 * GB  # PCIe to host memory, per GPU (offload traffic)
    bus_efficiency: float = 0.8
    gemm_efficiency: float = GEMM_SHARE_OF_MAMF * A100_MAMF_FRACTION  # of the datasheet peak
    matmul_fraction: float = A100_MAMF_FRACTION  # MAMF / datasheet peak (sources["matmul"])
    runtime_overhead_bytes: float = 1.0 * GiB  # CUDA context + NCCL/cuBLAS workspaces (estimate)
    host_memory_bytes: float = 2.0 * 2**40  # per node, for offload (DGX A100/H100: 2 TB; an assumption elsewhere)
    shared_compute: bool = False  # True for `cpu`: ranks on one machine share its cores
    sm_count: int = 0  # streaming multiprocessors (wave quantization of GEMM tiles); 0 = ignore
    # Measured on a machine by `tenfold tune` (empty / 0: not measured, the datasheet model applies):
    achieved_matmul_flops: dict[str, float] = field(default_factory=dict)  # FLOP/s a step's large GEMMs reach, per dtype
    step_overhead_s: float = 0.0  # per optimizer step, outside the modelled work (Python, data, logging)
    microbatch_overhead_s: float = 0.0  # per micro-batch (operator dispatch, autograd bookkeeping)
    sources: dict[str, str] = field(default_factory=dict)
    # `cpu`: measures a dtype's peak the first time a prediction needs it (tenfold.plan.cpu_peak),
    # so that what needs no peak (memory, --dry-run) never waits on a measurement
    measure_peak: Callable[[str], float] | None = field(default=None, repr=False)

    def gemm_peak(self, dtype: str) -> float:
        """The FLOP/s GEMMs are priced against (time.gemm_efficiency then applies the ceiling):
        the datasheet peak, or where this machine's achieved matmul rate was measured, the rate
        that gives exactly it (MFU is always against `peak`)."""
        achieved = self.achieved_matmul_flops.get(dtype)
        return achieved / self.gemm_efficiency if achieved else self.peak(dtype)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s of matmuls in `dtype`: fp32, bf16, fp16, or fp8 (the float8 matmuls
        of `tenfold train --fp8`; the rest of such a step runs at the bf16 rate)."""
        value = self.peak_flops.get(dtype)
        if not value and self.measure_peak is not None and dtype in MEASURED_DTYPES:
            value = self.peak_flops[dtype] = self.measure_peak(dtype)
        if not value and dtype == "fp8":
            with_fp8 = [name for name, hw in CATALOG.items() if hw.peak_flops.get("fp8")]
            why = self.sources.get("fp8", "none given")
            raise UserError(f"--fp8: {self.name} has no float8 matmul peak ({why}); GPUs with one: {', '.join(with_fp8)}")
        if not value:
            allowed = [k for k, v in self.peak_flops.items() if v and k != "fp8"]
            raise UserError(
                f"--precision {dtype} is not supported on {self.name} (no {dtype} peak); allowed: {', '.join(allowed)}"
            )
        return float(value)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "measure_peak"}


_NV = "NVIDIA datasheet"


_MAMF = "Bekman, ml-engineering, MAMF table (bf16 matmul, brute-force shape search)"
_NO_FP8 = "no float8 tensor cores: compute capability < 8.9"
_NO_MAMF = "no MAMF measurement published; the A100 SXM's 271.2/312 = 0.869 assumed"


def _gpu(name, fp32, bf16, fp16, mem_gib, hbm_gbs, intra_gbs, nic_gbs, sources, matmul_fraction=None, fp8=None,
         **kw) -> Hardware:
    fraction = A100_MAMF_FRACTION if matmul_fraction is None else matmul_fraction
    sources = {**sources, "matmul": sources.get("matmul", _NO_MAMF), "fp8": sources.get("fp8", _NO_FP8)}
    return Hardware(
        name=name,
        peak_flops={"fp32": fp32 * TFLOPS, "bf16": bf16 * TFLOPS if bf16 else None, "fp16": fp16 * TFLOPS,
                    "fp8": fp8 * TFLOPS if fp8 else None},
        memory_bytes=mem_gib * GiB, hbm_bw=hbm_gbs * GB, intra_node_bw=intra_gbs * GB,
        nic_bw=nic_gbs * GB, sources=sources, matmul_fraction=fraction,
        gemm_efficiency=GEMM_SHARE_OF_MAMF * fraction, **kw,
    )


_PCIE4 = "PCIe Gen4 x16 to the host: 32 GB/s each way raw, ~25 GB/s achievable"
_PCIE5 = "PCIe Gen5 x16 to the host: 64 GB/s each way raw, ~50 GB/s achievable"

CATALOG: dict[str, Hardware] = {
    "v100": _gpu("v100", 15.7, None, 125, 32, 900, 150, 12.5, {
        "peak": f"{_NV} Tesla V100 SXM2: 15.7 TFLOPS FP32, 125 TFLOPS tensor (fp16); no bf16",
        "memory": f"{_NV}: 32 GB HBM2, 900 GB/s",
        "intra": "NVLink2: 300 GB/s bidirectional per GPU = 150 GB/s each way",
        "nic": "DGX-1: 4x 100 Gb/s EDR for 8 GPUs = 12.5 GB/s per GPU (one 100Gb NIC per 2 GPUs, rounded up)",
        "sms": "NVIDIA Volta whitepaper: 80 SMs (Tesla V100)",
        "host": "PCIe Gen3 x16 to the host: 16 GB/s each way raw, ~12 GB/s achievable",
    }, sm_count=80, host_link_bw=12 * GB),
    "a100-40gb": _gpu("a100-40gb", 19.5, 312, 312, 40, 1555, 300, 25, {
        "peak": f"{_NV} A100 SXM: 19.5 TFLOPS FP32, 312 TFLOPS bf16/fp16 dense (Narayanan 2021: 312)",
        "memory": f"{_NV}: 40 GB HBM2, 1555 GB/s (llm-analysis gpu_configs agree)",
        "intra": "NVLink3: 600 GB/s bidirectional = 300 GB/s each way (llm-analysis: 300)",
        "nic": "DGX A100: 8x 200 Gb/s HDR, one per GPU = 25 GB/s",
        "sms": "NVIDIA Ampere GA100 whitepaper: 108 SMs (A100)",
        "host": _PCIE4,
        "matmul": f"{_MAMF}: A100 SXM 271.2 of 312 TFLOP/s = 0.869",
    }, sm_count=108, matmul_fraction=271.2 / 312),
    "a100-80gb": _gpu("a100-80gb", 19.5, 312, 312, 80, 2039, 300, 25, {
        "peak": f"{_NV} A100 SXM: 19.5 TFLOPS FP32, 312 TFLOPS bf16/fp16 dense",
        "memory": f"{_NV} A100 80GB SXM: 80 GB HBM2e, 2039 GB/s",
        "intra": "NVLink3: 600 GB/s bidirectional = 300 GB/s each way",
        "nic": "DGX A100: 8x 200 Gb/s HDR, one per GPU = 25 GB/s",
        "sms": "NVIDIA Ampere GA100 whitepaper: 108 SMs (A100)",
        "host": _PCIE4,
        "matmul": f"{_MAMF}: A100 SXM 271.2 of 312 TFLOP/s = 0.869",
    }, sm_count=108, matmul_fraction=271.2 / 312),
    "h100-sxm": _gpu("h100-sxm", 67, 989, 989, 80, 3350, 450, 50, {
        "peak": f"{_NV} H100 SXM5: 67 TFLOPS FP32, 989 TFLOPS bf16/fp16 dense (torchtitan get_peak_flops: 989e12)",
        "memory": f"{_NV}: 80 GB HBM3, 3.35 TB/s",
        "intra": "NVLink4: 900 GB/s bidirectional = 450 GB/s each way",
        "nic": "DGX H100: 8x 400 Gb/s NDR ConnectX-7, one per GPU = 50 GB/s",
        "sms": "NVIDIA Hopper whitepaper: 132 SMs (H100 SXM5)",
        "host": _PCIE5,
        "matmul": f"{_MAMF}: H100 SXM 794.5 of 989 TFLOP/s = 0.803",
        "fp8": f"{_NV} H100 SXM5: FP8 Tensor Core 3,958 TFLOPS with sparsity = 1,979 dense",
    }, sm_count=132, host_link_bw=50 * GB, matmul_fraction=794.5 / 989, fp8=1979),
    "h100-pcie": _gpu("h100-pcie", 51, 756, 756, 80, 2000, 64, 25, {
        "peak": f"{_NV} H100 PCIe: 51 TFLOPS FP32, 756 TFLOPS bf16/fp16 dense (torchtitan: 756e12)",
        "memory": f"{_NV}: 80 GB HBM2e, 2.0 TB/s",
        "intra": "PCIe Gen5 x16: 64 GB/s each way (no NVLink bridge assumed)",
        "nic": "assumed one 200 Gb/s NIC per GPU = 25 GB/s",
        "sms": "NVIDIA Hopper whitepaper: 114 SMs (H100 PCIe)",
        "host": _PCIE5,
        "fp8": f"{_NV} H100 PCIe: FP8 Tensor Core 3,026 TFLOPS with sparsity = 1,513 dense",
    }, host_link_bw=50 * GB, sm_count=114, fp8=1513),
    "h200": _gpu("h200", 67, 989, 989, 141e9 / GiB, 4800, 450, 50, {
        "peak": f"{_NV} H200 SXM: same compute as H100 SXM, 989 TFLOPS bf16 dense (torchtitan: 989e12)",
        "memory": "141 GB HBM3e (MLCommons v4.1 system JSON); 4.8 TB/s [secondary: TensorRT-LLM #1570]",
        "intra": "NVLink4: 900 GB/s bidirectional = 450 GB/s each way",
        "nic": "8x 400 Gb/s NDR, one per GPU = 50 GB/s",
        "sms": "same GH100 die as H100 SXM5: 132 SMs",
        "host": _PCIE5,
        "matmul": f"{_MAMF}: H100 SXM 794.5 of 989 TFLOP/s, 'H200 is the same' = 0.803",
        "fp8": f"{_NV} H200 SXM: FP8 Tensor Core 3,958 TFLOPS with sparsity = 1,979 dense",
    }, sm_count=132, host_link_bw=50 * GB, matmul_fraction=794.5 / 989, fp8=1979),
    "b200": _gpu("b200", 75, 2250, 2250, 180e9 / GiB, 8000, 900, 50, {
        "peak": f"{_NV} HGX B200: 2.25 PFLOPS bf16 dense per GPU (torchtitan: 2.25e15); FP32 600 TFLOPS / 8 GPUs",
        "memory": f"{_NV} HGX B200: 1.44 TB for 8 GPUs = 180 GB each, 8 TB/s",
        "intra": "NVLink5: 1.8 TB/s bidirectional = 900 GB/s each way",
        "nic": "8x 400 Gb/s ConnectX-7, one per GPU = 50 GB/s",
        "sms": "148 SMs (B200; as reported by CUDA device queries)",
        "host": _PCIE5,
        "matmul": f"{_MAMF}: B200 SXM 1745.0 of 2250 TFLOP/s = 0.776",
        "fp8": f"{_NV} HGX B200: FP8 Tensor Core 72 PFLOPS with sparsity for 8 GPUs = 4.5 PFLOPS dense per GPU",
    }, host_link_bw=50 * GB, sm_count=148, matmul_fraction=1745.0 / 2250, fp8=4500),
    "mi300x": _gpu("mi300x", 163.4, 1307.4, 1307.4, 192e9 / GiB, 5300, 448, 50, {
        "peak": "AMD Instinct MI300X datasheet: 1307.4 TFLOPS bf16/fp16 dense, 163.4 TFLOPS FP32 matrix (torchtitan: 1300e12)",
        "memory": "AMD datasheet: 192 GB HBM3, 5.3 TB/s",
        "intra": "Infinity Fabric: 7 links x 64 GB/s = 448 GB/s each way",
        "nic": "assumed one 400 Gb/s NIC per GPU = 50 GB/s",
        "sms": "AMD CDNA3 whitepaper: 304 compute units",
        "host": _PCIE5,
        "matmul": f"{_MAMF}: MI300X 668.4 of 1300 TFLOP/s = 0.514 (ROCm 6.3, TunableOp on)",
        "fp8": "none listed: `tenfold train --fp8` runs on NVIDIA GPUs of compute capability >= 8.9 only",
    }, host_link_bw=50 * GB, sm_count=304, matmul_fraction=668.4 / 1300),
    "l40s": _gpu("l40s", 91.6, 362, 362, 48e9 / GiB, 864, 32, 25, {
        "peak": f"{_NV} L40S: 91.6 TFLOPS FP32, 362 TFLOPS bf16/fp16 dense (733 with sparsity)",
        "memory": f"{_NV}: 48 GB GDDR6, 864 GB/s",
        "intra": "PCIe Gen4 x16: 32 GB/s each way (no NVLink)",
        "nic": "assumed one 200 Gb/s NIC per GPU = 25 GB/s",
        "sms": "NVIDIA Ada whitepaper: 142 SMs (L40S)",
        "host": _PCIE4,
        "fp8": f"{_NV} L40S: FP8 Tensor Core 1,466 TFLOPS with sparsity = 733 dense",
    }, sm_count=142, fp8=733),
    "rtx4090": _gpu("rtx4090", 82.6, 165.2, 165.2, 24e9 / GiB, 1008, 32, 12.5, {
        "peak": f"{_NV} Ada whitepaper, RTX 4090: 82.6 TFLOPS FP32, 165.2 TFLOPS bf16/fp16 with fp32 accumulate (dense)",
        "memory": "24 GB GDDR6X, 1008 GB/s",
        "intra": "PCIe Gen4 x16: 32 GB/s each way, no peer-to-peer (assumed through host)",
        "nic": "assumed 100 Gb/s Ethernet = 12.5 GB/s",
        "sms": "NVIDIA Ada whitepaper: 128 SMs (RTX 4090)",
        "host": _PCIE4,
        "fp8": "NVIDIA Ada whitepaper, RTX 4090: 330.3 TFLOPS FP8 with fp32 accumulate (dense; torch._scaled_mm accumulates in fp32)",
    }, sm_count=128, fp8=330.3),
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "a100-80": "a100-80gb", "a100-40": "a100-40gb", "4090": "rtx4090"}

# Rough constants for `cpu` (stated as such): gloo over loopback moves ~2 GB/s with ~50 us per
# message; eager PyTorch elementwise kernels (norms, casts, SwiGLU, Adam) stream ~10 GB/s on a
# few cores, far below the DRAM bandwidth (small tensors, per-op dispatch, bf16 conversions).
# 10 GB/s is fitted to `tenfold ladder --quick` on a 2-core EPYC (docs/benchmarks.md): the six
# rungs' measured/predicted tokens/s were 0.85-1.30 with it, 1.26-2.18 with the 5 GB/s used
# before RMSNorm and RoPE lost their extra kernels (tenfold/models/gpt.py).
CPU_LOOPBACK_BW = 2 * GB
CPU_LOOPBACK_LATENCY_S = 50e-6
CPU_MEMORY_BW = 10 * GB


def _cpu_peaks() -> dict[str, float]:
    """The dtypes whose peak this machine has cached (tenfold.plan.cpu_peak); the others are
    measured when a prediction first needs one (Hardware.measure_peak)."""
    cache = read_cache()
    return {d: v for d in MEASURED_DTYPES if (v := cached_peak(d, machine_threads(), cache)) is not None}


def _ram_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_hardware() -> Hardware:
    """This machine: measured GEMM peak per dtype (cached, or measured when first needed), its
    RAM, rough loopback constants."""
    return Hardware(
        name="cpu", peak_flops=_cpu_peaks(), measure_peak=measured_peak, memory_bytes=_ram_bytes(), hbm_bw=CPU_MEMORY_BW,
        intra_node_bw=CPU_LOOPBACK_BW, nic_bw=CPU_LOOPBACK_BW, gpus_per_node=os.cpu_count() or 1,
        intra_latency_s=CPU_LOOPBACK_LATENCY_S, inter_latency_s=CPU_LOOPBACK_LATENCY_S, collective_latency_s=0.0,
        host_link_bw=CPU_MEMORY_BW, bus_efficiency=1.0,
        gemm_efficiency=1.0, matmul_fraction=1.0,  # the peak is itself a measured large GEMM
        runtime_overhead_bytes=0.0, shared_compute=True, host_memory_bytes=_ram_bytes(),
        sources={
            "peak": f"measured by `python -m tenfold.engine.observe.peak` on {cpu_model_name()}, {machine_threads()} threads "
                    f"(cached in {cpu_peak_path()})",
            "memory": "MemTotal from /proc/meminfo",
            "intra": "rough constant: gloo over loopback ~2 GB/s, 50 us per message",
            "nic": "rough constant: gloo over loopback ~2 GB/s",
            "matmul": "the measured peak is itself the best GEMM: 1.0",
        },
    )


def load_hardware_toml(path: str | os.PathLike) -> Hardware:
    """User-defined hardware (tenfold.plan.hardware_file: the keys, what each takes) as a
    `Hardware`. `matmul_fraction` (measured best matmul / peak) sets the GEMM ceiling as the
    catalog does; `gemm_efficiency` sets it directly. What `tenfold tune` measures: [achieved_matmul_tflops] per dtype, step_overhead_s,
    microbatch_overhead_s (and shared_compute for CPU ranks that share one machine's cores;
    `hardware_toml` writes every key read here)."""
    f = read_hardware_file(path)
    extra = {key: getattr(f, key) for key in PLAIN_KEYS if getattr(f, key) is not None}
    for key, (field_name, scale) in SCALED_KEYS.items():
        if getattr(f, key) is not None:
            extra[field_name] = getattr(f, key) * scale
    if f.matmul_fraction is not None and f.gemm_efficiency is None:
        extra["gemm_efficiency"] = GEMM_SHARE_OF_MAMF * f.matmul_fraction
    if f.shared_compute is not None:
        extra["shared_compute"] = f.shared_compute
    achieved = {d: v * TFLOPS for d in DTYPES if (v := getattr(f.achieved_matmul_tflops, d))}
    if achieved:
        extra["achieved_matmul_flops"] = achieved
    peaks = {d: (v * TFLOPS if (v := getattr(f.peak_tflops, d)) else None) for d in DTYPES}
    if f.peak_tflops.fp8:  # only where given (most files predate it)
        peaks["fp8"] = f.peak_tflops.fp8 * TFLOPS
    return Hardware(name=f.name, peak_flops=peaks, memory_bytes=f.memory_gb * GB, hbm_bw=f.hbm_gbs * GB,
                    intra_node_bw=f.intra_node_gbs * GB, nic_bw=f.nic_gbs * GB,
                    sources={"file": str(Path(path)), **f.sources}, **extra)


def hardware_toml(hw: Hardware) -> str:
    """`hw` as a hardware file: every key `load_hardware_toml` reads, so that reading it back
    gives the same machine (`tenfold tune` saves the machine it calibrated this way)."""
    import tomli_w

    data: dict = {"name": hw.name, "memory_gb": hw.memory_bytes / GB, "hbm_gbs": hw.hbm_bw / GB,
                  "intra_node_gbs": hw.intra_node_bw / GB, "nic_gbs": hw.nic_bw / GB,
                  "shared_compute": hw.shared_compute}
    data.update({key: getattr(hw, key) for key in PLAIN_KEYS})
    data.update({key: getattr(hw, name) / scale for key, (name, scale) in SCALED_KEYS.items()})
    data["peak_tflops"] = {d: hw.peak_flops[d] / TFLOPS for d in PEAK_DTYPES if hw.peak_flops.get(d)}
    if hw.achieved_matmul_flops:
        data["achieved_matmul_tflops"] = {d: v / TFLOPS for d, v in hw.achieved_matmul_flops.items()}
    data["sources"] = {k: v for k, v in hw.sources.items() if k != "file"}
    return tomli_w.dumps(data)


def get_hardware(name: str | Hardware) -> Hardware:
    if isinstance(name, Hardware):
        return name
    key = name.lower()
    key = ALIASES.get(key, key)
    if key == "cpu":
        return cpu_hardware()
    if key in CATALOG:
        return CATALOG[key]
    if key.endswith(".toml") or os.sep in name or os.path.exists(name):  # a file, whatever its name
        return load_hardware_toml(name)
    raise UserError(f"unknown --gpu {name!r}; allowed: {', '.join([*CATALOG, 'cpu'])} or a .toml file")


def with_gpus_per_node(hw: Hardware, gpus_per_node: int | None) -> Hardware:
    return hw if not gpus_per_node else replace(hw, gpus_per_node=gpus_per_node)


_DEVICE_PATTERNS = [  # (substring of torch.cuda.get_device_name().lower(), catalog key); first match wins
    ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("h200", "h200"), ("gh200", "h200"), ("b200", "b200"),
    ("a100", "a100-80gb"), ("v100", "v100"), ("mi300x", "mi300x"), ("l40s", "l40s"), ("4090", "rtx4090"),
]


def catalog_name_for_device(device_name: str) -> str | None:
    """Catalog key for a CUDA/ROCm device name ("NVIDIA A100-SXM4-40GB" -> "a100-40gb"), or None."""
    name = device_name.lower()
    for pattern, key in _DEVICE_PATTERNS:
        if pattern in name:
            if key == "a100-80gb" and "40gb" in name:
                return "a100-40gb"
            return key
    return None


def gpu_peak_flops_for_device(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of a named GPU for `dtype` (the engine's MFU denominator), or None
    when the device is not in the catalog or lacks that dtype."""
    key = catalog_name_for_device(device_name)
    if key is None:
        return None
    value = CATALOG[key].peak_flops.get(dtype)
    return float(value) if value else None
