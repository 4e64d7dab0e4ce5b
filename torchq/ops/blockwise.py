"""bitsandbytes-compatible blockwise ops (``torch.ops.torchq.quantize_4bit`` and friends) and
``torchq::blockwise_4bit_linear``, the linear of :class:`~torchq.layouts.Blockwise4bitLayout`.

Each op has bitsandbytes' schema (argument names, types, defaults), a fake implementation for
``torch.compile``, and a pure-PyTorch implementation that is the executable spec and the fallback
for every device; device backends register against the same op. ``dequantize_4bit``,
``dequantize_blockwise`` and ``gemv_4bit`` also have bitsandbytes' ``.out`` overloads
(:mod:`.out_overloads`). ``gemm_4bit`` is ``gemv_4bit`` for any number of rows with a bias and,
optionally, double-quantized absmax (``absmax_8bit`` codes, ``absmax_code`` map, ``absmax_offset``,
with ``absmax`` then holding the per-256 statistics).

Formats (``numel = n``, ``blocksize = B``, ``nb = ceil(n / B)``):

* **4-bit (NF4 / FP4).** Blocks of ``B`` consecutive elements of the row-major flattened tensor;
  ``absmax`` fp32 ``[nb]``; ``s = x * (1 / absmax)`` in fp32; nibble = nearest codebook value
  (fp32 midpoints of neighbours, a tie goes to the lower value; FP4 rounds the magnitude that
  way, so a negative tie takes the larger magnitude, and sets bit 3 for negative values). Packed bytes ``ceil(n / 2)``: element ``2j`` in the high
  nibble, ``2j + 1`` in the low one; an odd tail is padded with the code of 0.0. Returned as
  ``[ceil(n/2) / itemsize, 1]`` of ``quant_storage`` (uint8 by default).
* **8-bit blockwise.** The same blocks and absmax; code = index of the nearest value in a sorted
  256-entry map (the dynamic map by default), one byte per element, in ``A``'s shape.
* **Dequantize:** ``code[index] * absmax[block]`` in fp32, then one cast to the output dtype.

**Statistics dtypes.** The ops that read statistics (``dequantize_4bit``, ``gemv_4bit``,
``gemm_4bit``, ``dequantize_blockwise`` and their ``.out`` overloads and fakes) take ``absmax``
(and ``gemm_4bit``'s per-256 ``absmax`` of the double-quantized form) in fp32, bf16 or fp16; any
other dtype raises a ValueError naming the argument. A bf16 / fp16 statistic is first widened to
fp32, which is exact (fp32 holds every bf16 and fp16 value), so the arithmetic is the fp32 one
above: ``fp32(code[index]) * fp32(absmax)`` rounded once to fp32, then one cast to the output
dtype. ``absmax_offset`` may be any floating dtype and is rounded to fp32 (exact for these three);
``code`` / ``absmax_code`` stay fp32 maps. This is bitsandbytes' arithmetic on the CPU (its
``dequantize_4bit`` kernel calls ``absmax.float()``; its ``gemv_4bit`` / ``gemm_4bit``, on CPUs
without AVX512-BF16, dequantize that way to A's dtype, then ``F.linear``) and in its pure-PyTorch
default backend (the fp32 code table times the absmax tensor, which type promotion widens to
fp32), bit for bit for the references. bitsandbytes' backends disagree elsewhere: its fakes of
``dequantize_4bit`` and ``gemm_4bit`` require fp32 absmax (so ``opcheck`` / ``torch.compile`` reject
bf16 there); its CUDA kernels and its CPU ``dequantize_blockwise`` kernel read the absmax buffer as
fp32 whatever its dtype (``gemm_4bit``'s fused CUDA kernel raises); its CPU ``gemv_4bit`` for
AVX512-BF16 machines rounds absmax *to* bf16 and computes in bf16 on its own repacked weight layout
(``_convert_weight_packed_for_cpu``), which torchq does not read. fp64 statistics are refused: the
CPU kernel would round them to fp32, the default backend would compute in fp64.

Choices where the reference implementations disagree (bytes differ, values do not):

* an all-zero block (``absmax = 0``) gets the code of 0.0 (NF4 nibble 7, FP4 nibble 0), as
  bitsandbytes' reference and CPU code do (its CUDA kernel writes nibble 0);
* FP4 never writes negative zero (nibble 8): every value whose magnitude rounds to 0 gets
  nibble 0. bitsandbytes' CPU code writes nibble 8 for tiny positive values and 0 for tiny
  negative ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..blockwise.codebooks import FP4_MAGNITUDES, NF4, codebook
from ..blockwise.nested import NESTED_BLOCKSIZE, double_dequantize
from .devices import check_op_devices, one_device_fake
from .out_overloads import define_out_overload

__all__ = [
    "BLOCK_SIZES",
    "quantize_4bit",
    "dequantize_4bit",
    "quantize_blockwise",
    "dequantize_blockwise",
    "check_blocksize",
    "STAT_DTYPES",
    "bnb_cpu_packed_to_standard",
    "is_bnb_cpu_packed",
    "check_statistic",
    "fp32_statistic",
    "check_gemv_4bit",
    "gemv_4bit",
    "gemv_4bit_reference",
    "gemm_4bit",
    "gemm_4bit_reference",
    "check_gemm_4bit",
    "gemm_4bit_absmax",
    "blockwise_4bit_linear",
    "check_blockwise_4bit_linear_args",
    "blockwise_4bit_weight",
    "blockwise_4bit_reference",
]

BLOCK_SIZES = tuple(2**i for i in range(5, 13))  # 32 ... 4096
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# dtypes of statistics (absmax): each value exact in fp32, so widening them changes nothing
STAT_DTYPES = _FLOATS


def check_statistic(name: str, t: torch.Tensor, numel: int, what: str) -> None:
    """Raise a ValueError naming ``name`` unless ``t`` holds ``numel`` fp32 / bf16 / fp16 values
    (``what``: the reason for the count, shown in the message)."""
    if t.dtype not in STAT_DTYPES or t.numel() != numel:
        raise ValueError(f"{name}: expected fp32 with {numel} entries ({what}; bf16 or fp16 also accepted), "
                         f"got {t.dtype} with {t.numel()}")


def fp32_statistic(t: torch.Tensor) -> torch.Tensor:
    """``t`` as fp32: itself when it is fp32, else widened (exact for bf16 / fp16)."""
    return t if t.dtype == torch.float32 else t.float()


def check_blocksize(blocksize: int) -> None:
    if not isinstance(blocksize, int) or blocksize not in BLOCK_SIZES:
        raise ValueError(f"blocksize: expected a power of two in 32..4096, got {blocksize!r}")


def _check_input(A: torch.Tensor, what: str = "A") -> None:
    if A.dtype not in _FLOATS:
        raise TypeError(f"{what}: expected fp32, bf16 or fp16, got {A.dtype}")
    if A.numel() == 0:
        raise ValueError(f"{what}: expected a non-empty tensor, got shape {tuple(A.shape)}")


def _midpoints(sorted_values: torch.Tensor) -> torch.Tensor:
    """fp32 midpoints of neighbouring values (computed in fp64, rounded once to fp32)."""
    v = sorted_values.double()
    return ((v[:-1] + v[1:]) / 2).float()


_NF4_MIDS = _midpoints(NF4)
_FP4_MAG_ORDER = torch.argsort(FP4_MAGNITUDES)  # sorted position -> 3-bit magnitude code
_FP4_MAG_MIDS = _midpoints(FP4_MAGNITUDES[_FP4_MAG_ORDER])


def _blocks(A: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normalised fp32 values [nb, B] padded with 0.0, absmax fp32 [nb])``."""
    flat = A.reshape(-1).float()
    n = flat.numel()
    nb = -(-n // blocksize)
    if nb * blocksize != n:
        flat = torch.cat([flat, flat.new_zeros(nb * blocksize - n)])
    blocks = flat.reshape(nb, blocksize)
    absmax = blocks.abs().amax(dim=1)
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError("A: contains NaN or inf; blockwise quantization needs finite values")
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))  # all-zero block: s = 0
    return blocks * inv[:, None], absmax


