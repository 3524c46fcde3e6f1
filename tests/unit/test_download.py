"""The downloader against a local HTTP server (127.0.0.1 only) serving generated ISIC zips."""

import errno
import hashlib
import http.server
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile

import numpy as np
import pytest
from PIL import Image

from jaxrat.data import download, fetch
from jaxrat.data.sources import isic
from jaxrat.runtime.errors import DataError
from runner import kill_when_ready

MAX_REQUESTS = 60  # the server answers at most this many requests
SERVER_LIFETIME_S = 120  # and shuts itself down after this long


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def _png(arr) -> bytes:
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format="PNG")
    return b.getvalue()


def _jpg(arr) -> bytes:
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format="JPEG")
    return b.getvalue()


def _isic_archives(n=3) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    out = {}
    for split, first in (("train", 0), ("validation", 100), ("test", 200)):
        img_folder, mask_folder = isic.SPLIT_FOLDERS[split]
        imgs = {f"{img_folder}/ATTRIBUTION.txt": b"generated for tests"}
        masks = {}
        for i in range(first, first + n):
            imgs[f"{img_folder}/ISIC_{i:07d}.jpg"] = _jpg(rng.integers(0, 255, (12, 16, 3), dtype=np.uint8))
            masks[f"{mask_folder}/ISIC_{i:07d}_segmentation.png"] = _png(
                (rng.random((12, 16)) > 0.5).astype(np.uint8) * 255)
        names = {"train": "Training", "validation": "Validation", "test": "Test"}[split]
        out[f"ISIC2018_Task1-2_{names}_Input.zip"] = _zip(imgs)
        out[f"ISIC2018_Task1_{names}_GroundTruth.zip"] = _zip(masks)
    return out


