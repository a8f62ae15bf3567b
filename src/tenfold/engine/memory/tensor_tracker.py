"""One step's memory by category, measured with PyTorch's tensor tracker
(`torch.distributed._tools.mem_tracker.MemTracker`: a TorchDispatchMode that sees every storage
the step creates and frees, and tells parameters, buffers, gradients, optimizer states and
activations apart through module, gradient and optimizer hooks). tenfold.engine.memory.measure reports
it; tenfold.engine.memory.tracker_probe checks once that it works in this torch.

MemTracker is imported inside `_make_tracker_class` on purpose: it is private PyTorch API that
may be missing in an untested release, and a run without it must still train (the probe says
why memory was not measured).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn

# torch's ModTracker (under MemTracker) warns "Please file a bug to PyTorch" when a module is
# entered while it is still running (a module that calls itself, Hugging Face's nested calls):
# the categories measured here do not depend on the module hierarchy, and a user cannot act on it.
TRACKER_NOISE = "The module hierarchy tracking maybe be messed up"


class _NoHook:
    """A hook handle for a parameter that has no hook (MemTracker removes every handle it holds)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


GATHERED = "Gathered parameter"  # the tracker's category for unsharded working copies of parameters


class _GatheredCopies:
    """MemTracker's categories plus one (a mixin of StepMemTracker): unsharded working copies of
    parameters, which MemTracker would file as activations: the storages FSDP2 all-gathers into
    (`gathered`) and casts of the model's own parameter storages (`params`; autocast's 16-bit
    weight copies). `_gathered_type` is the tracker's category for them."""

    _gathered_type: Any = None
    gathered: set[int]
    params: set[int]
    _casting_param = False
    making: Any = None  # the category of every storage made now (`file_unsharded_grads_as_gradients`), or None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._casting_param = func is torch.ops.aten._to_copy.default and bool(args) and bool(
            _storage_ids(args[0]) & self.params)
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._casting_param = False

    def _category(self, t: torch.Tensor, reftype):
        # A cast's storage is filed as it is made (its category stays with it until it is
        # freed); its id is not kept: a later storage may reuse the address. FSDP2's gathered
        # storages live as long as the model, so their ids stay theirs.
        if self._casting_param or _storage_ids(t) & self.gathered:
            return self._gathered_type
        if self.making is not None:
            return self.making
        return reftype

    def _track(self, reftype, t: torch.Tensor) -> None:
        super()._track(self._category(t, reftype), t)

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype, update_existing: bool = False):
        return super()._update_and_maybe_create_winfos(t, self._category(t, reftype), update_existing)


def _follow_category_peaks(tracker: Any, current: dict) -> None:
    """The high-water marks a step's report needs besides the total peak, per device:
    activations + temporaries (with the snapshot then), gathered parameter copies, gradients."""
    for dev, snap in current.items():
        by_name: dict[str, int] = {}
        for k, v in snap.items():
            name = getattr(k, "value", k)
            by_name[name] = by_name.get(name, 0) + v
        act = by_name.get("Activation", 0) + by_name.get("Temp", 0)
        if act > tracker.act_peak.get(dev, (-1, None))[0]:
            tracker.act_peak = {**tracker.act_peak, dev: (act, dict(snap))}
        tracker.gathered_peak[dev] = max(tracker.gathered_peak.get(dev, 0), by_name.get(GATHERED, 0))
        tracker.grad_peak[dev] = max(tracker.grad_peak.get(dev, 0), by_name.get("Gradient", 0))


def _follow_total_peak(tracker: Any) -> None:
    """MemTracker's global peak and its snapshot, without its per-module snapshots."""
    for dev, snap in tracker._curr_mem_snap.items():
        if tracker._peak_mem.get(dev, 0) < snap["Total"]:
            tracker._peak_mem[dev] = snap["Total"]
            tracker._peak_mem_snap[dev] = dict(snap)


def _mark_frozen_params_hooked(tracker: Any, module: nn.Module) -> None:
    """MemTracker hooks every parameter's gradient, and torch refuses a hook on a tensor that
    takes no gradient (a LoRA run's frozen base): those are marked as hooked."""
    for param in module.parameters():
        if not param.requires_grad and tracker._param_to_grad_hook_handles.get(param) is None:
            tracker._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)


