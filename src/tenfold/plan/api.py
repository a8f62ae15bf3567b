"""`predict(run, hardware) -> Plan`: the planner's one entry point. `run` is the resolved run
(tenfold.run.ResolvedRun) that `tenfold train` builds, so what is priced is what trains.

The training engine calls it on every run (predicted vs measured memory) and the ladder per
rung; the CLI prints it. Every figure carries the formula and source it came from
(`Plan.explain`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from tenfold.errors import UserError
from tenfold.plan import lora as lora_plan
from tenfold.plan import cp_traffic, memory
from tenfold.plan import gathered as gathered_plan
from tenfold.plan import moe as moe_plan
from tenfold.plan.hardware import Hardware, get_hardware, with_gpus_per_node
from tenfold.models.presets import active_param_count
from tenfold.plan.shape import ModelShape, largest_unit_params, layer_params, run_rank_params, shape_of
from tenfold.plan.step_time import TimeBreakdown, compute_share, step_time
from tenfold.run import ResolvedRun
from tenfold.terms import element_bytes

__all__ = ["Plan", "MemoryBreakdown", "TimeBreakdown", "predict", "predict_memory", "largest_micro_batch"]


@dataclass
class Explained:
    key: str
    value: float | None
    formula: str
    source: str


@dataclass
class MemoryBreakdown:
    """Bytes on the most loaded rank (the first pipeline stage unless the last holds more)."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float  # master weights + Adam moments (+ fp32 grad copy)
    master_weights_bytes: float
    optimizer_moments_bytes: float
    model_states_bytes: float
    activations_bytes: float | None  # None when only --params is known
    activation_working_bytes: float | None
    activations_per_layer_bytes: float | None
    inflight_microbatches: float | None
    comm_buffers_bytes: float
    # Unsharded working copies of parameters beside the rank's own (FSDP2's all-gathered units,
    # torch.amp's 16-bit weight casts): plan/gathered.py's gathered_param_bytes + autocast_weight_copies_bytes
    gathered_params_bytes: float
    autocast_weight_copies_bytes: float  # of gathered_params_bytes: torch.amp's casts (DDP, one process)
    allocated_bytes: float  # what torch.cuda.max_memory_allocated would show
    allocator_reserve_bytes: float
    runtime_overhead_bytes: float
    total_bytes: float
    capacity_bytes: float
    cpu_bytes: float  # offloaded optimizer/params/activations (host RAM per rank)
    stage: str  # "first", "last" or "only"

    @property
    def peak_bytes(self) -> float:
        return self.allocated_bytes


@dataclass
class Plan:
    model: str
    params: float
    hardware: str
    gpus: int
    gpus_per_node: int
    strategy: dict  # the run's layout (tenfold.run.ResolvedRun.layout)
    layout_line: str  # the same in one line, saying where the engine runs one strategy as another
    dp: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    memory: MemoryBreakdown
    time: TimeBreakdown
    fits: bool
    tokens_per_step: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (MFU convention) per GPU per second / 1e12
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    tokens: float | None
    train_days: float | None
    gpu_hours: float | None
    max_micro_batch: int | None = None  # largest micro-batch that fits, the rest unchanged (set by the CLI; see largest_micro_batch)
    tp_bytes_per_step: float = 0.0  # tensor-parallel traffic per rank per step (tenfold.plan.tp_traffic), busiest stage
    cp_bytes_per_step: float = 0.0  # context-parallel K/V traffic per rank per step (tenfold.plan.cp_traffic)
    ep_bytes_per_step: float = 0.0  # expert-parallel all-to-all bytes one rank sends per step (tenfold.plan.moe), busiest stage
    # Why `tenfold train` cannot run this strategy (tenfold.capabilities; set by the CLI and --search)
    unsupported: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    explain: list[Explained] = field(default_factory=list)
    run: ResolvedRun | None = field(default=None, repr=False, compare=False)  # what was priced
    # Parameters a token's forward uses (MoE: k routed experts per block); = params for dense.
    # Memory is priced on `params`, FLOPs and MFU on these.
    active_params: float | None = None

    @property
    def step_time_s(self) -> float:
        return self.time.step_s

    def to_dict(self) -> dict:
        d = asdict(replace(self, run=None))
        d.pop("run")
        d["step_time_s"] = self.time.step_s
        d["memory"]["peak_bytes"] = self.memory.peak_bytes
        return d


