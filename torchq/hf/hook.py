"""``import torchq`` registers torchq's quantizer with transformers, without importing transformers.

transformers finds a quantizer by ``quant_method`` in its registry; a folder whose config.json says
``"torchq"`` must load after a bare ``import torchq``. torchq never imports transformers (seconds),
so :func:`install_registration_hook` registers (imports :mod:`torchq.hf.registry`) when
transformers' model loading module has been imported: at once if it already is, else from an
import hook that fires after that module executes. A failure to register is a warning, never an
error inside transformers' own import.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

__all__ = ["install_registration_hook"]

_TRIGGER = "transformers.modeling_utils"


def _register_quietly() -> None:
    try:
        from . import registry  # noqa: F401  (importing it registers)
    except Exception as e:  # an unexpected transformers version must not break transformers itself
        warnings.warn(f"torchq: cannot register its transformers quantizer ({type(e).__name__}: {e}); "
                      f"from_pretrained will not read torchq checkpoints", stacklevel=2)


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        _register_quietly()

    def __getattr__(self, name: str) -> Any:  # get_data, get_resource_reader, ...
        return getattr(self._inner, name)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TRIGGER:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # fires once
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def install_registration_hook() -> None:
    """Register torchq with transformers now if its model loading is imported, else when it is."""
    if _TRIGGER in sys.modules:
        _register_quietly()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
