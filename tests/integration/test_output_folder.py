"""Where predict, evaluate and export write: never into what they read, only over jaxrat's own files,
one writer at a time, refused up front when unwritable or full, and a stopped predict leaves no trace."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
from PIL import Image

from jaxrat.config_schema import load_config
from jaxrat.inference import run as predict_run
from jaxrat.inference.inputs import expand_inputs
from jaxrat.runtime import output_folder
from jaxrat.runtime.errors import UserError
from jaxrat.trainer.workdir_lock import OutputFolderLock
from runner import REPO, SMOKE, env_with_devices


def _images(folder, names=("a.png", "b.png")):
    os.makedirs(folder, exist_ok=True)
    for n in names:
        Image.fromarray(np.full((6, 8, 3), 100, np.uint8)).save(os.path.join(folder, n))


def _workdir(path, data_dir=""):
    """A training workdir as commands see it before they load a checkpoint: config.json and checkpoints/2."""
    config = load_config(SMOKE)
    config.data.data_dir = data_dir
    os.makedirs(os.path.join(path, "checkpoints", "2"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(json.loads(config.to_json_best_effort()), f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write('{"step": 2, "eval/dice": 1.0}\n')
    return str(path)


def _tree(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


# ------------------------------------------------------------------------- what the output may be

def test_overwrite_never_deletes_an_input_lying_inside_the_output(tmp_path):
    pin = str(tmp_path / "pin")
    _images(os.path.join(pin, "masks"))
    inputs = expand_inputs(os.path.join(pin, "masks"))
    with pytest.raises(UserError, match=r"--out .*pin contains the input folder .*masks\), which predict only "
                                        r"reads; choose an output folder outside it"):
        predict_run.prepare_output(pin, inputs, os.path.join(pin, "masks"), True)
    assert _tree(pin) == ["masks/a.png", "masks/b.png"]
    listed = tmp_path / "list.txt"
    listed.write_text(f"{pin}/masks/a.png\n")
    with pytest.raises(UserError, match=r"contains the input .*a\.png"):  # a listed file, not a folder
        predict_run.prepare_output(pin, expand_inputs(str(listed)), str(listed), True)
    assert _tree(pin) == ["masks/a.png", "masks/b.png"]


@pytest.mark.parametrize("where, needle", [
    ("{wd}", "is a training run's workdir"),
    ("{wd}/checkpoints/2", "lies inside the run's own folder checkpoints"),
    ("{wd}/checkpoints", "is the run's own folder checkpoints"),
    ("{data}", "is the run's dataset folder"),
    ("{data}/preds", "lies inside the run's dataset folder"),
    ("{tmp}", "contains a training run's workdir"),
])
def test_an_output_over_the_runs_files_or_its_data_is_refused(tmp_path, where, needle):
    data = tmp_path / "data"
    _images(str(data))
    wd = _workdir(tmp_path / "run", data_dir=str(data))
    config = load_config(os.path.join(wd, "config.json"))
    out = where.format(wd=wd, data=data, tmp=tmp_path)
    before = _tree(str(tmp_path))
    with pytest.raises(UserError, match=needle):
        output_folder.check(out, output_folder.run_inputs(wd, config), command="evaluate")
    assert _tree(str(tmp_path)) == before
    for fine in (f"{wd}/eval/other", f"{wd}/predictions", str(tmp_path / "elsewhere")):
        output_folder.check(fine, output_folder.run_inputs(wd, config), command="evaluate")


def test_evaluate_or_export_out_into_the_workdir_is_refused_before_it_appends_to_the_runs_metrics(tmp_path):
    data = tmp_path / "data"
    _images(str(data))
    wd = _workdir(tmp_path / "run", data_dir=str(data))
    metrics = open(os.path.join(wd, "metrics.jsonl")).read()
    for out, needle in ((wd, "is a training run's workdir"),):  # the other cases: the test above
        proc = subprocess.run([sys.executable, "-m", "jaxrat.evaluate", f"--workdir={wd}", f"--out={out}"], cwd=REPO,
                              env=env_with_devices(1), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"jaxrat: error: --out {out} ") and needle in last, last
    assert open(os.path.join(wd, "metrics.jsonl")).read() == metrics and _tree(str(data)) == ["a.png", "b.png"]
    # export says what the folder is (it said "exists and is not empty; ... pass --overwrite").
    proc = subprocess.run([sys.executable, "-m", "jaxrat.export", f"--workdir={wd}", f"--out={wd}"],
                          cwd=REPO, env=env_with_devices(1), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"jaxrat: error: --out {wd} is a training run's workdir ({wd}), which export only reads; choose an output "
        f"folder outside it.")
    assert open(os.path.join(wd, "metrics.jsonl")).read() == metrics and os.path.isdir(os.path.join(wd, "checkpoints"))


def test_evaluate_out_into_a_folder_of_the_users_files_is_refused_before_any_work(tmp_path):
    wd = _workdir(tmp_path / "run")
    out = tmp_path / "mine"
    out.mkdir()
    for name in ("metrics.json", "per_image.csv"):  # the names evaluate writes, the user's own content
        (out / name).write_text("the user's own")
    for extra, says in (((), "exists and is not empty; choose a new folder or pass --overwrite."),
                        (("--overwrite",), f"holds files jaxrat did not write (it has no {output_folder.MANIFEST}), "
                                           "which --overwrite never deletes; choose a new folder, or empty this one "
                                           "yourself.")):
        proc = subprocess.run([sys.executable, "-m", "jaxrat.evaluate", f"--workdir={wd}", f"--out={out}", *extra],
                              cwd=REPO, env=env_with_devices(1), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == f"jaxrat: error: --out {out} {says}"
        assert _tree(str(out)) == ["metrics.json", "per_image.csv"]
        assert {p.read_text() for p in out.iterdir()} == {"the user's own"}


# ------------------------------------------------------------------------- --overwrite and the manifest

def test_overwrite_removes_only_the_files_jaxrat_listed(tmp_path):
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    _images(src)
    inputs = expand_inputs(src)
    predict_run.prepare_output(out, inputs, src, False)
    for rel in ("masks/a.png", "overlays/a.jpg", "masks/b.png", "predictions.csv"):  # what a prediction wrote
        os.makedirs(os.path.dirname(os.path.join(out, rel)) or out, exist_ok=True)
        open(os.path.join(out, rel), "w").close()
    for rel in ("masks/mine.png", "notes.txt"):  # what the user added
        open(os.path.join(out, rel), "w").write("mine")
    with pytest.raises(UserError, match="exists and is not empty; choose a new folder or pass --overwrite"):
        predict_run.prepare_output(out, inputs, src, False)
    predict_run.prepare_output(out, inputs[:1], src, True)
    assert _tree(out) == [output_folder.MANIFEST, "masks/mine.png", "notes.txt"]
    assert output_folder.listed_files(output_folder.read_manifest(out))[-1] == "boxes/a.jpg"  # now only a's


def test_overwrite_of_a_folder_jaxrat_did_not_write_is_refused(tmp_path):
    src, out = str(tmp_path / "in"), tmp_path / "out"
    _images(src)
    (out / "masks").mkdir(parents=True)
    (out / "masks" / "a.png").write_text("the user's own")
    with pytest.raises(UserError, match=r"holds files jaxrat did not write .*--overwrite never deletes"):
        predict_run.prepare_output(str(out), expand_inputs(src), src, True)
    assert (out / "masks" / "a.png").read_text() == "the user's own"


COMMANDS = ("predict", "evaluate", "export")


@pytest.mark.parametrize("first, then", [(a, b) for a in COMMANDS for b in COMMANDS if a != b])
def test_overwrite_never_replaces_another_commands_outputs(tmp_path, first, then):
    out = str(tmp_path / "out")
    os.makedirs(out)
    output_folder.claim(out, command=first, overwrite=False, files=["result.txt"])
    open(os.path.join(out, "result.txt"), "w").write(first)
    for overwrite in (True, False):  # without it too: "pass --overwrite" would only lead to this refusal
        with pytest.raises(UserError) as refused:
            output_folder.claim(out, command=then, overwrite=overwrite, files=["result.txt"])
        assert str(refused.value) == (f"--out {out} holds the outputs of jaxrat {first}, which {then} never "
                                      f"replaces, even with --overwrite; choose a new folder.")
    assert _tree(out) == [output_folder.MANIFEST, "result.txt"]
    assert open(os.path.join(out, "result.txt")).read() == first
    assert output_folder.read_manifest(out)["command"] == first
    output_folder.claim(out, command=first, overwrite=True, files=["result.txt"])  # its own command replaces them
    assert _tree(out) == [output_folder.MANIFEST]


def _saved(folder):
    return {rel: open(os.path.join(folder, rel), "rb").read() for rel in _tree(folder)}


def test_each_command_refuses_another_commands_folder_before_any_work(tmp_path):
    """export --overwrite over a prediction deleted its masks and CSV; predict over an export its model."""
    src = str(tmp_path / "in")
    _images(src)
    wd = _workdir(tmp_path / "run")
    made = {}
    for command, files in (("predict", ["predictions.csv", "masks/a.png"]), ("export", ["model.jax", "model.json"]),
                           ("evaluate", ["metrics.json"])):
        made[command] = out = str(tmp_path / command)
        os.makedirs(out)
        output_folder.claim(out, command=command, overwrite=False, files=files)
        os.makedirs(os.path.join(out, "masks"))
        for rel in files:
            open(os.path.join(out, rel), "w").write(f"{command}'s")
    before = {c: _saved(out) for c, out in made.items()}
    for command, over in (("export", "predict"), ("predict", "export"), ("evaluate", "predict")):
        out = made[over]
        extra = [f"--input={src}", "--noprogress"] if command == "predict" else []
        proc = subprocess.run([sys.executable, "-m", f"jaxrat.{command}", f"--workdir={wd}", f"--out={out}",
                               "--overwrite", *extra], cwd=REPO, env=env_with_devices(1), capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"jaxrat: error: --out {out} holds the outputs of jaxrat {over}, which {command} never replaces, even "
            f"with --overwrite; choose a new folder.")
    assert {c: _saved(out) for c, out in made.items()} == before


EVALUATE_NAME_DRIVER = """
import contextlib, sys
from jaxrat.config_schema import load_config
import jaxrat.trainer.evaluation as ev, jaxrat.checkpointing.reading as rd, jaxrat.inference.checkpoint_choice as cc
config = load_config(sys.argv.pop())
ev.open_trained_run = lambda workdir, overrides, allow=(): (workdir, config)
cc.choose = lambda workdir, step: "2"
rd.open_checkpoint = lambda spec, items: contextlib.nullcontext(type("Opened", (), {"step": 2})())

