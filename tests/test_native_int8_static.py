"""The native int8 static-activation CPU kernel (``TQ_FORMAT_INT8_STATIC``) against its reference.

``torchq::int8_static_linear`` quantizes x with one fixed fp32 scale and zero point
(:class:`torchq.activation.StaticInt8`), sums the int8 x int8 products exactly and subtracts the zero
point's correction ``z * rowsum(w)``; the native kernel must give the reference's bits:

* on every ISA this CPU has (scalar, AVX2 sign trick, AVX2 narrow kernels for 7-bit ranges, VNNI),
  with the GEMM forms on and off, for row counts on both sides of every path switch, odd K and N
  (partial tiles, panels and panel steps), zero points at 0, inside and at both ends of the range;
* for fp32 / bf16 / fp16 inputs with ±inf (saturating), NaN (the row's outputs NaN), huge values,
  exact ties (half to even), tiny and huge scales; with a bias (added after the rounding);
* K above the GEMM's int32 bound with a zero point (the row kernels subtract in int64);
* the library refuses inconsistent static fields; the row sums follow in-place writes of the codes;
* without the library (or for a range below -127) the reference runs and says so once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_blockwise import ISAS, NATIVE, needs_native

from torchq import native
from torchq.backends.native_cpu import abi as native_abi
from torchq.backends.native_cpu import int8 as native_int8
from torchq.backends.native_cpu import library
from torchq.ops.int8 import int8_static_linear, int8_static_reference

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
MS = [1, 2, 3, 5, 8, 31, 32, 33, 64, 257]
# (K, N) pairs covering K in {1, 7, 33, 100, 576} and N in {1, 15, 16, 17, 40}: partial 32 / 64-code
# tiles and 4-code panel steps, partial 4-row tiles and 16-row panels
SHAPES = [(1, 17), (7, 1), (33, 15), (100, 16), (576, 40), (100, 17), (33, 40)]
# (zero point, quant_min, quant_max): symmetric, inside, at both ends; a 7-bit range (the AVX2 narrow
# kernels from 8 rows) with its ends; an unsigned-like range
QCASES = [(0, -127, 127), (17, -127, 127), (-40, -127, 127), (-127, -127, 127), (127, -127, 127), (0, -64, 63), (-64, -64, 63),
          (63, -64, 63), (5, -20, 100)]
TINY = 2.0**-126  # the smallest scale StaticInt8 takes: 1 / scale = 2^126


def ref(x, codes, scale, s, z, qmin, qmax, bias=None):
    return int8_static_reference(x, codes, scale, s, z, qmin, qmax, bias)


def assert_same_bits(y: torch.Tensor, expected: torch.Tensor, what=""):
    """Equal dtypes, shapes, NaN positions and bit patterns everywhere else (signed zeros included)."""
    assert y.dtype == expected.dtype and y.shape == expected.shape, what
    nan = expected.isnan()
    assert torch.equal(y.isnan(), nan), (what, (y.isnan() != nan).nonzero()[:5])
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[y.dtype]
    a, b = y[~nan].view(ints), expected[~nan].view(ints)
    if not torch.equal(a, b):
        bad = (a != b).nonzero()[:5].flatten()
        raise AssertionError(f"{what}: {y[~nan][bad].tolist()} != {expected[~nan][bad].tolist()}")


def weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    codes[0] = -128  # the widest products: 2 * 127 * 128 per pair (sign trick, narrow kernels)
    if n > 1:
        codes[-1] = 127
    scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    if n > 2:
        scale[1] = -scale[1]  # a negative scale: its signed zeros
    return codes, scale


def activations(m: int, k: int, dtype: torch.dtype, s: float, seed: int = 0) -> torch.Tensor:
    """Rows spanning the code range and beyond, with the special rows of the contract."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (200 * s)  # ~1/3 of the codes clamp at the range's ends
    big = 6e4 if dtype == torch.float16 else 1e30
    for i in range(m):
        kind = i % 7
        if kind == 1:
            x[i, (i * 5) % k] = float("inf")
            x[i, (i * 3 + 1) % k] = -float("inf")
        elif kind == 2 and m > 2:
            x[i, (i * 7) % k] = float("nan")
        elif kind == 3:
            x[i] *= big
        elif kind == 4:
            x[i] = 0.0
        elif kind == 5 and s == 0.25:  # exact ties x * 4 = j + 0.5: half to even
            x[i] = (torch.arange(k) - k // 2 + 0.5) / 4
        elif kind == 6:
            x[i] *= 1e-30
    return x.to(dtype)


# -- bit-exact on every path ----------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("gemm", [True, False], ids=["gemm", "rows"])
@pytest.mark.parametrize("m", MS, ids=lambda m: f"M{m}")
def test_static_is_bit_equal_to_the_reference(isa, gemm, m):
    with library.lut4_paths(gemm=gemm):
        for i, (k, n) in enumerate(SHAPES):
            codes, scale = weight(n, k, seed=i)
            for j, (z, qmin, qmax) in enumerate(QCASES):
                s = (0.03, 0.25, TINY, 1e5, 0.5)[(i + j) % 5]
                for dtype in FLOATS:
                    x = activations(m, k, dtype, s, seed=i + j)
                    y = int8_static_linear(x, codes, scale, s, z, qmin, qmax)
                    assert_same_bits(y, ref(x, codes, scale, s, z, qmin, qmax), (isa, gemm, m, k, n, z, qmin, qmax, s, dtype))


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("m", [1, 9, 40])
def test_static_threads_larger_shapes_and_bias(isa, threads, m):
    """Two threads split N (the GEMM in whole panels); a bias of x's dtype is added after the
    rounding; a 3-D x keeps its leading dimensions."""
    n, k = 67, 1029
    codes, scale = weight(n, k, seed=m)
    for dtype in FLOATS:
        bias = torch.randn(n, generator=torch.Generator().manual_seed(m)).to(dtype)
        for z, qmin, qmax in ((0, -127, 127), (-9, -127, 127), (20, -64, 63)):
            x = activations(m, k, dtype, 0.02, seed=m)
            y = int8_static_linear(x, codes, scale, 0.02, z, qmin, qmax, bias)
            assert_same_bits(y, ref(x, codes, scale, 0.02, z, qmin, qmax, bias), (m, dtype, z))
            x3 = x.reshape(1, m, k).expand(2, m, k)  # not contiguous: copied
            y3 = int8_static_linear(x3, codes, scale, 0.02, z, qmin, qmax, bias)
            assert y3.shape == (2, m, n)
            assert_same_bits(y3[1], y, "3-D")


@needs_native
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40), k=st.integers(1, 300), m=st.sampled_from(MS), dtype=st.sampled_from(FLOATS),
    qrange=st.sampled_from([(-127, 127), (-64, 63), (-8, 7), (0, 127), (-127, 0)]), zfrac=st.floats(0, 1),
    scale=st.one_of(st.sampled_from([TINY, 1e-30, 0.25, 1.0, 2.0**126]), st.floats(1e-6, 1e3)), magnitude=st.sampled_from([1e-3, 1.0, 1e3]),
    isa=st.sampled_from(ISAS or ["scalar"]), gemm=st.booleans(), seed=st.integers(0, 2**16),
)
def test_static_random_shapes_zero_points_and_scales(n, k, m, dtype, qrange, zfrac, scale, magnitude, isa, gemm, seed):
    qmin, qmax = qrange
    z = qmin + round(zfrac * (qmax - qmin))
    s = float(torch.tensor(scale, dtype=torch.float32))  # as StaticInt8 keeps it
    codes, wscale = weight(n, k, seed)
    x = (activations(m, k, torch.float32, s, seed) * magnitude).to(dtype)
    saved = native.status().isa
    native.set_isa(isa)
    try:
        with library.lut4_paths(gemm=gemm):
            y = int8_static_linear(x, codes, wscale, s, z, qmin, qmax)
    finally:
        native.set_isa(saved)
    assert_same_bits(y, ref(x, codes, wscale, s, z, qmin, qmax), (isa, gemm))


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("m", [1, 33])  # the row tiles; 33 rows: where the GEMM would run
def test_static_zero_point_correction_beyond_int32(isa, m):
    """K = 70000 with z = -127 and every code at 127 against weights 127: sum_k (q - z) w =
    254 * 127 * K > 2^31, which the reference subtracts in int64; the kernel must not take the
    GEMM form's int32 correction there (the row kernels subtract in int64)."""
    n, k = 5, 70000
    codes = torch.full((n, k), 127, dtype=torch.int8)
    codes[1] = -128
    codes[2, ::2] = -7
    scale = torch.full((n,), 1e-3)
    x = torch.full((m, k), 1e3)
    if m > 1:
        x[-1, ::3] = -1e3
    y = int8_static_linear(x, codes, scale, 1.0, -127, -127, 127)
    expected = ref(x, codes, scale, 1.0, -127, -127, 127)
    assert expected[0, 0].item() == pytest.approx(254 * 127 * k * 1e-3, rel=1e-6)  # beyond int32
    assert_same_bits(y, expected)