def _no_trace(key, value, formula, source):
    return value


class _Trace:
    def __init__(self) -> None:
        self.items: list[Explained] = []

    def __call__(self, key: str, value, formula: str, source: str):
        self.items.append(Explained(key, None if value is None else float(value), formula, source))
        return value


def _prepare(run: ResolvedRun, hardware, gpus_per_node, name):
    if not isinstance(run, ResolvedRun):
        raise TypeError(f"predict takes a tenfold.run.ResolvedRun, got {type(run).__name__}")
    shape = shape_of(run.model if run.model is not None else run.params, name=name)
    hw = with_gpus_per_node(get_hardware(hardware), gpus_per_node)
    return shape, hw


def predict_memory(run: ResolvedRun, hardware: "str | Hardware", gpus_per_node: int | None = None,
                   name: str | None = None) -> MemoryBreakdown:
    """Only the memory side of `predict` (what `--search` checks first)."""
    shape, hw = _prepare(run, hardware, gpus_per_node, name)
    return _memory(shape, hw, run, _no_trace, [])


def predict(run: ResolvedRun, hardware: "str | Hardware", *, gpus_per_node: int | None = None, name: str | None = None,
            tokens: float | None = None, achieved_tflops: float | None = None) -> Plan:
    """Predict memory, step time, throughput and days of `run` on `run.world_size` GPUs.

    hardware: catalog name, "cpu", a .toml path or a Hardware; tokens: the training budget (for
    days and GPU-hours); achieved_tflops: per-GPU hardware TFLOP/s (Narayanan's X) instead of the
    time model; name: the model's label in the report."""
    return _predict(run, hardware, gpus_per_node, name=name, tokens=tokens, achieved_tflops=achieved_tflops)


