"""A run's config.json read back as a config: its values checked against the schema's kinds, a missing
field taking its default, each mistake one sentence naming the key, the file and what was expected."""

import json
import os
import re

import pytest

from jaxrat.config_schema import field, load_config
from jaxrat.runtime.errors import ConfigError
from runner import REPO, SMOKE


def _write(tmp_path, edit, spec=SMOKE):
    """A config.json as training writes it (the smoke config, or ``spec``), changed by ``edit`` (a dict -> None)."""
    raw = json.loads(load_config(spec).to_json_best_effort())
    edit(raw)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _set(key, value):
    def edit(raw):
        *parents, leaf = key.split(".")
        for p in parents:
            raw = raw[p]
        raw[leaf] = value
    return edit


@pytest.mark.parametrize("key, value, expected", [
    ("num_train_steps", "30", "an integer"),
    ("num_train_steps", 30.0, "an integer"),
    ("optimizer.learning_rate", True, "a number"),
    ("data.random_flip", "yes", "true or false"),
    ("model.name", 3, "a string (in double quotes)"),
    ("data.random_crop_scale", [1.0, 0.5], "a range [low, high] with low <= high"),
    ("mesh.axes", [["data", -1], "fsdp"], "a list of lists"),
    ("tracking.backends", "jsonl", "a list"),
])
def test_a_wrong_kind_is_one_sentence_naming_key_file_and_kind(tmp_path, key, value, expected):
    path = _write(tmp_path, _set(key, value))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    message = str(e.value)
    assert message.startswith(f"{path}: {key} is {json.dumps(value)}, not {expected};"), message
    assert message.count(". ") == 0 and message.endswith("."), message


def test_a_section_that_is_not_an_object_is_refused(tmp_path):
    path = _write(tmp_path, _set("data", 5))
    with pytest.raises(ConfigError, match=r"config\.json: data is 5, not a section of fields"):
        load_config(path)


def test_missing_fields_take_their_defaults_and_good_values_load(tmp_path):
    def edit(raw):
        del raw["num_train_steps"]  # from an older jaxrat, or deleted by hand
        del raw["optimizer"]["ema_warmup"]  # a field added later: what the older jaxrat did
        del raw["tracking"]
        raw["optimizer"]["learning_rate"] = 1  # an integer for a float field
    config = load_config(_write(tmp_path, edit))
    assert config.num_train_steps == 1000  # read directly: filled in
    # A section's field, or a section, stays missing as saved; its readers take the default.
    assert "ema_warmup" not in config.optimizer and field(config.optimizer, "optimizer.ema_warmup") is False
    assert "tracking" not in config
    assert config.optimizer.learning_rate == 1.0 and isinstance(config.optimizer.learning_rate, float)
    assert config.mesh.axes == load_config(SMOKE).mesh.axes


def test_the_task_and_models_own_fields_are_kept(tmp_path):
    config = load_config(_write(tmp_path, lambda raw: None))
    smoke = load_config(SMOKE)
    assert config.task.to_dict() == json.loads(smoke.task.to_json_best_effort())


@pytest.mark.parametrize("name", ["my.yaml", "photo.png", "settings.cfg"])
def test_a_file_neither_python_nor_json_is_one_sentence(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"\x89PNG\r\n" if name.endswith(".png") else b"num_train_steps: 30\n")
    with pytest.raises(ConfigError, match=rf"--config {re.escape(str(path))} is neither a Python config file "
                                          r"\(\.py, defining get_config\(\)\) nor a run's config\.json"):
        load_config(str(path))


def test_a_run_folder_names_its_config_json(tmp_path):
    run = tmp_path / "run1"
    run.mkdir()
    (run / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        load_config(str(run))
    assert str(e.value) == (f"--config {run} is a folder, not a config file; pass {run / 'config.json'} to train "
                            "with that run's config.")


def test_a_folder_is_not_said_to_be_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"is a folder, not a config file; pass a config file's path \(\.py\), "
                                          r"a run's config\.json or a packaged config's name \(ablations, "):
        load_config(str(tmp_path))


def test_a_packaged_name_wins_over_a_folder_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "coco").mkdir()  # the dataset, say
    packaged = load_config(os.path.join(REPO, "configs", "coco.py") + ":smoke")
    assert load_config("coco:smoke").to_dict() == packaged.to_dict()


@pytest.mark.parametrize("key, value", [("data.image_size", -32), ("data.eval_batch_size", 0)])
def test_a_hand_edited_size_below_one_is_one_sentence_for_the_commands_that_read_a_run(tmp_path, key, value):
    """evaluate, predict and export on a run whose config.json was edited to image_size -32 ended in a
    traceback from the data pipeline (ValueError: negative dimensions are not allowed)."""
    from jaxrat.config_schema.run_config import load_run_config

    _write(tmp_path, _set(key, value))
    with pytest.raises(ConfigError, match=rf"^config\.{re.escape(key)}={value} must be 1 or more; ") as e:
        load_run_config(str(tmp_path))
    assert "\n" not in str(e.value)
    assert load_run_config(str(tmp_path), [f"--config.{key}=16"]).data[key.split(".")[1]] == 16  # the fix it names


@pytest.mark.parametrize("section", ["model", "data", "task", "train", "optimizer", "checkpoint", "mesh", "sharding",
                                     "distributed"])
