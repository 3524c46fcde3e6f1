"""The bad-file policy and the data-wait metric through ``python -m jaxrat.main``."""

import os

import pytest

from jaxrat.data import badfiles
from jaxrat.data.sources import isic
from jaxrat.data.synthetic import isic as synthetic_isic
from runner import read_metrics, run_main

IMG, MASK = isic.SPLIT_FOLDERS["train"]


@pytest.fixture
def broken_dir(tmp_path):
    d = str(tmp_path / "isic")
    synthetic_isic.write_dataset(d, num_train=16, num_val=8, image_size=32, seed=0)
    open(os.path.join(d, IMG, "ISIC_0000003.jpg"), "wb").close()  # empty
    path = os.path.join(d, IMG, "ISIC_0000007.jpg")
    data = open(path, "rb").read()
    sos = data.index(b"\xff\xda")
    open(path, "wb").write(data[: sos + (len(data) - sos) // 2])  # truncated: only decoding finds it
    return d


def test_fail_policy_stops_with_one_sentence_naming_the_file(broken_dir, tmp_path):
    proc = run_main(str(tmp_path / "wd"), "--config.data.synthetic=false", f"--config.data.data_dir={broken_dir}",
                    check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "ISIC_0000003.jpg: file is empty" in proc.stderr and "on_bad_file=skip" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("jaxrat: error:") == 1


def test_skip_policy_trains_and_lists_the_skipped_files(broken_dir, tmp_path):
    wd = str(tmp_path / "wd")
    # 16 images, batch 8: the truncated image is met in every epoch of the 6 steps.
    proc = run_main(wd, "--config.data.synthetic=false", f"--config.data.data_dir={broken_dir}",
                    "--config.data.on_bad_file=skip", "--config.train.eval_every=1000")
    assert "skipping bad file" in proc.stderr
    skipped = sorted(os.path.basename(f) for f, _ in badfiles.read_skipped(os.path.join(wd, "skipped_files.txt")))
    assert skipped == ["ISIC_0000003.jpg", "ISIC_0000007.jpg"]
    rows = [r for r in read_metrics(wd) if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(0 <= r["train/data_wait_fraction"] <= 1 for r in rows)


def _config(variant=None):
    from jaxrat.config_schema import load_config
    from runner import REPO

    path = os.path.join(REPO, "configs", "isic.py")
    return load_config(f"{path}:{variant}" if variant else path)


def test_isic_config_applies_the_augmentations_the_reference_only_listed():
    from jaxrat.data import pipeline
    from jaxrat.data import transforms as T

    def op_types(cfg):
        return [type(o) for o in pipeline.train_options(cfg.data)["ops"]]

    for variant in (None, "unet"):
        ops = op_types(_config(variant))
        assert ops == [T.Resize, T.RandomFlip, T.RandomRotation, T.ElasticDeform, T.ColorJitter, T.Normalize]
        rot = pipeline.train_options(_config(variant).data)["ops"][2]
        assert rot.degrees == 15.0
    assert op_types(_config("demo")) == [T.Resize, T.RandomFlip, T.Normalize]
