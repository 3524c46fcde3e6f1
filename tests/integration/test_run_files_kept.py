"""What a training run leaves alone: a finished run's results when the same command runs again, and
the files of a folder that is not a jaxrat run when a new run starts in it."""

import os

import pytest

from runner import run_main

STEPS = ["--config.num_train_steps=2", "--config.train.eval_every=2"]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.integration
def test_a_finished_run_started_again_keeps_its_summary(tmp_path):
    wd = str(tmp_path / "run")
    run_main(wd, *STEPS)
    kept = {n: _read(os.path.join(wd, n)) for n in ("summary.json", "summary.md")}
    assert b'"last_eval": {}' not in kept["summary.json"]  # the finished run's metrics are there to lose
    proc = run_main(wd, *STEPS)
    assert "nothing to do: workdir already at step 2 of 2" in proc.stderr + proc.stdout
    assert {n: _read(os.path.join(wd, n)) for n in kept} == kept


@pytest.mark.integration
def test_a_new_run_in_a_folder_of_the_users_keeps_its_files_aside(tmp_path):
    wd = tmp_path / "mine"
    wd.mkdir()
    mine = {"summary.md": b"my own summary\n", "curves.png": b"my own picture", "metrics.jsonl": b"{}\n",
            "notes.txt": b"my notes\n"}
    for name, data in mine.items():
        (wd / name).write_bytes(data)
    run_main(str(wd), *STEPS)
    assert (wd / "notes.txt").read_bytes() == mine["notes.txt"]  # not a name the run writes: left as it is
    for name in ("summary.md", "curves.png", "metrics.jsonl"):
        stem, ext = os.path.splitext(name)
        aside = [p for p in wd.iterdir() if p.name.startswith(stem + ".") and p.name.endswith(ext) and p.name != name]
        assert [p.read_bytes() for p in aside] == [mine[name]], name  # the user's file, renamed
    assert (wd / "summary.md").read_bytes().startswith(b"# Run summary")  # the run's own
