"""FSDP2 all-gather extension for quantized weights (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` of :class:`~torchq.tensor.AffineQuantizedTensor`).

``fully_shard`` cuts a quantized weight along dim 0 with ``torch.chunk`` (``ceil(N / world)``
rows per rank, the last ranks fewer or none) and keeps each rank's rows as a quantized weight
in its layout (another layout where the shard's shape rules that one out). Padding rule: every
rank all-gathers one uint8 tensor of ``ceil(N / world)`` rows, each row the bytes of its
:mod:`row parts <torchq.distributed.rows>` (bit-packed codes, then scales, then zero points);
the rows a rank lacks are sent as zeros and dropped after the gather. (One tensor, not one per
part: FSDP2's single-process path copies only the first all-gather input.) Only those parts cross the wire, ``N * RowFormat.row_bytes()`` per weight instead of
``N * K * itemsize`` for the float weight; the gathered weight is packed in the shard's layout,
in the dtype FSDP asks for (``param_dtype`` of a mixed precision policy: the wrapper's dtype
only, never the codes or scales). With CPU offload the parts move as bytes.

Resharding after forward frees the gathered weight's tensors; the gather before backward
refills the same tensors (``out=``), so autograd's reference to them sees the weight again.
"""

from __future__ import annotations

from typing import Any

import torch

from ..tensor import AQT
from .rows import RowFormat, from_row_parts, pack_in, to_row_parts

__all__ = ["pre_all_gather", "post_all_gather", "GatherMetadata"]


class GatherMetadata(tuple):
    """``(row format, layout, whole row count, the shard)``: what :func:`post_all_gather` needs
    to rebuild the weight from the gathered parts."""

    __slots__ = ()


def pre_all_gather(w: AQT, mesh: Any) -> tuple[tuple[torch.Tensor, ...], GatherMetadata]:
    """The all-gather input of a rank's shard ``w``: uint8 ``[ceil(N / world), row_bytes]`` (FSDP2's
    padded shard size), each row its row parts' bytes, zero rows past the shard's own; and the
    metadata to rebuild the whole."""
    if w.transposed:
        raise NotImplementedError(f"torchq: FSDP2 shards quantized weights as [N, K]; {w.label!r} is transposed")
    what = f"quantized weight {w.label or tuple(w.shape)!r}"
    fmt, parts = to_row_parts(w.to_plain(), what)
    rows = w.shape[0]
    whole, padded = _shard_rows(w, mesh)
    record = torch.zeros(padded, fmt.row_bytes(), dtype=torch.uint8, device=w.device)
    col = 0
    for part in parts:
        width = part.shape[1] * part.element_size()
        record[:rows, col:col + width] = part.view(torch.uint8).reshape(rows, width)
        col += width
    return (record,), GatherMetadata((fmt, w.tensor_impl.layout, whole, w))


def _shard_rows(w: AQT, mesh: Any) -> tuple[int, int]:
    """``(N, ceil(N / world))`` for the rank's shard ``w``: the whole row count is the sum of the
    ranks' rows (one all-reduce the first time, then remembered on the shard). FSDP2 hands the
    extension only the shard and the mesh, and every rank gathers the same parameters in the
    same order, so the all-reduce lines up across ranks."""
    known = w.__dict__.get("_fsdp_rows")
    if known is not None:
        return known
    world = mesh.size()
    if world == 1:
        known = (w.shape[0], w.shape[0])
    else:
        import torch.distributed as dist

        count = torch.tensor([w.shape[0]], dtype=torch.int64, device=w.device)
        dist.all_reduce(count, group=mesh.get_group())
        whole = int(count.item())
        known = (whole, -(-whole // world))
    w._fsdp_rows = known
    return known


def post_all_gather(all_gather_outputs: tuple[torch.Tensor, ...], metadata: GatherMetadata, param_dtype: torch.dtype,
                    *, out: AQT | None = None):
    """Rebuild the whole quantized weight from the gathered row parts (``[world * padded, ...]``
    each), dropping the padding rows.
    Returns ``(weight, inner tensors FSDP may free)``, or fills ``out`` in place."""
    fmt, layout, n, template = metadata
    fmt: RowFormat
    (record,) = all_gather_outputs
    parts, col = [], 0
    for dtype, width in zip(fmt.dtypes, fmt.widths):
        nbytes = width * dtype.itemsize
        parts.append(record.new_empty((n, nbytes)).copy_(record[:n, col:col + nbytes]).view(dtype))  # own storage, packed strides
        col += nbytes
    plain = from_row_parts(fmt, parts)
    impl = pack_in(layout, plain)
    # Each inner tensor owns its storage (FSDP frees and re-allocates storages whole).
    shared = {t.untyped_storage().data_ptr() for t in all_gather_outputs}
    impl = impl.map(lambda t: t.clone() if t.untyped_storage().data_ptr() in shared or not t.is_contiguous()
                    or t.untyped_storage().nbytes() != t.numel() * t.element_size() else t)
    if out is not None:
        dst = out.tensor_impl
        if dst.metadata() != impl.metadata():
            raise RuntimeError(f"torchq FSDP2: the re-gathered weight {template.label!r} changed format: "
                               f"{dst.metadata()} vs {impl.metadata()}")
        for name in dst.tensor_names():
            getattr(dst, name).copy_(getattr(impl, name))
        return None
    s, p = template.input_scale, template.input_perm
    w = AQT(impl, param_dtype, act_quant=template.act_quant, label=template.label, config=template.config,
            compute_dtype=template.compute_dtype, input_scale=s, input_perm=p)
    return w, tuple(getattr(impl, name) for name in impl.tensor_names())
