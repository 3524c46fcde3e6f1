"""Images per forward pass, as ``jaxrat predict --batch`` and ``Predictor(batch_size=...)`` take it:
one check, so the command line and the Python API refuse a negative value in the same sentence."""

from __future__ import annotations

from jaxrat.runtime.errors import UserError


def check_batch(batch: int, name: str = "--batch") -> None:
    """Refuse a negative ``batch`` (0 is the run's ``data.eval_batch_size``); ``name`` is how the
    sentence names the setting: a flag (``--batch -1``) or a keyword argument (``batch_size=-1``)."""
    if batch < 0:
        given = f"{name} {batch}" if name.startswith("--") else f"{name}={batch}"
        raise UserError(f"{given} is negative; pass the images per forward pass (>= 1), or 0 for the run's "
                        f"evaluation batch.")
