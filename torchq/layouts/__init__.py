"""Layouts: every module in this package but ``base`` and ``preference`` defines one layout and is imported (registered) here.

Adding a layout means adding a module; nothing else in torchq changes.
"""

import importlib
import pkgutil

from . import preference
from .base import Fit, Layout, LayoutExample, TensorImpl, choose_layout, layout_from_json, layout_rejections, registered_layouts

__all__ = ["Fit", "Layout", "LayoutExample", "TensorImpl", "choose_layout", "layout_from_json", "layout_rejections", "registered_layouts",
           "preference"]

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name not in ("base", "preference"):
        _module = importlib.import_module(f"{__name__}.{_mod.name}")
        for _name in getattr(_module, "__all__", ()):
            if _name.endswith("Layout"):
                globals()[_name] = getattr(_module, _name)
                __all__.append(_name)
