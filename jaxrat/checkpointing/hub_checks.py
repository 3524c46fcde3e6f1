"""What a file fetched from the Hugging Face hub must be: its size, SHA-256 or git object id as the
hub lists them, and not an HTML or XML page served in its place (:mod:`jaxrat.checkpointing.hub` checks every
file after a download and whenever it is taken from the cache)."""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


def _digest(path: str, h: Any) -> str:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _git_blob_id(path: str) -> str:
    h = hashlib.sha1(b"blob %d\0" % os.path.getsize(path))
    return _digest(path, h)


def _looks_like_html(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(512).lstrip().lower()
    return head.startswith((b"<!doctype html", b"<html", b"<head", b"<?xml"))


def problem(path: str, *, size: int | None = None, sha256: str | None = None, git_id: str | None = None) -> str | None:
    """What is wrong with a fetched file (None: nothing found). The expected values come from the
    hub; without them the cache's blob name (the ETag the file was stored under) says what to check."""
    etag = os.path.basename(os.path.realpath(path))
    if sha256 is None and _SHA256.fullmatch(etag):
        sha256 = etag
    if git_id is None and sha256 is None and _COMMIT.fullmatch(etag):
        git_id = etag
    if _looks_like_html(path):
        return "it is an HTML or XML page (a login or error page), not the file"
    have = os.path.getsize(path)
    if size is not None and have != size:
        return f"it has {have} bytes, the hub says {size}"
    if sha256 and _digest(path, hashlib.sha256()) != sha256:
        return f"its SHA-256 is not the hub's {sha256}"
    if git_id and not sha256 and _git_blob_id(path) != git_id:
        return f"its git object id is not the hub's {git_id}"
    return None


def listed_checks(sibling: Any) -> dict[str, Any]:
    """The size/sha256/git id the repository listing gives for one file."""
    if sibling is None:
        return {}
    lfs = getattr(sibling, "lfs", None)
    if lfs is not None:
        return {"size": lfs.size, "sha256": lfs.sha256}
    return {"size": sibling.size, "git_id": sibling.blob_id}
