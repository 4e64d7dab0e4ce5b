"""LLM.int8 row-wise int8 ops against the numerics spec (§3) and, when installed, bitsandbytes."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchq  # noqa: F401

ops = torch.ops.torchq
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


def ref_vectorwise_quant(A: torch.Tensor, threshold: float):
    x = A.reshape(-1, A.shape[-1]).float().clone()
    cols = None
    if threshold > 0:
        mask = x.abs() >= threshold
        cols = sorted({int(j) for j in mask.nonzero()[:, 1].tolist()})
        x[mask] = 0
    stats = x.abs().max(dim=1).values
    codes = torch.zeros_like(x, dtype=torch.int8)
    for i in range(x.shape[0]):
        if stats[i] > 0:
            codes[i] = torch.round(x[i] * (127.0 / stats[i])).to(torch.int8)
    if cols:
        codes[:, cols] = 0
    return codes.reshape(A.shape), stats.reshape(A.shape[:-1]), cols


@st.composite
def activations(draw):
    rows = draw(st.integers(1, 9))
    k = draw(st.integers(1, 80))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(rows, k, generator=g) * draw(st.sampled_from([0.5, 2.0, 4.0]))
    if draw(st.booleans()):
        x[draw(st.integers(0, rows - 1))] = 0  # an all-zero row
    return x.to(dtype)


@settings(max_examples=150, deadline=None)
@given(A=activations(), threshold=st.sampled_from([0.0, 1.5, 6.0]))
def test_vectorwise_quant_matches_the_spec(A, threshold):
    before = A.clone()
    codes, stats, cols = ops.int8_vectorwise_quant(A, threshold)
    assert torch.equal(A, before)  # never mutates its input
    rc, rs, rcols = ref_vectorwise_quant(A, threshold)
    assert codes.dtype == torch.int8 and stats.dtype == torch.float32
    assert torch.equal(codes, rc) and torch.equal(stats, rs)
    if threshold == 0:
        assert cols is None
    else:
        assert cols.dtype == torch.int64 and cols.tolist() == rcols
    back = ops.int8_vectorwise_dequant(codes, stats)
    assert torch.equal(back, codes.float() * stats[:, None] / 127)


def test_int8_matmul_is_exact_and_dequant_follows_the_formula():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (33, 4096), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (17, 4096), dtype=torch.int8, generator=g)
    c = ops.int8_linear_matmul(a, b)
    assert c.dtype == torch.int32 and torch.equal(c.long(), a.long() @ b.long().t())
    rs, cs = torch.rand(33) * 5, torch.rand(17) * 5
    bias = torch.randn(17, dtype=torch.bfloat16)
    y = ops.int8_mm_dequant(c, rs, cs, torch.bfloat16, bias)
    want = (c.float() * (rs[:, None] * cs[None, :]) / 16129.0 + bias.float()).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    assert ops.int8_mm_dequant(c, rs, cs).dtype == torch.float16  # bitsandbytes' default
    assert torch.equal(ops.int8_linear_dequant(a, b, rs, cs, bias, torch.bfloat16), want)


@pytest.mark.parametrize("m,k", [(1, 1), (3, 1), (33, 1), (2, 2), (1, 7)])
def test_int8_matmul_small_k_is_exact(m, k):
    """torch._int_mm returns wrong sums on CPU for K == 1; the op must not."""
    g = torch.Generator().manual_seed(k)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (5, k), dtype=torch.int8, generator=g)
    assert torch.equal(ops.int8_linear_matmul(a, b).long(), a.long() @ b.long().t())


def test_llm_int8_linear_close_to_float():
    """The full LLM.int8 recipe (outlier columns in float) reproduces a float linear closely."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 256, generator=g)
    x[:, 7] *= 20  # an outlier feature
    w = torch.randn(64, 256, generator=g) * 0.05
    cx, sx, cols = ops.int8_vectorwise_quant(x, 6.0)
    cw, sw, _ = ops.int8_vectorwise_quant(w, 0.0)
    y = ops.int8_linear_dequant(cx, cw, sx, sw, None, torch.float32)
    y = y + x[:, cols] @ w[:, cols].t()
    ref = x @ w.t()
    sqnr = 20 * torch.log10(ref.norm() / (ref - y).norm())
    assert cols.tolist() == [7] and sqnr > 35


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="A: expected fp32"):
        ops.int8_vectorwise_quant(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="threshold"):
        ops.int8_vectorwise_quant(torch.ones(2, 3), -1.0)
    with pytest.raises(ValueError, match="NaN"):
        ops.int8_vectorwise_quant(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="B: expected"):
        ops.int8_linear_matmul(torch.ones(2, 3, dtype=torch.int8), torch.ones(4, 5, dtype=torch.int8))
    with pytest.raises(ValueError, match="row_stats"):
        ops.int8_mm_dequant(torch.ones(2, 3, dtype=torch.int32), torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="stats"):
        ops.int8_vectorwise_dequant(torch.ones(2, 3, dtype=torch.int8), torch.ones(3))


