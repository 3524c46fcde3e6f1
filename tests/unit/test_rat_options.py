"""RATConfig refuses sizes its layers cannot build or run, in one sentence naming the option; it
accepts every form the configs and the reference's arguments use."""

from __future__ import annotations

import pytest

from jaxrat.models.rat import RATConfig


@pytest.mark.parametrize("fields, words", [
    (dict(proj_kernel_size=-1), "proj_kernel_size must be an integer >= 1 or 2 of them"),
    (dict(proj_kernel_size=(7, 0)), "proj_kernel_size must be"),
    (dict(proj_padding=-2), 'proj_padding must be "same", an integer >= 0'),
    (dict(proj_padding="valid"), 'proj_padding must be "same"'),
    (dict(sga_kernel_size=0), "sga_kernel_size must be an integer >= 1"),
    (dict(sga_kernel_size=(3, "a")), "sga_kernel_size must be"),
    (dict(sga_kernel_size=(3, 3, 3)), "sga_kernel_size must be an integer >= 1 or 2 of them"),
    (dict(sga_kernel_size=7.5), "sga_kernel_size must be"),
    (dict(stride=0), r"stride must be None \(half the kernel\), an integer >= 1"),
    (dict(stride="x"), "stride must be"),
    (dict(positional_encoding="absolute", absolute_pos_grid=0), "absolute_pos_grid must be an integer >= 1"),
    (dict(spacing=-1.0), "spacing must be None, a number > 0 or 2 of them"),
    (dict(spacing="z"), "spacing must be"),
    (dict(scales=(64, 0)), r"scales must be \(\) or image sizes >= 1"),
    (dict(scales="abc"), "scales must be"),
    (dict(num_heads=0), "num_heads must be an integer >= 1"),
    (dict(feature_dims=0), "feature_dims must be an integer >= 1"),
    (dict(num_blocks=0), "num_blocks must be an integer >= 1"),
    (dict(leading_tokens=-1), "leading_tokens must be an integer >= 0"),
    (dict(feature_dims=30, num_heads=4), "feature_dims=30 must be a multiple of num_heads=4"),
    (dict(rotary_ratio=1.5), "rotary_ratio must be between 0 and 1"),
    (dict(mlp_dropout=1.0), r"mlp_dropout in \[0, 1\)"),
    (dict(attention=5), "attention must be one of"),
    (dict(attention=("sparse", "dense")), "a per-block attention needs 4 of"),
])
def test_a_size_the_layers_cannot_use_is_refused_naming_the_option(fields, words):
    with pytest.raises(ValueError, match=words):
        RATConfig.from_mapping(fields)


@pytest.mark.parametrize("fields", [
    {},
    dict(proj_padding=3), dict(proj_padding=(3, 2)), dict(proj_kernel_size=(7, 5)),
    dict(sga_kernel_size=7.0), dict(stride=(2, 2)), dict(stride=None),
    dict(spacing=(1.0, 2.5)), dict(spacing=2), dict(scales=[256, 128, 64]), dict(scales=None),
    dict(spatial_dims=3, sga_kernel_size=(3, 3, 3)),  # the default 2-D absolute grid is unused here
    dict(positional_encoding="absolute", absolute_pos_grid=16), dict(iters=0), dict(rotary_ratio=0.0),
    dict(attention=("sparse", "sparse", "dense", "dense")), dict(sga_attention_type="dense"),
])
def test_the_forms_configs_and_the_reference_use_are_accepted(fields):
    RATConfig.from_mapping(fields)
