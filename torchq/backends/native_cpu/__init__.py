"""torchq's native CPU kernels as implementations of :mod:`torchq.ops` (the library is loaded
by :mod:`torchq.native`; without it each op runs its reference, with a one-time warning).

* :mod:`.int8`: ``int8_weight_linear``, ``int8_dynamic_linear``, ``int8_static_linear``;
* :mod:`.int8_panels`: their panel-order forms (``int8_panel_weight_linear``, ...);
* :mod:`.lut4`: ``blockwise_4bit_linear``, ``gemv_4bit``, ``gemm_4bit``.
"""

from . import int8, int8_panels, lut4

__all__ = ["int8", "int8_panels", "lut4"]
