"""Models from the Hugging Face hub through huggingface_hub, against a hub served on 127.0.0.1
(tests/fake_hub.py; nothing leaves the machine): the standard cache, revisions apart, tokens, offline
mode, and every way a download goes wrong ending in one sentence with no empty folder left."""

import errno
import hashlib
import json
import os
import time
import types

import numpy as np
import pytest
from safetensors.numpy import save

from fake_hub import HTML_PAGE, FakeHub, commit_for
from jaxrat.checkpointing import hub
from jaxrat.runtime.errors import DataError, UserError

pytest.importorskip("huggingface_hub")


def _weights(seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    return save({"cls_token": rng.standard_normal((1, 1, 8)).astype(np.float32),
                 "pos_embed": rng.standard_normal((1, 5, 8)).astype(np.float32)})


def _files(seed=0) -> dict[str, bytes]:
    return {"config.json": json.dumps({"architecture": "vit_tiny_patch16_224", "seed": seed}).encode(),
            "model.safetensors": _weights(seed), "README.md": b"# tiny\n"}


@pytest.fixture
def serve(tmp_path, monkeypatch):
    """Start a fake hub and point HF_ENDPOINT and HF_HUB_CACHE (tmp_path/cache, not made yet) at it."""
    servers = []
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))

    def make(repos, **kw):
        servers.append(FakeHub(repos, **kw))
        monkeypatch.setenv("HF_ENDPOINT", servers[-1].url)
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _leftovers(path) -> list[str]:
    """Every folder under ``path`` (itself included) that exists and holds no file at any depth."""
    out = []
    for root, _, files in os.walk(path):
        if not files and not any(f for _, _, f in os.walk(root)):
            out.append(root)
    return out


