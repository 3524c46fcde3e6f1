"""User mistakes end with one clear sentence and exit status 2, never a traceback."""

import pytest

from runner import run_main
from jaxrat.configlib import check_override_args
from jaxrat.errors import ConfigError
from runner import SMOKE


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"--config.data.batch_size\?"):
        check_override_args([f"--config={SMOKE}", "--config.data.batchsize=4"])


@pytest.mark.parametrize("arg", ["--config.data.batch_size=abc", "--config.optimizer.learning_rate=fast",
                                 "--config.data.random_flip=maybe"])
def test_wrong_type_is_named(arg):
    with pytest.raises(ConfigError, match=arg.split("=")[0].replace(".", r"\.")):
        check_override_args([f"--config={SMOKE}", arg])


def test_valid_overrides_pass():
    check_override_args([f"--config={SMOKE}", "--config.data.batch_size=4", "--config.optimizer.learning_rate=1e-3",
                         "--config.data.random_flip=false", "--config.data.data_dir=/x", "--config.num_train_steps", "3"])


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["--config.data.batchsize=4"], "Unknown config key --config.data.batchsize"),
        (["--config.data.batch_size=6"], "does not divide over 8 devices"),
        (["--config.data.synthetic=false", "--config.data.data_dir=/nonexistent/isic"],
         "ISIC 2018 data not found: looked for /nonexistent/isic"),
        (["--config.mesh.axes=(('data', 3),)"], "config.mesh.axes"),
        (["--config.model.name=resnet"], "Unknown model 'resnet'"),
    ],
)
def test_main_fails_with_one_sentence(tmp_path, overrides, needle):
    proc = run_main(str(tmp_path), *overrides, devices=8, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("jaxrat: error:") == 1


@pytest.mark.parametrize("config, needle", [
    ("configs/isic.py:foo", "Unknown variant 'foo' for configs/isic.py; use demo, smoke, unet or none."),
    ("configs/nope.py", "Config file configs/nope.py does not exist"),
])
def test_bad_config_file_or_variant_is_one_sentence(tmp_path, config, needle):
    proc = run_main(str(tmp_path), config=config, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