def _predict(run: ResolvedRun, hardware, gpus_per_node=None, trace: bool = True, mem: MemoryBreakdown | None = None,
             name: str | None = None, tokens: float | None = None, achieved_tflops: float | None = None) -> Plan:
    """`predict`, optionally without the explanations and with memory already computed
    (what `--search` uses for its thousands of candidates)."""
    shape, hw = _prepare(run, hardware, gpus_per_node, name)
    gpus = run.world_size
    tr = _Trace() if trace else _no_trace
    notes: list[str] = []
    if mem is None or trace:
        mem = _memory(shape, hw, run, tr, notes)
    t, flops_model, flops_hw = step_time(shape, hw, run, tr, achieved_tflops)
    tokens_step = run.tokens_per_step
    peak = hw.peak(run.precision) * compute_share(hw, gpus)
    tps = tokens_step / t.step_s
    tflops = flops_model / t.step_s / gpus
    hw_tflops = flops_hw / t.step_s / gpus
    mfu = tflops / peak
    hfu = hw_tflops / peak
    tr("tokens_per_s", tps, "global_batch x seq_len / step_time", "definition")
    tr("mfu", mfu, "model FLOPs per step / (step_time x gpus x peak)", "PaLM (Chowdhery et al. 2022) §4.1, no recompute, no causal halving")
    tr("hfu", hfu, "(model + recompute FLOPs) / (step_time x gpus x peak)", "Korthikanti et al. 2022 App. A")
    days = hours = None
    if tokens is not None:
        if not tokens > 0:
            raise UserError(f"--tokens must be positive, got {tokens}")
        days = tr("train_days", tokens / tps / 86400, "tokens / tokens_per_s / 86400", "definition")
        hours = days * 24 * gpus
    tp_bytes, cp_bytes, ep_bytes = _model_parallel_bytes(shape, run, tr)
    fits = _fits(mem, hw, gpus)
    if not fits and hw.shared_compute:
        notes.append(f"does not fit: {min(gpus, hw.gpus_per_node)} ranks x {(mem.total_bytes + mem.cpu_bytes) / 2**30:.1f} GiB "
                     f"vs {mem.capacity_bytes / 2**30:.1f} GiB of RAM")
    elif mem.total_bytes > mem.capacity_bytes:
        notes.append(
            f"does not fit: {mem.total_bytes / 2**30:.1f} GiB needed on the {mem.stage} stage vs {mem.capacity_bytes / 2**30:.1f} GiB"
        )
    if run.fp8 and not hw.peak_flops.get("fp8"):
        notes.append(f"--fp8 priced at the {run.precision} rate: {hw.name} has no float8 matmul peak (emulated)")
    if not shape.known:
        notes.append("only --params given: activations unknown (null); FLOPs = 6 x params per token; no TP/PP shapes")
    return Plan(
        model=shape.name, params=shape.params, hardware=hw.name, gpus=gpus, gpus_per_node=hw.gpus_per_node,
        strategy=run.layout(), layout_line=run.layout_line(), dp=run.dp, micro_batch=run.micro_batch,
        grad_accum=run.grad_accum, global_batch=run.global_batch, seq_len=run.seq_len, memory=mem, time=t, fits=fits,
        tokens_per_step=tokens_step, model_flops_per_step=flops_model, hardware_flops_per_step=flops_hw,
        tokens_per_s=tps, tflops_per_gpu=tflops / 1e12, hardware_tflops_per_gpu=hw_tflops / 1e12, mfu=mfu, hfu=hfu,
        tokens=tokens, train_days=days, gpu_hours=hours, notes=notes, explain=tr.items if trace else [],
        tp_bytes_per_step=tp_bytes, cp_bytes_per_step=cp_bytes, ep_bytes_per_step=ep_bytes, run=run,
        active_params=float(active_param_count(shape.cfg)) if shape.known else shape.params,
    )


def _model_parallel_bytes(shape: ModelShape, run: ResolvedRun, tr) -> tuple[float, float, float]:
    """Bytes one rank sends per step on its tensor-, context- and expert-parallel groups."""
    tp_bytes = _tp_bytes_per_step(shape, run)
    if tp_bytes:
        tr("tp_bytes_per_step", tp_bytes, "per layer 8 (t-1)/t b s h x m, + embedding, head, loss, norm gradients, "
           "clip (docs/tensor_parallel.md)", "Narayanan et al. 2021 §3.2; Korthikanti et al. 2022 §4.2.2")
    cp_bytes = cp_traffic.bytes_per_step(shape.cfg, run) if shape.cfg is not None else 0.0
    if cp_bytes:
        tr("cp_bytes_per_step", cp_bytes, "per layer and micro-batch: the K/V all-gather (again per recomputed layer) "
           "and reduce-scatter of b s 2 kv/t elements, (cp-1)/cp of them sent by each rank",
           "Llama 3 (arXiv:2407.21783) §3.3.2 all-gather CP; nccl-tests bus bandwidth")
    ep_bytes = moe_plan.ep_bytes_per_step(shape.cfg, run) if shape.known else 0.0
    if ep_bytes:
        tr("ep_bytes_per_step", ep_bytes, "(4 per MoE layer + 2 per recomputed one) all-to-alls of b s k d x m, "
           "(ep-1)/ep of each leaving the rank", "GShard (Lepikhin et al. 2020) §2.2")
    return tp_bytes, cp_bytes, ep_bytes


def _tp_bytes_per_step(shape: ModelShape, run: ResolvedRun) -> float:
    """Bytes one rank sends on its tensor-parallel group per step, on the busier of the first
    and last pipeline rank (tenfold.plan.tp_traffic); 0 without TP or a model shape."""
    cfg = shape.cfg
    if run.tp <= 1 or cfg is None:
        return 0.0
    from tenfold.plan.tp_traffic import tp_traffic

    return max(tp_traffic(cfg, run, rank).total for rank in run.busiest_ranks())


