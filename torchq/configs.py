"""Quantization configs: frozen dataclasses that say how to quantize one linear weight.

Every config has ``layout`` (None: chosen per weight) and ``compute_dtype``: the dtype its linears
compute in (inputs of another dtype are cast to it and outputs cast back), None (default) for the
input's own dtype.

Each config round-trips through JSON (``config.to_json()`` / ``config_from_json``) with a
``type`` and a format ``version``. ``layout=None`` means "the best registered layout for the
weight's device" (see :func:`torchq.layouts.choose_layout`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .activation import Float8Activations, OutlierInt8, PerTokenInt8, StaticInt8, activation_from_json
from .algorithms import ALGORITHMS, CalibrationRequired, hqq_zero_points
from .algorithms.formats import AffineGroupFormat, CodebookGroupFormat, GroupFormat
from .algorithms.statistics import CALIBRATED, statistics_for
from .canonical import FLOAT8_CODEBOOK, PlainForm, QuantSpec
from .float8 import FLOAT8_DTYPE, check_granularity, quantize_float8
from .layouts.base import Layout, layout_from_json
from .primitives import MappingType, ZeroPointDomain, code_range
from .serialization import reduce_object, register_kind
from .tensor import AffineQuantizedTensor, check_compute_dtype

__all__ = [
    "QuantConfig",
    "LayerNotSupported",
    "Int4WeightOnlyConfig",
    "Int8WeightOnlyConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "Int8StaticActivationInt8WeightConfig",
    "int8_static_activation_int8_weight",
    "OBSERVERS",
    "IntxWeightOnlyConfig",
    "int4_weight_only",
    "int8_weight_only",
    "int8_dynamic_activation_int8_weight",
    "intx_weight_only",
    "NF4WeightOnlyConfig",
    "LLMInt8Config",
    "llm_int8",
    "Int8DynamicActivation4BitWeightConfig",
    "int8_dynamic_activation_4bit_weight",
    "nf4_weight_only",
    "fp4_weight_only",
    "Float8DynamicActivationFloat8WeightConfig",
    "Float8WeightOnlyConfig",
    "float8_dynamic_activation_float8_weight",
    "float8_weight_only",
    "config_from_json",
    "config_from_name",
    "registered_configs",
]

_CONFIGS: dict[str, type[QuantConfig]] = {}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def registered_configs() -> dict[str, type[QuantConfig]]:
    """Config classes by name (the ``type`` of their JSON), including user-defined subclasses."""
    return dict(_CONFIGS)


ROW_CHUNK_BYTES = 1 << 20  # float bytes of rows quantized at a time where rows are independent (see quantize_in_row_chunks)


class LayerNotSupported(Exception):
    """The layer's structure cannot take this config; quantize_ skips it with a warning."""


def _dtype_to_json(d: torch.dtype | None) -> str | None:
    return None if d is None else str(d).removeprefix("torch.")


def _dtype_from_json(s: str | None) -> torch.dtype | None:
    if s is None:
        return None
    d = getattr(torch, s, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"config JSON: unknown dtype {s!r}")
    return d


