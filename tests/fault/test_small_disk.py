"""Small and read-only disks for real: a 5 MiB tmpfs that an 8 MB download cannot fit, and a full or
read-only one as an output folder. Downloads (datasets and hub models, from servers on 127.0.0.1)
are refused before writing when the length is known, and when it is not, the full disk ends them at
once, untried again, with the partial file removed so the disk is as free as before. predict and
evaluate refuse a full or read-only ``--out`` in one sentence before any work.

Mounting a tmpfs needs root (skipped otherwise, with the reason). The same failures are simulated
(a refused write, a reported free space) in tests/unit/test_download.py, tests/unit/test_hub_download.py
and tests/integration/test_output_folder.py, which run everywhere.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from PIL import Image

from fake_hub import FakeHub
from jaxrat.checkpointing import hub
from jaxrat.data import download
from jaxrat.inference import run as predict_run
from jaxrat.inference.inputs import expand_inputs
from jaxrat.runtime import output_folder
from jaxrat.runtime.errors import DataError, UserError
from runner import REPO, env_with_devices, fill_disk
from test_download import TRAIN_INPUT, _Server
from test_output_folder import _workdir

DISK_MB = 5
BIG = 8_000_000  # bytes: more than the disk holds


def _mount(where, *options: str) -> None:
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={DISK_MB}m", *options]), "tmpfs",
                              str(where)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'needs root'}); the simulated "
                    f"full-disk tests in tests/unit cover the same code")


@pytest.fixture
def small_disk(tmp_path):
    """A fresh 5 MiB tmpfs."""
    where = tmp_path / "disk"
    _mount(where)
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def read_only_disk(tmp_path):
    """A 5 MiB tmpfs mounted read-only: refused to root as well (a chmod would not stop root)."""
    where = tmp_path / "ro"
    _mount(where, "ro")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def _big_zip() -> bytes:
    """An ISIC input archive of incompressible bytes, stored: more than the disk holds."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("ISIC2018_Task1-2_Training_Input/ISIC_0000000.jpg", np.random.default_rng(0).bytes(BIG))
    return buf.getvalue()


def _used(disk) -> int:
    return shutil.disk_usage(disk).used


def _files_under(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


# ------------------------------------------------------------------------------- dataset downloads

@pytest.mark.parametrize("length", [True, False], ids=["with-length", "no-length"])
def test_a_dataset_archive_larger_than_the_disk_is_refused_or_stopped_and_leaves_the_disk_free(small_disk, length):
    srv = _Server({TRAIN_INPUT: _big_zip()}, length=length)
    try:
        before = _used(small_disk)
        dest = small_disk / "isic"
        expected = (r"is 8.0 MB but the disk holding .* has 5.2 MB free; free space or choose another --dest" if length
                    else r"The disk holding .* is full \(No space left on device\) while downloading .*; the partial "
                         r"file was removed: free space or choose another --dest")
        with pytest.raises(DataError, match=expected):
            download.download("isic2018", str(dest), splits=("train",), base_url=srv.url, retries=3, timeout=10,
                              backoff=0)
        assert len(srv.requests) == 1  # neither case is retried: a retry cannot make room
        assert _files_under(dest) == [] and _used(small_disk) == before
    finally:
        srv.close()


# ------------------------------------------------------------------------------- hub downloads

def _model(seed=0) -> dict[str, bytes]:
    return {"config.json": b'{"architecture": "vit_tiny_patch16_224"}',
            "model.safetensors": np.random.default_rng(seed).bytes(BIG)}


@pytest.mark.parametrize("size", ["listed", "in-headers", "unknown"])
@pytest.mark.filterwarnings("ignore:Not enough free disk space")  # huggingface_hub's, when the size is "unknown"
def test_a_hub_model_larger_than_the_disk_is_refused_or_stopped_and_leaves_the_disk_free(small_disk, size,
                                                                                        monkeypatch):
    # listed: the repository listing gives the size; in-headers: a bare listing, the file's HEAD
    # (X-Linked-Size) gives it; unknown: nothing does, so the disk fills and stops the download.
    srv = FakeHub({"org/big": {"main": _model()}}, bare_listing=size != "listed")
    if size == "unknown":
        monkeypatch.setattr(hub, "_size", lambda *a: 0)
    try:
        before = _used(small_disk)
        cache = small_disk / "cache"
        expected = (r"The disk holding .* is full \(No space left on device\) while downloading org/big@main "
                    r"file model.safetensors; free space" if size == "unknown"
                    else r"org/big@main needs 8.0 MB but the disk holding .* has 5.2 MB free; free space")
        with pytest.raises(DataError, match=expected):
            hub.download_model("org/big", cache_dir=str(cache), endpoint=srv.url, timeout=10)
        weights = [p for m, p, _, _ in srv.requests if m == "GET" and p.endswith("model.safetensors")]
        assert len(weights) == (1 if size == "unknown" else 0)  # stopped at once, or refused before asking
        left = {f: os.path.getsize(small_disk / f) for f in _files_under(small_disk)}
        assert all(n < 1024 for n in left.values()), left  # no part of the weights; config.json may stay
        assert _used(small_disk) - before < 64 * 1024
    finally:
        srv.close()


# ------------------------------------------------------------------------------- output folders

def _images(folder) -> str:
    os.makedirs(folder)
    for name in ("a.png", "b.png"):
        Image.fromarray(np.full((6, 8, 3), 100, np.uint8)).save(os.path.join(folder, name))
    return str(folder)


def test_a_full_output_disk_is_refused_in_one_sentence_before_predict_loads_anything(small_disk, tmp_path):
    src = _images(tmp_path / "in")
    out = small_disk / "out"
    out.mkdir()
    fill_disk(small_disk / "ballast")
    wd = _workdir(tmp_path / "run")  # config.json and an empty checkpoints/2: loading it would fail otherwise
    proc = subprocess.run([sys.executable, "-m", "jaxrat.predict", f"--workdir={wd}", f"--input={src}",
                           f"--out={out}"], cwd=REPO, env=env_with_devices(1), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"jaxrat: error: Cannot write the predict's results to {out} (No space left on device); pass --out a folder "
        f"you can write to, on a disk with free space.")
    assert os.listdir(out) == []
    with pytest.raises(UserError, match=rf"Cannot write the evaluation to {out}/e \(No space left on device\)"):
        output_folder.check(str(out / "e"), [], command="evaluate")


def test_a_read_only_output_disk_is_refused_in_one_sentence(read_only_disk, tmp_path):
    src = _images(tmp_path / "in")
    for out, command, what in ((read_only_disk, "predict", "predict's results"),
                               (read_only_disk / "new", "predict", "predict's results"),
                               (read_only_disk, "evaluate", "evaluation")):
        with pytest.raises(UserError, match=rf"Cannot write the {what} to {out} \(Read-only file system\); "
                                            rf"pass --out a folder you can write to"):
            if command == "predict":
                predict_run.prepare_output(str(out), expand_inputs(src), src, False)
            else:
                output_folder.check(str(out), [], command=command)
