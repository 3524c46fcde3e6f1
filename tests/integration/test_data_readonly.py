"""A dataset folder is the user's: training (demo, smoke and the real config pointed at it),
staging, the bad-file policy, the tfds source and the ArrayRecord converter only ever read it,
and all of them work on a read-only one."""

import contextlib
import gc
import hashlib
import os
import stat
import subprocess

import numpy as np
import pytest
from PIL import Image

from jaxrat.config_schema import load_config
from jaxrat.data import datasets, pipeline, staging
from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.data.sources import isic
from jaxrat.data.synthetic import isic as synthetic_isic
from jaxrat.runtime.errors import DataError, UserError
from jaxrat.trainer.loop import train_and_evaluate
from runner import REPO, SMOKE, run_main

ISIC_CONFIG = os.path.join(REPO, "configs", "isic.py")
# Tiny enough to train two steps of each variant in seconds; the model fields are the RAT's.
TINY = ["--config.num_train_steps=2", "--config.train.eval_every=2", "--config.checkpoint.every_steps=2",
        "--config.train.log_every=1", "--config.train.log_images=false", "--config.data.image_size=32",
        "--config.data.batch_size=4", "--config.data.eval_batch_size=4", "--config.data.num_workers=0",
        "--config.data.num_threads=1", "--config.optimizer.warmup_steps=1"]
TINY_RAT = ["--config.model.rat.feature_dims=8", "--config.model.rat.num_blocks=1", "--config.model.rat.num_heads=2",
            "--config.model.rat.iters=1", "--config.model.decoder_dim=8", "--config.model.rat.mlp_dropout=0.0"]


def snapshot(root: str) -> dict:
    """Every entry under ``root`` (root included): kind, mode, size, mtime and the bytes' SHA-256."""
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in [""] + sorted(dirs) + sorted(files):
            path = os.path.join(folder, name) if name else folder
            st = os.lstat(path)
            digest = None
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(path, root)] = (stat.S_IFMT(st.st_mode), st.st_mode, st.st_size, st.st_mtime_ns,
                                                digest)
    return out


def make_user_dataset(root: str) -> str:
    """An ISIC-layout folder as a user's would be: no jaxrat marker, a README, an empty image (for
    on_bad_file=skip), and ISIC_0000000.jpg, the first name the synthetic data would write."""
    synthetic_isic.write_dataset(root, num_train=8, num_val=4, image_size=32, seed=7)
    os.remove(os.path.join(root, "jaxrat_synthetic.json"))
    img_dir, mask_dir = (os.path.join(root, f) for f in isic.SPLIT_FOLDERS["train"])
    with open(os.path.join(img_dir, "README.txt"), "w") as f:
        f.write("the user's notes\n")
    open(os.path.join(img_dir, "ISIC_0000099.jpg"), "wb").close()
    Image.fromarray(np.zeros((36, 40), np.uint8)).save(os.path.join(mask_dir, "ISIC_0000099_segmentation.png"))
    assert os.path.isfile(os.path.join(img_dir, "ISIC_0000000.jpg"))
    return root