# --------------------------------------------------------------------------- memory
def _memory(shape: ModelShape, hw: Hardware, run: ResolvedRun, tr: _Trace, notes: list[str]) -> MemoryBreakdown:
    best: MemoryBreakdown | None = None
    for rank in run.busiest_ranks():
        m = _stage_memory(shape, hw, run, rank)
        if best is None or m.total_bytes > best.total_bytes:
            best = m
    assert best is not None
    b = memory.bytes_per_param(run)
    z, pp = run.zero_runs_as, run.pp
    pipelined = " (unsharded: pipelining reduces once per step)" if pp > 1 and z >= 2 else ""
    if run.lora is not None:
        _trace_lora_states(tr, best, run)
        return _trace_rest(tr, best, run, hw, notes)
    tr("params_bytes", best.params_bytes, f"{b.params:g} B/param x stage params"
       f"{' / N_d' if z >= 3 and pp == 1 else ''}", "ZeRO §5 (Rajbhandari et al. 2020); Megatron first-stage layout")
    tr("grads_bytes", best.grads_bytes, f"{b.grads:g} B/param x stage params{' / N_d' if z >= 2 and pp == 1 else ''}"
       f"{pipelined}", "ZeRO §5; torch.distributed.pipelining + FSDP2")
    tr("master_weights_bytes", best.master_weights_bytes, f"{b.master:g} B/param (fp32 copy){' / N_d' if z >= 1 else ''}",
       "ZeRO §3.1: K = 12 = fp32 params + momentum + variance")
    tr("optimizer_moments_bytes", best.optimizer_moments_bytes, f"{b.optimizer:g} B/param (Adam m, v){' / N_d' if z >= 1 else ''}", "ZeRO §3.1")
    tr("model_states_bytes", best.model_states_bytes, "stage 0: 16Ψ; 1: 4Ψ + 12Ψ/N_d; 2: 2Ψ + 14Ψ/N_d; 3: 16Ψ/N_d",
       "ZeRO Table 1 / §5.1-5.3")
    return _trace_rest(tr, best, run, hw, notes)


def _trace_lora_states(tr, best: MemoryBreakdown, run: ResolvedRun) -> None:
    nf4 = run.lora.base == "nf4"
    tr("params_bytes", best.params_bytes, "frozen base: B bytes/param" + (" (the blocks' Linears in NF4: 0.5 + 1/64 + "
       "2/16384 bytes/value)" if nf4 else "") + " + adapters 4 B/param" + (" / N_d" if run.zero_runs_as >= 3 else ""),
       "Hu et al. 2021" + ("; Dettmers et al. 2023 §3 (double quantization)" if nf4 else ""))
    tr("grads_bytes", best.grads_bytes, "adapters only, 4 B/param (the frozen base takes no gradient)", "plan/lora.py")
    tr("optimizer_moments_bytes", best.optimizer_moments_bytes, "adapters only, AdamW m + v, 8 B/param", "plan/lora.py")


