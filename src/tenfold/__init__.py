"""tenfold: plan and train transformers faster on fewer GPUs.

`import tenfold` stays light (no torch) so that `tenfold.plan` runs anywhere; the engine's
names are imported on first use.
"""

__version__ = "0.1.0"

__all__ = ["Trainer", "TenfoldConfig", "__version__"]


def __getattr__(name: str):
    if name == "Trainer":
        from tenfold.engine.loop.trainer import Trainer

        return Trainer
    if name == "TenfoldConfig":
        from tenfold.config import TenfoldConfig

        return TenfoldConfig
    raise AttributeError(f"module 'tenfold' has no attribute {name!r}")
