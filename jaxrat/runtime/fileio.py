"""Files written whole or not at all.

Every file a user or a later run reads (summaries, tables, plots, markers, pointers) is written
through :func:`atomic_open`: the bytes go to a temporary file with a unique name in the same folder
(so two writers never share one, and the rename cannot cross filesystems), are flushed and fsynced,
and the temporary is renamed over the destination; the folder is then fsynced where the filesystem
supports it, so the rename itself survives a crash. On any failure (a full disk, an exception in the
caller's block, Ctrl-C) the temporary is removed and the previous file, if any, is left as it was.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import json
import os
import tempfile
from typing import IO, Any, Iterable, Iterator, Sequence

# fsync on a folder is refused by some filesystems (and by Windows); the rename is done either way.
_NO_DIR_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES, errno.EISDIR,
                 errno.EPERM}


def _umask() -> int:
    # Reading it from /proc leaves the process's umask untouched; os.umask(x) would change it for a
    # moment under every other thread creating files.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def _mode_for(path: str) -> int:
    """The destination's current permissions, or what ``open()`` would give a new file (mkstemp's are 0600)."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def fsync_dir(folder: str) -> None:
    """Make a rename or a new entry in ``folder`` durable, where the filesystem allows it."""
    try:
        fd = os.open(folder or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def temp_name_prefix(path: str) -> str:
    """The prefix of :func:`atomic_open`'s temporaries for ``path`` (``.NAME.``); they end in ``.tmp``."""
    return f".{os.path.basename(path)}."


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, encoding: str | None = None,
                newline: str | None = None) -> Iterator[IO[Any]]:
    """A file object whose content replaces ``path`` when the block ends without an exception.

    ``mode`` is ``"w"`` (text, UTF-8 unless ``encoding`` says otherwise) or ``"wb"``. A new file gets
    the permissions ``open()`` would give it (0666 less the umask); an existing one keeps its own.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a whole file: mode 'w' or 'wb', not {mode!r}")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    perms = _mode_for(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_name_prefix(path), suffix=".tmp", dir=folder)
    try:
        try:
            f = (os.fdopen(fd, "wb") if mode == "wb"
                 else os.fdopen(fd, "w", encoding=encoding or "utf-8", newline=newline))
        except BaseException:
            os.close(fd)
            raise
        with f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), perms)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` by ``data``, whole or not at all."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str, *, encoding: str | None = None) -> None:
    """Replace ``path`` by ``text``, whole or not at all."""
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj: Any, **dump_kwargs: Any) -> None:
    """Replace ``path`` by ``obj`` as JSON (``json.dump``'s keyword arguments), whole or not at all.

    The text is built first, so an object JSON cannot write leaves the old file untouched.
    """
    write_text(path, json.dumps(obj, **dump_kwargs))


def read_json(path: str | os.PathLike) -> Any:
    """The JSON object at ``path``; None when there is no such file or it cannot be read as JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_csv(path: str | os.PathLike, rows: Iterable[Sequence[Any]], header: Sequence[str] | None = None,
              **writer_kwargs: Any) -> None:
    """Replace ``path`` by a CSV of ``rows`` (after ``header`` if given), whole or not at all."""
    with atomic_open(path, "w", newline="") as f:
        writer = csv.writer(f, **writer_kwargs)
        if header is not None:
            writer.writerow(header)
        writer.writerows(rows)


def _format_of(path: str, known: Iterable[str]) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in known:
        raise ValueError(f"cannot tell the image format of {path}: name it with one of {sorted(known)}")
    return ext


def save_image(path: str | os.PathLike, image: Any, **save_kwargs: Any) -> None:
    """Save a PIL image to ``path`` (format from the extension), whole or not at all."""
    from PIL import Image

    path = os.fspath(path)
    fmt = Image.registered_extensions()[_format_of(path, Image.registered_extensions())]
    with atomic_open(path, "wb") as f:
        image.save(f, format=fmt, **save_kwargs)


def save_figure(path: str | os.PathLike, figure: Any, **savefig_kwargs: Any) -> None:
    """Save a matplotlib figure to ``path`` (format from the extension), whole or not at all."""
    path = os.fspath(path)
    fmt = _format_of(path, {f".{k}" for k in figure.canvas.get_supported_filetypes()})[1:]
    # Rendered into memory first: a figure that fails to draw leaves no trace on disk.
    buffer = io.BytesIO()
    figure.savefig(buffer, format=fmt, **savefig_kwargs)
    write_bytes(path, buffer.getvalue())


def move_into_place(src: str | os.PathLike, dst: str | os.PathLike, *, sync: bool = True) -> None:
    """Rename a finished file or folder ``src`` over ``dst`` (same filesystem) and, with ``sync``, make
    it durable (the file's data, then the folder's entry).

    For content written elsewhere first (a download's ``.part``, a staged copy); a file written in one
    go should use :func:`atomic_open` instead. ``sync=False`` is for many files whose commit is a
    later file written with :func:`atomic_open` (an archive's extracted members).
    """
    src, dst = os.fspath(src), os.fspath(dst)
    if not sync:
        os.replace(src, dst)
        return
    if os.path.isfile(src):
        fd = os.open(src, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(src, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))


def unwritable(folder: str | os.PathLike, probe_bytes: int = 0) -> str | None:
    """Why files cannot be written in ``folder`` (created if missing), e.g. "Read-only file
    system"; None when they can. A probe file is made and removed: permissions alone do not tell
    (root ignores them, a read-only mount does not show in them). With ``probe_bytes`` that many
    bytes are written and synced first, so a full disk ("No space left on device") shows too: an
    empty file needs no data block."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
        try:
            left = memoryview(bytes(probe_bytes))
            while left:
                left = left[os.write(fd, left):]
            if probe_bytes:
                os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None
