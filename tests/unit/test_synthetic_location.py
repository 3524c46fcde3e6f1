"""A command that reads a trained run (evaluate, robustness) reads the run's synthetic data where it is,
never writing there, instead of generating a copy in each of its output folders."""

import os

import pytest

from jaxrat.config_schema import load_config
from jaxrat.data.synthetic import location
from jaxrat.tasks.base import load_task
from runner import REPO


def _files(root):
    """Every file under ``root`` with its size and modification time: what a write would change."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            st = os.stat(os.path.join(folder, name))
            found[os.path.relpath(os.path.join(folder, name), root)] = (st.st_size, st.st_mtime_ns)
    return found


@pytest.mark.parametrize("variant", ["isic.py:smoke", "segmentation.py:smoke", "classification.py:smoke",
                                     "coco.py:smoke"])
def test_the_runs_synthetic_data_is_read_where_it_is(tmp_path, variant):
    config = load_config(os.path.join(REPO, "configs", variant))
    run, out = str(tmp_path / "run"), str(tmp_path / "eval")
    trained = load_task(config).prepare_data(run)  # what the training run wrote
    data = location.folder(run, 0)
    before = _files(data)
    with location.reading_run(run):
        assert load_task(config).prepare_data(out) == trained
    assert not os.path.exists(os.path.join(out, "synthetic_data"))
    assert _files(data) == before

    # Other data than the run's (here one more validation image): generated in the command's own
    # folder as before, the run's copy left as it is.
    config.data.synthetic_val += 1
    with location.reading_run(run):
        load_task(config).prepare_data(out)
    assert os.path.isdir(location.folder(out, 0)) and _files(data) == before

