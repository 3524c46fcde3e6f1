"""python -m jaxrat.robustness: one checkpoint over input sizes and spacings, tabulated against the
training resolution; the table maths, the spacing op and the pinned synthetic data on their own."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from runner import REPO, env_with_devices, read_metrics, run_main


@pytest.mark.integration
def test_robustness_at_three_sizes_writes_the_tables_and_the_plot(tmp_path):
    wd = str(tmp_path / "run")
    run_main(wd, devices=1)  # configs/isic.py:smoke, trained at 32 px, evaluated at steps 3 and 6
    last = [r for r in read_metrics(wd) if "eval/dice" in r][-1]

    def robustness(*args):
        return subprocess.run([sys.executable, "-m", "jaxrat.robustness", f"--workdir={wd}", *args], cwd=REPO,
                              env=env_with_devices(2), capture_output=True, text=True, timeout=600)

    proc = robustness("--sizes=24,32,48", "--spacings=1,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = os.path.join(wd, "robustness")
    table = json.load(open(os.path.join(out, "table.json")))
    assert table["step"] == 6 and table["train_size"] == 32
    assert [(r["size"], r["spacing"]) for r in table["rows"]] == [(s, f) for s in (24, 32, 48) for f in (1.0, 2.0)]
    ref = next(r for r in table["rows"] if r["reference"])
    assert (ref["size"], ref["spacing"]) == (32, 1.0)
    # The reference is the training run's own last eval, to float precision; its change is 0.
    for key in ("eval/dice", "eval/iou", "eval/loss", "eval/sensitivity"):
        assert ref["metrics"][key] == pytest.approx(last[key], abs=1e-6), key
        assert ref["relative_change"][key] == 0
    for r in table["rows"]:
        for key in ("eval/dice", "eval/loss"):
            assert r["relative_change"][key] == pytest.approx((r["metrics"][key] - ref["metrics"][key])
                                                              / abs(ref["metrics"][key]))
    # Coarser detail is a different input: the loss moves, at every size.
    for size in (24, 32, 48):
        by_spacing = {r["spacing"]: r["metrics"]["eval/loss"] for r in table["rows"] if r["size"] == size}
        assert by_spacing[2.0] != by_spacing[1.0], size
    # Every size read the images generated at the trained size (resized, like real data): the run's own,
    # which robustness reads where they are (a point asking for other data would have written a copy here).
    marker = json.load(open(os.path.join(wd, "synthetic_data", "process_0", "jaxrat_synthetic.json")))
    assert marker["image_size"] == 32 and not os.path.exists(os.path.join(out, "synthetic_data"))

    rows = list(csv.DictReader(open(os.path.join(out, "table.csv"))))
    assert len(rows) == 6 and {"eval/dice", "eval/dice_rel_change", "reference"} <= set(rows[0])
    assert [float(r["eval/dice_rel_change"]) for r in rows if r["reference"] == "1"] == [0.0]
    md = open(os.path.join(out, "table.md")).read().splitlines()
    assert sum(line.startswith("| 32 (train) | 1 |") for line in md) == 1
    assert sum(line.startswith("| ") for line in md) == 1 + 6  # header and one line per point
    png = open(os.path.join(out, "plot.png"), "rb").read()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert len(os.listdir(os.path.join(out, "points"))) == 6

    proc = robustness("--sizes=31")  # the smoke U-Net halves its input: 31 does not fit
    assert proc.returncode == 2 and "cannot be evaluated at size 31" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    proc = robustness("--sizes=24,big")
    assert proc.returncode == 2 and "--sizes=24,big" in proc.stderr and "Traceback" not in proc.stderr
    proc = robustness("--sizes=24", "--spacings=0.5")
    assert proc.returncode == 2 and "factors of 1 or more" in proc.stderr


def test_table_relative_changes_and_markdown():
    from jaxrat.experiments.robustness import make_table, to_markdown

    rows = [{"size": 64, "spacing": 1.0, "metrics": {"eval/dice": 0.5, "eval/zero": 0.0}},
            {"size": 32, "spacing": 1.0, "metrics": {"eval/dice": 0.8, "eval/zero": 0.0}},
            {"size": 32, "spacing": 2.0, "metrics": {"eval/dice": 0.4, "eval/zero": 1.0}}]
    table = make_table(rows, train_size=32)
    assert [(r["size"], r["spacing"], r["reference"]) for r in table["rows"]] == [
        (32, 1.0, True), (32, 2.0, False), (64, 1.0, False)]
    assert [r["relative_change"]["eval/dice"] for r in table["rows"]] == pytest.approx([0.0, -0.5, -0.375])
    assert [r["relative_change"]["eval/zero"] for r in table["rows"]] == [0.0, None, 0.0]  # no scale at 0
    md = to_markdown(table)
    assert "| 32 (train) | 1 | 0.8 | 0 |" in md and "| 32 | 2 | 0.4 (-50.0%) | 1 |" in md


def test_sizes_and_spacings_are_parsed_with_one_sentence_errors():
    from jaxrat.experiments.robustness import parse_sizes, parse_spacings
    from jaxrat.runtime.errors import ConfigError

    assert parse_sizes("128, 192,256,128") == [128, 192, 256]
    assert parse_spacings("1,1.5,2") == [1.0, 1.5, 2.0]
    for bad in ("", "0", "a"):
        with pytest.raises(ConfigError):
            parse_sizes(bad)
    for bad in ("", "0.5", "x", "inf"):
        with pytest.raises(ConfigError):
            parse_spacings(bad)


def test_eval_spacing_coarsens_the_image_only():
    import ml_collections as mlc

    from jaxrat.config_schema import base_config
    from jaxrat.data import pipeline
    from jaxrat.data import transforms as T
    from jaxrat.runtime.errors import ConfigError

    checker = (np.indices((16, 16)).sum(0) % 2 * 255).astype(np.uint8)
    ex = {"image": np.repeat(checker[..., None], 3, -1), "mask": checker.copy()}
    out = T.Coarsen(2.0).map(ex)
    assert out["image"].shape == (16, 16, 3) and out["image"].std() < 5  # the finest detail is gone
    np.testing.assert_array_equal(out["mask"], checker)  # the labels are the scene's, unchanged
    assert T.Coarsen(1.0).map(ex) is ex

    data = base_config().data
    assert not any(isinstance(op, T.Coarsen) for op in pipeline.eval_options(data)["ops"])
    data.eval_spacing = 3.0
    ops = pipeline.eval_options(data)["ops"]
    assert [type(op) for op in ops] == [T.Resize, T.Coarsen, T.Normalize] and ops[1].spacing == 3.0
    data.eval_spacing = 0.5
    with pytest.raises(ConfigError, match="eval_spacing"):
        pipeline.eval_options(data)
    assert pipeline.eval_coarsen(mlc.ConfigDict({"image_size": 8})) is None  # configs older than the field


def test_run_config_pins_synthetic_data_to_the_trained_size(tmp_path):
    from jaxrat.config_schema import base_config, load_run_config

    config = base_config()
    config.data.synthetic, config.data.image_size = True, 48
    raw = json.loads(config.to_json_best_effort())
    del raw["data"]["synthetic_image_size"]  # as a run from before the field wrote it
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = load_run_config(str(tmp_path), ["--config.data.image_size=96"])
    assert (loaded.data.image_size, loaded.data.synthetic_image_size) == (96, 48)
    loaded = load_run_config(str(tmp_path), ["--config.data.synthetic_image_size=64"])
    assert loaded.data.synthetic_image_size == 64