class _Server:
    """Serves ``files`` with Range/If-Range and an MD5 ETag; ``cut`` names files whose first
    response is cut off half way (to test resuming); ``etag=False`` sends none."""

    def __init__(self, files, cut=(), etag=True, ranges=True, if_range=True, status=None, content_type=None,
                 stall=(), stall_s=3.0, length=True):
        self.files, self.cut, self.etag, self.length = dict(files), set(cut), etag, length  # length: Content-Length
        self.content_type, self.stall, self.stall_s = content_type, set(stall), stall_s  # stall: half, then silence
        self.ranges, self.if_range, self.status = ranges, if_range, status  # ranges=False: always 200
        self.requests: list[tuple[str, str | None]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.requests.append((self.path, self.headers.get("Range")))
                name = self.path.rsplit("/", 1)[-1]
                if len(outer.requests) > MAX_REQUESTS or name not in outer.files:
                    self.send_error(404)
                    return
                if outer.status:
                    self.send_error(outer.status)
                    return
                data = outer.files[name]
                tag = f'"{hashlib.md5(data).hexdigest()}"'
                start, rng = 0, self.headers.get("Range")
                if_range_ok = not outer.if_range or self.headers.get("If-Range") in (None, tag)
                if rng and outer.ranges and if_range_ok:
                    start = int(rng.split("=")[1].split("-")[0])
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                if outer.length:
                    self.send_header("Content-Length", str(len(data) - start))
                if outer.etag:
                    self.send_header("ETag", tag)
                if outer.content_type:
                    self.send_header("Content-Type", outer.content_type)
                self.end_headers()
                body = data[start:]
                if name in outer.stall:
                    outer.stall.discard(name)
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    time.sleep(outer.stall_s)
                    self.close_connection = True
                    return
                if name in outer.cut:
                    outer.cut.discard(name)
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/2018/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.timer = threading.Timer(SERVER_LIFETIME_S, self.httpd.shutdown)
        self.timer.daemon = True
        self.timer.start()

    def close(self):
        self.timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    servers = []

    def make(files, **kw):
        servers.append(_Server(files, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_download_extracts_the_official_layout_and_skips_when_done(server, tmp_path):
    srv = server(_isic_archives())
    dest = str(tmp_path / "isic")
    done = download.download("isic2018", dest, base_url=srv.url, retries=0, timeout=10)
    assert len(done) == 6
    for split in ("train", "validation", "test"):
        assert len(isic.find_pairs(dest, split)) == 3  # ATTRIBUTION.txt is ignored
    assert not os.listdir(os.path.join(dest, "downloads"))  # archives removed after extraction
    n = len(srv.requests)
    assert download.download("isic2018", dest, base_url=srv.url, retries=0) == []
    assert len(srv.requests) == n  # nothing fetched again


def test_interrupted_download_resumes_with_a_range_request(server, tmp_path):
    files = _isic_archives()
    name = "ISIC2018_Task1-2_Training_Input.zip"
    srv = server(files, cut={name})
    dest = str(tmp_path / "isic")
    download.download("isic2018", dest, splits=("train",), base_url=srv.url, retries=2, timeout=10, backoff=0)
    ranges = [r for p, r in srv.requests if p.endswith(name)]
    assert ranges[0] is None and ranges[1] == f"bytes={len(files[name]) // 2}-"
    assert len(isic.find_pairs(dest, "train")) == 3
    # A partial file left by a killed process is resumed by the next run as well.
    srv2 = server(files, cut=set())
    dest2 = str(tmp_path / "isic2")
    os.makedirs(os.path.join(dest2, "downloads"))
    part = os.path.join(dest2, "downloads", name + ".part")
    open(part, "wb").write(files[name][:1000])
    open(part + ".json", "w").write('{"etag": "\\"%s\\""}' % hashlib.md5(files[name]).hexdigest())
    download.download("isic2018", dest2, splits=("train",), base_url=srv2.url, retries=0, timeout=10)
    assert ("/2018/" + name, "bytes=1000-") in srv2.requests


def test_corrupt_archive_is_detected_and_deleted(server, tmp_path):
    files = _isic_archives()
    name = "ISIC2018_Task1_Training_GroundTruth.zip"
    good = files[name]
    # Same length, one flipped byte inside a member: only a checksum can tell.
    files[name] = good[:200] + bytes([good[200] ^ 0xFF]) + good[201:]
    srv = server(files, etag=False)
    dest = str(tmp_path / "isic")
    with pytest.raises(DataError, match=f"Archive {name} is corrupt.*CRC"):
        download.download("isic2018", dest, splits=("train",), base_url=srv.url, retries=0, timeout=10)
    assert not os.path.exists(os.path.join(dest, "downloads", name))
    # A pinned SHA-256 catches a wrong file even when the zip itself is valid.
    srv2 = server(_isic_archives())
    with pytest.raises(DataError, match="SHA-256"):
        download.download("isic2018", str(tmp_path / "other"), splits=("train",), base_url=srv2.url, retries=0,
                          checksums={"ISIC2018_Task1-2_Training_Input.zip": "0" * 64})


def test_cli_reports_missing_files_in_one_sentence(server, tmp_path):
    srv = server({})
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrat.data.download", "isic2018", "--dest", str(tmp_path / "d"),
         "--base-url", srv.url, "--retries", "0", "--splits", "validation"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "jaxrat: error: Download of" in proc.stderr and "HTTP 404" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unreachable_server_and_a_cut_with_no_retries_left_name_the_fix(server, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DataError, match="check the network connection and --base-url"):
        download.download("isic2018", str(tmp_path / "a"), splits=("train",),
                          base_url=f"http://127.0.0.1:{port}/", retries=1, timeout=5, backoff=0)
    name = "ISIC2018_Task1-2_Training_Input.zip"
    files = _isic_archives()
    srv = server(files, cut={name})
    with pytest.raises(DataError, match=r"run the same command again to resume from .*\.part"):
        download.download("isic2018", str(tmp_path / "b"), splits=("train",), base_url=srv.url, retries=0,
                          timeout=10, backoff=0)
    # ... and the same command then finishes from where it stopped.
    download.download("isic2018", str(tmp_path / "b"), splits=("train",), base_url=srv.url, retries=0, timeout=10)
    assert len(isic.find_pairs(str(tmp_path / "b"), "train")) == 3
    assert [r for p, r in srv.requests if p.endswith(name)][1] == f"bytes={len(files[name]) // 2}-"


TRAIN_INPUT = "ISIC2018_Task1-2_Training_Input.zip"


def _other_isic_train_input(n=3) -> bytes:
    """A different, valid version of the training-input archive (same names, other pixels)."""
    rng = np.random.default_rng(7)
    img_folder = isic.SPLIT_FOLDERS["train"][0]
    return _zip({f"{img_folder}/ISIC_{i:07d}.jpg": _jpg(rng.integers(0, 255, (10, 14, 3), dtype=np.uint8))
                 for i in range(n)})


def _train_image_bytes(dest) -> bytes:
    return open(os.path.join(dest, isic.SPLIT_FOLDERS["train"][0], "ISIC_0000000.jpg"), "rb").read()


def test_server_ignoring_range_restarts_from_zero_without_corrupting(server, tmp_path):
    files = _isic_archives()
    srv = server(files, cut={TRAIN_INPUT}, ranges=False)
    dest = str(tmp_path / "isic")
    download.download("isic2018", dest, splits=("train",), base_url=srv.url, retries=2, timeout=10, backoff=0)
    ranges = [r for p, r in srv.requests if p.endswith(TRAIN_INPUT)]
    assert ranges[1] is not None  # we asked to resume, the server sent everything again
    assert len(isic.find_pairs(dest, "train")) == 3
    with zipfile.ZipFile(io.BytesIO(files[TRAIN_INPUT])) as z:
        assert _train_image_bytes(dest) == z.read(f"{isic.SPLIT_FOLDERS['train'][0]}/ISIC_0000000.jpg")


@pytest.mark.parametrize("if_range", [True, False])
def test_file_changed_between_attempts_restarts_instead_of_splicing(server, tmp_path, if_range):
    files = _isic_archives()
    srv = server(files, cut={TRAIN_INPUT}, if_range=if_range)
    dest = str(tmp_path / "isic")
    with pytest.raises(DataError, match="resume"):
        download.download("isic2018", dest, splits=("train",), base_url=srv.url, retries=0, timeout=10)
    new = _other_isic_train_input()
    srv.files[TRAIN_INPUT] = new  # a new ETag; a server ignoring If-Range would send its tail as 206
    download.download("isic2018", dest, splits=("train",), base_url=srv.url, retries=0, timeout=10)
    with zipfile.ZipFile(io.BytesIO(new)) as z:
        assert _train_image_bytes(dest) == z.read(f"{isic.SPLIT_FOLDERS['train'][0]}/ISIC_0000000.jpg")


def test_partial_state_left_by_a_kill_is_handled(server, tmp_path):
    files = _isic_archives()
    srv = server(files)
    # The small metadata file was being written when the process died: start again, no traceback.
    dest = str(tmp_path / "a")
    os.makedirs(os.path.join(dest, "downloads"))
    part = os.path.join(dest, "downloads", TRAIN_INPUT + ".part")
    open(part, "wb").write(files[TRAIN_INPUT][:100])
    open(part + ".json", "w").close()
    download.download("isic2018", dest, splits=("train",), base_url=srv.url, retries=0, timeout=10)
    assert len(isic.find_pairs(dest, "train")) == 3
    # The whole body had arrived when the process died: used without asking the server again.
    dest = str(tmp_path / "b")
    os.makedirs(os.path.join(dest, "downloads"))
    part = os.path.join(dest, "downloads", TRAIN_INPUT + ".part")
    open(part, "wb").write(files[TRAIN_INPUT])
    tag = '"%s"' % hashlib.md5(files[TRAIN_INPUT]).hexdigest()
    open(part + ".json", "w").write('{"etag": %s, "size": %d}' % (json.dumps(tag), len(files[TRAIN_INPUT])))
    n = len(srv.requests)
    download.download("isic2018", dest, splits=("train",), base_url=srv.url, retries=0, timeout=10)
    assert not [p for p, _ in srv.requests[n:] if p.endswith(TRAIN_INPUT)]
    assert len(isic.find_pairs(dest, "train")) == 3


def test_http_500_is_one_sentence_that_does_not_blame_the_network(server, tmp_path):
    srv = server(_isic_archives(), status=500)
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrat.data.download", "isic2018", "--dest", str(tmp_path / "d"),
         "--base-url", srv.url, "--retries", "1", "--splits", "train"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = [line for line in proc.stderr.splitlines() if line.startswith("jaxrat: error:")]
    assert len(err) == 1 and "HTTP Error 500" in err[0] and "--base-url" in err[0] and "network" not in err[0]


def test_macos_metadata_is_left_out_and_unsafe_members_are_refused(server, tmp_path):
    files = _isic_archives()
    img_folder = isic.SPLIT_FOLDERS["train"][0]
    with zipfile.ZipFile(io.BytesIO(files[TRAIN_INPUT])) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members[f"__MACOSX/{img_folder}/._ISIC_0000000.jpg"] = b"\x00\x05\x16\x07 resource fork"
    members[f"{img_folder}/._ISIC_0000001.jpg"] = b"\x00\x05\x16\x07 resource fork"
    members[f"{img_folder}/.DS_Store"] = b"finder"
    files[TRAIN_INPUT] = _zip(members)
    dest = str(tmp_path / "isic")
    download.download("isic2018", dest, splits=("train",), base_url=server(files).url, retries=0, timeout=10)
    assert not os.path.exists(os.path.join(dest, "__MACOSX"))
    assert sorted(os.listdir(os.path.join(dest, img_folder))) == [
        "ATTRIBUTION.txt", "ISIC_0000000.jpg", "ISIC_0000001.jpg", "ISIC_0000002.jpg"]
    for bad in ("../evil.txt", f"{img_folder}/../../evil.txt", "/tmp/evil.txt"):
        evil = dict(members)
        evil[bad] = b"owned"
        other = dict(_isic_archives())
        other[TRAIN_INPUT] = _zip(evil)
        d = tmp_path / f"bad{len(bad)}"
        with pytest.raises(DataError, match="unsafe member path"):
            download.download("isic2018", str(d / "dest"), splits=("train",), base_url=server(other).url,
                              retries=0, timeout=10)
        assert not (d / "evil.txt").exists() and not (tmp_path / "evil.txt").exists()
        assert not (d / "dest" / img_folder).exists()  # nothing of the refused archive was extracted


KILL_DURING_EXTRACTION = r"""
import sys, time, zipfile
from jaxrat.data import download
ready, n = sys.argv[1], [0]
original = zipfile.ZipFile._extract_member
def stall(self, member, path, pwd):
    n[0] += 1
    if n[0] == 3:  # two members written: tell the test, then wait to be killed
        open(ready, "w").close()
        time.sleep(120)
    return original(self, member, path, pwd)
zipfile.ZipFile._extract_member = stall
sys.exit(download.main(sys.argv[2:]))
"""


def test_kill_during_extraction_leaves_no_half_folder_and_a_rerun_finishes(server, tmp_path):
    srv = server(_isic_archives())
    dest, ready = str(tmp_path / "isic"), str(tmp_path / "ready")
    kill_when_ready([sys.executable, "-c", KILL_DURING_EXTRACTION, ready, "isic2018", "--dest", dest,
                     "--base-url", srv.url, "--splits", "train", "--retries", "0"], ready, "the extraction")
    assert not os.path.exists(os.path.join(dest, isic.SPLIT_FOLDERS["train"][0]))  # nothing half-written
    with pytest.raises(DataError, match="not found"):
        isic.find_pairs(dest, "train")
    download.download("isic2018", dest, splits=("train",), base_url=srv.url, retries=0, timeout=10)
    assert len(isic.find_pairs(dest, "train")) == 3
    assert not [e for e in os.listdir(dest) if e.startswith(".extract")]  # the killed run's leftovers are gone


def test_deleted_folder_is_extracted_again_by_a_rerun(server, tmp_path):
    srv = server(_isic_archives())
    dest = str(tmp_path / "isic")
    download.download("isic2018", dest, splits=("train",), base_url=srv.url, retries=0, timeout=10)
    shutil.rmtree(os.path.join(dest, isic.SPLIT_FOLDERS["train"][1]))  # the masks
    assert download.download("isic2018", dest, splits=("train",), base_url=srv.url, retries=0) == [
        "ISIC2018_Task1_Training_GroundTruth.zip"]
    assert len(isic.find_pairs(dest, "train")) == 3


def test_coco2017_archives_extract_to_the_layout_the_reader_uses(server, tmp_path):
    from jaxrat.data.sources import coco
    from jaxrat.data.synthetic import coco as synthetic_coco

    src = str(tmp_path / "src")
    synthetic_coco.write_coco(src, num_train=3, num_val=2, image_size=32)

    def zip_folder(folder):
        out = {}
        for root, _, names in os.walk(os.path.join(src, folder)):
            for n in names:
                p = os.path.join(root, n)
                out[os.path.relpath(p, src)] = open(p, "rb").read()
        return _zip(out)

    files = {"annotations_trainval2017.zip": zip_folder("annotations"), "train2017.zip": zip_folder("train2017"),
             "val2017.zip": zip_folder("val2017")}
    srv = server(files)
    base = srv.url.rsplit("/2018/", 1)[0] + "/"
    # The official archives' sizes and hashes are known (the next test): these stand-ins pin their own.
    ours = {name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)} for name, data in files.items()}
    dest = str(tmp_path / "coco")
    done = download.download("coco2017", dest, base_url=base, retries=0, timeout=10, checksums=ours)
    assert sorted(done) == sorted(files)
    assert sorted(p for p, _ in srv.requests) == ["/annotations/annotations_trainval2017.zip",
                                                   "/zips/train2017.zip", "/zips/val2017.zip"]
    assert len(coco.CocoDetection(dest, "validation").records) == 2
    assert len(coco.CocoDetection(dest, "train").records) == 3


def test_an_archive_of_another_size_than_the_official_one_is_refused_before_writing(server, tmp_path):
    # COCO 2017's sizes and SHA-256 are in the registry: a mirror serving other bytes under these
    # names is refused on the first answer's length, without retrying and with nothing saved.
    srv = server({"annotations_trainval2017.zip": _zip({"annotations/instances_val2017.json": b"{}"})})
    base = srv.url.rsplit("/2018/", 1)[0] + "/"
    with pytest.raises(DataError, match=r"annotations_trainval2017.zip offers \d+ bytes but its pinned size is "
                                        r"252907541; it is another file"):
        download.download("coco2017", str(tmp_path / "coco"), base_url=base, retries=2, timeout=10, backoff=0)
    assert len(srv.requests) == 1 and os.listdir(tmp_path / "coco" / "downloads") == []
    assert download.DATASETS["coco2017"].archives[2].sha256 == (
        "4f7e2ccb2866ec5041993c9cf2a952bbed69647b115d0f74da7ce8f4bef82f05")  # val2017.zip, as TFDS records it


LOGIN_PAGE = b"<!DOCTYPE html><html><body><form action=/login>Sign in to download</form></body></html>"


def test_a_200_html_login_page_is_refused_before_it_is_saved(server, tmp_path):
    files = _isic_archives()
    files[TRAIN_INPUT] = LOGIN_PAGE
    srv = server(files, content_type="text/html; charset=utf-8")
    dest = tmp_path / "isic"
    with pytest.raises(DataError, match=r"answered with an HTML page \(text/html\), not the file: a login or error "
                                        r"page; check the URL or --base-url"):
        download.download("isic2018", str(dest), splits=("train",), base_url=srv.url, retries=2, timeout=10,
                          backoff=0)
    assert len([p for p, _ in srv.requests if p.endswith(TRAIN_INPUT)]) == 1  # not retried
    assert not [f for f in os.listdir(dest / "downloads") if f.startswith(TRAIN_INPUT)]  # nothing saved


def test_a_stall_keeps_the_bytes_received_and_resumes_after_the_timeout(server, tmp_path):
    # The server goes silent for 30 s half way; --timeout 1 gives up on it after a second (the
    # default would wait 60 s per try) and the next try asks only for what is missing.
    files = _isic_archives()
    srv = server(files, stall={TRAIN_INPUT}, stall_s=30.0)
    dest = str(tmp_path / "isic")
    start = time.monotonic()
    assert download.main(["isic2018", "--dest", dest, "--splits", "train", "--base-url", srv.url, "--retries", "2",
                          "--timeout", "1"]) == 0
    assert time.monotonic() - start < 20
    ranges = [r for p, r in srv.requests if p.endswith(TRAIN_INPUT)]
    assert ranges == [None, f"bytes={len(files[TRAIN_INPUT]) // 2}-"]  # the first half was kept
    assert len(isic.find_pairs(dest, "train")) == 3


def test_too_little_space_is_refused_before_writing_and_a_full_disk_is_not_retried(server, tmp_path, monkeypatch):
    from collections import namedtuple

    files = _isic_archives()
    srv = server(files)
    usage = namedtuple("usage", "total used free")
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 100, 100))
    dest = tmp_path / "a"
    with pytest.raises(DataError, match=r"is 0.0 MB but the disk holding .* has 0.0 MB free; free space or choose "
                                        r"another --dest"):
        download.download("isic2018", str(dest), splits=("train",), base_url=srv.url, retries=3, timeout=10,
                          backoff=0)
    assert len(srv.requests) == 1 and os.listdir(dest / "downloads") == []
    monkeypatch.setattr(shutil, "disk_usage", real_usage)
    real_open = open

    class Full:  # a disk that fills up after 1000 bytes of the archive
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    def fake_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return Full(f) if str(path).endswith(".part") and "b" in mode else f

    monkeypatch.setattr(fetch, "open", fake_open, raising=False)  # the .part file is written by data.fetch
    dest = tmp_path / "b"
    n = len(srv.requests)
    with pytest.raises(DataError, match=r"The disk holding .* is full \(No space left on device\) while downloading "
                                        r".*; the partial file was removed"):
        download.download("isic2018", str(dest), splits=("train",), base_url=srv.url, retries=3, timeout=10,
                          backoff=0)
    assert len(srv.requests) == n + 1 and os.listdir(dest / "downloads") == []


