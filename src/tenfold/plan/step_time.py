"""One optimizer step's time, assembled: every micro-batch on the slowest pipeline stage
(time.py's layer times), the pipeline bubble, the offload traffic over the host link, the
DP/ZeRO collectives with what really overlaps them (dp_time.py), and the optimizer step.
`api.predict` calls `step_time`; docs/planner.md "Step time" lists every term with its source.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenfold.errors import UserError
from tenfold.plan import comm, dp_time, memory
from tenfold.plan import time as tm
from tenfold.plan.flops import model_flops_per_token, recompute_flops_per_token, recomputed_layers, regathered_layers
from tenfold.plan.hardware import Hardware
from tenfold.plan.shape import ModelShape, layer_params, layers_on_stage, stage_params
from tenfold.plan.strategy import Resolved


@dataclass
class TimeBreakdown:
    compute_s: float  # forward + backward of all micro-batches on the slowest stage, no bubble
    recompute_s: float
    tp_comm_s: float
    pp_comm_s: float
    host_transfer_s: float  # offload traffic that compute does not hide
    bubble_s: float
    dp_comm_s: float  # total DP/ZeRO collective time
    dp_comm_exposed_s: float
    optimizer_s: float
    step_s: float
    bubble_fraction: float
    source: str  # "model" or "achieved_tflops"


@dataclass
class MicroBatch:
    """One micro-batch on the slowest pipeline stage (seconds), and that stage's layers."""

    fwd: float
    bwd: float
    rc: float  # recompute
    tpc: float  # exposed TP all-reduces
    ppc: float  # pipeline sends
    host: float  # exposed offload traffic
    stage: int = 0
    layers: int = 0
    layer_fwd: float = 0.0  # one layer's forward window (compute + TP), what hides a prefetch
    layer_bwd: float = 0.0  # one layer's backward window (backward + recompute + TP)


def compute_share(hw: Hardware, gpus: int) -> float:
    """Ranks on one CPU share its cores (the measured peak is for the whole machine)."""
    return 1.0 / min(gpus, hw.gpus_per_node) if hw.shared_compute else 1.0


def step_flops(shape: ModelShape, r: Resolved, tr) -> tuple[float, float]:
    """(model FLOPs, model + recompute FLOPs) of one optimizer step."""
    cfg = shape.cfg
    tokens_step = r.global_batch * r.seq_len
    if cfg is not None:
        model = model_flops_per_token(cfg, r.seq_len) * tokens_step
        rc = recompute_flops_per_token(cfg, r.seq_len, r.policy) * tokens_step
    else:
        model = 6.0 * shape.params * tokens_step
        rc = (2.0 * shape.params * tokens_step) if r.policy.kind == "full" else 0.0
    tr("model_flops_per_step", model, "(6N + 12 L s d) x tokens (N = matmul params incl. output layer)",
       "Kaplan et al. 2020; PaLM App. B; nanoGPT estimate_mfu")
    tr("recompute_flops_per_step", rc, "full: +1 forward per layer; selective: +4 s h per layer; every:N / segments:K: their share",
       "Narayanan Eq. (3) (96 vs 72); Korthikanti Eq. (8)")
    return model, model + rc


def step_time(shape: ModelShape, hw: Hardware, r: Resolved, tr) -> tuple[TimeBreakdown, float, float]:
    s = r.s
    model_flops, hw_flops = step_flops(shape, r, tr)
    if s.achieved_tflops is not None:
        if s.achieved_tflops <= 0:
            raise UserError(f"--achieved-tflops must be positive, got {s.achieved_tflops}")
        step = hw_flops / (r.gpus * s.achieved_tflops * 1e12)
        tr("step_time_s", step, "(model + recompute FLOPs) / (gpus x X)", "Narayanan et al. 2021 Eq. (4): 8TP/(nX)")
        return TimeBreakdown(step, 0, 0, 0, 0, 0, 0, 0, 0, step, 0, "achieved_tflops"), model_flops, hw_flops
    peak = hw.peak(s.precision) * compute_share(hw, r.gpus)
    m = r.grad_accum
    mb = microbatch(shape, hw, r, peak)
    t_mb = mb.fwd + mb.bwd + mb.rc + mb.tpc + mb.host + mb.ppc
    bubble = (s.pp - 1) / r.v * t_mb * bubble_factor(s.pp_schedule) if s.pp > 1 else 0.0
    dp = dp_time.dp_step_comm(s.zero, stage_work(shape, r, mb), hw,
                              comm.group_layout(r.dp, s.tp, hw.gpus_per_node), s.overlap_comm)
    n_params = max(stage_params(shape, s.pp, st, s.tp) for st in {0, s.pp - 1})
    on_rank = n_params / (r.dp if s.zero >= 1 else 1)
    pcie = (4.0 if s.zero == 1 else 2.0) if s.offload != "none" else 0.0  # 16-bit grads down (ZeRO-1) + params up
    opt = tm.optimizer_step_time(on_rank, hw, s.offload != "none", min(r.gpus, hw.gpus_per_node), pcie)
    step = m * t_mb + bubble + dp.exposed_s + opt
    _trace_time(tr, r, hw, mb, bubble, dp, opt, step)
    t = TimeBreakdown(
        compute_s=m * (mb.fwd + mb.bwd), recompute_s=m * mb.rc, tp_comm_s=m * mb.tpc, pp_comm_s=m * mb.ppc,
        host_transfer_s=m * mb.host, bubble_s=bubble, dp_comm_s=dp.total_s, dp_comm_exposed_s=dp.exposed_s,
        optimizer_s=opt, step_s=step, bubble_fraction=bubble / (m * t_mb), source="model",
    )
    return t, model_flops, hw_flops


