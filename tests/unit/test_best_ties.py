"""A tie for the best step is resolved one way everywhere: the later step, the one Orbax keeps."""

from __future__ import annotations

import json

import ml_collections as mlc
import pytest

from jaxrat.checkpointing import inspect, store
from jaxrat.config_schema import load_config
from jaxrat.experiments.summary import summarize_run
from jaxrat.parallel.mesh import make_mesh
from jaxrat.trainer import run_summary
from jaxrat.trainer.hooks import Evaluation
from runner import SMOKE

# eval/dice per step: 2 and 4 tie for the best in "max" mode, 6 and 8 tie for it in "min" mode.
DICE = {2: 1.0, 4: 1.0, 6: 0.5, 8: 0.5}


def _run(tmp_path, mode):
    config = load_config(SMOKE)
    config.checkpoint.best_metric, config.checkpoint.best_mode = "eval/dice", mode
    (tmp_path / "config.json").write_text(config.to_json_best_effort())
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "eval/dice": v}) + "\n"
                                                    for s, v in DICE.items()))
    for step, value in DICE.items():  # committed checkpoints with their metrics, no best.json pointer
        d = tmp_path / "checkpoints" / str(step)
        d.mkdir(parents=True)
        meta = {"metrics": {"eval/dice": value}, "best_metric": "eval/dice", "best_mode": mode}
        (d / "_CHECKPOINT_METADATA").write_text(json.dumps({"custom_metadata": meta}))
        (d / "commit_success.txt").write_text("")
    return config


def _training_best(config):
    """The best the training loop's evaluation records, the summary's own when no pointer exists."""
    evaluation = Evaluation.__new__(Evaluation)
    evaluation.config, evaluation.best = mlc.ConfigDict({"checkpoint": config.checkpoint.to_dict()}), None
    for step, value in DICE.items():
        evaluation._rank(step, {"eval/dice": value})
    return evaluation.best


@pytest.mark.parametrize("mode, step", [("max", 4), ("min", 8)])
def test_every_reader_names_the_later_of_two_tied_steps(tmp_path, mode, step):
    config = _run(tmp_path, mode)
    assert inspect.describe(str(tmp_path))["best"]["step"] == step  # jaxrat checkpoints
    assert store.best_step(str(tmp_path / "checkpoints"))[0] == step
    assert summarize_run(str(tmp_path), "run").best[0] == step  # jaxrat summarize
    best = _training_best(config)
    assert best["step"] == step
    mesh = make_mesh((("data", -1),))
    kw = dict(status="finished", mesh=mesh, first=0, last=8, wall_time_s=1.0, images_per_sec=1.0, last_train={},
              last_eval={}, best=best)
    assert run_summary.build(config, str(tmp_path), checkpoint_dir=str(tmp_path / "checkpoints"), **kw)["best"][
        "step"] == step  # summary.json, from the checkpoints
    assert run_summary.build(config, str(tmp_path), checkpoint_dir=str(tmp_path / "none"), **kw)["best"][
        "step"] == step  # summary.json, from the training's own record


def test_the_listing_refuses_a_folder_that_is_no_run_and_names_the_run_of_a_step(tmp_path):
    """`jaxrat checkpoints` on a folder of images, or on one step's folder, said "(no complete
    checkpoint)" and exited 0; each is one sentence saying what to pass instead."""
    from jaxrat.runtime.errors import UserError

    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.jpg").write_bytes(b"x")
    with pytest.raises(UserError, match=r"photos is not a training run .*pass a run's --workdir"):
        inspect.describe(str(photos))
    (tmp_path / "run").mkdir()
    _run(tmp_path / "run", "max")
    step = tmp_path / "run" / "checkpoints" / "4"
    with pytest.raises(UserError, match=rf"is one checkpoint \(step 4\), not a run; pass the run's workdir, "
                                        rf"{tmp_path / 'run'}\."):
        inspect.describe(str(step))
    assert inspect.describe(str(tmp_path / "run"))["latest"] == 8
    fresh = tmp_path / "fresh"  # a run that saved nothing yet: listed, empty
    fresh.mkdir()
    (fresh / "config.json").write_text("{}")
    assert inspect.describe(str(fresh))["steps"] == []
