"""The platforms an export is lowered for: the names jax.export and its loader compare, whatever the case."""

import pytest

from jaxrat.inference.exporting import platform_names
from jaxrat.runtime.errors import UserError


def test_names_are_lower_cased_once_each_in_order():
    assert platform_names(["CPU", " Cuda", "cpu", "", "TPU"]) == ("cpu", "cuda", "tpu")


@pytest.mark.parametrize("name", ["bogus", "metal", "cpu0"])
def test_an_unknown_name_is_refused(name):
    with pytest.raises(UserError, match=rf"^--platforms {name} is not a platform jax.export knows; pass cpu, cuda, "
                                        r"rocm or tpu"):
        platform_names(["cpu", name])


def test_gpu_is_refused_with_the_names_to_use():
    with pytest.raises(UserError, match=r"pass cuda \(NVIDIA\) or rocm \(AMD\)\.$"):
        platform_names(["GPU"])
