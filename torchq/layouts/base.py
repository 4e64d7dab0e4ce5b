"""Layout and TensorImpl bases, the layout registry, and automatic layout choice.

A ``Layout`` is a frozen, hashable dataclass that names a storage format and its options; its
``impl_class`` (a :class:`TensorImpl`) holds the tensors in that format and converts losslessly
to and from :class:`~torchq.canonical.PlainForm`. A layout module defines both and the layout's
ordered linear kernels (:meth:`Layout.linear_kernels`), and touches nothing else. This module never names a concrete
layout: a layout answers one question, :meth:`Layout.fit` (can it hold a weight, and should
automatic choice put it there), and automatic choice takes the first layout in the device's
preference order (:mod:`torchq.layouts.preference`) that fits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from ..canonical import PlainForm, QuantSpec
from ..identity_cache import IdentityCache
from ..ops.affine import dequantize_plain
from ..primitives import ZeroPointDomain, scale_shape
from ..serialization import reduce_object, register_kind

__all__ = [
    "Layout", "LayoutExample", "Fit", "TensorImpl", "Buffer", "FLOATING", "INTEGER", "layout_from_json", "registered_layouts", "choose_layout",
    "layout_rejections", "placement_reason", "plain_buffers", "zero_dtype_rejects",
]

_LAYOUTS: dict[str, type[Layout]] = {}


@dataclasses.dataclass(frozen=True)
class Fit:
    """A layout's answer for one weight: ``cannot_hold`` (None, or why the layout cannot hold it)
    and ``not_automatic`` (None, or why automatic choice should not put it there although it
    can hold it: its kernels do not run on that device, an optional library is missing...)."""

    cannot_hold: str | None = None
    not_automatic: str | None = None

    @property
    def holds(self) -> bool:
        return self.cannot_hold is None

    @property
    def automatic(self) -> bool:
        return self.cannot_hold is None and self.not_automatic is None

    @property
    def reason(self) -> str | None:
        """Why automatic choice passes over the layout (None: it takes it)."""
        return self.cannot_hold or self.not_automatic


HOLDS = Fit()


@dataclasses.dataclass(frozen=True)
class LayoutExample:
    """One weight a layout is documented to hold, for the layout contract tests: the layout (with
    its options), the format, the ``[N, K]`` shape and the dtypes of the scales and zero points
    (``zero_dtype`` None: the default of :meth:`~torchq.canonical.PlainForm.example`)."""

    layout: Layout
    spec: QuantSpec
    shape: tuple[int, int]
    scale_dtype: torch.dtype = torch.float32
    zero_dtype: torch.dtype | None = None

    def plain(self, seed: int = 0) -> PlainForm:
        """A random plain form of this example (on the CPU)."""
        return PlainForm.example(self.spec, self.shape, self.scale_dtype, zero_dtype=self.zero_dtype, seed=seed)


class Layout:
    """Base of all layouts. Subclasses are ``@dataclass(frozen=True)`` and set ``name``.

    Class attributes a layout sets:

    * ``name``: registry key used in JSON (``{"type": name, ...fields}``);
    * ``impl_class``: its :class:`TensorImpl`;
    * ``device_specific``: True when the packed bytes only make sense on one device type,
      so moving to another device repacks through the plain form;
    * ``holds_codebooks`` / ``holds_nested_scales``: whether it stores codebook formats (nf4,
      fp4) and double-quantized scales losslessly (checked for every layout by :meth:`fit`).

    Automatic choice tries layouts in the order of :mod:`torchq.layouts.preference`.
    """

    name: ClassVar[str] = ""
    impl_class: ClassVar[type[TensorImpl]]
    device_specific: ClassVar[bool] = False
    holds_codebooks: ClassVar[bool] = False
    holds_nested_scales: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            if cls.name in _LAYOUTS and _LAYOUTS[cls.name].__qualname__ != cls.__qualname__:
                raise ValueError(f"layout name {cls.name!r} is already registered by {_LAYOUTS[cls.name]}")
            _LAYOUTS[cls.name] = cls

    @classmethod
    def linear_kernels(cls) -> tuple[Any, ...]:
        """This layout's own :class:`~torchq.dispatch.LinearKernel` s, in the order the dispatch
        tries them (after user kernels registered for the layout). Conditions need not check the
        layout: they are only asked about weights in it. None by default."""
        return ()

    @classmethod
    def examples(cls) -> tuple[LayoutExample, ...]:
        """Weights this layout holds, covering what it is documented to hold (formats, scale and
        zero-point dtypes, padded shapes, layout options): the layout contract tests
        (``tests/test_layout_contract.py``) run every registered layout on its examples, so a
        layout must override this. None by default."""
        return ()

    def __reduce__(self):
        return reduce_object("layout", self)

    def fit(self, spec: QuantSpec, shape: tuple[int, ...] | None = None, scale_dtype: torch.dtype | None = None,
            device: torch.device | str | None = None) -> Fit:
        """Whether this layout can hold a weight of format ``spec``, ``shape``, scales of
        ``scale_dtype`` on ``device``, and whether automatic choice should put it here. None
        for an argument means unknown (a config checks the format before it sees a weight):
        only what the known arguments rule out is reported. Layouts extend this (calling it
        first: it checks the capabilities every layout declares)."""
        if spec.codebook is not None and not self.holds_codebooks:
            return Fit(f"does not hold codebook formats ({spec.codebook})")
        if spec.double_quant and not self.holds_nested_scales:
            return Fit("does not hold double-quantized scales")
        return HOLDS

    def pack(self, plain: PlainForm) -> TensorImpl:
        """Convert the plain form into this layout (raises ValueError with the reason if it cannot)."""
        reason = self.fit(plain.spec, plain.shape, plain.scale.dtype, plain.device).cannot_hold
        if reason is not None:
            raise ValueError(f"layout {self!r} cannot hold this weight: {reason}")
        return self.impl_class.from_plain(plain, self)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"type": self.name}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            out[f.name] = getattr(self, f.name)
        return out


def layout_from_json(d: dict) -> Layout:
    """Inverse of ``Layout.to_json``."""
    if not isinstance(d, dict) or "type" not in d:
        raise ValueError(f"layout JSON: expected an object with a 'type' key, got {d!r}")
    cls = _LAYOUTS.get(d["type"])
    if cls is None:
        raise ValueError(f"layout JSON: unknown layout type {d['type']!r}; known: {sorted(_LAYOUTS)}")
    fields = {k: v for k, v in d.items() if k != "type"}
    try:
        return cls(**fields)
    except TypeError as e:
        raise ValueError(f"layout JSON for {d['type']!r}: {e}") from None


register_kind("layout", layout_from_json)


def registered_layouts() -> dict[str, type[Layout]]:
    return dict(_LAYOUTS)


def _automatic_candidates(device: torch.device) -> list[Layout]:
    from .preference import order

    return [_LAYOUTS[name]() for name in order(device.type) if name in _LAYOUTS]


def layout_rejections(spec: QuantSpec, shape, scale_dtype, device) -> dict[str, str | None]:
    """For every registered layout (with default options where it has them), the ones automatic
    choice tries on ``device`` first and in that order: None (automatic choice may take it) or why not."""
    from .preference import order

    device = torch.device(device)
    out: dict[str, str | None] = {}
    preferred = order(device.type)
    for name in sorted(_LAYOUTS, key=lambda n: (preferred.index(n) if n in preferred else len(preferred), n)):
        try:
            layout = _LAYOUTS[name]()
        except TypeError:  # a layout without default options
            continue
        reason = layout.fit(spec, tuple(shape), scale_dtype, device).reason
        if reason is None and name not in preferred:
            reason = f"not in the automatic order for {device.type} (torchq.layouts.preference)"
        out[name] = reason
    return out


def choose_layout(spec: QuantSpec, shape, scale_dtype: torch.dtype, device) -> Layout:
    """The first layout in ``device``'s preference order (default options) that fits the weight."""
    device = torch.device(device)
    for layout in _automatic_candidates(device):
        if layout.fit(spec, tuple(shape), scale_dtype, device).automatic:
            return layout
    raise ValueError(f"no registered layout accepts {spec.describe()} of shape {tuple(shape)} on {device}")


