"""The aten ops that sharding a quantized weight needs (FSDP2's ``fully_shard``, DTensor's
``distribute_tensor``), on :class:`~torchq.tensor.AffineQuantizedTensor`.

* ``split`` / ``split_with_sizes`` (``torch.chunk``): row or column ranges, each one the quantized
  range of the float weight (a block or group that would be cut raises a ValueError naming it);
* ``new_zeros`` / ``new_empty``: a weight of the same format whose values are 0 (a shard's padding
  rows, or an empty shard of no rows or columns; ``new_empty(0)``: no rows);
* ``constant_pad_nd`` (``F.pad`` with zeros at the end of a dimension): DTensor's padding of
  uneven shards before a scatter (:mod:`.collectives` moves quantized shards);
* ``view`` to its own shape (an alias); ``view(-1)`` only for FSDP2, which keeps it as a flat shard
  handle it never reads for weights with an all-gather extension (the weight has no 1-D form, so
  FSDP2 gets an alias in the 2-D shape; anyone else gets a NotImplementedError);
* ``as_strided`` to its own size and contiguous strides (an alias);
* ``is_pinned`` / ``_pin_memory`` (CPU offload), ``empty_like`` (zeros, as ``new_zeros``: the buffer a
  scatter or broadcast fills).
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..tensor import AQT, implements, slice_weight
from .rows import pack_in, pad_plain, zero_plain

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
    return _zeros(self, tuple(int(s) for s in args[1]), kwargs.get("dtype") or self.dtype,
                  torch.device(kwargs.get("device") or self.device), nested=False)


def _zeros(self: AQT, size: tuple[int, ...], dtype: torch.dtype, device: torch.device, nested: bool) -> AQT:
    """A weight of ``self``'s format and layout, of ``size``, whose values are 0; its scales are
    double-quantized where ``nested`` and ``self``'s are (``empty_like``: a scatter's buffer for a
    whole weight), plain fp32 otherwise (FSDP2 copies a shard into a slice of its ``new_zeros``)."""
    if len(size) != 2 or any(s < 0 for s in size):
        raise NotImplementedError(
            f"torchq: new_zeros({list(size)}) of the quantized weight {self.label or tuple(self.shape)!r} "
            f"{tuple(self.shape)}: a quantized weight is 2-D; give [rows, columns]"
        )
    if not dtype.is_floating_point:
        raise TypeError(f"new_zeros: a quantized weight's dtype is a float dtype, got {dtype}")
    n, k = (size[1], size[0]) if self.transposed else size
    plain = self.to_plain()
    spec = plain.spec
    b0, b1 = spec.block_size
    if k != plain.shape[1] and b1 >= plain.shape[1]:  # a block spanning the row spans the new width
        spec = dataclasses.replace(spec, block_size=(b0, max(k, 1)))
    zero_dtype = None if plain.zero_point is None else plain.zero_point.dtype
    z = zero_plain(spec, (n, k), plain.scale.dtype, zero_dtype, device, nested=nested and (n, k) == plain.shape)
    impl = pack_in(self.tensor_impl.layout, z)
    s, p = self.input_scale, self.input_perm
    if k != plain.shape[1]:  # another width: a zero weight's own factors (1) and order (identity)
        s = None if s is None else torch.ones(k, dtype=s.dtype, device=device)
        p = None if p is None else torch.arange(k, dtype=p.dtype, device=device)
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
    """A weight of the same format and layout whose values are 0 (double-quantized scales stay
    double-quantized): the buffer DTensor scatters a shard into."""
    self: AQT = args[0]
    return _zeros(self, tuple(self.shape), kwargs.get("dtype") or self.dtype,
                  torch.device(kwargs.get("device") or self.device), nested=True)


@implements(aten.constant_pad_nd.default)
def _constant_pad_nd(func, args, kwargs):
    """Zero padding at the end of a dimension (``F.pad(w, [0, c])`` or ``[0, 0, 0, r]``): DTensor
    pads uneven shards to one size before a scatter and cuts the padding off after it. The padded
    weight keeps every value of ``self`` bit for bit (:func:`~torchq.distributed.rows.pad_plain`);
    padded input features get an ``input_scale`` of 1 and keep their own place in an ``input_perm``."""
    self: AQT = args[0]
    pad = [int(p) for p in (args[1] if len(args) > 1 else kwargs["pad"])]
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    if value != 0 or len(pad) not in (2, 4) or any(p < 0 for p in pad) or any(pad[0::2]):
        raise NotImplementedError(
            f"torchq: pad={pad}, value={value} on the quantized weight {self.label or tuple(self.shape)!r}: only zero "
            f"padding at the end of a dimension is supported (pad=[0, c] or [0, 0, 0, r], value=0: DTensor's padding "
            f"of uneven shards); call .dequantize() first for other padding"
        )
    extra = [pad[3] if len(pad) == 4 else 0, pad[1]]  # wrapper dims 0, 1
    rows, cols = reversed(extra) if self.transposed else extra
    if not rows and not cols:
        return self._replace()
    plain = self.to_plain()
    impl = pack_in(self.tensor_impl.layout, pad_plain(plain, rows, cols))
    s, p = self.input_scale, self.input_perm
    k = plain.shape[1]
    if cols and s is not None:
        s = torch.cat([s, torch.ones(cols, dtype=s.dtype, device=s.device)])
    if cols and p is not None:
        p = torch.cat([p, torch.arange(k, k + cols, dtype=p.dtype, device=p.device)])
    return self._replace(impl, input_scale=None if s is None else s.clone(), input_perm=None if p is None else p.clone())


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
