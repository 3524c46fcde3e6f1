"""Using a trained model: :class:`~jaxrat.inference.predictor.Predictor` (imported on first use, so
:mod:`jaxrat.inference.exported` stays free of jaxrat's model code)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxrat.inference.predictor import Prediction, Predictor

__all__ = ["Prediction", "Predictor"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from jaxrat.inference import predictor

        return getattr(predictor, name)
    raise AttributeError(f"module 'jaxrat.inference' has no attribute {name!r}")
