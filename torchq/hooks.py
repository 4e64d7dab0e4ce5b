"""Hooks that integrations register into, so that the layers below call them without importing them.

``weights installed``: after ``quantize_``, ``load_quantized`` or a peer-format loader puts torchq
weights into a model, every registered hook may prepare a follow-up for it (the transformers
integration gives a ``PreTrainedModel`` torchq's quantizer, so that ``save_pretrained`` writes the
torchq weights). Preparing may fail (a warning, or None); the returned function commits every
prepared follow-up and cannot fail, so it runs after the model's weights are swapped in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["on_weights_installed", "prepare_weights_installed"]

# hook(model, needs_weights) -> a commit function, or None when the hook has nothing to do
WeightsInstalledHook = Callable[[Any, bool], "Callable[[], None] | None"]
_WEIGHTS_INSTALLED: list[WeightsInstalledHook] = []


def on_weights_installed(hook: WeightsInstalledHook) -> WeightsInstalledHook:
    """Register ``hook(model, needs_weights)`` (idempotent); returns it. ``needs_weights``: the
    caller has not checked that the model holds torchq weights (a loader)."""
    if hook not in _WEIGHTS_INSTALLED:
        _WEIGHTS_INSTALLED.append(hook)
    return hook


def prepare_weights_installed(model: Any, *, needs_weights: bool = False) -> Callable[[], None] | None:
    """Every registered hook's follow-up for ``model``, as one function that cannot fail (None when
    no hook has anything to do)."""
    commits = [c for c in (hook(model, needs_weights) for hook in _WEIGHTS_INSTALLED) if c is not None]
    if not commits:
        return None

    def commit() -> None:
        for c in commits:
            c()

    return commit