def placement_reason(layout: Layout, spec: QuantSpec, shape, scale_dtype: torch.dtype, device) -> str | None:
    """Why a weight moving (or loading) to ``device`` should not stay in ``layout``: it cannot
    hold it there, or the layout is ``device_specific`` and automatic choice would pass over it
    there (its kernels run elsewhere). None: keep the layout."""
    f = layout.fit(spec, tuple(shape), scale_dtype, torch.device(device))
    return f.cannot_hold or (f.not_automatic if layout.device_specific else None)


# impls that passed validate(), by identity (a pickle cannot add to it)
_VALIDATED = IdentityCache()

# Dtype kinds a Buffer may name instead of dtypes.
FLOATING = "floating point"
INTEGER = "integer"


@dataclasses.dataclass(frozen=True)
class Buffer:
    """What one inner tensor of a :class:`TensorImpl` must be: exactly ``shape``, a dtype in
    ``dtype`` (one dtype, a tuple of them, or the kinds :data:`FLOATING` / :data:`INTEGER`),
    and contiguous if ``contiguous``."""

    shape: tuple[int, ...]
    dtype: torch.dtype | tuple[torch.dtype, ...] | str
    contiguous: bool = False

    def accepts_dtype(self, dtype: torch.dtype) -> bool:
        if self.dtype == FLOATING:
            return dtype.is_floating_point
        if self.dtype == INTEGER:
            return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
        return dtype in self.dtype if isinstance(self.dtype, tuple) else dtype == self.dtype

    def describe(self) -> str:
        if isinstance(self.dtype, tuple):
            kind = "/".join(str(d).removeprefix("torch.") for d in self.dtype)
        else:
            kind = str(self.dtype).removeprefix("torch.")
        return f"{'contiguous ' if self.contiguous else ''}{kind} {list(self.shape)}"