def _make_stage_mod_tracker_class():
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.autograd.graph import register_multi_grad_hook
    from torch.utils._pytree import tree_flatten

    class StageModTracker(ModTracker):
        """ModTracker whose end-of-module-backward marker skips inputs that are autograd leaves.

        ModTracker marks the end of a module's backward with a multi-grad hook on every input
        that requires a gradient; the hook asks the autograd engine whether each input's node
        will run, which the engine refuses for a leaf inside `torch.autograd.grad` ("A leaf node
        was passed to _will_engine_execute_node", torch 2.13). A pipeline stage's input is such
        a leaf (the received activation), and the zero-bubble schedule runs the stage's input
        backward with `torch.autograd.grad`. A module whose every such input is a leaf gets the
        end-of-backward marker ModTracker gives a module without one (the engine's callback at
        the end of the backward). The markers only time the per-module snapshots; the step's
        categories and peak do not depend on them.
        """

        def _fw_pre_hook(self, mod, input):
            if torch._dynamo.eval_frame._is_in_optimized_module():
                return
            name = self._get_mod_name(mod)
            w_mod = weakref.ref(mod)
            self._get_append_fn(w_mod, name, False)()
            if self._user_pre_fw_hook is not None:
                self._user_pre_fw_hook(mod, input)
            args, _ = tree_flatten(input)
            tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad and a.grad_fn is not None]
            if not self.is_bw:
                if tensors:
                    register_multi_grad_hook(tensors, self._get_pop_fn(w_mod, name, True))
                else:
                    self._post_bw_callbacks_to_enqueue.append(self._get_pop_fn(w_mod, name, True))

    return StageModTracker


def _make_tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _RefType

    stage_mod_tracker = _make_stage_mod_tracker_class()

    # A str enum: each member equals MemTracker's own member of the same name and value.
    step_ref_type = _RefType("StepRefType", {**{m.name: m.value for m in _MemRefType}, "GATHERED": GATHERED})

    class StepMemTracker(_GatheredCopies, MemTracker):
        """MemTracker that accepts several forwards of the root module in one step, and files
        gathered parameter copies on their own (`_GatheredCopies`).

        Gradient accumulation (and pipeline micro-batches) call the model once per
        micro-batch; MemTracker raises NotImplementedError on a second root forward. We
        restart the module-wise statistics at each root forward instead (the report shows the
        last micro-batch, every one has the same shapes); the global peak is kept.
        """

        _gathered_type = step_ref_type.GATHERED

        def __init__(self, per_module: bool = True, gathered: set[int] = frozenset(),
                     params: set[int] = frozenset()) -> None:
            super().__init__()
            self._mod_tracker = stage_mod_tracker()
            self._ref_class = step_ref_type
            self.per_module = per_module  # False: only the step's totals (much less overhead)
            self.act_peak: dict = {}  # per device: (highest Activation + Temp, the snapshot then)
            self.gathered_peak: dict = {}  # per device: highest bytes of gathered parameter copies
            self.grad_peak: dict = {}  # per device: highest bytes of gradients (unsharded ones included)
            self.held_unsharded_grads = False  # FSDP2 held gradients across micro-batches unsharded
            self.gathered, self.params = set(gathered), set(params)

        def _update_peak_stats(self, peak_state) -> None:
            # Called after every operator: also follow the activation high-water mark, which
            # need not coincide with the total peak (that can be in the optimizer step).
            if self.per_module:
                super()._update_peak_stats(peak_state)
            else:  # MemTracker's global part only: no per-module peak snapshots (deep copies)
                _follow_total_peak(self)
            _follow_category_peaks(self, self._curr_mem_snap)

        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
            _mark_frozen_params_hooked(self, module)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    # A root's next forward restarts the statistics of that root's modules
                    # only: a multi-stage pipeline schedule runs several roots on one rank (its
                    # stages), and a stage's backward may still be due when another stage's
                    # next forward starts (its modules' backward hooks look their stats up).
                    # With one root, that is every module tracked.
                    for sub in module.modules():
                        self.memory_tracking.pop(sub, None)
            super()._pre_fw_hook(module, inputs)

    return StepMemTracker