@needs_native
def test_static_through_the_op_compiles_fullgraph_and_passes_opcheck():
    codes, scale = weight(24, 100, seed=3)
    x, bias = activations(5, 100, torch.float32, 0.05), torch.randn(24)

    def f(x):
        return int8_static_linear(x, codes, scale, 0.05, -3, -127, 127, bias)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    expected = ref(x, codes, scale, 0.05, -3, -127, 127, bias)
    for _ in range(2):  # the second call: the op's cached static weight, before the argument checks
        assert_same_bits(compiled(x), expected)
    torch.library.opcheck(torch.ops.torchq.int8_static_linear.default, (x.nan_to_num(), codes, scale, 0.05, -3, -127, 127, bias))


@needs_native
def test_static_op_checks_its_arguments_even_with_a_cached_weight():
    codes, scale = weight(8, 64)
    x = torch.randn(2, 64)
    int8_static_linear(x, codes, scale, 0.1, 0, -127, 127)
    with pytest.raises(ValueError, match="zero_point"):
        int8_static_linear(x, codes, scale, 0.1, 200, -127, 127)
    with pytest.raises(ValueError, match="scale"):
        int8_static_linear(x, codes, scale, 0.0, 0, -127, 127)


# -- the library's checks and the Python binding ------------------------------------------------------

