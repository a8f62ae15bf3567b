"""Per-GPU memory: model states (ZeRO), activations (Korthikanti et al.), buffers, reserve.

Every function returns bytes. Sources are cited beside each formula; docs/planner.md lists
them all with worked examples.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tenfold.models.presets import ModelConfig
from tenfold.plan import lora as lora_plan
from tenfold.plan.fp8 import block_param_bytes
from tenfold.plan.layer_terms import layer_activation_terms, norm_bytes_per_token
from tenfold.run import ResolvedRun, Stack, resolve
from tenfold.terms import DDP_BUCKET_BYTES, MULTI_STAGE_SCHEDULES, RecomputePolicy, element_bytes, op_saved_tensors, runs_on_fsdp2

MiB = 2**20


# --------------------------------------------------------------------------- model states
@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of each model state before ZeRO partitioning."""

    params: float
    grads: float
    master: float  # fp32 master weights (mixed precision with 16-bit params)
    optimizer: float  # Adam momentum + variance (fp32)
    grad_copy: float  # Megatron fp16: fp32 copy of the gradients for the optimizer

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.optimizer + self.grad_copy


def bytes_per_param(run: ResolvedRun) -> BytesPerParam:
    st = run.stack
    return _bytes_per_param(run.precision, st.master_weights, st.grads_fp32, st.fp32_grad_copy)


@functools.lru_cache(maxsize=64)
def _bytes_per_param(precision: str, master_weights: bool, grads_fp32: bool, fp32_grad_copy: bool) -> BytesPerParam:
    """ZeRO §3.1: mixed-precision Adam keeps 2 (fp16 params) + 2 (fp16 grads) + K = 12
    (fp32 params, momentum, variance) = 16 bytes/param. fp32 training: 4 + 4 + 8 = 16.
    Megatron's table (dist_optimizer.md): bf16 with fp32 main grads 18; fp16/fp16 20
    (an extra fp32 gradient copy). torch.amp (master_weights=False): fp32 params and grads."""
    if precision == "fp32" or not master_weights:
        return BytesPerParam(4, 4, 0, 8, 0)
    return BytesPerParam(2, 4 if grads_fp32 else 2, 4, 8, 4 if fp32_grad_copy else 0)


