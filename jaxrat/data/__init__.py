"""Datasets, transforms and Grain pipelines. Nothing here imports models or training code."""
