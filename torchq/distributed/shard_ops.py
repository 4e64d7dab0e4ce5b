"""The aten ops that sharding a quantized weight needs (FSDP2's ``fully_shard``, DTensor's
``distribute_tensor``), on :class:`~torchq.tensor.AffineQuantizedTensor`.

* ``split`` / ``split_with_sizes`` (``torch.chunk``): row or column ranges, each one the quantized
  range of the float weight (a block or group that would be cut raises a ValueError naming it);
* ``new_zeros`` / ``new_empty``: a weight of the same format whose values are 0 (a shard's padding
  rows; ``new_empty(0)``: no rows);
* ``view`` to its own shape (an alias); ``view(-1)`` only for FSDP2, which keeps it as a flat shard
  handle it never reads for weights with an all-gather extension (the weight has no 1-D form, so
  FSDP2 gets an alias in the 2-D shape; anyone else gets a NotImplementedError);
* ``as_strided`` to its own size and contiguous strides (an alias);
* ``is_pinned`` / ``_pin_memory`` (CPU offload), ``empty_like`` (zeros, as ``new_zeros``).
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..tensor import AQT, implements, slice_weight
from .rows import pack_in, zero_plain

aten = torch.ops.aten


@implements(aten.split.Tensor)
def _split(func, args, kwargs):
    self: AQT = args[0]
    size = args[1] if len(args) > 1 else kwargs["split_size"]
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % 2
    total = self.shape[dim]
    sizes = [min(size, total - s) for s in range(0, total, size)] if size > 0 else [total]
    return _split_sizes(self, sizes or [0], dim)


@implements(aten.split_with_sizes.default)
def _split_with_sizes(func, args, kwargs):
    self: AQT = args[0]
    sizes = list(args[1] if len(args) > 1 else kwargs["split_sizes"])
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % 2
    if sum(sizes) != self.shape[dim] or any(s < 0 for s in sizes):
        raise ValueError(f"split_with_sizes: sizes {sizes} do not add up to dim {dim} of size {self.shape[dim]}")
    return _split_sizes(self, sizes, dim)


def _split_sizes(self: AQT, sizes: list[int], dim: int) -> list[AQT]:
    out, start = [], 0
    for s in sizes:
        out.append(slice_weight(aten.slice.Tensor, (self, dim, start, start + s), {}))
        start += s
    return out


@implements(aten.new_zeros.default)
def _new_zeros(func, args, kwargs):
    self: AQT = args[0]
    size = tuple(int(s) for s in args[1])
    dtype = kwargs.get("dtype") or self.dtype
    device = torch.device(kwargs.get("device") or self.device)
    if len(size) != 2 or (self.transposed and size[0] != self.shape[0]) or (not self.transposed and size[1] != self.shape[1]):
        raise NotImplementedError(
            f"torchq: new_zeros({list(size)}) of the quantized weight {self.label or tuple(self.shape)!r} "
            f"{tuple(self.shape)}: only more or fewer rows of the same width are supported (a shard's padding)"
        )
    if not dtype.is_floating_point:
        raise TypeError(f"new_zeros: a quantized weight's dtype is a float dtype, got {dtype}")
    n = size[1] if self.transposed else size[0]
    plain = self.to_plain()
    zero_dtype = None if plain.zero_point is None else plain.zero_point.dtype
    z = zero_plain(plain.spec, (n, plain.shape[1]), plain.scale.dtype, zero_dtype, device)
    impl = pack_in(self.tensor_impl.layout, z)
    s, p = self.input_scale, self.input_perm
    return self._replace(impl, dtype=dtype, input_scale=None if s is None else s.to(device, copy=True),
                         input_perm=None if p is None else p.to(device, copy=True))


@implements(aten.new_empty.default)
def _new_empty(func, args, kwargs):
    """As ``new_zeros`` (a quantized weight has no uninitialised form); an empty size of another
    rank (FSDP2's ``new_empty(0)`` for a rank without rows) is a weight of no rows."""
    self: AQT = args[0]
    size = tuple(int(s) for s in args[1])
    if len(size) != 2 and 0 in size or size == (0,):
        size = (0, self.shape[1]) if not self.transposed else (self.shape[0], 0)
    return _new_zeros(aten.new_zeros.default, (self, size), kwargs)


@implements(aten.empty_like.default, aten.zeros_like.default)
def _zeros_like(func, args, kwargs):
    self: AQT = args[0]
    kw = {k: kwargs[k] for k in ("dtype", "device") if kwargs.get(k) is not None}
    return _new_zeros(aten.new_zeros.default, (self, tuple(self.shape)), kw)


@implements(aten.view.default)
def _view(func, args, kwargs):
    self: AQT = args[0]
    size = list(args[1])
    if size == list(self.shape) or (size in ([-1], [self.numel()]) and _called_by_fsdp()):
        return return_and_correct_aliasing(func, args, kwargs, self._replace())
    raise NotImplementedError(
        f"torchq: view({size}) of the quantized weight {self.label or tuple(self.shape)!r} {tuple(self.shape)}: a "
        f"quantized weight keeps its 2-D shape; call .dequantize() first"
    )


def _called_by_fsdp(depth: int = 12) -> bool:
    """Whether FSDP2's own code asked (it keeps ``view(-1)`` of a shard as a handle it never reads
    for weights with an all-gather extension); anyone else asking for a 1-D view gets the error."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if "/fsdp/_fully_shard/" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


@implements(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    self: AQT = args[0]
    size, stride = list(args[1]), list(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    if size == list(self.shape) and stride == list(self.stride()) and not offset:
        return return_and_correct_aliasing(func, args, kwargs, self._replace())
    raise NotImplementedError(
        f"torchq: as_strided({size}, {stride}, {offset}) of the quantized weight {self.label or tuple(self.shape)!r}: "
        f"only its own size and strides are supported"
    )


@implements(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    self: AQT = args[0]
    return all(getattr(self.tensor_impl, n).is_pinned() for n in self.tensor_impl.tensor_names())


@implements(aten._pin_memory.default)
def _pin_memory(func, args, kwargs):
    self: AQT = args[0]
    s, p = self.input_scale, self.input_perm
    return self._replace(self.tensor_impl.map(lambda t: t.pin_memory()), input_scale=None if s is None else s.pin_memory(),
                         input_perm=None if p is None else p.pin_memory())