class QuantConfig:
    """Base of all configs (subclasses are frozen dataclasses)."""

    version: ClassVar[int] = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _CONFIGS[cls.__name__] = cls

    def __reduce__(self):
        return reduce_object("config", self)

    def quantize_weight(self, weight: torch.Tensor, *, label: str | None = None) -> AffineQuantizedTensor:
        raise NotImplementedError

    def rows_independent(self, weight: torch.Tensor) -> bool:
        """True when each row of ``weight`` quantizes the same alone as within the whole weight (no
        statistic spans rows), so :func:`torchq.quantize.quantize_in_row_chunks` may bound the
        temporaries of a large weight by quantizing a few rows at a time."""
        return False

    def group_format(self, weight: torch.Tensor) -> GroupFormat:
        """This config's format for ``weight`` as a :class:`~torchq.algorithms.formats.GroupFormat`
        (what calibrated algorithms choose codes in); LayerNotSupported where it has none."""
        raise LayerNotSupported(f"{type(self).__name__} has no group format for calibrated algorithms")

    def _quantize_calibrated(self, weight: torch.Tensor, label: str | None) -> AffineQuantizedTensor:
        """``self.algorithm`` (GPTQ or AWQ) on ``weight`` with the calibration statistics of layer
        ``label`` (see :func:`torchq.calibrate`); the codes go into this config's format and layout
        (AWQ's input scale onto the weight, :attr:`AffineQuantizedTensor.input_scale`)."""
        from .algorithms.awq import awq_quantize
        from .algorithms.gptq import gptq_quantize

        algorithm = self.algorithm  # type: ignore[attr-defined]
        stats = statistics_for(label, algorithm)
        fmt = self.group_format(weight)
        opts = stats.options.get(algorithm, {})
        input_scale = None
        if algorithm == "gptq":
            opts = dict(opts)
            awq_scale = opts.pop("awq_scale", False)
            result = gptq_quantize(weight, stats.hessian, fmt, **opts)
            if awq_scale:  # GPTQ on AWQ-scaled columns too; the lower output error is kept
                scaled, input_scale, alpha = _gptq_on_awq_scaled(weight, stats, fmt, opts)
                if scaled is not None and scaled.error < result.error:
                    result = scaled
                    stats.report.update(alpha=alpha)
                else:
                    input_scale = None
        else:
            result = awq_quantize(weight, stats.hessian, stats.mean_abs, fmt, **opts)
            input_scale = result.input_scale
            stats.report.update(alpha=result.alpha)
        stats.report.update(error=result.error, rtn_error=result.rtn_error, used=result.used)
        plain = fmt.plain(result.codes, result.scale, result.zero, result.state)
        if not bool(torch.isfinite(plain.dequantize(weight.dtype)).all()):
            raise ValueError(f"weight: its range overflows {plain.scale.dtype} scale arithmetic; quantize with "
                             f"scale_dtype=torch.float32")
        q = AffineQuantizedTensor.from_plain(plain, weight.dtype, layout=self.layout, label=label, config=self)  # type: ignore[attr-defined]
        return q if input_scale is None else q._replace(input_scale=input_scale.to(q.device))

    def _check_weight(self, weight: torch.Tensor, label: str | None) -> None:
        if weight.dim() != 2:
            raise LayerNotSupported(f"weight is {weight.dim()}-D (shape {tuple(weight.shape)}); {type(self).__name__} quantizes 2-D linear weights")
        if weight.dtype not in _FLOAT_DTYPES:
            raise LayerNotSupported(f"weight dtype {weight.dtype} is not fp32/bf16/fp16")

    def _check_common(self) -> None:
        """Checks of the fields every config has: ``layout`` and ``compute_dtype``."""
        check_compute_dtype(self.compute_dtype)  # type: ignore[attr-defined]
        if self.layout is not None and not isinstance(self.layout, Layout):  # type: ignore[attr-defined]
            raise TypeError(f"layout: expected a torchq Layout or None, got {type(self.layout).__name__}")  # type: ignore[attr-defined]

    def to_json(self) -> dict:
        out: dict[str, Any] = {"type": type(self).__name__, "version": self.version}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, Layout):
                v = v.to_json()
            elif isinstance(v, torch.dtype):
                v = _dtype_to_json(v)
            elif isinstance(v, (MappingType, ZeroPointDomain)):
                v = v.value
            elif isinstance(v, StaticInt8):
                v = v.to_json()
            out[f.name] = v
        return out

    def to_json_str(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def _gptq_on_awq_scaled(weight: torch.Tensor, stats: Any, fmt: GroupFormat, opts: dict) -> tuple:
    """GPTQ on ``W diag(s)`` with ``s`` AWQ's per-input factor (searched by round-to-nearest's output
    error), for inputs ``x / s`` (Hessian ``H / (s s^T)``): ``(result, input_scale = 1 / s, alpha)``,
    or ``(None, None, 0.0)`` where AWQ finds no factor better than none. The proxy errors are relative
    to ``tr(W H W^T)``, which the scaling leaves unchanged, so they compare with plain GPTQ's."""
    from .algorithms.awq import awq_scales
    from .algorithms.gptq import gptq_quantize

    s, alpha = awq_scales(weight, stats.hessian, stats.mean_abs, fmt, grid=stats.options.get("awq", {}).get("grid", 20))
    if s is None:
        return None, None, 0.0
    hessian = stats.hessian / s[:, None] / s[None, :]
    scaled = (weight.detach().float() * s).to(weight.dtype)
    result = gptq_quantize(scaled, hessian, fmt, **opts)
    result.used = f"{result.used}+awq"  # "gptq+awq", or "rtn+awq" where GPTQ did not beat rounding the scaled weight
    return result, (1.0 / s).float(), alpha


def config_from_json(data: dict | str) -> QuantConfig:
    """Inverse of ``QuantConfig.to_json`` (accepts the dict or its JSON string)."""
    if isinstance(data, str):
        data = json.loads(data)
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"config JSON: expected an object with a 'type' key, got {data!r}")
    cls = _CONFIGS.get(data["type"])
    if cls is None:
        raise ValueError(f"config JSON: unknown config type {data['type']!r}; known: {sorted(_CONFIGS)}")
    version = data.get("version", 1)
    if version > cls.version:
        raise ValueError(f"config JSON: {data['type']} version {version} is newer than this torchq supports ({cls.version})")
    kwargs: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for k, v in data.items():
        if k in ("type", "version"):
            continue
        if k not in names:
            raise ValueError(f"config JSON: {data['type']} has no field {k!r}")
        if k == "layout" and v is not None:
            v = layout_from_json(v)
        elif k.endswith("dtype"):
            v = _dtype_from_json(v)
        elif k == "mapping_type":
            v = MappingType(v)
        elif k == "zero_point_domain":
            v = ZeroPointDomain(v)
        elif k == "activation" and v is not None:
            v = activation_from_json(v)
        kwargs[k] = v
    return cls(**kwargs)


register_kind("config", config_from_json)


