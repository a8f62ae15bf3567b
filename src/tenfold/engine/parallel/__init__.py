"""Parallel set-up: the process group and device mesh, the launcher, the techniques applied to the model."""
