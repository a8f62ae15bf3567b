"""Rank-side scripts that multi-process tests start under `python -m torch.distributed.run`.
Not test modules: pytest does not collect them (their names do not start with test_)."""