@dataclass(frozen=True)
class Int4WeightOnlyConfig(QuantConfig):
    """4-bit groupwise weights. ``zero_point_domain``:

    * FLOAT (default): tinygemm numerics, codes 0..15, raw min/max, ``s = (max-min)/15``,
      ``zero = min + 8s``, computed in ``scale_dtype`` (default: the weight's dtype), eps 1e-6;
    * INT: asymmetric codes 0..15 with an integer zero point (zero exactly representable);
    * NONE: symmetric codes -8..7.

    ``algorithm``: ``"rtn"`` (round to nearest, default), ``"hqq"`` (zero points by HQQ's
    half-quadratic optimisation, no calibration data: :mod:`torchq.algorithms.hqq`; FLOAT and INT
    zero points), ``"gptq"`` (codes with error compensation on calibration data:
    :func:`torchq.calibrate`, :mod:`torchq.algorithms.gptq`) or ``"awq"`` (activation-aware input
    scaling on calibration data, :mod:`torchq.algorithms.awq`). The format and kernels are the same
    whichever chose the codes.
    """

    group_size: int = 128
    layout: Layout | None = None
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.FLOAT
    scale_dtype: torch.dtype | None = None
    compute_dtype: torch.dtype | None = None
    algorithm: str = "rtn"

    def __post_init__(self) -> None:
        if self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"group_size: expected one of 32, 64, 128, 256, got {self.group_size!r}")
        object.__setattr__(self, "zero_point_domain", ZeroPointDomain(self.zero_point_domain))
        _check_algorithm(self.algorithm, self.zero_point_domain is not ZeroPointDomain.NONE, "zero_point_domain=NONE")
        if self.scale_dtype is not None and self.scale_dtype not in _FLOAT_DTYPES:
            raise ValueError(f"scale_dtype: expected fp32/bf16/fp16 or None, got {self.scale_dtype}")
        self._check_common()
        if self.layout is not None:
            spec = self.spec()
            reason = self.layout.fit(spec, None, self.scale_dtype, None).cannot_hold
            if reason is not None:
                raise ValueError(
                    f"layout: {self.layout!r} cannot hold {spec.describe()} (zero_point_domain={self.zero_point_domain.name}, "
                    f"scale_dtype={self.scale_dtype}): {reason}"
                )

    def spec(self) -> QuantSpec:
        """The format this config produces (the same for every weight)."""
        qmin, qmax = (-8, 7) if self.zero_point_domain is ZeroPointDomain.NONE else (0, 15)
        return QuantSpec((1, self.group_size), qmin, qmax, self.zero_point_domain)

    def group_format(self, weight: torch.Tensor) -> AffineGroupFormat:
        sd = self.scale_dtype or weight.dtype
        domain = self.zero_point_domain
        if domain is ZeroPointDomain.NONE:
            return AffineGroupFormat(self.group_size, MappingType.SYMMETRIC, -8, 7, 1e-6, sd, None, domain, True)
        return AffineGroupFormat(self.group_size, MappingType.ASYMMETRIC, 0, 15, 1e-6, sd,
                                 sd if domain is ZeroPointDomain.FLOAT else None, domain, domain is ZeroPointDomain.INT)

    def rows_independent(self, weight: torch.Tensor) -> bool:
        return self.algorithm not in CALIBRATED  # RTN and HQQ work group by group

    def quantize_weight(self, weight: torch.Tensor, *, label: str | None = None) -> AffineQuantizedTensor:
        self._check_weight(weight, label)
        if self.algorithm in CALIBRATED:
            return self._quantize_calibrated(weight, label)
        sd = self.scale_dtype or weight.dtype
        domain = self.zero_point_domain
        common = dict(layout=self.layout, label=label, config=self, scale_dtype=sd, zero_point_domain=domain)
        block = (1, self.group_size)
        refine = _zero_refiner(self.algorithm, block, 0, 15, domain)
        if domain is ZeroPointDomain.FLOAT:
            return AffineQuantizedTensor.from_float(
                weight, MappingType.ASYMMETRIC, block, 0, 15, eps=1e-6, zero_point_dtype=sd, preserve_zero=False,
                refine_zero=refine, **common
            )
        if domain is ZeroPointDomain.INT:
            return AffineQuantizedTensor.from_float(weight, MappingType.ASYMMETRIC, block, 0, 15, eps=1e-6, refine_zero=refine,
                                                    **common)
        return AffineQuantizedTensor.from_float(weight, MappingType.SYMMETRIC, block, -8, 7, eps=1e-6, **common)


