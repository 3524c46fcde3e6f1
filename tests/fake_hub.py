"""A Hugging Face hub on 127.0.0.1 for tests: the few HTTP endpoints ``huggingface_hub`` calls to
download a model, answered the way huggingface.co answers them, with faults to order.

    GET  /api/models/{owner}/{name}/revision/{rev}?blobs=true   repository info: commit, files, sizes,
                                                                 LFS sha256 (HfApi.model_info)
    HEAD /{owner}/{name}/resolve/{rev}/{file}                   metadata: X-Repo-Commit, ETag (git blob
                                                                 sha1), X-Linked-Etag / X-Linked-Size
                                                                 (LFS sha256 and size) (hf_hub_download)
    GET  /{owner}/{name}/resolve/{rev}/{file}                   the bytes, with Range support

Errors carry the hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo),
which is what ``huggingface_hub`` turns into its exception classes. Point ``HF_ENDPOINT`` at
:attr:`FakeHub.url`. The server is bounded: it answers at most ``max_requests`` requests and shuts
itself down after ``lifetime_s``.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import time
import urllib.parse

LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".npz")
HTML_PAGE = b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>Log in to continue</body></html>\n"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file, which the hub sends as the ETag of files kept in git (not LFS)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def commit_for(repo_id: str, revision: str) -> str:
    return hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()


class FakeHub:
    """``repos``: {"owner/name": {revision: {file name: bytes}}}. Faults, each a set of file names:
    ``cut`` (the body ends half way, once per name), ``cut_always`` (every time), ``no_length``
    (GET without Content-Length), ``html`` (a 200 ``text/html`` login page instead of the file),
    ``stall`` (half the body, then ``stall_s`` of silence, once per name), ``corrupt`` (one byte of
    the body flipped, same length, once per name), ``corrupt_always`` (every time). ``bare_listing``:
    the repository listing gives no size or hash, so only the file's own headers (X-Linked-Etag,
    X-Linked-Size) say what it must be. ``gated``: repositories that answer 401 GatedRepo unless the
    request carries ``Authorization: Bearer {token}``."""

    def __init__(self, repos, *, gated=(), token="hf_secret", cut=(), cut_always=(), no_length=(), html=(),
                 stall=(), stall_s=3.0, corrupt=(), corrupt_always=(), bare_listing=False, max_requests=200,
                 lifetime_s=120.0):
        self.repos = repos
        self.gated, self.token = set(gated), token
        self.cut, self.cut_always, self.no_length = set(cut), set(cut_always), set(no_length)
        self.corrupt, self.corrupt_always, self.bare_listing = set(corrupt), set(corrupt_always), bare_listing
        self.html, self.stall, self.stall_s = set(html), set(stall), stall_s
        self.max_requests = max_requests
        self.requests: list[tuple[str, str, str | None, str | None]] = []  # method, path, Range, Authorization
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                outer._answer(self, head=True)

            def do_GET(self):
                outer._answer(self, head=False)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.timer = threading.Timer(lifetime_s, self.httpd.shutdown)
        self.timer.daemon = True
        self.timer.start()

    def close(self) -> None:
        self.timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()

    def paths(self, method: str | None = None) -> list[str]:
        return [p for m, p, _, _ in self.requests if method in (None, m)]

    # ------------------------------------------------------------------------------------- answers

    def _error(self, h, status: int, code: str | None, commit: str | None = None) -> None:
        body = json.dumps({"error": code or "error"}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _lookup(self, h, repo_id: str, revision: str):
        """The files of ``repo_id`` at ``revision`` (a branch or a commit), or None after an error answer."""
        if repo_id not in self.repos:
            # huggingface.co answers 401 for a repository that does not exist (or is private) when no
            # token is sent; the X-Error-Code is what clients go by.
            self._error(h, 401, "RepoNotFound")
            return None
        if repo_id in self.gated and h.headers.get("Authorization") != f"Bearer {self.token}":
            self._error(h, 401, "GatedRepo")
            return None
        for rev, files in self.repos[repo_id].items():
            if revision in (rev, commit_for(repo_id, rev)):
                return commit_for(repo_id, rev), files
        self._error(h, 404, "RevisionNotFound")
        return None

    def _answer(self, h, *, head: bool) -> None:
        parsed = urllib.parse.urlsplit(h.path)
        path = urllib.parse.unquote(parsed.path)
        self.requests.append((h.command, path, h.headers.get("Range"), h.headers.get("Authorization")))
        if len(self.requests) > self.max_requests:
            self._error(h, 503, None)
            return
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) == 6 and parts[4] == "revision":
            found = self._lookup(h, "/".join(parts[2:4]), parts[5])
            if found is not None:
                self._info(h, "/".join(parts[2:4]), *found, head=head)
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            found = self._lookup(h, repo_id, revision)
            if found is not None:
                self._file(h, repo_id, name, *found, head=head)
            return
        self._error(h, 404, None)

    def _info(self, h, repo_id: str, commit: str, files: dict[str, bytes], *, head: bool) -> None:
        siblings = []
        for name, data in files.items():
            if self.bare_listing:  # names only: a mirror's or an older hub's listing
                siblings.append({"rfilename": name})
                continue
            entry = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            siblings.append(entry)
        body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": commit, "siblings": siblings}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _file(self, h, repo_id: str, name: str, commit: str, files: dict[str, bytes], *, head: bool) -> None:
        if name not in files:
            self._error(h, 404, "EntryNotFound", commit)
            return
        data = files[name]
        lfs = name.endswith(LFS_SUFFIXES)
        # The metadata describe the real file even when the body will be something else (the
        # faults below): that is what a client must check the body against.
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes",
                   "ETag": f'"{git_blob_sha1(data)}"', "Content-Type": "application/octet-stream"}
        if lfs:
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
            headers["X-Linked-Size"] = str(len(data))
        if name in self.html:
            data = HTML_PAGE
            headers["Content-Type"] = "text/html; charset=utf-8"
            headers.pop("X-Linked-Size", None)
        start, rng = 0, h.headers.get("Range")
        if rng and not head and name not in self.html:
            start = int(rng.split("=")[1].split("-")[0])
            h.send_response(206)
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        else:
            h.send_response(200)
        body = data[start:]
        if not head and body and (name in self.corrupt or name in self.corrupt_always):
            self.corrupt.discard(name)
            body = body[:-1] + bytes([body[-1] ^ 0xFF])  # what a faulty proxy or disk might hand on
        if head or name not in self.no_length:
            headers["Content-Length"] = str(len(body))
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if head:
            return
        h.close_connection = True
        if name in self.stall:
            self.stall.discard(name)
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            time.sleep(self.stall_s)
            return
        if name in self.cut or name in self.cut_always:
            self.cut.discard(name)
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            return
        h.wfile.write(body)
