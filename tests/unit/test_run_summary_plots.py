"""``train.plots``: the run summary draws curves.png (and a classifier's confusion matrices) by default,
and none when it is off (the smoke variant, which tests start hundreds of times, skips matplotlib)."""

from __future__ import annotations

import json

import numpy as np

from configs.isic import get_config
from jaxrat.tracking.base import TrackerBase
from jaxrat.trainer import run_summary


class _Recorder(TrackerBase):
    def __init__(self) -> None:
        self.artifacts: list[str] = []

    def log_artifact(self, path: str) -> None:
        self.artifacts.append(path)


def _publish(tmp_path, plots: bool) -> tuple[dict, list[str]]:
    rows = [{"step": s, "train/loss": 1.0 / s, "eval/dice": 0.1 * s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"checkpoint": {"best_metric": "eval/dice"}, "train": {"plots": plots}}
    writer = _Recorder()
    run_summary.publish(writer, str(tmp_path), {"config": config, "checkpoints": {}},
                        confusions={"kind": (np.eye(2, dtype=np.int64), ["a", "b"])})
    return json.loads((tmp_path / "summary.json").read_text()), writer.artifacts


def test_plots_are_drawn_by_default_and_skipped_when_off(tmp_path):
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    summary, artifacts = _publish(tmp_path / "on", plots=True)
    assert summary["plots"] == ["curves.png", "confusion_kind.png"]
    assert (tmp_path / "on" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert {a.rsplit("/", 1)[1] for a in artifacts} >= {"curves.png", "confusion_kind.png", "summary.json"}
    summary, artifacts = _publish(tmp_path / "off", plots=False)
    assert summary["plots"] == [] and not list((tmp_path / "off").glob("*.png"))
    assert all(not a.endswith(".png") for a in artifacts)


def test_the_default_draws_and_only_the_smoke_variant_skips_them():
    assert get_config().train.plots and get_config("demo").train.plots
    assert not get_config("smoke").train.plots
