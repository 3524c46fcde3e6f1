"""Where metrics, images and run facts go: TensorBoard and metrics.jsonl today."""