def _nibbles(s: torch.Tensor, quant_type: str) -> torch.Tensor:
    """4-bit codes (uint8) of normalised values ``s`` in [-1, 1]."""
    if quant_type == "nf4":
        return torch.bucketize(s, _NF4_MIDS.to(s.device), right=False).to(torch.uint8)
    if quant_type == "fp4":
        mids = _FP4_MAG_MIDS.to(s.device)
        neg = s < 0
        # a tie goes to the lower value: the smaller magnitude for s > 0, the larger for s < 0
        pos = torch.where(neg, torch.bucketize(-s, mids, right=True), torch.bucketize(s, mids, right=False))
        mag = _FP4_MAG_ORDER.to(s.device)[pos]
        sign = neg & (mag != 0)
        return (mag + 8 * sign).to(torch.uint8)
    codebook(quant_type)  # raises the error naming the argument
    raise AssertionError


def _pack_nibbles(nib: torch.Tensor, n: int) -> torch.Tensor:
    flat = nib.reshape(-1)[: n + (n % 2)]  # the odd tail keeps one padding code (of 0.0)
    pairs = flat.reshape(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1]


def _check_quantize_4bit(A: torch.Tensor, blocksize: int, quant_type: str, quant_storage: torch.dtype) -> int:
    """The argument checks of :func:`quantize_4bit` (shared with its fake); returns the number of
    ``quant_storage`` elements of the packed result."""
    check_blocksize(blocksize)
    codebook(quant_type)
    _check_input(A)
    size = quant_storage.itemsize
    nbytes = (A.numel() + 1) // 2
    if nbytes % size:
        raise ValueError(
            f"quant_storage: {nbytes} packed bytes do not fill whole {quant_storage} elements "
            f"({size} bytes each); use uint8 or an even number of elements"
        )
    return nbytes // size


