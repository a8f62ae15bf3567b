"""One optimizer step's time, assembled: every micro-batch on the slowest pipeline stage
(time.py's layer times), the pipeline bubble, the offload traffic over the host link, the
DP/ZeRO collectives with what really overlaps them (dp_time.py), and the optimizer step.
`api.predict` calls `step_time`; docs/planner.md "Step time" lists every term with its source.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenfold.errors import UserError
from tenfold.plan import comm, cp_traffic, dp_time, fp8, memory
from tenfold.plan import gathered as gathered_plan
from tenfold.plan import lora as lora_plan
from tenfold.plan import moe as moe_plan
from tenfold.plan import time as tm
from tenfold.plan.flops import model_flops_per_token, recompute_flops_per_token, regathered_layers
from tenfold.plan.hardware import Hardware
from tenfold.plan.shape import ModelShape, layer_params, run_rank_params
from tenfold.run import ResolvedRun
from tenfold.terms import element_bytes


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
    overhead_s: float = 0.0  # measured per-step + per-micro-batch overhead (Hardware; `tenfold tune`)
    embedding_sync_s: float = 0.0  # tied embeddings under pp: the first + last stage's gradient all-reduce
    ep_comm_s: float = 0.0  # MoE token dispatch + combine all-to-alls under expert parallelism (plan/moe.py)
    dp_bytes: float = 0.0  # what one rank of the slowest stage sends per step on its dp groups (dp_time.dp_step_bytes)


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
    epc: float = 0.0  # expert-parallel all-to-alls (not overlapped)
    layers: int = 0
    layer_fwd: float = 0.0  # one layer's forward window (compute + TP), what hides a prefetch
    layer_bwd: float = 0.0  # one layer's backward window (backward + recompute + TP)


def compute_share(hw: Hardware, gpus: int) -> float:
    """Ranks on one CPU share its cores: the measured peak is the whole machine's, and each of
    `gpus` ranks gets its share of it (as `tenfold train` divides it, tenfold.engine.observe.peak)."""
    return 1.0 / gpus if hw.shared_compute else 1.0


def recomputed_blocks(run: ResolvedRun) -> int:
    """Blocks whose forward runs twice: the engine wraps each pipeline stage's blocks on its own
    (tenfold.terms.RecomputePolicy.checkpointed_blocks per stage)."""
    if run.recompute.kind == "op":  # every block reruns a part (flops.op_rerun_flops_per_token)
        return 0
    return sum(len(run.recompute.recomputed_blocks(n)) for n in run.stage_layers)


def step_flops(shape: ModelShape, r: ResolvedRun, tr) -> tuple[float, float]:
    """(model FLOPs, model + recompute FLOPs) of one optimizer step."""
    cfg = shape.cfg
    tokens_step = r.tokens_per_step
    if cfg is not None and r.lora is not None:  # frozen matmuls: no weight gradient (plan/lora.py)
        model = lora_plan.flops_per_token(cfg, r) * tokens_step
        rc = recompute_flops_per_token(cfg, r.seq_len, r.recompute, recomputed_blocks(r)) * tokens_step
    elif cfg is not None:
        model = model_flops_per_token(cfg, r.seq_len) * tokens_step
        rc = recompute_flops_per_token(cfg, r.seq_len, r.recompute, recomputed_blocks(r)) * tokens_step
    else:
        model = 6.0 * shape.params * tokens_step
        rc = (2.0 * shape.params * tokens_step) if r.recompute.kind == "full" else 0.0
    formula = ("(4 N_frozen + 6 N_adapters + 12 L s d) x tokens (no weight gradient for the frozen base)"
               if r.lora is not None and cfg is not None else "(6N + 12 L s d) x tokens (N = matmul params incl. output layer)")
    tr("model_flops_per_step", model, formula, "Kaplan et al. 2020; PaLM App. B; nanoGPT estimate_mfu")
    tr("recompute_flops_per_step", rc, "full: +1 forward per layer; selective: +4 s h per layer; every:N / segments:K: their share",
       "Narayanan Eq. (3) (96 vs 72); Korthikanti Eq. (8)")
    return model, model + rc


def step_time(shape: ModelShape, hw: Hardware, r: ResolvedRun, tr,
              achieved_tflops: float | None = None) -> tuple[TimeBreakdown, float, float]:
    model_flops, hw_flops = step_flops(shape, r, tr)
    if achieved_tflops is not None:
        if not achieved_tflops > 0:
            raise UserError(f"--achieved-tflops must be positive, got {achieved_tflops}")
        step = hw_flops / (r.world_size * achieved_tflops * 1e12)
        tr("step_time_s", step, "(model + recompute FLOPs) / (gpus x X)", "Narayanan et al. 2021 Eq. (4): 8TP/(nX)")
        return TimeBreakdown(step, 0, 0, 0, 0, 0, 0, 0, 0, step, 0, "achieved_tflops"), model_flops, hw_flops
    peak = hw.gemm_peak(r.precision) * compute_share(hw, r.world_size)
    m = r.grad_accum
    z = r.zero_runs_as
    mb = microbatch(shape, hw, r, peak)
    t_mb = mb.fwd + mb.bwd + mb.rc + mb.tpc + mb.host + mb.ppc + mb.epc + hw.microbatch_overhead_s
    bubble = (r.pp - 1) / r.virtual_stages * t_mb * bubble_factor(r.pp_schedule) if r.pp > 1 else 0.0
    # Tensor-parallel ranks are the fastest mesh dim, then the shard group, then its replicas
    # (the engine's (pp, dp_replicate, dp_shard, tp) mesh).
    gpn = hw.gpus_per_node
    replicas = comm.group_layout(r.replicas, r.tp * r.shard_size, gpn) if r.shard_group else None
    work = stage_work(shape, r, mb)
    dp = dp_time.dp_step_comm(z, work, hw, comm.group_layout(r.shard_size, r.tp, gpn), r.stack.overlap_comm, replicas)
    dp_bytes = dp_time.dp_step_bytes(z, work, r.shard_size, replicas.size if replicas else 1) if r.grad_ranks > 1 else 0.0
    n_params = max(trained_params(shape, r, rank) for rank in r.busiest_ranks())
    on_rank = n_params / (r.shard_size if z >= 1 else 1)
    # What crosses the host link at the step: DeepSpeed's ZeRO-Offload sends 16-bit grads down
    # (ZeRO-1) and the updated params up; FSDP2's CPU offload (`optimizer+params`) steps on the
    # host shard in place; tenfold's `optimizer` (HostAdamW) sends the fp32 shard and its
    # gradient down and the updated shard up: 12 bytes per parameter of the shard.
    pcie = 0.0
    if r.offload != "none" and r.stack.master_weights:
        pcie = 4.0 if z == 1 else 2.0
    elif r.offload == "optimizer":
        pcie = 12.0
    opt = tm.optimizer_step_time(on_rank, hw, r.offload != "none", min(r.world_size, hw.gpus_per_node), pcie)
    overhead = m * hw.microbatch_overhead_s + hw.step_overhead_s
    sync = tied_embedding_sync_time(shape, hw, r)
    step = m * t_mb + bubble + dp.exposed_s + opt + sync + hw.step_overhead_s
    _trace_time(tr, r, hw, mb, bubble, dp, opt, step)
    if sync:
        tr("tied_embedding_sync_s", sync, "all-reduce of the tied (V, d) gradient / tp (/ N_d under ZeRO-2/3) over the "
           "2-rank embedding group (first + last pipeline stage), once per step, not overlapped",
           "Narayanan et al. 2021 (Megatron-LM) §2; Megatron _allreduce_word_embedding_grads")
    t = TimeBreakdown(
        compute_s=m * (mb.fwd + mb.bwd), recompute_s=m * mb.rc, tp_comm_s=m * mb.tpc, pp_comm_s=m * mb.ppc,
        host_transfer_s=m * mb.host, bubble_s=bubble, dp_comm_s=dp.total_s, dp_comm_exposed_s=dp.exposed_s,
        optimizer_s=opt, step_s=step, bubble_fraction=bubble / (m * t_mb), source="model", overhead_s=overhead,
        embedding_sync_s=sync, ep_comm_s=m * mb.epc, dp_bytes=dp_bytes,
    )
    return t, model_flops, hw_flops


def trained_params(shape: ModelShape, r: ResolvedRun, rank: int) -> float:
    """The parameters the optimizer steps on a pipeline rank: all of them, or a LoRA run's adapters."""
    if r.lora is not None and shape.cfg is not None:
        return lora_plan.adapter_params(shape.cfg, r, r.rank_layers(rank))
    return run_rank_params(shape, r, rank)


