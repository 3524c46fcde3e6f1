"""The progress line."""


def test_progress_line_shows_the_window_rates_and_an_eta():
    from jaxrat.tracking.writers import format_progress

    line = format_progress(40, 400, {"train/loss": 0.5, "train/learning_rate": 1e-3, "train/steps_per_sec": 3.4,
                                     "train/examples_per_sec": 54.4}, elapsed=36.0, done=40)
    assert line == "step 40/400 (10%) loss 0.5000 lr 1.0e-03 3.40 steps/s 54 ex/s ETA 00:05:24"


def test_a_full_disk_costs_a_warning_and_never_half_a_line(tmp_path, monkeypatch, caplog):
    import json
    import os

    from jaxrat.tracking.writers import MetricWriter

    writer = MetricWriter(str(tmp_path), is_main=True)
    writer.write_scalars(1, {"train/loss": 1.0})
    real_write = os.write

    def half(fd, data):  # the disk fills up midway through the line
        return real_write(fd, data[: len(data) // 2])

    monkeypatch.setattr(os, "write", half)
    writer.write_scalars(2, {"train/loss": 2.0})
    writer.write_scalars(3, {"train/loss": 3.0})
    monkeypatch.setattr(os, "write", real_write)
    writer.write_scalars(4, {"train/loss": 4.0})
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 4]
    assert caplog.text.count("cannot write") == 1 and "writing again" in caplog.text