def test_a_kept_archive_that_fails_its_check_is_fetched_again(server, tmp_path):
    files = _isic_archives()
    srv = server(files)
    dest = tmp_path / "isic"
    (dest / "downloads").mkdir(parents=True)
    (dest / "downloads" / TRAIN_INPUT).write_bytes(files[TRAIN_INPUT][:-100])  # cut short by an earlier run
    download.download("isic2018", str(dest), splits=("train",), base_url=srv.url, retries=0, timeout=10)
    assert [p for p, _ in srv.requests if p.endswith(TRAIN_INPUT)] == ["/2018/" + TRAIN_INPUT]
    assert len(isic.find_pairs(str(dest), "train")) == 3


def test_a_body_without_a_length_cut_short_is_completed_not_accepted(server, tmp_path):
    files = _isic_archives()
    srv = server(files, cut={TRAIN_INPUT}, length=False)  # HTTP/1.0, no Content-Length: a cut looks like the end
    dest = str(tmp_path / "isic")
    download.download("isic2018", dest, splits=("train",), base_url=srv.url, retries=2, timeout=10, backoff=0)
    half = f"bytes={len(files[TRAIN_INPUT]) // 2}-"
    assert [r for p, r in srv.requests if p.endswith(TRAIN_INPUT)] == [None, half, half]  # asked, then resumed
    with zipfile.ZipFile(io.BytesIO(files[TRAIN_INPUT])) as z:
        assert _train_image_bytes(dest) == z.read(f"{isic.SPLIT_FOLDERS['train'][0]}/ISIC_0000000.jpg")
    # A whole body without a length: one more request, answered 416, confirms the end.
    srv2 = server(files, length=False)
    download.download("isic2018", str(tmp_path / "b"), splits=("train",), base_url=srv2.url, retries=0, timeout=10)
    assert [r for p, r in srv2.requests if p.endswith(TRAIN_INPUT)] == [None, f"bytes={len(files[TRAIN_INPUT])}-"]


