"""A negative images-per-forward-pass is refused in one sentence, the same from ``jaxrat predict --batch``
and from ``Predictor(batch_size=...)``, before the run is read."""

import pytest

from jaxrat.inference.batch import check_batch
from jaxrat.inference.predictor import Predictor
from jaxrat.runtime.errors import UserError

SAID = "is negative; pass the images per forward pass (>= 1), or 0 for the run's evaluation batch."


def test_the_flag_and_the_keyword_are_refused_in_the_same_sentence(tmp_path):
    with pytest.raises(UserError) as flag:
        check_batch(-1)
    assert str(flag.value) == f"--batch -1 {SAID}"
    with pytest.raises(UserError) as keyword:
        Predictor(None, str(tmp_path / "no_run"), batch_size=-2)  # refused before the config or the run is read
    assert str(keyword.value) == f"batch_size=-2 {SAID}"
    for fine in (0, 1, 64):
        check_batch(fine)
        check_batch(fine, "batch_size")
