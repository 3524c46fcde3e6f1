"""Download and extract official dataset archives: resumable, verified, into the official layout.

    python -m jaxrat.data.download isic2018 --dest DIR [--splits train,validation,test]
    python -m jaxrat.data.download coco2017 --dest DIR

Each archive is fetched to ``DEST/downloads/NAME.part`` and resumed with an HTTP ``Range``
request after an interruption (``If-Range`` on the ETag, so a changed file restarts from zero).
Before extraction it is checked: the byte count against ``Content-Length``; its MD5 against the
ETag when the server's ETag is a plain MD5 (S3 and most static servers for single-part
uploads); its SHA-256 and size against the values known for it (the registry below pins COCO
2017's; ISIC 2018's official values could not be read from this project's machines) or pinned with
``--checksums FILE`` (a value given there takes precedence); and every zip member's CRC. An
archive kept from an earlier run that fails these checks is fetched again. A ``text/html`` answer
(a login or error page sent with status 200) is refused before a byte is saved; an archive larger
than the disk's free space, or of another length than the pinned one, is refused before writing,
and a disk that fills up anyway ends the download at once, its partial file removed.
Bytes received before a stall (``--timeout`` seconds without data) or a cut are kept and the next try
resumes after them; a body sent without a length is complete only when a Range request for what
follows it is answered 416. Extraction goes to a temporary folder renamed into place (macOS
``__MACOSX``/``._*`` metadata left out), and ``DEST/.jaxrat_downloads.json`` records the SHA-256
and top-level folders of each archive extracted, so a rerun skips it while those folders exist.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import zipfile

from jaxrat.data.fetch import fetch, verify
from jaxrat.runtime.errors import DataError, UserError
from jaxrat.runtime.fileio import move_into_place, write_json

_STATE = ".jaxrat_downloads.json"


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
            # Sizes and SHA-256 as TensorFlow Datasets records them for these URLs
            # (tensorflow_datasets/url_checksums/coco.txt): a mirror (--base-url) serving other
            # bytes under these names is refused before a byte is written (size) or after (hash).
            Archive("annotations/annotations_trainval2017.zip", "annotations",
                    "113a836d90195ee1f884e704da6304dfaaecff1f023f49b6ca93c4aaae470268", 252_907_541),
            Archive("zips/train2017.zip", "train",
                    "69a8bb58ea5f8f99d24875f21416de2e9ded3178e903f1f7603e283b9e06d929", 19_336_861_798),
            Archive("zips/val2017.zip", "validation",
                    "4f7e2ccb2866ec5041993c9cf2a952bbed69647b115d0f74da7ce8f4bef82f05", 815_585_330),
        ),
    ),
}


# ----------------------------------------------------------------------------------- fetching

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


def _selected_archives(dataset: str, splits: tuple[str, ...] | None) -> tuple[Dataset, list[Archive]]:
    """``dataset``'s registry entry and its archives of ``splits`` (all when None); unknown names refused."""
    if dataset not in DATASETS:
        raise DataError(f"Unknown dataset {dataset!r}; use one of {sorted(DATASETS)}.")
    spec = DATASETS[dataset]
    known = sorted({a.split for a in spec.archives})
    if splits:
        unknown = set(splits) - set(known)
        if unknown:
            raise DataError(f"Unknown split(s) {sorted(unknown)} for {dataset}; use some of {known}.")
    return spec, [a for a in spec.archives if not splits or a.split in splits]


def _pinned(arc: Archive, checksums: dict[str, str | dict] | None) -> tuple[str | None, int | None]:
    """The (SHA-256, size) an archive must have: ``checksums``' values, else the registry's."""
    pin = (checksums or {}).get(os.path.basename(arc.name))
    pin = pin if isinstance(pin, dict) else {"sha256": pin}
    return pin.get("sha256") or arc.sha256, pin.get("size") or arc.size


def _fetch_verified(url: str, path: str, *, sha256: str | None, size: int | None, retries: int, timeout: float,
                    backoff: float) -> str:
    """Fetch ``url`` to ``path`` unless an earlier run left it there, verify it, and return its SHA-256."""
    meta = {"etag": None}
    kept = os.path.exists(path)  # an archive a run before this one fetched (--keep-archives, a kill)
    if not kept:
        logging.info("downloading %s", url)
        meta = fetch(url, path, retries=retries, timeout=timeout, backoff=backoff, size=size)
    try:
        return verify(path, etag=meta.get("etag"), sha256=sha256, size=size)
    except DataError as e:
        if not kept:
            raise
        # verify() deleted it; a kept archive that no longer checks out is fetched again, not trusted.
        logging.warning("%s in %s fails its check (%s); downloading it again", os.path.basename(path),
                        os.path.dirname(path), e)
        meta = fetch(url, path, retries=retries, timeout=timeout, backoff=backoff, size=size)
        return verify(path, etag=meta.get("etag"), sha256=sha256, size=size)


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
    spec, archives = _selected_archives(dataset, splits)
    base = (base_url or spec.base_url).rstrip("/") + "/"
    dest = os.path.abspath(dest)
    downloads = os.path.join(dest, "downloads")
    try:
        os.makedirs(downloads, exist_ok=True)
    except OSError as e:
        raise DataError(f"Cannot create {downloads} ({e.strerror}); choose another --dest.") from None
    state = _load_state(dest)
    done = []
    for arc in archives:
        fname = os.path.basename(arc.name)
        pinned, size = _pinned(arc, checksums)
        if _extracted(state.get(fname), dest, pinned):
            logging.info("%s already extracted in %s", fname, dest)
            continue
        path = os.path.join(downloads, fname)
        digest = _fetch_verified(base + arc.name, path, sha256=pinned, size=size, retries=retries, timeout=timeout,
                                 backoff=backoff)
        state[fname] = {"sha256": digest, "entries": extract(path, dest)}
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
