"""Fetch one URL to a file, resumably and verified: the HTTP half of :mod:`jaxrat.data.download`.

``fetch`` resumes ``PATH.part`` with a ``Range`` request (``If-Range`` on the ETag), refuses a
``text/html`` body, checks free space against the length before writing, stops at once on a full disk
(removing the partial file), keeps bytes received before a stall, and confirms a body sent without a
length with a Range request for what follows it. ``verify`` checks a finished file's length, MD5 (a
plain-MD5 ETag) and pinned SHA-256.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import json
import logging
import os
import re
import shutil
import time
import urllib.error
import urllib.request
import zipfile

from jaxrat.runtime.errors import DataError
from jaxrat.runtime.fileio import move_into_place, write_json

_CHUNK = 1 << 20


def _file_digest(path: str, algo: str) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _open(url: str, headers: dict[str, str], timeout: float):
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)


def fetch(url: str, path: str, *, retries: int = 5, timeout: float = 60.0, backoff: float = 1.0,
          size: int | None = None, mirror_flag: str = "--base-url") -> dict:
    """Download ``url`` to ``path``, resuming ``path + '.part'``; returns {"etag", "size"}.

    Retries network errors up to ``retries`` times, each time continuing where it stopped. ``size``
    (pinned): a server offering another length is refused before a byte is written. ``mirror_flag``
    is the calling command's option for another server, which its errors name."""
    part, meta_path = path + ".part", path + ".part.json"
    meta = _read_meta(meta_path)  # each attempt updates it in place, so the next one resumes against it
    last_error = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * attempt)
        have = os.path.getsize(part) if os.path.exists(part) else 0
        if have and have == meta.get("size"):  # complete before a kill; a Range request would get 416
            _complete(part, path, meta_path)
            return meta
        try:
            _attempt(url, part, meta_path, meta, have, size=size, timeout=timeout)
            _complete(part, path, meta_path)
            return meta
        except urllib.error.HTTPError as e:
            if e.code == 416:  # our partial file is not a prefix of the server's: start over
                os.remove(part)
                last_error = e
                continue
            if e.code in (403, 404, 410):
                raise DataError(f"Download of {url} failed: HTTP {e.code} {e.reason}; "
                                f"check the URL or {mirror_flag}.") from None
            last_error = e
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, http.client.HTTPException) as e:
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                # Retrying cannot help and the partial file is what fills the disk: give the space back.
                for leftover in (part, meta_path):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(leftover)
                raise DataError(f"The disk holding {os.path.dirname(path)} is full ({e.strerror}) while downloading "
                                f"{url}; the partial file was removed: free space or choose another --dest.") from None
            last_error = e
        if attempt < retries:
            logging.warning("download of %s interrupted (%s); retry %d of %d", url, last_error, attempt + 1, retries)
    raise DataError(f"Download of {url} failed after {retries + 1} attempts ({last_error}); "
                    f"{_advice_after_failure(part, last_error, mirror_flag)}.")


def _complete(part: str, path: str, meta_path: str) -> None:
    move_into_place(part, path)
    os.remove(meta_path)


def _attempt(url: str, part: str, meta_path: str, meta: dict, have: int, *, size: int | None,
             timeout: float) -> None:
    """One request: the rest of ``part`` (or all of it again), checked to be whole. ``meta`` is
    replaced in place by the answer's ETag and length, and saved, before a byte is written."""
    resp = _open_resuming(url, part, have, meta.get("etag"), timeout)
    with resp:
        etag = resp.headers.get("ETag")
        total, have = _answer_lengths(resp, url, have, size)
        _check_space(part, total - have if total >= 0 else -1, url)
        meta.clear()
        meta.update({"etag": etag, "size": total})
        _write_meta(meta_path, meta)
        have += _write_body(resp, part, "ab" if resp.status == 206 else "wb")
    if total >= 0 and have != total:
        raise ConnectionError(f"got {have} of {total} bytes")
    if total < 0:  # no length: a closed connection looks like the end, so ask whether there is more
        _confirm_end(url, have, etag, timeout)


def _open_resuming(url: str, part: str, have: int, etag: str | None, timeout: float):
    """The server's answer to a request for the bytes after ``have`` (with the ETag they came with),
    or for the whole file when there are none or a partial answer would not continue them."""
    headers = {"User-Agent": "jaxrat-download"}
    if have and etag:
        headers.update({"Range": f"bytes={have}-", "If-Range": etag})
    resp = _open(url, headers, timeout)
    _refuse_html(resp, url)
    if resp.status == 206 and not _continues(resp, have, etag):
        # Appending this would splice two versions or misplace bytes: start again.
        logging.warning("%s: the server's partial answer does not continue our file; restarting", url)
        resp.close()
        os.remove(part)
        resp = _open(url, {"User-Agent": "jaxrat-download"}, timeout)
        _refuse_html(resp, url)
    return resp