def tied_embedding_sync_time(shape: ModelShape, hw: Hardware, r: ResolvedRun) -> float:
    """Tied embeddings under pipeline parallelism: the first stage's embedding and the last
    stage's output layer are two copies of one (V, d) matrix, whose gradients are summed by an
    all-reduce over the "embedding group" (the first and the last pipeline rank at the same dp,
    tp coordinate) after the backward and before the optimizer step, with nothing to overlap it
    (Narayanan et al. 2021, Megatron-LM; Megatron's `_allreduce_word_embedding_grads`; the
    engine's techniques/tied_embeddings.py). Each rank reduces its local gradient: V d / tp
    (vocabulary-parallel), / N_d where ZeRO-2/3 shards it, in the gradients' own dtype. The two
    ranks sit (pp - 1) dp tp ranks apart, on two nodes once that reaches a node."""
    cfg = shape.cfg
    if cfg is None or r.pp <= 1 or not cfg.tie_embeddings:
        return 0.0
    elements = cfg.vocab_size * cfg.d_model / r.tp / (r.shard_size if r.zero_runs_as >= 2 else 1)
    group = comm.group_layout(2, (r.pp - 1) * r.dp * r.tp, hw.gpus_per_node)
    return comm.all_reduce_time(elements * memory.bytes_per_param(r).grads, hw, group)


