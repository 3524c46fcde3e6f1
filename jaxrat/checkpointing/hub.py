"""Pretrained model folders from the Hugging Face hub, through ``huggingface_hub`` (``pip install 'jaxrat[hub]'``).

    --config.model.pretrained=hf:timm/vit_base_patch16_224.augreg2_in21k_ft_in1k[@REVISION]
    jaxrat download hf:microsoft/beit-base-patch16-224[@REVISION] [--dest CACHE] [--timeout S]

Files land in (or are reused from) the standard Hugging Face cache (``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``; ``--dest`` names another), one snapshot folder per
commit, so two revisions never share a file. Only ``config.json`` and one set of weights are fetched:
``model.safetensors`` (or its shards) when the repository has it (tensors only), else
``pytorch_model.bin`` (read later only with ``torch.load(weights_only=True)``). ``HF_TOKEN`` is sent for
gated and private repositories, ``HF_ENDPOINT`` names a mirror, ``HF_HUB_OFFLINE=1`` uses the cache
alone; all three are read when the download starts.

Every file is checked after the download and again each time it is taken from the cache: its size
and SHA-256 against the hub's (``X-Linked-Size``/``X-Linked-Etag``, the repository listing's LFS
entry), its git object id for files kept in git, and that it is not an HTML page (a login or error
page served with status 200). A file that fails is deleted and fetched once more; a second failure,
like every other problem (offline and not cached, 401 gated, 404, a cut connection, a full disk), ends
in one sentence. Before a byte is written, the files' sizes (the listing's, else each file's
``X-Linked-Size``/``Content-Length``) are checked against the cache disk's free space. A failed first
download leaves no empty folders in the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import sys
from typing import Any, Iterator

from jaxrat.checkpointing.hub_checks import listed_checks, problem
from jaxrat.runtime.errors import DataError, UserError

PREFIX = "hf:"
# In order of preference: tensors-only formats first, so a repository holding both is never unpickled.
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
           "pytorch_model.bin.index.json", "open_clip_pytorch_model.bin")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_RESUME_CHUNK = 1 << 20  # bytes: what a cut connection may cost at most
# Where the user names the hub: the variable every command reads, and jaxrat download's own option.
MIRROR = "HF_ENDPOINT (jaxrat download: --endpoint)"


# ------------------------------------------------------------------------------------ naming

def is_hub(value: str) -> bool:
    """Whether a ``pretrained`` value names a hub repository (``hf:OWNER/NAME[@REV]``)."""
    return str(value).startswith(PREFIX)


def parse(spec: str, revision: str | None = None) -> tuple[str, str]:
    """``(repo_id, revision)`` of ``hf:OWNER/NAME[@REV]`` (the ``hf:`` optional); ``revision``
    fills in when the spec names none, else ``main``."""
    body = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    repo_id, at, rev = body.partition("@")
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id or (at and not rev):
        raise UserError(f"{spec!r} is not a hub model; write hf:OWNER/NAME or hf:OWNER/NAME@REVISION, e.g. "
                        f"hf:timm/vit_base_patch16_224.augreg2_in21k_ft_in1k.")
    if rev and revision and rev != revision:
        raise UserError(f"{spec!r} names revision {rev} but --revision says {revision}; give one of them.")
    return repo_id, rev or revision or "main"


def _cache_dir(cache_dir: str | None) -> str:
    """The hub cache, read from the environment now (not when huggingface_hub was imported)."""
    if cache_dir:
        return os.path.abspath(os.path.expanduser(cache_dir))
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return os.path.abspath(os.path.join(os.path.expanduser(home), "hub"))


def _offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").strip().upper() in (
        "1", "ON", "YES", "TRUE")


def _import_hub():
    try:
        import huggingface_hub
        import huggingface_hub.errors  # noqa: F401  (a submodule: hfh.errors only once imported)
    except ImportError:
        raise UserError("hf: models are downloaded with huggingface_hub; install it with pip install "
                        "'jaxrat[hub]', or point pretrained at a downloaded folder.") from None
    return huggingface_hub


@dataclasses.dataclass
class _Where:
    repo_id: str
    revision: str
    cache: str
    endpoint: str

    @property
    def storage(self) -> str:
        return os.path.join(self.cache, "models--" + self.repo_id.replace("/", "--"))

    @property
    def name(self) -> str:
        return f"{self.repo_id}@{self.revision}"


def _remove(path: str) -> None:
    """Delete a cached file: its blob and the snapshot's link to it."""
    blob = os.path.realpath(path)
    for p in {blob, path}:
        with contextlib.suppress(OSError):  # gone already, or a read-only cache (the next download says so)
            os.remove(p)


