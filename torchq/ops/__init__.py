"""Every ``torchq::`` op: its schema, fake implementation, argument checks and pure-PyTorch
reference (the executable spec), one module per op family. Device backends
(:mod:`torchq.backends`) register implementations against these ops.

* :mod:`.affine`: ``choose_qparams_affine``, ``quantize_affine``, ``dequantize_affine``;
* :mod:`.int8`: ``int8_weight_linear``, ``int8_dynamic_linear``, ``int8_weight_only_mm``.

The other op families still live beside their layouts (``layouts/int4_native.py``,
``int4_cpu.py``, ``tensor_core_tiled.py``, ``int4_xpu.py``) and in ``blockwise/`` and ``vectorwise.py``.
"""

from . import affine, blockwise, int4, int8, vectorwise

__all__ = ["affine", "blockwise", "int4", "int8", "vectorwise"]
