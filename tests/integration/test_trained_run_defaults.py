"""Commands that read a trained run: the best checkpoint unless told otherwise (and they say which),
export never writes over a folder, and the run summary's best is the checkpoints' best after a resume."""

from __future__ import annotations

import json
import subprocess
import sys

from jaxrat.config_schema import load_config
from jaxrat.parallel.mesh import make_mesh
from jaxrat.tracking.summary import markdown
from jaxrat.trainer import run_summary
from runner import REPO, SMOKE, env_with_devices, run_main


def _fake_checkpoint(workdir, step):
    d = workdir / "checkpoints" / str(step)
    d.mkdir(parents=True)
    (d / "_CHECKPOINT_METADATA").write_text(json.dumps({"custom_metadata": {}}))
    (d / "commit_success.txt").write_text("")


def test_summary_names_the_best_of_the_whole_run_after_a_resume(tmp_path):
    for step in (3, 6):
        _fake_checkpoint(tmp_path, step)
    pointer = {"step": 3, "metric": "eval/dice", "mode": "max", "value": 0.91}
    (tmp_path / "checkpoints" / "best.json").write_text(json.dumps(pointer))
    resumed_part = {"metric": "eval/dice", "mode": "max", "value": 0.88, "step": 6}  # what the resumed part saw
    summary = run_summary.build(load_config(SMOKE), str(tmp_path), status="finished", mesh=make_mesh((("data", -1),)),
                                first=3, last=6, wall_time_s=1.0, images_per_sec=1.0, last_train={}, last_eval={},
                                best=resumed_part, checkpoint_dir=str(tmp_path / "checkpoints"))
    assert summary["best"] == pointer
    assert "eval/dice 0.9100 at step 3" in markdown(summary)  # four decimals kept (summary.md)


def test_export_refuses_a_non_empty_output_without_overwrite(tmp_path):
    from test_output_folder import _workdir

    _workdir(tmp_path / "run")  # what export reads before the output (config.json): no checkpoint is loaded
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = subprocess.run([sys.executable, "-m", "jaxrat", "export", f"--workdir={tmp_path / 'run'}", f"--out={out}"],
                          cwd=REPO, env=env_with_devices(1), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (f"jaxrat: error: --out {out} exists and is not empty; choose a new "
                                                    f"folder or pass --overwrite.")
    assert (out / "notes.txt").read_text() == "mine"


def test_evaluate_takes_the_best_checkpoint_and_says_so(tmp_path):
    work = tmp_path / "run"
    run_main(str(work), "--config.checkpoint.best_metric=eval/loss", "--config.checkpoint.best_mode=min")
    best = json.loads((work / "checkpoints" / "best.json").read_text())["step"]
    proc = subprocess.run([sys.executable, "-m", "jaxrat", "evaluate", f"--workdir={work}"], cwd=REPO,
                          env=env_with_devices(1), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint: the best, step {best} (eval/loss" in proc.stderr
    assert (work / "eval" / f"step_{best}" / "metrics.json").is_file()
