"""Rank 1 of 4 on torch's fake process group (no other process, collectives do nothing): an
embedding split by rows with tenfold's `VocabParallelEmbedding` and with torch's
`RowwiseParallel`, one backward each under a dispatch mode that records the shape of every
tensor the backward makes (a DTensor's local part). Prints, per style, whether a whole (V, d)
matrix was made and the gradient's placement and local shape, as JSON.

    python tests/workers/vocab_embedding_worker.py
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from tenfold.techniques.tensor_parallel import VocabParallelEmbedding

VOCAB, WIDTH, TP = 1024, 16, 4


class Shapes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.made: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor):
                self.made.append(list((t.to_local() if hasattr(t, "to_local") else t).shape))
        return out


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=TP)
    mesh = init_device_mesh("cpu", (TP,))
    result = {}
    styles = {"tenfold": VocabParallelEmbedding(Shard(1)),
              "torch": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))}
    for name, style in styles.items():
        embedding = nn.Embedding(VOCAB, WIDTH)
        parallelize_module(embedding, mesh, style)
        out = embedding(torch.randint(0, VOCAB, (2, 8)))
        with Shapes() as shapes:
            out.sum().backward()
        grad = embedding.weight.grad
        result[name] = {"whole_matrix": [VOCAB, WIDTH] in shapes.made, "placements": [str(p) for p in grad.placements],
                        "local_shape": list(grad.to_local().shape)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
