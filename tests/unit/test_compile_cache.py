"""The persistent compilation cache: where it goes, how it is turned off, and that a bad folder only warns."""

import os

import jax
import pytest

from jaxrat.runtime import compile_cache


@pytest.fixture
def restore_jax_cache_config():
    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


def test_default_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAXRAT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == str(tmp_path / "xdg" / "jaxrat" / "xla")
    monkeypatch.setenv("JAXRAT_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.default_dir() == str(tmp_path / "mine" / "xla")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert compile_cache.default_dir() == str(tmp_path / "jax")


def test_enable_none_and_unwritable(tmp_path, caplog, restore_jax_cache_config):
    assert compile_cache.enable("none") is None
    assert compile_cache.enable(str(tmp_path / "c")) == str(tmp_path / "c")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache.enable(str(blocker / "sub")) is None
    assert "compilation cache off" in caplog.text and os.path.isfile(blocker)
    assert jax.config.jax_compilation_cache_dir is None


def test_none_also_turns_off_the_folder_jax_took_from_the_environment(tmp_path, restore_jax_cache_config):
    # jax sets its flag from $JAX_COMPILATION_CACHE_DIR at import (the test run itself sets it, see
    # tests/conftest.py); --config.train.compilation_cache_dir=none must still mean no cache.
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "from_env"))
    assert compile_cache.enable("none") is None
    assert jax.config.jax_compilation_cache_dir is None