def plain_buffers(spec: QuantSpec, shape: tuple[int, ...]) -> dict[str, Buffer | None]:
    """``scale`` and ``zero_point`` as a :class:`~torchq.canonical.PlainForm` holds them for
    ``spec`` and ``shape`` (for layouts that store them unchanged)."""
    grid = scale_shape(shape, spec.block_size)
    domain = spec.zero_point_domain
    zero = None
    if domain is not ZeroPointDomain.NONE:
        zero = Buffer(grid, FLOATING if domain is ZeroPointDomain.FLOAT else INTEGER)
    return {"scale": Buffer(grid, torch.float32 if spec.codebook is not None else FLOATING), "zero_point": zero}


def zero_dtype_rejects(spec: QuantSpec, zero_dtype: Any) -> str | None:
    """Why ``zero_dtype`` (a layout's remembered zero-point dtype) does not fit ``spec``'s
    zero-point domain: None for NONE, a floating dtype for FLOAT, an integer one for INT."""
    domain = spec.zero_point_domain
    if domain is ZeroPointDomain.NONE:
        ok = zero_dtype is None
    elif isinstance(zero_dtype, torch.dtype):
        ok = zero_dtype.is_floating_point if domain is ZeroPointDomain.FLOAT else Buffer((), INTEGER).accepts_dtype(zero_dtype)
    else:
        ok = False
    if ok:
        return None
    want = {ZeroPointDomain.NONE: "None", ZeroPointDomain.FLOAT: "a floating dtype", ZeroPointDomain.INT: "an integer dtype"}[domain]
    return f"zero_dtype: expected {want} for zero_point_domain {domain.name}, got {zero_dtype!r}"


