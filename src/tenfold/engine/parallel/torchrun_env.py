"""What torchrun tells a process it started (its environment), read without torch: the command
line asks before it imports torch, the engine after."""

from __future__ import annotations

import os


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def local_world_size() -> int:
    """The ranks on this node (torchrun's LOCAL_WORLD_SIZE; 1 for a process started alone)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched_by_torchrun() else 1
