"""The training loop and its parts: loss, optimizer, LR schedule, metrics."""
