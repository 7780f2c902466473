"""The training runtime: engine, optimizers, LR schedules, precision and checkpoints."""
