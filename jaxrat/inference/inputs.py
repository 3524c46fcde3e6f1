"""Which images a prediction reads: a folder (recursive), one file, a glob, or a text file of paths.

Every input comes with the relative path its outputs take under the output folder, so images of the
same name in different sub-folders never overwrite each other's results.
"""

from __future__ import annotations

import dataclasses
import glob
import os

from jaxrat.runtime import folders
from jaxrat.runtime.errors import UserError

# A folder's files are all tried, whatever their extension (an image saved as .dat is still read;
# a README is listed in skipped.txt as no image); hidden files (.DS_Store) are left out.
# A text file listing paths: these extensions, read one path per line.
LIST_EXTENSIONS = (".txt", ".lst", ".list")


@dataclasses.dataclass(frozen=True)
class InputImage:
    """One image to predict: ``path`` to read and ``name``, its path relative to the input (``/``
    separated), which its outputs mirror under the output folder."""

    path: str
    name: str


def expand_inputs(spec: str) -> list[InputImage]:
    """The images ``spec`` names, sorted by name; raises UserError when it names none."""
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        found = []
        for root, _, files in folders.walk(path):  # links followed, each real folder once (loops end)
            for f in files:
                if not f.startswith("."):  # every file is tried: one that is no image lands in skipped.txt
                    full = os.path.join(root, f)
                    found.append(InputImage(full, os.path.relpath(full, path).replace(os.sep, "/")))
        found.sort(key=lambda i: i.name)
        if not found:
            raise UserError(f"--input {spec}: the folder holds no files; point --input at a folder of images, a "
                            f"file, a glob or a list of paths.")
        return found
    if os.path.isfile(path) and path.lower().endswith(LIST_EXTENSIONS):
        return _from_list(path)
    if os.path.isfile(path):
        return [InputImage(path, os.path.basename(path))]
    if glob.has_magic(path):
        matches = folders.glob_files(path)
        if not matches:
            raise UserError(f"--input {spec}: the pattern matches no file; check the pattern.")
        return _relative_to_common(matches)
    raise UserError(f"--input {spec} does not exist; pass a folder, an image file, a glob or a text file of paths.")


def _from_list(list_file: str) -> list[InputImage]:
    base = os.path.dirname(os.path.abspath(list_file))
    paths = []
    with open(list_file, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                p = os.path.expanduser(line)
                paths.append(p if os.path.isabs(p) else os.path.join(base, p))
    if not paths:
        raise UserError(f"--input {list_file}: the list names no file; write one image path per line.")
    # Missing files are kept: the prediction lists them in skipped.txt rather than stopping.
    return _relative_to_common(paths)


def _relative_to_common(paths: list[str]) -> list[InputImage]:
    absolute = [os.path.abspath(p) for p in paths]
    root = os.path.commonpath([os.path.dirname(p) for p in absolute])
    seen: set[str] = set()
    out = []
    for p, a in zip(paths, absolute):
        name = os.path.relpath(a, root).replace(os.sep, "/")
        if name in seen:  # the same file listed twice: predicted once
            continue
        seen.add(name)
        out.append(InputImage(p, name))
    return sorted(out, key=lambda x: x.name)
