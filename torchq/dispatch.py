"""The linear dispatch: each layout's ordered kernels, plus the kernels users register.

``F.linear``, ``aten.linear``, ``aten.mm`` and ``aten.addmm`` with an ``AffineQuantizedTensor``
weight arrive at :func:`quantized_linear`. A layout lists its own kernels in order
(``Layout.linear_kernels()``, defined in the layout's module); the kernels tried for a weight are,
in this order: user kernels registered for its layout class (or a base class), user kernels
registered for :data:`ALL_LAYOUTS`, then the layout's own list (a user kernel registered with
``before=``/``after=`` a kernel of that list sits at that place instead). The first kernel whose
condition accepts ``(input, weight, bias)`` runs. A condition returns ``None`` or ``True`` to
accept, and a string (the reason) or ``False`` to reject.

**Compute dtype.** A kernel declares the input dtypes it takes (:attr:`LinearKernel.dtypes`). The
dtype a linear computes in is ``weight.compute_dtype`` or, when that is None, the input's dtype.
When it differs from the input's dtype, the input is cast to it, the kernel runs without bias,
its output is cast back to the input's dtype and the bias is added in that dtype (it was asked
for: no warning). When no kernel takes the compute dtype but one takes the input cast to another
of fp32/bf16/fp16, that kernel runs through the same cast as a visible fallback: a one-time
:class:`FallbackWarning` naming the layer, the kernel and both dtypes (:class:`NoKernelError`
under :func:`strict`). When no kernel accepts any dtype, the weight is dequantized and the float
op runs in the compute dtype, with a one-time warning naming every kernel's reason (or the error).

The choice is cached per weight (its tensor impl, plus its dtype, compute dtype and activation
quantization) and input signature (dtype, device, shape, subclass; the bias's dtype, device and
shape), so a decode loop asks the conditions once per shape, not once per call. Conditions must
therefore depend only on that signature, the weight's own metadata and global state that is part
of the cache key: the registrations (any change clears the cache) and the providers added with
:func:`add_selection_state` (one is added here: whether the native library is enabled in the calling
thread, :func:`torchq.native.available`). Call :func:`clear_kernel_cache` after changing anything else a condition reads.
A cached choice also keeps its kernel's bound per-call form (:attr:`LinearKernel.bind`), which later
calls of the same signature run when no gradient is needed: for the native CPU kernels, the decode
path with the weight's checked pointers, checking only x and the bias per call.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from . import native
from .identity_cache import IdentityCache
from .ops.devices import check_op_devices
from .tracing import traced

__all__ = [
    "ALL_LAYOUTS",
    "FLOAT_DTYPES",
    "LinearKernel",
    "LinearPlan",
    "FallbackWarning",
    "NoKernelError",
    "register_linear_kernel",
    "unregister_linear_kernel",
    "linear_kernels",
    "select_linear_kernel",
    "plan_linear",
    "quantized_linear",
    "strict",
    "set_strict",
    "is_strict",
    "add_selection_state",
    "clear_kernel_cache",
    "recording",
    "warn_fallback_once",
    "DirectLinear",
    "check_op_devices",
]

Condition = Callable[[torch.Tensor, Any, "torch.Tensor | None"], "bool | str | None"]
Impl = Callable[[torch.Tensor, Any, "torch.Tensor | None"], torch.Tensor]
# a kernel's per-call form for one weight and one input signature: (x, weight, bias) -> output, or
# None when this call cannot take it (the dispatch then runs the kernel's impl)
BoundCall = Callable[[torch.Tensor, Any, "torch.Tensor | None"], "torch.Tensor | None"]
Bind = Callable[[torch.Tensor, Any, "torch.Tensor | None"], "BoundCall | None"]

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
# the dtypes a cast fallback tries, in this order, when no kernel takes the compute dtype
_CAST_ORDER = (torch.bfloat16, torch.float16, torch.float32)


def dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


class FallbackWarning(UserWarning):
    """A quantized linear did not run the kernel it asked for: it ran a kernel on an input cast
    to another dtype, or dequantize + float matmul."""


class NoKernelError(RuntimeError):
    """Raised instead of falling back when strict mode is on."""


class _AllLayouts:
    """Marker for :func:`register_linear_kernel`: the kernel is tried for every layout."""

    def __repr__(self) -> str:
        return "torchq.ALL_LAYOUTS"


ALL_LAYOUTS = _AllLayouts()


@dataclass(frozen=True)
class LinearKernel:
    """A named ``(condition, impl)`` pair; ``dtypes``: the input dtypes ``impl`` takes (the
    dispatch never shows it another one, and casts to one of them when the compute dtype asks).

    ``bind`` (optional): ``bind(x, weight, bias)`` returns a per-call form of ``impl`` for this
    weight and inputs of x's and the bias's signature, ``call(x, weight, bias)``, or None when
    there is none. The dispatch binds once per cached choice (its first call) and then, whenever
    no gradient is needed, calls ``call`` instead of ``impl``; it returns the same bits as ``impl``
    would, or None to hand this call to ``impl``. It is how a decode-sized call skips the work
    ``impl`` redoes per call (finding the weight's native arguments, re-deciding its path). The
    call is kept in the cache that hangs off the weight's tensor impl, so it must not hold the
    weight or its tensor impl (it gets the weight at each call): that would keep them alive."""

    name: str
    condition: Condition = field(repr=False)
    impl: Impl = field(repr=False)
    description: str = ""
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    bind: Bind | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty string, got {self.name!r}")
        if not callable(self.condition) or not callable(self.impl):
            raise TypeError(f"kernel {self.name!r}: condition and impl: expected callables (input, weight, bias)")
        if self.bind is not None and not callable(self.bind):
            raise TypeError(f"kernel {self.name!r}: bind: expected None or a callable (input, weight, bias), got {self.bind!r}")
        dtypes = tuple(self.dtypes)
        if not dtypes or not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
            raise ValueError(f"kernel {self.name!r}: dtypes: expected a non-empty tuple of floating dtypes, got {self.dtypes!r}")
        object.__setattr__(self, "dtypes", dtypes)

    def check(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> str | None:
        """None when the kernel accepts, else the reason it rejects."""
        if x.dtype not in self.dtypes:
            return f"takes {dtype_names(self.dtypes)} inputs, input is {x.dtype}"
        verdict = self.condition(x, weight, bias)
        if verdict is None or verdict is True:
            return None
        if verdict is False:
            return "condition returned False"
        if isinstance(verdict, str):
            return verdict or "condition returned an empty reason"
        raise TypeError(f"kernel {self.name!r}: condition must return None/True/False/str, got {type(verdict).__name__}")


@dataclass(frozen=True)
class _Registration:
    kernel: LinearKernel
    layout: Any  # a Layout subclass or ALL_LAYOUTS
    before: str | None
    after: str | None


_USER: list[_Registration] = []
# (layout class, built-in kernel name) -> the user kernel in its place, or None (unregistered)
_BUILTIN_OVERRIDES: dict[tuple[type, str], LinearKernel | None] = {}
_WALKS: dict[type, tuple[LinearKernel, ...]] = {}
# strict mode of the calling thread (or task); new threads start from TORCHQ_STRICT
_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torchq_strict", default=os.environ.get("TORCHQ_STRICT", "") not in ("", "0")
)
_WARNED: set[tuple[str, str]] = set()
_RECORDERS: list[list] = []
# weight.tensor_impl -> {signature (_signature): LinearPlan}; see the module docstring. Entries hang off
# the weight's tensor impl (the packed data and its format), not the weight tensor: a weak reference to
# the tensor would block torch.utils.swap_tensors (module.to), and the wrapper-level properties
# conditions read are part of the key. Not consulted while recording or compiling.
_KERNEL_CACHE = IdentityCache()
_GENERATION = 0  # counts clear_kernel_cache calls
_STATE_PROVIDERS: list[Callable[[], Any]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[Any, torch.Tensor, LinearPlan]]]:
    """Within this block, every quantized linear call appends ``(weight, input, plan)`` to the
    yielded list (its plan evaluates every kernel; nothing is taken from or added to the cache)."""
    records: list[tuple[Any, torch.Tensor, LinearPlan]] = []
    _RECORDERS.append(records)
    try:
        yield records
    finally:
        _RECORDERS.remove(records)


def clear_kernel_cache() -> None:
    """Forget every cached kernel choice (the next call of each layer asks the conditions again)."""
    global _GENERATION
    _KERNEL_CACHE.clear()
    _GENERATION += 1  # what DirectLinear took from the cache is stale too


def _changed() -> None:
    _WALKS.clear()
    clear_kernel_cache()


def add_selection_state(provider: Callable[[], Any]) -> None:
    """Make ``provider()`` (a cheap, hashable value) part of every kernel-cache key: for global
    state that kernel conditions read, such as whether an optional library is enabled."""
    if not callable(provider):
        raise TypeError(f"provider: expected a callable returning a hashable value, got {provider!r}")
    _STATE_PROVIDERS.append(provider)
    clear_kernel_cache()


add_selection_state(native.available)  # kernel conditions read whether the native library is enabled


def _layout_class(layout: Any, arg: str = "layout") -> type:
    from .layouts.base import Layout

    if isinstance(layout, Layout):
        return type(layout)
    if isinstance(layout, type) and issubclass(layout, Layout):
        return layout
    raise TypeError(f"{arg}: expected a torchq Layout subclass (or instance) or torchq.ALL_LAYOUTS, got {layout!r}")


def _builtin_names(cls: type) -> list[str]:
    return [k.name for k in cls.linear_kernels()]


def register_linear_kernel(
    name: str,
    condition: Condition,
    impl: Impl,
    *,
    layout: Any = None,
    before: str | None = None,
    after: str | None = None,
    replace: bool = False,
    description: str = "",
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    bind: Bind | None = None,
) -> LinearKernel:
    """Add a kernel for weights of ``layout`` (a Layout subclass, or :data:`ALL_LAYOUTS`).

    It is tried ahead of the layout's own kernels, or right before/after the layout's kernel
    named ``before``/``after``. ``replace=True`` swaps out a user kernel of that name, or puts
    the kernel in the place of the layout's own kernel of that name. ``dtypes``: the input
    dtypes ``impl`` takes; ``bind``: its per-call form (:class:`LinearKernel`)."""
    if layout is None:
        raise TypeError(
            "layout: register_linear_kernel needs the layout whose weights the kernel runs (a Layout subclass, "
            "e.g. layout=torchq.layouts.PlainLayout) or layout=torchq.ALL_LAYOUTS"
        )
    kernel = LinearKernel(name, condition, impl, description, tuple(dtypes), bind)
    cls = layout if layout is ALL_LAYOUTS else _layout_class(layout)
    if before is not None and after is not None:
        raise ValueError(f"before/after: give at most one, got before={before!r}, after={after!r}")
    anchor = before if before is not None else after
    if anchor is not None:
        if cls is ALL_LAYOUTS:
            raise ValueError("before/after: only a kernel registered for one layout class can take a place in its list")
        if anchor not in _builtin_names(cls):
            raise KeyError(f"{'before' if before is not None else 'after'}: {cls.__name__} has no kernel named {anchor!r}; "
                           f"its kernels: {_builtin_names(cls)}")
    existing = [r for r in _USER if r.kernel.name == name]
    builtin = cls is not ALL_LAYOUTS and name in _builtin_names(cls) and _BUILTIN_OVERRIDES.get((cls, name), 0) is not None
    if (existing or builtin) and not replace:
        where = "registered" if existing else f"one of {cls.__name__}'s kernels"
        raise ValueError(f"name: a linear kernel named {name!r} is already {where} (pass replace=True)")
    for r in existing:
        _USER.remove(r)
    if builtin:  # in the built-in's place, or (anchored elsewhere) instead of it
        _BUILTIN_OVERRIDES[(cls, name)] = kernel if anchor is None else None
    if not builtin or anchor is not None:
        _USER.append(_Registration(kernel, cls, before, after))
    _changed()
    return kernel


def unregister_linear_kernel(name: str, *, layout: Any = None) -> LinearKernel:
    """Remove a user kernel, or (with ``layout``) one of that layout's own kernels, by name and
    return it (so it can be registered again later)."""
    for r in _USER:
        if r.kernel.name == name and (layout is None or r.layout is layout):
            _USER.remove(r)
            _changed()
            return r.kernel
    if layout is not None and layout is not ALL_LAYOUTS:
        cls = _layout_class(layout)
        for k in cls.linear_kernels():
            if k.name == name:
                current = _BUILTIN_OVERRIDES.get((cls, name), k)
                if current is not None:
                    _BUILTIN_OVERRIDES[(cls, name)] = None
                    _changed()
                    return current
    names = [k.name for k in linear_kernels(layout)]
    raise KeyError(f"name: no linear kernel named {name!r}{'' if layout is None else f' for {layout!r}'}; registered: {names}")


def _walk(cls: type) -> tuple[LinearKernel, ...]:
    walk = _WALKS.get(cls)
    if walk is not None:
        return walk
    own = [r for r in _USER if r.layout is not ALL_LAYOUTS and issubclass(cls, r.layout)]
    out = [r.kernel for r in own if r.before is None and r.after is None]
    out += [r.kernel for r in _USER if r.layout is ALL_LAYOUTS]
    for k in cls.linear_kernels():
        out += [r.kernel for r in own if r.before == k.name]
        current = k
        for base in cls.__mro__:
            if (base, k.name) in _BUILTIN_OVERRIDES:
                current = _BUILTIN_OVERRIDES[(base, k.name)]
                break
        if current is not None:
            out.append(current)
        out += [r.kernel for r in own if r.after == k.name]
    _WALKS[cls] = walk = tuple(out)
    return walk


def linear_kernels(layout: Any = None) -> tuple[LinearKernel, ...]:
    """The kernels tried for weights of ``layout`` (a Layout subclass or instance), in order; with
    no layout, every kernel of every registered layout and every user kernel (each once)."""
    if layout is not None and layout is not ALL_LAYOUTS:
        return _walk(_layout_class(layout))
    from .layouts.base import registered_layouts

    seen: dict[str, LinearKernel] = {r.kernel.name: r.kernel for r in _USER}
    if layout is None:
        for cls in registered_layouts().values():
            for k in _walk(cls):
                seen.setdefault(k.name, k)
    return tuple(seen.values())


class strict:
    """Turn fallbacks into :class:`NoKernelError`: ``with torchq.strict(): ...``, or
    ``torchq.set_strict(True)``. Both act on the calling thread (a context variable: a new thread
    starts from ``TORCHQ_STRICT``)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = bool(enabled)
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> strict:
        self._tokens.append(_STRICT.set(self.enabled))
        return self

    def __exit__(self, *exc: object) -> None:
        _STRICT.reset(self._tokens.pop())


def set_strict(enabled: bool) -> None:
    """Strict mode on or off for the calling thread, until changed again."""
    _STRICT.set(bool(enabled))


def is_strict() -> bool:
    return _STRICT.get()


def _layer_name(weight: Any) -> str:
    return getattr(weight, "label", None) or f"<unnamed {tuple(weight.shape)} weight>"


@dataclass(frozen=True)
class LinearPlan:
    """How a linear runs: ``kernel`` (None: dequantize + F.linear) on the input cast to
    ``run_dtype`` (``input_dtype`` when no cast), asked for ``compute_dtype``. ``fallback``: the
    warning text when this is not what was asked (a cast to another dtype, or no kernel), else
    None. ``verdicts``: ``(kernel name, reason or None)`` for the compute dtype's candidates."""

    kernel: LinearKernel | None
    input_dtype: torch.dtype
    compute_dtype: torch.dtype
    run_dtype: torch.dtype
    verdicts: tuple[tuple[str, str | None], ...]
    fallback: str | None = None
    # the kernel's bound per-call form (LinearKernel.bind) for the weight and signature this plan
    # is cached for; set only on cached plans
    bound: BoundCall | None = field(default=None, compare=False, repr=False)

    @property
    def cast(self) -> bool:
        return self.run_dtype != self.input_dtype


def _first_accepting(kernels, x, weight, bias, evaluate_all: bool):
    chosen = None
    verdicts: list[tuple[str, str | None]] = []
    for k in kernels:
        reason = k.check(x, weight, bias)
        verdicts.append((k.name, reason))
        if reason is None and chosen is None:
            chosen = k
            if not evaluate_all:
                break
    return chosen, verdicts


def plan_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None, *, evaluate_all: bool = False) -> LinearPlan:
    """Choose how ``F.linear(x, weight, bias)`` runs (see the module docstring). Conditions see
    the input in the dtype the kernel would get (and no bias when the input is cast).

    Stops at the first acceptance unless ``evaluate_all`` (then every condition is asked for
    the compute dtype, so a report can show what each later kernel would have said)."""
    kernels = _walk(type(weight.tensor_impl.layout))
    compute = weight.compute_dtype or x.dtype
    cast = compute != x.dtype
    xc = x.to(compute) if cast else x
    chosen, verdicts = _first_accepting(kernels, xc, weight, None if cast else bias, evaluate_all)
    if chosen is not None:
        return LinearPlan(chosen, x.dtype, compute, compute, tuple(verdicts))
    name = _layer_name(weight)
    layout = weight.tensor_impl.layout
    if compute in FLOAT_DTYPES:
        for d in _CAST_ORDER:
            if d == compute:
                continue
            xd = x.to(d)
            for k in kernels:
                if d in k.dtypes and k.check(xd, weight, None if d == x.dtype else bias) is None:
                    msg = (f"layer {name!r} ({layout!r}, input {x.dtype} {tuple(x.shape)}): no linear kernel takes a "
                           f"{compute} input (compute dtype); kernel {k.name!r} runs on the input cast to {d} "
                           f"and its output is cast back to {x.dtype}")
                    return LinearPlan(k, x.dtype, compute, d, tuple(verdicts), msg)
    why = "; ".join(f"{k}: {r}" for k, r in verdicts) or "the layout has no linear kernel"
    msg = f"layer {name!r} ({layout!r}, input {x.dtype} {tuple(x.shape)}): no linear kernel accepted ({why})"
    return LinearPlan(None, x.dtype, compute, compute, tuple(verdicts), msg)


