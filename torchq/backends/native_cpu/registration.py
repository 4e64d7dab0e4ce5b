"""Registering the native CPU kernels against their ``torchq::`` ops, with a lean dispatcher path
for calls that need no gradient.

A ``torch.library.custom_op`` call on CPU tensors passes the dispatcher twice and three Python
frames before the kernel (the op's autograd kernel, a redispatch below autograd, the CPU backend
wrapper with its aliasing check): about 10 µs per call here, as much as a decode-sized layer's
whole kernel. A ``torch.compile`` graph calls the op itself at every linear, so this is paid
per layer per token. :func:`register_cpu_kernel` registers the kernel the usual way
(``register_kernel("cpu")``) and, on the ``AutogradCPU`` key, a kernel that runs it directly
when

* no gradient is needed (grad mode off, or no argument requires grad), and
* nothing sits between autograd and the CPU backend: no ``Python`` key (fake tensors, torch
  dispatch modes such as ``FlopCounterMode``), no functionalization, no other backend.

Every other call takes the op's own autograd kernel (``make_autograd_impl``, the one the custom op
registered on ``Autograd``), so gradients, tracing and modes are unchanged. The direct path runs
the same kernel on the same arguments: the results are the same bits. Without the torch internals
it needs (another torch version), only the usual registration is made.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    from torch._library.autograd import make_autograd_impl
except ImportError:  # pragma: no cover - a torch without it: the custom op's own path only
    make_autograd_impl = None

__all__ = ["register_cpu_kernel", "direct_path_registered"]

_LIB = torch.library.Library("torchq", "IMPL")
_DIRECT: set[str] = set()


def register_cpu_kernel(op) -> Callable[[Callable], Callable]:
    """A decorator: register the function as the CPU implementation of the custom op ``op`` (a
    ``torch.library.CustomOpDef``) and install the direct no-grad path described in the module
    docstring."""
    return lambda kernel: _register(op, kernel)


def _register(op, kernel: Callable) -> Callable:
    op.register_kernel("cpu")(kernel)
    if make_autograd_impl is None:
        return kernel
    general = make_autograd_impl(op._opoverload, op)  # reads the backward / setup registered later, at call time
    below_autograd = torch._C._after_ADInplaceOrView_keyset
    cpu = torch._C.DispatchKey.CPU
    grad_enabled, any_requires_grad = torch.is_grad_enabled, torch._C._any_requires_grad

    def autograd_cpu(keyset, *args, **kwargs):
        if not kwargs and (keyset & below_autograd).highestPriorityTypeId() == cpu and not (grad_enabled() and any_requires_grad(*args)):
            return kernel(*args)
        return general(keyset, *args, **kwargs)

    _LIB.impl(op._name, autograd_cpu, "AutogradCPU", with_keyset=True)
    _DIRECT.add(op._name)
    return kernel


def direct_path_registered(name: str) -> bool:
    """Whether the op ``torchq::<name>`` has the direct no-grad CPU path (for tests)."""
    return name in _DIRECT
