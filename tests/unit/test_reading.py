"""The read side's restore (evaluate, predict, export, init_from, robustness): digests checked,
``latest`` falls back past a damaged step with a line saying so (nothing moved: the folder is the
training's), and a step held for reading survives the training rotating it away."""

import logging
import os
import re
import shutil

import numpy as np
import pytest

from jaxrat.checkpointing import load_init, reading, store
from jaxrat.runtime.errors import UserError
from test_checkpoint_faults import _abstract, _files, _saved, _state


def _flip_a_bit(directory, step):
    biggest = max(_files(os.path.join(directory, str(step), "state")), key=os.path.getsize)
    data = bytearray(open(biggest, "rb").read())
    data[len(data) * 2 // 3] ^= 0x10  # inside the array bytes, which Orbax reads without an error
    open(biggest, "wb").write(data)


@pytest.mark.parametrize("damage", ["flipped bit", "truncated"])
def test_latest_skips_a_damaged_step_and_says_so_and_moves_nothing(tmp_path, caplog, damage):
    """load_init read a damaged newest checkpoint: a traceback, or (a flipped bit) wrong weights."""
    workdir = tmp_path / "run"
    directory = str(workdir / "checkpoints")
    _saved(directory, [1, 2])
    if damage == "truncated":
        for f in _files(os.path.join(directory, "2", "state")):
            os.truncate(f, 0)
    else:
        _flip_a_bit(directory, 2)
    with caplog.at_level(logging.WARNING):
        loaded = load_init(str(workdir), _abstract())
    np.testing.assert_array_equal(loaded["params"]["w"], _state(1)["params"]["w"])
    said = [r.getMessage() for r in caplog.records if "reading the previous complete step 1" in r.getMessage()]
    assert len(said) == 1 and os.path.join(directory, "2") in said[0], caplog.text
    assert store.committed_steps(directory) == [1, 2] and not os.path.exists(os.path.join(directory, "damaged"))
    with pytest.raises(UserError, match="cannot be read .*--step latest"):  # asked for by number: not replaced
        load_init(f"{workdir}:2", _abstract())
    assert not [n for n in os.listdir(workdir) if n.startswith(reading.PIN_PREFIX)]  # nothing left behind


def test_a_held_step_survives_the_training_rotating_it_away(tmp_path):
    workdir = tmp_path / "run"
    directory = str(workdir / "checkpoints")
    _saved(directory, [1, 2])
    with reading.open_checkpoint(str(workdir)) as opened:
        assert opened.step == 2
        shutil.rmtree(os.path.join(directory, "2"))  # the training's keep=1 removed it meanwhile
        loaded = load_init(opened.spec, _abstract(), opened=opened)
    np.testing.assert_array_equal(loaded["params"]["w"], _state(2)["params"]["w"])
    assert not [n for n in os.listdir(workdir) if n.startswith(reading.PIN_PREFIX)]


def test_a_step_gone_before_it_was_held_is_named_in_one_sentence(tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    directory = str(workdir / "checkpoints")
    _saved(directory, [1, 2])
    real = reading._pinned

    def rotated_first(d, step):  # the training removes the step between resolving and holding it
        shutil.rmtree(os.path.join(d, str(step)), ignore_errors=True)
        return real(d, step)

    monkeypatch.setattr(reading, "_pinned", rotated_first)
    with pytest.raises(UserError, match="step 2 .* was removed while it was read"):
        with reading.open_checkpoint(f"{workdir}:2"):
            pass


def test_a_dead_readers_pin_is_cleaned_up(tmp_path):
    import socket
    import subprocess

    workdir = tmp_path / "run"
    _saved(str(workdir / "checkpoints"), [1])
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = workdir / f"{reading.PIN_PREFIX}{socket.gethostname()}-{dead.pid}-abc"
    (stale / "1").mkdir(parents=True)
    with reading.open_checkpoint(str(workdir)):
        pass
    assert not stale.exists()


def test_an_evaluation_name_stays_inside_the_eval_folder(tmp_path):
    """--name accepted .. and absolute paths and wrote outside WORKDIR/eval."""
    from jaxrat.trainer.evaluation import eval_dir

    wd = str(tmp_path / "run")
    assert eval_dir(wd, "at48") == os.path.join(wd, "eval", "at48")
    assert eval_dir(wd, "tta/flip") == os.path.join(wd, "eval", "tta", "flip")
    for name in ("..", "../x", "a/../../x", "/tmp/elsewhere", "."):
        with pytest.raises(UserError, match="leads out of .*--out DIR"):
            eval_dir(wd, name)


def test_unwritable_says_why_and_leaves_nothing(tmp_path):
    from jaxrat.runtime.fileio import unwritable

    assert unwritable(tmp_path / "new" / "folder") is None and os.listdir(tmp_path / "new" / "folder") == []
    (tmp_path / "f").write_text("")
    assert unwritable(tmp_path / "f" / "x") == "Not a directory"
    assert unwritable("/sys/jaxrat_probe") is not None  # a filesystem that takes no files


def test_the_only_checkpoint_damaged_is_said_so_naming_the_real_folder(tmp_path):
    """The advice was to ask for another step, listing the damaged one, of a folder the reader had deleted."""
    workdir = tmp_path / "run"
    directory = str(workdir / "checkpoints")
    _saved(directory, [1])
    for f in _files(os.path.join(directory, "1", "state")):
        os.truncate(f, 0)
    with pytest.raises(UserError) as e:
        load_init(str(workdir), _abstract())
    message = str(e.value)
    assert message.startswith(f"The checkpoint {os.path.join(directory, '1')} cannot be read ("), message
    assert message.endswith(") and it is the run's only complete checkpoint; restore that folder from a copy, or "
                            "train the run again."), message
    assert reading.PIN_PREFIX not in message and "another step" not in message


def test_a_run_without_checkpoints_is_refused_in_words_that_fit_every_command(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(UserError) as e:
        store.resolve(str(tmp_path))
    assert str(e.value) == (f"{tmp_path / 'checkpoints'} holds no complete checkpoint; train that run first, or name "
                            "a run that saved one.")


def test_best_without_a_ranked_checkpoint_names_no_flag_spelling(tmp_path):
    _saved(str(tmp_path / "checkpoints"), [1])
    with pytest.raises(UserError, match=r"no ranked checkpoint .*; ask for the latest or a step number \(1\) "
                                        r"instead\.$"):
        store.resolve(f"{tmp_path}:best")


@pytest.mark.parametrize("step", ["foo", "-1", "1.5", "Latest "])
def test_an_invalid_step_is_refused_naming_the_values(step):
    from jaxrat.inference.checkpoint_choice import check_step

    with pytest.raises(UserError, match=rf"^--step {re.escape(step)} names no checkpoint; pass a step number \(0 or "
                                        r"more\), latest or best\.$"):
        check_step(step)
    for good in ("", "0", "20", "best", "latest"):
        check_step(good)