def select_linear_kernel(x: torch.Tensor, weight: Any, bias: torch.Tensor | None, *, evaluate_all: bool = False):
    """``(chosen kernel or None, [(kernel name, reason or None), ...])``: :func:`plan_linear`'s
    kernel (which may run on a cast input: see the plan for that) and verdicts."""
    plan = plan_linear(x, weight, bias, evaluate_all=evaluate_all)
    return plan.kernel, list(plan.verdicts)


def _validate(x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> None:
    name = _layer_name(weight)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"layer {name!r}: input must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    n, k = weight.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"layer {name!r}: input's last dimension must be in_features={k}, got input shape {tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"layer {name!r}: input is on {x.device} but the weight is on {weight.device}")
    if bias is not None:
        _validate_bias(name, x, n, bias)


def _validate_bias(name: str, x: torch.Tensor, n: int, bias: Any) -> None:
    """The bias checks float ``F.linear`` makes (device, dtype) and the shape ``(N,)``: every
    kernel relies on them (a meta bias would read as "no bias" in C)."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"layer {name!r}: bias: expected a tensor or None, got {type(bias).__name__}")
    if bias.device != x.device:
        raise ValueError(f"layer {name!r}: bias: expected device {x.device} (the input's), got {bias.device}")
    # as float F.linear: the input's dtype (under autocast, any floating dtype: it is cast)
    if bias.dtype != x.dtype and not (bias.is_floating_point() and torch.is_autocast_enabled(x.device.type)):
        raise TypeError(f"layer {name!r}: bias: expected dtype {x.dtype} (the input's), got {bias.dtype}")
    if tuple(bias.shape) != (n,):
        raise ValueError(f"layer {name!r}: bias must have shape ({n},), got {tuple(bias.shape)}")


def dequantized_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference meaning of a quantized linear: dequantize (and fake-quantize the input for
    dynamic activation quantization), then ``F.linear`` in the input's dtype. Like every kernel it
    multiplies the codes: a weight's ``input_scale`` and ``input_perm`` were applied to ``x`` by
    :func:`quantized_linear`."""
    act = getattr(weight, "act_quant", None)
    if act is not None:
        x = act.fake_quantize(x)
    b = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight.tensor_impl.dequantize(x.dtype), b)