@contextlib.contextmanager
def read_only_view(src: str, mountpoint: str):
    """``src`` mounted read-only at ``mountpoint`` (root ignores permission bits, not a read-only mount)."""
    os.makedirs(mountpoint)
    bind = subprocess.run(["mount", "--bind", src, mountpoint], capture_output=True, text=True)
    if bind.returncode != 0:
        pytest.skip(f"a read-only bind mount needs mount permission here: {bind.stderr.strip()}")
    try:
        ro = subprocess.run(["mount", "-o", "remount,bind,ro", mountpoint], capture_output=True, text=True)
        if ro.returncode != 0:
            pytest.skip(f"cannot remount read-only: {ro.stderr.strip()}")
        with pytest.raises(OSError):
            open(os.path.join(mountpoint, "probe"), "w").close()
        yield mountpoint
    finally:
        if subprocess.run(["umount", mountpoint], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", mountpoint], check=True)  # a reader still holds a file open


@pytest.fixture
def user_dataset(tmp_path):
    d = make_user_dataset(str(tmp_path / "isic2018"))
    return d, snapshot(d)


class Cfg(dict):
    __getattr__ = dict.get


def test_synthetic_variant_pointed_at_a_dataset_reads_it_and_writes_nothing(user_dataset, tmp_path, caplog):
    d, before = user_dataset
    cfg = Cfg(name="isic2018", source="files", data_dir=d, synthetic=True, synthetic_train=32, synthetic_val=8,
              image_size=32, on_bad_file="skip", split_file="")
    wd = str(tmp_path / "wd")
    with caplog.at_level("INFO"):
        train, val = datasets.resolve_segmentation(cfg, wd, seed=0, process_index=0)
    assert (len(train), len(val)) == (8, 4)  # the user's images (#99 dropped by its header check), not 32 + 8
    assert all(p[0].startswith(d) for p in train.records)
    assert "synthetic data off: config.data.data_dir=" in caplog.text
    assert not os.path.exists(os.path.join(wd, "synthetic_data"))
    assert snapshot(d) == before


def test_synthetic_data_goes_under_the_workdir_without_a_data_dir(tmp_path):
    cfg = Cfg(name="isic2018", source="files", data_dir="", synthetic=True, synthetic_train=4, synthetic_val=2,
              image_size=16, on_bad_file="fail", split_file="")
    wd = str(tmp_path / "wd")
    train, _ = datasets.resolve_segmentation(cfg, wd, seed=0, process_index=0)
    assert len(train) == 4 and all(p[0].startswith(os.path.join(wd, "synthetic_data")) for p in train.records)


@pytest.mark.parametrize("where", ["{d}", "{d}/images/run", "{link}/run"])
def test_a_workdir_in_the_dataset_folder_is_refused_before_anything_is_written(user_dataset, tmp_path, where):
    d, before = user_dataset
    link = tmp_path / "link"
    link.symlink_to(d)  # the same folder by another name
    config = load_config(SMOKE)
    config.data.data_dir = d
    workdir = where.format(d=d, link=link)
    how = "is" if workdir == d else "lies inside"
    with pytest.raises(UserError, match=rf"^--workdir {workdir} {how} the dataset folder config\.data\.data_dir={d}, "
                                        r"which jaxrat only reads; choose a workdir outside it\.$"):
        train_and_evaluate(config, workdir)
    assert snapshot(d) == before


def test_staging_or_converting_into_the_dataset_folder_is_refused(user_dataset):
    from jaxrat.data.sources import isic_arrayrecord

    d, before = user_dataset
    with pytest.raises(DataError, match="is inside the dataset folder"):
        staging.stage(d, os.path.join(d, "local"))
    with pytest.raises(DataError, match="is inside --src"):
        isic_arrayrecord.prepare(d, os.path.join(d, "tfds"))
    assert snapshot(d) == before


def test_read_only_folder_stages_trains_under_skip_and_converts(user_dataset, tmp_path):
    d, _ = user_dataset
    for folder, _, _ in os.walk(d):  # a shared dataset often has read-only folders too
        os.chmod(folder, 0o555)
    try:
        _read_only_checks(d, tmp_path)
    finally:
        for folder, _, _ in os.walk(d):
            os.chmod(folder, 0o755)


def _read_only_checks(d, tmp_path):
    from jaxrat.data.sources import isic_arrayrecord

    before = snapshot(d)
    with read_only_view(d, str(tmp_path / "ro")) as ro:
        policy = BadFilePolicy("skip", str(tmp_path / "wd" / "skipped_files.txt"))
        pairs = isic.find_pairs(ro, "train", policy=policy)
        batch = next(pipeline.train_iterator(pipeline.ExampleSource(pairs, policy=policy), image_size=16,
                                             local_batch=4, seed=0, process_index=0, process_count=1, num_threads=0))
        assert batch["image"].shape == (4, 16, 16, 3)
        assert "ISIC_0000099.jpg" in open(tmp_path / "wd" / "skipped_files.txt").read()

        local = staging.stage(ro, str(tmp_path / "local"))
        assert len(isic.find_pairs(local, "train", policy=BadFilePolicy("skip"))) == 8
        assert all(os.stat(f).st_mode & stat.S_IWUSR for f, _, _ in os.walk(local))
        assert staging.stage(ro, str(tmp_path / "local")) == local  # reused

        out = str(tmp_path / "tfds")  # the converter only reads --src
        isic_arrayrecord.prepare(ro, out, on_bad_file="skip")
    tfds_before = snapshot(out)
    with read_only_view(out, str(tmp_path / "tfds_ro")) as tfds_ro:
        cfg = Cfg(name="isic2018", source="tfds", data_dir=tfds_ro, synthetic=True, on_bad_file="fail", split_file="")
        train, val = datasets.resolve_segmentation(cfg, str(tmp_path / "wd2"), seed=0, process_index=0)
        assert (len(train), len(val)) == (8, 4)
        assert train.loader.map(train.records[0])["image"].ndim == 3
        del train, val  # the ArrayRecord readers keep their files open
        gc.collect()
    assert snapshot(out) == tfds_before
    assert snapshot(d) == before


@pytest.mark.slow
@pytest.mark.parametrize("variant,extra", [
    (":smoke", []),
    (":demo", TINY + TINY_RAT),
    ("", TINY + TINY_RAT),  # the real config: RAT with the ISIC augmentations
], ids=["smoke", "demo", "real"])
def test_runs_pointed_at_a_dataset_leave_it_byte_for_byte_unchanged(user_dataset, tmp_path, variant, extra):
    d, before = user_dataset
    wd = str(tmp_path / "wd")
    proc = run_main(wd, f"--config.data.data_dir={d}", "--config.data.on_bad_file=skip", *extra,
                    config=ISIC_CONFIG + variant, timeout=600)
    if variant:
        assert "synthetic data off: config.data.data_dir=" in proc.stdout + proc.stderr
    assert not os.path.exists(os.path.join(wd, "synthetic_data"))
    assert "ISIC_0000099.jpg" in open(os.path.join(wd, "skipped_files.txt")).read()
    assert snapshot(d) == before


@pytest.mark.slow
def test_smoke_runs_on_a_read_only_dataset_directly_and_staged(user_dataset, tmp_path):
    d, before = user_dataset
    with read_only_view(d, str(tmp_path / "ro")) as ro:
        run_main(str(tmp_path / "wd"), f"--config.data.data_dir={ro}", "--config.data.on_bad_file=skip")
        assert "ISIC_0000099.jpg" in open(tmp_path / "wd" / "skipped_files.txt").read()
        local = str(tmp_path / "local")
        run_main(str(tmp_path / "wd_staged"), f"--config.data.data_dir={ro}", "--config.data.on_bad_file=skip",
                 f"--config.data.stage_to_local_dir={local}")
        assert any(n.startswith("ro-") for n in os.listdir(local))
    assert snapshot(d) == before
