"""Folder walks that follow links but enter every real folder once.

A dataset or an input folder may hold links to folders (a ``masks`` linked from elsewhere, a shared
``images``); following them is what users mean. A link back to the folder itself or to an ancestor
(``ln -s . in/a``) would make ``os.walk(followlinks=True)`` and ``glob("**")`` list the same files
under ever longer names, exponentially with two such links, until the kernel's link limit: a hang
and duplicate inputs. Here a folder whose real path was already entered is skipped, so each file
is listed once, under the first name the walk reaches it by (real folders before links).
"""

from __future__ import annotations

import fnmatch
import glob
import os
from typing import Iterator


def walk(top: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(top, followlinks=True)`` that never enters one real folder twice; ``dirs`` come
    sorted (folders before links to folders), and a caller may prune them further."""
    seen = {os.path.realpath(top)}
    for root, dirs, files in os.walk(top, followlinks=True):
        kept = []
        for name in sorted(dirs, key=lambda d: (os.path.islink(os.path.join(root, d)), d)):
            real = os.path.realpath(os.path.join(root, name))
            if real not in seen:
                seen.add(real)
                kept.append(name)
        dirs[:] = sorted(kept)
        files.sort()
        yield root, dirs, files


def _matches(parts: list[str], patterns: list[str]) -> bool:
    """Whether the path components ``parts`` match ``patterns`` (glob's rules: ``**`` is any number
    of folders, ``*`` stays within one name, hidden names only match a pattern starting with a dot)."""
    if not patterns:
        return not parts
    head = patterns[0]
    if head == "**":
        for i in range(len(parts) + 1):
            if i and parts[i - 1].startswith("."):
                break
            if _matches(parts[i:], patterns[1:]):
                return True
        return False
    if not parts or (parts[0].startswith(".") and not head.startswith(".")):
        return False
    return fnmatch.fnmatchcase(parts[0], head) and _matches(parts[1:], patterns[1:])


def glob_files(pattern: str) -> list[str]:
    """The files ``pattern`` matches, sorted; like ``glob.glob(pattern, recursive=True)``, but a
    ``**`` walks with :func:`walk`, so links to folders are followed once and loops end."""
    parts = pattern.split(os.sep)
    if "**" not in parts:
        return sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    first = parts.index("**")
    prefix = os.sep.join(parts[:first]) or (os.sep if pattern.startswith(os.sep) else os.curdir)
    rest = parts[first:]
    bases = glob.glob(prefix) if glob.has_magic(prefix) else [prefix]
    found = set()
    for base in bases:
        if not os.path.isdir(base):
            continue
        for root, _, files in walk(base):
            for name in files:
                path = os.path.join(root, name)
                if _matches(os.path.relpath(path, base).split(os.sep), rest) and os.path.isfile(path):
                    # The caller's spelling of the base, as glob.glob gives it ("./" stays off).
                    found.add(path if parts[:first] else os.path.relpath(path, base))
    return sorted(found)