def _selection_state() -> tuple | None:
    providers = _STATE_PROVIDERS
    if not providers:
        return None
    if len(providers) == 1:  # torchq.native's (the usual case): no generator per call
        return (providers[0](),)
    return tuple(p() for p in providers)


def _signature(x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> tuple:
    b = None if bias is None else (bias.dtype, bias.device, bias.shape)
    state = _selection_state()
    # the wrapper's own dtype as stored: 0.05 us instead of a __torch_function__ round trip (2 us)
    dtype = weight.__dict__.get("wrapper_dtype")
    if dtype is None:
        with _NO_SUBCLASS_FUNCTION():
            dtype = weight.dtype
    return (type(x), x.dtype, x.device, x.shape, b, dtype, weight.compute_dtype, weight.act_quant, weight.transposed, state)


_NO_SUBCLASS_FUNCTION = torch._C.DisableTorchFunctionSubclass


def _remember(weight: Any, key: tuple, plan: LinearPlan, x: torch.Tensor, bias: torch.Tensor | None) -> None:
    chosen = _KERNEL_CACHE.get(weight.tensor_impl)
    if chosen is None:
        chosen = _KERNEL_CACHE.set(weight.tensor_impl, {})
    bind = plan.kernel.bind if plan.kernel is not None and plan.fallback is None and not plan.cast else None
    bound = bind(x, weight, bias) if bind is not None else None
    chosen[key] = plan if bound is None else dataclasses.replace(plan, bound=bound)


def warn_fallback_once(key: tuple, message: str, *, instead: str, forbids: str, stacklevel: int = 3) -> None:
    """A visible fallback: in strict mode raise :class:`NoKernelError` (``message; strict mode
    forbids <forbids>``), else warn :class:`FallbackWarning` (``message; <instead>``) once per ``key``."""
    if _STRICT.get():
        raise NoKernelError(f"{message}; strict mode forbids {forbids}")
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"{message}; {instead}", FallbackWarning, stacklevel=stacklevel + 1)


