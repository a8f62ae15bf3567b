"""The training loop: the Trainer, the parts it runs on, one optimizer step, the fit loop, the learning-rate schedule."""
