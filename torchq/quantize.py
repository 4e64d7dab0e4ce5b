"""``quantize_``: replace linear weights with quantized tensors, in place and atomically."""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Callable, Mapping

import torch
from torch import nn

from . import dispatch
from .configs import LayerNotSupported, QuantConfig
from .tensor import AffineQuantizedTensor

__all__ = ["quantize_", "QuantizationError", "SkippedLayerWarning", "default_filter"]

ConfigSpec = QuantConfig | Mapping[str, QuantConfig | None]


class QuantizationError(RuntimeError):
    """quantize_ failed; the model was left exactly as it was."""


class SkippedLayerWarning(UserWarning):
    """A selected layer could not take its config and was left in float."""


def default_filter(module: nn.Module, name: str) -> bool:
    """``nn.Linear`` layers whose weight is a float tensor (not already quantized)."""
    return (
        isinstance(module, nn.Linear)
        and not isinstance(module.weight, AffineQuantizedTensor)
        and module.weight.is_floating_point()
    )


def _resolver(config: ConfigSpec, names: list[str]) -> Callable[[str], QuantConfig | None]:
    if isinstance(config, QuantConfig):
        return lambda name: config
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config: expected a torchq config (e.g. torchq.int4_weight_only()) or a mapping from module "
            f"names / 're:<regex>' / '_default' to configs, got {type(config).__name__}"
        )
    exact: dict[str, QuantConfig | None] = {}
    patterns: list[tuple[str, re.Pattern, QuantConfig | None]] = []
    default = None
    for key, cfg in config.items():
        if cfg is not None and not isinstance(cfg, QuantConfig):
            raise TypeError(f"config[{key!r}]: expected a torchq config or None, got {type(cfg).__name__}")
        if not isinstance(key, str):
            raise TypeError(f"config: keys must be module names, got {key!r}")
        if key == "_default":
            default = cfg
        elif key.startswith("re:"):
            try:
                patterns.append((key, re.compile(key[3:]), cfg))
            except re.error as e:
                raise ValueError(f"config[{key!r}]: invalid regular expression: {e}") from None
        else:
            exact[key] = cfg
    missing = [k for k in exact if k not in names]
    if missing:
        hints = {k: difflib.get_close_matches(k, names, n=3) for k in missing}
        raise ValueError(
            "config: these module names match no quantizable module (wrong name, already quantized, "
            "or excluded by filter_fn): " + "; ".join(f"{k!r} (close: {hints[k]})" for k in missing)
        )
    for key, pat, _ in patterns:
        if not any(pat.fullmatch(n) for n in names):
            warnings.warn(f"quantize_: pattern {key!r} matches no quantizable module", SkippedLayerWarning, stacklevel=3)

    def resolve(name: str) -> QuantConfig | None:
        if name in exact:
            return exact[name]
        for _, pat, cfg in patterns:
            if pat.fullmatch(name):
                return cfg
        return default

    return resolve


def quantize_(
    model: nn.Module,
    config: ConfigSpec,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Quantize the weights of the selected modules of ``model`` in place; returns ``model``.

    ``config``: one config for every selected module, or a mapping from module names (exact),
    ``"re:<regex>"`` (full match, first match wins) and ``"_default"`` to a config or None
    (leave in float). ``filter_fn(module, name)`` selects modules (default: float
    ``nn.Linear``). ``device``: quantize module by module on that device and leave the
    quantized modules there (bounds peak memory to one float weight on the device).

    A layer whose structure cannot take the config is skipped with a
    :class:`SkippedLayerWarning` naming it (a :class:`QuantizationError` in strict mode).
    Any other failure raises :class:`QuantizationError` and leaves the model unchanged:
    every new weight is computed before the first one is installed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    filter_fn = filter_fn or default_filter
    selected = [(name, mod) for name, mod in model.named_modules() if filter_fn(mod, name)]
    resolve = _resolver(config, [n for n, _ in selected])
    device = None if device is None else torch.device(device)

    staged: list[tuple[nn.Module, dict[str, nn.Parameter]]] = []
    for name, mod in selected:
        cfg = resolve(name)
        if cfg is None:
            continue
        weight = getattr(mod, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise QuantizationError(f"quantize_: module {name!r} ({type(mod).__name__}) has no weight tensor; nothing was changed")
        if isinstance(weight, AffineQuantizedTensor):
            raise QuantizationError(f"quantize_: module {name!r} is already quantized; nothing was changed")
        w = weight.detach()
        if device is not None:
            w = w.to(device)
        try:
            q = cfg.quantize_weight(w, label=name)
        except LayerNotSupported as e:
            msg = f"quantize_: skipped layer {name!r} ({type(mod).__name__}, weight {tuple(weight.shape)}): {e}"
            if dispatch.is_strict():
                raise QuantizationError(msg + " (strict mode); nothing was changed") from e
            warnings.warn(msg, SkippedLayerWarning, stacklevel=2)
            continue
        except Exception as e:
            raise QuantizationError(
                f"quantize_: layer {name!r} ({type(mod).__name__}, weight {tuple(weight.shape)} {weight.dtype}) "
                f"could not take {cfg!r}: {e}; nothing was changed"
            ) from e
        params = {"weight": nn.Parameter(q, requires_grad=False)}
        if device is not None:
            for pname, p in mod.named_parameters(recurse=False):
                if pname != "weight":
                    params[pname] = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
        staged.append((mod, params))

    for mod, params in staged:  # commit: attribute assignments only
        for pname, p in params.items():
            setattr(mod, pname, p)
        if device is not None:
            for bname, b in list(mod.named_buffers(recurse=False)):
                mod._buffers[bname] = b.to(device)
    return model