# ------------------------------------------------------------------------------------ errors

@contextlib.contextmanager
def _explained(hfh: Any, where: _Where, filename: str | None = None) -> Iterator[None]:
    """Turn what huggingface_hub raises into one sentence naming the problem and the fix."""
    e_ = hfh.errors
    what = f"{where.name}" + (f" file {filename}" if filename else "")
    try:
        yield
    except e_.GatedRepoError as e:
        sent = "the token in HF_TOKEN has no access to it" if os.environ.get("HF_TOKEN") else "no token was sent"
        raise DataError(f"{where.repo_id} is a gated repository on {where.endpoint} and {sent} (HTTP "
                        f"{_status(e)}); accept its terms on the hub and set HF_TOKEN to a token of the account that "
                        f"did.") from None
    except e_.RepositoryNotFoundError as e:
        raise DataError(f"{where.repo_id} is not on {where.endpoint} or is private (HTTP {_status(e)}); check the "
                        f"repository id, or set HF_TOKEN for a private repository.") from None
    except e_.RevisionNotFoundError:
        raise DataError(f"{where.repo_id} has no revision {where.revision} on {where.endpoint} (HTTP 404); give a "
                        f"branch, tag or commit it has (hf:{where.repo_id}@REVISION).") from None
    except e_.RemoteEntryNotFoundError:
        raise DataError(f"{what} is not on {where.endpoint} (HTTP 404); the repository changed while it was "
                        f"downloaded, run the same command again.") from None
    except (e_.LocalEntryNotFoundError, e_.OfflineModeIsEnabled, e_.FileMetadataError) as e:
        cause = e.__cause__ or e
        raise DataError(f"Cannot download {what} from {where.endpoint} ({_short(cause)}) and it is not in the "
                        f"cache {where.cache}; check the network and {MIRROR}.") from None
    except e_.HfHubHTTPError as e:
        raise DataError(f"{where.endpoint} answered HTTP {_status(e)} for {what}; check {MIRROR} and HF_TOKEN, "
                        f"or run the same command again later.") from None
    except e_.HTTPError as e:  # the transport: refused, timed out, cut
        raise DataError(f"Download of {what} from {where.endpoint} failed ({_short(e)}); check the network and "
                        f"{MIRROR}, raise --timeout for a slow link, and run the same command again.") from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(f"The disk holding {where.cache} is full ({e.strerror}) while downloading {what}; free "
                            f"space or set HF_HUB_CACHE (or --dest) to a larger disk.") from None
        if "Consistency check failed" in str(e):
            raise DataError(f"Download of {what} ended short of its size ({_short(e)}); the connection was cut, "
                            f"run the same command again.") from None
        raise DataError(f"Cannot write {what} into {where.cache} ({_short(e)}); set HF_HUB_CACHE (or --dest) to "
                        f"a writable folder.") from None


def _status(e: Any) -> Any:
    return getattr(getattr(e, "response", None), "status_code", "?")


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


