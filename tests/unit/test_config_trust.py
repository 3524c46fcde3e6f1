"""A run's config.json is data: the task module it names is imported only when built-in or allowed."""

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from jaxrat.config_schema import load_config, load_run_config
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks.base import load_task
from runner import REPO, env_with_devices

# Creates a file when imported: the proof that a config.json ran code.
PAYLOAD = "import os\nopen(os.path.join(os.path.dirname(__file__), 'RAN'), 'w').close()\n" \
          "from jaxrat.tasks.segmentation import SegmentationTask as Task\n"


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """A workdir whose config.json names ``planted:Task``, and ``planted.py`` in the current folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "planted.py").write_text(PAYLOAD)
    wd = tmp_path / "shared"
    wd.mkdir()
    config = json.loads(json.dumps(load_config(os.path.join(REPO, "configs", "isic.py") + ":smoke").to_dict(),
                                   default=list))
    config["task"]["name"] = "planted:Task"
    (wd / "config.json").write_text(json.dumps(config))
    yield wd
    sys.modules.pop("planted", None)


def test_a_workdir_config_naming_an_outside_module_is_refused_before_importing_it(shared):
    with pytest.raises(ConfigError, match=r"--allow-import planted") as e:
        load_task(load_run_config(str(shared)))
    assert "config.json is data" in str(e.value)
    with pytest.raises(ConfigError, match=r"--allow-import planted"):  # as training's --config
        load_config(str(shared / "config.json"))
    assert not (shared.parent / "RAN").exists() and "planted" not in sys.modules


def test_the_module_allowed_on_the_command_line_is_imported(shared):
    config = load_run_config(str(shared), allow_import=["planted"])
    assert type(load_task(config)).__name__ == "SegmentationTask" and (shared.parent / "RAN").exists()


def test_a_task_named_on_the_command_line_is_the_users_choice(shared):
    config = load_run_config(str(shared), ["--config.task.name=segmentation"])
    assert config.task.name == "segmentation"


def test_builtin_tasks_need_no_permission(shared):
    config = json.loads((shared / "config.json").read_text())
    for name in ("segmentation", "jaxrat.tasks.segmentation:SegmentationTask"):
        config["task"]["name"] = name
        (shared / "config.json").write_text(json.dumps(config))
        assert load_run_config(str(shared)).task.name == name


def test_predict_on_a_shared_workdir_says_so_in_one_sentence_and_runs_nothing(shared, tmp_path):
    (tmp_path / "in").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "in" / "a.png")
    proc = subprocess.run([sys.executable, "-m", "jaxrat.predict", f"--workdir={shared}", f"--input={tmp_path / 'in'}",
                           f"--out={tmp_path / 'out'}"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**env_with_devices(1), "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "pass --allow-import planted" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "RAN").exists()


def test_a_config_file_importing_the_old_package_name_is_told_the_new_one(tmp_path):
    old = tmp_path / "mine.py"
    old.write_text("from jaxrat.config import base_config\n\ndef get_config():\n    return base_config()\n")
    with pytest.raises(ConfigError, match=r"imports jaxrat\.config, which is now jaxrat\.config_schema"):
        load_config(str(old))
    broken = tmp_path / "typo.py"  # any other missing module keeps its own error
    broken.write_text("import jaxrat_no_such_module\n")
    with pytest.raises(ModuleNotFoundError):
        load_config(str(broken))