@pytest.mark.parametrize("op,args", [
    (ops.int8_vectorwise_quant.default, lambda: (torch.randn(4, 16), 0.0)),
    (ops.int8_vectorwise_quant.default, lambda: (torch.randn(4, 16) * 4, 6.0)),
    (ops.int8_vectorwise_dequant.default, lambda: (torch.randint(-127, 128, (4, 16), dtype=torch.int8), torch.rand(4))),
    (ops.int8_linear_matmul.default, lambda: (torch.randint(-127, 128, (20, 32), dtype=torch.int8), torch.randint(-127, 128, (8, 32), dtype=torch.int8))),
    (ops.int8_mm_dequant.default, lambda: (torch.randint(-999, 999, (4, 8), dtype=torch.int32), torch.rand(4), torch.rand(8), torch.bfloat16, torch.randn(8))),
    (ops.int8_linear_dequant.default, lambda: (torch.randint(-127, 128, (20, 32), dtype=torch.int8), torch.randint(-127, 128, (8, 32), dtype=torch.int8),
                                               torch.rand(20), torch.rand(8), None, torch.float32)),
])
def test_opcheck(op, args):
    torch.library.opcheck(op, args())


@pytest.mark.slow
def test_compile_fullgraph():
    def f(x, w):
        cx, sx, _ = torch.ops.torchq.int8_vectorwise_quant(x, 0.0)
        cw, sw, _ = torch.ops.torchq.int8_vectorwise_quant(w, 0.0)
        return torch.ops.torchq.int8_linear_dequant(cx, cw, sx, sw, None, torch.float32)

    x, w = torch.randn(20, 64), torch.randn(16, 64)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(x, w), f(x, w))


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")
def test_matches_bitsandbytes_where_the_formulas_agree():
    import bitsandbytes  # noqa: F401

    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 128, generator=g)
    x[:, 5] *= 10
    for threshold in (0.0, 6.0):
        ours = ops.int8_vectorwise_quant(x, threshold)
        theirs = torch.ops.bitsandbytes.int8_vectorwise_quant(x.clone(), threshold)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
        assert (ours[2] is None) == (theirs[2] is None)
        if ours[2] is not None:
            assert torch.equal(ours[2], theirs[2])
    a, b = ours[0], torch.randint(-127, 128, (8, 128), dtype=torch.int8, generator=g)
    assert torch.equal(ops.int8_linear_matmul(a, b), torch.ops.bitsandbytes.int8_linear_matmul(a, b))
    c = ops.int8_linear_matmul(a, b)
    rs, cs = torch.rand(16) * 3, torch.rand(8) * 3
    mine = ops.int8_mm_dequant(c, rs, cs, torch.float32)
    bnb = torch.ops.bitsandbytes.int8_mm_dequant(c, rs, cs, torch.float32)
    assert torch.allclose(mine, bnb, rtol=3e-5, atol=0)  # 1/127^2 vs bitsandbytes' 6.200124e-05


@pytest.mark.parametrize("k", [1, 2, 3, 1023, 1024, 1025, 4099])
def test_int8_linear_matmul_is_exact_where_16_bit_pair_sums_would_saturate(k):
    """torch._int_mm on CPUs without VNNI (oneDNN's AVX2 kernel) saturates 16-bit pair sums; the
    op's CPU path must give the exact int32 sums: extreme codes, and random ones."""
    g = torch.Generator().manual_seed(k)
    for a, b in [(torch.full((3, k), 127, dtype=torch.int8), torch.full((5, k), -128, dtype=torch.int8)),
                 (torch.randint(-128, 128, (4, k), generator=g, dtype=torch.int8), torch.randint(-128, 128, (6, k), generator=g, dtype=torch.int8))]:
        exact = (a.long() @ b.long().t()).to(torch.int32)
        assert torch.equal(torch.ops.torchq.int8_linear_matmul(a, b), exact)
