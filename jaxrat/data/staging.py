"""Copy a dataset folder to node-local disk before training (what the cluster scripts did by hand).

Several processes of one node may call :func:`stage` at once: one copies under an exclusive file
lock, the others wait and reuse the copy. A copy is reused only when its manifest (relative
path, size and mtime of every file) matches the source, so a changed dataset is re-staged.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time

from jaxrat.errors import DataError

_MANIFEST = ".jaxrat_staged.json"


def _manifest(src: str) -> dict:
    files = {}
    for root, dirs, names in os.walk(src):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            st = os.stat(path)
            files[os.path.relpath(path, src)] = [st.st_size, int(st.st_mtime)]
    return {"source": os.path.abspath(src), "files": files}


def stage(src: str, local_root: str) -> str:
    """Copy ``src`` to ``local_root/<name>-<hash of src path>`` unless an identical copy is there;
    return the local copy's path."""
    src = os.path.abspath(src)
    if not os.path.isdir(src):
        raise DataError(f"Cannot stage {src}: not a folder; fix --config.data.data_dir.")
    tag = hashlib.sha1(src.encode()).hexdigest()[:8]
    dest = os.path.join(os.path.abspath(local_root), f"{os.path.basename(src.rstrip(os.sep))}-{tag}")
    try:
        os.makedirs(local_root, exist_ok=True)
        lock_path = dest + ".lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other processes of this node wait here
            return _stage_locked(src, dest)
    except OSError as e:
        raise DataError(
            f"Staging {src} to {local_root} failed ({e.strerror or e}); free space there or fix "
            f"--config.data.stage_to_local_dir."
        ) from None


def _stage_locked(src: str, dest: str) -> str:
    want = _manifest(src)
    marker = os.path.join(dest, _MANIFEST)
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == want:
                logging.info("data: reusing the staged copy %s", dest)
                return dest
    t0 = time.perf_counter()
    tmp = f"{dest}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    with open(os.path.join(tmp, _MANIFEST), "w") as f:
        json.dump(want, f)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)  # the copy appears complete or not at all
    size = sum(v[0] for v in want["files"].values())
    logging.info("data: staged %s to %s (%d files, %.1f MB) in %.1f s",
                 src, dest, len(want["files"]), size / 1e6, time.perf_counter() - t0)
    return dest
