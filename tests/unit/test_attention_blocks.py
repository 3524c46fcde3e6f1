"""benchmarks/attention_blocks.py: the block-size sweep runs, and its choice is the least slowdown."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import load


@pytest.fixture(scope="module")
def ab():
    return load("attention_blocks")


def test_choose_takes_the_least_geometric_mean_slowdown(ab):
    rows = [dict(shape="a", block=1, seconds=1.0), dict(shape="a", block=2, seconds=1.2),
            dict(shape="a", block=4, seconds=3.0),
            dict(shape="b", block=1, seconds=4.0), dict(shape="b", block=2, seconds=2.0),
            dict(shape="b", block=4, seconds=2.1)]
    # slowdowns: block 1 -> (1, 2), block 2 -> (1.2, 1), block 4 -> (3, 1.05)
    assert ab.choose(rows) == 2
    # a block not measured on every shape cannot be chosen, however fast
    assert ab.choose(rows + [dict(shape="a", block=8, seconds=0.1)]) == 2


def test_shapes_follow_the_rat_first_layer(ab):
    s = ab.shapes(size=128, batch=2, heads=8, head_dim=16, window=16)
    assert s["dense SGA, layer 1"] == dict(slices=16, queries=43 * 43, keys=128 * 128, grouping=True)
    assert s["windowed MR, block 1"]["slices"] == 16 * 9
    assert ab.shapes(size=24, batch=1, heads=1, head_dim=4, window=16)["windowed MR, block 1"]["queries"] == 64


def test_a_tiny_sweep_writes_its_table_and_choice(ab, tmp_path, capsys):
    out = tmp_path / "ab.json"
    ab.main(["--size", "12", "--batch", "1", "--heads", "2", "--head-dim", "4", "--blocks", "64", "4096",
             "--reps", "1", "--matmul", "64", "--out", str(out)])
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 6 and result["chosen_block"] in (64, 4096)
    assert all(r["seconds"] > 0 and r["ratio"] > 0 for r in result["rows"])
    assert min(r["vs_best"] for r in result["rows"]) == 1.0
    assert "| dense SGA, layer 1 | 2 x 16 x 144 |" in capsys.readouterr().out
