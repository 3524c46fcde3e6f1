"""Tasks: loss, metrics and evaluation for one kind of problem. No cluster or training-loop code."""
