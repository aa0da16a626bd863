"""One trainer, losses, the per-method training steps, checkpoints and resume."""