def bubble_factor(schedule: str) -> float:
    """Zero-bubble schedules split each backward into input- and weight-gradient halves and fill
    the warm-up/cool-down idle time with weight-gradient work: with forward, input-gradient and
    weight-gradient passes of equal length, the idle time is (p-1) of them instead of 3(p-1)
    (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", ZB-H1, section 3)."""
    return 1.0 / 3.0 if schedule == "zero-bubble" else 1.0


def _trace_time(tr, r: ResolvedRun, hw: Hardware, mb: MicroBatch, bubble: float, dp: dp_time.DpComm, opt: float,
                step: float) -> None:
    m = r.grad_accum
    tr("bubble_fraction", bubble / (m * (mb.fwd + mb.bwd + mb.rc + mb.tpc + mb.host + mb.ppc + mb.epc
                                        + hw.microbatch_overhead_s)),
       "(p - 1) / (v m), x 1/3 for zero-bubble",
       "Narayanan et al. 2021 §2.2 (GPipe, 1F1B, interleaved); Qi et al. 2023 (zero bubble, ZB-H1)")
    tr("compute_s", m * (mb.fwd + mb.bwd), "m x sum over GEMMs max(FLOPs/(peak x e_max x tile x wave), bytes/HBM) "
       "+ attention + elementwise bytes/HBM; backward = 2 x forward",
       f"roofline (Williams et al. 2009); e_max = {hw.gemm_efficiency:.3f} of peak = "
       f"{hw.gemm_efficiency / hw.matmul_fraction:.3f} x measured best matmul ({hw.matmul_fraction:.3f} of peak)")
    tr("recompute_s", m * mb.rc, f"forward of the recomputed part ({r.recompute.text})", "torch.utils.checkpoint semantics")
    tr("tp_comm_s", m * mb.tpc, "4 all-reduces of b s h per layer (+2 per recomputed layer), not overlapped; "
       "with cp: + the K/V all-gather per layer (again per recomputed layer) and reduce-scatter of b s 2 kv/t "
       "elements, (cp-1)/cp of them crossing each rank, not overlapped",
       "Narayanan §3.2: 8 b s h (t-1)/t elements per layer; Llama 3 (arXiv:2407.21783) §3.3.2 all-gather CP")
    tr("pp_comm_s", m * mb.ppc, "2 v sends of b s h / t per micro-batch", "Narayanan §4.1 (scatter/gather)")
    if mb.epc:
        tr("ep_comm_s", m * mb.epc, "4 all-to-alls of b s k d per MoE layer (+2 per recomputed layer), (ep-1)/ep "
           "of each leaving the rank, off-node part over its NIC, not overlapped",
           "GShard (Lepikhin et al. 2020) §2.2; Megatron-Core MoE token dispatcher")
    tr("bubble_s", bubble, "(p - 1)/v x t_microbatch", "Narayanan Eq. (1)")
    tr("host_transfer_s", m * mb.host, "host-link bytes per micro-batch (offloaded activations, params, gradients) "
       "/ host link - the compute they overlap", "ZeRO-Offload (Ren et al. 2021) §4; torch save_on_cpu")
    tr("dp_comm_s", dp.total_s, dp.formula, "ZeRO §7 volumes; NCCL ring/tree latency and bandwidth (tuning.cc)")
    tr("dp_comm_exposed_s", dp.exposed_s, f"per layer max(0, comm - compute) + first gather / last reduce; "
       f"+{dp_time.OVERLAP_CONTENTION:.0%} of the hidden part", "FSDP2 prefetch semantics; tenfold time model")
    tr("optimizer_s", opt, "~30 bytes/param of the rank's shard / HBM (host when offloaded)", "memory-bound Adam")
    if hw.step_overhead_s or hw.microbatch_overhead_s:
        tr("overhead_s", m * hw.microbatch_overhead_s + hw.step_overhead_s,
           "m x per-micro-batch overhead + per-step overhead", f"measured: {hw.sources.get('overhead', 'hardware file')}")
    tr("step_time_s", step, "m x t_mb + bubble + exposed DP/ZeRO comm + optimizer step (+ tied embedding "
       "all-reduce, overhead)",
       "tenfold time model (docs/planner.md)")


