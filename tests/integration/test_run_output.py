"""Output a person reads: a progress line with epoch, throughput and ETA (rewritten in place on a
terminal, plain lines in a job log), and the curves and confusion matrices a run leaves in its
workdir, linked from summary.md."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest

from jaxrat.runtime import console
from jaxrat.tracking import plots
from jaxrat.tracking.summary import markdown
from jaxrat.tracking.writers import format_progress


def test_progress_line_has_epoch_step_throughput_and_eta():
    line = format_progress(120, 400, {"train/loss": 0.31, "train/learning_rate": 3e-3, "train/steps_per_sec": 8.1,
                                      "train/examples_per_sec": 130.0}, elapsed=10.0, done=100, epoch=2.4, bar=True)
    assert line.startswith("[######              ] epoch 2.40 step 120/400 (30%) loss 0.3100")
    assert "8.10 steps/s" in line and "130 ex/s" in line and "ETA 00:00:28" in line
    assert not format_progress(1, 4, {}, 1.0, 1).startswith("[")


def test_on_a_terminal_the_line_is_rewritten_and_the_next_log_line_starts_below(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(console.sys, "stderr", err)
    monkeypatch.setattr(console, "on_terminal", lambda: True)
    handler = logging.StreamHandler(err)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        console.progress("step 1/2")
        console.progress("step 2/2")
        logging.getLogger().warning("an eval line")
    finally:
        root.removeHandler(handler)
        console._LIVE.clear()
    assert err.getvalue() == "\rstep 1/2\x1b[K\rstep 2/2\x1b[K\nan eval line\n"


def test_in_a_job_log_each_progress_line_is_a_log_line(monkeypatch, caplog):
    monkeypatch.setattr(console, "on_terminal", lambda: False)
    with caplog.at_level(logging.INFO):
        console.progress("epoch 1.00 step 3/6")
    assert [r.getMessage() for r in caplog.records] == ["epoch 1.00 step 3/6"]
    assert caplog.records[0].filename == "test_run_output.py"  # the caller's line, not console.py's


def test_curves_and_confusion_are_drawn_and_linked(tmp_path):
    rows = [{"step": s, "train/loss": 1.0 / s, "train/learning_rate": 1e-3} for s in range(1, 6)]
    rows += [{"step": 5, "eval/dice": 0.7, "eval/loss": 0.4, "eval/num_images": 8}]
    rows += [{"step": 5, "train/loss": 0.1}]  # a resumed run re-logs a step: the last line wins
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "tr')
    assert plots.eval_keys(plots.read_rows(str(tmp_path / "metrics.jsonl")), "eval/loss") == ["eval/loss",
                                                                                             "eval/dice"]
    assert plots.read_rows(str(tmp_path / "metrics.jsonl"))[-1]["train/loss"] == 0.1
    path = plots.write_curves(str(tmp_path), "eval/dice")
    conf = plots.write_confusion(str(tmp_path), "kind/a b", np.array([[3, 1], [0, 4]]), ["cat", "dog"])
    assert path.endswith("curves.png") and conf.endswith("confusion_kind_a_b.png")
    for p in (path, conf):
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    page = markdown({"workdir": "w", "plots": ["curves.png", "confusion_kind_a_b.png"]})
    assert "![curves.png](curves.png)" in page and "![confusion_kind_a_b.png](confusion_kind_a_b.png)" in page


# A classification run's curves and confusion matrices: test_predict_tasks.py reads them off its smoke run.


def test_multiclass_curves_show_the_mean_and_each_foreground_class_not_the_background():
    row = {"step": 5, "eval/dice": 0.8, "eval/iou": 0.7, "eval/dice_all": 0.85, "eval/loss": 0.3,
           "eval/pixel_accuracy": 0.9, "eval/dice/background": 0.99, "eval/iou/background": 0.98,
           "eval/dice/disc": 0.7, "eval/iou/disc": 0.6, "eval/dice/square": 0.9, "eval/iou/square": 0.8}
    assert plots.eval_keys([row], "eval/dice", foreground=("disc", "square")) == [
        "eval/dice", "eval/dice/disc", "eval/dice/square"]


@pytest.mark.parametrize("head, n", [("shape", 2), ("a_rather_long_head_name", 3), ("kind", 9)])
def test_the_confusion_matrix_title_fits_the_picture(head, n):
    import matplotlib.pyplot as plt

    fig = plots.confusion_figure(head, np.eye(n) * 3, [f"class {i}" for i in range(n)])
    fig.canvas.draw()
    box = fig.axes[0].title.get_window_extent(fig.canvas.get_renderer())
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1, (box, fig.bbox)
    plt.close(fig)


def test_summary_page_keeps_four_decimals_of_the_best_score():
    page = markdown({"workdir": "w", "best": {"metric": "eval/dice", "value": 0.9700000286102295, "step": 150},
                     "last_eval": {"eval/dice": 0.9700000286102295, "eval/num_images": 8}})
    assert "eval/dice 0.9700 at step 150" in page and "| eval/dice | 0.9700 |" in page
