"""Whether a value is of its field's kind: a command line's ``--config.KEY=VALUE`` (:func:`check_value`), a
value read from a config.json (:func:`json_misfit`), and the sizes and periods that must be 1 or more
(:func:`check_counts`). A field's kind is its default's; a tuple's items are of its default items' kind."""

from __future__ import annotations

import ast
from typing import Any

import ml_collections as mlc

from jaxrat.runtime.errors import ConfigError


def json_misfit(key: str, value: Any, reference: Any) -> str | None:
    """What the field ``key`` should hold, in JSON's words ("an integer", "a list of numbers"), where
    ``value`` (read from JSON) is not of the kind of ``reference`` (its default); None where it is."""
    kind = json_kind(reference)
    if kind is int:
        return None if json_kind(value) is int else "an integer"  # a step count, a size: 30, not 30.0
    if kind is float:
        return None if json_kind(value) in (int, float) else "a number"
    if kind is tuple:
        return _json_list_misfit(key, value, reference)
    if json_kind(value) is not kind:
        return {bool: "true or false", str: "a string (in double quotes)"}.get(kind, f"a {kind.__name__}")
    return None


def json_kind(value: Any) -> type:
    """The kind a JSON value (or a schema default) is checked as: bool, int, float, str, tuple (lists) or other."""
    if isinstance(value, bool):
        return bool
    if isinstance(value, (tuple, list)):
        return tuple
    return type(value)


def _json_list_misfit(key: str, value: Any, schema_value: tuple) -> str | None:
    """What a tuple field expects where ``value`` (from JSON) does not fit it, in JSON's words; None where it fits."""
    misfit = _sequence_misfit(key, value, schema_value)
    if misfit is None:
        return None
    return misfit.replace("tuple", "list").replace("(low, high)", "[low, high]")


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
# Fields whose value is a (low, high) range: two numbers, low <= high.
RANGES = {"data.random_crop_scale", "data.scale_jitter"}


def _kind(value: object) -> type:
    if isinstance(value, bool):
        return bool
    if isinstance(value, (int, float)):
        return float
    if isinstance(value, (tuple, list)):
        return tuple
    return type(value)


def _wrong(key: str, raw: str, what: str, current: object) -> ConfigError:
    return ConfigError(f"--config.{key}={raw} is not {what}; pass a value like the field's default, {current!r}.")


def _check_sequence(key: str, current: tuple | list, raw: str) -> None:
    """A tuple field takes a Python literal tuple (or list) whose items are of the default's kind."""
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        raise _wrong(key, raw, "a tuple", current) from None
    misfit = _sequence_misfit(key, value, current)
    if misfit:
        raise _wrong(key, raw, misfit, current)


def _sequence_misfit(key: str, value: object, current: tuple | list) -> str | None:
    """What a tuple field expects where ``value`` does not fit it: a range is two ordered numbers, other
    tuples hold items of the default's kind; None where it fits."""
    if key in RANGES:
        fits = (isinstance(value, (tuple, list)) and len(value) == 2 and all(_kind(v) is float for v in value)
                and value[0] <= value[1])
        return None if fits else "a range (low, high) with low <= high"
    if not isinstance(value, (tuple, list)):
        return "a tuple"
    kinds = {_kind(v) for v in current}
    if len(kinds) == 1 and value and any(_kind(v) not in kinds for v in value):
        plural = {float: "numbers", str: "strings", tuple: "tuples", bool: "booleans"}.get(_kind(current[0]), "items")
        return f"a tuple of {plural}"
    return None


# Sizes and periods that must be 1 or more, and what to set instead. Below 1 each failed deep in
# the data pipeline or the loop with a traceback (negative dimensions, a batch of 0, a modulo by
# zero), most of them after the first checkpoint was written; eval_every=-1 evaluated every step.
COUNTS = {
    "data.image_size": ("the side the images are resized to", 256),
    "data.batch_size": ("the global batch", 32),
    "data.eval_batch_size": ("the evaluation's global batch", 32),
    "train.log_every": ("the steps between progress lines", 10),
    "train.eval_every": ("the steps between evaluations (num_train_steps evaluates once, at the end)", 200),
}


def check_counts(config: mlc.ConfigDict) -> None:
    """Refuse a size or period of :data:`COUNTS` below 1 (an integer: the config's kind check ran first)."""
    for key, (what, example) in COUNTS.items():
        section, name = key.split(".")
        node = config.get(section)
        value = node.get(name) if node is not None else None
        if isinstance(value, int) and value < 1:
            raise ConfigError(f"config.{key}={value} must be 1 or more; set it to {what}, such as "
                              f"--config.{key}={example}.")


def check_value(key: str, current: object, raw: str | None) -> None:
    """Refuse ``raw`` unless it parses as the kind (and, for tuples, the shape) of the field's default."""
    if raw is None or current is None:
        return
    if isinstance(current, (tuple, list)):
        _check_sequence(key, current, raw)
        return
    kind = type(current)
    if kind not in _KIND_NAMES or kind is str:
        return
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
        elif kind is int:
            int(raw)
        elif kind is float:
            float(raw)
    except ValueError:
        raise _wrong(key, raw, _KIND_NAMES[kind], current) from None
