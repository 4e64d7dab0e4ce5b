"""The linear dispatch table: an ordered list of named ``(condition, impl)`` kernel pairs.

``F.linear``, ``aten.linear``, ``aten.mm`` and ``aten.addmm`` with an ``AffineQuantizedTensor``
weight arrive at :func:`quantized_linear`, which runs the first kernel whose condition accepts
``(input, weight, bias)``. A condition returns ``None`` or ``True`` to accept, and a string (the
reason) or ``False`` to reject. When nothing accepts, the weight is dequantized and the float op
runs, with a one-time :class:`FallbackWarning` naming the layer and every kernel's reason;
under :func:`strict` that is a :class:`NoKernelError` instead.

Kernels are ordered by ``priority`` (higher first, then registration order). Built-in kernels
use priority 0; :func:`register_linear_kernel` defaults to 100 so a user's kernel wins.

The choice is cached per weight (its tensor impl, plus its dtype and activation quantization)
and input signature (dtype, device, shape, subclass; the bias's dtype, device and shape), so a
decode loop asks the conditions once per shape, not once per call. Conditions must therefore depend only on that signature, the weight's own metadata
and global state that is part of the cache key: the table itself (any change clears the cache)
and the providers added with :func:`add_selection_state` (``torchq.native`` adds whether the
native library is enabled in the calling thread). Call :func:`clear_kernel_cache` after
changing anything else a condition reads.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .identity_cache import IdentityCache

__all__ = [
    "LinearKernel",
    "FallbackWarning",
    "NoKernelError",
    "register_linear_kernel",
    "unregister_linear_kernel",
    "linear_kernels",
    "select_linear_kernel",
    "quantized_linear",
    "strict",
    "set_strict",
    "is_strict",
    "add_selection_state",
    "clear_kernel_cache",
    "check_op_devices",
]

Condition = Callable[[torch.Tensor, Any, "torch.Tensor | None"], "bool | str | None"]
Impl = Callable[[torch.Tensor, Any, "torch.Tensor | None"], torch.Tensor]


class FallbackWarning(UserWarning):
    """No kernel accepted a quantized linear; it ran as dequantize + float matmul."""


class NoKernelError(RuntimeError):
    """Raised instead of falling back when strict mode is on."""


@dataclass(frozen=True)
class LinearKernel:
    name: str
    condition: Condition = field(repr=False)
    impl: Impl = field(repr=False)
    description: str = ""
    priority: int = 0

    def check(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> str | None:
        """None when the kernel accepts, else the reason it rejects."""
        verdict = self.condition(x, weight, bias)
        if verdict is None or verdict is True:
            return None
        if verdict is False:
            return "condition returned False"
        if isinstance(verdict, str):
            return verdict or "condition returned an empty reason"
        raise TypeError(f"kernel {self.name!r}: condition must return None/True/False/str, got {type(verdict).__name__}")


_TABLE: list[LinearKernel] = []
_STRICT = [os.environ.get("TORCHQ_STRICT", "") not in ("", "0")]
_WARNED: set[tuple[str, str]] = set()
_RECORDERS: list[list] = []
# weight.tensor_impl -> {signature: kernel}; see the module docstring and _cached_kernel.
_KERNEL_CACHE = IdentityCache()
_STATE_PROVIDERS: list[Callable[[], Any]] = []


def clear_kernel_cache() -> None:
    """Forget every cached kernel choice (the next call of each layer asks the conditions again)."""
    _KERNEL_CACHE.clear()


def add_selection_state(provider: Callable[[], Any]) -> None:
    """Make ``provider()`` (a cheap, hashable value) part of every kernel-cache key: for global
    state that kernel conditions read, such as whether an optional library is enabled."""
    if not callable(provider):
        raise TypeError(f"provider: expected a callable returning a hashable value, got {provider!r}")
    _STATE_PROVIDERS.append(provider)
    clear_kernel_cache()


def register_linear_kernel(
    name: str,
    condition: Condition,
    impl: Impl,
    *,
    description: str = "",
    priority: int = 100,
    before: str | None = None,
    replace: bool = False,
) -> LinearKernel:
    """Add a kernel to the table. ``replace=True`` swaps out an existing kernel of that name.

    Kernels are tried by descending ``priority``, ties in registration order; ``before=NAME``
    instead puts the kernel immediately ahead of kernel NAME (taking its priority)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    if not callable(condition) or not callable(impl):
        raise TypeError("condition and impl: expected callables (input, weight, bias)")
    existing = [k for k in _TABLE if k.name == name]
    if existing and not replace:
        raise ValueError(f"name: a linear kernel named {name!r} is already registered (pass replace=True)")
    anchor = None
    if before is not None:
        anchor = next((k for k in _TABLE if k.name == before), None)
        if anchor is None:
            raise KeyError(f"before: no linear kernel named {before!r}; registered: {[k.name for k in _TABLE]}")
        priority = anchor.priority
    for k in existing:
        _TABLE.remove(k)
    kernel = LinearKernel(name, condition, impl, description, int(priority))
    if anchor is not None:
        _TABLE.insert(_TABLE.index(anchor), kernel)
    else:
        _TABLE.append(kernel)
    _TABLE.sort(key=lambda k: -k.priority)  # stable: ties keep their order
    clear_kernel_cache()
    return kernel


