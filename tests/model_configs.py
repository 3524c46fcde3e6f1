"""``config.model`` for a RAT model from one flat dict of fields, as tests write them."""

from __future__ import annotations

import ml_collections as mlc

from jaxrat.models.rat.config import field_names


def rat_model(name: str = "rat", **fields) -> mlc.ConfigDict:
    """``{name, <task model fields>, rat: {<RAT options>}}``: each field goes where it belongs."""
    rat = {k: fields.pop(k) for k in list(fields) if k in field_names()}
    return mlc.ConfigDict(dict(name=name, **fields, rat=rat))
