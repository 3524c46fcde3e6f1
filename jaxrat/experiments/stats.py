"""Repeated runs of a sweep (``--folds``/``--seeds``): each variant's metrics as mean ± sd over its
runs, and each variant against the baseline as paired differences with a 95% confidence interval.

A run is counted once it is finished (or stopped early) and has an evaluation; its value of a
metric is that of its last evaluation (``eval/*``: the EMA's when the run kept one). Pairs match a
variant's run with the baseline's run of the same fold and seed, so the fold's data and the seed's
initialisation cancel out of the difference. The interval is ``mean ± t(0.975, n-1) * sd / sqrt(n)``
over the pairs' differences; with at least 3 pairs the paired t-test's and the Wilcoxon signed-rank
test's two-sided p-values are given too. The baseline is the variant named ``baseline``, else the
sweep's first variant.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Iterable

import numpy as np

from jaxrat.experiments.sweep import MANIFEST

STATS_FILE = "summary_stats.json"
MIN_TEST_PAIRS = 3


def manifest_runs(root: str) -> list[dict[str, Any]]:
    """The runs of ``ROOT/sweep.json`` with their variant, fold and seed ([] without a manifest)."""
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            runs = json.load(f)["variants"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [{"name": r["name"], "variant": r.get("variant") or r["name"], "fold": r.get("fold"),
             "seed": r.get("seed")} for r in runs]


def pair_key(fold: int | None, seed: int | None) -> str:
    return f"fold {fold if fold is not None else '-'} seed {seed if seed is not None else '-'}"


def describe(values: Iterable[float]) -> dict[str, Any]:
    """``{"n", "mean", "sd"}`` (sample sd, ddof=1; None for fewer than 2 values)."""
    v = np.asarray(list(values), np.float64)
    return {"n": int(v.size), "mean": float(v.mean()) if v.size else None,
            "sd": float(v.std(ddof=1)) if v.size > 1 else None}


def paired(diffs: Iterable[float]) -> dict[str, Any]:
    """Mean, sd, 95% t interval and (n >= 3) paired t-test / Wilcoxon p-values of paired differences."""
    from scipy import stats

    d = np.asarray(list(diffs), np.float64)
    out = {**describe(d), "ci95": None, "t_test_p": None, "wilcoxon_p": None}
    if d.size >= 2:
        half = float(stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size))
        out["ci95"] = [float(d.mean()) - half, float(d.mean()) + half]
    if d.size >= MIN_TEST_PAIRS:
        with warnings.catch_warnings():  # identical pairs: no test to run, p stays None
            warnings.simplefilter("ignore")
            t = stats.ttest_1samp(d, 0.0)  # = ttest_rel(variant, baseline)
            out["t_test_p"] = None if np.isnan(t.pvalue) else float(t.pvalue)
            if np.any(d != 0):
                out["wilcoxon_p"] = float(stats.wilcoxon(d).pvalue)
    return out


def compute(root: str, runs: list[Any]) -> dict[str, Any] | None:
    """The study's numbers from the :class:`~jaxrat.experiments.summary.RunSummary` s of ``root``
    (None when the sweep has no repeats): what ``summary_stats.json`` holds."""
    info = manifest_runs(root)
    if not any(r["fold"] is not None or r["seed"] is not None for r in info):
        return None
    by_name = {r.name: r for r in runs}
    started = {r["variant"] for r in info if r["name"] in by_name}
    info = [r for r in info if r["variant"] in started]  # variants left out of this sweep (--only): not shown
    if not info:
        return None
    variants: list[str] = []
    values: dict[str, dict[str, dict[str, float]]] = {}  # variant -> metric -> pair key -> value
    counted: dict[str, list[str]] = {}
    for r in info:
        if r["variant"] not in variants:
            variants.append(r["variant"])
        run = by_name.get(r["name"])
        counted.setdefault(r["variant"], [])
        if run is None or not run.last_eval or not run.state.startswith(("finished", "stopped early")):
            continue
        counted[r["variant"]].append(r["name"])
        for metric, value in run.last_eval.items():
            values.setdefault(r["variant"], {}).setdefault(metric, {})[pair_key(r["fold"], r["seed"])] = value
    baseline = "baseline" if "baseline" in variants else variants[0]
    metrics: list[str] = []
    for v in variants:
        metrics += [m for m in values.get(v, {}) if m not in metrics]
    out: dict[str, Any] = {"baseline": baseline, "metrics": metrics, "variants": {}, "paired": {}}
    for v in variants:
        per = values.get(v, {})
        out["variants"][v] = {"runs": counted[v], "expected": sum(r["variant"] == v for r in info),
                              "metrics": {m: {**describe(per[m].values()), "values": per[m]} for m in per}}
        if v == baseline:
            continue
        base = values.get(baseline, {})
        out["paired"][v] = {}
        for m in per:
            keys = sorted(set(per[m]) & set(base.get(m, {})))
            if keys:
                out["paired"][v][m] = {**paired(per[m][k] - base[m][k] for k in keys), "pairs": keys}
    return out


def _pm(d: dict[str, Any] | None) -> str:
    if not d or d.get("mean") is None:
        return ""
    return f"{d['mean']:.4f} ± {d['sd']:.4f}" if d.get("sd") is not None else f"{d['mean']:.4f}"


def _p(v: float | None) -> str:
    return "" if v is None else f"{v:.3g}"


def markdown(stats: dict[str, Any], primary: list[str]) -> str:
    """Two tables: mean ± sd per variant (every metric), and the paired differences against the
    baseline of the ``primary`` metrics (all when empty)."""
    metrics = stats["metrics"]
    lines = ["## Variants over folds and seeds (mean ± sd of the last evaluation)", "",
             "| variant | runs | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
    left_out = 0
    for v, d in stats["variants"].items():
        cells = [_pm(d["metrics"].get(m)) for m in metrics]
        lines.append(f"| {v} | {len(d['runs'])}/{d['expected']} | " + " | ".join(cells) + " |")
        left_out += d["expected"] - len(d["runs"])
    if left_out:
        lines += ["", f"{left_out} run{'s are' if left_out > 1 else ' is'} not finished (running, failed, "
                  "preempted or killed) and left out of these means and of the differences below; \"runs\" counts "
                  "the finished ones of each variant."]
    shown = [m for m in metrics if m in primary] or metrics
    lines += ["", f"## Paired differences against {stats['baseline']} (variant - baseline, pairs of the same "
              "fold and seed)", "",
              "| variant | metric | pairs | mean difference ± sd | 95% CI | paired t-test p | Wilcoxon p |",
              "|---|---|---|---|---|---|---|"]
    for v, per in stats["paired"].items():
        for m in shown:
            d = per.get(m)
            if not d:
                continue
            ci = f"[{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]" if d["ci95"] else ""
            lines.append(f"| {v} | {m} | {d['n']} | {_pm(d)} | {ci} | {_p(d['t_test_p'])} | {_p(d['wilcoxon_p'])} |")
    return "\n".join(lines) + "\n"
