"""Implementations of the ops of :mod:`torchq.ops` per device, registered against the op objects
when imported (after the ops, before the layouts). A backend whose library is missing only makes
its kernels unavailable, with the reason (``torchq.native.status()``, ``torchq.explain``).

* :mod:`.native_cpu`: torchq's native CPU library (``torchq.native`` controls it);
* :mod:`.aten`: PyTorch's own int4 kernels (tinygemm on CUDA, the XPU kernels);
* :mod:`.triton`: Triton kernels on CUDA (triton itself is imported on the first CUDA call).
"""

from . import aten, native_cpu, triton

__all__ = ["aten", "native_cpu", "triton"]