def unregister_linear_kernel(name: str) -> LinearKernel:
    """Remove a kernel by name and return it (so it can be registered again later)."""
    for k in _TABLE:
        if k.name == name:
            _TABLE.remove(k)
            clear_kernel_cache()
            return k
    raise KeyError(f"name: no linear kernel named {name!r}; registered: {[k.name for k in _TABLE]}")


def linear_kernels() -> tuple[LinearKernel, ...]:
    """The table, in the order it is tried."""
    return tuple(_TABLE)


class strict:
    """Turn fallbacks into :class:`NoKernelError`. ``with torchq.strict(): ...`` or ``torchq.set_strict(True)``."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = bool(enabled)
        self._saved: list[bool] = []

    def __enter__(self) -> strict:
        self._saved.append(_STRICT[0])
        _STRICT[0] = self.enabled
        return self

    def __exit__(self, *exc: object) -> None:
        _STRICT[0] = self._saved.pop()


def set_strict(enabled: bool) -> None:
    _STRICT[0] = bool(enabled)


def is_strict() -> bool:
    return _STRICT[0]


def _layer_name(weight: Any) -> str:
    return getattr(weight, "label", None) or f"<unnamed {tuple(weight.shape)} weight>"


def select_linear_kernel(x: torch.Tensor, weight: Any, bias: torch.Tensor | None, *, evaluate_all: bool = False):
    """``(chosen kernel or None, [(kernel name, reason or None), ...])``.

    Stops at the first acceptance unless ``evaluate_all`` (then every condition is asked, so a
    report can show what each later kernel would have said)."""
    chosen = None
    verdicts: list[tuple[str, str | None]] = []
    for k in _TABLE:
        reason = k.check(x, weight, bias)
        verdicts.append((k.name, reason))
        if reason is None and chosen is None:
            chosen = k
            if not evaluate_all:
                break
    return chosen, verdicts


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


def check_op_devices(op: str, x: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """For a custom op's fake kernel: raise unless every tensor argument is on ``x``'s device.
    An eager call with a meta argument among CPU ones (a meta bias, say) dispatches to the fake
    kernel, whose uninitialized output would otherwise come back as the result."""
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"torchq::{op}: {name}: expected device {x.device} (x's), got {t.device}")


def one_device_fake(op: str):
    """Decorator for a custom op's fake kernel whose tensor arguments must share one device: an
    eager call mixing a meta tensor with CPU ones dispatches to the fake kernel, and its
    uninitialized output would come back as the result (see :func:`check_op_devices`)."""

    def deco(fake):
        signature = inspect.signature(fake)

        @functools.wraps(fake)
        def checked(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            tensors = [(k, v) for k, v in bound.items() if isinstance(v, torch.Tensor)]
            if tensors:
                first = tensors[0][1].device
                for name, t in tensors[1:]:
                    if t.device != first:
                        raise ValueError(f"torchq::{op}: {name}: expected device {first} (the first tensor's), got {t.device}")
            return fake(*args, **kwargs)

        return checked

    return deco


def dequantized_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference meaning of a quantized linear: dequantize (and fake-quantize the input for
    dynamic activation quantization), then ``F.linear`` in the input's dtype."""
    act = getattr(weight, "act_quant", None)
    if act is not None:
        x = act.fake_quantize(x)
    b = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight.dequantize(x.dtype), b)