def evaluate_checkpoint(*args, **kwargs):
    raise SystemExit("evaluated into the folder")

ev.evaluate_checkpoint = evaluate_checkpoint
from jaxrat import evaluate
evaluate.run()
"""


def test_evaluate_refuses_a_name_whose_folder_another_command_wrote(tmp_path):
    """WORKDIR/eval/NAME is evaluate's own folder, but predict --out may have taken it: the two mixed."""
    wd = _workdir(tmp_path / "run")
    out = os.path.join(wd, "eval", "preds")
    os.makedirs(out)
    output_folder.claim(out, command="predict", overwrite=False, files=["predictions.csv"])
    open(os.path.join(out, "predictions.csv"), "w").write("predict's")
    proc = subprocess.run([sys.executable, "-c", EVALUATE_NAME_DRIVER, f"--workdir={wd}", "--name=preds", SMOKE],
                          cwd=REPO, env=env_with_devices(1), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"jaxrat: error: {out} holds the outputs of jaxrat predict, which evaluate never replaces; pass another "
        f"--name (or --out).")
    assert _tree(out) == [output_folder.MANIFEST, "predictions.csv"]


def test_a_manifest_cannot_reach_outside_its_folder(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("keep")
    (out / "link").symlink_to(tmp_path)
    (out / output_folder.MANIFEST).write_text(json.dumps({"files": ["../victim.txt", "link/victim.txt",
                                                                    str(victim)]}))
    output_folder.claim(str(out), command="predict", overwrite=True)
    assert victim.read_text() == "keep"


# ------------------------------------------------------------------------- unwritable, full

def test_a_read_only_or_full_output_is_refused_before_any_work(tmp_path, monkeypatch):
    src = str(tmp_path / "in")
    _images(src)
    inputs = expand_inputs(src)
    with pytest.raises(UserError, match=r"Cannot write the predict's results to /sys/jaxrat_out \("):
        predict_run.prepare_output("/sys/jaxrat_out", inputs, src, False)

    def full_disk(*args, **kwargs):  # the kernel's answer on a full disk: /dev/full refuses every write
        return os.open("/dev/full", os.O_WRONLY), str(tmp_path / "never-made")

    monkeypatch.setattr(tempfile, "mkstemp", full_disk)
    with pytest.raises(UserError, match=r"Cannot write the predict's results to .*out \(No space left on device\); "
                                        r"pass --out a folder you can write to, on a disk with free space\."):
        predict_run.prepare_output(str(tmp_path / "out"), inputs, src, False)


# ------------------------------------------------------------------------- two writers, part files

@dataclasses.dataclass
class _Pred:
    mask: np.ndarray
    probability: np.ndarray
    width: int
    height: int
    labels: None = None


class FakePredictor:
    """What predict_files needs of a Predictor: a fixed mask, ``delay`` seconds per batch, and a hook."""

    kind, image_size, batch_size, step = "segmentation", 8, 1, 1

    def __init__(self, delay=0.0, before=None):
        self.delay, self.before = delay, before
        self.task = type("Task", (), {"num_classes": 1})()

    def predict(self, images, hws):
        if self.before is not None:
            self.before()
        time.sleep(self.delay)
        return [_Pred(np.ones((h, w), bool), np.full((h, w), 0.9, np.float32), w, h) for h, w in hws]


def test_two_predictions_into_one_folder_keep_their_own_part_files(tmp_path):
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    _images(src)
    inputs = expand_inputs(src)
    os.makedirs(out)
    b_done, results = threading.Event(), {}

    def run_a():
        wait = lambda: b_done.wait(30)  # noqa: E731  (A is mid-way when B starts and ends)
        results["a"] = predict_run.predict_files(FakePredictor(before=wait), inputs, out, predict_run.Options(),
                                                 progress=False)

    a = threading.Thread(target=run_a)
    a.start()
    time.sleep(0.2)
    results["b"] = predict_run.predict_files(FakePredictor(), inputs, out, predict_run.Options(), progress=False)
    b_done.set()
    a.join(60)
    assert results == {"a": {"images": 2, "skipped": 0}, "b": {"images": 2, "skipped": 0}}
    assert not [n for n in os.listdir(out) if n.startswith(".parts")]


def test_a_second_predict_into_a_folder_in_use_is_refused_naming_the_first(tmp_path):
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    _images(src)
    wd = _workdir(tmp_path / "run")
    os.makedirs(out)
    lock = OutputFolderLock(out)
    lock.acquire()  # the first writer: this live process
    try:
        proc = subprocess.run([sys.executable, "-m", "jaxrat.predict", f"--workdir={wd}", f"--input={src}",
                               f"--out={out}"], cwd=REPO, env=env_with_devices(1), capture_output=True, text=True,
                              timeout=120)
    finally:
        lock.release()
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"The output folder {out} is in use by another command (process {os.getpid()} on host" in last, last
    assert "or pass another --out" in last and os.listdir(out) == []


# ------------------------------------------------------------------------- SIGTERM, Ctrl-C

DRIVER = """
import sys
from jaxrat.config_schema import load_config
import jaxrat.trainer.evaluation as ev, jaxrat.inference.predictor as pr, jaxrat.inference.checkpoint_choice as cc
from test_output_folder import FakePredictor
config = load_config(sys.argv.pop())
ev.open_trained_run = lambda workdir, overrides, allow=(): (workdir, config)
pr.Predictor = lambda *a, **k: FakePredictor(delay=0.3)
cc.choose = lambda workdir, step: "1"
from jaxrat import predict
predict.run()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_predict_says_so_in_one_line_and_leaves_no_temporary_file(tmp_path, sig):
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    _images(src, [f"{i:02d}.png" for i in range(40)])
    wd = _workdir(tmp_path / "run")
    here = os.path.dirname(os.path.abspath(__file__))  # the driver imports this module's FakePredictor
    env = {**env_with_devices(1), "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests"), here])}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, f"--workdir={wd}", f"--input={src}", f"--out={out}",
                             "--noprogress", SMOKE], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 90
        while not os.path.exists(os.path.join(out, "masks", "01.png")) and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err[-2000:]
    assert err.strip().splitlines()[-1] == (f"jaxrat: predict stopped by {signal.Signals(sig).name}; {out} holds the "
                                            f"images finished so far: rerun with --overwrite to predict them all.")
    assert "Traceback" not in err
    left = [n for n in _tree(out) if n.endswith(".tmp") or ".parts" in n or "lock" in n]
    assert left == [] and "masks/00.png" in _tree(out)


EVALUATE_DRIVER = """
import contextlib, os, sys, time
from jaxrat.config_schema import load_config
import jaxrat.trainer.evaluation as ev, jaxrat.checkpointing.reading as rd, jaxrat.inference.checkpoint_choice as cc
from jaxrat.runtime.fileio import atomic_open
config = load_config(sys.argv.pop())
ev.open_trained_run = lambda workdir, overrides, allow=(): (workdir, config)
cc.choose = lambda workdir, step: "2"
rd.open_checkpoint = lambda spec, items: contextlib.nullcontext(type("Opened", (), {"step": 2})())

def evaluate_checkpoint(config, workdir, step, name, out_dir, **kw):  # stopped while it writes metrics.json
    with atomic_open(os.path.join(out_dir, "metrics.json")) as f:
        f.write("{")
        time.sleep(120)

ev.evaluate_checkpoint = evaluate_checkpoint
from jaxrat import evaluate
evaluate.run()
"""


def test_a_stopped_evaluate_says_so_in_one_line_and_leaves_no_temporary_file_or_lock(tmp_path):
    wd, out = _workdir(tmp_path / "run"), str(tmp_path / "out")
    proc = subprocess.Popen([sys.executable, "-c", EVALUATE_DRIVER, f"--workdir={wd}", f"--out={out}", SMOKE],
                            cwd=REPO, env=env_with_devices(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 90
        while not [n for n in _tree(str(tmp_path)) if n.endswith(".tmp")] and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines()[-1] == (f"jaxrat: evaluate stopped by SIGTERM; {out} may hold part of its results: "
                                            f"run the same command again.")
    assert "Traceback" not in err
    assert [n for n in _tree(str(tmp_path)) if n.endswith(".tmp") or "lock" in n] == []


def test_a_runs_evaluation_folder_is_named_as_such_when_another_command_would_take_it(tmp_path):
    # export --overwrite --out WORKDIR/eval/step_5 said the folder "holds files jaxrat did not write":
    # evaluate wrote them, into the run's own folder, which carries no manifest.
    run = tmp_path / "run"
    (run / "eval" / "step_5").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "eval" / "step_5" / "metrics.json").write_text("{}")
    out = str(run / "eval" / "step_5")
    for command in ("export", "predict"):
        for overwrite in (False, True):
            with pytest.raises(UserError, match=rf"--out {out} holds an evaluation of the run .* which {command} never "
                                                r"replaces, even with --overwrite; choose a new folder\."):
                output_folder.refuse_taken(out, command=command, overwrite=overwrite)
    with pytest.raises(UserError, match="holds files jaxrat did not write"):  # evaluate's own --out rule, as before
        output_folder.refuse_taken(out, command="evaluate", overwrite=True)
    assert sorted(os.listdir(out)) == ["metrics.json"]
