"""Automatic batch sizing: the largest micro-batch whose compiled step fits, accumulation to the target."""

import jax
import numpy as np
import pytest

from jaxrat.config_schema import load_config
from jaxrat.parallel.mesh import make_mesh
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks.base import load_task
from jaxrat.trainer import autotune


class _Fake:
    def __init__(self, nbytes):
        self.argument_size_in_bytes, self.output_size_in_bytes, self.temp_size_in_bytes = nbytes, 0, 0


def _compile_step(per_example, fixed):
    class Compiled:
        def __init__(self, b):
            self.b = b

        def memory_analysis(self):
            return _Fake(fixed + per_example * self.b)

    return Compiled


def test_choose_finds_the_largest_fitting_micro_batch_and_the_accumulation():
    config = load_config("configs/isic.py:smoke")
    config.train.memory_budget_gb = 1.0
    config.train.memory_margin = 0.0
    config.data.target_batch_size = 1000
    budget = 2**30
    step = _compile_step(per_example=budget // 37, fixed=1000)
    choice = autotune.choose(config, devices=8, compile_step=step)
    assert choice.per_device <= 36 and all(m <= budget for b, m in choice.tried if b == choice.per_device)
    largest_fit = max(b for b, m in choice.tried if m <= budget)
    assert largest_fit == 36 and any(b == 37 and m > budget for b, m in choice.tried)
    assert choice.accum == 4 and choice.global_batch >= 1000 and choice.global_batch == choice.per_device * 8 * 4
    config.optimizer.lr_scaling, config.optimizer.reference_batch_size = "linear", 500
    assert autotune.scaled_learning_rate(config, 1000) == pytest.approx(2 * config.optimizer.learning_rate)
    config.optimizer.lr_scaling = "sqrt"
    assert autotune.scaled_learning_rate(config, 2000) == pytest.approx(2 * config.optimizer.learning_rate)


def test_nothing_fits_and_no_budget_are_one_sentence():
    config = load_config("configs/isic.py:smoke")
    config.train.memory_budget_gb = 1e-6
    with pytest.raises(ConfigError, match="One example per device needs"):
        autotune.choose(config, devices=1, compile_step=_compile_step(10**6, 0))
    config.train.memory_budget_gb = 0.0
    with pytest.raises(ConfigError, match="memory_budget_gb"):
        autotune.budget_bytes(config)  # CPUs do not report their memory


@pytest.mark.slow
def test_a_simulated_budget_picks_a_batch_that_fits_and_whose_double_does_not(tmp_path):
    # A two-level U-Net at 64 px needs ~1.3 MiB per example, so 45 MiB fits about 31: the search
    # doubles past the config's 16 and bisects, ~10 compiles of a small program (the ISIC U-Net at
    # 128 px and 2 GiB was the same search at 3x the test's time).
    config = load_config("configs/isic.py:unet")
    config.data.image_size = 64
    config.model.features = (4, 8)
    config.data.per_device_batch_size = "auto"
    config.train.memory_budget_gb = 0.045
    mesh = make_mesh((("data", 1), ("fsdp", 1)), devices=jax.devices()[:1])
    task = load_task(config)
    example = {"image": np.zeros((1, 64, 64, 3), np.float32), "mask": np.zeros((1, 64, 64, 1), np.float32)}
    choice = autotune.size_batch(config, mesh, task, example, str(tmp_path))
    budget = autotune.budget_bytes(config)
    largest = max(b for b, m in choice.tried if m <= budget)
    over = [b for b, m in choice.tried if m > budget]
    assert over and min(over) == largest + 1  # the largest that fits, and the next size does not
    assert 2 * largest in dict(choice.tried) or min(over) <= 2 * largest
    # the target (the config's batch of 16) is reached with the fewest accumulation steps
    assert choice.accum == 1 and choice.per_device == 16 <= largest
    assert config.data.batch_size == choice.global_batch and (tmp_path / "autotune.json").exists()


def test_auto_sizing_with_fixed_shards_is_one_sentence(tmp_path):
    config = load_config("configs/classification.py:smoke")
    config.data.per_device_batch_size = "auto"
    assert config.train.reduction_shards
    with pytest.raises(ConfigError, match="multiple of the shards"):
        autotune.size_batch(config, None, None, {}, str(tmp_path))


def _fake_lowering(monkeypatch, per_example, fixed, compiles):
    """size_batch on a fake step whose compiled bytes grow with the batch; ``compiles`` counts them."""
    step = _compile_step(per_example, fixed)

    class Lowered:
        def __init__(self, b):
            self.b = b

        def compile(self):
            compiles.append(self.b)
            return step(self.b)

    monkeypatch.setattr(autotune, "train_step_lowering", lambda config, mesh, task: (lambda ex, gb: Lowered(gb)))


def test_a_resume_keeps_the_recorded_choice_with_one_compile_and_searches_when_it_cannot(tmp_path, monkeypatch, caplog):
    # A resume searched again: a dozen compiles per restart, and on a device with less memory another
    # global batch and learning rate than the checkpoints were trained with, without a word.
    import types

    config = load_config("configs/isic.py:smoke")
    config.data.per_device_batch_size = "auto"
    config.train.memory_budget_gb, config.train.memory_margin = 1.0, 0.0
    config.data.target_batch_size = 1000
    mesh, compiles = types.SimpleNamespace(size=8), []
    # compiled bytes grow by global batch (8 devices x per-device): 36 per device fit a GiB, 37 do not
    _fake_lowering(monkeypatch, per_example=2**30 // (37 * 8), fixed=1000, compiles=compiles)
    first = autotune.size_batch(config, mesh, None, {}, str(tmp_path))
    assert len(compiles) > 5 and (tmp_path / "autotune.json").exists()
    record = (tmp_path / "autotune.json").read_text()

    compiles.clear()
    again = autotune.size_batch(config, mesh, None, {}, str(tmp_path))
    assert compiles == [first.per_device * 8]  # one compile, of the recorded micro-batch
    assert (again.per_device, again.accum, again.global_batch, again.learning_rate) == \
           (first.per_device, first.accum, first.global_batch, first.learning_rate)
    assert (tmp_path / "autotune.json").read_text() == record  # the search's record stays

    compiles.clear()  # another device count: the recorded choice says nothing about it
    autotune.size_batch(config, types.SimpleNamespace(size=4), None, {}, str(tmp_path))
    assert len(compiles) > 1

    (tmp_path / "autotune.json").write_text(record)
    config.train.memory_budget_gb = 0.5  # a device with less memory: the recorded micro-batch no longer fits
    compiles.clear()
    with caplog.at_level("WARNING"):
        smaller = autotune.size_batch(config, mesh, None, {}, str(tmp_path))
    assert smaller.per_device < first.per_device and len(compiles) > 1
    assert "searching again" in caplog.text
