"""NF4 / FP4 / 8-bit blockwise ops: bit-exact against a reference written from the numerics spec (§4)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchq  # noqa: F401  (registers torch.ops.torchq.*)
from torchq.blockwise import FP4, NF4, codebook, dynamic_map
from torchq.checkpoint.codec import tensor_crc32
from torchq.ops.blockwise import BLOCK_SIZES

ops = torch.ops.torchq
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None

SPEC_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0]
SPEC_FP4_MAGNITUDES = [0, 0.0625, 8, 12, 4, 6, 2, 3]  # / 12, by the low 3 bits; bit 3 = sign


# -- reference from the spec (deliberately written differently from torchq's implementation) --------
def ref_values_and_nibbles(quant_type: str) -> tuple[torch.Tensor, list[int]]:
    """Distinct code values sorted ascending and the nibble each one is written as (+0 for zero)."""
    if quant_type == "nf4":
        return torch.tensor(SPEC_NF4, dtype=torch.float32), list(range(16))
    pairs = {}
    for nib in range(16):
        mag = torch.tensor(SPEC_FP4_MAGNITUDES[nib & 7], dtype=torch.float32) / 12
        v = float(-mag if nib & 8 else mag)
        if v == 0.0:
            v, nib = 0.0, 0
        pairs.setdefault(v, nib)
    vals = sorted(pairs)
    return torch.tensor(vals, dtype=torch.float32), [pairs[v] for v in vals]


def ref_index(s: torch.Tensor, sorted_values: torch.Tensor) -> torch.Tensor:
    """Index of the nearest value: the number of fp32 midpoints strictly below s (a tie goes to
    the lower value)."""
    mids = ((sorted_values[:-1] + sorted_values[1:]) / 2).to(torch.float32)
    return (s.reshape(-1, 1) > mids.reshape(1, -1)).sum(dim=1)


def ref_blocks(x: torch.Tensor, blocksize: int):
    flat = x.reshape(-1).to(torch.float32)
    out_s, absmax = [], []
    for start in range(0, flat.numel(), blocksize):
        blk = flat[start:start + blocksize]
        a = blk.abs().max()
        absmax.append(a)
        out_s.append(blk * (1 / a) if a > 0 else torch.zeros_like(blk))
    return torch.cat(out_s), torch.stack(absmax)


def ref_quantize_4bit(x: torch.Tensor, blocksize: int, quant_type: str):
    s, absmax = ref_blocks(x, blocksize)
    vals, nibs = ref_values_and_nibbles(quant_type)
    nib = torch.tensor(nibs, dtype=torch.uint8)[ref_index(s, vals)]
    if nib.numel() % 2:
        nib = torch.cat([nib, torch.tensor(nibs, dtype=torch.uint8)[ref_index(torch.zeros(1), vals)]])
    packed = nib[0::2] * 16 + nib[1::2]
    return packed.reshape(-1, 1), absmax


def ref_dequantize_4bit(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str, shape, dtype):
    b = packed.reshape(-1).view(torch.uint8).to(torch.int64)
    nib = torch.stack([b // 16, b % 16], dim=1).reshape(-1)
    n = 1
    for d in shape:
        n *= d
    table = torch.tensor(SPEC_NF4) if quant_type == "nf4" else torch.tensor(
        [(-1 if i & 8 else 1) * SPEC_FP4_MAGNITUDES[i & 7] / 12 for i in range(16)], dtype=torch.float32)
    vals = table[nib[:n]] * absmax.repeat_interleave(blocksize)[:n]
    return vals.to(dtype).reshape(shape)


# -- strategies ----------------------------------------------------------------------------------------
SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 1e-8, 3e38, -3e38, 1.0, -1.0, 0.5]


@st.composite
def tensors(draw, max_numel: int = 3000):
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    shape = draw(st.lists(st.integers(1, 70), min_size=1, max_size=3).filter(lambda s: torch.Size(s).numel() <= max_numel))
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["normal", "normal", "zeros", "constant", "special", "tiny", "huge", "zero_blocks"]))
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel()
    if kind == "normal":
        x = torch.randn(n, generator=g) * draw(st.sampled_from([1.0, 1e-3, 100.0]))
    elif kind == "zeros":
        x = torch.zeros(n)
    elif kind == "constant":
        x = torch.full((n,), draw(st.sampled_from([0.3, -2.0, 7.0])))
    elif kind == "special":
        x = torch.tensor(SPECIAL)[torch.randint(len(SPECIAL), (n,), generator=g)]
    elif kind == "tiny":
        x = torch.randn(n, generator=g) * 1e-36
    elif kind == "huge":
        x = torch.randn(n, generator=g) * 1e37
    else:
        x = torch.randn(n, generator=g)
        x[: n // 2] = 0
    if dtype != torch.float32:
        fmax = torch.finfo(dtype).max
        x = x.clamp(-fmax, fmax)
    return x.to(dtype).reshape(shape)


# -- codebooks -----------------------------------------------------------------------------------------
def test_codebooks_match_the_spec():
    assert NF4.tolist() == torch.tensor(SPEC_NF4, dtype=torch.float32).tolist()
    assert codebook("nf4") is NF4 and codebook("fp4") is FP4
    for nib in range(16):
        want = (-1 if nib & 8 else 1) * torch.tensor(SPEC_FP4_MAGNITUDES[nib & 7], dtype=torch.float32) / 12
        assert FP4[nib].item() == want.item()
    with pytest.raises(ValueError, match="quant_type"):
        codebook("int4")


def test_dynamic_map_facts():
    m = dynamic_map()
    assert m.dtype == torch.float32 and m.shape == (256,)
    assert bool((m[1:] >= m[:-1]).all())
    assert m[0] == torch.tensor(-0.99296875, dtype=torch.float32)
    assert m[127].item() == 0.0 and m[255].item() == 1.0
    assert dynamic_map() is not m and torch.equal(dynamic_map(), m)
    # CRC-32 of the fp32 bytes of bitsandbytes' create_dynamic_map(signed, 7, 8), recorded with
    # bitsandbytes 0.50.2, so the exact map is checked where bitsandbytes is not installed
    assert tensor_crc32(m) == 454261483
    assert tensor_crc32(dynamic_map(signed=False)) == 3899729807


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("exp_bits", [7, 5, 4])
def test_dynamic_map_equals_bitsandbytes(signed, exp_bits):
    from bitsandbytes.functional import create_dynamic_map

    if not signed and exp_bits < 7:
        pytest.skip("bitsandbytes' own function asserts for these")
    assert torch.equal(dynamic_map(signed, exp_bits, 8), create_dynamic_map(signed, exp_bits, 8))


# -- 4-bit ------------------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(x=tensors(), blocksize=st.sampled_from(BLOCK_SIZES), quant_type=st.sampled_from(["nf4", "fp4"]))
def test_quantize_4bit_bit_exact_to_spec(x, blocksize, quant_type):
    packed, absmax = ops.quantize_4bit(x, blocksize, quant_type, torch.uint8)
    ref_packed, ref_absmax = ref_quantize_4bit(x, blocksize, quant_type)
    assert packed.dtype == torch.uint8 and packed.shape == ((x.numel() + 1) // 2, 1)
    assert absmax.dtype == torch.float32 and torch.equal(absmax, ref_absmax)
    assert torch.equal(packed, ref_packed)
    y = ops.dequantize_4bit(packed, absmax, blocksize, quant_type, list(x.shape), x.dtype)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y, ref_dequantize_4bit(packed, absmax, blocksize, quant_type, tuple(x.shape), x.dtype))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_ties_and_neighbours_of_every_threshold(quant_type):
    vals, _ = ref_values_and_nibbles(quant_type)
    mids = ((vals[:-1] + vals[1:]) / 2).float()
    probes = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, -2)), torch.nextafter(mids, torch.full_like(mids, 2)), vals])
    x = torch.cat([probes, torch.ones(64 - probes.numel() % 64)])  # every block holds a 1.0: s == x
    packed, _ = ops.quantize_4bit(x, 64, quant_type, torch.uint8)
    assert torch.equal(packed, ref_quantize_4bit(x, 64, quant_type)[0])


@pytest.mark.parametrize("quant_type,zero_nibble", [("nf4", 7), ("fp4", 0)])
def test_zero_block_and_odd_tail_use_the_code_of_zero(quant_type, zero_nibble):
    x = torch.zeros(65)
    x[64] = 0.5
    packed, absmax = ops.quantize_4bit(x, 64, quant_type, torch.uint8)
    assert absmax.tolist() == [0.0, 0.5]
    assert packed[:32].reshape(-1).tolist() == [zero_nibble * 17] * 32
    top = 15 if quant_type == "nf4" else 3  # code of +1.0
    assert packed[32].item() == top * 16 + zero_nibble
    neg = ops.quantize_4bit(torch.full((2,), -1e-9) * torch.tensor([1.0, 1e-30]), 64, quant_type, torch.uint8)[0]
    assert neg.dtype == torch.uint8


def test_fp4_never_writes_negative_zero():
    x = torch.tensor([1.0, -1e-6, 1e-6, -0.0] * 16)
    packed, _ = ops.quantize_4bit(x, 64, "fp4", torch.uint8)
    nib = torch.stack([packed.reshape(-1) >> 4, packed.reshape(-1) & 15], 1).reshape(-1)
    assert nib[1::4].unique().tolist() == [0] and nib[2::4].unique().tolist() == [0] and nib[3::4].unique().tolist() == [0]


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.uint8])
def test_quant_storage_is_a_view_of_the_same_bytes(storage):
    x = torch.randn(16, 64)
    ref, absmax = ops.quantize_4bit(x, 64, "nf4", torch.uint8)
    packed, _ = ops.quantize_4bit(x, 64, "nf4", storage)
    assert packed.dtype == storage and packed.shape[1] == 1
    assert torch.equal(packed.reshape(-1).view(torch.uint8), ref.reshape(-1))
    y = ops.dequantize_4bit(packed, absmax, 64, "nf4", [16, 64], torch.float32)
    assert torch.equal(y, ops.dequantize_4bit(ref, absmax, 64, "nf4", [16, 64], torch.float32))


def test_4bit_bad_input_errors_name_the_argument():
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match="blocksize"):
        ops.quantize_4bit(x, 48, "nf4", torch.uint8)
    with pytest.raises(ValueError, match="quant_type"):
        ops.quantize_4bit(x, 64, "int4", torch.uint8)
    with pytest.raises(TypeError, match="A: expected fp32"):
        ops.quantize_4bit(x.to(torch.int32), 64, "nf4", torch.uint8)
    with pytest.raises(ValueError, match="NaN"):
        ops.quantize_4bit(torch.tensor([1.0, float("nan")]), 64, "nf4", torch.uint8)
    with pytest.raises(ValueError, match="quant_storage"):
        ops.quantize_4bit(torch.randn(3), 64, "nf4", torch.int32)
    packed, absmax = ops.quantize_4bit(x, 64, "nf4", torch.uint8)
    with pytest.raises(ValueError, match=r"A: expected 240 packed bytes for shape \[8, 60\], got 256"):
        ops.dequantize_4bit(packed, absmax, 64, "nf4", [8, 60], torch.float32)
    with pytest.raises(ValueError, match="absmax: expected fp32 with 8"):
        ops.dequantize_4bit(packed, absmax[:4], 64, "nf4", [8, 64], torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        ops.dequantize_4bit(packed, absmax, 64, "nf4", [8, 64], torch.int8)


# -- 8-bit blockwise ----------------------------------------------------------------------------------
def ref_quantize_blockwise(x, code, blocksize):
    s, absmax = ref_blocks(x, blocksize)
    return ref_index(s, code).to(torch.uint8).reshape(x.shape), absmax


@settings(max_examples=100, deadline=None)
@given(x=tensors(), blocksize=st.sampled_from(BLOCK_SIZES))
def test_quantize_blockwise_bit_exact_to_spec(x, blocksize):
    code = dynamic_map()
    q, absmax = ops.quantize_blockwise(x, code, blocksize)
    rq, rabsmax = ref_quantize_blockwise(x, code, blocksize)
    assert q.dtype == torch.uint8 and q.shape == x.shape
    assert torch.equal(absmax, rabsmax) and torch.equal(q, rq)
    y = ops.dequantize_blockwise(q, absmax, code, blocksize, x.dtype)
    want = (code[q.reshape(-1).long()] * absmax.repeat_interleave(blocksize)[: x.numel()]).to(x.dtype).reshape(x.shape)
    assert torch.equal(y, want)


def test_quantize_blockwise_with_an_unsorted_code_maps_back_to_its_indices():
    code = dynamic_map()
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(3))
    x = torch.randn(300)
    q_sorted, absmax = ops.quantize_blockwise(x, code, 64)
    q_perm, _ = ops.quantize_blockwise(x, code[perm], 64)
    assert torch.equal(code[perm][q_perm.long()], code[q_sorted.long()])


def test_blockwise_bad_input():
    code = dynamic_map()
    with pytest.raises(ValueError, match="blocksize"):
        ops.quantize_blockwise(torch.randn(10), code, 100)
    with pytest.raises(ValueError, match="code"):
        ops.quantize_blockwise(torch.randn(10), code.double(), 64)
    q, absmax = ops.quantize_blockwise(torch.randn(10), code, 64)
    with pytest.raises(TypeError, match="A: expected uint8"):
        ops.dequantize_blockwise(q.to(torch.int8), absmax, code, 64, torch.float32)
    with pytest.raises(ValueError, match="absmax"):
        ops.dequantize_blockwise(q, absmax.double(), code, 64, torch.float32)


# -- op contracts ---------------------------------------------------------------------------------------
OPCHECK_CASES = [
    (ops.quantize_4bit.default, lambda: (torch.randn(5, 70), 64, "nf4", torch.uint8)),
    (ops.quantize_4bit.default, lambda: (torch.randn(132, dtype=torch.bfloat16), 32, "fp4", torch.bfloat16)),
    (ops.dequantize_4bit.default, lambda: (*ops.quantize_4bit(torch.randn(5, 70), 64, "nf4", torch.uint8), 64, "nf4", [5, 70], torch.float16)),
    (ops.quantize_blockwise.default, lambda: (torch.randn(7, 33), dynamic_map(), 256)),
    (ops.dequantize_blockwise.default, lambda: (*ops.quantize_blockwise(torch.randn(7, 33), dynamic_map(), 256), dynamic_map(), 256, torch.bfloat16)),
]


@pytest.mark.parametrize("op,make_args", OPCHECK_CASES, ids=[str(c[0]) + str(i) for i, c in enumerate(OPCHECK_CASES)])
def test_opcheck(op, make_args):
    torch.library.opcheck(op, make_args())


@pytest.mark.slow
def test_compile_fullgraph_through_every_op():
    code = dynamic_map()

    def roundtrip(x):
        p, a = torch.ops.torchq.quantize_4bit(x, 64, "nf4", torch.uint8)
        y = torch.ops.torchq.dequantize_4bit(p, a, 64, "nf4", [x.shape[0], x.shape[1]], x.dtype)
        q, b = torch.ops.torchq.quantize_blockwise(y, code, 256)
        return torch.ops.torchq.dequantize_blockwise(q, b, code, 256, x.dtype)

    x = torch.randn(12, 96)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(roundtrip, fullgraph=True)(x), roundtrip(x))


# -- bitsandbytes, when installed -------------------------------------------------------------------------
@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("blocksize", [64, 128, 4096])
def test_4bit_bytes_equal_bitsandbytes(dtype, blocksize):
    import bitsandbytes.functional as bnbf

    x = torch.randn(300, 333, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0, :200] = 0  # an all-zero block
    for qt in ("nf4", "fp4"):
        ours, absmax = ops.quantize_4bit(x, blocksize, qt, torch.uint8)
        theirs, state = bnbf.quantize_4bit(x, blocksize=blocksize, quant_type=qt)
        assert torch.equal(absmax, state.absmax)
        a, b = ours.reshape(-1), theirs.reshape(-1)
        na = torch.stack([a >> 4, a & 15], 1).reshape(-1)
        nb = torch.stack([b >> 4, b & 15], 1).reshape(-1)
        differ = na != nb
        if qt == "nf4":
            assert not differ.any()
        else:  # only where bitsandbytes writes a signed zero (nibble 8 for tiny positive values)
            assert bool(((na[differ] % 8 == 0) & (nb[differ] % 8 == 0)).all())
        assert torch.equal(ops.dequantize_4bit(theirs, state.absmax, blocksize, qt, list(x.shape), dtype), bnbf.dequantize_4bit(theirs, state))


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")
def test_blockwise_vs_bitsandbytes_differs_only_by_rounding_to_a_neighbour():
    """bitsandbytes' 8-bit kernels search the map approximately; torchq takes the nearest code (the
    spec). They disagree on ~0.2% of values, by one index (rarely two, near zero), with torchq
    never farther from the value."""
    import bitsandbytes.functional as bnbf

    code = dynamic_map()
    x = torch.randn(500, 301, generator=torch.Generator().manual_seed(2))
    ours, absmax = ops.quantize_blockwise(x, code, 256)
    theirs, state = bnbf.quantize_blockwise(x, code=code, blocksize=256)
    assert torch.equal(absmax, state.absmax)
    differ = ours != theirs
    assert differ.float().mean() < 0.01
    assert bool(((ours[differ].int() - theirs[differ].int()).abs() <= 2).all())
    s = (x.reshape(-1) * (1 / absmax).repeat_interleave(256)[: x.numel()]).reshape(x.shape)
    assert bool(((s - code[ours.long()]).abs() <= (s - code[theirs.long()]).abs()).all())
    assert torch.equal(ops.dequantize_blockwise(theirs, absmax, code, 256, torch.float32), bnbf.dequantize_blockwise(theirs, state))


# -- double quantization and gemv ---------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 2000), seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["random", "constant", "zeros"]))
def test_double_quantize_matches_the_spec_formula(n, seed, kind):
    from torchq.blockwise import double_dequantize, double_quantize

    g = torch.Generator().manual_seed(seed)
    absmax = torch.rand(n, generator=g) * 3 if kind == "random" else torch.full((n,), 0.7 if kind == "constant" else 0.0)
    codes, absmax2, offset = double_quantize(absmax)
    assert codes.dtype == torch.uint8 and codes.shape == (n,) and absmax2.shape == (-(-n // 256),) and offset.dim() == 0
    assert offset == absmax.mean()
    dyn = dynamic_map()
    rq, rabs = ref_quantize_blockwise(absmax - offset, dyn, 256)
    assert torch.equal(codes, rq) and torch.equal(absmax2, rabs)
    want = dyn[codes.long()] * absmax2.repeat_interleave(256)[:n] + offset
    assert torch.equal(double_dequantize(codes, absmax2, offset), want)
    assert (double_dequantize(codes, absmax2, offset) - absmax).abs().max() <= absmax2.max() * 0.01 + 1e-7


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_4bit_is_dequantize_then_linear(quant_type, dtype, m):
    w = torch.randn(40, 96)
    packed, absmax = ops.quantize_4bit(w, 64, quant_type, torch.uint8)
    x = torch.randn(m, 96).to(dtype)
    y = ops.gemv_4bit(x, packed, [40, 96], absmax, codebook(quant_type), 64)
    ref = torch.nn.functional.linear(x, ops.dequantize_4bit(packed, absmax, 64, quant_type, [40, 96], dtype))
    assert y.dtype == dtype and torch.equal(y, ref)
    with pytest.raises(ValueError, match="A: expected last dimension 96"):
        ops.gemv_4bit(torch.randn(1, 95), packed, [40, 96], absmax, codebook(quant_type), 64)
    with pytest.raises(ValueError, match="code"):
        ops.gemv_4bit(x, packed, [40, 96], absmax, dynamic_map(), 64)


def test_opcheck_gemv_4bit():
    packed, absmax = ops.quantize_4bit(torch.randn(40, 96), 64, "nf4", torch.uint8)
    torch.library.opcheck(ops.gemv_4bit.default, (torch.randn(2, 96), packed, [40, 96], absmax, codebook("nf4"), 64))