def test_a_pinned_size_refuses_another_file_before_writing_and_checks_a_kept_one(server, tmp_path, capsys):
    files = _isic_archives()
    srv = server(files)
    good = {"sha256": hashlib.sha256(files[TRAIN_INPUT]).hexdigest(), "size": len(files[TRAIN_INPUT])}
    dest = tmp_path / "a"
    with pytest.raises(DataError, match=rf"offers {good['size']} bytes but its pinned size is {good['size'] + 1}"):
        download.download("isic2018", str(dest), splits=("train",), base_url=srv.url, retries=2, timeout=10,
                          backoff=0, checksums={TRAIN_INPUT: {"size": good["size"] + 1}})
    assert len([p for p, _ in srv.requests if p.endswith(TRAIN_INPUT)]) == 1
    assert not [f for f in os.listdir(dest / "downloads") if f.startswith(TRAIN_INPUT)]
    download.download("isic2018", str(dest), splits=("train",), base_url=srv.url, retries=0, timeout=10,
                      checksums={TRAIN_INPUT: good})
    assert len(isic.find_pairs(str(dest), "train")) == 3
    (tmp_path / "sums.json").write_text('{"x": [1]}')
    assert download.main(["isic2018", "--dest", str(tmp_path / "c"), "--checksums", str(tmp_path / "sums.json")]) == 2
    assert "pass a JSON object name -> sha256 or" in capsys.readouterr().err
