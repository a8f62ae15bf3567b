"""`Trainer`: config -> resolved run -> parts (engine/parts.py) -> steps (engine/step.py) inside
the run's loop, outputs and checkpoints (engine/fit.py, engine/run_outputs.py).

>>> from tenfold import Trainer
>>> Trainer({"train": {"steps": 10}}).fit()        # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from tenfold.config import TenfoldConfig, build_config
from tenfold.engine import step
from tenfold.engine.distributed import on_every_rank
from tenfold.engine.fit import Fit, TrainState
from tenfold.engine.memory import run_memory_report
from tenfold.engine.parts import Parts, build_parts
from tenfold.engine.run_folder import RunFolder
from tenfold.engine.run_outputs import console, model_label
from tenfold.errors import UserError
from tenfold.techniques.precision import StepResult

__all__ = ["Trainer", "TrainState"]


class Trainer:
    """Train tenfold's GPT (or a user's `nn.Module`) with the configured techniques.

    `model`: any module mapping input ids (b, s) to logits (b, s, vocab), or use `loss_fn`.
    `dataset`: a DataBundle, or an int array (N, seq_len + 1) of packed token sequences.
    `loss_fn(model, batch) -> (sum of token losses, number of targets)` replaces the default
    next-token cross-entropy; `batch` is a dict with input_ids and labels.
    `tp_plan`: under `parallel.tp_degree > 1`, how to split a user's own `model`
    ({module FQN or pattern: torch.distributed.tensor.parallel.ParallelStyle}, the argument of
    `parallelize_module`; docs/tensor_parallel.md). tenfold's GPT and Hugging Face Llama-family
    models have a built-in plan.
    """

    def __init__(
        self,
        config: TenfoldConfig | dict | None = None,
        model: nn.Module | None = None,
        dataset: Any = None,
        loss_fn: Callable | None = None,
        tp_plan: dict | None = None,
    ):
        if config is None or isinstance(config, dict):
            config = build_config(config or {})
        self.cfg: TenfoldConfig = config
        self.user_model, self.user_dataset, self.loss_fn = model, dataset, loss_fn
        self.tp_plan = tp_plan
        self.state = TrainState()
        self.parts: Parts | None = None

    def setup(self) -> None:
        """Validate everything and build model, data, optimizer. Writes nothing to disk."""
        self.parts = build_parts(self.cfg, self.user_model, self.user_dataset, self.loss_fn, self.tp_plan)

    # Shorthands for `trainer.parts` after setup() (the engine itself takes the parts, not the trainer).
    dist = property(lambda self: self._parts.dist)
    model = property(lambda self: self._parts.model)
    optimizer = property(lambda self: self._parts.optimizer)
    loader = property(lambda self: self._parts.loader)
    scaler = property(lambda self: self._parts.precision.scaler)

    @property
    def _parts(self) -> Parts:
        if self.parts is None:
            raise AttributeError("the trainer is not set up: call setup() or fit() first")
        return self.parts

    # ------------------------------------------------------------------ one step (engine/step.py)

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        loss, global_tokens = self.accumulate_gradients(micro_batches)
        return self.apply_gradients(loss, global_tokens)

    def accumulate_gradients(self, micro_batches: list[dict]) -> tuple[float, int]:
        return step.accumulate_gradients(self._parts, micro_batches)

    def apply_gradients(self, loss: float, global_tokens: int) -> StepResult:
        return step.apply_gradients(self._parts, loss, global_tokens, self.state.step + 1)

    def forward_loss(self, batch: dict) -> torch.Tensor:
        return step.forward_loss(self._parts, batch)

    def evaluate(self) -> float | None:
        return step.evaluate(self._parts)

    # ------------------------------------------------------------------ the run (engine/fit.py)

    def fit(self) -> dict:
        # --out, --resume and an earlier run in --out, before anything is built or written
        folder = on_every_rank(lambda: RunFolder.check(self.cfg), peer_error=UserError)
        if self.parts is None:
            self.setup()
        return Fit(self.parts, self.cfg, self.state, folder, train_step=self.train_step,
                   model_label=model_label(self.cfg.model, self.user_model), own_model=self.user_model is not None)()

    def memory_report(self) -> int:
        """`tenfold train --memory-report`: one warm-up step, then one step measured by module
        and category (beside the planner's prediction), printed; nothing is written."""
        if self.parts is None:
            self.setup()
        report = run_memory_report(self.parts, self.train_step, own_model=self.user_model is not None)
        if self.dist.is_main:
            console(True).print(report)
        return 0
