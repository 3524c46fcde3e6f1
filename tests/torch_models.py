"""timm and transformers imported beside this machine's CPU torch, for the backbone parity tests.

PyPI's torchvision (pulled in by timm) is a CUDA build whose compiled ops do not load beside the CPU
torch ("operator torchvision::nms does not exist"), and both libraries import it. transformers
only uses it when it is installed, so it is imported while torchvision is hidden; timm imports
names from it at import time (batch norms, datasets, transforms: used by none of the models
tested), so it is imported with stand-in modules whose every name is an empty class.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _AnyAttribute(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return f"{cls.__name__}.{name}"


class _StandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyAttribute(name, (), {})


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def import_references():
    """(timm, transformers), or pytest skips when torch or either library is missing."""
    import pytest

    pytest.importorskip("torch")
    bare = sys.modules.get("timm")
    if bare is not None and getattr(bare, "__spec__", None) is None:
        # jaxrat.models.torch_import's bare timm (Mlp and DropPath only, for the reference RAT):
        # transformers' find_spec("timm") fails on it, so the real one is imported below
        for name in [n for n in sys.modules if n == "timm" or n.startswith("timm.")]:
            del sys.modules[name]
    if "timm" not in sys.modules:
        real = sys.modules.get("torchvision")
        sys.modules["torchvision"] = None  # transformers: "not installed"
        transformers = pytest.importorskip("transformers")
        from transformers import BeitConfig  # noqa: F401  (resolves the lazy module while hidden)
        from transformers.models.beit import modeling_beit  # noqa: F401
        from transformers.models.swin import modeling_swin  # noqa: F401
        from transformers.models.vit import modeling_vit  # noqa: F401

        del sys.modules["torchvision"]
        finder = _StandInFinder()
        sys.meta_path.insert(0, finder)
        try:
            pytest.importorskip("timm")
        finally:
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
                del sys.modules[name]
            if real is not None:
                sys.modules["torchvision"] = real
    import timm
    import transformers

    return timm, transformers
