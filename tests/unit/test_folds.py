"""Seeds and folds without training: the fold assignment, the data sources honouring it, the
repeated sweep's run names and job array, and the statistics of the summary recomputed by hand."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from jaxrat.config_schema import load_config
from jaxrat.data import datasets, folds
from jaxrat.experiments import stats, summary, sweep
from jaxrat.runtime.errors import ConfigError
from test_sweep import fake_run

REPO = Path(__file__).resolve().parents[2]
TOY = "tests/toy/sweep_config.py"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def test_folds_are_deterministic_balanced_and_stratified():
    ids = [f"img{i:03d}" for i in range(50)]
    classes = [0] * 30 + [1] * 15 + [2] * 5
    a = folds.assign(ids, 5, seed=0, classes=classes)
    assert a == folds.assign(list(ids), 5, seed=0, classes=classes)
    assert a != folds.assign(ids, 5, seed=1, classes=classes)
    assert sorted(Counter(a).values()) == [10] * 5
    for f in range(5):  # every class in the same share in every fold
        assert Counter(c for c, x in zip(classes, a) if x == f) == {0: 6, 1: 3, 2: 1}
    # The order the source lists the items in does not matter.
    order = list(reversed(range(50)))
    b = folds.assign([ids[i] for i in order], 5, seed=0, classes=[classes[i] for i in order])
    assert [b[order.index(i)] for i in range(50)] == a
    assert sorted(Counter(folds.assign(ids[:11], 3, seed=0)).values()) == [3, 4, 4]
    with pytest.raises(ConfigError, match="only 2 items"):
        folds.assign(ids[:2], 3, seed=0)


def test_bad_fold_settings_name_the_fix():
    config = load_config("configs/isic.py:smoke")
    config.data.folds = 1
    with pytest.raises(ConfigError, match="K >= 2"):
        folds.settings(config.data)
    config.data.folds, config.data.fold = 3, 3
    with pytest.raises(ConfigError, match="use 0 to 2"):
        folds.settings(config.data)


@pytest.mark.parametrize("which", ["isic", "classification"])
def test_a_fold_of_the_training_split_is_the_validation_split(tmp_path, which):
    config = load_config("configs/isic.py:smoke" if which == "isic" else "configs/classification.py:smoke")
    config.data.folds, config.data.fold_dir = 3, str(tmp_path / "folds")
    resolve = (lambda wd: datasets.resolve_segmentation(config.data, wd, seed=0, process_index=0)) if which == "isic" \
        else (lambda wd: datasets.resolve_classification(config.data, tuple(config.task.heads), wd, seed=0,
                                                         process_index=0)[:2])
    key = (lambda e: e[0]) if which == "isic" else (lambda e: e["path"])
    seen = []
    for fold in range(3):
        config.data.fold = fold
        train, val = resolve(str(tmp_path / f"run{fold}"))
        t = {os.path.basename(key(x)) for x in train.records}
        v = {os.path.basename(key(x)) for x in val.records}
        assert t and v and not t & v and len(t) + len(v) == config.data.synthetic_train
        seen.append(v)
    assert set().union(*seen) == t | v and sum(len(v) for v in seen) == config.data.synthetic_train
    written = os.listdir(tmp_path / "folds")
    assert len(written) == 1 and written[0].startswith("folds-K3-seed0-")  # one file: the three runs agreed
    content = json.load(open(tmp_path / "folds" / written[0]))
    assert content["stratified"] == (which == "classification") and sorted(set(content["fold"])) == [0, 1, 2]


def test_repeats_name_runs_and_submit_one_array(tmp_path, capsys):
    from jaxrat.cli import sweep as cli

    variants = sweep.load_sweep(TOY)
    runs = sweep.replicate(sweep.select(variants, ["base", "wide"]), str(tmp_path), folds=3, seeds=2, first_seed=5)
    assert [r.name for r in runs[:3]] == ["base-f0-s5", "base-f0-s6", "base-f1-s5"] and len(runs) == 12
    assert runs[1].overrides[-4:] == ("--config.seed=6", "--config.data.folds=3", "--config.data.fold=0",
                                      f"--config.data.fold_dir={tmp_path}/folds")
    assert {(r.group, r.fold, r.seed) for r in runs} == {(v, f, s) for v in ("base", "wide") for f in range(3)
                                                         for s in (5, 6)}
    assert [r.name for r in sweep.replicate(variants[:1], "/r", seeds=2)] == ["base-s0", "base-s1"]
    with pytest.raises(ConfigError, match="--folds 1"):
        sweep.replicate(variants, "/r", folds=1)

    argv = ["--config", TOY, "--root", str(tmp_path), "--only", "base,wide", "--folds", "3", "--seeds", "2", "--slurm",
            "--dry-run"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "#SBATCH --array=0-5,12-17\n" in out  # the chosen variants' 12 runs of the sweep's 18
    assert "base-f2-s1: not started, submitting" in err


def test_stats_are_the_mean_sd_and_paired_differences_of_the_last_evals(tmp_path):
    rng = np.random.default_rng(0)
    runs = []
    values: dict[tuple, float] = {}
    for variant, shift in (("baseline", 0.0), ("pe_none", -0.05)):
        for fold in range(3):
            for seed in range(2):
                name = f"{variant}-f{fold}-s{seed}"
                dice = 0.7 + 0.02 * fold + shift + float(rng.normal(0, 0.01))
                values[variant, fold, seed] = dice
                fake_run(tmp_path, name, [{"step": 2, "eval/dice": 0.1}, {"step": 4, "eval/dice": dice,
                                                                             "eval/loss": 1 - dice}])
                runs.append(sweep.Variant(name, (), variant, fold, seed))
    fake_run(tmp_path, "pe_none-f9-s9", [{"step": 2, "eval/dice": 0.0}], done=False)  # unfinished: not counted
    runs.append(sweep.Variant("pe_none-f9-s9", (), "pe_none", 9, 9))
    sweep.write_manifest(str(tmp_path), TOY, runs, [])
    text = summary.report(str(tmp_path))
    got = json.load(open(tmp_path / stats.STATS_FILE))
    assert got["baseline"] == "baseline"
    keys = [(f, s) for f in range(3) for s in range(2)]
    base = np.array([values["baseline", f, s] for f, s in keys])
    other = np.array([values["pe_none", f, s] for f, s in keys])
    d = got["variants"]["pe_none"]
    assert d["expected"] == 7 and len(d["runs"]) == 6
    assert d["metrics"]["eval/dice"]["mean"] == pytest.approx(other.mean())
    assert d["metrics"]["eval/dice"]["sd"] == pytest.approx(other.std(ddof=1))
    p = got["paired"]["pe_none"]["eval/dice"]
    diff = other - base
    half = sps.t.ppf(0.975, 5) * diff.std(ddof=1) / math.sqrt(6)
    assert p["n"] == 6 and p["mean"] == pytest.approx(diff.mean())
    assert p["ci95"] == pytest.approx([diff.mean() - half, diff.mean() + half])
    assert p["t_test_p"] == pytest.approx(sps.ttest_rel(other, base).pvalue)
    assert p["wilcoxon_p"] == pytest.approx(sps.wilcoxon(other, base).pvalue)
    assert f"| pe_none | 6/7 | {other.mean():.4f} ± {other.std(ddof=1):.4f} |" in text
    assert f"| pe_none | eval/dice | 6 | {diff.mean():.4f} ± {diff.std(ddof=1):.4f} |" in text
    assert "eval/loss | 6" not in text  # the paired table shows the best metric; the JSON has every one
    # In words, not only in "6/7": the unfinished run is not in the means.
    assert "1 run is not finished (running, failed, preempted or killed) and left out of these means" in text
    assert "eval/loss" in got["paired"]["pe_none"]


def test_another_assignment_for_the_same_folds_is_warned_about(tmp_path, caplog):
    """An image added to the dataset deals the folds anew; written silently beside the old assignment,
    a resumed fold run went on training on another split."""
    import logging

    ids = [f"im{i:02d}" for i in range(20)]
    with caplog.at_level(logging.WARNING):
        folds.record(str(tmp_path), ids, None, 5, 0, folds.assign(ids, 5, 0))
        folds.record(str(tmp_path), ids, None, 5, 0, folds.assign(ids, 5, 0))  # the same items: checked, no word
    assert not caplog.records
    grown = ids + ["im20"]
    with caplog.at_level(logging.WARNING):
        folds.record(str(tmp_path), grown, None, 5, 0, folds.assign(grown, 5, 0))
    assert "the items differ from those of" in caplog.text and "dealt anew" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # other folds (K=4) are another assignment, not a changed one
        folds.record(str(tmp_path), ids, None, 4, 0, folds.assign(ids, 4, 0))
    assert not caplog.records
