"""jaxrat's one weight reader: safetensors, torch state dicts, .npz and Hugging Face folders give the
same named arrays to every path that reads weights (backbones, the reference RAT import, init_from)."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxrat.checkpointing.init_from import _source_arrays
from jaxrat.checkpointing.weight_files import read_arrays
from jaxrat.models.torch_import import read_state_dict
from jaxrat.runtime.errors import ConfigError

STATE = {"blocks.0.attn.qkv.weight": np.arange(12, dtype=np.float32).reshape(6, 2),
         "norm.bias": np.ones(2, np.float32)}


def _same(got, want=STATE):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_every_format_reads_to_the_same_arrays(tmp_path):
    torch = pytest.importorskip("torch")
    save_file(STATE, str(tmp_path / "w.safetensors"))
    np.savez(tmp_path / "w.npz", **STATE)
    torch.save({"state_dict": {f"module.{k}": torch.from_numpy(v) for k, v in STATE.items()}}, tmp_path / "w.pth")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    first, second = dict(list(STATE.items())[:1]), dict(list(STATE.items())[1:])
    save_file(first, str(folder / "model-00001-of-00002.safetensors"))
    save_file(second, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{k: "model-00001-of-00002.safetensors" for k in first},
        **{k: "model-00002-of-00002.safetensors" for k in second}}}))
    for source in ("w.safetensors", "w.npz", "w.pth", "hf"):
        _same(read_arrays(tmp_path / source))
    # the same reader behind init_from's files and the reference RAT import (which now reads safetensors too)
    _same(_source_arrays(str(tmp_path / "w.safetensors")))
    _same(read_state_dict(tmp_path / "w.safetensors", prefix="blocks.0."), {"attn.qkv.weight": STATE[
        "blocks.0.attn.qkv.weight"]})


class Payload:
    def __reduce__(self):
        return (print, ("code ran",))


def test_every_reader_refuses_the_same_way(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.zeros(2), "extra": Payload()}, tmp_path / "evil.pt")
    for read in (read_arrays, read_state_dict, _source_arrays):
        with pytest.raises(ConfigError, match=r"evil.pt is a pickle that holds more than plain tensors \(Unsupported "
                                              r"global: GLOBAL \S*print was not an allowed global\)"):
            read(str(tmp_path / "evil.pt"))
    assert "code ran" not in capsys.readouterr().out
    with pytest.raises(ConfigError, match="weights .*gone.safetensors do not exist"):
        read_arrays(tmp_path / "gone.safetensors")
    (tmp_path / "w.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"weights must be \.safetensors, \.bin"):
        read_arrays(tmp_path / "w.txt")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="not a readable .npz"):
        read_arrays(tmp_path / "bad.npz")
