"""Training: the trainer, its checkpoints and evaluation metrics."""