def _answer_lengths(resp, url: str, have: int, size: int | None) -> tuple[int, int]:
    """(the file's length, -1 when unknown; the bytes of it the partial file keeps) by a 206 (resumed)
    or 200 answer; a length other than the pinned ``size`` is refused."""
    if resp.status == 206:
        total = int(resp.headers["Content-Range"].rsplit("/", 1)[1])
        logging.info("resuming %s at %.1f of %.1f MB", url, have / 1e6, total / 1e6)
    else:  # 200: a fresh start (no partial file, no Range support, or the file changed)
        total, have = int(resp.headers.get("Content-Length", -1)), 0
    if size is not None and total >= 0 and total != size:
        raise DataError(f"{url} offers {total} bytes but its pinned size is {size}; it is another file: "
                        f"check --base-url and the --checksums entry.")
    return (size if size is not None and total < 0 else total), have


def _write_body(resp, part: str, mode: str) -> int:
    """Write the answer's body to ``part`` (``mode`` "ab" appends); returns the bytes written."""
    written = 0
    with open(part, mode) as out:
        # read1: whatever has arrived, so a stall or a cut loses nothing already received
        # (read(n) waits for n bytes and drops them all when the socket times out).
        for chunk in iter(lambda: resp.read1(_CHUNK), b""):
            out.write(chunk)
            written += len(chunk)
    return written


def _advice_after_failure(part: str, last_error: Exception | None, mirror_flag: str) -> str:
    if os.path.exists(part) and os.path.getsize(part):
        return f"run the same command again to resume from {part}"
    if isinstance(last_error, urllib.error.HTTPError):  # the server answered, so not the network
        return f"the server failed; run the same command again later or use a mirror with {mirror_flag}"
    return f"check the network connection and {mirror_flag}, then run the same command again"


def _refuse_html(resp, url: str) -> None:
    """A login or error page sent with status 200 is not the archive: refused before a byte is saved."""
    kind = (resp.headers.get("Content-Type") or "").split(";")[0].strip().lower()
    if kind in ("text/html", "application/xhtml+xml"):
        resp.close()
        raise DataError(f"{url} answered with an HTML page ({kind}), not the file: a login or error page; check the "
                        f"URL or --base-url.")


def _confirm_end(url: str, have: int, etag: str | None, timeout: float) -> None:
    """After a body sent without a length, ask for the bytes after ``have``: 416 (nothing there)
    confirms the end; 206 means the body was cut short (ConnectionError: the caller resumes). A
    server without Range support cannot tell; then the checksums and the zip check decide."""
    headers = {"User-Agent": "jaxrat-download", "Range": f"bytes={have}-"}
    if etag:
        headers["If-Range"] = etag
    try:
        with _open(url, headers, timeout) as resp:
            if resp.status == 206:
                raise ConnectionError(f"the body ended after {have} bytes without a length and the server has more")
            logging.warning("%s sent no length and ignores Range requests: only the checksums and the zip "
                            "check can tell whether its %d bytes are all of it", url, have)
    except urllib.error.HTTPError as e:
        if e.code != 416:
            raise


def _check_space(part: str, need: int, url: str) -> None:
    """Refuse before writing when the server's length does not fit on the disk (``need`` < 0: unknown)."""
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(part))).free
    if need > free:
        raise DataError(f"{url} is {_amount(need)} but the disk holding {os.path.dirname(part)} has "
                        f"{_amount(free)} free; free space or choose another --dest.")


def _amount(n: int) -> str:
    """Bytes as the refusal says them: GB from 1 GB up, else MB ("0.01 GB" said nothing of 8 MB against 5)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _read_meta(meta_path: str) -> dict:
    """The partial download's {"etag", "size"}; empty when missing or unreadable (a kill while
    it was written), which makes the next request a fresh start instead of a traceback."""
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_meta(meta_path: str, meta: dict) -> None:
    write_json(meta_path, meta)


def _continues(resp, have: int, etag: str | None) -> bool:
    """Whether a 206 answer is the rest of our ``have`` bytes of the same file: it starts at
    ``have`` and carries the ETag we started with (servers that ignore If-Range send the new
    file's bytes otherwise)."""
    m = re.fullmatch(r"bytes (\d+)-\d+/(\d+)", (resp.headers.get("Content-Range") or "").strip())
    if not m or int(m.group(1)) != have:
        return False
    new_tag = resp.headers.get("ETag")
    return not (etag and new_tag and new_tag != etag)


def verify(path: str, *, etag: str | None, sha256: str | None, size: int | None = None) -> str:
    """Check ``path`` against a pinned size, the ETag MD5 (when it is one), a pinned SHA-256 and its
    zip CRCs; returns its SHA-256. A corrupt archive is deleted so the next run downloads it again."""
    name = os.path.basename(path)
    digest = _file_digest(path, "sha256")
    tag = (etag or "").strip('"')
    problems = []
    if size is not None and os.path.getsize(path) != size:
        problems.append(f"it has {os.path.getsize(path)} bytes, not the pinned {size}")
    if re.fullmatch(r"[0-9a-f]{32}", tag) and _file_digest(path, "md5") != tag:
        problems.append(f"its MD5 differs from the server's ETag {tag}")
    if sha256 and digest != sha256.lower():
        problems.append(f"its SHA-256 {digest} is not the expected {sha256}")
    if not problems:
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
            if bad:
                problems.append(f"member {bad} fails its CRC check")
        except zipfile.BadZipFile as e:
            problems.append(f"it is not a valid zip ({e})")
    if problems:
        os.remove(path)
        raise DataError(f"Archive {name} is corrupt: {'; '.join(problems)}; it was deleted, run the command again.")
    return digest