def test_downloads_into_the_hf_cache_and_reuses_it_online_and_offline(serve, tmp_path, monkeypatch):
    files = _files()
    srv = serve({"timm/tiny": {"main": files}})
    folder = hub.download_model("timm/tiny")
    commit = commit_for("timm/tiny", "main")
    assert folder == str(tmp_path / "cache" / "models--timm--tiny" / "snapshots" / commit)
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]  # not the README
    for name in ("config.json", "model.safetensors"):
        assert open(os.path.join(folder, name), "rb").read() == files[name]
    # huggingface_hub's layout: the weights stored once under their SHA-256, the branch's commit in refs/.
    sha = hashlib.sha256(files["model.safetensors"]).hexdigest()
    assert os.path.realpath(os.path.join(folder, "model.safetensors")).endswith(f"/blobs/{sha}")
    assert (tmp_path / "cache" / "models--timm--tiny" / "refs" / "main").read_text() == commit
    assert "/api/models/timm/tiny/revision/main" in srv.paths("GET")
    n = len(srv.paths("GET"))
    assert hub.download_model("timm/tiny") == folder  # cached: only the listing is asked again
    assert [p for p in srv.paths("GET")[n:] if "/resolve/" in p] == []
    # a run resolves its pretrained value once: building the model and loading it take one commit
    n = len(srv.requests)
    assert hub.resolve_pretrained("hf:timm/tiny") == hub.resolve_pretrained("hf:timm/tiny") == folder
    assert [p for _, p, _, _ in srv.requests[n:]] == ["/api/models/timm/tiny/revision/main"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = len(srv.requests)
    assert hub.resolve_pretrained("hf:timm/tiny") == folder
    assert hub.resolve_pretrained("hf:timm/tiny@" + commit) == folder
    assert len(srv.requests) == n  # offline: no request at all
    assert hub.resolve_pretrained(str(tmp_path / "x.safetensors")) == str(tmp_path / "x.safetensors")


def test_two_revisions_never_share_a_file(serve, tmp_path):
    serve({"org/m": {"main": _files(0), "v2": _files(1)}})
    main, v2 = hub.download_model("org/m"), hub.download_model("org/m", revision="v2")
    assert main != v2
    assert open(os.path.join(v2, "model.safetensors"), "rb").read() == _files(1)["model.safetensors"]
    assert open(os.path.join(main, "model.safetensors"), "rb").read() == _files(0)["model.safetensors"]
    folder = hub.download_model("org/m", cache_dir=str(tmp_path / "dest"))  # --dest: the same layout elsewhere
    assert folder.startswith(str(tmp_path / "dest" / "models--org--m" / "snapshots"))
    other = hub.download_model("org/m", revision="v2", cache_dir=str(tmp_path / "dest"))  # the same --dest
    assert other != folder and open(os.path.join(other, "model.safetensors"), "rb").read() == (
        _files(1)["model.safetensors"])
    assert open(os.path.join(folder, "model.safetensors"), "rb").read() == _files(0)["model.safetensors"]


def test_a_cut_body_is_resumed_and_one_cut_for_good_is_refused(serve, tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "_RESUME_CHUNK", 8)  # what arrived is kept in whole chunks
    files = _files()
    srv = serve({"org/m": {"main": files}}, cut={"model.safetensors"})
    folder = hub.download_model("org/m")
    assert open(os.path.join(folder, "model.safetensors"), "rb").read() == files["model.safetensors"]
    ranges = [r for m, p, r, _ in srv.requests if m == "GET" and p.endswith("model.safetensors")]
    assert ranges == [None, f"bytes={len(files['model.safetensors']) // 2}-"]  # resumed, not restarted
    # No Content-Length on the body and the connection closed half way: the hub's X-Linked-Size tells.
    serve({"org/m": {"main": files}}, cut_always={"model.safetensors"}, no_length={"model.safetensors"})
    with pytest.raises(DataError, match=r"org/m@main file model.safetensors ended short of its size.*run the same"):
        hub.download_model("org/m", cache_dir=str(tmp_path / "fresh"))
    # What arrived whole stays for the rerun (config.json), nothing of the cut file, no empty folder.
    blobs = tmp_path / "fresh" / "models--org--m" / "blobs"
    assert sorted(b.read_bytes() for b in blobs.iterdir()) == [files["config.json"]]
    assert _leftovers(tmp_path / "fresh") == []


def test_a_stall_resumes_from_the_bytes_received(serve, monkeypatch, capsys):
    # Silent for 30 s half way: --timeout 1 gives up on the read after a second and resumes.
    monkeypatch.setattr(hub, "_RESUME_CHUNK", 8)
    files = _files()
    srv = serve({"org/m": {"main": files}}, stall={"model.safetensors"}, stall_s=30.0)
    start = time.monotonic()
    assert hub.main(["hf:org/m", "--timeout", "1"]) == 0
    assert time.monotonic() - start < 20
    folder = hub.download_model("org/m")  # from the cache now
    assert open(os.path.join(folder, "model.safetensors"), "rb").read() == files["model.safetensors"]
    ranges = [r for m, p, r, _ in srv.requests if m == "GET" and p.endswith("model.safetensors")]
    assert ranges == [None, f"bytes={len(files['model.safetensors']) // 2}-"]


def test_404_401_and_a_gated_repository_each_one_sentence_and_no_folder_left(serve, tmp_path, monkeypatch):
    srv = serve({"org/open": {"main": _files()}, "org/gated": {"main": _files()}}, gated={"org/gated"})
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=r"org/nothere is not on http://127.0.0.1:\d+ or is private \(HTTP 401\); "
                                        r"check the repository id, or set HF_TOKEN"):
        hub.download_model("org/nothere")
    with pytest.raises(DataError, match=r"org/open has no revision v9 .*\(HTTP 404\)"):
        hub.download_model("org/open", revision="v9")
    with pytest.raises(DataError, match=r"org/gated is a gated repository .* no token was sent \(HTTP 401\); "
                                        r"accept its terms .* set HF_TOKEN"):
        hub.download_model("org/gated")
    assert not cache.exists()
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(DataError, match="the token in HF_TOKEN has no access"):
        hub.download_model("org/gated")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    folder = hub.download_model("org/gated")
    assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    assert all(auth == "Bearer hf_secret" for _, p, _, auth in srv.requests[-4:])
    srv.repos["org/empty"] = {"main": {"config.json": b"{}"}}
    with pytest.raises(DataError, match="org/empty@main has none of model.safetensors"):
        hub.download_model("org/empty")
    assert _leftovers(cache) == []
    with pytest.raises(UserError, match="not a hub model"):
        hub.download_model("../etc")


