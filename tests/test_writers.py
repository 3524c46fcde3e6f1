"""The progress line."""


def test_progress_line_shows_the_window_rates_and_an_eta():
    from jaxrat.tracking.writers import format_progress

    line = format_progress(40, 400, {"train/loss": 0.5, "train/learning_rate": 1e-3, "train/steps_per_sec": 3.4,
                                     "train/examples_per_sec": 54.4}, elapsed=36.0, done=40)
    assert line == "step 40/400 (10%) loss 0.5000 lr 1.0e-03 3.40 steps/s 54 ex/s ETA 00:05:24"
