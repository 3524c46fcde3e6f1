"""Files written whole or not at all (jaxrat.runtime.fileio): the old file survives every failure, no
temporary is left behind, concurrent writers never share a temporary, permissions are open()'s."""

from __future__ import annotations

import csv
import errno
import json
import os
import resource
import signal
import stat
import tempfile
import threading

import numpy as np
import pytest

from jaxrat.runtime import fileio


def _leftovers(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))


def test_each_kind_round_trips_and_leaves_only_the_file(tmp_path):
    fileio.write_bytes(tmp_path / "a.bin", b"\x00\x01")
    fileio.write_text(tmp_path / "a.md", "# hi\n")
    fileio.write_json(tmp_path / "a.json", {"x": [1, 2]}, indent=2)
    fileio.write_csv(tmp_path / "a.csv", [[1, "a,b"], [2, ""]], header=["n", "s"])
    from PIL import Image

    pixels = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    fileio.save_image(tmp_path / "a.png", Image.fromarray(pixels))
    from matplotlib.figure import Figure

    fig = Figure()
    fig.subplots().plot([0, 1], [1, 0])
    fileio.save_figure(tmp_path / "a.png.plot.png", fig, dpi=50)

    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "a.md").read_text() == "# hi\n"
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": [1, 2]}
    with open(tmp_path / "a.csv", newline="") as f:
        assert list(csv.reader(f)) == [["n", "s"], ["1", "a,b"], ["2", ""]]
    assert np.array_equal(np.asarray(Image.open(tmp_path / "a.png")), pixels)
    assert (tmp_path / "a.png.plot.png").read_bytes().startswith(b"\x89PNG")
    assert _leftovers(tmp_path) == [] and not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_a_new_file_gets_opens_permissions_and_an_old_one_keeps_its_own(tmp_path):
    old = os.umask(0o027)
    try:
        fileio.write_text(tmp_path / "new.txt", "x")
        with open(tmp_path / "plain.txt", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new.txt").st_mode) == stat.S_IMODE(os.stat(tmp_path / "plain.txt").st_mode)
    assert stat.S_IMODE(os.stat(tmp_path / "new.txt").st_mode) == 0o640  # not mkstemp's 0600
    os.chmod(tmp_path / "new.txt", 0o604)
    fileio.write_text(tmp_path / "new.txt", "y")
    assert stat.S_IMODE(os.stat(tmp_path / "new.txt").st_mode) == 0o604


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_failure_mid_write_keeps_the_old_file_and_no_temporary(tmp_path, error):
    path = tmp_path / "summary.json"
    fileio.write_text(path, "old")
    with pytest.raises(type(error)):
        with fileio.atomic_open(path) as f:
            f.write("half of the new" * 1000)
            f.flush()
            assert _leftovers(tmp_path)  # the temporary exists while writing, in the same folder
            raise error
    assert path.read_text() == "old"
    assert _leftovers(tmp_path) == []


def test_an_object_json_cannot_write_leaves_the_old_file(tmp_path):
    fileio.write_json(tmp_path / "m.json", {"a": 1})
    with pytest.raises(TypeError):
        fileio.write_json(tmp_path / "m.json", {"a": object()})
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": 1} and _leftovers(tmp_path) == []


def test_disk_full_at_fsync_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "best.json"
    fileio.write_json(path, {"step": 1})

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        fileio.write_json(path, {"step": 2})
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"step": 1} and _leftovers(tmp_path) == []


def test_a_write_the_kernel_refuses_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    """A real short write: RLIMIT_FSIZE makes write(2) fail partway, as a full disk does."""
    path = tmp_path / "table.csv"
    fileio.write_text(path, "old\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(OSError) as e:
            fileio.write_csv(path, [[i, "x" * 100] for i in range(10_000)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert e.value.errno == errno.EFBIG
    assert path.read_text() == "old\n" and _leftovers(tmp_path) == []


def test_concurrent_writers_never_share_a_temporary_and_one_whole_version_wins(tmp_path, monkeypatch):
    n = 8
    names: list[str] = []
    real_mkstemp = tempfile.mkstemp

    def recording(*a, **k):
        fd, name = real_mkstemp(*a, **k)
        names.append(name)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", recording)
    together = threading.Barrier(n)
    path = tmp_path / "manifest.json"
    errors = []

    def writer(i: int) -> None:
        try:
            with fileio.atomic_open(path) as f:
                f.write(json.dumps({"writer": i, "pad": "p" * 10_000 * i}))
                together.wait(30)  # every writer holds its temporary open at once
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(set(names)) == n and all(os.path.dirname(p) == str(tmp_path) for p in names)
    assert all(os.path.basename(p).startswith(".manifest.json.") and p.endswith(".tmp") for p in names)
    final = json.loads(path.read_text())
    assert final["pad"] == "p" * 10_000 * final["writer"]
    assert _leftovers(tmp_path) == []


def test_an_image_whose_save_fails_leaves_the_old_one(tmp_path):
    from PIL import Image

    path = tmp_path / "plot.png"
    fileio.save_image(path, Image.new("RGB", (2, 2)))
    before = path.read_bytes()
    with pytest.raises(ValueError, match="image format"):
        fileio.save_image(tmp_path / "plot.unknownext", Image.new("RGB", (2, 2)))
    with pytest.raises(OSError):
        fileio.save_image(path, Image.new("CMYK", (2, 2)))  # PNG has no CMYK: PIL refuses inside the write
    assert path.read_bytes() == before and _leftovers(tmp_path) == []


def test_move_into_place_replaces_a_folder_or_file(tmp_path):
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "f").write_text("n")
    (tmp_path / "dest").mkdir()
    fileio.move_into_place(tmp_path / "dest", tmp_path / "old")
    fileio.move_into_place(tmp_path / "new", tmp_path / "dest")
    assert (tmp_path / "dest" / "f").read_text() == "n" and not (tmp_path / "new").exists()
    (tmp_path / "x.part").write_bytes(b"data")
    fileio.move_into_place(tmp_path / "x.part", tmp_path / "x")
    assert (tmp_path / "x").read_bytes() == b"data"


def test_only_whole_file_modes_are_accepted(tmp_path):
    with pytest.raises(ValueError, match="whole file"):
        with fileio.atomic_open(tmp_path / "a", "a"):
            pass
