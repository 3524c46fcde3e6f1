"""The downloader against a local HTTP server (127.0.0.1 only) serving generated ISIC zips."""

import hashlib
import http.server
import io
import os
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest
from PIL import Image

from jaxrat.data import download, isic
from jaxrat.errors import DataError

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

    def __init__(self, files, cut=(), etag=True):
        self.files, self.cut, self.etag = dict(files), set(cut), etag
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
                data = outer.files[name]
                tag = f'"{hashlib.md5(data).hexdigest()}"'
                start, rng = 0, self.headers.get("Range")
                if rng and (self.headers.get("If-Range") in (None, tag)):
                    start = int(rng.split("=")[1].split("-")[0])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                if outer.etag:
                    self.send_header("ETag", tag)
                self.end_headers()
                body = data[start:]
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
