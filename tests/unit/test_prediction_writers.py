"""What predict writes for one segmentation image: a multi-class run's probabilities as one (H, W, C) array."""

import numpy as np
import pytest

from jaxrat.inference.predictor import Prediction
from jaxrat.inference.writers import write_segmentation
from jaxrat.runtime.errors import UserError


def _multiclass(h=5, w=7, c=3):
    p = np.random.default_rng(0).dirichlet(np.ones(c), (h, w)).astype(np.float32)
    labels = p.argmax(-1).astype(np.uint8)
    return Prediction(w, h, probability=p.max(-1), mask=labels > 0, labels=labels, class_probabilities=p)


def test_multiclass_npy_holds_every_class_probability(tmp_path):
    pred = _multiclass()
    image = np.zeros((5, 7, 3), np.uint8)
    write_segmentation(str(tmp_path), "sub/a", image, pred, "npy", ("background", "b", "c"))
    saved = np.load(tmp_path / "probs" / "sub" / "a.npy")
    assert saved.dtype == np.float32 and saved.shape == (5, 7, 3)
    np.testing.assert_array_equal(saved, pred.class_probabilities)
    assert (tmp_path / "masks" / "sub" / "a.png").exists()


def test_multiclass_png16_is_refused_naming_npy(tmp_path):
    with pytest.raises(UserError, match=r"this run predicts 3 classes; pass --save_probs npy"):
        write_segmentation(str(tmp_path), "a", np.zeros((5, 7, 3), np.uint8), _multiclass(), "png16")
