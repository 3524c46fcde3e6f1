"""Copy a dataset folder to node-local disk before training, so every epoch reads local files.

Several processes of one node may call :func:`stage` at once: one copies under an exclusive file
lock, the others wait and reuse the copy. A copy is reused only when its manifest (relative
path, size and mtime of every file) matches the source and its files are all still there, so a
changed dataset is re-staged; a copy killed half way is never used, and the next call removes it.
Links to folders (a ``masks`` linked from elsewhere) are followed, each real folder once: the
manifest lists, and the copy holds, exactly the files training reads, so a changed file behind a
link is re-staged too, and a link loop is copied once instead of forever.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import time

from jaxrat.runtime import folders
from jaxrat.runtime.errors import DataError
from jaxrat.runtime.fileio import move_into_place, write_json

_MANIFEST = ".jaxrat_staged.json"


def _manifest(src: str) -> dict:
    files = {}
    for root, _, names in folders.walk(src):
        for name in names:
            path = os.path.join(root, name)
            st = os.stat(path)
            # Nanoseconds: a file rewritten at the same size within one second must still count
            # as changed.
            files[os.path.relpath(path, src)] = [st.st_size, st.st_mtime_ns]
    return {"source": os.path.abspath(src), "files": files}


def _listed_only(src: str, files: dict):
    """A ``copytree`` ignore that copies only the manifest's files: what the walk skipped (a
    folder reached a second time through a link) is never copied."""
    keep = set(files)
    parents = {os.path.dirname(rel) for rel in keep}
    for rel in list(parents):
        while rel:
            rel = os.path.dirname(rel)
            parents.add(rel)

    def ignore(folder: str, names: list[str]) -> list[str]:
        here = os.path.relpath(folder, src)
        rels = {n: os.path.normpath(os.path.join(here, n)) for n in names}
        return [n for n, rel in rels.items() if rel not in keep and rel not in parents]

    return ignore


def _intact(dest: str, want: dict) -> bool:
    """Whether ``dest`` is a finished copy of the source ``want`` describes, every file still
    there at its size (node-local scratch is often cleaned file by file behind our back)."""
    try:
        with open(os.path.join(dest, _MANIFEST)) as f:
            if json.load(f) != want:
                return False
        return all(os.path.getsize(os.path.join(dest, rel)) == size for rel, (size, _) in want["files"].items())
    except (OSError, ValueError):
        return False


def stage(src: str, local_root: str) -> str:
    """Copy ``src`` to ``local_root/<name>-<hash of src path>`` unless an identical copy is there;
    return the local copy's path."""
    src = os.path.abspath(src)
    if not os.path.isdir(src):
        raise DataError(f"Cannot stage {src}: not a folder; fix --config.data.data_dir.")
    if os.path.commonpath([src, os.path.abspath(local_root)]) == src:
        # The copy would land in the dataset folder (which is only ever read) and copy itself.
        raise DataError(f"--config.data.stage_to_local_dir={local_root} is inside the dataset folder {src}; "
                        f"pick a folder outside it.")
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
            f"Staging {src} to {local_root} failed ({_reason(e)}); free space there or fix "
            f"--config.data.stage_to_local_dir."
        ) from None


def _reason(e: OSError) -> str:
    """The cause in a few words: copytree collects one error per file (thousands on a full disk)."""
    failures = e.args[0] if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) else None
    if failures:
        first = failures[0]
        more = f", and {len(failures) - 1} more file(s)" if len(failures) > 1 else ""
        return f"{first[-1]} copying {first[0]}{more}"
    return str(e.strerror or e)


def _make_owner_writable(root: str) -> None:
    """Folders of a read-only dataset are copied read-only (copytree keeps modes), and the manifest
    could not be written nor the copy removed later: the copy's folders become owner-writable."""
    for folder, _, _ in os.walk(root):
        mode = stat.S_IMODE(os.stat(folder).st_mode)
        if not mode & stat.S_IWUSR:
            os.chmod(folder, mode | stat.S_IWUSR)


def _remove(path: str) -> None:
    """Delete a copy of ours, also one left half made (with read-only folders) by a killed run."""
    with contextlib.suppress(OSError):
        _make_owner_writable(path)
    shutil.rmtree(path, ignore_errors=True)


def _stage_locked(src: str, dest: str) -> str:
    want = _manifest(src)
    if _intact(dest, want):
        logging.info("data: reusing the staged copy %s", dest)
        return dest
    t0 = time.perf_counter()
    parent, base = os.path.split(dest)
    # Copies of killed runs (preemption mid-copy) would pile up on the local disk: only the lock
    # holder writes these names, and that is us.
    for name in os.listdir(parent):
        if name.startswith((base + ".tmp-", base + ".old-")):
            _remove(os.path.join(parent, name))
    tmp = f"{dest}.tmp-{os.getpid()}"
    try:
        shutil.copytree(src, tmp, ignore=_listed_only(src, want["files"]))
        _make_owner_writable(tmp)
        write_json(os.path.join(tmp, _MANIFEST), want)
    except BaseException:
        _remove(tmp)  # a full disk keeps no half copy
        raise
    old = f"{dest}.old-{os.getpid()}"
    if os.path.exists(dest):
        # Moved aside in one step, not deleted in place: a kill during a deletion could leave
        # a copy with its manifest but without some files.
        move_into_place(dest, old)
    move_into_place(tmp, dest)  # the copy appears complete or not at all
    _remove(old)
    size = sum(v[0] for v in want["files"].values())
    logging.info("data: staged %s to %s (%d files, %.1f MB) in %.1f s",
                 src, dest, len(want["files"]), size / 1e6, time.perf_counter() - t0)
    return dest