def _signature(x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> tuple:
    b = None if bias is None else (bias.dtype, bias.device, bias.shape)
    state = tuple(p() for p in _STATE_PROVIDERS) if _STATE_PROVIDERS else None
    return (type(x), x.dtype, x.device, x.shape, b, weight.dtype, weight.act_quant, weight.transposed, state)


def _cached_kernel(x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> tuple[LinearKernel | None, tuple | None]:
    """``(kernel, None)`` on a cache hit, else ``(None, key)`` (key None: do not cache).

    Entries hang off the weight's tensor impl (the packed data and its format), not the weight
    tensor: a weak reference to the tensor would block ``torch.utils.swap_tensors`` (``module.to``)
    and the wrapper-level properties conditions read are part of the key."""
    if _RECORDERS or torch.compiler.is_compiling():
        return None, None
    key = _signature(x, weight, bias)
    chosen = _KERNEL_CACHE.get(weight.tensor_impl)
    return (None, key) if chosen is None else (chosen.get(key), key)


def _remember(weight: Any, key: tuple, kernel: LinearKernel) -> None:
    chosen = _KERNEL_CACHE.get(weight.tensor_impl)
    if chosen is None:
        chosen = _KERNEL_CACHE.set(weight.tensor_impl, {})
    chosen[key] = kernel


def quantized_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a quantized (non-transposed ``[N, K]``) weight."""
    kernel, key = _cached_kernel(x, weight, bias)
    if kernel is not None:  # same weight and input signature as an earlier, validated call
        return _run(kernel.impl, x, weight, bias)
    _validate(x, weight, bias)
    kernel, verdicts = select_linear_kernel(x, weight, bias, evaluate_all=bool(_RECORDERS))
    for rec in _RECORDERS:
        rec.append((weight, x, kernel, verdicts))
    if kernel is not None:
        if key is not None:
            _remember(weight, key, kernel)
        return _run(kernel.impl, x, weight, bias)
    name = _layer_name(weight)
    why = "; ".join(f"{k}: {r}" for k, r in verdicts) or "the kernel table is empty"
    layout = weight.tensor_impl.layout
    msg = f"layer {name!r} ({layout!r}, input {x.dtype} {tuple(x.shape)}): no linear kernel accepted ({why})"
    if _STRICT[0]:
        raise NoKernelError(msg + "; strict mode forbids the dequantize + F.linear fallback")
    key = (name, why)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg + "; running dequantize + F.linear instead (slow, full-size float weight)", FallbackWarning, stacklevel=3)
    return dequantized_linear(x, weight, bias)


class _QuantizedLinearGrad(torch.autograd.Function):
    """Makes any kernel differentiable in its input: ``grad_x = grad_y @ dequantize(W)``.

    The weight is frozen (no gradient); dynamic activation quantization is treated as identity
    in the backward pass (straight-through), as QLoRA-style training expects."""

    @staticmethod
    def forward(ctx, x, weight, impl):
        if torch.compiler.is_compiling():
            ctx.save_for_backward(weight)
        else:  # the packed data, not the wrapper: a saved wrapper blocks torch.utils.swap_tensors
            ctx.weight_impl = weight.tensor_impl  # (module.to(dtype) while this graph is alive)
        return impl(x, weight, None)

    @staticmethod
    def backward(ctx, grad_y):
        impl = getattr(ctx, "weight_impl", None)
        w = ctx.saved_tensors[0].dequantize(grad_y.dtype) if impl is None else impl.dequantize(grad_y.dtype)
        return grad_y @ w, None, None


def _run(impl: Impl, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
    if not (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))):
        return impl(x, weight, bias)
    y = _QuantizedLinearGrad.apply(x, weight, impl)
    return y if bias is None else y + bias.to(y.dtype)


def reset_fallback_warnings() -> None:
    """Forget which fallbacks were already warned about (mainly for tests)."""
    _WARNED.clear()