@contextlib.contextmanager
def _transfer(timeout: float | None) -> Iterator[None]:
    """huggingface_hub reads its read timeout and chunk size from module constants (the timeout from
    ``HF_HUB_DOWNLOAD_TIMEOUT`` at import). After a cut or a stall it resumes from the last whole chunk
    it wrote, so a smaller chunk than its 10 MB keeps more of what arrived."""
    import huggingface_hub.constants as c  # a submodule: not an attribute until imported
    old = c.HF_HUB_DOWNLOAD_TIMEOUT, c.DOWNLOAD_CHUNK_SIZE
    c.HF_HUB_DOWNLOAD_TIMEOUT = timeout or c.HF_HUB_DOWNLOAD_TIMEOUT
    c.DOWNLOAD_CHUNK_SIZE = min(c.DOWNLOAD_CHUNK_SIZE, _RESUME_CHUNK)
    try:
        yield
    finally:
        c.HF_HUB_DOWNLOAD_TIMEOUT, c.DOWNLOAD_CHUNK_SIZE = old


def _tidy(where: _Where, storage_existed: bool, cache_existed: bool) -> None:
    """After a failure: drop the empty folders this call made in the cache (a new repository's
    folder entirely when it holds no file bytes), never anything that holds data."""
    storage = where.storage
    if os.path.isdir(storage):
        blobs = os.path.join(storage, "blobs")
        has_bytes = os.path.isdir(blobs) and any(os.path.getsize(os.path.join(blobs, b)) for b in os.listdir(blobs))
        if not storage_existed and not has_bytes:
            shutil.rmtree(storage, ignore_errors=True)
        else:
            for root, _, _ in sorted(os.walk(storage), key=lambda t: -len(t[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(root)  # only empty folders go
    locks = os.path.join(where.cache, ".locks", os.path.basename(storage))
    if not os.path.isdir(storage):
        shutil.rmtree(locks, ignore_errors=True)
    if not cache_existed and os.path.isdir(where.cache):
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(where.cache, ".locks"))  # only when empty
        if set(os.listdir(where.cache)) <= {"CACHEDIR.TAG"}:
            shutil.rmtree(where.cache, ignore_errors=True)


# ------------------------------------------------------------------------------------ fetching

def _index_shards(path: str) -> list[str]:
    try:
        with open(path) as f:
            return sorted(set(json.load(f).get("weight_map", {}).values()))
    except (OSError, ValueError, AttributeError) as e:
        raise DataError(f"{path} is not a readable shard index ({e}); run the same command again.") from None


_OFFLINE = "HF_HUB_OFFLINE is set"


def _from_cache(where: _Where, reason: str) -> str:
    """The snapshot folder of ``where`` already in the cache, checked; ``reason`` says why the hub is not asked."""
    commit = where.revision if _COMMIT.fullmatch(where.revision) else None
    ref = os.path.join(where.storage, "refs", where.revision)
    if commit is None and os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    folder = os.path.join(where.storage, "snapshots", commit) if commit else ""
    weights = next((n for n in WEIGHTS if folder and os.path.isfile(os.path.join(folder, n))), None)
    if weights is None:
        fix = "unset HF_HUB_OFFLINE" if reason == _OFFLINE else f"check the network and {MIRROR}"
        raise DataError(f"{reason} and {where.name} is not in the Hugging Face cache {where.cache}; download it "
                        f"once with network (jaxrat download hf:{where.name}), or {fix}.")
    names = ["config.json"] if os.path.isfile(os.path.join(folder, "config.json")) else []
    names.append(weights)
    if weights.endswith(".index.json"):
        names += _index_shards(os.path.join(folder, weights))
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise DataError(f"{where.name} is only partly in the cache {where.cache} ({name} is missing) and "
                            f"{reason}; download it again with network.")
        bad = problem(path)
        if bad:
            _remove(path)
            raise DataError(f"The cached {where.name} file {name} is damaged ({bad}) and {reason}; it was removed, "
                            f"download it again with network.")
    logging.info("%s: commit %s from the cache %s (%s)", where.name, commit, where.cache, reason)
    return folder


def _fetch_one(hfh: Any, where: _Where, commit: str, name: str, expected: dict, timeout: float | None) -> str:
    """Download (or reuse) one file of the snapshot, check it, and fetch it once more if it fails."""
    for attempt in range(2):
        with _explained(hfh, where, name):
            path = hfh.hf_hub_download(where.repo_id, name, revision=commit, cache_dir=where.cache,
                                       endpoint=where.endpoint, force_download=attempt > 0,
                                       etag_timeout=timeout or 10.0)
        bad = problem(path, **expected)
        if bad is None:
            return path
        _remove(path)
        if attempt == 0:
            logging.warning("%s: %s failed its check (%s); fetching it again", where.name, name, bad)
    raise DataError(f"{where.endpoint} sent {where.name} file {name} twice and both times {bad}; it was deleted: "
                    f"check {MIRROR} (a proxy or login page in the way?) and HF_TOKEN.")


def _size(hfh: Any, where: _Where, commit: str, name: str, siblings: dict, timeout: float | None) -> int:
    """Bytes ``name`` will take: the listing's size, else (a mirror's or an older hub's listing gives
    none) the file's own headers, X-Linked-Size or Content-Length, from a HEAD request; 0 if unknown."""
    listed = listed_checks(siblings.get(name)).get("size")
    if listed is not None:
        return int(listed)
    url = hfh.hf_hub_url(where.repo_id, name, revision=commit, endpoint=where.endpoint)
    with _explained(hfh, where, name):
        return int(hfh.get_hf_file_metadata(url, timeout=timeout or 10.0).size or 0)


def _check_space(hfh: Any, where: _Where, commit: str, names: list[str], siblings: dict,
                 timeout: float | None) -> None:
    """Refuse before a byte is written when the files not yet in the cache do not fit on its disk
    (huggingface_hub only warns, then fills the disk)."""
    folder = os.path.join(where.storage, "snapshots", commit)
    need = sum(_size(hfh, where, commit, n, siblings, timeout) for n in names
               if not os.path.isfile(os.path.join(folder, n)))
    probe = where.cache
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if need > free:
        raise DataError(f"{where.name} needs {need / 1e6:.1f} MB but the disk holding {where.cache} has "
                        f"{free / 1e6:.1f} MB free; free space or set HF_HUB_CACHE (or --dest) to a larger disk.")


def _fetch(hfh: Any, where: _Where, timeout: float | None) -> str:
    api = hfh.HfApi(endpoint=where.endpoint)
    info = unreachable = None
    with _explained(hfh, where):
        try:
            info = api.model_info(where.repo_id, revision=where.revision, files_metadata=True,
                                  timeout=timeout or 10.0)
        except hfh.errors.HfHubHTTPError:
            raise  # the hub answered (401, 404): the cache must not hide that
        except (hfh.errors.HTTPError, hfh.errors.OfflineModeIsEnabled) as e:
            unreachable = e
    if info is None:  # as huggingface_hub does: without a network, what the cache holds
        return _from_cache(where, f"{where.endpoint} cannot be reached ({_short(unreachable)})")
    commit = info.sha
    siblings = {s.rfilename: s for s in info.siblings or []}
    weights = next((n for n in WEIGHTS if n in siblings), None)
    if weights is None:
        raise DataError(f"{where.name} has none of {', '.join(WEIGHTS)} on {where.endpoint}; check the repository "
                        f"id, or download its weights yourself and point pretrained at them.")
    names = (["config.json"] if "config.json" in siblings else []) + [weights]
    if weights.endswith(".index.json"):  # the index first: it names the shards to fetch
        _check_space(hfh, where, commit, names, siblings, timeout)
        index = _fetch_one(hfh, where, commit, weights, listed_checks(siblings.get(weights)), timeout)
        missing = [s for s in _index_shards(index) if s not in siblings]
        if missing:
            raise DataError(f"{where.name}: {weights} names {missing[0]}, which the repository lacks; the upload "
                            f"is incomplete, pick another revision.")
        names += _index_shards(index)
    _check_space(hfh, where, commit, names, siblings, timeout)
    for name in names:
        _fetch_one(hfh, where, commit, name, listed_checks(siblings.get(name)), timeout)
    if where.revision != commit:  # so that HF_HUB_OFFLINE finds this revision by its name later
        ref = os.path.join(where.storage, "refs", where.revision)
        tmp = f"{ref}.{os.getpid()}.tmp"  # every host of a job may write it into one shared cache
        try:
            os.makedirs(os.path.dirname(ref), exist_ok=True)
            with open(tmp, "w") as f:
                f.write(commit)
            os.replace(tmp, ref)
        except OSError as e:  # a read-only shared cache that already holds the files: fine, as for the library
            logging.info("%s: could not record %s -> %s in the cache (%s)", where.name, where.revision, commit, e)
    logging.info("%s: commit %s in %s", where.name, commit, where.cache)
    return os.path.join(where.storage, "snapshots", commit)


def download_model(repo_id: str, *, revision: str = "main", cache_dir: str | None = None,
                   endpoint: str | None = None, timeout: float | None = None) -> str:
    """Fetch (or find in the cache) ``config.json`` and the weights of ``repo_id`` at ``revision``,
    checked; returns the snapshot folder, which :func:`jaxrat.models.backbones.weights.read_weights` reads.

    ``cache_dir``: default the Hugging Face cache; ``endpoint``: default ``$HF_ENDPOINT`` or
    huggingface.co; ``timeout``: seconds without data before a read is retried (default the library's)."""
    repo_id, revision = parse(repo_id, revision)
    hfh = _import_hub()
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    where = _Where(repo_id, revision, _cache_dir(cache_dir), endpoint)
    cache_existed, storage_existed = os.path.isdir(where.cache), os.path.isdir(where.storage)
    try:
        if _offline():
            return _from_cache(where, _OFFLINE)
        with _transfer(timeout):
            return _fetch(hfh, where, timeout)
    except BaseException:
        _tidy(where, storage_existed, cache_existed)
        raise


# Hub values this process resolved, by value and the settings that choose the copy: {key: snapshot folder}.
_RESOLVED: dict[tuple[str, ...], str] = {}


def resolve_pretrained(value: str) -> str:
    """A ``config.model.pretrained`` value as a local path: ``hf:OWNER/NAME[@REV]`` downloaded (or
    found in the cache), anything else unchanged. Resolved once per process: building the model,
    loading its weights and the task's other reads take the same commit (a branch that moves between
    them cannot give one commit's architecture and another's weights), and the hub is asked once."""
    if not is_hub(value):
        return value
    repo_id, revision = parse(value)
    key = (repo_id, revision, os.environ.get("HF_ENDPOINT", ""), _cache_dir(None), str(_offline()))
    folder = _RESOLVED.get(key)
    if folder is None or not os.path.isdir(folder):
        folder = _RESOLVED[key] = download_model(repo_id, revision=revision)
    return folder


def main(argv: list[str] | None = None) -> int:
    """``jaxrat download hf:OWNER/NAME[@REV]`` (also ``python -m jaxrat.checkpointing.hub``); user errors print one
    sentence and return 2."""
    p = argparse.ArgumentParser(prog="jaxrat download", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="hf:OWNER/NAME[@REVISION] (the hf: may be left out here)")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default main)")
    p.add_argument("--dest", default=None, help="the cache folder (default the Hugging Face cache: HF_HUB_CACHE)")
    p.add_argument("--endpoint", default=None, help="hub URL (default $HF_ENDPOINT or https://huggingface.co)")
    p.add_argument("--timeout", type=float, default=None, help="seconds without data before a read is retried")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "httpx2"):  # huggingface_hub's HTTP client logs every request at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        repo_id, revision = parse(a.model, a.revision)
        folder = download_model(repo_id, revision=revision, cache_dir=a.dest, endpoint=a.endpoint,
                                timeout=a.timeout)
    except UserError as e:
        print(f"jaxrat: error: {e}", file=sys.stderr)
        return 2
    print(f"--config.model.pretrained={folder}" if a.dest else f"--config.model.pretrained=hf:{repo_id}@{revision}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