@dataclass
class ModelStates:
    params_bytes: float
    grads_bytes: float
    master_weights_bytes: float
    optimizer_moments_bytes: float
    grad_copy_bytes: float
    cpu_bytes: float  # offloaded to host memory

    @property
    def optimizer_bytes(self) -> float:  # optimizer states incl. master weights (ZeRO's K)
        return self.master_weights_bytes + self.optimizer_moments_bytes + self.grad_copy_bytes

    @property
    def total(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def model_states(n_params: float, run: ResolvedRun, largest_unit: float = 0.0) -> ModelStates:
    """ZeRO §5 / Table 1 for one rank holding `n_params` (already divided by tp and pp):
    stage 0: (2+2+K)Ψ; stage 1 (P_os): 2Ψ + 2Ψ + KΨ/N_d; stage 2 (P_os+g): 2Ψ + (2+K)Ψ/N_d;
    stage 3 (P_os+g+p): (2+2+K)Ψ/N_d. Offload (ZeRO-Offload, Ren et al. 2021; DeepSpeed's
    estimate_zero2/3_model_states_mem_needs): optimizer states live on the CPU, gradients as
    below; `optimizer+params` moves parameters too. `largest_unit`: the parameters of the
    largest FSDP2 unit (the gradients held under pipelining, below)."""
    b = bytes_per_param(run)
    z, dp = run.zero_runs_as, run.shard_size  # hybrid sharding: the states are split over one shard group
    opt_div = dp if z >= 1 else 1
    # Under pipeline parallelism torch.distributed.pipelining turns FSDP2's gradient sync and
    # resharding after backward off until the last micro-batch: every rank holds its stage's
    # unreduced gradients and, after a backward, its unsharded parameters (stage 2's memory).
    held = holds_unsharded_gradients(run)
    grad_div = 1 if held or z < 2 else dp
    # FSDP2 (tenfold's ZeRO-2/3) keeps each rank's fp32 shard at every stage and under
    # pipelining; the unsharded copies it computes with are plan/gathered.py's. DeepSpeed's
    # ZeRO-2 (a 16-bit stack) keeps whole 16-bit parameters.
    fsdp2_shards = z >= 2 and not run.stack.master_weights
    param_div = dp if (z >= 3 and run.pp == 1) or fsdp2_shards else 1
    st = ModelStates(
        params_bytes=b.params * n_params / param_div,
        grads_bytes=b.grads * n_params / grad_div + (unit_grad_cast_bytes(run, largest_unit) if held else 0.0),
        master_weights_bytes=b.master * n_params / opt_div,
        optimizer_moments_bytes=b.optimizer * n_params / opt_div,
        grad_copy_bytes=b.grad_copy * n_params / opt_div,
        cpu_bytes=0.0,
    )
    if run.offload == "optimizer" and not run.stack.master_weights:
        # tenfold's engine, `optimizer` (techniques/offload.HostAdamW, DeepSpeed's offload_optimizer):
        # the fp32 parameter shards and their gradients stay on the device as without offload;
        # the host holds the Adam moments and a buffer each of the parameter and gradient shards
        # the update runs on: 16 B/param / N (measured, tests/test_offload.py).
        st.cpu_bytes = (b.optimizer + b.params + b.grads) * n_params / opt_div
        st.master_weights_bytes = st.optimizer_moments_bytes = st.grad_copy_bytes = 0.0
        return st
    if run.offload == "optimizer+params" and not run.stack.master_weights:
        # tenfold's engine, `optimizer+params`: FSDP2's CPUOffloadPolicy keeps this rank's fp32
        # parameter shard, its fp32 gradient shard and the Adam moments on the host (16 B/param
        # / N; measured: 16 x params / dp bytes per rank, tests/test_offload.py); the device
        # holds only gathered units (plan/gathered.py and the buffers).
        st.cpu_bytes = 16.0 * n_params / dp
        st.params_bytes = st.grads_bytes = 0.0
        st.master_weights_bytes = st.optimizer_moments_bytes = st.grad_copy_bytes = 0.0
        return st
    if run.offload != "none":
        # ZeRO-Offload (Ren et al. 2021 §4; DeepSpeed estimate_zero2/3 with cpu_offload): the
        # fp32 master, moments and an fp32 gradient accumulator live on the host, partitioned
        # over dp (16 B/param / N_d, the estimators' CPU figure). ZeRO-2/3 send each
        # micro-batch's reduced gradient partition down as it is produced, so the GPU keeps
        # only buckets; ZeRO-1 reduces once per step, so until then every rank holds its full
        # 16-bit gradients on the GPU (or would ship them unreduced every micro-batch).
        st.cpu_bytes = st.optimizer_bytes + 4.0 * n_params / dp
        st.master_weights_bytes = st.optimizer_moments_bytes = st.grad_copy_bytes = 0.0
        st.grads_bytes = b.grads * n_params if z == 1 else 0.0
    if run.offload == "optimizer+params":
        st.cpu_bytes += st.params_bytes
        st.params_bytes = 0.0
    return st


def holds_unsharded_gradients(run: ResolvedRun) -> bool:
    """FSDP2 under pipelining: every micro-batch's gradients stay unsharded on the stage until
    the step's one reduce-scatter, after the last backward."""
    return run.zero_runs_as >= 2 and run.pp > 1


def unit_grad_cast_bytes(run: ResolvedRun, largest_unit: float) -> float:
    """Gradients beside the ones FSDP2 holds unsharded in the reduce dtype (fp32) across a
    pipelined stage's micro-batches: a unit's backward leaves its gradients on the parameters in
    the compute dtype, and the unit's post-backward adds them into the fp32 ones one parameter at
    a time (torch 2.13's FSDPParamGroup.post_backward, FSDPParam.accumulate_unsharded_grad_if_needed):
    one unit's 16-bit gradients at their high."""
    b = bytes_per_param(run)
    compute = element_bytes(run.precision)
    if run.offload != "none" or run.stack.master_weights or compute >= b.grads:
        return 0.0
    return largest_unit * compute


def _zero_paper_run(stage: int, dp: int) -> ResolvedRun:
    """The ZeRO paper's setting: fp16 mixed precision with fp32 master weights, data parallel."""
    return resolve(None, dp, params=1.0, precision="fp16", zero_stage=stage, stack=Stack(master_weights=True),
                   check=False)


def zero_model_states_gb(psi: float, stage: int, dp: int) -> float:
    """ZeRO Table 1 cell in GB (1e9 bytes): mixed-precision Adam (K = 12) at this stage."""
    return model_states(psi, _zero_paper_run(stage, dp)).total / 1e9


def largest_model_that_fits(memory_bytes: float, stage: int, dp: int) -> float:
    """ZeRO Table 2 'max theoretical model size': Ψ = M / (bytes per param at this stage)."""
    return memory_bytes / model_states(1.0, _zero_paper_run(stage, dp)).total


# --------------------------------------------------------------------------- activations
def params_16bit_in_compute(run: ResolvedRun) -> bool:
    """Whether the layers compute with 16-bit parameters: a 16-bit stack's own (master weights
    kept apart), or FSDP2's all-gathered copies (MixedPrecisionPolicy param_dtype: ZeRO-2/3, and
    `replicate` under tensor parallelism, with data parallelism). With fp32 parameters under
    autocast (DDP, one rank) the embedding's output and so the residual stream are fp32."""
    if run.precision == "fp32":
        return False
    lora_base = run.lora is not None  # the frozen base is kept in the compute dtype
    return lora_base or run.stack.master_weights or runs_on_fsdp2(run.zero_stage, run.tp, run.dp, run.offload)


def layer_input_bytes_per_token(cfg: ModelConfig, run: ResolvedRun) -> float:
    """What a fully recomputed layer keeps: its input, one element of the residual stream per
    channel. Korthikanti Table 2 'full activation recomputation': sbh(2) for a 16-bit residual;
    under autocast with fp32 parameters tenfold's residual stream is fp32 (4 bytes), with 16-bit
    parameters in compute 16-bit (measured: tiny, ZeRO-3 on 2 ranks, full recompute)."""
    if run.precision == "fp32":
        return 4.0 * cfg.d_model
    if run.stack.activation_style == "tenfold" and residual_stream_is_fp32(run):
        return 4.0 * cfg.d_model
    return 2.0 * cfg.d_model


def activation_bytes_per_layer(cfg: ModelConfig, run: ResolvedRun, drop_parts: tuple[str, ...] = ()) -> float:
    """Korthikanti Table 2 generalised: sum of the saved tensors of one layer, one micro-batch.
    TP divides "shard" terms by t; sequence parallelism also divides the "replicated" ones
    (Eq. 4: sbh/t (34 + 5as/h)). `drop_parts` are the parts that selective recompute frees.
    Under context parallelism a rank holds s/cp tokens of each sequence (their queries see all
    s keys) and keeps the other ranks' keys and values for backward (`cp_kv_bytes`)."""
    total = 0.0
    s, b, tp = run.local_seq_len, run.micro_batch, run.tp
    for term in layer_activation_terms(cfg, run):
        if term.part in drop_parts:
            continue
        n = term.bytes_per_token * b * s * (run.seq_len if term.per_seq else 1)
        if term.tp == "shard" or (run.sequence_parallel and term.tp == "replicated"):
            n /= tp
        total += n
    if "attn_core" not in drop_parts:
        total += cp_kv_bytes(cfg, run)
    return total


def cp_kv_bytes(cfg: ModelConfig, run: ResolvedRun) -> float:
    """What one layer's cp attention keeps for backward beyond the plain attention
    (techniques/context_parallel.py): the received key/value blocks, the other cp - 1 ranks' K
    and V, (cp-1)/cp x s x 2 x kv_dim / tp elements per sequence (the all-gather's output), and
    one (s/cp) x h / tp copy of its output: its chunks are joined head-major, so the output
    projection's input is a transposed copy where the plain kernel's output is reshaped as a
    view (measured: tiny at sequence 512, cp 2, fp32; tests/test_context_parallel.py). Both in
    the compute dtype; 0 without cp."""
    if run.cp <= 1:
        return 0.0
    kv = cfg.kv_heads * cfg.head_dim
    received = run.seq_len * (run.cp - 1) / run.cp * 2 * kv
    return run.micro_batch * (received + run.local_seq_len * cfg.d_model) / run.tp * element_bytes(run.precision)


def op_saved_bytes(cfg: ModelConfig, run: ResolvedRun) -> float:
    """Bytes per layer per micro-batch that per-op selective recompute keeps besides the block's
    input: torchtitan's save list applied to the block (tenfold.terms.op_saved_tensors, the
    same list the engine's policy is tested against), 16-bit outputs under autocast, fp32 ones
    (the attention's logsumexp) always."""
    B = element_bytes(run.precision)
    per_token = sum(t.per_token * (4.0 if t.fp32 else B) for t in op_saved_tensors(cfg, run.tp, run.sequence_parallel))
    return per_token * run.micro_batch * run.local_seq_len + cp_kv_bytes(cfg, run)


def recompute_layer_bytes(cfg: ModelConfig, run: ResolvedRun) -> float:
    """Bytes kept by a checkpointed layer: its input (divided by t only with SP)."""
    n = layer_input_bytes_per_token(cfg, run) * run.micro_batch * run.local_seq_len
    return n / run.tp if run.sequence_parallel else n


@dataclass
class StageActivations:
    """Activations held by one pipeline stage at its peak (the start of a backward)."""

    stored_bytes: float  # kept for backward: in-flight micro-batches x layers
    working_bytes: float  # one layer's recomputed activations during backward
    extra_bytes: float  # the last stage's final norm, logits and loss
    cpu_bytes: float  # offloaded activations
    layer_full_bytes: float  # one layer, one micro-batch, nothing recomputed
    inflight: float  # micro-batches in flight (times the interleave factor)
    stage_output_bytes: float = 0.0  # of stored_bytes: the pipeline's kept stage outputs
    receive_buffer_bytes: float = 0.0  # of stored_bytes: receive buffers beyond the in-flight block inputs
    backward_bytes: float = 0.0  # of working_bytes: a block's backward temporaries (block_backward_bytes)

    @property
    def total(self) -> float:
        # The loss and the final norm are freed by their own backward, before the first block's
        # backward recomputes anything: the two never coincide.
        return self.stored_bytes + max(self.working_bytes, self.extra_bytes)


def inflight_microbatches(schedule: str, pp: int, m: int, v: int, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `rank` keeps at once.
    No pipeline: 1 (accumulation frees each micro-batch's activations in its backward).
    GPipe: m (all forwards before any backward; Huang et al. 2019, Narayanan §2.2.1).
    1F1B: min(p - rank, m) (Narayanan §2.2.1: the first stage 'at most p', each later stage one
    fewer warm-up forward); Korthikanti §4.2.3: so the first stage holds L layers' worth
    regardless of p. Interleaved, first rank: p (1 + (p-1)/(p v)) (Korthikanti §4.2.3, Megatron
    theoretical_memory_usage); a later rank as 1F1B."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in MULTI_STAGE_SCHEDULES and v > 1 and rank == 0:
        return pp * (1 + (pp - 1) / (pp * v))
    return float(min(pp - rank, m))


def _block_recompute_bytes(policy: RecomputePolicy, layers: int, full: float, ckpt: float) -> tuple[float, float]:
    """(kept, working) activation bytes of one micro-batch when `policy` checkpoints groups of
    blocks (the engine's groups: RecomputePolicy.checkpointed_blocks). Kept, at the start of
    backward: each group's input, every other block's full activations. Working: what
    recomputing one group adds at its worst moment. Backward runs from the last block down, so
    when group j is recomputed the blocks above it are already freed: live are the inputs of
    groups 0..j, the unwrapped blocks below group j, and group j's rebuilt activations."""
    groups = policy.checkpointed_blocks(layers)
    wrapped = {i for g in groups for i in g}
    kept = len(groups) * ckpt + (layers - len(wrapped)) * full
    peak = 0.0
    for j, g in enumerate(groups):
        unwrapped_below = sum(1 for i in range(g[0]) if i not in wrapped)
        peak = max(peak, (j + 1) * ckpt + (unwrapped_below + len(g)) * full)
    return kept, max(0.0, peak - kept)


def stage_activations(cfg: ModelConfig, run: ResolvedRun, modules: tuple[int, ...], first: bool,
                      last: bool, rank: int | None = None) -> StageActivations:
    """Activations of one pipeline rank at its peak. `modules`: the blocks of each stage module
    the rank holds (one entry without interleaving); recompute wraps each module's blocks on its
    own, as the engine applies it per stage (engine/parallel/parallelize.py). `rank`: the pipeline rank
    (default 0 when `first`, else the last)."""
    policy = run.recompute
    full = activation_bytes_per_layer(cfg, run)
    ckpt = recompute_layer_bytes(cfg, run)
    layers = sum(modules)
    rank = (0 if first else run.pp - 1) if rank is None else rank
    inflight = inflight_microbatches(run.pp_schedule, run.pp, run.grad_accum, run.virtual_stages, rank)
    working, cpu = 0.0, 0.0
    k = policy.kind
    if k == "none":
        per_mb = layers * full
    elif k in ("full", "every", "segments"):
        kept_working = [_block_recompute_bytes(policy, n, full, ckpt) for n in modules]
        per_mb = sum(kw[0] for kw in kept_working)
        working = max(kw[1] for kw in kept_working)
    elif k == "selective":
        dropped = ("attn_core",) if policy.target == "attention" else ("mlp",)
        kept = activation_bytes_per_layer(cfg, run, dropped)
        per_mb, working = layers * kept, full - kept
    elif k == "op":
        # Each block checkpointed on its own, keeping its input and the op outputs on the save
        # list (tenfold.terms.op_saved_tensors); its backward rebuilds the rest of one block.
        saved = op_saved_bytes(cfg, run)
        per_mb, working = layers * (ckpt + saved), max(0.0, full - saved)
    elif k == "offload":
        # torch.autograd.graph.save_on_cpu: saved tensors go to pinned host memory; the GPU
        # keeps about one layer in flight while it is copied out / back in.
        per_mb = full
        cpu = layers * full * inflight
    else:  # pragma: no cover - parse_recompute rejects anything else
        raise AssertionError(k)
    stored = per_mb if k == "offload" else per_mb * inflight
    stage_outputs = receive_buffers = 0.0
    if run.pp > 1:
        # torch.distributed.pipelining's PipelineStage.forward_one_chunk keeps each micro-batch's
        # stage output (fwd_cache) until that micro-batch's backward runs from it: one residual-
        # stream tensor per micro-batch in flight for every stage module the rank holds but the
        # model's last (whose output feeds the loss: final_layer_activation_bytes); on the device
        # under offload too (fwd_cache is not a saved tensor). Under sequence parallelism a stage
        # hands on its (b, s/tp, h) slice.
        stage_outputs = (len(modules) - (1 if last else 0)) * inflight * ckpt
        receive_buffers = receive_buffer_bytes(len(modules), first, last, run.grad_accum,
                                               inflight if _first_block_keeps_its_input(run) else 0.0, ckpt)
        stored += stage_outputs + receive_buffers
    tokens = run.micro_batch * run.local_seq_len
    if first and run.stack.dropout:
        # Korthikanti §4.3: embedding dropout mask sbhp/t (p micro-batches in flight).
        stored += tokens * cfg.d_model * inflight / (run.tp if run.sequence_parallel else 1)
    extra = final_layer_activation_bytes(cfg, run) if last else 0.0
    backward = block_backward_bytes(cfg, run) if run.stack.activation_style == "tenfold" else 0.0
    return StageActivations(stored, working + backward, extra, cpu, full, inflight, stage_outputs, receive_buffers,
                            backward)


def block_backward_bytes(cfg: ModelConfig, run: ResolvedRun) -> float:
    """What a block's backward makes beside the activations it still holds, at its high, the
    MLP's output projection (w2): w2's weight gradient in the compute dtype (f x h / t, a
    temporary until it is added into the parameter's gradient), the gradient of w2's input
    (b s f / t), the gradient of the block's output in the compute dtype (whole under sequence
    parallelism: DTensor all-gathers it for the row-parallel w2's backward) and the residual
    stream's fp32 gradient (b s h, divided by t under sequence parallelism). An MoE layer's
    routed and shared experts run their backward one after the other: the wider of the two."""
    B = element_bytes(run.precision)
    h, tp = cfg.d_model, run.tp
    f = max(cfg.experts_per_token * cfg.expert_dim, cfg.shared_dim) if cfg.is_moe else cfg.ffn_dim
    tokens = run.micro_batch * run.local_seq_len
    split = tp if run.sequence_parallel else 1
    weight_gradient = 0.0 if run.lora is not None else B * h * f / tp  # a frozen base makes none
    return weight_gradient + tokens * (B * f / tp + B * h + 4.0 * h / split)


def _first_block_keeps_its_input(run: ResolvedRun) -> bool:
    """Whether a stage's received input is the first block's kept input (counted with the
    block): under a policy that checkpoints blocks (the checkpoint keeps it), and where the
    first norm keeps the tensor it is given: Korthikanti's 16-bit LayerNorm input, or tenfold's
    norm on an fp32 residual stream (`x.float()` is `x`). tenfold's norm on a 16-bit stream
    keeps an fp32 copy instead, and the received tensor is only a receive buffer."""
    if run.recompute.kind in ("full", "every", "segments", "op"):
        return True
    return run.stack.activation_style == "megatron" or residual_stream_is_fp32(run)


def residual_stream_is_fp32(run: ResolvedRun) -> bool:
    """tenfold's residual stream is fp32 (fp32 training, or fp32 parameters under autocast)."""
    return run.precision == "fp32" or not params_16bit_in_compute(run)


def receive_buffer_bytes(n_modules: int, first: bool, last: bool, microbatches: int, inflight_kept: float,
                         tensor_bytes: float) -> float:
    """torch.distributed.pipelining's receive buffers beyond the in-flight inputs counted as the
    first block's kept input: PipelineStage (torch 2.13) makes one buffer per micro-batch for each
    stage input (on every stage module but the model's first) and one for each stage output's
    gradient (on every stage module but the model's last) at its first step and keeps them for
    the run (pytorch/pytorch#136380). `inflight_kept`: the micro-batches whose received input is
    also the first block's kept input (0 where the blocks' inputs go to the host)."""
    receiving = n_modules - (1 if first else 0)
    returning = n_modules - (1 if last else 0)
    return (receiving * max(0.0, microbatches - inflight_kept) + returning * microbatches) * tensor_bytes


def final_layer_activation_bytes(cfg: ModelConfig, run: ResolvedRun) -> float:
    """Korthikanti §4.3 (counted on the last stage): final norm input 2sbh/t, output projection
    input 2sbh/t, fp32 logits 4sbv/t. tenfold: the final norm as a block's (`_norm_terms`) and
    the loss at its backward (`loss_bytes_per_token`)."""
    bs = run.micro_batch * run.local_seq_len
    h, tp = cfg.d_model, run.tp
    B = element_bytes(run.precision)
    if run.lora is not None and run.stack.activation_style == "tenfold":
        return lora_plan.final_norm_bytes(cfg, run) + bs * loss_bytes_per_token(cfg, run)
    if run.stack.activation_style == "tenfold":
        per_channel, per_token = norm_bytes_per_token(cfg, run.model_kind == "hf", B)
        norm_kept = (per_channel * h + per_token) / (tp if run.sequence_parallel else 1)
        return bs * (norm_kept + B * h + loss_bytes_per_token(cfg, run))
    return bs * (2 * B * h / (tp if run.sequence_parallel else 1) + 4.0 * cfg.vocab_size / tp)


def loss_bytes_per_token(cfg: ModelConfig, run: ResolvedRun) -> float:
    """The cross-entropy's fp32 tensors at their high, the start of backward (tenfold/models/
    loss.py: log_softmax of the fp32 logits, then nll_loss). On one tp rank: the saved
    log-probabilities, their gradient and the logits' gradient being made, 3 x 4 V. Under
    tensor parallelism (`loss_parallel`, the logits split over the vocabulary) torch's
    log-softmax backward makes one more: the saved log-probabilities, their gradient, exp of
    them and the product it subtracts, 4 x 4 V / t (torch.distributed.tensor.parallel.loss,
    `_log_softmax_backward_handler`)."""
    if run.tp > 1:
        return 4 * 4.0 * cfg.vocab_size / run.tp
    return 3 * 4.0 * cfg.vocab_size


# --------------------------------------------------------------------------- buffers


def comm_buffer_bytes(run: ResolvedRun, largest_unit: float, tp_seq_bytes: float) -> tuple[float, str]:
    """Communication buffers of the engine that runs (tenfold.terms.zero_runs_as).
    ZeRO-0/1 on DDP (no tensor parallelism): two gradient buckets in flight (bucket_cap_mb=25).
    FSDP2 (ZeRO-2/3, and every stage under tensor parallelism): a unit's unsharded gradients
    before its reduce-scatter (the gathered parameters are plan/gathered.py's). Nothing
    without data parallelism. PP: the input gradient a stage is sending."""
    b = bytes_per_param(run)
    unit_param_bytes, grads = block_param_bytes(run), b.grads  # float8 with --fp8 under FSDP2
    if run.lora is not None and run.model is not None:  # the frozen base gathered, the adapters' gradients
        unit_param_bytes, grads = lora_plan.unit_bytes_per_param(run)
    z = run.zero_runs_as
    if run.dp <= 1 and run.offload == "none":
        n, why = 0.0, "no gradient buffers (no data parallelism)"
    elif z >= 2 or run.tp > 1:
        n = largest_unit * max(grads, unit_param_bytes)
        why = "FSDP2: 1 unsharded grad unit"
    else:
        n = 2 * DDP_BUCKET_BYTES
        why = f"2 x {DDP_BUCKET_BYTES // MiB} MiB DDP gradient buckets"
    if run.pp > 1:  # the received tensors are activations (receive_buffer_bytes)
        n += tp_seq_bytes
        why += " + the input gradient being sent"
    return n, why


ALLOCATOR_RESERVE_FRACTION = 0.10  # caching-allocator fragmentation on churning tensors (assumption)