def _check_algorithm(algorithm: str, has_zero: bool, why_not: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "hqq" and not has_zero:
        raise ValueError(f"algorithm: 'hqq' optimises zero points; {why_not} has none (use an asymmetric format)")


def _zero_refiner(algorithm: str, block: tuple[int, int], qmin: int, qmax: int, domain: ZeroPointDomain):
    """The ``refine_zero`` hook of :meth:`AffineQuantizedTensor.from_float` for ``algorithm``."""
    if algorithm != "hqq":
        return None

    def refine(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return hqq_zero_points(weight, block, qmin, qmax, scale, zero, domain)

    return refine


def _int8_per_channel(weight, cfg, qmin: int, qmax: int, act_quant, label) -> AffineQuantizedTensor:
    """Symmetric per-output-channel int8 codes in [qmin, qmax], fp32 scales, no zero point."""
    return AffineQuantizedTensor.from_float(
        weight, MappingType.SYMMETRIC, (1, weight.shape[1]), qmin, qmax,
        eps=torch.finfo(torch.float32).eps, scale_dtype=torch.float32, zero_point_domain=ZeroPointDomain.NONE,
        layout=cfg.layout, act_quant=act_quant, label=label, config=cfg,
    )


@dataclass(frozen=True)
class Int8WeightOnlyConfig(QuantConfig):
    """int8 per output channel, symmetric over the full [-128, 127] (``s = amax / 127.5``), no
    zero point, fp32 scales, ``eps = finfo(float32).eps``."""

    layout: Layout | None = None
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        self._check_common()

    def rows_independent(self, weight: torch.Tensor) -> bool:
        return True  # one scale per row

    def quantize_weight(self, weight: torch.Tensor, *, label: str | None = None) -> AffineQuantizedTensor:
        self._check_weight(weight, label)
        return _int8_per_channel(weight, self, -128, 127, None, label)


@dataclass(frozen=True)
class Int8DynamicActivationInt8WeightConfig(QuantConfig):
    """int8 weights per output channel, symmetric [-127, 127], fp32 scales; activations are
    quantized per token at run time with :class:`~torchq.activation.PerTokenInt8`
    (symmetric [-127, 127], fp32 scale, eps 1e-5) and multiplied in int32.

    ``reduce_range=True``: activations in 7 bits, symmetric [-63, 63] (``s = amax / 63``), the
    range PyTorch's x86 dynamic quantization (FBGEMM, ``reduce_range``) uses. One bit of
    activation precision less; on CPUs without VNNI (AVX2) the native kernel then multiplies the
    codes + 64 straight with the weights (no sign trick: 3 instructions per 32 products instead
    of 4). Same numerics contract otherwise: bit-equal to the reference with that range."""

    layout: Layout | None = None
    compute_dtype: torch.dtype | None = None
    reduce_range: bool = False

    def __post_init__(self) -> None:
        self._check_common()
        if not isinstance(self.reduce_range, bool):
            raise TypeError(f"reduce_range: expected a bool, got {type(self.reduce_range).__name__} {self.reduce_range!r}")

    def rows_independent(self, weight: torch.Tensor) -> bool:
        return True  # one scale per row

    def quantize_weight(self, weight: torch.Tensor, *, label: str | None = None) -> AffineQuantizedTensor:
        self._check_weight(weight, label)
        act = PerTokenInt8(-63, 63) if self.reduce_range else PerTokenInt8()
        return _int8_per_channel(weight, self, -127, 127, act, label)


#: the activation observers of :class:`Int8StaticActivationInt8WeightConfig` (:mod:`torchq.static`)
OBSERVERS = ("minmax", "moving_average", "percentile")


@dataclass(frozen=True)
class Int8StaticActivationInt8WeightConfig(QuantConfig):
    """int8 weights per output channel (symmetric [-127, 127], fp32 scales: int8dq's) and **static**
    int8 activations: one fp32 scale and int zero point per layer, fixed at calibration
    (:class:`~torchq.activation.StaticInt8`), so a call quantizes its input with no pass to find
    its range. Kernel: ``torchq::int8_static_linear`` (native CPU, Triton on CUDA).

    ``activation``: the calibrated scheme, or None: then the config describes how to calibrate and
    :func:`torchq.static.prepare` / :func:`torchq.static.convert` fill it in (``quantize_`` refuses it,
    :class:`~torchq.algorithms.CalibrationRequired`). Calibration: ``observer`` ``"minmax"`` (the
    range of every value seen), ``"moving_average"`` (``min``/``max`` per batch, averaged with
    ``averaging_constant`` as PyTorch's MovingAverageMinMaxObserver) or ``"percentile"`` (the
    ``percentile`` and ``100 - percentile`` percentiles of a uniform sample of the inputs: outliers
    clipped); ``symmetric``: zero point 0 (``s = amax / 127``) instead of the range's own."""

    activation: StaticInt8 | None = None
    observer: str = "minmax"
    symmetric: bool = False
    percentile: float = 99.99
    averaging_constant: float = 0.01
    layout: Layout | None = None
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        self._check_common()
        if self.activation is not None and not isinstance(self.activation, StaticInt8):
            raise TypeError(f"activation: expected a torchq.activation.StaticInt8 or None, got {type(self.activation).__name__}")
        if self.observer not in OBSERVERS:
            raise ValueError(f"observer: expected one of {OBSERVERS}, got {self.observer!r}")
        if not isinstance(self.symmetric, bool):
            raise TypeError(f"symmetric: expected a bool, got {type(self.symmetric).__name__} {self.symmetric!r}")
        p = self.percentile
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 50.0 < p <= 100.0:
            raise ValueError(f"percentile: expected a number in (50, 100], got {p!r}")
        c = self.averaging_constant
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 < c <= 1.0:
            raise ValueError(f"averaging_constant: expected a number in (0, 1], got {c!r}")

    def rows_independent(self, weight: torch.Tensor) -> bool:
        return True  # one scale per row

    def quantize_weight(self, weight: torch.Tensor, *, label: str | None = None) -> AffineQuantizedTensor:
        self._check_weight(weight, label)
        if self.activation is None:
            raise CalibrationRequired(
                f"layer {label!r}: static int8 activations need calibrated scales; run torchq.static.prepare(model, config), "
                f"the model on calibration data, then torchq.static.convert(model) (or give activation=StaticInt8(...))")
        return _int8_per_channel(weight, self, -127, 127, self.activation, label)


@dataclass(frozen=True)
class IntxWeightOnlyConfig(QuantConfig):
    """``bits``-wide (1-8) weights, groupwise (``group_size``) or per channel (``None``).

    ASYMMETRIC (default): unsigned codes ``[0, 2^bits)`` with an integer zero point;
    SYMMETRIC: signed codes ``[-2^(bits-1), 2^(bits-1))`` with no zero point (bits >= 2).
    Scales in ``scale_dtype`` (default: the weight's dtype), clamped to at least ``eps``
    (default ``finfo(float32).eps``: bf16's own epsilon, 0.0078, would clip typical weights).
    """

    bits: int = 4
    group_size: int | None = 32
    mapping_type: MappingType = MappingType.ASYMMETRIC
    layout: Layout | None = None
    scale_dtype: torch.dtype | None = None
    eps: float = float(torch.finfo(torch.float32).eps)
    compute_dtype: torch.dtype | None = None
    algorithm: str = "rtn"

    def __post_init__(self) -> None:
        if not (isinstance(self.eps, float) and self.eps > 0):
            raise ValueError(f"eps: expected a positive float, got {self.eps!r}")
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"bits: expected an int in 1..8, got {self.bits!r}")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ValueError(f"group_size: expected a positive int or None (per channel), got {self.group_size!r}")
        mt = MappingType(self.mapping_type)
        object.__setattr__(self, "mapping_type", mt)
        if mt is MappingType.SYMMETRIC_NO_CLIPPING_ERR:
            raise ValueError("mapping_type: expected ASYMMETRIC or SYMMETRIC, got SYMMETRIC_NO_CLIPPING_ERR")
        if mt is MappingType.SYMMETRIC and self.bits < 2:
            raise ValueError("bits: SYMMETRIC needs at least 2 bits (1-bit signed codes {-1, 0} cannot hold +x)")
        if self.scale_dtype is not None and self.scale_dtype not in _FLOAT_DTYPES:
            raise ValueError(f"scale_dtype: expected fp32/bf16/fp16 or None, got {self.scale_dtype}")
        _check_algorithm(self.algorithm, mt is MappingType.ASYMMETRIC, "mapping_type=SYMMETRIC")
        self._check_common()

    def group_format(self, weight: torch.Tensor) -> AffineGroupFormat:
        g = weight.shape[1] if self.group_size is None else self.group_size
        sd = self.scale_dtype or weight.dtype
        if self.mapping_type is MappingType.ASYMMETRIC:
            qmin, qmax = code_range(self.bits, signed=False)
            return AffineGroupFormat(g, self.mapping_type, qmin, qmax, self.eps, sd, None, ZeroPointDomain.INT, True)
        qmin, qmax = code_range(self.bits, signed=True)
        return AffineGroupFormat(g, self.mapping_type, qmin, qmax, self.eps, sd, None, ZeroPointDomain.NONE, True)

    def rows_independent(self, weight: torch.Tensor) -> bool:
        return self.algorithm not in CALIBRATED

    def quantize_weight(self, weight: torch.Tensor, *, label: str | None = None) -> AffineQuantizedTensor:
        self._check_weight(weight, label)
        if self.algorithm in CALIBRATED:
            return self._quantize_calibrated(weight, label)
        block = (1, weight.shape[1] if self.group_size is None else self.group_size)
        sd = self.scale_dtype or weight.dtype
        if self.mapping_type is MappingType.ASYMMETRIC:
            qmin, qmax = code_range(self.bits, signed=False)
            domain = ZeroPointDomain.INT
        else:
            qmin, qmax = code_range(self.bits, signed=True)
            domain = ZeroPointDomain.NONE
        return AffineQuantizedTensor.from_float(
            weight, self.mapping_type, block, qmin, qmax, eps=self.eps, scale_dtype=sd, zero_point_domain=domain,
            layout=self.layout, label=label, config=self, refine_zero=_zero_refiner(self.algorithm, block, qmin, qmax, domain),
        )


@dataclass(frozen=True)
class NF4WeightOnlyConfig(QuantConfig):
    """bitsandbytes-compatible 4-bit blockwise weights (QLoRA's NF4, or bitsandbytes' FP4).

    Blocks of ``block_size`` (a power of two in 32..4096 dividing ``in_features``) get an fp32
    absmax; each weight becomes the nibble of the nearest ``quant_type`` codebook value of
    ``w / absmax``. ``double_quant`` stores the absmax double-quantized (8-bit dynamic map in
    blocks of 256 with a mean offset: 4.127 instead of 4.5 bits per weight at block 64).
    Numerics: ``torch.ops.torchq.quantize_4bit``; bytes equal bitsandbytes'.
    ``algorithm``: ``"rtn"`` (nearest codebook value, default), ``"gptq"`` or ``"awq"`` (calibrated:
    :func:`torchq.calibrate`).
    """

    block_size: int = 64
    double_quant: bool = True
    quant_type: str = "nf4"
    layout: Layout | None = None
    compute_dtype: torch.dtype | None = None
    algorithm: str = "rtn"

    def __post_init__(self) -> None:
        from .ops.blockwise import BLOCK_SIZES

        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size: expected a power of two in 32..4096, got {self.block_size!r}")
        if self.quant_type not in ("nf4", "fp4"):
            raise ValueError(f"quant_type: expected 'nf4' or 'fp4', got {self.quant_type!r}")
        if not isinstance(self.double_quant, bool):
            raise TypeError(f"double_quant: expected a bool, got {self.double_quant!r}")
        _check_algorithm(self.algorithm, False, "a codebook format (nf4 / fp4)")
        self._check_common()

    def group_format(self, weight: torch.Tensor) -> CodebookGroupFormat:
        return CodebookGroupFormat(self.block_size, self.quant_type, self.double_quant)

    def rows_independent(self, weight: torch.Tensor) -> bool:
        return False  # quantize_weight bounds its own temporaries (its double quantization spans the whole weight)

    def quantize_weight(self, weight: torch.Tensor, *, label: str | None = None) -> AffineQuantizedTensor:
        from .canonical import NestedScale, PlainForm, QuantSpec

        self._check_weight(weight, label)
        n, k = weight.shape
        if k % self.block_size:
            raise LayerNotSupported(f"in_features {k} is not a multiple of block_size {self.block_size}")
        if self.algorithm in CALIBRATED:
            return self._quantize_calibrated(weight, label)
        if weight.device.type != "meta" and not bool(torch.isfinite(weight).all()):
            raise ValueError(f"weight contains {int((~torch.isfinite(weight)).sum())} NaN/inf value(s)")
        from .bitpack import unpack_bits

        # blocks never straddle rows (k % block_size == 0): a few rows at a time bounds the temporaries
        rows = max(1, ROW_CHUNK_BYTES // (k * weight.element_size()))
        codes = torch.empty(n, k, dtype=torch.uint8, device=weight.device)
        scale = torch.empty(n, k // self.block_size, dtype=torch.float32, device=weight.device)
        for r0 in range(0, n, rows):
            chunk = weight.detach()[r0:r0 + rows]
            packed, absmax = torch.ops.torchq.quantize_4bit(chunk, self.block_size, self.quant_type, torch.uint8)
            codes[r0:r0 + rows] = unpack_bits(packed.reshape(chunk.shape[0], k // 2), 4, k)
            scale[r0:r0 + rows] = absmax.reshape(chunk.shape[0], k // self.block_size)
        nested = NestedScale.quantize(scale) if self.double_quant else None
        if nested is not None:
            scale = nested.dequantize()
        spec = QuantSpec((1, self.block_size), 0, 15, ZeroPointDomain.NONE, codebook=self.quant_type, double_quant=self.double_quant)
        plain = PlainForm(codes, scale, None, spec, nested)
        return AffineQuantizedTensor.from_plain(plain, weight.dtype, layout=self.layout, label=label, config=self)


@dataclass(frozen=True)
class Int8DynamicActivation4BitWeightConfig(QuantConfig):
    """4-bit weights x int8 activations (llama.cpp's Q4 x Q8_0, torchao's da8w4): at run time each
    activation row is quantized per 32-element block to int8
    (:class:`~torchq.activation.PerBlockInt8`) and multiplied by the 4-bit codes with integer
    dot products (``torchq.ops.int8act``).

    ``weight``: ``"int4"`` (groupwise affine codes 0..15, tinygemm-style float zero point, fp32
    scales and zeros, :class:`~torchq.layouts.Int4NativeLayout`: 4 bits + 64 bits per
    ``group_size`` weights) or ``"nf4"`` / ``"fp4"`` (blockwise absmax per ``group_size``, as
    :class:`NF4WeightOnlyConfig`; ``double_quant`` optional). Numerics: ``torchq.ops.int8act``
    (int4: the reference up to fp32 summation order; NF4 / FP4: the codebook rounded to int8).
    """

    weight: str = "int4"
    group_size: int = 32
    double_quant: bool = False
    layout: Layout | None = None
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.weight not in ("int4", "nf4", "fp4"):
            raise ValueError(f"weight: expected 'int4', 'nf4' or 'fp4', got {self.weight!r}")
        self._inner()  # validates group_size / double_quant for the weight format
        self._check_common()
        if self.layout is not None:
            raise ValueError(f"layout: the int8-activation mode chooses its own (int4: Int4NativeLayout), got {self.layout!r}")

    def _inner(self) -> QuantConfig:
        from .layouts import Int4NativeLayout

        if self.weight == "int4":
            if self.double_quant:
                raise ValueError("double_quant: only for weight='nf4' / 'fp4'")
            return Int4WeightOnlyConfig(group_size=self.group_size, layout=Int4NativeLayout(), scale_dtype=torch.float32)
        return NF4WeightOnlyConfig(block_size=self.group_size, double_quant=self.double_quant, quant_type=self.weight)

    def quantize_weight(self, weight: torch.Tensor, *, label: str | None = None) -> AffineQuantizedTensor:
        from .activation import PerBlockInt8

        self._check_weight(weight, label)
        w = self._inner().quantize_weight(weight, label=label)
        return AffineQuantizedTensor(w.tensor_impl, w.dtype, act_quant=PerBlockInt8(), label=label, config=self,
                                     compute_dtype=self.compute_dtype)


@dataclass(frozen=True)
class LLMInt8Config(QuantConfig):
    """LLM.int8 (bitsandbytes semantics): int8 weights per output channel, symmetric [-127, 127]
    with fp32 scales; at run time, activation columns holding a value with ``|x| >= threshold``
    are multiplied in floating point and the rest per row in int8 (see
    :class:`~torchq.activation.OutlierInt8`)."""

    threshold: float = 6.0
    layout: Layout | None = None
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        OutlierInt8(self.threshold)  # validates
        object.__setattr__(self, "threshold", float(self.threshold))
        self._check_common()

    def quantize_weight(self, weight: torch.Tensor, *, label: str | None = None) -> AffineQuantizedTensor:
        self._check_weight(weight, label)
        return _int8_per_channel(weight, self, -127, 127, OutlierInt8(self.threshold), label)


def _float8_weight(weight: torch.Tensor, cfg: QuantConfig, granularity: str, act_quant, label) -> AffineQuantizedTensor:
    """float8_e4m3fn codes and fp32 scales (:func:`torchq.float8.quantize_float8`) in the plain form's
    ``e4m3fn`` codebook (the codes' own bytes)."""
    n, k = weight.shape
    spec = QuantSpec((1, k) if granularity == "row" else (n, k), 0, 255, ZeroPointDomain.NONE, codebook=FLOAT8_CODEBOOK)
    if weight.device.type == "meta":  # shapes only (a meta model built from its config)
        codes = torch.empty(n, k, dtype=FLOAT8_DTYPE, device="meta")
        scale = torch.empty((n, 1) if granularity == "row" else (1, 1), dtype=torch.float32, device="meta")
    else:
        try:
            codes, scale = quantize_float8(weight.detach(), granularity)
        except ValueError as e:
            raise ValueError(f"weight: {str(e).removeprefix('w: ')}") from None
    plain = PlainForm(codes.view(torch.uint8), scale, None, spec)
    return AffineQuantizedTensor.from_plain(plain, weight.dtype, layout=cfg.layout, act_quant=act_quant, label=label,  # type: ignore[attr-defined]
                                            config=cfg)


@dataclass(frozen=True)
class Float8DynamicActivationFloat8WeightConfig(QuantConfig):
    """float8_e4m3fn weights with one fp32 scale per output row (``granularity="row"``) or per
    tensor; activations quantized to float8_e4m3fn per call, per row (token) or per tensor
    (:class:`~torchq.activation.Float8Activations`, the same granularity), the product through
    ``torch._scaled_mm`` on CUDA 8.9+ (``torchq::float8_dynamic_linear``). Scales
    ``max(amax / 448, 2^-126)`` in fp32; codes rounded to nearest even, saturated at ±448; a weight
    row with NaN or inf is refused (:mod:`torchq.float8`)."""

    granularity: str = "row"
    layout: Layout | None = None
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        check_granularity(self.granularity)
        self._check_common()

    def rows_independent(self, weight: torch.Tensor) -> bool:
        return self.granularity == "row"

    def quantize_weight(self, weight: torch.Tensor, *, label: str | None = None) -> AffineQuantizedTensor:
        self._check_weight(weight, label)
        return _float8_weight(weight, self, self.granularity, Float8Activations(self.granularity), label)


@dataclass(frozen=True)
class Float8WeightOnlyConfig(QuantConfig):
    """float8_e4m3fn weights with one fp32 scale per output row (as
    :class:`Float8DynamicActivationFloat8WeightConfig`), activations as given
    (``torchq::float8_weight_linear``)."""

    layout: Layout | None = None
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        self._check_common()

    def rows_independent(self, weight: torch.Tensor) -> bool:
        return True

    def quantize_weight(self, weight: torch.Tensor, *, label: str | None = None) -> AffineQuantizedTensor:
        self._check_weight(weight, label)
        return _float8_weight(weight, self, "row", None, label)


def float8_dynamic_activation_float8_weight(granularity: str = "row", layout: Layout | None = None,
                                            compute_dtype: torch.dtype | None = None) -> Float8DynamicActivationFloat8WeightConfig:
    return Float8DynamicActivationFloat8WeightConfig(granularity=granularity, layout=layout, compute_dtype=compute_dtype)


def float8_weight_only(layout: Layout | None = None, compute_dtype: torch.dtype | None = None) -> Float8WeightOnlyConfig:
    return Float8WeightOnlyConfig(layout=layout, compute_dtype=compute_dtype)


def int4_weight_only(group_size: int = 128, layout: Layout | None = None, **kwargs: Any) -> Int4WeightOnlyConfig:
    return Int4WeightOnlyConfig(group_size=group_size, layout=layout, **kwargs)


def int8_weight_only(layout: Layout | None = None, compute_dtype: torch.dtype | None = None) -> Int8WeightOnlyConfig:
    return Int8WeightOnlyConfig(layout=layout, compute_dtype=compute_dtype)


def int8_dynamic_activation_int8_weight(
    layout: Layout | None = None, compute_dtype: torch.dtype | None = None, reduce_range: bool = False
) -> Int8DynamicActivationInt8WeightConfig:
    return Int8DynamicActivationInt8WeightConfig(layout=layout, compute_dtype=compute_dtype, reduce_range=reduce_range)


def int8_static_activation_int8_weight(
    observer: str = "minmax", symmetric: bool = False, percentile: float = 99.99, averaging_constant: float = 0.01,
    layout: Layout | None = None, compute_dtype: torch.dtype | None = None,
) -> Int8StaticActivationInt8WeightConfig:
    """The config :func:`torchq.static.prepare` calibrates (see :class:`Int8StaticActivationInt8WeightConfig`)."""
    return Int8StaticActivationInt8WeightConfig(observer=observer, symmetric=symmetric, percentile=percentile,
                                                averaging_constant=averaging_constant, layout=layout, compute_dtype=compute_dtype)


def intx_weight_only(bits: int = 4, group_size: int | None = 32, **kwargs: Any) -> IntxWeightOnlyConfig:
    return IntxWeightOnlyConfig(bits=bits, group_size=group_size, **kwargs)


def config_from_name(name: str) -> QuantConfig:
    """A config from its short name, as used by benchmarks and command lines: ``int8wo``,
    ``int8dq`` (``int8dq-r7``: 7-bit activations, ``reduce_range``), ``int8static[-sym][-minmax|-ma|-pct]``
    (static int8 activations to calibrate with :mod:`torchq.static`: symmetric, observer), ``int4-g<G>`` (e.g.
    ``int4-g128``; ``int4-g<G>-fp32``: fp32 scales and zeros whatever the weight's dtype, the form
    the AVX2 decode path factors), ``intx<B>-g<G>`` (e.g. ``intx3-g32``), either with ``-hqq`` at
    the end for HQQ zero points (``int4-g128-hqq``), ``nf4`` / ``fp4`` with an optional
    ``-b<block>`` (double-quantized scales), any of these with ``-gptq`` / ``-awq`` at the end for a
    calibrated algorithm (``int4-g128-gptq``, ``nf4-awq``: :func:`torchq.calibrate`), the int8-activation mode ``int4a8[-g<G>]``
    (default 32) / ``nf4a8[-b<B>]`` / ``fp4a8[-b<B>]`` (default 64), or float8: ``fp8dq-row`` / ``fp8dq-tensor``
    (dynamic float8 activations) and ``fp8wo`` (weight-only)."""
    import re

    if name == "int8wo":
        return int8_weight_only()
    if name == "int8dq":
        return int8_dynamic_activation_int8_weight()
    if name == "int8dq-r7":
        return int8_dynamic_activation_int8_weight(reduce_range=True)
    if m := re.fullmatch(r"int8static(-sym)?(-minmax|-ma|-pct)?", name):
        observer = {"-ma": "moving_average", "-pct": "percentile"}.get(m[2] or "", "minmax")
        return int8_static_activation_int8_weight(observer=observer, symmetric=bool(m[1]))
    if name in ("fp8dq-row", "fp8dq-tensor"):
        return float8_dynamic_activation_float8_weight(name.removeprefix("fp8dq-"))
    if name == "fp8wo":
        return float8_weight_only()
    if m := re.fullmatch(r"(nf4|fp4)(-b(\d+))?(-gptq|-awq)?", name):
        return NF4WeightOnlyConfig(block_size=int(m[3] or 64), quant_type=m[1], algorithm=(m[4] or "-rtn")[1:])
    if m := re.fullmatch(r"int4-g(\d+)(-fp32)?(-hqq|-gptq|-awq)?", name):
        return int4_weight_only(group_size=int(m[1]), **({"scale_dtype": torch.float32} if m[2] else {}),
                                algorithm=(m[3] or "-rtn")[1:])
    if m := re.fullmatch(r"intx(\d)-g(\d+)(-hqq|-gptq|-awq)?", name):
        return intx_weight_only(bits=int(m[1]), group_size=int(m[2]), algorithm=(m[3] or "-rtn")[1:])
    if m := re.fullmatch(r"(int4|nf4|fp4)a8(-[gb](\d+))?", name):
        return int8_dynamic_activation_4bit_weight(m[1], int(m[3] or (32 if m[1] == "int4" else 64)))
    raise ValueError(f"config name: unknown {name!r}; expected int8wo, int8dq, int8dq-r7, int8static[-sym][-minmax|-ma|-pct], int4-g<G>[-fp32][-hqq|-gptq|-awq], "
                     f"intx<B>-g<G>[-hqq|-gptq|-awq], nf4[-b<B>][-gptq|-awq], "
                     f"fp4[-b<B>], int4a8[-g<G>], nf4a8[-b<B>], fp4a8[-b<B>], fp8dq-row, fp8dq-tensor or fp8wo")


def int8_dynamic_activation_4bit_weight(weight: str = "int4", group_size: int = 32, double_quant: bool = False,
                                        compute_dtype: torch.dtype | None = None) -> Int8DynamicActivation4BitWeightConfig:
    return Int8DynamicActivation4BitWeightConfig(weight=weight, group_size=group_size, double_quant=double_quant,
                                                 compute_dtype=compute_dtype)


def nf4_weight_only(
    block_size: int = 64, double_quant: bool = True, layout: Layout | None = None, compute_dtype: torch.dtype | None = None,
    algorithm: str = "rtn",
) -> NF4WeightOnlyConfig:
    return NF4WeightOnlyConfig(block_size=block_size, double_quant=double_quant, quant_type="nf4", layout=layout,
                               compute_dtype=compute_dtype, algorithm=algorithm)


def fp4_weight_only(
    block_size: int = 64, double_quant: bool = True, layout: Layout | None = None, compute_dtype: torch.dtype | None = None,
    algorithm: str = "rtn",
) -> NF4WeightOnlyConfig:
    return NF4WeightOnlyConfig(block_size=block_size, double_quant=double_quant, quant_type="fp4", layout=layout,
                               compute_dtype=compute_dtype, algorithm=algorithm)


def llm_int8(threshold: float = 6.0, layout: Layout | None = None, compute_dtype: torch.dtype | None = None) -> LLMInt8Config:
    return LLMInt8Config(threshold=threshold, layout=layout, compute_dtype=compute_dtype)
