"""One dotted-name flatten for every layer (config checks, resume check, trackers, report)."""

import ml_collections as mlc

from jaxrat.runtime import dotted


def test_dicts_and_config_dicts_flatten_alike_and_every_layer_uses_the_one():
    nested = {"data": {"batch_size": 16, "sizes": [1, 2]}, "seed": 0}
    assert dotted.flatten(nested) == {"data.batch_size": 16, "data.sizes": [1, 2], "seed": 0}
    assert dotted.flatten(mlc.ConfigDict(nested)) == dotted.flatten(nested)
    assert dotted.flatten(nested, "cfg.", leaf=str) == {"cfg.data.batch_size": "16", "cfg.data.sizes": "[1, 2]",
                                                        "cfg.seed": "0"}
    from jaxrat import config_schema as config
    from jaxrat.experiments import report
    from jaxrat.trainer import workdir

    assert config.flatten is workdir.flatten is report.flatten is dotted.flatten
