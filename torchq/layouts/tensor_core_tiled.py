"""``TensorCoreTiledLayout``: PyTorch's CUDA tensor-core tiled int4 ("tinygemm") format.

The format of ``aten._convert_weight_to_int4pack`` / ``aten._weight_int4pack_mm`` (CUDA,
sm80+): groupwise <=4-bit weights, group size ``g`` in {32, 64, 128, 256}, bf16 scales (and
zeros). Codes are shifted to ``q' = q + (8 - mid)`` in 0..15 so that the kernel's
``x̂ = (q' - 8)·s + zero`` is the format's value, with ``zero = z`` (FLOAT), ``(mid - z)·s``
rounded to bf16 (INT) or 0 (NONE).

Bytes per ``[N, K]`` weight, with ``Np = ceil(N/8)·8``, ``Kp = ceil(K/L)·L`` where
``L = max(g, 16·inner_k_tiles)`` (the kernel needs whole groups and whole packed k-tiles):

* ``packed`` int32 ``[Np/8, Kp/(16·t), 32, t/2]`` (``t = inner_k_tiles``): the m16n8k16 B
  operand order. Word ``[nt, kt, lane, j]`` holds row ``n = 8·nt + lane // 4`` and, with
  ``c = lane % 4`` and ``k0 = 16·(kt·t + 2j)``, the codes at ``k0 + {2c, 2c+1, 2c+8, 2c+9}`` and
  the same offsets from ``k0 + 16``. Nibble slot ``4e + 2·tile + half`` (bits ``4·slot``) holds
  ``k = k0 + 16·tile + 8·half + 2c + e``;
* ``scales_and_zeros`` bf16 ``[Kp/g, Np, 2]`` (``[..., 0]`` scale, ``[..., 1]`` float zero);
* ``int_zero`` the original integer zero points ``[N, ceil(K/g)]`` (INT domain only).

Padding rows and columns hold code 8 with scale 0 and zero 0 (weight 0), and are sliced off.

The bytes are the same on every device: on CUDA they come from ``_convert_weight_to_int4pack``
(checked once per process against :func:`pack_tiled`, the pure-PyTorch packer used
elsewhere), and :func:`unpack_tiled` inverts them exactly, so the layout converts to and from
the plain form without loss and a checkpoint moves between CPU and GPU unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..canonical import PlainForm, QuantSpec
from ..dispatch import LinearKernel
from ..ops.int4 import TILE_ROWS, int4_tensor_core_mm, unpack_tiled
from ..primitives import ZeroPointDomain
from .base import Buffer, Fit, Layout, LayoutExample, TensorImpl, zero_dtype_rejects
from .int4_padded import format_codes, groupwise_int4_rejects, kernel_codes, padded_linear, round_up

__all__ = ["TensorCoreTiledLayout", "TensorCoreTiledImpl", "pack_tiled"]

GROUP_SIZES = (32, 64, 128, 256)
INNER_K_TILES = (2, 4, 8)


def _padded(n: int, k: int, group_size: int, inner_k_tiles: int) -> tuple[int, int]:
    return round_up(n, TILE_ROWS), round_up(k, max(group_size, 16 * inner_k_tiles))


def _tile_view(q: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """``[Np, Kp]`` codes viewed as ``[Np/8, Kp/(16t), 8 (row), 4 (c), t/2 (j), 2 (e), 2 (tile), 2 (half)]``."""
    np_, kp = q.shape
    t = inner_k_tiles
    v = q.reshape(np_ // TILE_ROWS, TILE_ROWS, kp // (16 * t), t // 2, 2, 2, 4, 2)  # nt, row, kt, j, tile, half, c, e
    return v.permute(0, 2, 1, 6, 3, 7, 4, 5)


def pack_tiled(q: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """Codes ``[Np, Kp]`` (0..15, any integer dtype; ``Np % 8 == 0``, ``Kp % (16·t) == 0``) to
    the tiled int32 words (see the module doc): what ``_convert_weight_to_int4pack`` returns for
    ``(q[:, 0::2] << 4) | q[:, 1::2]``."""
    np_, kp = q.shape
    t = inner_k_tiles
    nib = _tile_view(q.to(torch.int64), t).reshape(np_ // TILE_ROWS, kp // (16 * t), 32, t // 2, 8)
    shifts = 4 * torch.arange(8, dtype=torch.int64, device=q.device)
    words = (nib << shifts).sum(-1)  # slot order e, tile, half = 4e + 2·tile + half
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@functools.cache
def _cuda_pack_verified(device_index: int, inner_k_tiles: int) -> bool:
    """Whether this build's ``_convert_weight_to_int4pack`` produces :func:`pack_tiled`'s words
    (probed once per device and tile count with codes that tell every position apart)."""
    device = torch.device("cuda", device_index)
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 64 * inner_k_tiles), generator=gen, dtype=torch.uint8)
    got = torch.ops.aten._convert_weight_to_int4pack(((q[:, 0::2] << 4) | q[:, 1::2]).to(device), inner_k_tiles)
    return torch.equal(got.cpu(), pack_tiled(q, inner_k_tiles))


def _pack(q8: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    if q8.numel() == 0:  # an empty shard (FSDP2 pads the row count): the aten op would launch an empty grid
        return pack_tiled(q8, inner_k_tiles)
    if q8.device.type == "cuda":
        if not _cuda_pack_verified(q8.device.index or 0, inner_k_tiles):
            raise RuntimeError(
                "torchq: aten._convert_weight_to_int4pack on this CUDA build does not produce the tiled order torchq "
                "documents; use Int4NativeLayout (Triton kernels) instead of TensorCoreTiledLayout"
            )
        return torch.ops.aten._convert_weight_to_int4pack(((q8[:, 0::2] << 4) | q8[:, 1::2]).contiguous(), inner_k_tiles)
    return pack_tiled(q8, inner_k_tiles)


class TensorCoreTiledImpl(TensorImpl):
    tensor_fields = ("packed", "scales_and_zeros", "int_zero")
    attr_fields = ("zero_dtype",)

    @property
    def group_size(self) -> int:
        return self.spec.block_size[1]

    @property
    def padded_shape(self) -> tuple[int, int]:
        return _padded(*self.shape, self.group_size, self.layout.inner_k_tiles)

    def expected_tensors(self) -> dict[str, Buffer | None]:
        spec = self.spec
        domain = spec.zero_point_domain
        reason = self.layout.fit(spec, self.shape, torch.bfloat16, self.device).cannot_hold or zero_dtype_rejects(spec, self.zero_dtype)
        if reason is None and domain is ZeroPointDomain.FLOAT and self.zero_dtype != torch.bfloat16:
            reason = f"zero_dtype: the kernel reads bf16 float zeros, got {self.zero_dtype}"
        if reason is not None:
            raise ValueError(f"TensorCoreTiledImpl ({spec.describe()}): {reason}")
        n, k = self.shape
        np_, kp = self.padded_shape
        g, t = self.group_size, self.layout.inner_k_tiles
        return {
            "packed": Buffer((np_ // TILE_ROWS, kp // (16 * t), 32, t // 2), torch.int32, contiguous=True),
            "scales_and_zeros": Buffer((kp // g, np_, 2), torch.bfloat16, contiguous=True),
            "int_zero": Buffer((n, -(-k // g)), self.zero_dtype) if domain is ZeroPointDomain.INT else None,
        }

    @classmethod
    def from_plain(cls, plain: PlainForm, layout: Layout) -> TensorCoreTiledImpl:
        spec = plain.spec
        n, k = plain.shape
        g = spec.block_size[1]
        np_, kp = _padded(n, k, g, layout.inner_k_tiles)
        q8 = kernel_codes(plain, np_, kp, fill=8)
        scale = plain.scale
        domain = spec.zero_point_domain
        if domain is ZeroPointDomain.FLOAT:
            if plain.zero_point.dtype != torch.bfloat16:
                raise ValueError(f"zero_point: the kernel reads bf16 float zeros, got {plain.zero_point.dtype}")
            zero_f = plain.zero_point
        elif domain is ZeroPointDomain.INT:
            zero_f = ((spec.mid - plain.zero_point.to(torch.int32)) * scale).to(torch.bfloat16)
        else:
            zero_f = torch.zeros_like(scale)
        sz = torch.zeros(np_, kp // g, 2, dtype=torch.bfloat16, device=plain.device)
        sz[:n, : scale.shape[1], 0] = scale
        sz[:n, : scale.shape[1], 1] = zero_f
        return cls(
            layout, spec, (n, k),
            packed=_pack(q8, layout.inner_k_tiles),
            scales_and_zeros=sz.transpose(0, 1).contiguous(),
            int_zero=plain.zero_point if domain is ZeroPointDomain.INT else None,
            zero_dtype=None if plain.zero_point is None else plain.zero_point.dtype,
        )

    def to_plain(self) -> PlainForm:
        spec = self.spec
        n, k = self.shape
        np_, kp = self.padded_shape
        codes = format_codes(unpack_tiled(self.packed, np_, kp), spec, n, k)
        groups = -(-k // self.group_size)
        sz = self.scales_and_zeros[:groups, :n].transpose(0, 1)
        domain = spec.zero_point_domain
        if domain is ZeroPointDomain.FLOAT:
            zero = sz[..., 1].to(self.zero_dtype).contiguous()
        elif domain is ZeroPointDomain.INT:
            zero = self.int_zero
        else:
            zero = None
        return PlainForm(codes, sz[..., 0].contiguous(), zero, spec)


@dataclass(frozen=True)
class TensorCoreTiledLayout(Layout):
    """PyTorch's CUDA tensor-core tiled int4 format (``_weight_int4pack_mm``); see the module doc.

    ``inner_k_tiles`` (2, 4 or 8): k-tiles of 16 packed per lane, i.e. 4-, 8- or 16-byte loads."""

    inner_k_tiles: int = 8

    name = "tensor_core_tiled"
    impl_class = TensorCoreTiledImpl
    device_specific = True

    @classmethod
    def linear_kernels(cls):
        return KERNELS

    def __post_init__(self) -> None:
        if self.inner_k_tiles not in INNER_K_TILES:
            raise ValueError(f"inner_k_tiles: expected one of {INNER_K_TILES}, got {self.inner_k_tiles!r}")

    def fit(self, spec, shape=None, scale_dtype=None, device=None):
        base = super().fit(spec, shape, scale_dtype, device)
        if not base.holds:
            return base
        if shape is not None and len(shape) != 2:
            return Fit(f"needs a 2-D weight, got shape {shape}")
        reason = groupwise_int4_rejects(spec, GROUP_SIZES)
        if reason is not None:
            return Fit(reason)
        if scale_dtype is not None and scale_dtype != torch.bfloat16:
            return Fit(f"the kernel reads bf16 scales, got {scale_dtype} (quantize with scale_dtype=torch.bfloat16)")
        return base if device is None else Fit(not_automatic=_device_rejects(torch.device(device)))

    @classmethod
    def examples(cls) -> tuple[LayoutExample, ...]:
        z, bf16 = ZeroPointDomain, torch.bfloat16
        return (
            LayoutExample(cls(), QuantSpec((1, 128), 0, 15, z.INT), (24, 256), bf16),
            LayoutExample(cls(inner_k_tiles=2), QuantSpec((1, 32), -8, 7, z.NONE), (33, 96), bf16),  # odd N
            LayoutExample(cls(inner_k_tiles=4), QuantSpec((1, 64), 0, 15, z.FLOAT), (40, 200), bf16),  # padded K
            LayoutExample(cls(), QuantSpec((1, 256), 0, 15, z.INT), (8, 300), bf16, torch.int32),
        )


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _device_rejects(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"CUDA kernel, tensor is on {device}"
    if torch.version.hip is not None:
        return "tinygemm's tiled order is NVIDIA's (ROCm builds use another)"
    cap = _capability(device)
    if cap < (8, 0):
        return f"needs compute capability 8.0+ (bf16 tensor cores), {device} has {cap[0]}.{cap[1]}"
    return None


def _check(x: torch.Tensor, w, bias) -> str | None:
    reason = _device_rejects(x.device)
    if reason is not None:
        return reason
    if w.act_quant is not None:
        return f"weight-only kernel, weight has {w.act_quant.describe()}"
    return None


def _linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl: TensorCoreTiledImpl = w.tensor_impl
    mm = lambda x2: int4_tensor_core_mm(x2, w.packed, impl.group_size, w.scales_and_zeros)  # noqa: E731
    return padded_linear(x, bias, *impl.shape, *impl.padded_shape, mm, compute_dtype=torch.bfloat16)


# The kernel takes bf16 activations only: a config with compute_dtype=torch.bfloat16 runs fp16/fp32
# inputs through it (cast in, output cast back); without it they run through the same cast as a
# visible fallback (a FallbackWarning; an error under torchq.strict()).
KERNELS = (
    LinearKernel(
        "tensor_core_tiled",
        _check,
        _linear,
        description="aten._weight_int4pack_mm (tinygemm, CUDA sm80+) below 32 rows, the tiled weight written once by "
        "Triton + cuBLAS from 32 (torchq::int4_tensor_core_mm): bf16 input, tiled int4 weight",
        dtypes=(torch.bfloat16,),
    ),
)
