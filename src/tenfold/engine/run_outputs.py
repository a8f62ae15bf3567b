"""What a training run writes besides the metrics: the run's facts (header and summary.json),
summary.json itself, the 16-bit and Hugging Face exports, the tokenizer, the closing lines.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console

from tenfold.config import ModelSection, TenfoldConfig
from tenfold.engine import summary as run_summary
from tenfold.engine import wandb_log
from tenfold.engine.export import export_after_training
from tenfold.engine.distributed import DistInfo
from tenfold.engine.lora_run import ADAPTER_FOLDER, save_adapter_at_end
from tenfold.engine.parts import Parts
from tenfold.engine.peak import mfu_peak, peak_source
from tenfold.engine.run_folder import replace_folder
from tenfold.models.hf import save_hf_pretrained
from tenfold.plan.hardware import gpu_peak_flops_for_device  # the planner's catalog

if TYPE_CHECKING:  # typing only: engine/fit.py imports this module
    from tenfold.engine.fit import Fit


def console(main: bool) -> Console | None:
    if not main:
        return None
    return Console(soft_wrap=True)  # a line stays one line in a log file; tables keep their width


def device_peak(dist: DistInfo, dtype: str, measure: bool = True) -> tuple[float | None, str | None]:
    """(dense peak FLOP/s of one device for `dtype`, MFU's denominator; or None and why no MFU
    is reported). On a CPU the measured peak: `measure=False` takes the cached figure only (a
    run's start never waits on a measurement, engine/peak.py)."""
    if dist.device.type == "cpu":  # the ranks share this machine's cores
        return mfu_peak(dtype, ranks=dist.world_size, measure=measure)
    return gpu_peak_flops_for_device(torch.cuda.get_device_name(dist.device), dtype), None


def facts(p: Parts, cfg: TenfoldConfig, label: str) -> run_summary.RunFacts:
    r = p.run
    peak, mfu_note = device_peak(p.dist, p.precision.name, measure=False)  # the start: a cached CPU peak or none, never a wait
    return run_summary.RunFacts(
        config=cfg.to_dict(), model_label=label,
        blocks=f"{len(p.adapter.blocks)} x {p.adapter.block_class}", params=p.adapter.param_count,
        flops_per_token=p.adapter.flops_per_token, device=str(p.dist.device), world_size=p.dist.world_size,
        dtype=p.precision.name, peak_flops_per_device=peak, mfu_note=mfu_note,
        peak_source=peak_source(p.dist.device.type),
        batch=r.batch_summary(), layout=r.layout(), layout_line=r.layout_line(),
    )


def measured_peak(fit: Fit) -> run_summary.RunFacts:
    """The run's facts with this CPU's peak measured where none was cached (or the cached one is
    to be measured again): after the run's timings are taken, so that no throughput figure
    includes it, and by the main rank alone (the figure is the same for every rank)."""
    if fit.dist.device.type != "cpu" or not fit.dist.is_main:
        return fit.facts
    peak, note = device_peak(fit.dist, fit.parts.precision.name, measure=True)
    return replace(fit.facts, peak_flops_per_device=peak, mfu_note=note)


def model_label(model: ModelSection, user_model: Any = None) -> str:  # preset name, HF config path or the user's class
    if user_model is not None:
        return type(user_model).__name__
    return model.hf_pretrained or model.hf_config or model.name


def totals(fit: Fit) -> dict:  # the counters summary.json reports
    s = fit.state
    return {"steps": s.step, "tokens": s.tokens, "skipped_steps": s.skipped, "val_loss": fit.val_loss,
            "loss_scale": fit.parts.precision.scaler.scale, "compile_s": fit.compile_clock.report()}


def start_wandb(fit: Fit):
    if not fit.cfg.log.wandb:
        return None
    return wandb_log.start(fit.cfg.log, fit.cfg.to_dict(), fit.out_dir, fit.state.step, fit.say)


def finish(fit: Fit, last: dict, wall: float) -> dict:
    """summary.json (rank 0), the requested exports, the summary table."""
    t, s = fit.parts, fit.state
    fit.facts = measured_peak(fit)
    summary = run_summary.build_summary(fit.facts, s.history, totals(fit), last, wall, fit.step_times)
    if fit.dist.pp_size > 1:  # split, measured bubble per stage vs (P-1)/m
        summary["pipeline"] = t.model.report(fit.dist)
    summary["memory"].update(fit.run_memory.summary())
    if t.lora is not None:
        summary["lora"] = {**t.lora.record(), "adapted_linears": t.lora.summary.adapted,
                           "trainable_params": t.lora.summary.trainable, "frozen_params": t.lora.summary.frozen,
                           "nf4_linears": t.lora.summary.nf4}
    summary.update(exports(fit))
    summary["tokenizer"] = tokenizer_summary(t.data, fit.tokenizer_dir, summary.get("hf_export"))
    fit.writer.log_final(summary["final"])
    if fit.dist.is_main:
        run_summary.write_json_atomic(fit.out_dir / "summary.json", summary)
        fit.console.print(run_summary.summary_table(summary, fit.out_dir))
        fit.console.print(run_summary.outputs_text(written_paths(fit, summary)), soft_wrap=True, highlight=False)
        fit.folder.commit()  # finished: the run --overwrite replaces goes now
    return summary


def written_paths(fit: Fit, summary: dict) -> list[tuple[str, str]]:
    """(path, what it is) of every file or folder this run wrote, for the closing lines."""
    out = [(str(fit.out_dir / "summary.json"), "final figures, resolved config, memory")]
    out += [(str(path), what) for path, what in fit.writer.paths.values()]
    saves = fit.checkpoints.saves
    if saves:
        out.append((str(saves[-1].path), f"checkpoint of step {saves[-1].step}"))
    if summary.get("export"):
        out.append((summary["export"], "16-bit weights (checkpoint.export_16bit)"))
    if summary.get("hf_export"):
        out.append((summary["hf_export"], "Hugging Face save_pretrained folder"))
    if summary.get("adapter_export"):
        out.append((summary["adapter_export"], "the adapters as a PEFT folder (tenfold export RUN --merge: merged weights)"))
    if fit.tokenizer_dir is not None:
        out.append((str(fit.tokenizer_dir), "the tokenizer that made the token ids"))
    return out


def exports(fit: Fit) -> dict:
    """The 16-bit safetensors export (DeepSpeed's stage3_gather_16bit_weights_on_model_save)
    and, for a Hugging Face model, its save_pretrained folder. Every rank takes part."""
    t, out_dir = fit.parts, fit.out_dir
    out: dict = {}
    if fit.cfg.checkpoint.export_16bit and fit.is_last_step():
        final = fit.checkpoints.save_final(fit.state.step)  # the trainer exports, not the manager
        exported = export_after_training(out_dir, final, t.precision.name, log=fit.say)
        out["export"] = exported["safetensors"] if exported else str(out_dir / "model.safetensors")
    if t.lora is not None:  # the adapters as a PEFT folder; the base stays where it came from
        m = fit.cfg.model
        path = save_adapter_at_end(t.model, t.lora, out_dir, is_main=fit.dist.is_main, hf=t.adapter.spec.hugging_face,
                                   base_path=m.hf_pretrained or m.hf_config)
        out["adapter_export"] = str(path or out_dir / ADAPTER_FOLDER)
    elif t.adapter.spec.hugging_face:
        save_hf_pretrained(t.model, out_dir / "hf", fit.dist.is_main)
        out["hf_export"] = str(out_dir / "hf")
    return out


def save_tokenizer(data: Any, out_dir: Path) -> Path | None:
    """OUT/tokenizer: the tokenizer that made the ids, written under a fresh scratch name and
    renamed into place (the tokenizers library follows links; a link there is replaced)."""
    if not hasattr(data, "save_tokenizer"):
        return None
    return replace_folder(out_dir, "tokenizer", data.save_tokenizer)


def tokenizer_summary(data: Any, saved: Path | None, hf_dir: str | None) -> dict | None:
    """summary.json's record of the tokenizer; a copy goes beside the HF weights."""
    if saved is not None and hf_dir:
        data.save_tokenizer(hf_dir)
    record = data.tokenizer_record() if hasattr(data, "tokenizer_record") else None
    return {**record, "saved": str(saved) if saved else None} if record else None
