"""The trainer: train state, jitted steps, periodic actions and the loop, for any task."""
