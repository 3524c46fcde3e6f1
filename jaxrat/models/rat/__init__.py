"""The Resolution Aware Transformer: its config, backbone, layers and the segmenter.

The paper's math, and nothing of a machine: how each operation is computed is the kernel policy's
business (:mod:`jaxrat.ops`).
"""

from jaxrat.models.rat.backbone import AbsolutePositionEmbedding, ResolutionAwareTransformer, ScaleOutput
from jaxrat.models.rat.config import RATConfig, rat_config
from jaxrat.models.rat.segmenter import RATSegmenter, rat_from_config

__all__ = ["AbsolutePositionEmbedding", "RATConfig", "RATSegmenter", "ResolutionAwareTransformer", "ScaleOutput",
           "rat_config", "rat_from_config"]
