"""The JSON side of a checkpoint as `torch.distributed.checkpoint.stateful.Stateful` objects:
RNG streams, data loader position, LR schedule, loss scaler, trainer counters.

Each has `state_dict()` (plain JSON data) and `load_state_dict(data)`, plus `validate(data)`,
which raises `ValueError` saying what is wrong without changing anything. The manager
validates every piece of a checkpoint before it restores any, so a malformed file (a rank
file without `rng.numpy`, a counter that is a string) is refused as a whole and `--resume
auto` can fall back to the previous checkpoint.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import random
from typing import Any

import numpy as np
import torch

from tenfold.engine.outputs.checkpoint.model_state import ModelState, OptimizerState


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError(f"{what} is not valid base64") from None


def _entry(state: Any, key: str, kind: type | tuple, where: str) -> Any:
    if not isinstance(state, dict) or key not in state:
        raise ValueError(f"{where} has no {key!r} entry")
    if not isinstance(state[key], kind) or isinstance(state[key], bool):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ValueError(f"{where}.{key} must be a {names}")
    return state[key]


# --------------------------------------------------------------------------- RNG streams


def capture_rng_state() -> dict:
    """This process's RNG states as JSON: torch CPU (+ every CUDA device), numpy, `random`."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch_cpu": _b64(torch.get_rng_state().numpy().tobytes()),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss},
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = [_b64(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return state


def _decoded_rng(state: Any) -> tuple:
    """The saved streams, decoded and tried on scratch generators (ValueError if unusable)."""
    cpu = torch.frombuffer(bytearray(_unb64(_entry(state, "torch_cpu", str, "rng"), "rng.torch_cpu")), dtype=torch.uint8)
    npst = _entry(state, "numpy", dict, "rng")
    py = _entry(state, "python", dict, "rng")
    np_state = (_entry(npst, "kind", str, "rng.numpy"), np.array(_entry(npst, "keys", list, "rng.numpy"), dtype=np.uint32),
                _entry(npst, "pos", int, "rng.numpy"), _entry(npst, "has_gauss", int, "rng.numpy"),
                float(_entry(npst, "cached_gaussian", (int, float), "rng.numpy")))
    gauss = py.get("gauss_next")
    if gauss is not None and not isinstance(gauss, (int, float)):
        raise ValueError("rng.python.gauss_next must be a number or null")
    py_state = (_entry(py, "version", int, "rng.python"), tuple(_entry(py, "state", list, "rng.python")), gauss)
    cuda = [torch.frombuffer(bytearray(_unb64(s, "rng.torch_cuda")), dtype=torch.uint8)
            for s in (_entry(state, "torch_cuda", list, "rng") if "torch_cuda" in state else [])]
    try:  # the generators' own checks, on throw-away generators
        torch.Generator().set_state(cpu)
        np.random.RandomState().set_state(np_state)
        random.Random().setstate(py_state)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"rng holds an unusable generator state ({str(e).splitlines()[0]})") from None
    return cpu, np_state, py_state, cuda


def restore_rng_state(state: dict) -> None:
    cpu, np_state, py_state, cuda = _decoded_rng(state)
    torch.set_rng_state(cpu)
    np.random.set_state(np_state)
    random.setstate(py_state)
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


class RNGState:
    """This rank's random streams (torch CPU/CUDA, numpy, python `random`): a per-rank state.
    Restoring them is what makes a resumed run draw the same dropout/noise as an
    uninterrupted one."""

    def state_dict(self) -> dict:
        return capture_rng_state()

    def validate(self, state: Any) -> None:
        _decoded_rng(state)

    def load_state_dict(self, state: dict) -> None:
        restore_rng_state(state)


# --------------------------------------------------------------------------- JSON-shaped state


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, (list, tuple)) else "object" if isinstance(value, dict) else type(value).__name__


def _same_shape(current: dict, saved: Any, where: str) -> None:
    """`saved` has this object's keys, each of the same JSON kind (an integer may stand where a
    number is expected; anything may stand where this run holds null)."""
    if not isinstance(saved, dict):
        raise ValueError(f"{where} must be a JSON object, not {_json_kind(saved)}")
    if "kind" in current and saved.get("kind") != current["kind"]:
        return  # another kind of object (a static vs a dynamic loss scaler): its own
        # load_state_dict names the mismatch, which is the user's settings, not a bad file
    missing = sorted(set(current) - set(saved))
    if missing:
        raise ValueError(f"{where} has no {missing[0]!r} entry")
    for key, value in current.items():
        want, got = _json_kind(value), _json_kind(saved[key])
        if want != got and want != "null" and not (want == "number" and got == "integer"):
            raise ValueError(f"{where}.{key} must be {want}, not {got}")


class JsonState:
    """Any object whose state is plain JSON data, as a Stateful: an object with
    state_dict/load_state_dict (LR schedule, loss scaler, data loader), a dataclass (the
    trainer's counters) or a dict. A saved state must have the current state's keys and
    kinds (`validate`) before it is restored."""

    def __init__(self, obj: Any, name: str):
        self.obj, self.name = obj, name

    def state_dict(self) -> Any:
        obj = self.obj
        if hasattr(obj, "state_dict"):
            obj = obj.state_dict()
        elif dataclasses.is_dataclass(obj):
            obj = dataclasses.asdict(obj)
        elif not isinstance(obj, dict):
            obj = dict(vars(obj))
        try:
            return json.loads(json.dumps(obj))
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint state {self.name!r} must be JSON-serialisable: {e}") from None

    def validate(self, data: Any) -> None:
        _same_shape(self.state_dict(), data, self.name)

    def load_state_dict(self, data: Any) -> None:
        obj = self.obj
        if hasattr(obj, "load_state_dict"):
            obj.load_state_dict(data)
        elif isinstance(obj, dict):
            obj.clear()
            obj.update(data)
        else:
            for k, v in data.items():
                setattr(obj, k, v)


def training_states(model, optimizer, *, scheduler=None, scaler=None, loader=None, counters=None,
                    lora=None) -> dict:
    """The `states` a training run checkpoints, under the names the on-disk format uses:
    model + optimizer in DCP, the rest as JSON (see `manager.DCP_STATES` / `RANK_STATES`).
    `lora`: a LoRA run's base identity (engine/loop/lora_run.LoraCheckpointState); the model state is
    then the adapters only."""
    states: dict[str, Any] = {"model": ModelState(model, trainable_only=lora is not None), "rng": RNGState()}
    if lora is not None:
        states["lora"] = lora
    if optimizer is not None:
        states["optim"] = OptimizerState(model, optimizer)
    for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("loader", loader), ("state", counters)):
        if obj is not None:
            states[name] = JsonState(obj, name)
    return states
