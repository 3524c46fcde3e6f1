"""A run trained on the user's own CSV keeps its label names: predict names classes without the
dataset (moved, on another machine), and a dataset whose labels changed since training is refused
by evaluate and by a resume in one sentence instead of naming every output after another class."""

import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from runner import REPO, env_with_devices, run_main

pytestmark = pytest.mark.slow

CLASSES = {"cat": (200, 30, 30), "dog": (30, 200, 30), "bird": (30, 30, 200)}
TINY = ("--config.data.image_size=16", "--config.data.batch_size=8", "--config.data.eval_batch_size=8",
        "--config.model.features=(8,16)", "--config.num_train_steps=4", "--config.train.eval_every=4",
        "--config.checkpoint.every_steps=4", "--config.data.num_workers=0", "--config.optimizer.warmup_steps=1",
        "--config.train.plots=false")


def _dataset(root):
    os.makedirs(os.path.join(root, "images"))
    for split, n in (("train", 4), ("val", 2)):
        with open(os.path.join(root, f"{split}.csv"), "w", newline="") as f:
            f.write("image,label\n")
            for name, colour in CLASSES.items():
                for i in range(n):
                    path = f"images/{split}_{name}{i}.png"
                    Image.fromarray(np.full((12, 14, 3), colour, np.uint8)).save(os.path.join(root, path))
                    f.write(f"{path},{name}\n")
    return root


def _cmd(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env_with_devices(1),
                          capture_output=True, text=True, timeout=300)


def _one_sentence(proc, *says):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("jaxrat: error:") == 1, proc.stderr[-3000:]
    for s in says:
        assert s in proc.stderr, proc.stderr[-3000:]


def test_predict_names_classes_without_the_dataset_and_changed_labels_are_refused(tmp_path):
    data, wd = _dataset(str(tmp_path / "data")), str(tmp_path / "run")
    run_main(wd, f"--config.data.data_dir={data}", *TINY, config="classification")
    saved = json.load(open(os.path.join(wd, "labels.json")))
    assert saved["heads"]["label"] == {"classes": 3, "names": ["bird", "cat", "dog"]}

    photos = str(tmp_path / "photos")
    os.makedirs(photos)
    shutil.copy(os.path.join(data, "images", "val_dog0.png"), os.path.join(photos, "a.png"))
    moved = str(tmp_path / "elsewhere")
    os.rename(data, moved)  # predicted on another machine, or the dataset moved since
    proc = _cmd("jaxrat.predict", "--noprogress", f"--workdir={wd}", f"--input={photos}", f"--out={tmp_path / 'o1'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "o1" / "predictions.csv") as f:
        row = next(csv.DictReader(f))
    assert {row[f"label/top{k}_label"] for k in (1, 2, 3)} == {"bird", "cat", "dog"}
    os.rename(moved, data)

    # A class added to the CSVs since: index 0 would now be 'ant', and every name one off.
    with open(os.path.join(data, "train.csv"), "a") as f:
        f.write("images/train_cat0.png,ant\n")
    proc = _cmd("jaxrat.evaluate", f"--workdir={wd}")
    _one_sentence(proc, "labels of the data differ from those the run in", "head 'label'",
                  "3 classes bird, cat, dog -> 4 classes ant, bird, cat, dog")
    proc = run_main(wd, f"--config.data.data_dir={data}", *TINY, "--config.num_train_steps=8", config="classification",
                    check=False)
    _one_sentence(proc, "labels of the data differ from those the run in")
    proc = _cmd("jaxrat.predict", "--noprogress", f"--workdir={wd}", f"--input={photos}", f"--out={tmp_path / 'o2'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "o2" / "predictions.csv") as f:
        assert next(csv.DictReader(f)) == row  # the names it was trained with, not the CSV's new ones
