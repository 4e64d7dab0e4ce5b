"""``IdentityCache``: values attached to live objects by identity, dropped when the object dies.

For per-weight caches on the hot path of a quantized linear (the chosen kernel, a kernel's C
arguments). Tensors cannot be dictionary keys by value, ``torch.utils.weak.WeakIdKeyDictionary``
costs microseconds per lookup, and attributes on the object would travel with it through
``copy.deepcopy``; this costs one dict lookup and one weak-reference call.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["IdentityCache"]


class IdentityCache:
    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, owner: object) -> Any:
        """The value stored for ``owner`` (this very object), or None."""
        entry = self._entries.get(id(owner))
        if entry is not None and entry[0]() is owner:
            return entry[1]
        return None

    def set(self, owner: object, value: Any) -> Any:
        key = id(owner)
        entries = self._entries

        def forget(ref: weakref.ref) -> None:
            current = entries.get(key)
            if current is not None and current[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(owner, forget), value)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