def reduced_grad_bytes(r: ResolvedRun) -> float:
    """Bytes per gradient element as the data-parallel collectives move them: tenfold's engine
    (fp32 gradients) reduces in `parallel.reduce_dtype` (FSDP2's reduce_dtype, DDP's comm hook);
    a 16-bit stack (DeepSpeed's, Megatron's bookkeeping) in its gradients' own dtype."""
    if r.stack.master_weights:
        return memory.bytes_per_param(r).grads
    return element_bytes(r.reduce_dtype)


def stage_work(shape: ModelShape, r: ResolvedRun, mb: MicroBatch) -> dp_time.StageWork:
    """What DP/ZeRO moves for the slowest stage, and the compute windows that can hide it."""
    elem = fp8.block_param_bytes(r)  # a gathered block weight: float8 under --fp8 with FSDP2
    grad_bytes = reduced_grad_bytes(r)
    on_stage = run_rank_params(shape, r, mb.stage)
    if shape.known:
        per_layer = layer_params(shape, r.tp, r.ep)
        layers = mb.layers
        regathered = sum(regathered_layers(r.recompute, n) for n in r.rank_stage_layers(mb.stage))
        fwd_w, bwd_w = mb.layer_fwd, mb.layer_bwd
    else:  # --params only: the whole stage is one unit, nothing to prefetch it behind
        per_layer, layers, regathered = on_stage, 1, 0.0
        fwd_w, bwd_w = mb.fwd, mb.bwd + mb.rc
    root = max(0.0, on_stage - layers * per_layer)
    layer_bytes, layer_grads, root_grads = elem * per_layer, grad_bytes * per_layer, grad_bytes * root
    if r.lora is not None and shape.known:  # gathers carry the frozen base (16-bit or NF4), reductions the adapters
        counts = lora_plan.layer_counts(shape.cfg, r)
        layer_bytes = lora_plan.frozen_bytes(per_layer, 1, counts, r.precision) + element_bytes(r.precision) * counts.adapters
        layer_grads, root_grads = grad_bytes * counts.adapters, 0.0
    return dp_time.StageWork(
        layers=layers, layer_fwd_s=fwd_w, layer_bwd_s=bwd_w, bwd_s=mb.bwd + mb.rc,
        layer_param_bytes=layer_bytes, layer_grad_bytes=layer_grads,
        root_param_bytes=element_bytes(r.precision) * root, root_grad_bytes=root_grads,
        regathered_layers=regathered, micro_batches=r.grad_accum, pp=r.pp,
        reduce_once=r.zero_stage == 1 and r.zero_runs_as == 2,
        blocks_persist=shape.known and gathered_plan.blocks_persist(r, per_layer),
    )


