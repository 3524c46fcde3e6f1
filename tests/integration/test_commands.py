"""The ``jaxrat`` command: one subcommand per entry point, one flag style, help that reads as text,
configs by name from any folder, and config mistakes refused at load in one sentence."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxrat.cli import command_line
from jaxrat.cli.commands import COMMANDS
from jaxrat.config_schema import check_override_args, load_config
from jaxrat.runtime.errors import ConfigError
from runner import REPO, SMOKE, env_with_devices


def _run(*args: str, cwd: str = REPO, timeout: int = 120) -> subprocess.CompletedProcess:
    env = env_with_devices(1)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])  # from any folder, this checkout
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_top_level_help_lists_every_subcommand_in_one_line_each():
    proc = _run("-m", "jaxrat", "--help")
    assert proc.returncode == 0, proc.stderr
    for name in ("train", "evaluate", "predict", "export", "robustness", "sweep", "summarize", "tune", "report",
                 "launch", "checkpoints", "download"):
        assert any(line.split()[:1] == [name] for line in proc.stdout.splitlines()), name
    unknown = _run("-m", "jaxrat", "trian")
    assert unknown.returncode == 2 and "did you mean jaxrat train?" in unknown.stderr


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_help_exits_0_as_plain_text(name):
    proc = _run("-m", "jaxrat", name, "--help")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage:" in proc.stdout
    assert "``" not in proc.stdout and ":mod:" not in proc.stdout and ":func:" not in proc.stdout


def test_a_subcommand_is_its_module(tmp_path):
    missing = str(tmp_path / "nothing")
    a = _run("-m", "jaxrat", "checkpoints", missing)
    b = _run("-m", "jaxrat.checkpoints", missing)
    assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr)
    assert a.returncode == 2 and a.stderr.count("jaxrat: error:") == 1


@pytest.mark.parametrize("flag", ["--save-predictions", "--save_predictions", "--no-per-image", "--noper_image"])
def test_both_flag_spellings_are_accepted(tmp_path, flag):
    # The flag parses: the command goes on to the one sentence about the missing run.
    proc = _run("-m", "jaxrat", "evaluate", f"--workdir={tmp_path}", flag)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config.json not found" in proc.stderr and "Traceback" not in proc.stderr


def test_respelling_leaves_overrides_and_the_tail_alone():
    argv = ["--gpus_per_node=2", "--config.data.batch_size=4", "--dry_run", "--", "--save_predictions"]
    assert command_line.argparse_style(argv) == ["--gpus-per-node=2", "--config.data.batch_size=4", "--dry-run",
                                                 "--", "--save_predictions"]
    assert command_line.plain("see :mod:`jaxrat.x` and ``--flag``") == "see jaxrat.x and --flag"


def test_packaged_config_by_name_equals_the_clone_file():
    assert load_config("isic:smoke").to_dict() == load_config(SMOKE).to_dict()
    assert load_config("isic.py:demo").to_dict() == load_config(f"{REPO}/configs/isic.py:demo").to_dict()
    with pytest.raises(ConfigError, match=r"isic, isic_multiscale, segmentation\), e.g. --config isic:demo"):
        load_config("nosuch:demo")


def test_list_configs_names_every_config_and_its_variants():
    proc = _run("-m", "jaxrat", "train", "--list-configs")
    assert proc.returncode == 0, proc.stderr
    assert "isic " in proc.stdout and "demo, smoke, unet" in proc.stdout and "coco " in proc.stdout


def test_config_json_is_a_config(tmp_path):
    from jaxrat.trainer.workdir import config_as_json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_as_json(load_config(SMOKE))))
    assert load_config(str(path)).to_dict() == load_config(SMOKE).to_dict()
    with pytest.raises(ConfigError, match="has no variants"):
        load_config(f"{path}:demo")


@pytest.mark.parametrize("arg, needle", [
    ("--config.data.random_crop_scale=0.5", "is not a range (low, high)"),
    ("--config.data.scale_jitter=(1.2, 0.8)", "low <= high"),
    ("--config.task.heads=label", "is not a tuple; pass a value like the field's default, ('shape', 'kind')."),
    ("--config.model.features=('a', 'b')", "is not a tuple of numbers"),
    ("--config.train.log_every=0.5", "is not an integer"),
])
def test_a_value_of_the_wrong_shape_is_refused_naming_the_field(arg, needle):
    config = "configs/classification.py:smoke" if ".task.heads" in arg or "features" in arg else SMOKE
    key = arg.split("=")[0].replace(".", r"\.")
    with pytest.raises(ConfigError, match="^" + key) as e:
        check_override_args([f"--config={config}", arg])
    assert needle in str(e.value)
    check_override_args([f"--config={config}", "--config.data.random_crop_scale=(0.5, 1.0)",
                         "--config.mesh.axes=(('data', 2),)"])


def test_train_from_outside_the_clone_by_name_refuses_a_bad_range_before_the_workdir(tmp_path):
    proc = _run("-m", "jaxrat", "train", "--config", "isic:smoke", "--workdir", "w",
                "--config.data.random_crop_scale=0.5", cwd=str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("jaxrat: error: --config.data.random_crop_scale=0.5")
    assert "Traceback" not in proc.stderr and not (tmp_path / "w").exists()


def test_a_trained_runs_overrides_are_checked_alike(tmp_path):
    from jaxrat.config_schema import load_run_config
    from jaxrat.trainer.workdir import config_as_json

    (tmp_path / "config.json").write_text(json.dumps(config_as_json(load_config(SMOKE))))
    with pytest.raises(ConfigError, match=r"^--config\.data\.scale_jitter=0\.9 is not a range"):
        load_run_config(str(tmp_path), ["--config.data.scale_jitter=0.9"])
    assert load_run_config(str(tmp_path), ["--config.data.scale_jitter=(0.9, 1.1)"]).data.scale_jitter == (0.9, 1.1)


@pytest.mark.parametrize("args, sentence", [
    (["predict", "--wokdir=x", "--input=y", "--out=z"], "Unknown flag --wokdir; did you mean --workdir?"),
    (["predict", "--input=y", "--out=z"], "Pass --workdir: it is required (--help says what it takes)."),
    (["train", "--config", "isic:smoke", "--workdri=w"], "Unknown flag --workdri; did you mean --workdir?"),
    (["predict", "--workdir=x", "--images=y", "--out=z"], "Unknown flag --images; did you mean --input?"),
    (["export", "--workdir=x", "--output=z"], "Unknown flag --output; did you mean --out?"),
    (["predict", "--workdir=x", "--input=y", "--out=z", "--batch", "abc"],
     "--batch=abc is not an integer; pass an integer (--help says what it takes)."),
    (["evaluate", "--workdir=x", "--overlap=half"], "--overlap=half is not a number; pass a number (--help says "
                                                   "what it takes)."),
    (["predict", "--workdir=x", "--input=y", "--out=z", "--save_probs=bmp"],
     "--save_probs=bmp: value should be one of <|png16|npy>; --help says what it takes."),
])
def test_flag_mistakes_are_one_sentence(args, sentence):
    proc = _run("-m", "jaxrat", *args)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == f"jaxrat: error: {sentence}"
    assert "FATAL" not in proc.stderr


def test_every_listed_variant_loads():
    from jaxrat.config_schema.packaged import load_config_module, packaged_configs

    for name in packaged_configs():
        for variant in load_config_module(name).VARIANTS:
            load_config(f"{name}:{variant}" if variant else name)


def test_a_hand_edited_tasks_own_field_is_one_sentence_in_every_command_that_reads_the_run(tmp_path):
    """evaluate, predict, export and train --config WORKDIR/config.json (the resume) read the task's own
    fields as they were: task.num_classes "three" ended in a traceback. Each now stops at the read, in one
    sentence, before anything is written (the workdir keeps its one file, no --out is made)."""
    from PIL import Image

    from jaxrat.trainer.workdir import config_as_json

    config = config_as_json(load_config("configs/classification.py:smoke"))
    config["task"]["num_classes"] = "three"
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps(config, indent=2))
    image = tmp_path / "photo.png"
    Image.new("RGB", (16, 16)).save(image)
    sentence = (f"jaxrat: error: {workdir / 'config.json'}: task.num_classes is \"three\", not a list; put back the "
                f"value the run was trained with (the packaged config classification has [0]).")
    out = tmp_path / "out"
    for args in (["evaluate", f"--workdir={workdir}", f"--out={out}"],
                 ["predict", f"--workdir={workdir}", f"--input={image}", f"--out={out}"],
                 ["export", f"--workdir={workdir}", f"--out={out}"],
                 ["train", f"--config={workdir / 'config.json'}", f"--workdir={workdir}"]):
        proc = _run("-m", "jaxrat", *args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr[-3000:])
        assert proc.stderr.strip().splitlines()[-1] == sentence, (args, proc.stderr[-2000:])
        assert os.listdir(workdir) == ["config.json"] and not out.exists(), args
