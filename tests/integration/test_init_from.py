"""init_from with include/exclude patterns, re-initialised mismatches, .npz sources; a RAT
classifier started from a RAT segmenter's backbone."""

import logging
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrat.checkpointing import Checkpointer, Policy, load_init
from jaxrat.checkpointing.init_from import merge_params
from jaxrat.runtime.errors import ConfigError
from test_checkpoint import _abstract, _mesh, _state


@pytest.fixture
def saved(tmp_path):
    ck = Checkpointer(str(tmp_path / "src" / "checkpoints"), Policy())
    ck.save(5, _state(5, _mesh()), reason="final")
    ck.close()
    return str(tmp_path / "src")


def test_a_shape_mismatch_is_reinitialised_and_listed(saved, caplog):
    mesh = _mesh()
    other = _state(0, mesh, kernel_shape=(8, 6))
    caplog.set_level(logging.INFO)
    loaded = load_init(saved, _abstract(other, mesh), strict=False)
    assert list(loaded["params"]) == ["head"]  # only what loads
    np.testing.assert_array_equal(loaded["params"]["head"]["bias"], np.full(4, 5.0))
    merged = merge_params(other["params"], loaded["params"])
    np.testing.assert_array_equal(merged["conv"]["kernel"], other["params"]["conv"]["kernel"])  # fresh
    np.testing.assert_array_equal(merged["head"]["bias"], np.full(4, 5.0))
    assert "re-initialised (shape differs): conv/kernel (checkpoint (8, 4), model (8, 6))" in caplog.text
    assert "1 of 2 parameter tensors load" in caplog.text
    with pytest.raises(ConfigError, match="conv/kernel"):  # strict, as before
        load_init(saved, _abstract(other, mesh))
    with pytest.raises(ConfigError, match="needs every parameter"):
        load_init(saved, _abstract(other, mesh), strict=False, optimizer=True)


def test_include_and_exclude_patterns_pick_parameters(saved, caplog):
    mesh = _mesh()
    fresh = _state(0, mesh)
    caplog.set_level(logging.INFO)
    only_conv = load_init(saved, _abstract(fresh, mesh), include=r"^conv/", strict=False)["params"]
    assert list(only_conv) == ["conv"] and float(only_conv["conv"]["kernel"][0, 0]) == 5.0
    assert "excluded by init_from_include/exclude): head/bias" in caplog.text
    no_head = load_init(saved, _abstract(fresh, mesh), exclude="head", strict=False)["params"]
    assert list(no_head) == ["conv"]
    with pytest.raises(ConfigError, match="no parameter of this model loads"):
        load_init(saved, _abstract(fresh, mesh), include="nothing_matches", strict=False)
    with pytest.raises(ConfigError, match="regular expression"):
        load_init(saved, _abstract(fresh, mesh), include="(", strict=False)
    # Everything included, strict: the old behaviour, optimizer too.
    both = load_init(saved, _abstract(fresh, mesh), include=".", strict=True, optimizer=True)
    assert set(both) == {"params", "opt_state"}


def test_an_npz_of_backbone_parameters_lands_under_the_backbone(tmp_path, caplog):
    mesh = _mesh()
    fresh = _state(0, mesh)
    model = {"backbone": fresh["params"], "heads": {"w": jax.numpy.zeros((3,))}}
    abstract = {"params": _abstract(model, mesh)}
    path = str(tmp_path / "backbone.npz")
    np.savez(path, **{"conv/kernel": np.full((8, 4), 2.0, np.float32), "head/bias": np.ones(4, np.float32)})
    caplog.set_level(logging.INFO)
    loaded = load_init(path, abstract, strict=False)["params"]
    assert set(loaded) == {"backbone"} and float(loaded["backbone"]["conv"]["kernel"][1, 1]) == 2.0
    assert "placed under backbone/" in caplog.text and "not in the checkpoint): heads/w" in caplog.text
    with pytest.raises(ConfigError, match="heads/w"):
        load_init(path, abstract)


def test_rename_moves_a_checkpoints_parameters_to_other_paths(saved, caplog):
    mesh = _mesh()
    fresh = _state(0, mesh)
    model = {"backbone": {"net": fresh["params"]}, "class_head": {"w": jax.numpy.zeros((3,))}}
    abstract = {"params": _abstract(model, mesh)}
    caplog.set_level(logging.INFO)
    loaded = load_init(saved, abstract, rename="conv/=backbone/net/conv/,head/=backbone/net/head/",
                       strict=False)["params"]
    np.testing.assert_array_equal(loaded["backbone"]["net"]["conv"]["kernel"],
                                  np.arange(32, dtype=np.float32).reshape(8, 4) + 5)
    assert "not in the checkpoint): class_head/w" in caplog.text
    with pytest.raises(ConfigError, match="OLD_PREFIX=NEW_PREFIX"):
        load_init(saved, abstract, rename="backbone")


RAT = dict(feature_dims=16, num_blocks=1, num_heads=2, iters=1, mlp_dropout=0.0, attention="sparse",
           positional_encoding="rose", mr_attention="windowed", mr_window=16)
CLASSIFIER_CONFIG = """
import runpy
import ml_collections as mlc
from jaxrat.models.rat import rat_config

def get_config(arg=None):
    c = runpy.run_path({classification!r})["get_config"]("smoke")
    c.model = mlc.ConfigDict(dict(name="rat_classifier", kernels="auto", pool="mean"))
    c.model.rat = rat_config(**{rat!r})
    c.data.image_size = 32
    c.num_train_steps = 2
    c.train.eval_at_end = False  # the weights loaded are the point; evaluation would only add compiles
    c.checkpoint.best_metric = ""
    return c
"""


@pytest.mark.slow
@pytest.mark.integration
def test_a_rat_classifier_starts_from_a_segmenters_backbone(tmp_path):
    from runner import REPO, env_with_devices, losses_by_step, run_main

    seg = str(tmp_path / "seg")
    run_main(seg, *[f"--config.model.rat.{k}={v}" for k, v in RAT.items()], "--config.model.decoder_dim=8",
             "--config.num_train_steps=2", "--config.data.synthetic_train=16", "--config.data.synthetic_val=8",
             "--config.data.image_size=32", "--config.data.batch_size=8", "--config.train.eval_every=1000",
             "--config.train.eval_at_end=false", "--config.checkpoint.every_steps=2",
             "--config.checkpoint.best_metric=", config=os.path.join(REPO, "configs", "isic.py") + ":demo",
             timeout=900)
    cfg = tmp_path / "classifier.py"
    cfg.write_text(CLASSIFIER_CONFIG.format(classification=os.path.join(REPO, "configs", "classification.py"),
                                            rat=RAT))
    wd = str(tmp_path / "cls")
    proc = subprocess.run([sys.executable, "-m", "jaxrat.main", f"--config={cfg}", f"--workdir={wd}",
                           f"--config.init_from={seg}"], cwd=REPO,
                          env=env_with_devices(1), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stderr
    m = re.search(r"init_from: (\d+) of (\d+) parameter tensors load", log)
    assert m, log[-3000:]
    fresh = re.search(r"re-initialised \(not in the checkpoint\): (.*)", log).group(1).split(", ")
    # Every tensor but the classifier's heads came from the segmenter; the heads are listed.
    assert fresh and all(n.startswith("heads/") for n in fresh), fresh
    assert "shape differs" not in log and int(m.group(1)) + len(fresh) == int(m.group(2))
    losses = losses_by_step(wd)
    assert sorted(losses) == [1, 2] and all(np.isfinite(v) for v in losses.values())
