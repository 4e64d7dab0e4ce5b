"""torch.ops.torchq implements bitsandbytes' op set: the same schemas (so code written against
``torch.ops.bitsandbytes`` runs after renaming the namespace), opcheck-clean, with values equal to
the default overloads / pure-PyTorch references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import torchq  # noqa: F401  (registers torch.ops.torchq.*)
from torchq.blockwise import codebook, dynamic_map
from torchq.blockwise.nested import double_quantize
from torchq.ops.blockwise import gemm_4bit_reference, gemv_4bit_reference

ops = torch.ops.torchq
FLOATS = [torch.float32, torch.bfloat16, torch.float16]

# Every schema declared in bitsandbytes/_ops.py (bitsandbytes-foundation/bitsandbytes at commit
# 95f9af309d4d5793847169c39288dcd3fcbdf564, 2026-08-19), except the two optimizer updates
# (optimizer_update_32bit / optimizer_update_8bit_blockwise), which torchq does not implement.
BNB_SCHEMAS = {
    "int8_mixed_scaled_mm": "(Tensor A, Tensor CA, Tensor CB, Tensor SCA, Tensor SCB, Tensor? outlier_cols=None, "
                            "Tensor? bias=None) -> (Tensor, Tensor?)",
    "int8_scaled_mm": "(Tensor A, Tensor B, Tensor row_stats, Tensor col_stats, Tensor? bias=None, ScalarType? dtype=None) -> Tensor",
    "int8_linear_matmul": "(Tensor A, Tensor B) -> Tensor",
    "int8_linear_matmul.out": "(Tensor A, Tensor B, Tensor! out) -> ()",
    "int8_vectorwise_quant": "(Tensor A, float threshold=0.0) -> (Tensor, Tensor, Tensor?)",
    "int8_vectorwise_dequant": "(Tensor A, Tensor stats) -> Tensor",
    "int8_mm_dequant": "(Tensor A, Tensor row_stats, Tensor col_stats, ScalarType? dtype=None, Tensor? bias=None) -> Tensor",
    "int8_double_quant": "(Tensor A, float threshold=0.0) -> (Tensor, Tensor, Tensor, Tensor, Tensor?)",
    "dequantize_4bit": "(Tensor A, Tensor absmax, int blocksize, str quant_type, int[] shape, ScalarType dtype) -> Tensor",
    "dequantize_4bit.out": "(Tensor A, Tensor absmax, int blocksize, str quant_type, int[] shape, ScalarType dtype, Tensor! out) -> ()",
    "quantize_4bit": "(Tensor A, int blocksize, str quant_type, ScalarType quant_storage) -> (Tensor, Tensor)",
    "gemm_4bit": "(Tensor A, Tensor B, int[] shapeB, Tensor absmax, int blocksize, str quant_type, Tensor? bias=None, "
                 "Tensor? absmax_8bit=None, Tensor? absmax_code=None, Tensor? absmax_offset=None) -> Tensor",
    "dequantize_blockwise": "(Tensor A, Tensor absmax, Tensor code, int blocksize, ScalarType dtype) -> Tensor",
    "dequantize_blockwise.out": "(Tensor A, Tensor absmax, Tensor code, int blocksize, ScalarType dtype, Tensor! out) -> ()",
    "quantize_blockwise": "(Tensor A, Tensor code, int blocksize) -> (Tensor, Tensor)",
    "gemv_4bit": "(Tensor A, Tensor B, int[] shapeB, Tensor absmax, Tensor code, int blocksize) -> Tensor",
    "gemv_4bit.out": "(Tensor A, Tensor B, int[] shapeB, Tensor absmax, Tensor code, int blocksize, Tensor! out) -> ()",
}
ALIASES = {"int8_linear_dequant": "int8_scaled_mm"}  # torchq's older name -> the bitsandbytes op it equals


def overload(name: str) -> torch._ops.OpOverload:
    op, _, over = name.partition(".")
    return getattr(getattr(ops, op), over or "default")


@pytest.mark.parametrize("name", [*BNB_SCHEMAS, *ALIASES])
def test_schema_is_bitsandbytes(name):
    bnb_name = ALIASES.get(name, name)
    want = torch._C.parse_schema(f"torchq::{name}{BNB_SCHEMAS[bnb_name]}")
    got = overload(name)._schema
    assert str(got) == str(want)  # str tells int from SymInt, which == does not


def weight_4bit(n: int, k: int, blocksize: int, quant_type: str, storage=torch.uint8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    packed, absmax = ops.quantize_4bit(w, blocksize, quant_type, storage)
    return packed, absmax


def int8_pair(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return a, b


# -- LLM.int8 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("threshold", [0.0, 3.0])
def test_int8_vectorwise_quant(dtype, threshold):
    a = torch.randn(7, 13).clamp(-2, 2).to(dtype)
    a[2, 5] = 10.0
    codes, stats, cols = ops.int8_vectorwise_quant(a, threshold)
    assert codes.dtype == torch.int8 and stats.shape == (7,)
    assert (cols is None) == (threshold == 0.0)
    if cols is not None:
        assert cols.tolist() == [5] and not codes[:, 5].any()
    opcheck(ops.int8_vectorwise_quant.default, (a, threshold))


@pytest.mark.parametrize("shape", [(2, 3, 8), (4, 1, 2, 8), (8,)])
@pytest.mark.parametrize("threshold", [0.0, 3.0])
def test_int8_row_stats_are_one_per_row_for_any_rank(shape, threshold):
    # bitsandbytes' contract: codes keep A's shape, row_stats is 1-D [numel / K] whatever A's rank
    a = torch.randn(shape).clamp(-2, 2)
    a.reshape(-1, shape[-1])[0, 3] = 9.0
    rows = a.numel() // shape[-1]
    codes, stats, _ = ops.int8_vectorwise_quant(a, threshold)
    flat_codes, flat_stats, _ = ops.int8_vectorwise_quant(a.reshape(rows, shape[-1]), threshold)
    assert codes.shape == shape and stats.shape == (rows,)
    assert torch.equal(codes.reshape(rows, -1), flat_codes) and torch.equal(stats, flat_stats)
    double = ops.int8_double_quant(a, threshold)
    assert double[0].shape == double[1].shape == shape and double[2].shape == (rows,) and double[3].shape == (shape[-1],)
    for op in (ops.int8_vectorwise_quant.default, ops.int8_double_quant.default):
        opcheck(op, (a, threshold))
    compiled = torch.compile(lambda x: ops.int8_vectorwise_quant(x, threshold)[1], fullgraph=True)
    assert torch.equal(compiled(a), stats)
    assert torch.equal(ops.int8_vectorwise_dequant(codes, stats).reshape(rows, -1), ops.int8_vectorwise_dequant(flat_codes, flat_stats))


def test_int8_vectorwise_dequant():
    codes, stats, _ = ops.int8_vectorwise_quant(torch.randn(5, 9))
    opcheck(ops.int8_vectorwise_dequant.default, (codes, stats))
    assert torch.equal(ops.int8_vectorwise_dequant(codes, stats), codes.float() * stats[:, None] / 127)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("threshold", [0.0, 3.0])
def test_int8_double_quant(dtype, threshold):
    a = torch.randn(6, 11).clamp(-2, 2).to(dtype)
    a[0, 4], a[1, 4] = 1.0, -9.0
    row_codes, col_codes, row_stats, col_stats, cols = ops.int8_double_quant(a, threshold)
    want_rows = ops.int8_vectorwise_quant(a, threshold)
    assert torch.equal(row_codes, want_rows[0]) and torch.equal(row_stats, want_rows[1])
    assert (cols is None) == (threshold == 0.0)
    # the columns: row-wise quantization of the transpose, with the outlier elements (only) set to 0
    kept = a.float().masked_fill(a.float().abs() >= threshold, 0.0) if threshold else a.float()
    want_cols, want_col_stats, _ = ops.int8_vectorwise_quant(kept.t().contiguous())
    assert torch.equal(col_codes, want_cols.t()) and torch.equal(col_stats, want_col_stats)
    if threshold:
        assert col_codes[1, 4] == 0 and col_codes[0, 4] != 0
    opcheck(ops.int8_double_quant.default, (a, threshold))


@pytest.mark.parametrize("m, n, k", [(10, 30, 20), (3, 7, 1), (1, 5, 33)])
def test_int8_linear_matmul_and_out(m, n, k):
    a, b = int8_pair(m, n, k)
    want = a.long() @ b.long().t()
    got = ops.int8_linear_matmul(a, b)
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    out = torch.full((m, n), -1, dtype=torch.int32)
    assert ops.int8_linear_matmul.out(a, b, out) is None
    assert torch.equal(out, got)
    opcheck(ops.int8_linear_matmul.default, (a, b))
    opcheck(ops.int8_linear_matmul.out, (a, b, out))


def test_int8_mm_dequant():
    c = ops.int8_linear_matmul(*int8_pair(9, 12, 16))
    rs, cs = torch.rand(9) * 3, torch.rand(12) * 3
    for args in [(c, rs, cs), (c, rs, cs, torch.bfloat16, torch.randn(12))]:
        opcheck(ops.int8_mm_dequant.default, args)
    want = (c.float() * (rs[:, None] * cs[None, :]) / 127**2).half()
    assert torch.equal(ops.int8_mm_dequant(c, rs, cs), want)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("has_bias", [False, True])
def test_int8_scaled_mm_and_alias(dtype, has_bias):
    a, b = int8_pair(10, 30, 20)
    rs, cs = torch.rand(10) * 2, torch.rand(30) * 2
    bias = torch.randn(30).to(dtype) if has_bias else None
    want = ops.int8_mm_dequant(ops.int8_linear_matmul(a, b), rs, cs, dtype, bias)
    got = ops.int8_scaled_mm(a, b, rs, cs, bias=bias, dtype=dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(ops.int8_linear_dequant(a, b, rs, cs, bias, dtype), want)
    opcheck(ops.int8_scaled_mm.default, (a, b, rs, cs, bias, dtype))
    assert ops.int8_scaled_mm(a, b, rs, cs).dtype == torch.float16


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("outliers", [True, False])
def test_int8_mixed_scaled_mm(dtype, outliers):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=g).clamp(-2, 2).to(dtype)
    if outliers:
        x[0, 3], x[4, 17] = 8.0, -7.0
    w = torch.randn(12, 32, generator=g)
    bias = torch.randn(12, generator=g).to(dtype)
    ca, sca, cols = ops.int8_vectorwise_quant(x, 3.0)
    cb, scb, _ = ops.int8_vectorwise_quant(w)
    out, sub_a = ops.int8_mixed_scaled_mm(x, ca, cb, sca, scb, cols, bias)
    assert out.dtype == dtype and out.shape == (5, 12)
    assert cols.tolist() == ([3, 17] if outliers else [])
    assert torch.equal(sub_a, x[:, cols])
    # the int8 part is int8_scaled_mm; the outlier columns add their product in A's dtype
    int8_part = ops.int8_scaled_mm(ca, cb, sca, scb, bias, dtype)
    if not outliers:
        assert torch.equal(out, int8_part)
    w_cols = ops.int8_vectorwise_dequant(cb, scb)[:, cols]
    want = int8_part.float() + x[:, cols].float() @ w_cols.t()
    torch.testing.assert_close(out.float(), want, atol=0.05, rtol=0.02)
    torch.testing.assert_close(out.float(), x.float() @ w.t() + bias.float(), atol=0.3, rtol=0.05)  # vs the float linear
    no_cols, sub_none = ops.int8_mixed_scaled_mm(x, ca, cb, sca, scb)
    assert sub_none.shape == (5, 0) and torch.equal(no_cols, ops.int8_scaled_mm(ca, cb, sca, scb, None, dtype))
    opcheck(ops.int8_mixed_scaled_mm.default, (x, ca, cb, sca, scb, cols, bias))


# -- blockwise --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_quantize_dequantize_4bit_and_out(dtype, quant_type):
    a = torch.randn(7, 63).to(dtype)  # odd numel, blocks cross rows
    packed, absmax = ops.quantize_4bit(a, 64, quant_type, torch.uint8)
    assert packed.shape == ((7 * 63 + 1) // 2, 1) and absmax.shape == (7,)
    opcheck(ops.quantize_4bit.default, (a, 64, quant_type, torch.uint8))
    got = ops.dequantize_4bit(packed, absmax, 64, quant_type, [7, 63], dtype)
    assert got.shape == (7, 63) and got.dtype == dtype
    out = torch.empty(7, 63, dtype=dtype)
    assert ops.dequantize_4bit.out(packed, absmax, 64, quant_type, [7, 63], dtype, out) is None
    assert torch.equal(out, got)
    opcheck(ops.dequantize_4bit.default, (packed, absmax, 64, quant_type, [7, 63], dtype))
    opcheck(ops.dequantize_4bit.out, (packed, absmax, 64, quant_type, [7, 63], dtype, out))


@pytest.mark.parametrize("dtype", FLOATS)
def test_quantize_dequantize_blockwise_and_out(dtype):
    a = torch.randn(5, 77).to(dtype)
    code = dynamic_map()
    q, absmax = ops.quantize_blockwise(a, code, 128)
    opcheck(ops.quantize_blockwise.default, (a, code, 128))
    got = ops.dequantize_blockwise(q, absmax, code, 128, dtype)
    out = torch.empty(5, 77, dtype=dtype)
    assert ops.dequantize_blockwise.out(q, absmax, code, 128, dtype, out) is None
    assert torch.equal(out, got)
    opcheck(ops.dequantize_blockwise.default, (q, absmax, code, 128, dtype))
    opcheck(ops.dequantize_blockwise.out, (q, absmax, code, 128, dtype, out))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.filterwarnings("ignore::torchq.native.NativeMissingWarning")
@pytest.mark.parametrize("n, k", [(24, 128), (9, 96)])  # K = 96: blocks of 64 cross rows (reference path on the CPU)
def test_gemv_4bit_and_out(dtype, n, k):
    packed, absmax = weight_4bit(n, k, 64, "nf4")
    code = codebook("nf4")
    a = torch.randn(1, 1, k).to(dtype)
    got = ops.gemv_4bit(a, packed, [n, k], absmax, code, 64)
    assert got.shape == (1, 1, n) and got.dtype == dtype
    torch.testing.assert_close(got, gemv_4bit_reference(a, packed, [n, k], absmax, code, 64), atol=2e-2, rtol=2e-2)
    out = torch.empty(1, 1, n, dtype=dtype)
    assert ops.gemv_4bit.out(a, packed, [n, k], absmax, code, 64, out) is None
    assert torch.equal(out, got)
    opcheck(ops.gemv_4bit.default, (a, packed, [n, k], absmax, code, 64))
    opcheck(ops.gemv_4bit.out, (a, packed, [n, k], absmax, code, 64, out))


def nested_args(absmax: torch.Tensor) -> dict:
    codes, absmax2, offset = double_quantize(absmax)
    return {"absmax": absmax2, "absmax_8bit": codes, "absmax_code": dynamic_map(), "absmax_offset": offset}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("has_bias", [False, True])
def test_gemm_4bit(dtype, quant_type, nested, has_bias):
    n, k, bs = 40, 128, 64
    packed, absmax = weight_4bit(n, k, bs, quant_type, seed=3)
    a = torch.randn(2, 3, k).to(dtype)
    bias = torch.randn(n).to(dtype) if has_bias else None
    scales = nested_args(absmax) if nested else {"absmax": absmax}
    absmax_arg = scales.pop("absmax")
    got = ops.gemm_4bit(a, packed, [n, k], absmax_arg, bs, quant_type, bias=bias, **scales)
    assert got.shape == (2, 3, n) and got.dtype == dtype
    ref = gemm_4bit_reference(a, packed, [n, k], absmax_arg, bs, quant_type, bias, **scales)
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=2e-2)
    # on the CPU gemm_4bit is blockwise_4bit_linear (same kernel, same bits) under bitsandbytes' schema
    nq = (scales["absmax_8bit"], absmax_arg, scales["absmax_offset"]) if nested else (None, None, None)
    linear = ops.blockwise_4bit_linear(a, packed, None if nested else absmax, *nq, [n, k], bs, quant_type, bias)
    assert torch.equal(got, linear)
    if has_bias == nested:  # half the cases (each dtype and quant_type, with and without both options) keeps the file fast
        opcheck(ops.gemm_4bit.default, (a, packed, [n, k], absmax_arg, bs, quant_type), {"bias": bias, **scales})


@pytest.mark.filterwarnings("ignore::torchq.native.NativeMissingWarning")
def test_gemm_4bit_quirks():
    n, k = 16, 96  # K not a multiple of the blocksize: the reference path, bit for bit
    packed, absmax = weight_4bit(n, k, 64, "nf4", storage=torch.bfloat16)  # bitsandbytes' quant_storage views
    a = torch.randn(3, k, dtype=torch.bfloat16)
    got = ops.gemm_4bit(a, packed, [n, k], absmax, 64, "nf4")
    assert torch.equal(got, gemm_4bit_reference(a, packed, [n, k], absmax, 64, "nf4"))
    # a bf16 / fp16 offset (a pre-quantized checkpoint) means its value in fp32
    scales = nested_args(absmax)
    absmax2 = scales.pop("absmax")
    off = scales.pop("absmax_offset").to(torch.bfloat16)
    want = ops.gemm_4bit(a, packed, [n, k], absmax2, 64, "nf4", absmax_offset=off.float(), **scales)
    assert torch.equal(ops.gemm_4bit(a, packed, [n, k], absmax2, 64, "nf4", absmax_offset=off, **scales), want)
    # another 8-bit map: absmax is dequantized first (map / 2 with statistics * 2: the same values, bits)
    packed2, plain = weight_4bit(32, 128, 64, "nf4")
    x = torch.randn(2, 128, dtype=torch.float16)
    scales2 = nested_args(plain)
    stats = scales2.pop("absmax")
    standard = ops.gemm_4bit(x, packed2, [32, 128], stats, 64, "nf4", **scales2)
    scales2["absmax_code"] = dynamic_map() / 2
    assert torch.equal(ops.gemm_4bit(x, packed2, [32, 128], stats * 2, 64, "nf4", **scales2), standard)
    with pytest.raises(ValueError, match="absmax_code, absmax_offset: required"):
        ops.gemm_4bit(a, packed, [n, k], absmax2, 64, "nf4", absmax_8bit=scales["absmax_8bit"])
    with pytest.raises(TypeError, match="bias: expected A's dtype"):
        ops.gemm_4bit(a, packed, [n, k], absmax, 64, "nf4", bias=torch.zeros(n))
    with pytest.raises(ValueError, match="quant_type"):
        ops.gemm_4bit(a, packed, [n, k], absmax, 64, "int4")


def test_gemm_4bit_autograd():
    n, k = 24, 64
    packed, absmax = weight_4bit(n, k, 32, "fp4")
    w = ops.dequantize_4bit(packed, absmax, 32, "fp4", [n, k], torch.float32)
    a = torch.randn(4, k, requires_grad=True)
    bias = torch.randn(n, requires_grad=True)
    a_ref, bias_ref = a.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    grad = torch.randn(4, n)
    ops.gemm_4bit(a, packed, [n, k], absmax, 32, "fp4", bias=bias).backward(grad)
    torch.nn.functional.linear(a_ref, w, bias_ref).backward(grad)
    torch.testing.assert_close(a.grad, a_ref.grad)
    torch.testing.assert_close(bias.grad, bias_ref.grad)
    opcheck(ops.gemm_4bit.default, (a, packed, [n, k], absmax, 32, "fp4"), {"bias": bias})


# -- .out: checks and torch.compile -----------------------------------------------------------------
def out_calls():
    """(overload name, inputs, correct out) of every .out overload."""
    packed, absmax = weight_4bit(8, 64, 64, "nf4")
    q, qabsmax = ops.quantize_blockwise(torch.randn(3, 40), dynamic_map(), 64)
    a, b = int8_pair(4, 6, 8)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    return [
        ("int8_linear_matmul.out", (a, b), torch.empty(4, 6, dtype=torch.int32)),
        ("dequantize_4bit.out", (packed, absmax, 64, "nf4", [8, 64], torch.float16), torch.empty(8, 64, dtype=torch.float16)),
        ("dequantize_blockwise.out", (q, qabsmax, dynamic_map(), 64, torch.float32), torch.empty(3, 40)),
        ("gemv_4bit.out", (x, packed, [8, 64], absmax, codebook("nf4"), 64), torch.empty(2, 8, dtype=torch.bfloat16)),
    ]


@pytest.mark.parametrize("index", range(4))
def test_out_is_checked(index):
    name, inputs, out = out_calls()[index]
    op = overload(name)
    wrong_shape = out.new_zeros((out.shape[0] + 1, *out.shape[1:]))
    wrong_dtype = out.to(torch.float64)
    with pytest.raises(ValueError, match=rf"torchq::{name}: out: expected shape \[{out.shape[0]}, {out.shape[1]}\], got \["):
        op(*inputs, wrong_shape)
    assert not wrong_shape.any()  # left untouched
    with pytest.raises(TypeError, match=rf"out: expected dtype {out.dtype}, got torch.float64"):
        op(*inputs, wrong_dtype)
    with pytest.raises(ValueError, match="out: expected device cpu, got meta"):
        op(*inputs, out.to("meta"))
    # the fake kernel (meta tensors, as under torch.compile) checks the same
    meta_inputs = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs]
    op(*meta_inputs, out.to("meta"))
    with pytest.raises(ValueError, match=rf"torchq::{name}: out: expected shape"):
        op(*meta_inputs, wrong_shape.to("meta"))


def test_out_overloads_compile_fullgraph():
    calls = out_calls()

    def run_all(outs):
        for (name, inputs, _), out in zip(calls, outs, strict=True):
            overload(name)(*inputs, out)
        return outs

    outs = [out.zero_() for _, _, out in calls]
    torch.compile(run_all, fullgraph=True, backend="aot_eager")(outs)
    for (name, inputs, _), out in zip(calls, outs, strict=True):
        assert torch.equal(out, overload(name.removesuffix(".out"))(*inputs)), name


def test_gemm_4bit_compiles_fullgraph():
    packed, absmax = weight_4bit(16, 64, 32, "nf4")
    a = torch.randn(3, 64)
    fn = torch.compile(lambda x: ops.gemm_4bit(x, packed, [16, 64], absmax, 32, "nf4"), fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(a), ops.gemm_4bit(a, packed, [16, 64], absmax, 32, "nf4"))


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 70), blocksize=st.sampled_from([32, 64, 128]),
       quant_type=st.sampled_from(["nf4", "fp4"]), dtype=st.sampled_from(FLOATS))
def test_dequantize_out_equals_default(rows, cols, blocksize, quant_type, dtype):
    a = torch.randn(rows, cols)
    packed, absmax = ops.quantize_4bit(a, blocksize, quant_type, torch.uint8)
    out = torch.empty(rows, cols, dtype=dtype)
    ops.dequantize_4bit.out(packed, absmax, blocksize, quant_type, [rows, cols], dtype, out)
    assert torch.equal(out, ops.dequantize_4bit(packed, absmax, blocksize, quant_type, [rows, cols], dtype))
    q, qabsmax = ops.quantize_blockwise(a, dynamic_map(), blocksize)
    ops.dequantize_blockwise.out(q, qabsmax, dynamic_map(), blocksize, dtype, out)
    assert torch.equal(out, ops.dequantize_blockwise(q, qabsmax, dynamic_map(), blocksize, dtype))


# -- a bitsandbytes-style test body, given the ops namespace ----------------------------------------
def bitsandbytes_style_body(ns) -> None:
    """Calls as bitsandbytes' own op tests make them (positional and keyword arguments by
    bitsandbytes' names), against the namespace ``ns``."""
    a, b = int8_pair(10, 30, 20)
    out = torch.empty((10, 30), dtype=torch.int32)
    ns.int8_linear_matmul.out(a, b, out)
    assert torch.equal(out, ns.int8_linear_matmul.default(a, b))
    row_stats, col_stats = torch.rand(10), torch.rand(30)
    y = ns.int8_scaled_mm(a, b, row_stats, col_stats, bias=torch.randn(30, dtype=torch.bfloat16), dtype=torch.bfloat16)
    assert y.shape == (10, 30) and y.dtype == torch.bfloat16
    assert ns.int8_mm_dequant(ns.int8_linear_matmul(a, b), row_stats, col_stats).dtype == torch.float16
    x = torch.randn(10, 20).clamp(-2, 2).half()
    x[1][0] = 1000.0
    out_row, stats, outlier_cols = ns.int8_vectorwise_quant(x, threshold=6.0)
    assert out_row.shape == (10, 20) and stats.shape == (10,) and outlier_cols.tolist() == [0]
    assert ns.int8_vectorwise_dequant(out_row, stats).dtype == torch.float32
    ca, cat, sca, scat, cols = ns.int8_double_quant(x, threshold=6.0)
    assert cat.shape == (10, 20) and scat.shape == (20,)
    w = torch.randn(30, 20, dtype=torch.float16)
    cb, scb, _ = ns.int8_vectorwise_quant(w)
    out, sub_a = ns.int8_mixed_scaled_mm(x, ca, cb, sca, scb, outlier_cols=cols, bias=None)
    assert out.shape == (10, 30) and out.dtype == torch.float16

    code = dynamic_map()
    m = torch.randn(64, 64, dtype=torch.bfloat16)
    q, absmax = ns.quantize_blockwise(m, code, 256)
    assert q.dtype == torch.uint8 and absmax.shape == (16,)
    deq = torch.empty_like(m)
    ns.dequantize_blockwise.out(q, absmax, code, 256, torch.bfloat16, deq)
    assert torch.equal(deq, ns.dequantize_blockwise.default(q, absmax, code, 256, torch.bfloat16))

    w4 = torch.randn(32, 64, dtype=torch.float16)
    packed, absmax = ns.quantize_4bit.default(w4, 64, "nf4", torch.bfloat16)
    assert packed.shape == (32 * 64 // 4, 1) and packed.dtype == torch.bfloat16
    dq = ns.dequantize_4bit.default(packed, absmax, 64, "nf4", w4.shape, torch.float16)
    assert dq.shape == w4.shape
    inp = torch.randn(1, 1, 64, dtype=torch.float16)
    v = ns.gemv_4bit.default(inp, packed, w4.shape, absmax, codebook("nf4"), 64)
    assert v.shape == (1, 1, 32)
    g = ns.gemm_4bit.default(inp, packed, list(w4.shape), absmax, 64, "nf4", bias=None)
    assert torch.equal(g, v)
    codes, absmax2, offset = double_quantize(absmax)
    g2 = ns.gemm_4bit.default(inp, packed, list(w4.shape), absmax2, 64, "nf4", absmax_8bit=codes, absmax_code=code,
                              absmax_offset=offset)
    torch.testing.assert_close(g2, g, atol=5e-2, rtol=5e-2)
    opcheck(ns.gemm_4bit.default, (inp, packed, list(w4.shape), absmax, 64, "nf4"), kwargs={"bias": None})


def test_bitsandbytes_style_body_runs_on_torchq():
    bitsandbytes_style_body(torch.ops.torchq)


def _u8(*shape, device):
    return torch.zeros(shape, dtype=torch.uint8, device=device)


# Invalid calls that bitsandbytes' fakes reject as well (its _ops.py torch._check's), plus torchq's
# size checks; each builds its arguments on a given device.
INVALID_CALLS = {
    "quantize_4bit quant_type": ("quantize_4bit", lambda d: (torch.randn(8, 8, device=d), 64, "int4", torch.uint8)),
    "quantize_4bit A dtype": ("quantize_4bit", lambda d: (torch.ones(8, 8, dtype=torch.int32, device=d), 64, "nf4", torch.uint8)),
    "quantize_4bit storage": ("quantize_4bit", lambda d: (torch.randn(1, 6, device=d), 64, "nf4", torch.float32)),
    "dequantize_4bit blocksize": ("dequantize_4bit", lambda d: (_u8(32, 1, device=d), torch.ones(1, device=d), 48, "nf4", [8, 8], torch.float16)),
    "dequantize_4bit quant_type": ("dequantize_4bit", lambda d: (_u8(32, 1, device=d), torch.ones(1, device=d), 64, "af4", [8, 8], torch.float16)),
    # absmax: fp32, bf16 or fp16 (widened to fp32); fp64 is refused (tests/test_bnb_absmax_dtypes.py)
    "dequantize_4bit absmax dtype": ("dequantize_4bit", lambda d: (_u8(32, 1, device=d), torch.ones(1, dtype=torch.float64, device=d), 64, "nf4", [8, 8], torch.float16)),
    "dequantize_4bit dtype": ("dequantize_4bit", lambda d: (_u8(32, 1, device=d), torch.ones(1, device=d), 64, "nf4", [8, 8], torch.int32)),
    "dequantize_4bit bytes": ("dequantize_4bit", lambda d: (_u8(31, 1, device=d), torch.ones(1, device=d), 64, "nf4", [8, 8], torch.float32)),
    "quantize_blockwise A dtype": ("quantize_blockwise", lambda d: (torch.ones(8, 8, dtype=torch.int32, device=d), dynamic_map().to(d), 64)),
    "dequantize_blockwise A dtype": ("dequantize_blockwise", lambda d: (torch.zeros(8, 8, device=d), torch.ones(1, device=d), dynamic_map().to(d), 64, torch.float32)),
    "dequantize_blockwise dtype": ("dequantize_blockwise", lambda d: (_u8(8, 8, device=d), torch.ones(1, device=d), dynamic_map().to(d), 64, torch.int32)),
    "dequantize_blockwise absmax dtype": ("dequantize_blockwise", lambda d: (_u8(8, 8, device=d), torch.ones(1, dtype=torch.float64, device=d), dynamic_map().to(d), 64, torch.float32)),
    "gemv_4bit blocksize": ("gemv_4bit", lambda d: (torch.randn(1, 8, device=d), _u8(32, 1, device=d), [8, 8], torch.ones(1, device=d), codebook("nf4").to(d), 48)),
    "gemv_4bit A dtype": ("gemv_4bit", lambda d: (torch.ones(1, 8, dtype=torch.int32, device=d), _u8(32, 1, device=d), [8, 8], torch.ones(1, device=d), codebook("nf4").to(d), 64)),
    "gemv_4bit B dtype": ("gemv_4bit", lambda d: (torch.randn(1, 8, device=d), torch.zeros(8, 1, dtype=torch.int32, device=d), [8, 8], torch.ones(1, device=d), codebook("nf4").to(d), 64)),
    "gemv_4bit absmax dtype": ("gemv_4bit", lambda d: (torch.randn(1, 8, device=d), _u8(32, 1, device=d), [8, 8], torch.ones(1, dtype=torch.float64, device=d), codebook("nf4").to(d), 64)),
    "gemm_4bit absmax count": ("gemm_4bit", lambda d: (torch.randn(1, 8, device=d), _u8(32, 1, device=d), [8, 8], torch.ones(2, device=d), 64, "nf4")),
    "gemm_4bit absmax dtype": ("gemm_4bit", lambda d: (torch.randn(1, 8, device=d), _u8(32, 1, device=d), [8, 8], torch.ones(1, dtype=torch.int32, device=d), 64, "nf4")),
    "int8_vectorwise_quant A dtype": ("int8_vectorwise_quant", lambda d: (torch.ones(4, 4, dtype=torch.int32, device=d),)),
    "int8_double_quant A dtype": ("int8_double_quant", lambda d: (torch.ones(4, 4, dtype=torch.int32, device=d),)),
    "int8_vectorwise_dequant A dtype": ("int8_vectorwise_dequant", lambda d: (torch.ones(4, 4, device=d), torch.ones(4, device=d))),
    "int8_mm_dequant A dtype": ("int8_mm_dequant", lambda d: (torch.ones(4, 4, dtype=torch.int8, device=d), torch.ones(4, device=d), torch.ones(4, device=d))),
    "int8_scaled_mm A dtype": ("int8_scaled_mm", lambda d: (torch.ones(4, 4, device=d), torch.ones(4, 4, dtype=torch.int8, device=d), torch.ones(4, device=d), torch.ones(4, device=d))),
    "int8_scaled_mm row_stats": ("int8_scaled_mm", lambda d: (torch.ones(4, 4, dtype=torch.int8, device=d), torch.ones(4, 4, dtype=torch.int8, device=d), torch.ones(3, device=d), torch.ones(4, device=d))),
}


@pytest.mark.parametrize("case", list(INVALID_CALLS))
def test_fakes_reject_what_the_kernels_reject(case):
    # bitsandbytes' fakes check their arguments, so a bad call fails on meta tensors and while
    # torch.compile traces, not only when a kernel runs; torchq's fakes run the kernels' checks
    name, build = INVALID_CALLS[case]
    op = getattr(ops, name).default
    with pytest.raises((ValueError, TypeError)) as eager:
        op(*build("cpu"))
    with pytest.raises(type(eager.value), match=str(eager.value).split(":")[0]):
        op(*build("meta"))
    with pytest.raises(Exception, match=str(eager.value).split(":")[0]):
        torch.compile(lambda *args: op(*args), fullgraph=True, backend="eager")(*build("cpu"))


def test_quantize_4bit_non_uint8_storage_passes_opcheck_and_compiles_bit_exactly():
    # bitsandbytes xfails opcheck for quant_storage != uint8: random packed bytes viewed as bf16
    # include NaN patterns and opcheck compares values with NaN != NaN. Bytes that form no NaN pass
    # opcheck; with NaN patterns, the compiled result has the eager bytes.
    a = torch.zeros(64, 64)
    a[0, 0] = 1.0  # NF4 bytes 0xf7 then 0x77 throughout: finite as bf16 and fp16
    for storage in (torch.bfloat16, torch.float16):
        opcheck(ops.quantize_4bit.default, (a, 64, "nf4", storage))
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    eager = ops.quantize_4bit(w, 64, "fp4", torch.bfloat16)
    compiled = torch.compile(lambda x: ops.quantize_4bit(x, 64, "fp4", torch.bfloat16), fullgraph=True)(w)
    assert torch.isnan(eager[0]).any()  # the case opcheck cannot compare
    assert torch.equal(compiled[0].view(torch.uint8), eager[0].view(torch.uint8)) and torch.equal(compiled[1], eager[1])


def _transposed_layout(t: torch.Tensor) -> torch.Tensor:
    """t's values in column-major memory (a non-contiguous view)."""
    return t.t().contiguous().t()


@pytest.mark.parametrize("threshold", [0.0, 4.0])
@pytest.mark.parametrize("dtype", FLOATS)
def test_int8_ops_give_contiguous_results_for_non_contiguous_inputs(dtype, threshold):
    # the fakes promise contiguous outputs; the kernels used to keep a transposed input's strides
    # (opcheck: stride mismatch); values must equal the contiguous call's
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(12, 64, generator=g) * 3).to(dtype)
    codes, stats, _ = ops.int8_vectorwise_quant(a, threshold)
    c32 = ops.int8_linear_matmul(codes, torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=g))
    calls = [
        (ops.int8_vectorwise_quant.default, (a, threshold), 0),
        (ops.int8_double_quant.default, (a, threshold), 0),
        (ops.int8_vectorwise_dequant.default, (codes, stats), 0),
        (ops.int8_mm_dequant.default, (c32, torch.rand(12, generator=g), torch.rand(32, generator=g), dtype), 0),
    ]
    for op, args, which in calls:
        moved = list(args)
        moved[which] = _transposed_layout(args[which])
        assert not moved[which].is_contiguous()
        want, got = op(*args), op(*moved)
        for w, o in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
            assert (w is None and o is None) or (torch.equal(w, o) and o.is_contiguous())
        opcheck(op, tuple(moved))
