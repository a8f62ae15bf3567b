"""A run before it runs: the dry-run description and the fake-tensor trace of one step."""