N, K = 8, 128


def _static_weight(z=3, qmin=-127, qmax=127, s=0.05):
    codes = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    base = library.int8_weight("int8_weight_linear", codes, torch.rand(N) + 0.5, N, K)
    return base, base.static(s, z, qmin, qmax)


def _altered(weight: library.NativeWeight, **changes) -> library.NativeWeight:
    fields = {name: getattr(weight.struct, name) for name, _ in weight.struct._fields_}
    return library.NativeWeight(weight.op, weight._tensors, **(fields | changes))


BAD_STATIC = [dict(row_sums=None), dict(act_zero_point=128), dict(act_zero_point=-128), dict(act_qmin=-128, act_zero_point=0),
              dict(act_qmax=128), dict(act_qmin=5, act_qmax=5, act_zero_point=5), dict(act_zero_point=-100, act_qmin=-64, act_qmax=63),
              dict(act_scale=0.0), dict(act_scale=-1.0), dict(act_scale=float("nan")), dict(act_scale=float("inf")),
              dict(act_scale=2.0**-127), dict(codes=None), dict(nested_map=1), dict(row_length=K + 1)]


@needs_native
@pytest.mark.parametrize("change", BAD_STATIC, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_an_inconsistent_static_weight_is_a_bad_argument(change):
    _, good = _static_weight()
    bad = _altered(good, **change)
    lib = library.library()
    x, out = torch.randn(2, K), torch.empty(2, N)
    assert lib.tq_linear(good.address, x.data_ptr(), 0, 2, None, out.data_ptr(), 1) == 0
    assert lib.tq_linear(bad.address, x.data_ptr(), 0, 2, None, out.data_ptr(), 1) == 1
    if bad.row_length == K:
        with pytest.raises(RuntimeError, match=r"failed with status 1 \(1: bad argument"):
            library.run_linear(bad, x, None)


@needs_native
def test_row_sums_belong_to_the_static_format_only_and_it_takes_no_bias_in_c():
    base, static = _static_weight()
    lib = library.library()
    x, out, bias = torch.randn(2, K), torch.empty(2, N), torch.randn(N)
    row_sums = static._row_sums.tensor
    assert torch.equal(row_sums, base._tensors[0].to(torch.int32).sum(1)) and row_sums.dtype == torch.int32
    for other in (base, base.dynamic(-127, 127, 1e-5)):
        assert lib.tq_linear(other.address, x.data_ptr(), 0, 2, None, out.data_ptr(), 1) == 0
        assert lib.tq_linear(_altered(other, row_sums=row_sums.data_ptr()).address, x.data_ptr(), 0, 2, None, out.data_ptr(), 1) == 1
    assert lib.tq_linear(static.address, x.data_ptr(), 0, 2, bias.data_ptr(), out.data_ptr(), 1) == 1
    assert torch.equal(library.run_linear(static, x, bias), library.run_linear(static, x, None) + bias)
    # the weight dequantizes as its weight-only form; one static weight per key, sharing the row sums
    tile, tile_base = torch.empty(N, K), torch.empty(N, K)
    library.dequantize_rows(static, 0, N, tile)
    library.dequantize_rows(base, 0, N, tile_base)
    assert torch.equal(tile, tile_base)
    assert base.static(0.05, 3, -127, 127) is static and base.derived(library.NativeWeight.static_key(0.05, 3, -127, 127)) is static
    other = base.static(0.05, 4, -127, 127)
    assert other is not static and other._row_sums is static._row_sums
    assert static.format == native_abi.FORMAT_INT8_STATIC == 5
    with pytest.raises(ValueError, match="static activations need an int8 weight-only weight"):
        static.static(0.05, 3, -127, 127)


class Owner:
    """A layout's tensor impl as the library's per-owner cache sees it."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        self.codes, self.scale, self.shape = codes, scale, codes.shape


@needs_native
@pytest.mark.parametrize("path", ["op", "decode", "bound"])
def test_row_sums_follow_in_place_writes_of_the_codes(path):
    """copy_ into the codes (load_state_dict into a quantized model) keeps their address: the
    cached weight sees the new codes, and its row sums are recomputed before the next call."""
    n, k = 24, 96
    codes, scale = weight(n, k, seed=7)
    new_codes, _ = weight(n, k, seed=8)
    x = torch.randn(3, k)
    args = (0.03, 25, -127, 127)
    owner = Owner(codes, scale)
    qweight = types.SimpleNamespace(tensor_impl=owner)

    def build(o):
        return library.int8_weight("int8_weight_linear", o.codes, o.scale, n, k)

    def call():
        if path == "op":
            return int8_static_linear(x, codes, scale, *args)
        if path == "decode":
            return library.decode_linear(owner, x, None, build, static=args)
        return bound(x, qweight, None)

    bound = library.bind_linear(owner, x, build, static=args)
    assert bound is not None and bound.bias_after
    assert_same_bits(call(), ref(x, codes, scale, *args))
    with torch.no_grad():
        codes.copy_(new_codes)
    assert_same_bits(call(), ref(x, new_codes, scale, *args))


# -- without the native kernel ---------------------------------------------------------------------

def test_full_range_runs_the_reference_and_says_why():
    codes, scale = weight(10, 48)
    x = torch.randn(2, 48)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = int8_static_linear(x, codes, scale, 0.02, -5, -128, 127)
    assert_same_bits(y, ref(x, codes, scale, 0.02, -5, -128, 127))
    if NATIVE:
        assert any(issubclass(w.category, native.NativeMissingWarning) and "[-128, 127]" in str(w.message) for w in caught)


def test_disabled_library_runs_the_reference_without_a_warning():
    codes, scale = weight(10, 48)
    x = activations(4, 48, torch.bfloat16, 0.02)
    with native.disabled(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = int8_static_linear(x, codes, scale, 0.02, 7, -127, 127)
        y2 = native_int8.static_linear_cpu(x, codes, scale, 0.02, 7, -127, 127)
    assert_same_bits(y, ref(x, codes, scale, 0.02, 7, -127, 127))
    assert_same_bits(y2, y)
    assert not [w for w in caught if issubclass(w.category, native.NativeMissingWarning)]
    # no rows: the reference (no kernel call)
    empty = torch.empty(0, 48)
    assert int8_static_linear(empty, codes, scale, 0.02, 7, -127, 127).shape == (0, 10)


def test_without_the_library_the_reference_runs_and_warns_once():
    code = (
        "import warnings, torch\n"
        "from torchq import native\n"
        "from torchq.ops.int8 import int8_static_linear, int8_static_reference\n"
        "assert not native.status().available\n"
        "codes = torch.randint(-128, 128, (8, 40), dtype=torch.int8)\n"
        "scale, x = torch.rand(8) + 0.1, torch.randn(3, 40)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    y = int8_static_linear(x, codes, scale, 0.02, 3, -127, 127)\n"
        "    int8_static_linear(x, codes, scale, 0.02, 3, -127, 127)\n"
        "assert torch.equal(y, int8_static_reference(x, codes, scale, 0.02, 3, -127, 127, None))\n"
        "msgs = [str(m.message) for m in w if issubclass(m.category, native.NativeMissingWarning)]\n"
        "assert len(msgs) == 1 and 'int8_static_linear' in msgs[0] and 'TORCHQ_NATIVE=0' in msgs[0], msgs\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TORCHQ_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


@needs_native
def test_static_without_vnni_is_bit_equal():
    """TORCHQ_NATIVE_VNNI=0 runs the path of AVX-512 CPUs without VNNI (the AVX2 kernels with the
    AVX-512 quantization; on any CPU)."""
    code = """
import torch
from torchq.ops.int8 import int8_static_linear, int8_static_reference
g = torch.Generator().manual_seed(0)
codes = torch.randint(-128, 128, (40, 70), generator=g, dtype=torch.int8)
scale = torch.rand(40, generator=g) + 0.1
for m in (1, 5, 9, 33):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for z, qmin, qmax in ((0, -127, 127), (-30, -127, 127), (10, -64, 63)):
            x = (torch.randn(m, 70, generator=g) * 3).to(dtype)
            y = int8_static_linear(x, codes, scale, 0.03, z, qmin, qmax)
            assert torch.equal(y, int8_static_reference(x, codes, scale, 0.03, z, qmin, qmax, None)), (m, dtype, z)
print("ok")
"""
    env = dict(os.environ, TORCHQ_NATIVE_VNNI="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
