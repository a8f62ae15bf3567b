"""`torch.compile` per transformer block (`--compile`, config `[train] compile`).

Each block's forward is compiled on its own, as torchtitan's `apply_compile` does
(torchtitan/models/llama3/infra/parallelize.py): the blocks are the same code with the same
shapes, so one compiled graph serves all of them (torch.compile's inlined nn.Module guards
compile `Block.forward` once, not once per block), compile time does not grow with depth, and
the embedding, the head and the loss stay eager. The order is torchtitan's too
(engine/parallel/parallelize.py): after tensor parallelism and activation recompute (the
`torch.utils.checkpoint` call is traced as a higher-order op whose recompute the compiled
backward keeps), before FSDP2's `fully_shard` (its all-gather and reduce-scatter hooks run
eagerly around the compiled forward). Tensor-parallel blocks are not compiled: on torch 2.13
their compiled backward hands DTensor's redistribute a plain tensor, so capabilities.py refuses
--compile with tp > 1 before any rank starts.

How: like recompute, the block's `forward` is replaced by an instance attribute (here the
compiled forward), so parameter names, state_dict keys and checkpoints stay exactly as without
compile, and every module hook still runs through `nn.Module.__call__`.

Compilation is lazy: it happens in the first step (and again when evaluation first runs in
eval mode under no_grad). `CompileClock` reads the time torch spent compiling, so the run can
report it on its own instead of folding it into the warm-up or the steady-state rate.
"""

from __future__ import annotations

import contextlib
import shutil
from typing import TYPE_CHECKING, Iterator

from tenfold.errors import RunError, UserError

if TYPE_CHECKING:  # pragma: no cover
    import torch.nn as nn

_MARK = "_tenfold_compiled"  # set on each block whose forward was compiled
FLAG = "train.compile (--compile)"


def check_supported(device_type: str) -> None:
    """Refuse (UserError, before the techniques are applied or anything is written) a compile
    that cannot run here: torch.compile's default backend (inductor) writes and builds C++ on a
    CPU and Triton kernels on a CUDA GPU."""
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise UserError(f"{FLAG} on a CUDA GPU needs Triton (pip install triton); it is not importable "
                            "here. Run without --compile")
        return
    compiler = _cpp_compiler()
    if compiler is None:
        raise UserError(
            f"{FLAG} on a CPU needs a C++ compiler: torch.compile (inductor) builds its kernels with one, and "
            "none was found ($CXX, or g++ / clang++ on PATH). Install one (e.g. apt install g++) or run without --compile"
        )


def _cpp_compiler() -> str | None:
    """The C++ compiler inductor will use, or None. Its own lookup where this torch has it (it
    honours $CXX and torch._inductor.config.cpp.cxx), else the usual names on PATH."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # pragma: no cover - older or newer torch: look on PATH ourselves
        return shutil.which("g++") or shutil.which("clang++")
    try:
        return get_cpp_compiler()
    except Exception:  # noqa: BLE001 - inductor raises its own InvalidCxxCompiler (a RuntimeError)
        return None


def apply_compile(model: "nn.Module", blocks: list["nn.Module"] | None = None) -> None:
    """Compile each block's forward in place (parameter names unchanged). `blocks` defaults to
    tenfold's GPT `model.layers` (techniques.recompute.find_blocks)."""
    import torch

    from tenfold.techniques.recompute import find_blocks

    for block in list(blocks) if blocks is not None else find_blocks(model):
        if getattr(block, _MARK, False):
            raise UserError("torch.compile was already applied to this model's blocks")
        # Not fullgraph: a user's or Hugging Face block with an untraceable line still runs
        # (torch.compile splits the graph there) instead of failing.
        block.forward = torch.compile(block.forward)
        setattr(block, _MARK, True)


def compiled_blocks(model: "nn.Module") -> list[str]:
    """FQNs of the modules whose forward was compiled (for reports and tests)."""
    return [name for name, m in model.named_modules() if getattr(m, _MARK, False)]


class CompileClock:
    """Seconds torch.compile has spent compiling since this clock was made: dynamo's own
    account of whole-frame and backward compilation (tracing, AOTAutograd, inductor's code
    generation and C++/Triton builds). Cumulative per process; read twice and subtract. A clock
    made with `enabled=False` (a run without --compile) reads 0 and imports nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.start = self._total()

    def _total(self) -> float:
        if not self.enabled:
            return 0.0
        try:
            from torch._dynamo.utils import calculate_time_spent
        except ImportError:  # pragma: no cover - the counter moved: report no compile time
            return 0.0
        return float(calculate_time_spent().get("total_wall_time", 0.0))

    def seconds(self) -> float:
        return self._total() - self.start

    def report(self) -> float | None:
        """summary.json's `compile_s`: None for a run that does not compile."""
        return self.seconds() if self.enabled else None


@contextlib.contextmanager
def compile_failures(enabled: bool = True) -> Iterator[None]:
    """A failure of torch.compile itself (a block it cannot trace, a backend that cannot build
    its kernels) ends the run with one line naming it and the way out, not a page of traceback;
    errors of the model's own code pass through unchanged."""
    if not enabled:
        yield
        return
    from torch._dynamo.exc import TorchDynamoException

    try:
        yield
    except TorchDynamoException as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise RunError(f"torch.compile failed ({type(e).__name__}: {first[:240]}); run without --compile, "
                       "or with --debug for the traceback") from e
