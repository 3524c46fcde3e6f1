"""``train.compute_dtype = "auto"``: bfloat16 on GPUs, float32 on CPUs, resolved from the mesh."""

from __future__ import annotations

import os
import types

import jax
import numpy as np
import pytest

from jaxrat.config_schema import load_config
from jaxrat.runtime.errors import ConfigError
from jaxrat.trainer.state import resolve_compute_dtype
from runner import REPO


def fake_mesh(platform: str):
    device = types.SimpleNamespace(platform=platform)
    return types.SimpleNamespace(devices=np.array([[device, device]], dtype=object))


def test_auto_is_bfloat16_on_gpus_and_float32_elsewhere():
    assert resolve_compute_dtype("auto", fake_mesh("gpu")) == "bfloat16"
    assert resolve_compute_dtype("auto", fake_mesh("cpu")) == "float32"
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    assert resolve_compute_dtype("auto", mesh) == "float32"  # this machine's CPU devices


def test_explicit_dtypes_are_kept_and_unknown_ones_refused():
    for name in ("float32", "bfloat16"):
        assert resolve_compute_dtype(name, fake_mesh("gpu")) == name
        assert resolve_compute_dtype(name, fake_mesh("cpu")) == name
    with pytest.raises(ConfigError, match="compute_dtype='fp16'; use 'auto', 'float32' or 'bfloat16'"):
        resolve_compute_dtype("fp16", fake_mesh("gpu"))


def test_auto_is_the_default():
    assert load_config(os.path.join(REPO, "configs/isic.py")).train.compute_dtype == "auto"
