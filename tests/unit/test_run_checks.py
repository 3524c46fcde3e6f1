"""The config's mistakes are refused before the data is prepared (which can take minutes: a synthetic
COCO written, a dataset staged), each in one sentence, and the new workdir is left as it was found."""

from __future__ import annotations

import pytest

from jaxrat.config_schema import load_config
from jaxrat.runtime.errors import ConfigError
from runner import SMOKE


@pytest.mark.parametrize("section, key, value, says", [
    ("sharding", "zero", 5, "config.sharding.zero=5; use 0, 1, 2 or 3."),
    ("train", "compute_dtype", "float16", "config.train.compute_dtype='float16'; use 'auto', 'float32' or 'bfloat16'."),
    ("model", "kernels", "fastest", "config.model.kernels: "),
    ("data", "batch_size", 3, "does not divide over 8 devices"),
])
def test_a_mistake_is_refused_before_the_data_is_prepared(tmp_path, monkeypatch, section, key, value, says):
    from jaxrat.trainer import loop

    load_task, prepared = loop.load_task, []

    def watched(config):
        task = load_task(config)
        monkeypatch.setattr(task, "prepare_data", lambda workdir: prepared.append(workdir) or "prepared")
        return task

    monkeypatch.setattr(loop, "load_task", watched)
    config = load_config(SMOKE)
    with config.unlocked(), config.ignore_type():
        config[section][key] = value
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        loop.train_and_evaluate(config, str(workdir))
    assert says in str(e.value) and str(e.value).count(". ") <= 2
    assert prepared == []  # refused before the data was touched
    assert not workdir.exists()  # a refused new run leaves no folder behind


def test_a_negative_number_of_steps_is_refused_before_the_run_starts(tmp_path):
    from jaxrat.trainer import loop

    config = load_config(SMOKE)
    config.num_train_steps = -5
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^config\.num_train_steps=-5 is not a number of steps; set it to 0 or more "
                                          r"\(e\.g\. --config\.num_train_steps=1000\)\.$"):
        loop.train_and_evaluate(config, str(workdir))
    assert not workdir.exists()  # no run recorded as finished


@pytest.mark.parametrize("section, key, value", [
    ("data", "image_size", -32), ("data", "image_size", 0), ("data", "batch_size", 0), ("data", "batch_size", -8),
    ("data", "eval_batch_size", 0), ("train", "log_every", 0), ("train", "eval_every", 0),
    ("train", "eval_every", -1),
])
def test_a_size_or_period_below_one_is_refused_before_the_data_is_prepared(tmp_path, section, key, value):
    """Each ended in a traceback (ValueError: negative dimensions are not allowed, batch_size must be
    positive, ZeroDivisionError), most after the first checkpoint was written; eval_every=-1 evaluated
    after every step."""
    from jaxrat.trainer import loop

    config = load_config(SMOKE)
    config[section][key] = value
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf"^config\.{section}\.{key}={value} must be 1 or more; ") as e:
        loop.train_and_evaluate(config, str(workdir))
    assert str(e.value).count(". ") == 0 and "\n" not in str(e.value)
    assert not workdir.exists()  # refused before the synthetic data or a checkpoint was written
