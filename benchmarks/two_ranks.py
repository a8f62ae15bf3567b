"""Two local gloo ranks for a benchmark, as `torchrun --nproc-per-node 2` would start them, but
from inside the script (torch.multiprocessing), so one command prints the comparison.

    rows = run_on_two_ranks(worker, args)      # in main()
    def worker(rank, port, args, result_file):
        join_as_rank(rank, port, threads=1)    # env:// variables + the gloo process group
        ...                                    # rank 0 writes its rows (JSON list) to result_file
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Callable

import torch


def join_as_rank(rank: int, port: int, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(threads)
    import torch.distributed as dist

    dist.init_process_group("gloo")


def run_on_two_ranks(worker: Callable, args) -> list:
    """Spawn `worker(rank, port, args, result_file)` on 2 processes; return rank 0's rows."""
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp, "rows.json")
        mp.spawn(worker, args=(port, args, str(result)), nprocs=2, join=True)
        return json.loads(result.read_text())
