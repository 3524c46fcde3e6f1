"""Experiments over trained runs and configs: sweeps, resolution robustness, their tables and plots."""
