"""The model families tests/integration/test_onnx_models.py leaves out, converted to ONNX the same way:
TransUNet, Swin-UNet, the U-Net, the CNN, RAT and BEiT classifiers, DETR on its CNN with the focal
post-processing (~40 s on 2 cores: outside CI's run)."""

import pytest

pytest.importorskip("onnxruntime")

from test_onnx_models import DETR_VARIANTS, HERE, MODELS, detr_converts, model_converts  # noqa: E402


@pytest.mark.parametrize("name", sorted(set(MODELS) - set(HERE)))
def test_model_converts(name):
    model_converts(name)


@pytest.mark.parametrize("backbone,focal", DETR_VARIANTS[1:])
def test_detr_converts_with_its_postprocessing(backbone, focal):
    detr_converts(backbone, focal)
