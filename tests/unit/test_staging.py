"""Staging to node-local disk: one copy per node under a lock, reused only while it is a complete
copy of an unchanged source, never a half copy (the basic copy/reuse/restage case is in
test_data_badfiles.py)."""

import os
import shutil
import sys
import threading
import time

import pytest

from jaxrat.data import staging
from jaxrat.runtime.errors import DataError
from runner import kill_when_ready


def _source(root, n=6):
    os.makedirs(os.path.join(root, "sub"))
    for i in range(n):
        with open(os.path.join(root, "sub" if i % 2 else "", f"f{i}.bin"), "wb") as f:
            f.write(bytes([i]) * (100 + i))
    return root


def _leftovers(local):
    return sorted(n for n in os.listdir(local) if ".tmp-" in n or ".old-" in n)


def test_same_size_rewrite_within_a_second_is_restaged(tmp_path):
    src = _source(str(tmp_path / "src"))
    path = os.path.join(src, "f0.bin")
    t = os.stat(path).st_mtime_ns
    os.utime(path, ns=(t, t - t % 10**9))  # at a whole second
    dest = staging.stage(src, str(tmp_path / "local"))
    with open(path, "wb") as f:
        f.write(b"X" * 100)  # same size ...
    os.utime(path, ns=(t, t - t % 10**9 + 500_000_000))  # ... half a second later
    assert staging.stage(src, str(tmp_path / "local")) == dest
    assert open(os.path.join(dest, "f0.bin"), "rb").read() == b"X" * 100


def test_a_file_deleted_from_the_local_copy_is_restaged(tmp_path):
    src = _source(str(tmp_path / "src"))
    dest = staging.stage(src, str(tmp_path / "local"))
    os.remove(os.path.join(dest, "sub", "f1.bin"))  # a scratch cleaner at work
    assert staging.stage(src, str(tmp_path / "local")) == dest
    assert open(os.path.join(dest, "sub", "f1.bin"), "rb").read() == bytes([1]) * 101


def test_processes_of_a_node_copy_once(tmp_path, monkeypatch):
    src = _source(str(tmp_path / "src"))
    local = str(tmp_path / "local")
    copies = []
    real = shutil.copytree

    def slow_copytree(s, d, *a, **kw):
        if not a:  # not copytree's own recursion into sub-folders
            copies.append(s)
            time.sleep(0.2)  # widen the window in which the others arrive
        return real(s, d, *a, **kw)

    monkeypatch.setattr(staging.shutil, "copytree", slow_copytree)
    results, errors = [], []

    def run():
        try:
            results.append(staging.stage(src, local))  # each call opens its own lock file description
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 4 and len(set(results)) == 1
    assert len(copies) == 1
    assert sorted(os.listdir(results[0])) == sorted(os.listdir(src) + [staging._MANIFEST])


KILL_MID_COPY = r"""
import shutil, sys, time
from jaxrat.data import staging
ready, n = sys.argv[1], [0]
real = shutil.copy2
def stall(*a, **kw):
    n[0] += 1
    if n[0] == 3:  # two files copied: tell the test, then wait to be killed
        open(ready, "w").close()
        time.sleep(120)
    return real(*a, **kw)
real_tree = shutil.copytree
shutil.copytree = lambda s, d, *a, **kw: real_tree(s, d, *a, **(kw if a else {**kw, "copy_function": stall}))
staging.stage(sys.argv[2], sys.argv[3])
"""


@pytest.mark.parametrize("restage", [False, True])
def test_a_copy_killed_half_way_is_never_used_and_is_cleaned_up(tmp_path, restage):
    src = _source(str(tmp_path / "src"))
    local = str(tmp_path / "local")
    if restage:  # a complete copy of an older source is there; the source then changed
        dest = staging.stage(src, local)
        with open(os.path.join(src, "f0.bin"), "wb") as f:
            f.write(b"new contents")
    ready = str(tmp_path / "ready")
    kill_when_ready([sys.executable, "-c", KILL_MID_COPY, ready, src, local], ready, "the copy")
    assert _leftovers(local)  # the killed copy's folder is there ...
    dest = staging.stage(src, local)  # ... and the next call neither uses nor keeps it
    assert _leftovers(local) == []
    for rel in ("f0.bin", "f2.bin", os.path.join("sub", "f1.bin"), os.path.join("sub", "f5.bin")):
        assert open(os.path.join(dest, rel), "rb").read() == open(os.path.join(src, rel), "rb").read()


def test_a_failed_copy_leaves_nothing_and_names_the_fix(tmp_path, monkeypatch):
    src = _source(str(tmp_path / "src"))
    local = str(tmp_path / "local")
    real = shutil.copy2
    n = [0]

    def full_disk(*a, **kw):
        n[0] += 1
        if n[0] >= 3:
            raise OSError(28, "No space left on device")
        return real(*a, **kw)

    real_tree = shutil.copytree
    monkeypatch.setattr(shutil, "copytree",  # copytree recurses with positional arguments
                        lambda s, d, *a, **kw: real_tree(s, d, *a, **(kw if a else {**kw, "copy_function": full_disk})))
    with pytest.raises(DataError, match="stage_to_local_dir") as err:
        staging.stage(src, local)
    msg = str(err.value)  # one cause, not one line per file that could not be written
    assert "No space left on device copying" in msg and "more file" in msg and msg.count("No space") == 1
    assert _leftovers(local) == [] and not [n for n in os.listdir(local) if not n.endswith(".lock")]


def test_a_linked_masks_folder_is_staged_and_a_changed_mask_restaged(tmp_path):
    masks = tmp_path / "elsewhere" / "masks"
    masks.mkdir(parents=True)
    (masks / "m0.png").write_bytes(b"old mask")
    src = tmp_path / "data"
    (src / "images").mkdir(parents=True)
    (src / "images" / "m0.png").write_bytes(b"image")
    os.symlink(masks, src / "masks")  # a folder linked into the dataset, as clusters' shared data often is
    local = str(tmp_path / "local")
    dest = staging.stage(str(src), local)
    assert open(os.path.join(dest, "masks", "m0.png"), "rb").read() == b"old mask"
    assert not os.path.islink(os.path.join(dest, "masks"))  # a copy, not a link back to the shared disk
    (masks / "m0.png").write_bytes(b"the new mask")
    assert staging.stage(str(src), local) == dest
    assert open(os.path.join(dest, "masks", "m0.png"), "rb").read() == b"the new mask"


@pytest.mark.timeout(60)
def test_a_link_loop_in_the_dataset_is_staged_once(tmp_path):
    src = _source(str(tmp_path / "src"))
    os.symlink("..", os.path.join(src, "sub", "up"))  # copytree copied sub/up/sub/up/... to the link limit
    dest = staging.stage(src, str(tmp_path / "local"))
    copied = sorted(os.path.relpath(os.path.join(r, f), dest) for r, _, fs in os.walk(dest) for f in fs)
    assert copied == sorted([staging._MANIFEST, "f0.bin", "f2.bin", "f4.bin"]
                            + [os.path.join("sub", f"f{i}.bin") for i in (1, 3, 5)])
    assert staging.stage(src, str(tmp_path / "local")) == dest  # reused: the manifest matches the walk
