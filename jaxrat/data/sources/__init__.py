"""Datasets as pipeline records: ISIC 2018 (official folders, and as ArrayRecord), COCO 2017,
image folders and CSVs for classification, and any TFDS dataset prepared as ArrayRecord."""