def _check_storage(what: str, t: torch.Tensor) -> None:
    """Raise unless ``t``'s storage holds every element its shape and strides address (plain
    tensors with real storage only: meta, fake and traced tensors are left to their shapes)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta" or t.numel() == 0:
        return
    if torch.compiler.is_compiling():
        return
    last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    need = (last + 1) * t.element_size()
    held = t.untyped_storage().nbytes()
    if held < need:
        raise ValueError(f"{what}: its storage holds {held} bytes, its shape and strides address {need}: {_describe_tensor(t)}")


def _describe_tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} strides {list(t.stride())} on {t.device}"


class TensorImpl:
    """Holds one quantized weight's tensors in one layout.

    Subclasses declare ``tensor_fields`` (inner tensor names, any may be None) and
    ``attr_fields`` (hashable non-tensor attributes beyond ``layout``, ``spec``, ``shape``);
    the constructor, flattening, ``map`` (detach / clone / to) and equality of metadata derive
    from these declarations. ``shape`` is the logical ``[N, K]`` weight shape.

    Every construction runs :meth:`validate`: the tensors must be what :meth:`expected_tensors`
    derives from the metadata (exact shapes and dtypes), so no kernel is handed a buffer smaller
    than the weight's metadata claims.
    """

    tensor_fields: ClassVar[tuple[str, ...]] = ()
    attr_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, layout: Layout, spec: QuantSpec, shape: tuple[int, ...], **fields: Any) -> None:
        self.layout = layout
        self.spec = spec
        self.shape = tuple(int(s) for s in shape)
        expected = set(self.tensor_fields) | set(self.attr_fields)
        if set(fields) != expected:
            raise TypeError(f"{type(self).__name__}: expected fields {sorted(expected)}, got {sorted(fields)}")
        for k, v in fields.items():
            setattr(self, k, v)
        self.validate()
        _VALIDATED.set(self, True)

    def ensure_valid(self) -> None:
        """:meth:`validate`, unless this very object already passed it (in its constructor or an
        earlier call): for wrappers built around an impl on every call. An object built without
        its constructor (by a pickle) is always validated here."""
        if _VALIDATED.get(self) is None:
            self.validate()
            _VALIDATED.set(self, True)

    # -- validation ----------------------------------------------------------------------------
    def expected_tensors(self) -> dict[str, Buffer | None] | None:
        """What each inner tensor must be, derived from the metadata alone (layout, spec, shape,
        attrs): a :class:`Buffer`, or None where the tensor must be absent. May raise ValueError
        when the metadata itself is inconsistent. None (the default, for layouts that declare
        nothing): only the generic checks of :meth:`validate` run."""
        return None

    def validate(self) -> None:
        """Raise ValueError/TypeError unless the metadata is well-formed and every inner tensor
        is exactly what :meth:`expected_tensors` says: present or absent, shape, dtype,
        contiguity, one device for all, no expanded (stride-0) dimensions. Reads no data, so
        meta and fake tensors are checked too."""
        name = type(self).__name__
        layout = getattr(self, "layout", None)
        if not isinstance(layout, Layout):
            raise TypeError(f"{name}: layout: expected a torchq Layout, got {type(layout).__name__}")
        if not isinstance(self, layout.impl_class):
            raise TypeError(f"{name}: layout {layout!r} holds {layout.impl_class.__name__} tensors, not {name}")
        if not isinstance(getattr(self, "spec", None), QuantSpec):
            raise TypeError(f"{name}: spec: expected a QuantSpec, got {type(getattr(self, 'spec', None)).__name__}")
        shape = getattr(self, "shape", None)
        if (not isinstance(shape, tuple) or len(shape) != len(self.spec.block_size)
                or not all(isinstance(s, int) and s >= 0 for s in shape)):
            raise ValueError(f"{name}: shape: expected {len(self.spec.block_size)} non-negative ints, got {shape!r}")
        present = []
        for f in self.tensor_fields:
            t = getattr(self, f, None)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: {f}: expected a tensor or None, got {type(t).__name__}")
            if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
                raise ValueError(f"{name}: {f}: expected a tensor that holds each of its elements, got an expanded "
                                 f"(stride 0) view: {_describe_tensor(t)}")
            _check_storage(f"{name}: {f}", t)
            present.append((f, t))
        if not present:
            raise ValueError(f"{name}: expected at least one of the tensors {list(self.tensor_fields)}, got none")
        device = present[0][1].device
        for f, t in present:
            if t.device != device:
                raise ValueError(f"{name}: {f}: expected device {device} (the {present[0][0]}'s), got {t.device}")
        expected = self.expected_tensors()
        if expected is None:
            return
        for f in self.tensor_fields:
            t, want = getattr(self, f, None), expected.get(f)
            if want is None:
                if t is not None:
                    raise ValueError(f"{self._what(f)}: expected no tensor for this format, got {_describe_tensor(t)}")
                continue
            if t is None:
                raise ValueError(f"{self._what(f)}: expected {want.describe()}, got None")
            if tuple(t.shape) != tuple(want.shape) or not want.accepts_dtype(t.dtype) or (want.contiguous and not t.is_contiguous()):
                raise ValueError(f"{self._what(f)}: expected {want.describe()}, got {_describe_tensor(t)}")

    def _what(self, field: str) -> str:
        return f"{type(self).__name__} ({self.spec.describe()}, shape {list(self.shape)}): {field}"

    # -- generic machinery -----------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        """Names of the inner tensors that are present (the flattening order)."""
        return [n for n in self.tensor_fields if getattr(self, n) is not None]

    def metadata(self) -> tuple:
        """Everything but the tensors: hashable, compared by guards and by ``copy_``."""
        return (type(self), self.layout, self.spec, self.shape, tuple(getattr(self, a) for a in self.attr_fields))

    @classmethod
    def rebuild(cls, metadata: tuple, tensors: dict[str, torch.Tensor]) -> TensorImpl:
        impl_cls, layout, spec, shape, attrs = metadata
        fields = {n: tensors.get(n) for n in impl_cls.tensor_fields}
        fields.update(zip(impl_cls.attr_fields, attrs))
        return impl_cls(layout, spec, shape, **fields)

    def map(self, fn) -> TensorImpl:
        """A new impl with ``fn`` applied to every present tensor (metadata unchanged)."""
        tensors = {n: fn(getattr(self, n)) for n in self.tensor_names()}
        return self.rebuild(self.metadata(), tensors)

    @property
    def device(self) -> torch.device:
        return getattr(self, self.tensor_names()[0]).device

    def nbytes(self) -> int:
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self.tensor_names())

    def to_device(self, device: torch.device, *, automatic: bool = False) -> TensorImpl:
        """Move without re-quantizing: copy the bytes, or repack through the plain form when the
        layout is device-specific (choosing the target device's best layout unless this one
        belongs there: see :func:`placement_reason`). ``automatic``: the layout was left to
        automatic choice, so a move to another device type takes that device's choice (a weight
        quantized on the CPU gets CUDA's layout on CUDA, and back)."""
        device = torch.device(device)
        if device == self.device:
            return self
        if automatic and device.type != self.device.type and "meta" not in (device.type, self.device.type):
            plain = self.to_plain()
            target = choose_layout(plain.spec, plain.shape, plain.scale.dtype, device)
            if target != self.layout:
                return target.pack(plain.map(lambda t: t.to(device)))
        if not self.layout.device_specific:
            return self.map(lambda t: t.to(device))
        plain = self.to_plain().map(lambda t: t.to(device))
        layout = self.layout
        if placement_reason(layout, plain.spec, plain.shape, plain.scale.dtype, device) is not None:
            layout = choose_layout(plain.spec, plain.shape, plain.scale.dtype, device)
        return layout.pack(plain)

    def automatic_layout(self) -> bool:
        """Whether this impl's layout is the one automatic choice gives on its own device."""
        plain_scale_dtype = self.to_plain().scale.dtype
        try:
            return choose_layout(self.spec, self.shape, plain_scale_dtype, self.device) == self.layout
        except ValueError:
            return False

    # -- per-layout hooks --------------------------------------------------------------------
    @classmethod
    def from_plain(cls, plain: PlainForm, layout: Layout) -> TensorImpl:
        raise NotImplementedError

    def to_plain(self) -> PlainForm:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_plain(self.to_plain(), dtype)  # compiled too, with the eager roundings

    def plain_rows(self, index: torch.Tensor) -> PlainForm:
        """The plain form of rows ``index`` (dim 0, in range), as ``to_plain().rows(index)``.
        Layouts whose rows are stored apart override it to gather those rows only: an embedding
        lookup on a tied weight then costs its rows, not an unpacking of the whole table."""
        return self.to_plain().rows(index)

    def narrow_view(self, dim: int, start: int, length: int) -> TensorImpl | None:
        """A slice whose tensors are views of this impl's storage, or None if the layout cannot
        slice there without copying (the caller then goes through the plain form)."""
        return None

    def __repr__(self) -> str:
        tensors = ", ".join(f"{n}={tuple(getattr(self, n).shape)}:{getattr(self, n).dtype}" for n in self.tensor_names())
        return f"{type(self).__name__}({self.layout!r}, {self.spec.describe()}, shape={self.shape}, {tensors})"