def test_a_200_html_login_page_is_never_saved_as_the_weights(serve, tmp_path):
    srv = serve({"org/m": {"main": _files()}}, html={"model.safetensors"})
    with pytest.raises(DataError, match=r"sent org/m@main file model.safetensors twice and both times it is an "
                                        r"HTML or XML page .*check HF_ENDPOINT"):
        hub.download_model("org/m")
    assert len([p for p in srv.paths("GET") if p.endswith("model.safetensors")]) == 2  # fetched once more
    blobs = tmp_path / "cache" / "models--org--m" / "blobs"
    assert not any(b.read_bytes() == HTML_PAGE for b in blobs.iterdir())
    assert _leftovers(tmp_path / "cache") == []


@pytest.mark.parametrize("bare_listing", [False, True])
def test_a_body_that_is_not_the_hubs_file_is_fetched_again_and_refused_for_good(serve, tmp_path, bare_listing):
    # One byte flipped on the way, the length right: only the SHA-256 tells. With a bare listing
    # (no sizes, no hashes) the file's own X-Linked-Etag is what it is checked against.
    files = _files()
    srv = serve({"org/m": {"main": files}}, corrupt={"model.safetensors"}, bare_listing=bare_listing)
    folder = hub.download_model("org/m")
    assert open(os.path.join(folder, "model.safetensors"), "rb").read() == files["model.safetensors"]
    assert len([p for p in srv.paths("GET") if p.endswith("model.safetensors")]) == 2  # fetched once more
    serve({"org/m": {"main": files}}, corrupt_always={"model.safetensors"}, bare_listing=bare_listing)
    sha = hashlib.sha256(files["model.safetensors"]).hexdigest()
    with pytest.raises(DataError, match=rf"sent org/m@main file model.safetensors twice and both times its SHA-256 "
                                        rf"is not the hub's {sha}; it was deleted"):
        hub.download_model("org/m", cache_dir=str(tmp_path / "fresh"))
    blobs = tmp_path / "fresh" / "models--org--m" / "blobs"
    assert files["model.safetensors"] not in [b.read_bytes() for b in blobs.iterdir()]
    assert not [b for b in blobs.iterdir() if b.name == sha]  # nothing kept under the good file's name
    assert _leftovers(tmp_path / "fresh") == []


def test_a_damaged_cached_file_is_fetched_again_online_and_refused_offline(serve, monkeypatch):
    files = _files()
    serve({"org/m": {"main": files}})
    folder = hub.download_model("org/m")
    weights = os.path.join(folder, "model.safetensors")
    blob = os.path.realpath(weights)
    data = bytearray(open(blob, "rb").read())
    data[-3] ^= 0xFF  # same size, one byte off: only the hash can tell
    os.chmod(blob, 0o644)
    open(blob, "wb").write(bytes(data))
    assert hub.download_model("org/m") == folder
    assert open(weights, "rb").read() == files["model.safetensors"]
    open(os.path.realpath(weights), "wb").write(bytes(data))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"cached org/m@main file model.safetensors is damaged \(its SHA-256 is not "
                                        r"the hub's .*\) and HF_HUB_OFFLINE is set; it was removed"):
        hub.download_model("org/m")
    assert not os.path.exists(blob)


def test_offline_or_unreachable_without_a_cache_is_one_sentence(serve, tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"HF_HUB_OFFLINE is set and org/m@main is not in the Hugging Face cache .*"
                                        r"download it once with network"):
        hub.download_model("org/m")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
    with pytest.raises(DataError, match=r"cannot be reached \(ConnectError.*\) and org/m@main is not in the"):
        hub.download_model("org/m", timeout=2)
    assert not (tmp_path / "cache").exists()


def test_not_enough_space_is_refused_before_writing_and_a_full_disk_is_one_sentence(serve, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    import huggingface_hub.file_download as fd

    srv = serve({"org/m": {"main": _files()}})
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 100, 100))
    with pytest.raises(DataError, match=r"org/m@main needs 0.0 MB but the disk holding .* has 0.0 MB free; free "
                                        r"space or set HF_HUB_CACHE"):
        hub.download_model("org/m")
    assert not [p for p in srv.paths() if "/resolve/" in p]  # refused before a byte was fetched
    assert not (tmp_path / "cache").exists()
    # A listing without sizes: the files' own headers (HEAD: X-Linked-Size) size them instead.
    bare = serve({"org/m": {"main": _files()}}, bare_listing=True)
    with pytest.raises(DataError, match=r"org/m@main needs 0.0 MB but the disk holding .* has 0.0 MB free"):
        hub.download_model("org/m")
    assert not [p for p in bare.paths("GET") if "/resolve/" in p] and "/resolve/" in bare.paths("HEAD")[-1]
    assert not (tmp_path / "cache").exists()
    monkeypatch.undo()
    monkeypatch.setenv("HF_ENDPOINT", srv.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fd, "http_get", full)
    with pytest.raises(DataError, match=r"The disk holding .* is full \(No space left on device\) while downloading "
                                        r"org/m@main file config.json; free space"):
        hub.download_model("org/m")
    assert not (tmp_path / "cache").exists()


