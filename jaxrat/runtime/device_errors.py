"""XLA's runtime errors a user can act on, turned into the one sentence jaxrat ends with.

A step that does not fit the accelerator's memory is the commonest mistake on a GPU, and XLA reports
it as a ``JaxRuntimeError`` (``RESOURCE_EXHAUSTED``) with a traceback and an allocation dump; a fused
kernel that fails to compile or run on a GPU names Triton or Pallas. Both end here with what to
change. XLA's own message is logged first, whole up to a length, for anyone who wants the detail.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Optional

from jaxrat.runtime.errors import UserError

MAX_LOGGED = 4000  # characters of XLA's message kept in the log (allocation dumps run to pages)
_KERNEL_WORDS = ("triton", "pallas", "ptxas")


def _first_line(text: str) -> str:
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line if len(line) <= 200 else line[:197] + "..."


def explain(error: BaseException, batch_advice: str) -> Optional[UserError]:
    """The sentence for ``error`` when it is an XLA runtime error a user can fix, else None.

    ``batch_advice`` names the batch knob of the command that failed and its value, e.g.
    ``"--config.data.batch_size (now 64)"``; it ends the out-of-memory sentence's first remedy."""
    import jax

    if not isinstance(error, jax.errors.JaxRuntimeError):
        return None
    text = str(error)
    if "RESOURCE_EXHAUSTED" in text:
        logging.warning("XLA: %s", text[:MAX_LOGGED])
        return UserError(
            f"The devices ran out of memory ({_first_line(text)}); lower {batch_advice}, or let jaxrat size "
            f"the batch to the memory (--config.data.per_device_batch_size=auto), or shard the parameters "
            f"and optimizer state over the devices (--config.sharding.zero=3).")
    if any(word in text.lower() for word in _KERNEL_WORDS):
        logging.warning("XLA: %s", text[:MAX_LOGGED])
        return UserError(
            f"One of jaxrat's fused GPU kernels failed ({_first_line(text)}); rerun with "
            f"--config.model.kernels=portable, which uses XLA's own kernels, and please report the error "
            f"logged above.")
    return None


def training_batch_advice(config) -> str:
    """:func:`explain`'s advice for a training run of ``config``: the batch, and the evaluation's."""
    data = config.data
    return (f"--config.data.batch_size (now {data.batch_size}) or, if it stopped in an evaluation, "
            f"--config.data.eval_batch_size (now {data.get('eval_batch_size', data.batch_size)})")


@contextlib.contextmanager
def in_a_sentence(batch_advice: Callable[[], str]) -> Iterator[None]:
    """Re-raise what :func:`explain` explains inside the block as its :class:`UserError`, with the
    advice ``batch_advice()`` gives (called only then); anything else passes through as it is."""
    try:
        yield
    except Exception as e:
        why = explain(e, batch_advice())
        if why is None:
            raise
        raise why from None
