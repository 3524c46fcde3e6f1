"""Experiments built from many runs or over a trained run: ablation sweeps (:mod:`.sweep`), their
comparison tables (:mod:`.summary`) and resolution robustness (:mod:`.robustness`).

Nothing here trains: a sweep starts ``python -m jaxrat.main`` once per variant (or submits a job
array that does), a summary reads the runs' ``metrics.jsonl`` and checkpoint folders, and
robustness scores one checkpoint through the evaluation it is handed.
"""
