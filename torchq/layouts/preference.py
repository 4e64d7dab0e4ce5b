"""The order in which automatic layout choice tries layouts, per device type.

``choose_layout`` walks the weight's device type's tuple and takes the first layout (with
default options) whose :meth:`~torchq.layouts.Layout.fit` says it can hold the weight and
automatic choice may put it there. Device types not listed use ``DEFAULT``. A layout named in
no order is never chosen automatically (a config or ``to_layout`` can still name it); a layout
defined outside torchq joins an order with :func:`prefer`.
"""

from __future__ import annotations

__all__ = ["DEFAULT", "order", "prefer"]

# Fastest first. float8 weights only fit float8 (its kernels pick by device); NF4/FP4 weights only fit blockwise_4bit; groupwise int4 fits the device's int4
# packing, then torchq's portable int4 bytes (native CPU kernel, Triton on CUDA), then PyTorch's
# CPU packing (where the native library is missing); 1-7-bit codes fit packed_bits; everything
# else stays plain.
_ORDERS: dict[str, list[str]] = {
    "cpu": ["float8", "blockwise_4bit", "int4_native", "int4_cpu", "packed_bits", "plain"],
    "cuda": ["float8", "blockwise_4bit", "tensor_core_tiled", "int4_native", "packed_bits", "plain"],
    "xpu": ["float8", "blockwise_4bit", "int4_xpu", "int4_native", "packed_bits", "plain"],
}
DEFAULT = "default"
_ORDERS[DEFAULT] = ["float8", "blockwise_4bit", "tensor_core_tiled", "int4_xpu", "int4_native", "int4_cpu", "packed_bits", "plain"]


def order(device_type: str) -> tuple[str, ...]:
    """Layout names in the order automatic choice tries them on ``device_type``."""
    return tuple(_ORDERS.get(device_type, _ORDERS[DEFAULT]))


def prefer(layout_name: str, device_type: str = DEFAULT, *, before: str | None = None) -> None:
    """Let automatic choice take ``layout_name`` on ``device_type`` (``DEFAULT``: devices with no
    order of their own), tried right before the layout named ``before`` (None: first)."""
    if not isinstance(layout_name, str) or not layout_name:
        raise ValueError(f"layout_name: expected a layout's name, got {layout_name!r}")
    names = _ORDERS.setdefault(device_type, list(_ORDERS[DEFAULT]))
    if layout_name in names:
        names.remove(layout_name)
    if before is None:
        names.insert(0, layout_name)
    elif before in names:
        names.insert(names.index(before), layout_name)
    else:
        raise ValueError(f"before: no layout {before!r} in the {device_type!r} order {names}")
