"""Download and extract official dataset archives: resumable, verified, into the official layout.

    python -m jaxrat.data.download isic2018 --dest DIR [--splits train,validation,test]
    python -m jaxrat.data.download coco2017 --dest DIR

Each archive is fetched to ``DEST/downloads/NAME.part`` and resumed with an HTTP ``Range``
request after an interruption (``If-Range`` on the ETag, so a changed file restarts from zero).
Before extraction it is checked: the byte count against ``Content-Length``; its MD5 against the
ETag when the server's ETag is a plain MD5 (S3 and most static servers for single-part
uploads); its SHA-256 and size against values you pin with ``--checksums FILE`` (the registry below
pins none: the official values could not be read from this project's machines); and every zip
member's CRC. An archive kept from an earlier run that fails these checks is fetched again. A
``text/html`` answer (a login or error page sent with status 200) is refused before a byte is saved;
an archive larger than the disk's free space, or of another length than the pinned one, is refused
before writing, and a disk that fills up anyway ends the download at once, its partial file removed.
Bytes received before a stall (``--timeout`` seconds without data) or a cut are kept and the next try
resumes after them; a body sent without a length is complete only when a Range request for what
follows it is answered 416. Extraction goes to a temporary folder renamed into place (macOS
``__MACOSX``/``._*`` metadata left out), and ``DEST/.jaxrat_downloads.json`` records the SHA-256
and top-level folders of each archive extracted, so a rerun skips it while those folders exist.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import http.client
import json
import logging
import os
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
import zipfile

from jaxrat.runtime.errors import DataError, UserError
from jaxrat.runtime.fileio import move_into_place, write_json

_STATE = ".jaxrat_downloads.json"
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Archive:
    """One archive: file name, URL relative to the dataset's base URL, split, and its SHA-256 if
    pinned, and its size in bytes if pinned (None: not pinned here; the ETag MD5 and the zip CRCs
    still check it)."""

    name: str
    split: str
    sha256: str | None = None
    size: int | None = None


@dataclasses.dataclass(frozen=True)
class Dataset:
    base_url: str
    archives: tuple[Archive, ...]


DATASETS = {
    "isic2018": Dataset(
        "https://isic-challenge-data.s3.amazonaws.com/2018/",
        (
            Archive("ISIC2018_Task1-2_Training_Input.zip", "train"),
            Archive("ISIC2018_Task1_Training_GroundTruth.zip", "train"),
            Archive("ISIC2018_Task1-2_Validation_Input.zip", "validation"),
            Archive("ISIC2018_Task1_Validation_GroundTruth.zip", "validation"),
            Archive("ISIC2018_Task1-2_Test_Input.zip", "test"),
            Archive("ISIC2018_Task1_Test_GroundTruth.zip", "test"),
        ),
    ),
    "coco2017": Dataset(
        "http://images.cocodataset.org/",
        (
            Archive("annotations/annotations_trainval2017.zip", "annotations"),
            Archive("zips/train2017.zip", "train"),
            Archive("zips/val2017.zip", "validation"),
        ),
    ),
}


# ----------------------------------------------------------------------------------- fetching

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
    meta = _read_meta(meta_path)
    last_error = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * attempt)
        have = os.path.getsize(part) if os.path.exists(part) else 0
        if have and have == meta.get("size"):  # complete before a kill; a Range request would get 416
            move_into_place(part, path)
            os.remove(meta_path)
            return meta
        headers = {"User-Agent": "jaxrat-download"}
        if have and meta.get("etag"):
            headers.update({"Range": f"bytes={have}-", "If-Range": meta["etag"]})
        try:
            resp = _open(url, headers, timeout)
            _refuse_html(resp, url)
            if resp.status == 206 and not _continues(resp, have, meta.get("etag")):
                # Appending this would splice two versions or misplace bytes: start again.
                logging.warning("%s: the server's partial answer does not continue our file; restarting", url)
                resp.close()
                os.remove(part)
                resp = _open(url, {"User-Agent": "jaxrat-download"}, timeout)
                _refuse_html(resp, url)
            with resp:
                etag = resp.headers.get("ETag")
                if resp.status == 206:
                    total = int(resp.headers["Content-Range"].rsplit("/", 1)[1])
                    mode = "ab"
                    logging.info("resuming %s at %.1f of %.1f MB", url, have / 1e6, total / 1e6)
                else:  # 200: a fresh start (no partial file, no Range support, or the file changed)
                    total = int(resp.headers.get("Content-Length", -1))
                    mode, have = "wb", 0
                if size is not None and total >= 0 and total != size:
                    raise DataError(f"{url} offers {total} bytes but its pinned size is {size}; it is another file: "
                                    f"check --base-url and the --checksums entry.")
                total = size if size is not None and total < 0 else total
                _check_space(part, total - have if total >= 0 else -1, url)
                meta = {"etag": etag, "size": total}
                _write_meta(meta_path, meta)
                with open(part, mode) as out:
                    # read1: whatever has arrived, so a stall or a cut loses nothing already received
                    # (read(n) waits for n bytes and drops them all when the socket times out).
                    for chunk in iter(lambda: resp.read1(_CHUNK), b""):
                        out.write(chunk)
                        have += len(chunk)
            if total >= 0 and have != total:
                raise ConnectionError(f"got {have} of {total} bytes")
            if total < 0:  # no length: a closed connection looks like the end, so ask whether there is more
                _confirm_end(url, have, etag, timeout)
            move_into_place(part, path)
            os.remove(meta_path)
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
    if os.path.exists(part) and os.path.getsize(part):
        fix = f"run the same command again to resume from {part}"
    elif isinstance(last_error, urllib.error.HTTPError):  # the server answered, so not the network
        fix = f"the server failed; run the same command again later or use a mirror with {mirror_flag}"
    else:
        fix = f"check the network connection and {mirror_flag}, then run the same command again"
    raise DataError(f"Download of {url} failed after {retries + 1} attempts ({last_error}); {fix}.")


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
        raise DataError(f"{url} is {need / 1e9:.2f} GB but the disk holding {os.path.dirname(part)} has "
                        f"{free / 1e9:.2f} GB free; free space or choose another --dest.")


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


def _is_junk(member: str) -> bool:
    """macOS Finder metadata that zips made on a Mac carry (``__MACOSX/``, ``._NAME``)."""
    parts = member.replace("\\", "/").split("/")
    return parts[0] == "__MACOSX" or parts[-1].startswith("._") or parts[-1] == ".DS_Store"


def extract(archive: str, dest: str) -> list[str]:
    """Unzip into ``dest`` (through a temporary folder); returns the top-level entries written.
    Members outside ``dest`` are refused; macOS metadata members are left out."""
    # One name per archive, not per process: a rerun after a kill removes what the killed
    # extraction left (possibly gigabytes) instead of leaving it beside the data for good.
    tmp = os.path.join(dest, f".extract-{os.path.basename(archive)}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(archive) as z:
            members = [m for m in z.namelist() if not _is_junk(m)]
            for member in members:
                target = os.path.normpath(os.path.join(tmp, member))
                if not target.startswith(tmp + os.sep) and target != tmp:
                    raise DataError(f"Archive {archive} has an unsafe member path {member!r}; refusing to extract it.")
            os.makedirs(tmp)
            for member in members:
                z.extract(member, tmp)
        entries = sorted(os.listdir(tmp))
        for entry in entries:
            src, dst = os.path.join(tmp, entry), os.path.join(dest, entry)
            if os.path.isdir(src) and os.path.isdir(dst):
                for root, _, files in os.walk(src):  # merge (COCO's annotations folder, reruns)
                    rel = os.path.relpath(root, src)
                    os.makedirs(os.path.join(dst, rel), exist_ok=True)
                    for f in files:
                        # No fsync per file (COCO has 118k): the state file written after them is the commit.
                        move_into_place(os.path.join(root, f), os.path.join(dst, rel, f), sync=False)
            else:
                if os.path.isdir(dst):
                    shutil.rmtree(dst)
                move_into_place(src, dst, sync=False)
        return entries
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------- driver

def _load_state(dest: str) -> dict:
    path = os.path.join(dest, _STATE)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def _extracted(record: str | dict | None, dest: str, pinned: str | None) -> bool:
    """Whether an archive's state ``record`` says it is extracted in ``dest`` and that is still
    true: pinned checksum equal, and the top-level entries it wrote (a folder deleted since
    would otherwise never come back) still there. Old records are the bare SHA-256."""
    if record is None:
        return False
    rec = record if isinstance(record, dict) else {"sha256": record, "entries": []}
    if pinned and rec.get("sha256") != pinned.lower():
        return False
    return all(os.path.exists(os.path.join(dest, e)) for e in rec.get("entries", []))


def _save_state(dest: str, state: dict) -> None:
    write_json(os.path.join(dest, _STATE), state, indent=1, sort_keys=True)


def download(
    dataset: str,
    dest: str,
    *,
    splits: tuple[str, ...] | None = None,
    base_url: str | None = None,
    checksums: dict[str, str | dict] | None = None,
    keep_archives: bool = False,
    retries: int = 5,
    timeout: float = 60.0,
    backoff: float = 1.0,
) -> list[str]:
    """Fetch, verify and extract ``dataset``'s archives (those of ``splits``) into ``dest``;
    returns the names of the archives extracted by this call (already extracted ones are skipped).
    ``checksums``: archive file name -> its SHA-256, or {"sha256": ..., "size": bytes} (either may be left out)."""
    if dataset not in DATASETS:
        raise DataError(f"Unknown dataset {dataset!r}; use one of {sorted(DATASETS)}.")
    spec = DATASETS[dataset]
    known = sorted({a.split for a in spec.archives})
    if splits:
        unknown = set(splits) - set(known)
        if unknown:
            raise DataError(f"Unknown split(s) {sorted(unknown)} for {dataset}; use some of {known}.")
    base = (base_url or spec.base_url).rstrip("/") + "/"
    dest = os.path.abspath(dest)
    downloads = os.path.join(dest, "downloads")
    try:
        os.makedirs(downloads, exist_ok=True)
    except OSError as e:
        raise DataError(f"Cannot create {downloads} ({e.strerror}); choose another --dest.") from None
    state = _load_state(dest)
    done = []
    for arc in spec.archives:
        if splits and arc.split not in splits:
            continue
        fname = os.path.basename(arc.name)
        pin = (checksums or {}).get(fname)
        pin = pin if isinstance(pin, dict) else {"sha256": pin}
        pinned, size = pin.get("sha256") or arc.sha256, pin.get("size") or arc.size
        if _extracted(state.get(fname), dest, pinned):
            logging.info("%s already extracted in %s", fname, dest)
            continue
        path = os.path.join(downloads, fname)
        meta = {"etag": None}
        kept = os.path.exists(path)  # an archive a run before this one fetched (--keep-archives, a kill)
        if not kept:
            logging.info("downloading %s", base + arc.name)
            meta = fetch(base + arc.name, path, retries=retries, timeout=timeout, backoff=backoff, size=size)
        try:
            digest = verify(path, etag=meta.get("etag"), sha256=pinned, size=size)
        except DataError as e:
            if not kept:
                raise
            # verify() deleted it; a kept archive that no longer checks out is fetched again, not trusted.
            logging.warning("%s in %s fails its check (%s); downloading it again", fname, downloads, e)
            meta = fetch(base + arc.name, path, retries=retries, timeout=timeout, backoff=backoff, size=size)
            digest = verify(path, etag=meta.get("etag"), sha256=pinned, size=size)
        entries = extract(path, dest)
        state[fname] = {"sha256": digest, "entries": entries}
        _save_state(dest, state)
        if not keep_archives:
            os.remove(path)
        logging.info("extracted %s (sha256 %s)", fname, digest)
        done.append(fname)
    return done


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; user errors print one sentence and return 2."""
    p = argparse.ArgumentParser(prog="python -m jaxrat.data.download", description=__doc__.split("\n")[0],
                                epilog="A pretrained model from the Hugging Face hub: jaxrat download "
                                       "hf:OWNER/NAME[@REVISION] (its own --help).")
    p.add_argument("dataset", choices=sorted(DATASETS))
    p.add_argument("--dest", required=True, help="folder to extract into (the config's data.data_dir)")
    p.add_argument("--splits", default="", help="comma-separated subset, e.g. train,validation")
    p.add_argument("--base-url", default=None, help="a mirror serving the same file names")
    p.add_argument("--checksums", default=None,
                   help='JSON file {archive file name: sha256 or {"sha256": ..., "size": bytes}} to pin')
    p.add_argument("--keep-archives", action="store_true", help="keep the zips after extraction")
    p.add_argument("--retries", type=int, default=5)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds without data before a retry")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        checksums = None
        if args.checksums:
            try:
                with open(args.checksums) as f:
                    checksums = json.load(f)
                if not isinstance(checksums, dict) or not all(
                        isinstance(v, str) or (isinstance(v, dict) and set(v) <= {"sha256", "size"})
                        for v in checksums.values()):
                    raise ValueError("not an object of names to a sha256 or {sha256, size}")
            except (OSError, ValueError) as e:  # ValueError: not JSON, or not of that shape
                raise DataError(f"Cannot read --checksums {args.checksums} ({e}); "
                                'pass a JSON object name -> sha256 or {"sha256": ..., "size": bytes}.') from None
        splits = tuple(s for s in args.splits.split(",") if s) or None
        done = download(args.dataset, args.dest, splits=splits, base_url=args.base_url, checksums=checksums,
                        keep_archives=args.keep_archives, retries=args.retries, timeout=args.timeout)
        print(f"{args.dataset}: {len(done)} archive(s) extracted into {os.path.abspath(args.dest)}")
        return 0
    except UserError as e:
        print(f"jaxrat: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