# -- 4-bit ----------------------------------------------------------------------------------------
@torch.library.custom_op(
    "torchq::quantize_4bit", mutates_args=(),
    schema="(Tensor A, int blocksize, str quant_type, ScalarType quant_storage) -> (Tensor, Tensor)",
)
def quantize_4bit(A: torch.Tensor, blocksize: int, quant_type: str, quant_storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed [ceil(n/2)/itemsize, 1] quant_storage, absmax fp32 [nb])`` (see module doc)."""
    _check_quantize_4bit(A, blocksize, quant_type, quant_storage)
    s, absmax = _blocks(A, blocksize)
    packed = _pack_nibbles(_nibbles(s, quant_type), A.numel())
    return packed.view(quant_storage).reshape(-1, 1), absmax


@quantize_4bit.register_fake
@one_device_fake('quantize_4bit')
def _(A, blocksize, quant_type, quant_storage):
    rows = _check_quantize_4bit(A, blocksize, quant_type, quant_storage)
    return A.new_empty((rows, 1), dtype=quant_storage), A.new_empty((-(-A.numel() // blocksize),), dtype=torch.float32)


_DEQUANTIZE_4BIT_ARGS = "Tensor A, Tensor absmax, int blocksize, str quant_type, int[] shape, ScalarType dtype"


@torch.library.custom_op("torchq::dequantize_4bit", mutates_args=(), schema=f"({_DEQUANTIZE_4BIT_ARGS}) -> Tensor")
def dequantize_4bit(
    A: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """Values of ``shape`` in ``dtype`` from packed 4-bit codes and their absmax (fp32, bf16 or
    fp16, widened to fp32): ``code[nibble] * absmax`` in fp32, one cast to ``dtype``."""
    return _dequantize_with_table(A, absmax, blocksize, codebook(quant_type).to(A.device), shape, dtype)


@dequantize_4bit.register_fake
@one_device_fake('dequantize_4bit')
def _(A, absmax, blocksize, quant_type, shape, dtype):
    codebook(quant_type)
    _check_packed_4bit(A, absmax, blocksize, shape, dtype)
    return A.new_empty(tuple(shape), dtype=dtype)


define_out_overload("dequantize_4bit", f"({_DEQUANTIZE_4BIT_ARGS}, Tensor! out) -> ()")


# -- 8-bit blockwise ------------------------------------------------------------------------------
def _check_quantize_blockwise(A: torch.Tensor, code: torch.Tensor, blocksize: int) -> None:
    """The argument checks of :func:`quantize_blockwise` (shared with its fake)."""
    check_blocksize(blocksize)
    _check_input(A)
    if code.dtype != torch.float32 or code.dim() != 1 or not 2 <= code.numel() <= 256:
        raise ValueError(f"code: expected a 1-D fp32 map of 2 to 256 values, got {code.dtype} {list(code.shape)}")


def _sorted_code(code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    if bool((code[1:] >= code[:-1]).all()):
        return code, None
    order = torch.argsort(code, stable=True)
    return code[order], order


@torch.library.custom_op("torchq::quantize_blockwise", mutates_args=(), schema="(Tensor A, Tensor code, int blocksize) -> (Tensor, Tensor)")
def quantize_blockwise(A: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(uint8 indices into code, A's shape; absmax fp32 [nb])``: nearest code value of
    ``x * (1 / absmax)`` (exact midpoints, ties to the lower value)."""
    _check_quantize_blockwise(A, code, blocksize)
    values, order = _sorted_code(code.to(A.device))
    s, absmax = _blocks(A, blocksize)
    idx = torch.bucketize(s, _midpoints(values), right=False)
    if order is not None:
        idx = order[idx]
    return idx.reshape(-1)[: A.numel()].to(torch.uint8).reshape(A.shape), absmax


