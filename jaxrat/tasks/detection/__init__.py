"""Object detection (DETR-style): box ops, Hungarian matching, set-prediction losses and the task."""
