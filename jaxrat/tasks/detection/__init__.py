"""Object detection (COCO 2017): the task, its matching and losses, and COCOeval scoring."""
