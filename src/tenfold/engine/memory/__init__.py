"""Memory measured: the tensor tracker, the per-category report and its notes, the host allocator."""