@quantize_blockwise.register_fake
@one_device_fake('quantize_blockwise')
def _(A, code, blocksize):
    _check_quantize_blockwise(A, code, blocksize)
    return A.new_empty(A.shape, dtype=torch.uint8), A.new_empty((-(-A.numel() // blocksize),), dtype=torch.float32)


_DEQUANTIZE_BLOCKWISE_ARGS = "Tensor A, Tensor absmax, Tensor code, int blocksize, ScalarType dtype"


def _check_dequantize_blockwise(A, absmax, code, blocksize, dtype) -> None:
    """The argument checks of :func:`dequantize_blockwise` (shared with its fake)."""
    check_blocksize(blocksize)
    if A.dtype != torch.uint8:
        raise TypeError(f"A: expected uint8 indices, got {A.dtype}")
    nb = -(-A.numel() // blocksize)
    check_statistic("absmax", absmax, nb, f"blocksize {blocksize}")
    if code.dtype != torch.float32 or code.dim() != 1:
        raise ValueError(f"code: expected a 1-D fp32 map, got {code.dtype} {list(code.shape)}")
    if dtype not in _FLOATS:
        raise TypeError(f"dtype: expected fp32, bf16 or fp16, got {dtype}")


@torch.library.custom_op("torchq::dequantize_blockwise", mutates_args=(), schema=f"({_DEQUANTIZE_BLOCKWISE_ARGS}) -> Tensor")
def dequantize_blockwise(A: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int, dtype: torch.dtype) -> torch.Tensor:
    """``code[A] * absmax[block]`` in fp32 (absmax fp32, bf16 or fp16, widened to fp32), cast to
    ``dtype``, in A's shape."""
    _check_dequantize_blockwise(A, absmax, code, blocksize, dtype)
    n = A.numel()
    nb = -(-n // blocksize)
    values = code.to(A.device)[A.reshape(-1).long()]
    pad = nb * blocksize - n
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    out = (values.reshape(nb, blocksize) * fp32_statistic(absmax).reshape(nb, 1)).reshape(-1)[:n]
    return out.to(dtype).reshape(A.shape)


@dequantize_blockwise.register_fake
@one_device_fake('dequantize_blockwise')
def _(A, absmax, code, blocksize, dtype):
    _check_dequantize_blockwise(A, absmax, code, blocksize, dtype)
    return A.new_empty(A.shape, dtype=dtype)


define_out_overload("dequantize_blockwise", f"({_DEQUANTIZE_BLOCKWISE_ARGS}, Tensor! out) -> ()")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        if s < 0:
            raise ValueError(f"shape: expected non-negative sizes, got {list(shape)}")
        n *= s
    if n == 0:
        raise ValueError(f"shape: expected a non-empty shape, got {list(shape)}")
    return n


# -- 4-bit matrix-vector ----------------------------------------------------------------------------
_GEMV_4BIT_ARGS = "Tensor A, Tensor B, int[] shapeB, Tensor absmax, Tensor code, int blocksize"


@torch.library.custom_op("torchq::gemv_4bit", mutates_args=(), schema=f"({_GEMV_4BIT_ARGS}) -> Tensor")
def gemv_4bit(
    A: torch.Tensor, B: torch.Tensor, shapeB: Sequence[int], absmax: torch.Tensor, code: torch.Tensor, blocksize: int
) -> torch.Tensor:
    """``A @ W.T`` in A's dtype, ``W = code[nibbles of B] * absmax`` of shape ``shapeB = [N, K]``
    (``code``: the 16-value fp32 table of the format; ``absmax`` fp32, bf16 or fp16, widened to
    fp32). Reference: dequantize in fp32, cast once to A's dtype, ``F.linear`` (bitsandbytes'
    default backend, bit for bit). On the CPU the native fused kernel runs instead when built
    (:mod:`torchq.backends.native_cpu.lut4`: the same fp32 weights, fp32 accumulation).
    bitsandbytes' CPU-packed layout (a 2-D ``[K/blocksize, N]`` absmax with ``B`` ``[N, K/2]``,
    :func:`is_bnb_cpu_packed`) is read as the same codes and statistics in the standard layout."""
    return gemv_4bit_reference(A, B, shapeB, absmax, code, blocksize)


def _check_4bit_matmul_operands(A, B, shapeB) -> None:
    """What gemv_4bit and gemm_4bit check alike: ``shapeB`` is ``[N, K]``, A is float with last
    dimension K, B is packed 4-bit storage."""
    if len(shapeB) != 2:
        raise ValueError(f"shapeB: expected [N, K], got {list(shapeB)}")
    if A.dtype not in _FLOATS:
        raise TypeError(f"A: expected fp32, bf16 or fp16, got {A.dtype}")
    if A.dim() < 1 or A.shape[-1] != shapeB[1]:
        raise ValueError(f"A: expected last dimension {shapeB[1]} (K of shapeB {list(shapeB)}), got shape {list(A.shape)}")
    _check_packed_4bit_storage(B)


def check_gemv_4bit(A, B, shapeB, absmax, code, blocksize) -> None:
    """The argument checks of :func:`gemv_4bit` that need no tensor data (shared with its fake)."""
    _check_4bit_matmul_operands(A, B, shapeB)
    if code.dtype != torch.float32 or code.shape != (16,):
        raise ValueError(f"code: expected the 16 fp32 values of a 4-bit format, got {code.dtype} {list(code.shape)}")
    _check_packed_4bit(B, absmax, blocksize, shapeB, A.dtype)


#: bitsandbytes' CPU-packed 4-bit layout (``bitsandbytes.functional._convert_weight_packed_for_cpu``): rows in groups of 32
BNB_CPU_BLOCK_N = 32


def is_bnb_cpu_packed(B: torch.Tensor, shapeB: Sequence[int], absmax: torch.Tensor, blocksize: int) -> bool:
    """Whether ``(B, absmax)`` is bitsandbytes' CPU-packed layout, which its ``gemv_4bit`` reads on
    CPUs with AVX512-BF16 (its tests repack there): ``B`` uint8 ``[N, K/2]`` where each run of 32
    bytes holds, for 32 rows and 2 neighbouring columns, the rows' first column in the low nibbles
    and the second in the high ones, and ``absmax`` 2-D ``[K/blocksize, N]`` (transposed). The
    standard layout's ``absmax`` is 1-D (as ``quantize_4bit`` returns it)."""
    if len(shapeB) != 2 or absmax.dim() != 2 or B.dim() != 2 or B.dtype != torch.uint8:
        return False
    n, k = shapeB
    return (k % blocksize == 0 and k % 2 == 0 and n % BNB_CPU_BLOCK_N == 0
            and tuple(absmax.shape) == (k // blocksize, n) and tuple(B.shape) == (n, k // 2))


def bnb_cpu_packed_to_standard(B: torch.Tensor, shapeB: Sequence[int], absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard layout ``(packed bytes [N*K/2], absmax [N*K/blocksize])`` of bitsandbytes'
    CPU-packed ``(B, absmax)`` (:func:`is_bnb_cpu_packed`): the same codes and statistics, moved."""
    n, k = shapeB
    runs = B.reshape(-1, BNB_CPU_BLOCK_N)
    pairs = torch.cat([runs & 0xF, runs >> 4], dim=1)  # [N/32 * K/2, 64]: 32 low nibbles, then 32 high
    codes = pairs.reshape(n // BNB_CPU_BLOCK_N, k // 2, BNB_CPU_BLOCK_N, 2).transpose(1, 2).reshape(n, k)
    flat = codes.reshape(-1, 2)
    return (flat[:, 0] << 4) | flat[:, 1], absmax.t().reshape(-1)


def gemv_4bit_reference(
    A: torch.Tensor, B: torch.Tensor, shapeB: Sequence[int], absmax: torch.Tensor, code: torch.Tensor, blocksize: int
) -> torch.Tensor:
    """The pure-PyTorch definition of :func:`gemv_4bit`."""
    check_gemv_4bit(A, B, shapeB, absmax, code, blocksize)
    if is_bnb_cpu_packed(B, shapeB, absmax, blocksize):
        B, absmax = bnb_cpu_packed_to_standard(B, shapeB, absmax)
    w = _dequantize_with_table(B, absmax, blocksize, code.to(A.device), shapeB, A.dtype)
    return torch.nn.functional.linear(A, w)


@gemv_4bit.register_fake
@one_device_fake('gemv_4bit')
def _(A, B, shapeB, absmax, code, blocksize):
    check_gemv_4bit(A, B, shapeB, absmax, code, blocksize)
    return A.new_empty((*A.shape[:-1], shapeB[0]))


define_out_overload("gemv_4bit", f"({_GEMV_4BIT_ARGS}, Tensor! out) -> ()")


# -- 4-bit matrix-matrix (optionally double-quantized absmax, bias) ----------------------------------
def check_gemm_4bit(A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset) -> None:
    """The argument checks of :func:`gemm_4bit` that need no tensor data (shared with its fake)."""
    check_blocksize(blocksize)
    codebook(quant_type)
    _check_4bit_matmul_operands(A, B, shapeB)
    nb = -(-_numel(shapeB) // blocksize)
    if B.numel() * B.element_size() != (_numel(shapeB) + 1) // 2:
        raise ValueError(f"B: expected {(_numel(shapeB) + 1) // 2} packed bytes for shapeB {list(shapeB)}, "
                         f"got {B.numel() * B.element_size()}")
    if absmax_8bit is None:
        if absmax_code is not None or absmax_offset is not None:
            raise ValueError("absmax_code, absmax_offset: only meaningful with absmax_8bit, which is None")
        check_statistic("absmax", absmax, nb, f"one per block of {blocksize}")
    else:
        if absmax_code is None or absmax_offset is None:
            raise ValueError("absmax_code, absmax_offset: required with absmax_8bit")
        if absmax_8bit.dtype != torch.uint8 or absmax_8bit.dim() != 1 or absmax_8bit.numel() != nb:
            raise ValueError(f"absmax_8bit: expected 1-D uint8 codes, one per block of {blocksize} ({nb}), "
                             f"got {absmax_8bit.dtype} {list(absmax_8bit.shape)}")
        check_statistic("absmax", absmax, -(-nb // NESTED_BLOCKSIZE), f"one per {NESTED_BLOCKSIZE} codes of absmax_8bit")
        if absmax_code.dtype != torch.float32 or tuple(absmax_code.shape) != (256,):
            raise ValueError(f"absmax_code: expected the 256 fp32 values of an 8-bit map, got {absmax_code.dtype} {list(absmax_code.shape)}")
        if not absmax_offset.is_floating_point() or absmax_offset.numel() != 1:
            raise ValueError(f"absmax_offset: expected one floating-point value, got {absmax_offset.dtype} {list(absmax_offset.shape)}")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != shapeB[0]:
            raise ValueError(f"bias: expected shape [{shapeB[0]}] (N of shapeB), got {list(bias.shape)}")
        if bias.dtype != A.dtype:
            raise TypeError(f"bias: expected A's dtype {A.dtype}, got {bias.dtype}")


def gemm_4bit_absmax(
    absmax: torch.Tensor, absmax_8bit: torch.Tensor | None, absmax_code: torch.Tensor | None, absmax_offset: torch.Tensor | None
) -> torch.Tensor:
    """fp32 per-block absmax: ``absmax`` widened to fp32, or with ``absmax_8bit`` the
    double-quantized form ``absmax_code[absmax_8bit[i]] * fp32(absmax[i // 256]) + fp32(absmax_offset)``
    in fp32 (``absmax`` then holds the per-256 statistics; :mod:`torchq.blockwise.nested`)."""
    if absmax_8bit is None:
        return fp32_statistic(absmax)
    return double_dequantize(absmax_8bit, fp32_statistic(absmax), absmax_offset.float().reshape(()), absmax_code)


_GEMM_4BIT_SCHEMA = ("(Tensor A, Tensor B, int[] shapeB, Tensor absmax, int blocksize, str quant_type, Tensor? bias=None, "
                     "Tensor? absmax_8bit=None, Tensor? absmax_code=None, Tensor? absmax_offset=None) -> Tensor")


@torch.library.custom_op("torchq::gemm_4bit", mutates_args=(), schema=_GEMM_4BIT_SCHEMA)
def gemm_4bit(
    A: torch.Tensor, B: torch.Tensor, shapeB: Sequence[int], absmax: torch.Tensor, blocksize: int, quant_type: str,
    bias: torch.Tensor | None = None, absmax_8bit: torch.Tensor | None = None, absmax_code: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """``A @ W.T + bias`` in A's dtype for the 4-bit ``[N, K] = shapeB`` weight ``W`` of ``B``
    (``quant_type`` codebook times the per-block absmax, see :func:`gemm_4bit_absmax`; statistics
    fp32, bf16 or fp16, widened to fp32).
    Reference: dequantize in fp32, cast once to A's dtype, ``F.linear``. On the CPU the native
    fused kernel runs instead when built (:mod:`torchq.backends.native_cpu.lut4`). Differentiable in A
    and bias."""
    return gemm_4bit_reference(A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset)


def gemm_4bit_reference(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
                        absmax_offset=None) -> torch.Tensor:
    """The pure-PyTorch definition of :func:`gemm_4bit`."""
    check_gemm_4bit(A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset)
    scale = gemm_4bit_absmax(absmax, absmax_8bit, absmax_code, absmax_offset)
    w = dequantize_4bit(B, scale, blocksize, quant_type, list(shapeB), A.dtype)
    return torch.nn.functional.linear(A, w, bias)


@gemm_4bit.register_fake
@one_device_fake('gemm_4bit')
def _(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None, absmax_offset=None):
    check_gemm_4bit(A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset)
    return A.new_empty((*A.shape[:-1], shapeB[0]))


def _gemm_4bit_setup(ctx, inputs, output) -> None:
    A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset = inputs
    ctx.save_for_backward(B, absmax, absmax_8bit, absmax_code, absmax_offset)
    ctx.meta = (list(shapeB), blocksize, quant_type, bias is not None)


def _gemm_4bit_backward(ctx, grad):
    B, absmax, absmax_8bit, absmax_code, absmax_offset = ctx.saved_tensors
    shapeB, blocksize, quant_type, has_bias = ctx.meta
    grad_a = grad_bias = None
    if ctx.needs_input_grad[0]:
        scale = gemm_4bit_absmax(absmax, absmax_8bit, absmax_code, absmax_offset)
        grad_a = grad @ dequantize_4bit(B, scale, blocksize, quant_type, shapeB, grad.dtype)
    if has_bias and ctx.needs_input_grad[6]:
        grad_bias = grad.reshape(-1, shapeB[0]).sum(0)
    return grad_a, None, None, None, None, None, grad_bias, None, None, None


gemm_4bit.register_autograd(_gemm_4bit_backward, setup_context=_gemm_4bit_setup)


def _check_packed_4bit_storage(B: torch.Tensor) -> None:
    if B.dtype not in (torch.uint8, *_FLOATS):
        raise TypeError(f"B: expected packed bytes stored as uint8, fp32, bf16 or fp16, got {B.dtype}")


def _check_packed_4bit(A, absmax, blocksize, shape, dtype) -> None:
    """Checks of packed 4-bit codes ``A`` (any storage dtype) and their ``absmax`` (fp32, bf16 or
    fp16) against the values' ``shape`` and the output ``dtype`` (metadata only: shared with the fakes)."""
    check_blocksize(blocksize)
    n = _numel(shape)
    nbytes = A.numel() * A.element_size()
    if nbytes != (n + 1) // 2:
        raise ValueError(f"A: expected {(n + 1) // 2} packed bytes for shape {list(shape)}, got {nbytes}")
    check_statistic("absmax", absmax, -(-n // blocksize), f"blocksize {blocksize}")
    if dtype not in _FLOATS:
        raise TypeError(f"dtype: expected fp32, bf16 or fp16, got {dtype}")


def _dequantize_with_table(A, absmax, blocksize, table, shape, dtype):
    _check_packed_4bit(A, absmax, blocksize, shape, dtype)
    n = _numel(shape)
    packed = A.reshape(-1).view(torch.uint8) if A.dtype != torch.uint8 else A.reshape(-1)
    nb = -(-n // blocksize)
    pairs = torch.stack([table.repeat_interleave(16), table.repeat(16)], dim=1)  # byte -> (high, low) values
    values = torch.embedding(pairs, packed.to(torch.int32)).reshape(-1)[:n]  # a row gather: ~2x an element gather
    pad = nb * blocksize - n
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    out = (values.reshape(nb, blocksize) * fp32_statistic(absmax).reshape(nb, 1)).reshape(-1)[:n]
    return out.to(dtype).reshape(tuple(shape))


# -- blockwise_4bit_linear (the layout's op: absmax plain or double-quantized) ---------------------
def check_blockwise_4bit_linear_args(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize,
                                     quant_type, bias) -> None:
    """The argument checks of :func:`blockwise_4bit_linear` (metadata only)."""
    check_op_devices("blockwise_4bit_linear", x, packed=packed, absmax=absmax, nested_codes=nested_codes,
                     nested_absmax=nested_absmax, nested_offset=nested_offset, bias=bias)
    check_blocksize(blocksize)
    if len(shape) != 2:
        raise ValueError(f"shape: expected [N, K], got {list(shape)}")
    n, k = shape
    if x.dtype not in _FLOATS:
        raise TypeError(f"x: expected fp32, bf16 or fp16, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dimension K={k}, got shape {list(x.shape)}")
    if k % blocksize:
        raise ValueError(f"shape: K={k} must be a multiple of blocksize {blocksize}")
    if packed.dtype != torch.uint8 or packed.numel() != n * k // 2:
        raise ValueError(f"packed: expected uint8 with {n * k // 2} bytes for shape {list(shape)}, got {packed.dtype} with {packed.numel()}")
    groups = n * k // blocksize
    if (absmax is None) == (nested_codes is None):
        raise ValueError("absmax, nested_codes: pass exactly one of the plain fp32 absmax and the double-quantized form")
    if absmax is not None and (absmax.dtype != torch.float32 or absmax.numel() != groups):
        raise ValueError(f"absmax: expected fp32 with {groups} entries, got {absmax.dtype} with {absmax.numel()}")
    if nested_codes is not None:
        if nested_absmax is None or nested_offset is None:
            raise ValueError("nested_absmax, nested_offset: required with nested_codes")
        if nested_codes.dtype != torch.uint8 or nested_codes.numel() != groups:
            raise ValueError(f"nested_codes: expected uint8 with {groups} entries, got {nested_codes.dtype} with {nested_codes.numel()}")
        want = -(-groups // NESTED_BLOCKSIZE)
        if nested_absmax.dtype != torch.float32 or nested_absmax.numel() != want:
            raise ValueError(f"nested_absmax: expected fp32 with {want} entries, got {nested_absmax.dtype} with {nested_absmax.numel()}")
        if nested_offset.dtype != torch.float32 or nested_offset.numel() != 1:
            raise ValueError(f"nested_offset: expected one fp32 value, got {nested_offset.dtype} with {nested_offset.numel()}")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias: expected {n} entries, got shape {list(bias.shape)}")


def blockwise_4bit_weight(packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type,
                          dtype: torch.dtype) -> torch.Tensor:
    """The ``[N, K]`` weight in fp32, cast once to ``dtype`` (absmax plain, or double-dequantized)."""
    if absmax is None:
        absmax = double_dequantize(nested_codes.reshape(-1), nested_absmax, nested_offset)
    return dequantize_4bit(packed, absmax.reshape(-1), blocksize, quant_type, list(shape), dtype)


def blockwise_4bit_reference(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type,
                             bias=None) -> torch.Tensor:
    """:func:`blockwise_4bit_linear`'s meaning on checked arguments: the weight in x's dtype, ``F.linear``."""
    w = blockwise_4bit_weight(packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


@torch.library.custom_op("torchq::blockwise_4bit_linear", mutates_args=())
def blockwise_4bit_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor | None,
    nested_codes: torch.Tensor | None,
    nested_absmax: torch.Tensor | None,
    nested_offset: torch.Tensor | None,
    shape: Sequence[int],
    blocksize: int,
    quant_type: str,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` in x's dtype for the ``[N, K]`` NF4 / FP4 weight
    ``W = codebook[nibbles of packed] * absmax`` (bitsandbytes' bytes; ``absmax`` fp32 per block,
    or double-quantized in the three ``nested_*`` tensors; see :mod:`torchq.layouts.blockwise_4bit`).
    Reference: dequantize to fp32, cast once to x's dtype, ``F.linear``. Gradients flow to ``x``
    and ``bias``; the quantized weight is frozen (QLoRA)."""
    check_blockwise_4bit_linear_args(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)
    return blockwise_4bit_reference(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)


@blockwise_4bit_linear.register_fake
def _(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias=None):
    check_op_devices("blockwise_4bit_linear", x, packed=packed, absmax=absmax, nested_codes=nested_codes,
                     nested_absmax=nested_absmax, nested_offset=nested_offset, bias=bias)
    return x.new_empty((*x.shape[:-1], shape[0]))


def _blockwise_4bit_setup(ctx, inputs, output) -> None:
    x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias = inputs
    ctx.save_for_backward(packed, absmax, nested_codes, nested_absmax, nested_offset)
    ctx.meta = (list(shape), blocksize, quant_type, x.dtype, bias is not None, None if bias is None else bias.dtype)


def _blockwise_4bit_backward(ctx, grad):
    packed, absmax, nested_codes, nested_absmax, nested_offset = ctx.saved_tensors
    shape, blocksize, quant_type, x_dtype, has_bias, bias_dtype = ctx.meta
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = blockwise_4bit_weight(packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, grad.dtype)
        grad_x = (grad @ w).to(x_dtype)
    if has_bias and ctx.needs_input_grad[9]:
        grad_bias = grad.reshape(-1, shape[0]).sum(0).to(bias_dtype)
    return grad_x, None, None, None, None, None, None, None, None, grad_bias


blockwise_4bit_linear.register_autograd(_blockwise_4bit_backward, setup_context=_blockwise_4bit_setup)
