"""Activation input and output of the native linears: the C library reads x in its own
dtype (fp32, bf16, fp16) and writes the output in that dtype, so no Python-side casts or pads run.

* the conversions (``tq_to_f32`` / ``tq_from_f32``) agree with torch's ``.to()`` bit for bit:
  exhaustively for every bf16 and fp16 bit pattern widened to fp32, and for fp32 values narrowed
  to bf16 / fp16 (ties, subnormals, the fp16 overflow threshold, inf, NaN), on every ISA;
* every native linear gives the same result for a strided or batched input as for its
  contiguous 2-D copy, and the native output equals the fp32 native output rounded once.
"""

from __future__ import annotations

import copy
import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_blockwise import ISAS, needs_native

import torchq
from torchq import native
from torchq.backends.native_cpu import library as native_library

pytestmark = needs_native
HALVES = [torch.bfloat16, torch.float16]


def to_f32(bits16: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(bits16.numel(), dtype=torch.float32)
    src = bits16.contiguous()
    native_library.check(native_library.library().tq_to_f32(src.data_ptr(), native_library.DTYPE_CODES[dtype], src.numel(), out.data_ptr()), "to_f32")
    return out


def from_f32(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=dtype)
    src = x.contiguous()
    native_library.check(native_library.library().tq_from_f32(src.data_ptr(), src.numel(), native_library.DTYPE_CODES[dtype], out.data_ptr()), "from_f32")
    return out


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, except that any NaN matches any NaN (payloads are not part of torch's contract)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    ai, bi = (t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) for t in (a, b))
    return torch.equal(ai[~nan], bi[~nan])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_every_16_bit_pattern_widens_as_torch_does(isa, dtype):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    ours = to_f32(bits, dtype)
    assert same_values(ours, bits.view(dtype).to(torch.float32))


def _edge_fp32() -> torch.Tensor:
    vals = [0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.996, 65520.0, 65536.0, 1e30,
            2.0**-14, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26, 3 * 2.0**-25, 5.96e-8, 6.1e-5, 1e-45, 3.4e38]
    ties = [1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-20 * (1 + 2**-1)]
    t = torch.tensor(vals + ties, dtype=torch.float32)
    # every fp32 neighbour of each edge value, both signs
    near = torch.cat([t, torch.nextafter(t, torch.full_like(t, float("inf"))), torch.nextafter(t, torch.full_like(t, -float("inf")))])
    return torch.cat([near, -near])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_edge_values_narrow_as_torch_does(isa, dtype):
    x = _edge_fp32()
    assert same_values(from_f32(x, dtype), x.to(dtype))


@settings(max_examples=40, deadline=None)
@given(bits=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=300), dtype=st.sampled_from(HALVES),
       isa=st.sampled_from(ISAS))
def test_random_fp32_bit_patterns_narrow_as_torch_does(bits, dtype, isa):
    x = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    saved = native.status().isa
    native.set_isa(isa)
    try:
        assert same_values(from_f32(x, dtype), x.to(dtype))
    finally:
        native.set_isa(saved)


def test_conversion_hooks_reject_bad_arguments():
    lib = native_library.library()
    buf = (ctypes.c_float * 4)()
    assert lib.tq_to_f32(ctypes.addressof(buf), 7, 4, ctypes.addressof(buf)) == 1
    assert lib.tq_from_f32(ctypes.addressof(buf), -1, 0, ctypes.addressof(buf)) == 1
    assert lib.tq_to_f32(None, 1, 0, None) == 0  # zero elements need no buffers


# -- every native linear reads strided / batched inputs and writes its own dtype -----------------

CONFIGS = {
    "int4": lambda: torchq.int4_weight_only(group_size=64),
    "nf4": lambda: torchq.nf4_weight_only(block_size=64),
    "int8wo": lambda: torchq.int8_weight_only(),
    "int8dq": lambda: torchq.int8_dynamic_activation_int8_weight(),
}


def quantized(cfg: str, k: int, n: int, dtype: torch.dtype, bias: bool) -> torch.nn.Linear:
    lin = torch.nn.Linear(k, n, bias=bias).to(dtype)
    torchq.quantize_(lin, CONFIGS[cfg]())
    return lin


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, *HALVES], ids=str)
@pytest.mark.parametrize("m", [1, 3])
def test_strided_and_batched_inputs_match_the_contiguous_call(cfg, dtype, m):
    k, n = 160 if cfg != "nf4" else 192, 37
    lin = quantized(cfg, k, n, dtype, bias=True)
    wide = torch.randn(m, 2 * k).to(dtype)
    strided = wide[:, :k]  # row stride 2K: not contiguous
    assert m == 1 or not strided.is_contiguous()
    with torch.no_grad():
        ref = lin(strided.contiguous())
        assert ref.dtype == dtype and ref.is_contiguous()
        assert torch.equal(lin(strided), ref)
        batched = strided.contiguous().reshape(1, m, 1, k)
        assert torch.equal(lin(batched), ref.reshape(1, m, 1, n))
        transposed = strided.contiguous().t().contiguous().t()  # column-major [m, k]
        assert torch.equal(lin(transposed), ref)


@pytest.mark.parametrize("cfg", ["int4", "nf4", "int8wo"])
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_half_outputs_are_the_fp32_result_rounded_once(cfg, dtype):
    """The kernels accumulate in fp32 and round once: feeding the (exactly widened) input as fp32
    must give the same fp32 sums, which rounded to the dtype equal the half-precision output."""
    k, n = 256, 19
    lin = quantized(cfg, k, n, dtype, bias=True)
    x = torch.randn(2, k).to(dtype)
    with torch.no_grad():
        half = lin(x)
        lin32 = copy.deepcopy(lin)
        lin32.weight = torch.nn.Parameter(lin.weight.to(torch.float32), requires_grad=False)
        lin32.bias = torch.nn.Parameter(lin.bias.to(torch.float32))  # exact; a bias must match x's dtype, as in F.linear
        full = lin32(x.to(torch.float32))
    assert same_values(half, full.to(dtype))


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_copy_into_a_weight_after_calls_is_seen_by_the_cached_decode_path(cfg):
    """The decode path caches the weight's pointers per layout impl: loading new values into the
    weight in place (``copy_``, as ``load_state_dict`` does) must change the next call's result."""
    a, b = quantized(cfg, 128, 24, torch.float32, bias=False), quantized(cfg, 128, 24, torch.float32, bias=False)
    x = torch.randn(1, 128)
    with torch.no_grad():
        before = a(x)
        assert not torch.equal(before, b(x))
        a.load_state_dict(b.state_dict())
        assert torch.equal(a(x), b(x))
