"""``TorchqConfig``: the ``quantization_config`` that transformers' ``from_pretrained`` takes and
``config.json`` stores (``"quant_method": "torchq"``).

What ``config.json`` holds (``to_dict``)::

    {"quant_method": "torchq", "quant": <spec> | null, "modules_to_not_convert": [...] | null,
     "layout": "auto" | "saved" | {layout JSON}, "format": "torchq.checkpoint", "version": 1,
     "torchq_version": "..."}

``<spec>`` is a short config name (``"int4-g128"``, :func:`torchq.config_from_name`), a config's
JSON (:meth:`torchq.QuantConfig.to_json`) or ``{"plan": {module name | "re:<regex>" | "_default":
config JSON | null}}``. It records how the weights were quantized; a folder with torchq weights
(``save_pretrained``) loads them as stored, whatever it says. Calibration data is never written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import transformers

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"torchq.hf follows transformers v5's loading contract (conversion ops); transformers "
                      f"{transformers.__version__} is installed: pip install 'torchq[hf]' (transformers>=5)")

from transformers.utils.quantization_config import QuantizationConfigMixin  # noqa: E402

from ..checkpoint.safetensors_io import FILE_FORMAT, FILE_VERSION  # noqa: E402
from ..configs import QuantConfig, config_from_json, config_from_name  # noqa: E402
from ..layouts import Layout, layout_from_json  # noqa: E402

__all__ = ["QUANT_METHOD", "TorchqConfig", "resolve_spec"]

QUANT_METHOD = "torchq"
Spec = str | QuantConfig | Mapping[str, QuantConfig | None]


def resolve_spec(quant: Any) -> QuantConfig | dict[str, QuantConfig | None] | None:
    """What ``quant`` asks for, as :func:`torchq.quantize_` takes it: a config, a plan (a mapping of
    module names / ``"re:"`` patterns / ``"_default"`` to configs or None), or None (nothing to
    quantize). Accepts a config, a short name, a plan, an ``AutoquantResult``, a plan file
    (:func:`torchq.save_plan`), and the JSON forms ``to_dict`` writes."""
    from ..autotune import AutoquantResult, load_plan

    if quant is None or isinstance(quant, QuantConfig):
        return quant
    if isinstance(quant, AutoquantResult):
        return dict(quant.plan)
    if isinstance(quant, os.PathLike) or (isinstance(quant, str) and quant.endswith(".json")):
        if not Path(quant).is_file():
            raise ValueError(f"quant: plan file {str(quant)!r} does not exist")
        return load_plan(quant)
    if isinstance(quant, str):
        return config_from_name(quant)
    if isinstance(quant, Mapping):
        if "type" in quant and "version" in quant:  # one config's JSON
            return config_from_json(dict(quant))
        plan = quant["plan"] if set(quant) == {"plan"} and isinstance(quant["plan"], Mapping) else quant
        out: dict[str, QuantConfig | None] = {}
        for name, cfg in plan.items():
            if not isinstance(name, str):
                raise TypeError(f"quant: plan keys must be module names, got {name!r}")
            if cfg is None or isinstance(cfg, QuantConfig):
                out[name] = cfg
            elif isinstance(cfg, str):
                out[name] = config_from_name(cfg)
            elif isinstance(cfg, Mapping):
                out[name] = config_from_json(dict(cfg))
            else:
                raise TypeError(f"quant[{name!r}]: expected a torchq config, its name or JSON, or None; got {type(cfg).__name__}")
        return out
    raise TypeError(
        f"quant: expected a torchq config, a config name such as 'int4-g128', a plan (mapping of module names to "
        f"configs), an AutoquantResult or a plan file; got {type(quant).__name__}"
    )


def _spec_json(quant: Any) -> Any:
    if quant is None or isinstance(quant, str):
        return quant
    resolved = resolve_spec(quant)
    if isinstance(resolved, QuantConfig):
        return resolved.to_json()
    assert isinstance(resolved, dict)
    return {"plan": {k: None if v is None else v.to_json() for k, v in resolved.items()}}


class TorchqConfig(QuantizationConfigMixin):
    """Quantize with torchq while transformers loads, or describe a checkpoint with torchq weights.

    ``quant``: what to quantize with (see :func:`resolve_spec`): ``"int4-g128"``,
    ``torchq.int4_weight_only(group_size=32)``, ``torchq.nf4_weight_only()``, a plan ``{"re:.*mlp.*":
    cfg, "_default": other}``, an ``AutoquantResult`` or its plan file; algorithms as in the configs
    (``"int4-g128-hqq"`` runs as each weight loads; ``"-gptq"`` / ``"-awq"`` need
    ``calibration_data`` and run :func:`torchq.calibrate` once the model is loaded).
    ``modules_to_not_convert``: module names kept in float (transformers' matching: a name, a
    prefix up to a module boundary, a regex, or a suffix). None (default): transformers' own
    default, as its other quantizers do: the output embedding (``lm_head``), tied weights and the
    last module stay float; ``[]`` quantizes every ``nn.Linear`` / ``Conv1D``, the tied head included
    (its embedding then holds the quantized weight, as :func:`torchq.quantize_` does): SmolLM2
    int4-g32 decodes at 2.4-2.9x float's speed with perplexity +0.91 that way, 2.1x and +0.00 with
    its head in float.
    ``layout``: for a checkpoint with torchq weights, ``"auto"`` (default: the layout this
    device prefers), ``"saved"`` (the stored one where it can live here) or a Layout.
    ``calibration_data``: batches for GPTQ / AWQ (``model(**batch)`` for a mapping, as
    :func:`torchq.calibrate`); ``calibrate_options``: keyword arguments of ``calibrate``.
    """

    def __init__(
        self,
        quant: Spec | None = None,
        *,
        modules_to_not_convert: list[str] | None = None,
        layout: str | Layout | dict = "auto",
        calibration_data: Iterable[Any] | None = None,
        calibrate_options: dict[str, Any] | None = None,
        format: str = FILE_FORMAT,
        version: int = FILE_VERSION,
        torchq_version: str | None = None,
        **kwargs: Any,
    ) -> None:
        from .._version import __version__

        self.quant_method = QUANT_METHOD
        self.load_error: str | None = None  # see from_dict
        self.quant = quant
        self.resolved = resolve_spec(quant)  # checked now: a bad name fails here, not mid-load
        if modules_to_not_convert is not None and not (
            isinstance(modules_to_not_convert, (list, tuple)) and all(isinstance(m, str) for m in modules_to_not_convert)
        ):
            raise TypeError(f"modules_to_not_convert: expected a list of module names, got {modules_to_not_convert!r}")
        self.modules_to_not_convert = None if modules_to_not_convert is None else list(modules_to_not_convert)
        if isinstance(layout, dict):
            layout = layout_from_json(layout)
        if not (isinstance(layout, Layout) or layout in ("auto", "saved")):
            raise ValueError(f"layout: expected 'auto', 'saved' or a torchq Layout, got {layout!r}")
        self.layout = layout
        self.calibration_data = None if calibration_data is None else list(calibration_data)
        self.calibrate_options = dict(calibrate_options or {})
        if format != FILE_FORMAT:
            raise ValueError(f"format: expected {FILE_FORMAT!r}, got {format!r}")
        self.format = format
        self.version = version
        self.torchq_version = torchq_version or __version__
        unknown = sorted(set(kwargs) - {"quant_method", "load_with"})  # load_with: written by torchq 0.1's attach
        if unknown:
            raise TypeError(f"TorchqConfig: unknown arguments {unknown}")

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any) -> Any:
        """The config a checkpoint's ``config.json`` holds. transformers builds it before anything says
        which folder it came from, so a field torchq cannot read (an unknown format, layout or quant) is
        kept in :attr:`load_error` and raised as a :class:`torchq.CheckpointError` naming the folder's
        ``config.json`` when loading starts, instead of a ValueError here that names no file."""
        try:
            return super().from_dict(config_dict, return_unused_kwargs, **kwargs)
        except (ValueError, TypeError) as e:
            config = cls()
            config.load_error = f"quantization_config: {e}"
            return (config, kwargs) if return_unused_kwargs else config

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": QUANT_METHOD,
            "quant": _spec_json(self.quant),
            "modules_to_not_convert": self.modules_to_not_convert,
            "layout": self.layout.to_json() if isinstance(self.layout, Layout) else self.layout,
            "format": self.format,
            "version": self.version,
            "torchq_version": self.torchq_version,
        }

    def __iter__(self):
        yield from self.to_dict().items()

    def __deepcopy__(self, memo: dict) -> TorchqConfig:
        # from_pretrained deep-copies the model config: the calibration batches are shared, not copied
        import copy

        new = copy.copy(self)
        new.modules_to_not_convert = copy.deepcopy(self.modules_to_not_convert, memo)
        new.calibrate_options = dict(self.calibrate_options)
        return new