def _trace_rest(tr, best: MemoryBreakdown, run: ResolvedRun, hw: Hardware, notes: list[str]) -> MemoryBreakdown:
    pp = run.pp
    if best.activations_bytes is not None:
        tr("activations_per_layer_bytes", best.activations_per_layer_bytes,
           "sbh(34 + 5as/h) no parallelism; TP: sbh(10 + 24/t + 5as/(ht)); per-term table, docs/planner.md",
           "Korthikanti et al. 2022 Eq. (1), Table 2")
        tr("inflight_microbatches", best.inflight_microbatches,
           "none: 1; GPipe: m; 1F1B: min(p, m); interleaved: p (1 + (p-1)/(p v))", "Narayanan §2.2; Korthikanti §4.2.3")
        tr("activations_bytes", best.activations_bytes,
           f"layers x per-layer({run.recompute.text}) x in-flight + working layer + embedding/logits extras"
           + (" + each stage module's kept output (b x s x h) x in-flight, but the model's last" if pp > 1 else ""),
           "Korthikanti Table 2 and §4.3; torch.utils.checkpoint semantics"
           + ("; torch.distributed.pipelining's fwd_cache" if pp > 1 else ""))
    tr("gathered_params_bytes", best.gathered_params_bytes,
       "FSDP2: ZeRO-3 2 units (the whole stage when blocks are under the persistence threshold), ZeRO-2 / replicate / pipelined the whole stage, in the compute dtype; "
       "DDP or one process: torch.amp's 16-bit weight casts", "PyTorch FSDP2 MixedPrecisionPolicy, PR #128884; torch.amp")
    tr("comm_buffers_bytes", best.comm_buffers_bytes, "DDP: 2 x 25 MiB buckets; FSDP2: 1 unsharded grad unit; "
       "none at dp 1", "PyTorch FSDP notes; DDP bucket_cap_mb")
    tr("allocator_reserve_bytes", best.allocator_reserve_bytes,
       f"{memory.ALLOCATOR_RESERVE_FRACTION:.0%} x (gathered params + activations + buffers)",
       "assumption (ZeRO §3.2: fragmentation)")
    tr("total_bytes", best.total_bytes, "model states + gathered params + activations + buffers + reserve + runtime "
       "overhead", "sum")
    if not _host_fits(best, hw, run.world_size):
        notes.append(f"does not fit: offloaded host memory {best.cpu_bytes * min(run.world_size, hw.gpus_per_node) / 2**30:,.0f} GiB "
                     f"per node > {hw.host_memory_bytes / 2**30:,.0f} GiB of host RAM")
    if pp > 1:
        notes.append(f"memory shown for the most loaded pipeline stage ({best.stage})")
    return best


def _host_fits(m: MemoryBreakdown, hw: Hardware, gpus: int) -> bool:
    """Offloaded states of every rank on a node must fit its host RAM (with 10% to spare)."""
    return m.cpu_bytes == 0 or m.cpu_bytes * min(gpus, hw.gpus_per_node) <= 0.9 * hw.host_memory_bytes


def _fits(m: MemoryBreakdown, hw: Hardware, gpus: int) -> bool:
    if hw.shared_compute:  # `cpu`: the ranks on this machine share its memory (the capacity)
        return (m.total_bytes + m.cpu_bytes) * min(gpus, hw.gpus_per_node) <= m.capacity_bytes
    return m.total_bytes <= m.capacity_bytes and _host_fits(m, hw, gpus)


def _autocast_copy_bytes(cfg, run: ResolvedRun, rank: int, n_params: float) -> float:
    """torch.amp's 16-bit weight copies on pipeline rank `rank` (plan/gathered.py; a LoRA run's:
    plan/lora.py)."""
    if run.lora and cfg is not None:
        return lora_plan.autocast_copy_bytes(cfg, run, run.rank_layers(rank))
    uncast = gathered_plan.uncast_param_count(cfg, run.rank_layers(rank), rank == 0, rank == run.pp - 1)
    return gathered_plan.autocast_weight_copy_bytes(n_params, run, uncast)


def _allocated_at_peak(run: ResolvedRun, st: memory.ModelStates, at_peak: float, act: float, buffers: float,
                       unit: float, sending: float) -> float:
    """The step's high: every term at its own high, or, where the engine's order is known, the
    larger of the activation high and the gradients' reduction after it."""
    if _no_gradients_at_activation_high(run):
        # the high is the start of the backward, before any gradient of the step exists; the
        # sharded gradients and the reduce-scatter's buffer come after, with the activations freed
        return max(st.total - st.grads_bytes + at_peak + act, st.total + buffers)
    if memory.holds_unsharded_gradients(run):
        # the one reduce-scatter of the step's gradients comes after the last backward, with the
        # activations freed; at the activation high a unit's 16-bit gradients are already added
        # into the held fp32 ones, and only the input gradient being sent is in flight
        return max(st.total - memory.unit_grad_cast_bytes(run, unit) + at_peak + act + sending,
                   st.total + at_peak + buffers)
    return st.total + at_peak + act + buffers