def test_a_section_deleted_by_hand_is_one_sentence_naming_it(tmp_path, section):
    """train --config WORKDIR/config.json, evaluate, predict and export ended in AttributeError: "'model'"."""
    from jaxrat.config_schema.run_config import load_run_config

    path = _write(tmp_path, lambda raw: raw.pop(section))
    for load in (lambda: load_config(path), lambda: load_run_config(str(tmp_path))):
        with pytest.raises(ConfigError, match=rf"^{re.escape(path)} has no {section} section; ") as e:
            load()
        assert "\n" not in str(e.value) and str(e.value).count(". ") == 0


def test_the_sections_the_readers_default_may_be_missing(tmp_path):
    load_config(_write(tmp_path, lambda raw: (raw.pop("tracking"), raw.pop("workdir"))))


def test_a_field_this_jaxrat_lacks_is_warned_about_with_the_close_one(tmp_path, caplog):
    """A hand-edited typo (train.evl_every) was ignored without a word: the run evaluated on the old
    schedule. Warned about (a newer jaxrat's config.json still loads); the task's own fields are not."""
    import logging

    def edit(raw):
        raw["train"]["evl_every"] = 5
        raw["optimizer"]["learning_rat"] = 0.1
        raw["sharding"]["zero"] = 1
        raw["task"]["a_field_of_my_task"] = 3  # the task's and model's own fields are not jaxrat's to judge
        raw["model"]["depth_of_mine"] = 2
        raw["seeds"] = 4
    with caplog.at_level(logging.WARNING):
        config = load_config(_write(tmp_path, edit))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 3, warned
    assert "learning_rat is not a field of this jaxrat's config and is ignored (a typo: did you mean " \
           "optimizer.learning_rate?" in warned[0]
    assert "seeds is not a field" in warned[1] and "did you mean seed?" in warned[1]
    assert "train.evl_every" in warned[2] and "train.eval_every" in warned[2]
    assert config.sharding.zero == 1
    caplog.clear()
    from jaxrat.config_schema.packaged import load_config_module, packaged_configs

    with caplog.at_level(logging.WARNING):  # a config.json as training writes it, of every packaged config: no word
        for name in packaged_configs():
            for variant in load_config_module(name).VARIANTS:
                saved = load_config(f"{name}:{variant}" if variant else name).to_json_best_effort(sort_keys=True)
                (tmp_path / "config.json").write_text(saved)
                load_config(str(tmp_path / "config.json"))
    assert not caplog.records


CLASSIFICATION = os.path.join(REPO, "configs", "classification.py") + ":smoke"
COCO = os.path.join(REPO, "configs", "coco.py") + ":smoke"


@pytest.mark.parametrize("spec, key, value, expected", [
    (SMOKE, "task.threshold", "three", "a number"),
    (SMOKE, "model.num_classes", [3], "an integer"),
    (SMOKE, "task.eval_original_resolution", "yes", "true or false"),
    (SMOKE, "model.features", "x", "a list"),
    (CLASSIFICATION, "task.num_classes", "three", "a list"),
    (CLASSIFICATION, "task.num_classes", ["a", "b"], "a list of numbers"),
    (CLASSIFICATION, "task.top_k", 2.5, "an integer"),
    (CLASSIFICATION, "data.train_csv", 3, "a string (in double quotes)"),
    (COCO, "model.num_queries", [10], "an integer"),
    (COCO, "model.rat.feature_dims", "64", "an integer"),
    (COCO, "task.focal", "yes", "true or false"),
    (COCO, "data.synthetic_classes", {"a": 1}, "an integer"),
    (COCO, "model.rat", 5, "a section of fields"),
])
def test_a_wrong_kind_in_a_tasks_own_field_is_one_sentence(tmp_path, spec, key, value, expected):
    """The fields a task, its model and its data add (not in the schema) were read as they were: a
    string where a number belongs ended in a traceback in evaluate, predict, export or the resume. They
    are checked by the kinds the packaged configs give them, before anything is written."""
    from jaxrat.config_schema.run_config import load_run_config

    path = _write(tmp_path, _set(key, value), spec)
    for load in (lambda: load_config(path), lambda: load_run_config(str(tmp_path))):
        with pytest.raises(ConfigError) as e:
            load()
        message = str(e.value)
        assert message.startswith(f"{path}: {key} is {json.dumps(value)}, not {expected}; put back the "), message
        assert message.count(". ") == 0 and message.endswith(".") and "\n" not in message, message


def test_a_tasks_own_fields_keep_what_the_configs_leave_open(tmp_path):
    def edit(raw):
        raw["task"]["threshold"] = 1  # an integer where the configs have a float: read as one
        raw["task"]["a_field_of_my_task"] = "anything"  # in no packaged config: not jaxrat's to judge
    config = load_config(_write(tmp_path, edit))
    assert config.task.threshold == 1.0 and isinstance(config.task.threshold, float)
    assert config.task.a_field_of_my_task == "anything"

    def edit_detr(raw):
        raw["model"]["query_level"] = 1  # None in some configs: any value
        raw["model"]["rat"]["attention"] = ["sparse", "sparse", "dense", "dense"]  # declared of any type
    config = load_config(_write(tmp_path, edit_detr, COCO))
    assert config.model.query_level == 1 and config.model.rat.attention == ("sparse", "sparse", "dense", "dense")
