"""``TorchqHfQuantizer``: transformers' ``HfQuantizer`` for torchq (transformers v5 loading).

Two ways in through ``from_pretrained``:

* **Quantize while loading** (``quantization_config=TorchqConfig(...)`` on a float checkpoint).
  transformers materializes one weight at a time; for each selected ``nn.Linear`` / ``Conv1D``
  weight the conversion op :class:`TorchqQuantize` quantizes it at once, so the float model is
  never whole in memory (peak: the quantized model plus one float weight). Weights the
  checkpoint does not hold (a ``lm_head`` tied to the embedding) are quantized after loading,
  tie kept (:func:`torchq.quantize_`); GPTQ / AWQ layers load in float and are calibrated
  after loading (:func:`torchq.calibrate`).
* **A folder with torchq weights** (``config.json`` says ``"quant_method": "torchq"``, written by
  ``save_pretrained``). Its torchq header is read and checked before loading; each quantized
  weight's parts (``name:codes``, ``name:scale``, ...) are gathered by one ``WeightConverter``
  and decoded by :class:`TorchqDeserialize` (every part's dtype, shape and CRC-32 checked, codes
  range-checked) into the layout this device prefers. Nothing is re-quantized.

A weight that fails to quantize or decode is an error once loading ends (transformers would
otherwise leave it randomly initialized); nothing is silently skipped.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

from ..algorithms.statistics import CALIBRATED
from ..checkpoint.codec import CheckpointError, ParsedRecord, check_version, decode
from ..checkpoint.model_state import check_against_model, release_free_memory
from ..checkpoint.safetensors_io import FILE_VERSION, INDEX_NAME, open_checkpoint
from ..configs import LayerNotSupported, QuantConfig
from ..quantize import (
    QuantizationError,
    SkippedLayerWarning,
    config_resolver,
    default_filter,
    is_conv1d,
    quantize_in_row_chunks,
    warn_skipped,
)
from ..tensor import AffineQuantizedTensor
from .config import TorchqConfig
from .state import state_dict_and_metadata

__all__ = ["TorchqHfQuantizer", "TorchqQuantize", "TorchqDeserialize", "PARTS"]

# every part a torchq record may have (see torchq.checkpoint.codec)
TRIM_LIMIT = 16 << 20  # free heap bytes kept before giving them back to the OS while quantizing
PARTS = ("codes", "scale", "zero_point", "scale_codes", "scale_absmax", "scale_offset", "input_scale", "input_perm")


def _fmt(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _checkpoint_path(files: list[str] | None) -> Path:
    if not files:
        raise CheckpointError("from_pretrained: torchq weights load from safetensors files; this checkpoint has none")
    first = Path(files[0])
    if len(files) > 1 or (first.parent / INDEX_NAME).is_file():
        return first.parent / INDEX_NAME if (first.parent / INDEX_NAME).is_file() else first.parent
    return first


def _param(q: torch.Tensor) -> nn.Parameter:
    p = nn.Parameter(q, requires_grad=False)
    p._is_hf_initialized = True
    return p


class _SharedOp(ConversionOps):
    """transformers deep-copies a converter for every weight; the op refers to the one quantizer."""

    def __init__(self, hf_quantizer: TorchqHfQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo: dict) -> _SharedOp:
        return self


class TorchqQuantize(_SharedOp):
    """Quantizes one float weight as transformers loads it (see the module docstring)."""

    def convert(self, input_dict: dict[str, Any], full_layer_name: str | None = None, model: nn.Module | None = None,
                **kwargs: Any) -> dict[str, torch.Tensor]:
        (value,) = input_dict.values()
        value = value[0] if isinstance(value, list) else value
        assert full_layer_name is not None and model is not None
        return self.hf_quantizer.quantize_weight(model, full_layer_name, value)


class TorchqDeserialize(_SharedOp):
    """Decodes one torchq weight from the parts transformers gathered for it."""

    def __init__(self, hf_quantizer: TorchqHfQuantizer, patterns: dict[str, str]) -> None:
        super().__init__(hf_quantizer)
        self.patterns = patterns  # source pattern -> part name

    def convert(self, input_dict: dict[str, Any], full_layer_name: str | None = None, model: nn.Module | None = None,
                **kwargs: Any) -> dict[str, torch.Tensor]:
        assert full_layer_name is not None and model is not None
        parts = {}
        for pattern, tensors in input_dict.items():
            tensors = tensors if isinstance(tensors, list) else [tensors]
            if len(tensors) != 1:
                raise CheckpointError(f"{self.hf_quantizer.source}: {full_layer_name}: part {self.patterns.get(pattern, pattern)!r} "
                                      f"stored {len(tensors)} times")
            parts[self.patterns.get(pattern, pattern)] = tensors[0]
        return self.hf_quantizer.decode_weight(model, full_layer_name, parts)


class TorchqHfQuantizer(HfQuantizer):
    """transformers' quantizer for ``quant_method = "torchq"`` (see the module docstring)."""

    requires_calibration = False
    quantization_config: TorchqConfig

    def __init__(self, quantization_config: TorchqConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.plan: dict[str, QuantConfig] = {}  # module -> config, quantized as its weight loads
        self.calibrated: dict[str, QuantConfig] = {}  # module -> GPTQ / AWQ config, calibrated after loading
        self.records: dict[str, ParsedRecord] = {}  # weight name -> record (a folder with torchq weights)
        self.failures: dict[str, str] = {}
        self.source = "from_pretrained"  # the checkpoint's path, once known
        self.done: set[str] = set()
        self.skipped: set[str] = set()  # layers the config cannot take (warned as they loaded)

    # -- transformers' contract --------------------------------------------------------------------
    def validate_environment(self, device_map: Any = None, **kwargs: Any) -> None:
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("device_map: torchq weights cannot be offloaded to disk; map every module to a device")
        if self.quantization_config.load_error and not self.pre_quantized:
            raise ValueError(self.quantization_config.load_error)
        if self.pre_quantized:
            return
        cfg = self.quantization_config
        if cfg.resolved is None:
            raise ValueError("quantization_config: TorchqConfig has no quant (e.g. TorchqConfig('int4-g128')): nothing to quantize")
        configs = [cfg.resolved] if isinstance(cfg.resolved, QuantConfig) else [c for c in cfg.resolved.values() if c is not None]
        needs = sorted({c.algorithm for c in configs if getattr(c, "algorithm", None) in CALIBRATED})
        if needs and not cfg.calibration_data:
            raise ValueError(
                f"quantization_config: {', '.join(needs)} needs calibration data: TorchqConfig(..., calibration_data=[batch, ...]) "
                f"(each batch as the model takes it, e.g. a tokenizer's output)"
            )

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:  # frozen quantized weights; adapters (LoRA / QLoRA) on top train
        return True

    @property
    def is_compileable(self) -> bool:
        return True

    def _process_model_before_weight_loading(self, model: nn.Module, checkpoint_files: list[str] | None = None,
                                             **kwargs: Any) -> nn.Module:
        if self.pre_quantized:
            path = _checkpoint_path(checkpoint_files)
            config = (path if path.is_dir() else path.parent) / "config.json"
            if self.quantization_config.load_error:
                raise CheckpointError(f"{config}: {self.quantization_config.load_error}")
            check_version(self.quantization_config.version, FILE_VERSION, f"{config}: quantization_config: torchq checkpoint format")
            # the checks load_quantized makes, before transformers reads a tensor: header, records and shard
            # map; every entry's shape and dtype against the model's; the float entries' CRC-32 (transformers
            # reads those itself, unchecked: each is read and checked here once, one at a time)
            with contextlib.ExitStack() as stack:
                incoming, _ = open_checkpoint(path, stack, "saved", require_header=f"{config} says its weights are torchq's")
                check_against_model(model, incoming, str(path))
                for inc in incoming.values():
                    if not inc.quantized:
                        inc.load(torch.device("cpu"))
                        release_free_memory()
            self.records = {n: inc.record for n, inc in incoming.items() if inc.quantized}
            self.source = str(path)
            return model
        cfg = self.quantization_config
        keep_fp32 = list(getattr(model, "_keep_in_fp32_modules", None) or [])
        if cfg.modules_to_not_convert is None:  # transformers' default: the output embedding (lm_head) and tied weights
            skip = self.get_modules_to_not_convert(model, None, keep_fp32)
        else:
            skip = list(cfg.modules_to_not_convert) + keep_fp32
        names = [n for n, m in model.named_modules() if default_filter(m, n)]
        resolve = config_resolver(cfg.resolved, names)
        for name in names:
            chosen = resolve(name)
            if not isinstance(chosen, QuantConfig) or not should_convert_module(name, skip):
                continue
            (self.calibrated if getattr(chosen, "algorithm", None) in CALIBRATED else self.plan)[name] = chosen
        if not self.plan and not self.calibrated:
            raise ValueError(f"quantization_config: {cfg.quant!r} selects no layer of {type(model).__name__} to quantize")
        return model

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        if self.pre_quantized:
            return param_name in self.records
        module, _, attr = param_name.rpartition(".")
        return attr == "weight" and module in self.plan

    def get_quantize_ops(self) -> ConversionOps:
        return TorchqQuantize(self)

    def get_weight_conversions(self) -> list:
        if not self.pre_quantized or not self.records:
            return []
        patterns = {f"weight:{p}$": p for p in PARTS}
        return [WeightConverter(list(patterns), "weight", [TorchqDeserialize(self, patterns)])]

    def get_state_dict_and_metadata(self, model: nn.Module) -> tuple[dict | None, dict[str, str]]:
        if getattr(model, "_hf_peft_config_loaded", False):
            return None, {}  # save_pretrained writes only the (float) adapter weights
        return state_dict_and_metadata(model)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        if self.failures:
            lines = "; ".join(f"{k}: {v}" for k, v in list(self.failures.items())[:4])
            kind = CheckpointError if self.pre_quantized else QuantizationError
            raise kind(f"{self.source if self.pre_quantized else 'from_pretrained'}: {len(self.failures)} weight(s) could not be "
                       f"{'loaded' if self.pre_quantized else 'quantized'}: {lines}")
        if self.pre_quantized:
            self._check_loaded(model)
        else:
            self._finish_quantization(model)
        return model

    def _dequantize(self, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
        for _, mod in model.named_modules():
            for attr, p in list(mod._parameters.items()):
                if isinstance(p, AffineQuantizedTensor):
                    mod._parameters[attr] = nn.Parameter(p.dequantize().to(dtype or p.dtype), requires_grad=False)
        return model

    # -- the work ----------------------------------------------------------------------------------
    def quantize_weight(self, model: nn.Module, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        module_name = name.rpartition(".")[0]
        cfg = self.plan[module_name]
        module = model.get_submodule(module_name)
        transposed = is_conv1d(module)
        w = value.detach().t().contiguous() if transposed else value.detach()
        try:
            q = quantize_in_row_chunks(cfg, w, label=module_name)
        except LayerNotSupported as e:
            try:
                warn_skipped(f"from_pretrained: skipped layer {module_name!r} ({type(module).__name__}, weight "
                      f"{tuple(value.shape)}): {e}", stacklevel=2)
            except QuantizationError as strict_error:
                self.failures[name] = str(strict_error)
                raise
            self.skipped.add(module_name)
            return {name: value}
        except Exception as e:
            self.failures[name] = f"{type(e).__name__}: {e}"
            raise
        if transposed:
            q = q._replace(transposed=True)
        # each weight's temporaries leave holes between the quantized tensors that glibc keeps:
        # without trimming, resident memory grows ~2x the quantized model's size
        release_free_memory(TRIM_LIMIT)
        self.done.add(module_name)
        module._is_hf_initialized = True
        return {name: _param(q)}

    def decode_weight(self, model: nn.Module, name: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rec = self.records.get(name)
        try:
            if rec is None:
                raise CheckpointError(f"{name!r}: the checkpoint stores its parts but its torchq header has no record of it")
            device = next(iter(parts.values())).device
            q = decode(rec, parts, name=name, device=device, layout=self.quantization_config.layout, verify=True)
        except Exception as e:
            # kept for the end of loading, where it is raised as torchq's own error: raised here, transformers
            # would turn it into a RuntimeError that points at a log line
            self.failures[name] = f"{type(e).__name__}: {e}"
            return {}
        module = model.get_submodule(name.rpartition(".")[0])
        module._is_hf_initialized = True
        self.done.add(name)
        return {name: _param(q)}

    def _check_loaded(self, model: nn.Module) -> None:
        state = dict(model.named_parameters(remove_duplicate=False))
        state.update(model.named_buffers(remove_duplicate=False))
        wrong = sorted(n for n in self.records if not isinstance(state.get(n), AffineQuantizedTensor))
        if wrong:
            raise CheckpointError(f"{self.source}: the torchq header lists {len(wrong)} quantized weight(s) that did not load "
                                  f"quantized: {_fmt(wrong)} (a name the model does not have, or a part missing)")

    def _finish_quantization(self, model: nn.Module) -> None:
        from ..calibrate import calibrate
        from ..quantize import quantize_

        left = {n: c for n, c in self.plan.items() if n not in self.done and n not in self.skipped
                and not isinstance(model.get_submodule(n).weight, AffineQuantizedTensor)}
        if left:  # weights the checkpoint does not hold: tied ones (lm_head), or initialised ones
            quantize_(model, left, filter_fn=lambda m, n: n in left)
        if self.calibrated:
            cfg = self.quantization_config
            calibrate(model, cfg.calibration_data, dict(self.calibrated), filter_fn=lambda m, n: n in self.calibrated,
                      **cfg.calibrate_options)
        float_left = sorted(n for n in [*self.plan, *self.calibrated] if n not in self.skipped
                            and not isinstance(model.get_submodule(n).weight, AffineQuantizedTensor))
        if float_left:
            warnings.warn(f"from_pretrained: {len(float_left)} layer(s) stayed in float: {_fmt(float_left)}",
                          SkippedLayerWarning, stacklevel=3)