def _no_gradients_at_activation_high(run: ResolvedRun) -> bool:
    """Whether a step's activations peak before its gradients exist: one micro-batch, no
    pipeline, on one process or on FSDP2 (ZeRO-2/3 or tensor parallelism, whose units
    reduce-scatter their gradients as the backward reaches them); the optimizer's
    `zero_grad(set_to_none=True)` freed the last step's. With accumulation or a pipeline the
    gradients of earlier micro-batches are held (the grads term); DDP's buckets live for the run."""
    one_process = run.world_size == 1
    return (run.pp == 1 and run.grad_accum == 1 and run.offload == "none"
            and (one_process or memory.runs_on_fsdp2(run.zero_stage, run.tp, run.dp, run.offload)))


def _stage_memory(shape: ModelShape, hw: Hardware, run: ResolvedRun, rank: int) -> MemoryBreakdown:
    cfg = shape.cfg
    n_params = run_rank_params(shape, run, rank)
    unit = largest_unit_params(shape, run.tp, run.ep)
    st = _model_states(shape, run, rank, n_params, unit)
    first, last = rank == 0, rank == run.pp - 1
    act = act_work = per_layer = inflight = None
    cpu = st.cpu_bytes
    tp_seq_bytes = 0.0
    if cfg is not None:
        sa = memory.stage_activations(cfg, run, run.rank_stage_layers(rank), first, last, rank)
        act, act_work, per_layer, inflight = sa.total, sa.working_bytes, sa.layer_full_bytes, sa.inflight
        if run.lora is not None:
            # QLoRA: a weight dequantized for its matmul, before the loss's tensors exist in the
            # forward and after the head's backward freed them (plan/lora.py), in a block's
            # backward in place of its other temporaries
            dequant = lora_plan.dequant_working_bytes(cfg, run)
            act = max(act, sa.stored_bytes + sa.working_bytes - sa.backward_bytes + max(sa.backward_bytes, dequant))
        cpu += sa.cpu_bytes
        tp_seq_bytes = run.micro_batch * run.local_seq_len * cfg.d_model * element_bytes(run.precision)
    buffers, _ = memory.comm_buffer_bytes(run, unit, tp_seq_bytes)
    autocast = _autocast_copy_bytes(cfg, run, rank, n_params)
    on_cpu = hw.name == "cpu"  # the engine's CPU units (techniques/zero.py)
    block = layer_params(shape, run.tp, run.ep) if shape.known else None
    gathered = gathered_plan.gathered_param_bytes(n_params, run, unit, on_cpu=on_cpu, block=block) + autocast  # each term at its own high
    next_unit = None
    if run.ep > 1 and cfg is not None and memory.runs_on_fsdp2(run.zero_stage, run.tp, run.dp, run.offload):
        # FSDP2 gathers the dense part by blocks, the ep-split experts in units of their own (or
        # they compute on autocast's casts under `replicate`, plan/moe.py)
        experts = moe_plan.rank_expert_params(cfg, run, run.rank_layers(rank))
        next_unit = moe_plan.expert_params_per_layer(cfg) / run.ep if moe_plan.experts_sharded(run) else None
        gathered = (gathered_plan.gathered_param_bytes(n_params - experts, run, unit, next_unit, on_cpu)
                    + moe_plan.expert_working_copy_bytes(cfg, run, rank) + autocast)
    # FSDP2's all-gather buffers are held in forward only, before the activation high (plan/gathered.py)
    at_peak = gathered - gathered_plan.all_gather_buffer_bytes(run, unit, next_unit, on_cpu)
    if autocast and act_work and run.recompute.kind in ("full", "every", "segments", "op"):
        # [recompute] torch.amp + recompute: autocast's cache holds every 16-bit weight copy
        # until the forward ends (the copies' high), but a checkpointed layer's copies are not
        # saved, so in backward only the recomputed layer's own copies coexist with its working
        # set. The step's high-water mark is stored + extra + max(all copies, working + one
        # layer's copies), i.e. copies counted beyond the working layer: max(copies - working,
        # copies / L). Measured on tiny/small bf16 `full`: -16%/-25% before, within 7% after;
        # `op` checkpoints every block the same way (its policy keeps no weight cast): -21%
        # before on tiny (docs/recompute.md, tests/test_memory.py).
        at_peak = at_peak - autocast + max(autocast - act_work, autocast / max(cfg.n_layers, 1))
    allocated = _allocated_at_peak(run, st, at_peak, act or 0.0, buffers, unit, tp_seq_bytes)
    reserve = memory.ALLOCATOR_RESERVE_FRACTION * ((act or 0.0) + buffers + at_peak)
    total = allocated + reserve + hw.runtime_overhead_bytes
    name = "only" if run.pp == 1 else ("first" if first else "last" if last else f"pp rank {rank}")
    return MemoryBreakdown(
        params_bytes=st.params_bytes, grads_bytes=st.grads_bytes, optimizer_bytes=st.optimizer_bytes,
        master_weights_bytes=st.master_weights_bytes, optimizer_moments_bytes=st.optimizer_moments_bytes,
        model_states_bytes=st.total, activations_bytes=act, activation_working_bytes=act_work,
        activations_per_layer_bytes=per_layer, inflight_microbatches=inflight, comm_buffers_bytes=buffers,
        gathered_params_bytes=gathered, autocast_weight_copies_bytes=autocast, allocated_bytes=allocated,
        allocator_reserve_bytes=reserve,
        runtime_overhead_bytes=hw.runtime_overhead_bytes, total_bytes=total, capacity_bytes=hw.memory_bytes,
        cpu_bytes=cpu, stage=name,
    )


