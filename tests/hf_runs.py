"""One-process Hugging Face runs for the tests: tests/data's tiny Llama and GPT-2 configs
trained by tenfold's Trainer (fp32, seq 32, 4 steps), and the logits of a fixed probe batch.
Imported by the Hugging Face tests with `from hf_runs import ...`."""

from __future__ import annotations

from pathlib import Path

import torch

from tenfold import Trainer

DATA = Path(__file__).parent / "data"
LLAMA = DATA / "llama-tiny" / "config.json"
GPT2 = DATA / "gpt2-tiny" / "config.json"


def hf_config(out: Path, config: Path, **sections) -> dict:
    cfg = {
        "model": {"hf_config": str(config)},
        "data": {"max_bytes": 200_000, "seq_len": 32},
        "train": {"steps": 4, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 0, "eval_every": 0, "eval_batches": 1},
        "precision": {"dtype": "fp32"},
        "log": {"out": str(out), "progress": False, "tensorboard": False},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def train(out: Path, config: Path, **sections) -> tuple[Trainer, dict]:
    trainer = Trainer(hf_config(out, config, **sections))
    return trainer, trainer.fit()


def probe_ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits(model) -> torch.Tensor:
    model.eval()
    return model(input_ids=probe_ids(), use_cache=False).logits