def microbatch(shape: ModelShape, hw: Hardware, r: ResolvedRun, peak: float) -> MicroBatch:
    cfg, tp = shape.cfg, r.tp
    if cfg is None:  # --params only: 6N FLOPs per token at the large-GEMM efficiency, no shapes
        flops_mb = 6.0 * shape.params * r.micro_batch * r.local_seq_len / (tp * r.pp)
        fwd = flops_mb / 3 / (peak * hw.gemm_efficiency)
        return MicroBatch(fwd, 2 * fwd, fwd if r.recompute.kind == "full" else 0.0, 0.0, 0.0, 0.0)
    act_bytes = r.micro_batch * r.local_seq_len * cfg.d_model * element_bytes(r.precision)
    tp_ar = comm.all_reduce_time(act_bytes, hw, comm.group_layout(tp, 1, hw.gpus_per_node))
    lt = tm.layer_times(cfg, r, hw, peak, tp_ar)
    cp = cp_traffic.layer_traffic(cfg, r, hw)
    rc_tp = r.recompute.kind in ("full", "every", "segments")  # a recomputed layer repeats its forward all-reduces
    best = None
    for rank in r.busiest_ranks():
        layers = r.rank_layers(rank)
        rc_layers = 0 if r.recompute.kind == "op" else sum(len(r.recompute.recomputed_blocks(n))
                                                             for n in r.rank_stage_layers(rank))
        fwd, bwd = layers * lt.fwd, layers * lt.bwd
        if rank == r.pp - 1:
            hf, hb = tm.head_time(cfg, r, hw, peak)
            fwd, bwd = fwd + hf, bwd + hb
        rc = tm.recompute_time(lt, r.recompute, layers, rc_layers)
        tpc = layers * 2 * lt.tp_comm_fwd + (rc_layers * lt.tp_comm_fwd if rc_tp else 0.0)
        tpc += cp_comm(cp, lt, layers, rc_layers if rc_tp else 0)
        cand = (fwd + bwd + rc + tpc, rank, layers, fwd, bwd, rc, tpc, rc_layers)
        best = cand if best is None or cand[0] > best[0] else best
    _, rank, layers, fwd, bwd, rc, tpc, rc_layers = best
    pp_crosses = tp * r.dp >= hw.gpus_per_node and r.pp > 1
    ppc = 2 * r.virtual_stages * comm.p2p_time(act_bytes / tp, hw, pp_crosses) if r.pp > 1 else 0.0
    host = host_transfer_exposed(shape, hw, r, fwd, bwd + rc)
    epc = moe_plan.ep_comm_time(cfg, r, hw, layers, rc_layers)
    share = rc_layers / layers if layers else 0.0  # the average layer's recompute share
    rc_layer = rc / layers if layers else 0.0
    return MicroBatch(fwd, bwd, rc, tpc, ppc, host, stage=rank, layers=layers, epc=epc, layer_fwd=lt.fwd + lt.tp_comm_fwd,
                      layer_bwd=lt.bwd + rc_layer + lt.tp_comm_fwd + (share * lt.tp_comm_fwd if rc_tp else 0.0))


