"""Experiments built from many runs: ablation sweeps (:mod:`.sweep`) and their comparison tables (:mod:`.summary`).

Nothing here trains: a sweep starts ``python -m jaxrat.main`` once per variant (or submits a job
array that does), and a summary reads the runs' ``metrics.jsonl`` and checkpoint folders.
"""
