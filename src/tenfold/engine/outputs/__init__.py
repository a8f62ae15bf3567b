"""What a run writes: the run folder, checkpoints, exports, safe file writes."""