def bubble_factor(schedule: str) -> float:
    """Zero-bubble schedules split each backward into input- and weight-gradient halves and fill
    the warm-up/cool-down idle time with weight-gradient work: with forward, input-gradient and
    weight-gradient passes of equal length, the idle time is (p-1) of them instead of 3(p-1)
    (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", ZB-H1, section 3)."""
    return 1.0 / 3.0 if schedule == "zero-bubble" else 1.0


def _trace_time(tr, r: Resolved, hw: Hardware, mb: MicroBatch, bubble: float, dp: dp_time.DpComm, opt: float,
                step: float) -> None:
    m = r.grad_accum
    tr("bubble_fraction", bubble / (m * (mb.fwd + mb.bwd + mb.rc + mb.tpc + mb.host + mb.ppc)),
       "(p - 1) / (v m), x 1/3 for zero-bubble",
       "Narayanan et al. 2021 §2.2 (GPipe, 1F1B, interleaved); Qi et al. 2023 (zero bubble, ZB-H1)")
    tr("compute_s", m * (mb.fwd + mb.bwd), "m x sum over GEMMs max(FLOPs/(peak x e_max x tile x wave), bytes/HBM) "
       "+ attention + elementwise bytes/HBM; backward = 2 x forward",
       f"roofline (Williams et al. 2009); e_max = {hw.gemm_efficiency:.3f} of peak = "
       f"{hw.gemm_efficiency / hw.matmul_fraction:.3f} x measured best matmul ({hw.matmul_fraction:.3f} of peak)")
    tr("recompute_s", m * mb.rc, f"forward of the recomputed part ({r.policy.text})", "torch.utils.checkpoint semantics")
    tr("tp_comm_s", m * mb.tpc, "4 all-reduces of b s h per layer (+2 per recomputed layer), not overlapped",
       "Narayanan §3.2: 8 b s h (t-1)/t elements per layer")
    tr("pp_comm_s", m * mb.ppc, "2 v sends of b s h / t per micro-batch", "Narayanan §4.1 (scatter/gather)")
    tr("bubble_s", bubble, "(p - 1)/v x t_microbatch", "Narayanan Eq. (1)")
    tr("host_transfer_s", m * mb.host, "host-link bytes per micro-batch (offloaded activations, params, gradients) "
       "/ host link - the compute they overlap", "ZeRO-Offload (Ren et al. 2021) §4; torch save_on_cpu")
    tr("dp_comm_s", dp.total_s, dp.formula, "ZeRO §7 volumes; NCCL ring/tree latency and bandwidth (tuning.cc)")
    tr("dp_comm_exposed_s", dp.exposed_s, f"per layer max(0, comm - compute) + first gather / last reduce; "
       f"+{dp_time.OVERLAP_CONTENTION:.0%} of the hidden part", "FSDP2 prefetch semantics; tenfold time model")
    tr("optimizer_s", opt, "~30 bytes/param of the rank's shard / HBM (host when offloaded)", "memory-bound Adam")
    tr("step_time_s", step, "m x t_mb + bubble + exposed DP/ZeRO comm + optimizer step", "tenfold time model (docs/planner.md)")


def stage_work(shape: ModelShape, r: Resolved, mb: MicroBatch) -> dp_time.StageWork:
    """What DP/ZeRO moves for the slowest stage, and the compute windows that can hide it."""
    s = r.s
    elem = 2.0 if s.precision != "fp32" else 4.0
    grad_bytes = memory.bytes_per_param(s).grads
    on_stage = stage_params(shape, s.pp, mb.stage, s.tp)
    if shape.known:
        per_layer = layer_params(shape, s.tp)
        layers = mb.layers
        regathered = regathered_layers(r.policy, shape.cfg.n_layers) * layers / shape.cfg.n_layers
        fwd_w, bwd_w = mb.layer_fwd, mb.layer_bwd
    else:  # --params only: the whole stage is one unit, nothing to prefetch it behind
        per_layer, layers, regathered = on_stage, 1, 0.0
        fwd_w, bwd_w = mb.fwd, mb.bwd + mb.rc
    root = max(0.0, on_stage - layers * per_layer)
    return dp_time.StageWork(
        layers=layers, layer_fwd_s=fwd_w, layer_bwd_s=bwd_w, bwd_s=mb.bwd + mb.rc,
        layer_param_bytes=elem * per_layer, layer_grad_bytes=grad_bytes * per_layer,
        root_param_bytes=elem * root, root_grad_bytes=grad_bytes * root,
        regathered_layers=regathered, micro_batches=r.grad_accum, pp=s.pp,
    )