def _execute(plan: LinearPlan, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
    if plan.kernel is None:
        if not plan.cast:
            return dequantized_linear(x, weight, bias)
        y = dequantized_linear(x.to(plan.run_dtype), weight, None).to(x.dtype)
    elif not plan.cast:
        return _run(plan.kernel.impl, x, weight, bias)
    else:
        y = _run(plan.kernel.impl, x.to(plan.run_dtype), weight, None).to(x.dtype)
    return y if bias is None else y + bias.to(y.dtype)


def quantized_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a quantized (non-transposed ``[N, K]``) weight. A weight's
    ``input_scale`` multiplies ``x`` first (in ``x``'s dtype), and its ``input_perm`` reorders ``x``'s
    features into the codes' column order; kernels then multiply the codes."""
    d = weight.__dict__
    in_scale = d.get("input_scale")
    if in_scale is not None:
        x = x * in_scale.to(x.dtype)
    in_perm = d.get("input_perm")
    if in_perm is not None:
        x = x.index_select(-1, in_perm)
    if _RECORDERS or traced(x):
        key = None
    else:  # _cached_plan inlined: this is every decode call's path
        key = _signature(x, weight, bias)
        chosen = _KERNEL_CACHE.get(weight.tensor_impl)
        plan = None if chosen is None else chosen.get(key)
        if plan is not None:  # same weight and input signature as an earlier, validated call
            bound = plan.bound  # set only for a kernel's own, uncast choice: the decode path
            if bound is not None and (not _grad_enabled() or not (x.requires_grad or (bias is not None and bias.requires_grad))):
                y = bound(x, weight, bias)
                if y is not None:
                    return y
            if plan.fallback is None:
                if plan.kernel is not None and not plan.cast:
                    return _run(plan.kernel.impl, x, weight, bias)
            elif _STRICT.get():
                raise NoKernelError(f"{plan.fallback}; strict mode forbids the cast fallback")
            return _execute(plan, x, weight, bias)
    _validate(x, weight, bias)
    plan = plan_linear(x, weight, bias, evaluate_all=bool(_RECORDERS))
    for rec in _RECORDERS:
        rec.append((weight, x, plan))
    if plan.kernel is not None:
        if plan.fallback is not None:
            warn_fallback_once((_layer_name(weight), plan.fallback), plan.fallback, instead="computing in the cast dtype",
                               forbids="the cast fallback")
        if key is not None:
            _remember(weight, key, plan, x, bias)
        return _execute(plan, x, weight, bias)
    in_dtype = f" in {plan.compute_dtype}" if plan.cast else ""
    warn_fallback_once((_layer_name(weight), plan.fallback), plan.fallback, forbids="the dequantize + F.linear fallback",
                       instead=f"running dequantize + F.linear{in_dtype} instead (slow, full-size float weight)")
    return _execute(plan, x, weight, bias)


class DirectLinear:
    """``F.linear(x, weight, bias)`` on a quantized weight, for a caller that owns the call site
    (vLLM's ``apply``, called once per layer per step): the same kernel and bits, with less Python
    per call. ``F.linear`` reaches the dispatch through ``__torch_function__`` and then builds the
    cache key of :func:`quantized_linear`; once a signature's first call has run that way and the
    dispatch cached a bound per-call form (:attr:`LinearPlan.bound`), later calls of the same
    signature here call it directly (64 x 64 int4 at one row, one core: 10.0 -> 6.9 us).

    A call takes the direct form only when it would take it through ``F.linear``: the same weight
    fields as the cached choice (tensor impl, dtype, compute dtype, activation quantization; no
    ``input_scale`` / ``input_perm``), the same kernel choices (no :func:`clear_kernel_cache` or
    change of the selection state since), a plain tensor, not compiling or recording, no
    ``TorchFunctionMode`` active, and no gradient wanted. Anything else, and a bound form that
    declines the call, runs ``F.linear``. Signatures without a bound form are remembered too (they
    run ``F.linear`` without asking the cache again). Keeps at most :attr:`MAX_SIGNATURES`
    signatures, dropping the oldest (prefills of every length would otherwise add one each)."""

    MAX_SIGNATURES = 64
    __slots__ = ("_calls",)

    def __init__(self) -> None:
        # (x shape, dtype, device, bias signature) -> weak references to the tensor impl, the weight
        # fields, (generation, selection state), a weak reference to the cached plan (which lives as
        # long as the impl's cache entry: nothing here keeps the weight's tensors alive), or None
        # where the dispatch has no bound form for the signature (F.linear, without asking again)
        self._calls: dict[tuple, tuple] = {}

    def __call__(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        if _is_compiling() or _RECORDERS or type(x) is not torch.Tensor or _function_mode():
            return F.linear(x, weight, bias)
        key = (x.shape, x.dtype, x.device, None if bias is None else (bias.dtype, bias.shape, bias.device))
        d = weight.__dict__
        entry = self._calls.get(key)
        if (entry is not None and entry[0]() is d.get("tensor_impl") and entry[1] == _weight_fields(d)
                and entry[2] == (_GENERATION, _selection_state())):
            if entry[3] is None:  # no bound form for this signature
                return F.linear(x, weight, bias)
            plan = entry[3]()
            if plan is not None:
                if not _grad_enabled() or not (x.requires_grad or (bias is not None and bias.requires_grad)):
                    y = plan.bound(x, weight, bias)
                    if y is not None:
                        return y
                return F.linear(x, weight, bias)  # a gradient is wanted, or the bound form declined x
        y = F.linear(x, weight, bias)
        if d.get("input_scale") is None and d.get("input_perm") is None:  # first call, or a stale entry
            self._remember(key, x, weight, bias)
        return y

    def _remember(self, key: tuple, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> None:
        impl = weight.__dict__.get("tensor_impl")
        plans = None if impl is None else _KERNEL_CACHE.get(impl)
        if plans is None:  # not a quantized weight the dispatch cached a choice for
            return
        plan = plans.get(_signature(x, weight, bias))
        calls = self._calls
        if len(calls) >= self.MAX_SIGNATURES and key not in calls:
            del calls[next(iter(calls))]  # the oldest
        calls[key] = (weakref.ref(impl), _weight_fields(weight.__dict__), (_GENERATION, _selection_state()),
                      None if plan is None or plan.bound is None else weakref.ref(plan))

    def clear(self) -> None:
        """Forget every signature (the next calls run ``F.linear`` again)."""
        self._calls.clear()

    def __len__(self) -> int:
        return len(self._calls)


def _weight_fields(d: dict) -> tuple:
    """The weight fields besides its tensor impl that the dispatch's cache key holds, and whether
    it has no ``input_scale`` / ``input_perm`` (``d``: the weight's ``__dict__``)."""
    return (d.get("wrapper_dtype"), d.get("compute_dtype"), d.get("act_quant"), d.get("transposed"),
            d.get("input_scale") is None and d.get("input_perm") is None)


class _QuantizedLinearGrad(torch.autograd.Function):
    """Makes any kernel differentiable in its input: ``grad_x = grad_y @ dequantize(W)``.

    The weight is frozen (no gradient); dynamic activation quantization is treated as identity
    in the backward pass (straight-through), as QLoRA-style training expects."""

    @staticmethod
    def forward(ctx, x, weight, impl):
        if traced(x):
            ctx.save_for_backward(weight)
        else:  # the packed data, not the wrapper: a saved wrapper blocks torch.utils.swap_tensors
            ctx.weight_impl = weight.tensor_impl  # (module.to(dtype) while this graph is alive)
        return impl(x, weight, None)

    @staticmethod
    def backward(ctx, grad_y):
        impl = getattr(ctx, "weight_impl", None)
        w = ctx.saved_tensors[0].dequantize(grad_y.dtype) if impl is None else impl.dequantize(grad_y.dtype)
        return grad_y @ w, None, None


_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_function_mode = torch._C._is_torch_function_mode_enabled  # F.linear would call an active TorchFunctionMode


def _run(impl: Impl, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
    if not torch.is_grad_enabled() or not (x.requires_grad or (bias is not None and bias.requires_grad)):
        return impl(x, weight, bias)
    if not x.requires_grad:  # only the bias wants a gradient: the addition records it (no autograd Function)
        y = impl(x, weight, None)
    else:
        y = _QuantizedLinearGrad.apply(x, weight, impl)
    return y if bias is None else y + bias.to(y.dtype)


def reset_fallback_warnings() -> None:
    """Forget which fallbacks were already warned about (mainly for tests)."""
    _WARNED.clear()
