"""Hugging Face causal LMs in tenfold: build from a config.json, load local safetensors, export.

    tenfold train --hf-config path/to/config.json      AutoModelForCausalLM.from_config (random init)
    tenfold train --hf-pretrained DIR                  DIR/config.json + DIR/*.safetensors
    OUT/hf/                                            written at the end of training: the
                                                       `save_pretrained` layout (config.json +
                                                       model.safetensors), loadable with
                                                       AutoModelForCausalLM.from_pretrained(OUT/hf)

Nothing here ever downloads: configs are read from local files (`AutoConfig.for_model`, not a
hub id) and weights with `local_files_only=True`. Only safetensors weights are loaded (no
pickle). Weights are kept in fp32 (the master copy; autocast computes in bf16/fp16), whatever
`dtype` the config.json names.

`transformers` is an optional dependency (`pip install tenfold[hf]`); it is imported only
when a Hugging Face model is asked for, and its absence is a UserError naming the extra.
"""

from __future__ import annotations

from pathlib import Path

from tenfold.errors import UserError
from tenfold.quiet import torchao_logs_silenced

EXTRA_HINT = "pip install 'tenfold[hf]' (transformers>=4.40)"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError(f"Hugging Face models need the transformers package: {EXTRA_HINT}") from None
    transformers.utils.logging.disable_progress_bar()  # tenfold draws its own progress
    return transformers