def _storage_ids(t: Any) -> set[int]:
    """Ids of the storages behind a tensor (a DTensor's local tensor; nothing for a non-tensor)."""
    if not isinstance(t, torch.Tensor):
        return set()
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    try:
        return {t.untyped_storage()._cdata}
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
        return set()


def pipeline_receive_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The receive buffers of this rank's pipeline stages (`model.runner.stages`, tenfold's
    PipelinedModel): torch.distributed.pipelining's PipelineStage makes one per micro-batch for
    each stage input and each output's gradient at the first step and keeps them for the run
    (pytorch/pytorch#136380). A step sees a buffer only once it receives into it; these are filed
    as activations from the step's start, where a device holds them."""
    buffers = []
    for stage in getattr(getattr(model, "runner", None), "stages", ()):
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            buffers += [i.buffer for i in infos if isinstance(getattr(i, "buffer", None), torch.Tensor)]
    return buffers


def pipeline_receive_buffer_bytes(model: nn.Module) -> int:
    """Bytes of `pipeline_receive_buffers`, each its own storage (fake storages share a null
    address, so `unique_nbytes` would count one)."""
    return sum(b.untyped_storage().nbytes() for b in pipeline_receive_buffers(model))


def fsdp_param_groups(model: nn.Module) -> list[Any]:
    """FSDP2's parameter groups inside `model`: one per fully_shard unit, or several where a
    unit's parameters sit on different meshes (a state's `_fsdp_param_groups`, torch 2.13)."""
    groups, seen = [], set()
    # a pipelined model registers its stages' submodules; each stage's root unit is the stage module
    stage_roots = [m for m in getattr(model, "parts", ()) if isinstance(m, nn.Module)]
    for m in [*model.modules(), *stage_roots]:
        if id(m) in seen:
            continue
        seen.add(id(m))
        get_state = getattr(m, "_get_fsdp_state", None)
        state = get_state() if callable(get_state) else None
        if state is None:
            continue
        many = getattr(state, "_fsdp_param_groups", None)
        one = getattr(state, "_fsdp_param_group", None) if many is None else None
        groups += list(many) if many is not None else ([one] if one is not None else [])
    return groups


def gathered_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors FSDP2 all-gathers this model's parameters into (each unit's unsharded
    parameters, whose storages it frees and re-allocates in place between gathers, so the same
    storages for the whole run): FSDP2's own per-parameter state, read after its first gather."""
    out: list[torch.Tensor] = []
    for group in fsdp_param_groups(model):
        for fsdp_param in group.fsdp_params:
            out += [*getattr(fsdp_param, "all_gather_outputs", ()), *getattr(fsdp_param, "_unsharded_inner_tensors", ())]
    return out


def file_unsharded_grads_as_gradients(model: nn.Module, tracker: Any) -> list[Any]:
    """Without gradient sync (pipelining: one reduce-scatter at the end of the step) FSDP2 keeps
    every micro-batch's gradient on its unsharded parameters (`.grad`, then
    `unsharded_accumulated_grad` in the reduce dtype) until the step's reduce-scatter:
    gradients, which the tracker would file as activations because they belong to no
    registered parameter. Hooks on the unsharded parameters and around each group's
    post-backward file them as gradients. Such a post-backward only adds each new gradient into
    the accumulated one in place or, at the group's first backward of the step, casts it to the
    reduce dtype (`FSDPParam.to_accumulated_grad_if_needed`): every storage it makes is a
    gradient, filed so as it is made (filed after the post-backward, one block's fp32 gradients
    would count as activations until the last of them is cast: 6.75 GiB of GPT-3 175B's
    activation high-water mark, pp 16). A post-backward that reduces makes the reduce-scatter's
    input and output (`foreach_reduce`): communication buffers (the planner's, one unsharded
    gradient unit), filed as "Other", then the output's storage as a gradient once it holds the
    parameters' sharded gradients. Returns the handles to remove."""
    grad = tracker._ref_class.GRAD

    def file(t: torch.Tensor | None) -> None:
        if isinstance(t, torch.Tensor):
            tracker._update_and_maybe_create_winfos(t, grad)
            tracker.held_unsharded_grads = True

    def file_group(group: Any) -> None:
        if group.reduce_grads:  # the sharded gradients, in the reduce-scatter's output
            for fsdp_param in group.fsdp_params:
                sharded = getattr(getattr(fsdp_param, "sharded_param", None), "grad", None)
                if isinstance(sharded, torch.Tensor):
                    tracker._update_and_maybe_create_winfos(sharded, grad)
            return
        for fsdp_param in group.fsdp_params:
            file(getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None))
            file(getattr(fsdp_param, "unsharded_accumulated_grad", None))

    handles: list[Any] = []
    for group in fsdp_param_groups(model):
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if isinstance(unsharded, torch.Tensor) and unsharded.requires_grad:
                handles.append(unsharded.register_post_accumulate_grad_hook(
                    lambda p, g=group: None if g.reduce_grads else file(p.grad)))
        handles.append(_AroundMethod(group, "post_backward", _post_backward_category(tracker), tracker, after=file_group))
    return handles


