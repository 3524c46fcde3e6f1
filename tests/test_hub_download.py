"""python -m jaxrat.data.hub against a hub served on 127.0.0.1 (nothing leaves the machine): the
folder lands whole, an interrupted weights file resumes, files already there are not fetched
again, a repository without safetensors falls back to pytorch_model.bin, and jaxrat loads it."""

import json

import numpy as np
import pytest
from safetensors.numpy import save

from jaxrat.data import hub
from jaxrat.runtime.errors import DataError, UserError
from test_download import _Server


def _files():
    weights = {"cls_token": np.ones((1, 1, 8), np.float32), "pos_embed": np.zeros((1, 5, 8), np.float32)}
    return {"config.json": json.dumps({"architecture": "vit_tiny_patch16_224"}).encode(),
            "model.safetensors": save(weights)}


def test_model_folder_downloads_resumes_and_is_cached(tmp_path):
    files = _files()
    srv = _Server(files, cut=("model.safetensors",))
    try:
        endpoint = srv.url.rsplit("/2018/", 1)[0]
        folder = hub.download_model("timm/tiny", str(tmp_path), endpoint=endpoint, retries=2, timeout=10)
        assert folder == str(tmp_path / "timm--tiny")
        for name, data in files.items():
            assert (tmp_path / "timm--tiny" / name).read_bytes() == data
        weights = [(p, r) for p, r in srv.requests if p.endswith("model.safetensors")]
        assert weights[0] == ("/timm/tiny/resolve/main/model.safetensors", None)
        assert weights[1][1] == f"bytes={len(files['model.safetensors']) // 2}-"  # resumed, not restarted
        before = len(srv.requests)
        hub.download_model("timm/tiny", str(tmp_path), endpoint=endpoint, retries=0, timeout=10)
        assert len(srv.requests) == before  # cached: nothing fetched again
    finally:
        srv.close()


def test_falls_back_to_pytorch_bin_and_names_what_is_missing(tmp_path):
    srv = _Server({"config.json": b"{}", "pytorch_model.bin": b"weights"})
    try:
        endpoint = srv.url.rsplit("/2018/", 1)[0]
        folder = hub.download_model("org/old", str(tmp_path), endpoint=endpoint, retries=0, timeout=10)
        assert sorted(p.name for p in (tmp_path / "org--old").iterdir()) == ["config.json", "pytorch_model.bin"]
        assert folder.endswith("org--old")
        with pytest.raises(DataError, match="has none of model.safetensors, pytorch_model.bin"):
            srv.files.pop("pytorch_model.bin")
            hub.download_model("org/empty", str(tmp_path), endpoint=endpoint, retries=0, timeout=10)
    finally:
        srv.close()
    with pytest.raises(UserError, match="not a hub repository id"):
        hub.download_model("../etc", str(tmp_path))


def test_failed_download_names_endpoint_and_leaves_no_model_folder(tmp_path):
    """A repository the server lacks (or one without weights) fails in one sentence naming the
    command's own option, --endpoint (there is no --base-url here), and leaves no folder that
    looks like a downloaded model; a partial weights file stays to resume from."""
    srv = _Server({})
    try:
        endpoint = srv.url.rsplit("/2018/", 1)[0]
        with pytest.raises(DataError) as err:
            hub.download_model("org/absent", str(tmp_path), endpoint=endpoint, retries=0, timeout=10)
        assert "--endpoint" in str(err.value) and "--base-url" not in str(err.value)
        assert not (tmp_path / "org--absent").exists()
        srv.files["config.json"] = b"{}"
        with pytest.raises(DataError, match="has none of"):  # config.json only: not a model either
            hub.download_model("org/noweights", str(tmp_path), endpoint=endpoint, retries=0, timeout=10)
        assert not (tmp_path / "org--noweights").exists()
        srv.status = 503  # the server fails: the message says how to use another one
        with pytest.raises(DataError, match="mirror with --endpoint"):
            hub.download_model("org/down", str(tmp_path), endpoint=endpoint, retries=0, timeout=10)
        assert list(tmp_path.iterdir()) == []
    finally:
        srv.close()
    assert hub.main(["org/x", "--dest", str(tmp_path), "--endpoint", "http://127.0.0.1:9", "--retries", "0"]) == 2
    assert list(tmp_path.iterdir()) == []
