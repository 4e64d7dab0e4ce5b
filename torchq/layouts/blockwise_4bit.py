"""``Blockwise4bitLayout``: bitsandbytes' NF4 / FP4 storage, bit for bit.

Holds codebook formats (``spec.codebook`` nf4 or fp4) of a ``[N, K]`` weight with blocks
``(1, B)``, ``B`` a power of two in 32..4096 dividing ``K`` (bitsandbytes' blocks run over the
flattened weight, so they coincide with row groups exactly when ``B`` divides ``K``). Bytes:

* ``packed``  uint8 ``[N, K/2]``: the flattened nibbles, element ``2j`` in the high nibble;
  the same bytes as ``bitsandbytes.functional.quantize_4bit``;
* plain scales: ``absmax`` fp32 ``[N, K/B]``;
* double-quantized scales (``spec.double_quant``): ``nested_codes`` uint8 ``[N, K/B]``,
  ``nested_absmax`` fp32 ``[ceil(N*K/B / 256)]``, ``nested_offset`` fp32 0-d
  (``absmax = DYNAMIC[codes] * nested_absmax[i // 256] + offset``).

Linear: ``torch.ops.torchq.blockwise_4bit_linear`` (:mod:`torchq.ops.blockwise`): the fused
native kernel on the CPU, Triton kernels on CUDA (:mod:`torchq.backends.triton`); gradients flow to the input and
bias through the frozen weight (QLoRA).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..backends import triton as triton_backend
from ..backends.native_cpu import library as native_library
from ..backends.native_cpu.lut4 import TABLES, blockwise_4bit_native_weight, blockwise_linear_cpu, int8_activation_rejects
from ..bitpack import pack_bits, unpack_bits
from ..blockwise.nested import NESTED_BLOCKSIZE
from ..canonical import NestedScale, PlainForm, QuantSpec
from ..dispatch import LinearKernel
from ..ops.blockwise import BLOCK_SIZES
from ..ops.int8act import blockwise_4bit_linear_a8
from ..primitives import ZeroPointDomain
from .base import Buffer, Fit, Layout, LayoutExample, TensorImpl

__all__ = ["Blockwise4bitLayout", "Blockwise4bitImpl"]



class Blockwise4bitImpl(TensorImpl):
    tensor_fields = ("packed", "absmax", "nested_codes", "nested_absmax", "nested_offset")

    def expected_tensors(self) -> dict[str, Buffer | None]:
        spec = self.spec
        reason = self.layout.fit(spec, self.shape, torch.float32, self.device).cannot_hold
        if reason is not None:
            raise ValueError(f"Blockwise4bitImpl: the layout cannot hold {spec.describe()} of shape {list(self.shape)}: {reason}")
        n, k = self.shape
        grid = (n, k // spec.block_size[1])
        nested = spec.double_quant
        return {
            "packed": Buffer((n, k // 2), torch.uint8),
            "absmax": None if nested else Buffer(grid, torch.float32),
            "nested_codes": Buffer(grid, torch.uint8) if nested else None,
            "nested_absmax": Buffer((-(-(grid[0] * grid[1]) // NESTED_BLOCKSIZE),), torch.float32) if nested else None,
            "nested_offset": Buffer((), torch.float32) if nested else None,
        }

    @classmethod
    def from_plain(cls, plain: PlainForm, layout: Layout) -> Blockwise4bitImpl:
        packed = pack_bits(plain.codes, 4)  # K is a multiple of the block (>= 32): [N, K/2], high nibble first
        nq = plain.nested
        return cls(
            layout, plain.spec, plain.shape, packed=packed.contiguous(),
            absmax=None if nq is not None else plain.scale,
            nested_codes=None if nq is None else nq.codes,
            nested_absmax=None if nq is None else nq.absmax,
            nested_offset=None if nq is None else nq.offset,
        )

    def nested(self) -> NestedScale | None:
        if self.nested_codes is None:
            return None
        return NestedScale(self.nested_codes, self.nested_absmax, self.nested_offset)

    def scale(self) -> torch.Tensor:
        """fp32 absmax ``[N, K/B]`` (reconstructed from the double-quantized form if need be)."""
        nq = self.nested()
        return self.absmax if nq is None else nq.dequantize()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.shape
        spec = self.spec
        return torch.ops.torchq.dequantize_4bit(self.packed, self.scale().reshape(-1), spec.block_size[1], spec.codebook, [n, k], dtype)

    def to_plain(self) -> PlainForm:
        n, k = self.shape
        codes = unpack_bits(self.packed, 4, k)
        return PlainForm(codes, self.scale(), None, self.spec, self.nested())

    def plain_rows(self, index: torch.Tensor) -> PlainForm:
        # as to_plain().rows(index): the rows' codes and fp32 absmax (double quantization resolved)
        codes = unpack_bits(self.packed[index], 4, self.shape[1])
        nq = self.nested()
        scale = self.absmax[index] if nq is None else nq.dequantize_rows(index)
        return PlainForm(codes, scale, None, dataclasses.replace(self.spec, double_quant=False))


@dataclass(frozen=True)
class Blockwise4bitLayout(Layout):
    """bitsandbytes-compatible NF4 / FP4 storage (see module doc for the bytes)."""

    name = "blockwise_4bit"
    impl_class = Blockwise4bitImpl
    holds_codebooks = True
    holds_nested_scales = True

    @classmethod
    def linear_kernels(cls):
        return KERNELS

    def fit(self, spec, shape=None, scale_dtype=None, device=None):
        base = super().fit(spec, shape, scale_dtype, device)
        if not base.holds:
            return base
        if spec.codebook not in ("nf4", "fp4"):
            return Fit(f"holds nf4/fp4 codebook formats only, weight is {spec.describe()}")
        if shape is not None and len(shape) != 2:
            return Fit(f"needs a 2-D weight, got shape {shape}")
        b0, b1 = spec.block_size
        if b0 != 1 or b1 not in BLOCK_SIZES:
            return Fit(f"needs blocks (1, B) with B a power of two in 32..4096, got {spec.block_size}")
        if shape is not None and shape[1] % b1:
            return Fit(f"K={shape[1]} is not a multiple of the block size {b1}")
        return base

    @classmethod
    def examples(cls) -> tuple[LayoutExample, ...]:
        none = ZeroPointDomain.NONE
        return (
            LayoutExample(cls(), QuantSpec((1, 64), 0, 15, none, "nf4"), (48, 128)),
            LayoutExample(cls(), QuantSpec((1, 32), 0, 15, none, "fp4"), (33, 96)),
            # 400 scales: two blocks of nested statistics, the second one partial
            LayoutExample(cls(), QuantSpec((1, 64), 0, 15, none, "nf4", double_quant=True), (100, 256)),
            LayoutExample(cls(), QuantSpec((1, 128), 0, 15, none, "fp4", double_quant=True), (31, 256)),
        )


def _check(x: torch.Tensor, w, bias) -> str | None:
    if w.act_quant is not None:
        return f"weight has dynamic activation quantization ({w.act_quant.describe()})"
    if x.device.type != "cpu":
        return triton_backend.cuda_rejects(x)
    return None


def _cached_native_weight(impl: Blockwise4bitImpl) -> native_library.NativeWeight | None:
    tensors = (impl.packed, impl.absmax, impl.nested_codes, impl.nested_absmax)
    if not all(t is None or t.is_contiguous() for t in tensors):
        return None  # pointers into temporary copies cannot be cached
    return blockwise_4bit_native_weight(impl.packed, TABLES[impl.spec.codebook], impl.absmax, impl.nested_codes, impl.nested_absmax,
                         impl.nested_offset, *impl.shape, impl.spec.block_size[1])


def _linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl: Blockwise4bitImpl = w.tensor_impl
    out = native_library.decode_linear(impl, x, bias, _cached_native_weight)
    if out is not None:  # decode-sized, eager CPU: the least Python per call (the nested offset is read by the kernel)
        return out
    spec = impl.spec
    n, k = impl.shape
    args = (impl.packed, impl.absmax, impl.nested_codes, impl.nested_absmax, impl.nested_offset, [n, k], spec.block_size[1],
            spec.codebook, bias)
    if triton_backend.eager_cuda(x):  # the custom-op dispatcher costs more than a decode-sized kernel
        return triton_backend.blockwise_4bit_linear_cuda(x, *args)
    if not native_library.eager_cpu(x):
        return torch.ops.torchq.blockwise_4bit_linear(x, *args)
    # eager CPU: the arguments come from a validated layout, so the op's checks are skipped
    impl.validate()  # cheap next to a prefill; the decode path's pointers were checked when cached
    return blockwise_linear_cpu(x, *args)


def _check_int8_activations(x: torch.Tensor, w, bias) -> str | None:
    return int8_activation_rejects(x, w.act_quant, triton_backend.cuda_rejects)


def _int8_activation_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl: Blockwise4bitImpl = w.tensor_impl
    if native_library.eager_cpu(x) and x.numel() and native_library.library() is not None:
        weight = native_library.weight_args(impl, _cached_native_weight)
        if weight is not None:  # the layout's own tensors, checked when cached
            return native_library.run_linear(weight.int8_activations(), x, bias)
    spec = impl.spec
    op = triton_backend.blockwise_4bit_linear_a8_cuda if triton_backend.eager_cuda(x) else blockwise_4bit_linear_a8
    return op(x, impl.packed, impl.absmax, impl.nested_codes, impl.nested_absmax, impl.nested_offset, list(impl.shape),
              spec.block_size[1], spec.codebook, bias)


KERNELS = (
    LinearKernel(
        "blockwise_4bit_linear",
        _check,
        _linear,
        description="torchq::blockwise_4bit_linear: fused native CPU kernel (unpack + fp32 FMA, no dequantized weight); "
        "Triton dequantize-GEMM / split-K GEMV on CUDA",
        bind=lambda x, w, b: native_library.bind_linear(w.tensor_impl, x, _cached_native_weight),
    ),
    LinearKernel(
        "blockwise_4bit_int8_activations",
        _check_int8_activations,
        _int8_activation_linear,
        description="torchq::blockwise_4bit_linear_a8: activations quantized per 32-block to int8, the codebook as int8, "
        "integer dot products (native CPU); CUDA: Triton int8 tensor cores above 4 rows, the 4-bit GEMV on the "
        "block-dequantized activations up to 4",
        bind=lambda x, w, b: native_library.bind_linear(w.tensor_impl, x, _cached_native_weight, int8_activations=True),
    ),
)