class _AroundMethod:
    """Runs method `name` of FSDP2's parameter group `group` with `tracker` filing every storage
    it makes under `category(group)`, then calls `after(group)`; `remove()` restores the
    group's method."""

    def __init__(self, group: Any, name: str, category: Callable[[Any], Any], tracker: Any,
                 after: Callable[[Any], None] | None = None) -> None:
        self.group, self.name, original = group, name, getattr(group, name)

        def around(*args: Any, **kwargs: Any) -> Any:
            outer = tracker.making
            tracker.making = category(group)
            try:
                out = original(*args, **kwargs)
            finally:
                tracker.making = outer
            if after is not None:
                after(group)
            return out

        setattr(group, name, around)

    def remove(self) -> None:
        self.group.__dict__.pop(self.name, None)


def _post_backward_category(tracker: Any) -> Callable[[Any], Any]:
    """A post-backward that reduces makes communication buffers ("Other"); one that does not
    only accumulates gradients."""
    return lambda group: tracker._ref_class.OTH if group.reduce_grads else tracker._ref_class.GRAD


def file_all_gathers_as_gathered(model: nn.Module, tracker: Any) -> list[Any]:
    """FSDP2's all-gather buffer of a unit (`FSDPParamGroup.unshard`: one flat tensor of the
    unit's unsharded parameters, made when the all-gather is issued and freed after the copy-out
    into the parameters' own storages) is a gathered copy in flight: filed as gathered
    parameters, which the tracker would file as activations. Under the pipelining runtime
    schedules (interleaved, zero-bubble) whole stages are unsharded ahead of their compute, and
    each of their units' buffers waits for the stage's first compute. Returns the handles to
    remove."""
    return [_AroundMethod(group, "unshard", lambda g: tracker._gathered_type, tracker)
            for group in fsdp_param_groups(model)]


def gathered_storages(model: nn.Module) -> set[int]:
    return set().union(*(_storage_ids(t) for t in gathered_tensors(model)))


