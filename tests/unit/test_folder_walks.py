"""Folder walks follow links to folders but enter each real folder once: a link loop in a predict
input, a glob or a TFDS folder ends at once and lists every file once (the staging walk is in
test_staging.py)."""

import os

import pytest

from jaxrat.data.sources import tfds as tfds_source
from jaxrat.inference.inputs import expand_inputs
from jaxrat.runtime import folders
from jaxrat.runtime.errors import DataError


def _looped(root):
    """in/x.png, in/sub/y.png, and two links back to in/ (2**40 paths for a walk that follows both)."""
    os.makedirs(os.path.join(root, "sub"))
    for rel in ("x.png", os.path.join("sub", "y.png")):
        with open(os.path.join(root, rel), "wb") as f:
            f.write(b"not decoded here")
    os.symlink(".", os.path.join(root, "a"))
    os.symlink("..", os.path.join(root, "sub", "b"))
    return root


@pytest.mark.timeout(30)
def test_predict_inputs_in_a_folder_with_link_loops_are_each_listed_once(tmp_path):
    root = _looped(str(tmp_path / "in"))
    assert [i.name for i in expand_inputs(root)] == ["sub/y.png", "x.png"]


@pytest.mark.timeout(30)
def test_a_recursive_glob_through_link_loops_ends_and_matches_like_glob(tmp_path):
    root = _looped(str(tmp_path / "in"))
    (tmp_path / "in" / ".hidden").mkdir()
    (tmp_path / "in" / ".hidden" / "z.png").write_bytes(b"")
    assert [i.name for i in expand_inputs(os.path.join(root, "**", "*.png"))] == ["sub/y.png", "x.png"]
    assert folders.glob_files(os.path.join(root, "**", "y.png")) == [os.path.join(root, "sub", "y.png")]
    assert folders.glob_files(os.path.join(root, "*.png")) == [os.path.join(root, "x.png")]


def test_a_linked_folder_is_followed_and_named_by_its_link(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "m.png").write_bytes(b"")
    (tmp_path / "in").mkdir()
    os.symlink(outside, tmp_path / "in" / "masks")
    os.symlink(outside, tmp_path / "in" / "masks_again")  # the same real folder: listed once
    assert [i.name for i in expand_inputs(str(tmp_path / "in"))] == ["masks/m.png"]


@pytest.mark.timeout(30)
def test_the_tfds_prepared_check_ends_in_a_folder_with_a_link_loop(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    root = tmp_path / "tfds" / "isic"
    root.mkdir(parents=True)
    os.symlink(".", root / "a")
    os.symlink(".", root / "b")
    with pytest.raises(DataError, match="no dataset_info.json"):
        tfds_source.data_source("isic", "train", str(tmp_path / "tfds"))