def test_sharded_safetensors_fetch_every_shard(serve):
    shards = {"model-00001-of-00002.safetensors": _weights(1), "model-00002-of-00002.safetensors": _weights(2)}
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    serve({"org/big": {"main": {"config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode(),
                                **shards}}})
    folder = hub.download_model("org/big")
    assert sorted(os.listdir(folder)) == sorted(["config.json", "model.safetensors.index.json", *shards])


def test_pretrained_hf_spec_loads_through_the_trainer(serve, monkeypatch):
    import jax
    import ml_collections as mlc
    from safetensors.numpy import save as save_arrays

    from jaxrat.trainer.state import initial_weights
    from test_backbone_weights import _expected, _timm_state

    state = _timm_state()
    # a timm folder: its config.json names the architecture (a bare "{}" is no model config and is refused)
    serve({"timm/tiny": {"main": {"config.json": b'{"architecture": "vit_tiny_patch16_224"}',
                                  "model.safetensors": save_arrays(state)}}})
    abstract = {"backbone": {}}
    for name, shape in _expected().items():
        node = abstract["backbone"]
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = jax.ShapeDtypeStruct(shape, np.float32)
    config = mlc.ConfigDict({"init_from": "", "model": {"pretrained": "hf:timm/tiny@main"}})
    spec = types.SimpleNamespace(abstract_with_shardings=lambda: {"params": abstract})  # what it reads of a spec
    placed = initial_weights(config, spec)["params"]
    np.testing.assert_array_equal(placed["backbone"]["blocks"]["0"]["attn"]["qkv"]["kernel"],
                                  state["blocks.0.attn.qkv.weight"].T)


def test_jaxrat_download_takes_a_model_and_prints_the_pretrained_value(serve, capsys, tmp_path):
    from jaxrat.cli import download

    serve({"org/m": {"main": _files()}})
    assert download.main(["hf:org/m@main", "--timeout", "5"]) == 0
    assert capsys.readouterr().out.strip().endswith("--config.model.pretrained=hf:org/m@main")
    assert download.main(["hf:org/nothere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxrat: error: org/nothere is not on")
    assert download.main(["hf:org/m", "--dest", str(tmp_path / "d")]) == 0
    assert capsys.readouterr().out.strip().endswith(f"snapshots/{commit_for('org/m', 'main')}")
    # A mistyped --endpoint: one sentence naming this command's option (issue 58 item 10), no folder left.
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        wrong = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert download.main(["hf:org/other", "--endpoint", wrong, "--dest", str(tmp_path / "e"), "--timeout", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{wrong} cannot be reached" in err[0] and "--endpoint" in err[0], err
    assert "unset HF_HUB_OFFLINE" not in err[0] and not (tmp_path / "e").exists()


def test_an_hf_pretrained_is_built_with_the_architecture_its_config_states(serve):
    # the model is built before the weights load: its config.json must be read from the hub's copy
    import ml_collections as mlc

    from jaxrat.models.backbones import backbone_fields
    from jaxrat.tasks.base import local_model_config
    from test_backbone_architecture import HF_VIT

    serve({"org/vit": {"main": {"config.json": json.dumps(dict(HF_VIT, layer_norm_eps=1e-12)).encode(),
                                "model.safetensors": save({"x": np.zeros(2, np.float32)})}}})
    model = mlc.ConfigDict({"backbone": "vit_tiny_patch16_224", "pretrained": "hf:org/vit@main"})
    local = local_model_config(model)
    assert model.pretrained == "hf:org/vit@main"  # the run's config keeps what the user wrote
    assert os.path.isdir(local.pretrained) and os.path.isfile(os.path.join(local.pretrained, "config.json"))
    fields = backbone_fields(model.backbone, {}, local.pretrained)
    assert fields["eps"] == 1e-12 and fields["embed_dim"] == HF_VIT["hidden_size"]
    plain = mlc.ConfigDict({"pretrained": "/some/file.safetensors"})
    assert local_model_config(plain) is plain