def _model_states(shape: ModelShape, run: ResolvedRun, rank: int, n_params: float,
                  largest_unit: float) -> memory.ModelStates:
    """ZeRO's model states, or a LoRA run's: the frozen base (16-bit or NF4) and the adapters'
    weights, gradients and AdamW states (plan/lora.py)."""
    if run.lora is None or shape.cfg is None:
        if run.ep > 1 and shape.cfg is not None:  # split experts: sharded over or whole on their replicas (plan/moe.py)
            experts = moe_plan.rank_expert_params(shape.cfg, run, run.rank_layers(rank))
            return _add_states(memory.model_states(n_params - experts, run, largest_unit),
                               memory.model_states(experts, moe_plan.expert_states_run(run)))
        return memory.model_states(n_params, run, largest_unit)
    s = lora_plan.model_states(n_params, run.rank_layers(rank), shape.cfg, run)
    return memory.ModelStates(params_bytes=s.params, grads_bytes=s.grads, master_weights_bytes=0.0,
                              optimizer_moments_bytes=s.moments, grad_copy_bytes=0.0, cpu_bytes=s.cpu)


def _add_states(a: memory.ModelStates, b: memory.ModelStates) -> memory.ModelStates:
    return memory.ModelStates(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a)})


def largest_micro_batch(run: ResolvedRun, hardware, memory_budget_bytes: float | None = None, limit: int = 4096,
                        gpus_per_node: int | None = None) -> int:
    """The largest micro-batch whose predicted total memory fits the device (or
    `memory_budget_bytes`), other settings as in `run` (grad_accum kept, global batch
    derived); 0 when not even one sequence fits. Memory grows monotonically with the
    micro-batch, so a doubling then bisection search suffices."""
    _, hw = _prepare(run, hardware, gpus_per_node, None)
    if memory_budget_bytes is not None:
        if memory_budget_bytes <= 0:
            raise UserError(f"memory budget must be positive, got {memory_budget_bytes}")
        hw = replace(hw, memory_bytes=float(memory_budget_bytes))

    def ok(b: int) -> bool:
        other = run.with_(micro_batch=b, grad_accum=run.grad_accum, global_batch=None, check=False)
        return _fits(predict_memory(other, hw), hw, run.world_size)

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # invariant: ok(lo), not ok(hi) (or hi beyond the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