def gathered_bytes_now(tensors: list[torch.Tensor]) -> int:
    """Bytes of `gathered_tensors` allocated at this moment (a freed unit's storage has size 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def param_storages(model: nn.Module) -> set[int]:
    ids: set[int] = set()
    for p in model.parameters():
        ids |= _storage_ids(p)
    return ids


def category_bytes(snapshot: dict, device: torch.device | None = None) -> dict[str, int]:
    """MemTracker snapshot {device: {reftype: bytes}} -> our keys, summed over devices."""
    out = dict.fromkeys(("param", "buffer", "grad", "act", "temp", "opt", "other", "gathered", "total"), 0)
    names = {
        "Parameter": "param", "Buffer": "buffer", "Gradient": "grad", "Activation": "act",
        "Temp": "temp", "Optstate": "opt", "Other": "other", GATHERED: "gathered", "Total": "total",
    }
    for dev, snap in snapshot.items():
        if device is not None and torch.device(dev).type != device.type:
            continue
        for ref, nbytes in snap.items():
            key = names.get(getattr(ref, "value", ref))
            if key:
                out[key] += int(nbytes)
    return out


def optimizers_of(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind `optimizer` (a plain one, or a container with `.optimizers`)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    inner = getattr(optimizer, "optimizers", None) or getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer):
        return [inner]
    return [o for o in (inner or []) if isinstance(o, torch.optim.Optimizer)]


def _tracked_step(model: nn.Module, optimizer: Any, run_step: Callable[[], None], device: torch.device,
                  per_module: bool = False):
    """Run `run_step` once under the tracker. Returns (tracker, snapshots at the optimizer
    step: {'pre': ..., 'post': ...}, peak snapshot)."""
    tracker = _make_tracker_class()(per_module, gathered=gathered_storages(model), params=param_storages(model))
    optimizers = optimizers_of(optimizer)
    tracker.track_external(model, *optimizers)
    for buffer in pipeline_receive_buffers(model):  # made in an earlier step, kept for the run
        tracker._update_and_maybe_create_winfos(buffer, tracker._ref_class.ACT)
    at_step: dict[str, dict] = {}
    handles = file_unsharded_grads_as_gradients(model, tracker) + file_all_gathers_as_gathered(model, tracker)

    params = list(model.parameters())

    def snap(key: str) -> None:
        if key == "post" or key not in at_step:
            at_step[key] = tracker.get_tracker_snapshot("current")
            if key == "pre":  # [zero] DDP's bucket-view gradients predate the tracker: count storages
                at_step["grad_storage_bytes"] = unique_nbytes(p.grad for p in params)  # type: ignore[assignment]

    for opt in optimizers:
        # Model states as held at the optimizer step: after backward, before zero_grad frees
        # the gradients (pre-hook); optimizer states once they exist (post-hook: covers step 1).
        # (Hooks must return None: a pre-hook's return value would replace step's arguments.)
        handles.append(opt.register_step_pre_hook(lambda *_: snap("pre")))
        handles.append(opt.register_step_post_hook(lambda *_: snap("post")))
    formatwarning = warnings.formatwarning  # ModTracker replaces it for the whole process
    try:
        with tracker, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=TRACKER_NOISE, category=UserWarning)
            run_step()
    finally:
        warnings.formatwarning = formatwarning
        for h in handles:
            h.remove()
    return tracker, at_step, tracker.get_tracker_snapshot("peak")


def measure_cpu(model, optimizer, run_step, device, per_module: bool = False) -> tuple[dict, Any]:
    tracker, at_step, peak_snap = _tracked_step(model, optimizer, run_step, device, per_module)
    peak = category_bytes(peak_snap, device)
    act_peak = category_bytes({d: snap for d, (_, snap) in tracker.act_peak.items()}, device)
    pre = category_bytes(at_step.get("pre", peak_snap), device)
    post = category_bytes(at_step.get("post", at_step.get("pre", peak_snap)), device)
    measured = {
        "params_bytes": pre["param"],
        # Gradients at their high-water mark: at the optimizer step, or earlier in the step
        # where FSDP2 holds unsharded ones until its one reduce-scatter (pipelining).
        "grads_bytes": max(pre["grad"], int(at_step.get("grad_storage_bytes", 0)),
                           sum(n for dev, n in tracker.grad_peak.items() if torch.device(dev).type == device.type)
                           if tracker.held_unsharded_grads else 0),
        "optimizer_bytes": max(post["opt"], pre["opt"]),
        # Saved-for-backward tensors and temporaries at their high-water mark (MemTracker may
        # file some recomputed tensors under Temp rather than Activation, its documented
        # limitation; the sum is exact). Not taken at the total peak: with recompute, or
        # small activations, that peak can fall in the optimizer step (foreach temporaries).
        "activations_bytes": act_peak["act"] + act_peak["temp"],
        # Unsharded working copies of parameters (FSDP2's gathered units, autocast's weight
        # casts) at their own high-water mark in the step.
        "gathered_params_bytes": sum(n for dev, n in tracker.gathered_peak.items()
                                     if torch.device(dev).type == device.type),
        "buffers_bytes": peak["buffer"],
        "other_bytes": peak["other"],
        "peak_bytes": peak["total"],
    }
    measured["total_bytes"] = model_states_plus_activations(measured)
    return measured, tracker


def model_states_plus_activations(m: dict) -> int:
    """params + grads + optimizer + gathered params + activations: the planner's sum."""
    return int(m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] + m.get("gathered_params_bytes", 0)
               + m["activations_bytes"])



def unique_nbytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (local shards for DTensors)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total