def config_json_path(path: str | Path, flag: str = "model.hf_config (--hf-config)") -> Path:
    """`path` itself if it is not a folder, else `path/config.json`; UserError when missing
    (what it is, a regular file of a few MB, is checked where it is read)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise UserError(f"{flag} {path}: no such file (expected a Hugging Face config.json)")
    return p


def read_config_dict(path: str | Path, flag: str = "model.hf_config (--hf-config)") -> dict:
    from tenfold.models.hf_config import read_config_json  # bounded: a regular file of a few MB

    p = config_json_path(path, flag)
    d = read_config_json(str(p), flag)
    if "model_type" not in d:
        raise UserError(f"{flag} {p}: a Hugging Face config.json needs a 'model_type' key (e.g. \"llama\", \"gpt2\")")
    return d


def load_hf_config(path: str | Path, flag: str = "model.hf_config (--hf-config)"):
    """A `transformers.PretrainedConfig` from a local config.json (never a hub id)."""
    tf = _transformers()
    d = dict(read_config_dict(path, flag))
    model_type = d.pop("model_type")
    try:
        return tf.AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError) as exc:
        raise UserError(f"{flag} {path}: transformers cannot build model_type {model_type!r} ({exc})") from None


def set_config_dtype(config, torch_dtype) -> None:
    """The config's weight dtype: `dtype` since transformers 4.56, `torch_dtype` before. Keyword
    arguments are avoided for the same reason, so that every transformers>=4.40 works."""
    setattr(config, "dtype" if "dtype" in vars(config) else "torch_dtype", torch_dtype)


def safetensors_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def check_pretrained_folder(hf_pretrained: str | Path) -> Path:
    """A `--hf-pretrained` folder has a config.json and safetensors weights, else a UserError."""
    directory = Path(hf_pretrained)
    config_json_path(directory, "model.hf_pretrained (--hf-pretrained)")
    if not safetensors_files(directory):
        raise UserError(
            f"model.hf_pretrained (--hf-pretrained) {hf_pretrained}: no *.safetensors weights in "
            "the folder (only safetensors are loaded); to start from random weights use "
            f"--hf-config {directory / 'config.json'}"
        )
    return directory


def build_hf_model(hf_config: str | None = None, hf_pretrained: str | None = None):
    """`AutoModelForCausalLM` from a local config (random init, seeded by the caller's torch
    RNG) or from a local folder with safetensors weights. fp32 parameters in both cases.
    (transformers imports torchao, where installed, as it builds a model: its import-time log
    lines are silenced, tenfold.quiet.)"""
    with torchao_logs_silenced():
        return _build_hf_model(hf_config, hf_pretrained)


def _build_hf_model(hf_config: str | None, hf_pretrained: str | None):
    import torch

    if hf_pretrained:
        directory = check_pretrained_folder(hf_pretrained)
    tf = _transformers()
    if hf_pretrained:
        config = load_hf_config(directory, "model.hf_pretrained (--hf-pretrained)")
        set_config_dtype(config, torch.float32)
        try:
            return tf.AutoModelForCausalLM.from_pretrained(
                str(directory), config=config, local_files_only=True, use_safetensors=True,
            ).float()
        except (OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"model.hf_pretrained (--hf-pretrained) {hf_pretrained}: cannot load ({exc})") from None
    if not hf_config:
        raise UserError("a Hugging Face model needs model.hf_config (--hf-config) or model.hf_pretrained (--hf-pretrained)")
    config = load_hf_config(hf_config)
    set_config_dtype(config, torch.float32)  # initialise in fp32, not in the config's 16-bit dtype
    try:
        return tf.AutoModelForCausalLM.from_config(config).float()
    except ValueError as exc:  # e.g. a model_type without a causal-LM head
        raise UserError(f"model.hf_config (--hf-config) {hf_config}: no causal LM for this config ({exc})") from None


# --------------------------------------------------------------------------- export


def full_state_dict(model) -> dict:
    """Unsharded CPU state dict of a (possibly FSDP2/DDP-wrapped) model. A collective under
    FSDP2: EVERY rank must call it (torch.distributed.checkpoint.state_dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    inner = getattr(model, "module", model)  # DDP
    return get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_hf_pretrained(model, out_dir: str | Path, is_main: bool = True) -> Path | None:
    """Write `model` (an HF PreTrainedModel, possibly sharded) as a `save_pretrained` folder:
    config.json + model.safetensors (fp32), loadable by `AutoModelForCausalLM.from_pretrained`.

    Every rank calls this (the unsharded state dict is gathered collectively); rank 0 writes.
    A pipelined model (tenfold.techniques.pipeline_runner.PipelinedModel) holds one stage per
    rank and gathers the stages itself (`full_state_dict()`)."""
    inner = getattr(model, "module", model)
    gather = getattr(inner, "full_state_dict", None)
    state = gather() if callable(gather) else full_state_dict(model)
    if not is_main:
        return None
    config = inner.config.__class__.from_dict(inner.config.to_dict())
    return write_hf_folder(state, config, out_dir, "fp32")[0]


def write_hf_folder(state: dict, config, out_dir: str | Path, dtype: str = "fp32") -> tuple[Path, int]:
    """`state` (full tensors keyed by the HF model's parameter names, e.g. a consolidated
    tenfold checkpoint) + a `PretrainedConfig` (or a config.json path) -> a save_pretrained
    folder. The weights go through a fresh model built on the meta device, so the folder names
    the plain architecture (FSDP2 renames the wrapped class), carries none of the training-time
    changes (recomputed forwards, sharded parameters), and tied weights are written once.
    Returns the folder and the model's parameter count (tied weights once)."""
    import torch

    tf = _transformers()
    from tenfold.terms import TORCH_DTYPE_NAMES

    torch_dtype = getattr(torch, TORCH_DTYPE_NAMES[dtype])
    if isinstance(config, (str, Path)):
        config = load_hf_config(config)
    set_config_dtype(config, torch_dtype)  # what from_pretrained(dtype="auto") will give back
    with torch.device("meta"):
        fresh = tf.AutoModelForCausalLM.from_config(config).to(torch_dtype)
    state = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in state.items()}
    result = fresh.load_state_dict(state, strict=False, assign=True)
    fresh.tie_weights()
    still_meta = [n for n, p in fresh.named_parameters() if p.is_meta]
    if result.unexpected_keys or still_meta:
        raise UserError(
            f"export to a Hugging Face folder: the weights do not fit {type(fresh).__name__} "
            f"(missing: {still_meta[:5]}, unexpected: {result.unexpected_keys[:5]})"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Non-persistent buffers (rotary inv_freq) stay on meta: save_pretrained does not write
    # them and from_pretrained recomputes them from the config.
    fresh.save_pretrained(str(out), safe_serialization=True)
    return out, sum(p.numel() for p in fresh.parameters())


def ties_word_embeddings(source: str | Path) -> bool:
    """Whether the model of this config.json (or folder) ties lm_head to the token embedding."""
    return bool(getattr(load_hf_config(source, "the checkpoint's model.hf_config"), "tie_word_embeddings", False))


def export_checkpoint_to_hf(weights: dict, saved_model: dict, out_dir: str | Path, info: dict) -> dict:
    """`tenfold export` of a Hugging Face run's checkpoint (called by engine/outputs/export.py): the
    consolidated `model.*` tensors -> a save_pretrained folder in `info["dtype"]`. The config
    comes from the run's own model.hf_pretrained / model.hf_config path."""
    source = saved_model.get("hf_pretrained") or saved_model.get("hf_config")
    config = load_hf_config(source, "the checkpoint's model.hf_config")
    out, n_params = write_hf_folder(weights, config, out_dir, info["dtype"])
    files = safetensors_files(out)
    return {
        **info, "format": "hf-save_pretrained", "model": source, "num_params": n_params,
        "safetensors": str(out), "config": str(out / "config.json"),
        "bytes": sum(f.stat().st_size for f in files),
    }