def cp_comm(cp: "cp_traffic.CpTraffic", lt: "tm.LayerTimes", layers: int, recomputed: int) -> float:
    """Context parallelism's exposed K/V traffic of a rank's layers in one micro-batch: the
    all-gather per layer forward (again per recomputed layer) and the reduce-scatter per layer
    backward, before / after the attention, so not hidden by it (plan/cp_traffic.py)."""
    if cp.bytes_per_layer == 0:
        return 0.0
    fwd = cp_traffic.exposed_s(cp.fwd_s, lt.attn_fwd, overlapped=False)
    bwd = cp_traffic.exposed_s(cp.bwd_s, 2.5 * lt.attn_fwd, overlapped=False)
    return (layers + recomputed) * fwd + layers * bwd


def host_transfer_exposed(shape: ModelShape, hw: Hardware, r: ResolvedRun, fwd: float, bwd: float) -> float:
    """Host-link traffic per micro-batch that compute does not hide.
    `--ac offload` (save_on_cpu): every saved activation goes to the host in forward and back
    in backward. tenfold's `--offload` (FSDP2's CPUOffloadPolicy): the rank's fp32 parameter
    shard comes up from the host for every all-gather (forward and backward at ZeRO-3, once per
    step at ZeRO-2) and its fp32 gradient shard goes down after each micro-batch's
    reduce-scatter (`optimizer+params`; `optimizer` keeps both on the device and moves them
    once per step, `optimizer_step_time`). DeepSpeed's stack: `optimizer+params`
    (ZeRO-Infinity) brings the 16-bit parameter shard up for forward and backward; ZeRO-Offload at ZeRO-2/3 (Ren et al. 2021 §4)
    sends each micro-batch's reduced gradient partition down during its backward (ZeRO-1 keeps
    its full 16-bit gradients on the GPU until the step, memory.model_states)."""
    cfg = shape.cfg
    moved = 0.0
    shard = run_rank_params(shape, r, 0) / r.shard_size
    if r.recompute.kind == "offload" and cfg is not None:
        moved += 2 * r.rank_layers(0) * memory.activation_bytes_per_layer(cfg, r)
    if r.offload == "optimizer+params" and not r.stack.master_weights:
        gathers = 2.0 if r.zero_runs_as == 3 else 1.0 / r.grad_accum  # ZeRO-2: once per step
        up, down = gathers * 4.0 * shard, 4.0 * shard
        return max(0.0, up / hw.host_link_bw - fwd) + max(0.0, down / hw.host_link_bw - bwd) + \
            max(0.0, moved / hw.host_link_bw - (fwd + bwd))
    if not r.stack.master_weights:  # tenfold's `optimizer`: nothing moves per micro-batch
        return max(0.0, moved / hw.host_link_bw - (fwd + bwd))
    if r.offload == "optimizer+params":
        moved += 2 * 2.0 * shard
    exposed = max(0.0, moved / hw.host_link_bw - (fwd + bwd))
    if r.offload != "none" and r.zero_runs_as >= 2:
        grads = memory.bytes_per_param(r).grads * shard
        exposed += max(0.0, grads / hw.host_link_bw - bwd)
    return exposed
