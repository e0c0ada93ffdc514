"""Import-time placeholder for torchvision (see ../README.md): importable, unusable."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+areal-jobs-cpu-stub"


class _Unavailable(type):
    """Any attribute of a placeholder is the placeholder; calling it raises."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __call__(cls, *args, **kwargs):
        raise RuntimeError("torchvision is not installed on this CPU-only machine (areal_jobs stub)")


class Placeholder(metaclass=_Unavailable):
    pass


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return Placeholder


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves every `torchvision.*` submodule to an empty module of placeholders."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _SubmoduleFinder())