def microbatch(shape: ModelShape, hw: Hardware, r: Resolved, peak: float) -> MicroBatch:
    s, cfg = r.s, shape.cfg
    if cfg is None:  # --params only: 6N FLOPs per token at the large-GEMM efficiency, no shapes
        flops_mb = 6.0 * shape.params * r.micro_batch * r.seq_len / (s.tp * s.pp)
        fwd = flops_mb / 3 / (peak * hw.gemm_efficiency)
        return MicroBatch(fwd, 2 * fwd, fwd if r.policy.kind == "full" else 0.0, 0.0, 0.0, 0.0)
    elem = 2.0 if s.precision != "fp32" else 4.0
    act_bytes = r.micro_batch * r.seq_len * cfg.d_model * elem
    tp_ar = comm.all_reduce_time(act_bytes, hw, comm.group_layout(s.tp, 1, hw.gpus_per_node))
    lt = tm.layer_times(cfg, s, hw, peak, r.seq_len, r.micro_batch, s.tp, tp_ar)
    rc_layers = recomputed_layers(r.policy, cfg.n_layers)
    rc_tp = r.policy.kind in ("full", "every", "segments")  # a recomputed layer repeats its forward all-reduces
    rc_layer = tm.recompute_time_per_layer(lt, r.policy, cfg.n_layers, rc_layers)
    rc_tp_layer = rc_layers / cfg.n_layers * lt.tp_comm_fwd if rc_tp else 0.0
    best = None
    for stage in sorted({0, s.pp - 1}):
        layers = layers_on_stage(cfg.n_layers, s.pp, stage)
        fwd, bwd = layers * lt.fwd, layers * lt.bwd
        if stage == s.pp - 1:
            hf, hb = tm.head_time(cfg, s, hw, peak, r.seq_len, r.micro_batch, s.tp)
            fwd, bwd = fwd + hf, bwd + hb
        rc = layers * rc_layer
        tpc = layers * (2 * lt.tp_comm_fwd + rc_tp_layer)
        cand = (fwd + bwd + rc + tpc, stage, layers, fwd, bwd, rc, tpc)
        best = cand if best is None or cand[0] > best[0] else best
    _, stage, layers, fwd, bwd, rc, tpc = best
    pp_crosses = s.tp * r.dp >= hw.gpus_per_node and s.pp > 1
    ppc = 2 * r.v * comm.p2p_time(act_bytes / s.tp, hw, pp_crosses) if s.pp > 1 else 0.0
    host = host_transfer_exposed(shape, hw, r, fwd, bwd + rc)
    return MicroBatch(fwd, bwd, rc, tpc, ppc, host, stage=stage, layers=layers,
                      layer_fwd=lt.fwd + lt.tp_comm_fwd, layer_bwd=lt.bwd + rc_layer + lt.tp_comm_fwd + rc_tp_layer)


def host_transfer_exposed(shape: ModelShape, hw: Hardware, r: Resolved, fwd: float, bwd: float) -> float:
    """Host-link traffic per micro-batch that compute does not hide.
    `--ac offload` (save_on_cpu): every saved activation goes to the host in forward and back
    in backward. `--offload optimizer+params` (ZeRO-Infinity): the rank's 16-bit parameter shard
    comes up from the host for forward and again for backward. `--offload` at ZeRO-2/3
    (ZeRO-Offload, Ren et al. 2021 §4): each micro-batch's reduced gradient partition goes down
    to the host, where it is accumulated in fp32, during that micro-batch's backward. (ZeRO-1
    keeps its full 16-bit gradients on the GPU until the step, memory.model_states.)"""
    s, cfg = r.s, shape.cfg
    moved = 0.0
    if r.policy.kind == "offload" and cfg is not None:
        layers = layers_on_stage(cfg.n_layers, s.pp, 0)
        moved += 2 * layers * memory.activation_bytes_per_layer(cfg, s, r.seq_len, r.micro_batch, s.tp)
    if s.offload == "optimizer+params":
        moved += 2 * 2.0 * stage_params(shape, s.pp, 0, s.tp) / r.dp
    exposed = max(0.0, moved / hw.host_link_bw - (fwd + bwd))
    if s.offload != "none" and s.zero >= 2:
        grads = memory.bytes_per_param(s).grads * stage_params(shape, s.pp, 0, s.tp) / r.dp
        exposed += max(0.0, grads / hw.host_link_bw - bwd)
    return exposed
