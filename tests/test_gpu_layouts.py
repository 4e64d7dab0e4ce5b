"""TensorCoreTiledLayout (CUDA tinygemm int4) and Int4XPULayout: exact packing against per-lane
references of the device kernels' formats, lossless round trips, the kernels' arithmetic in pure
PyTorch, config validation, dispatch conditions and their reasons, checkpoints through the
canonical form. The CUDA tests at the end run only where a CUDA device is present."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import sqnr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchq
from torchq import ZeroPointDomain as Z
from torchq.canonical import PlainForm, QuantSpec
from torchq.layouts.base import placement_reason
from torchq.layouts.int4_xpu import Int4XPULayout, pack_xpu
from torchq.layouts.tensor_core_tiled import TensorCoreTiledLayout, pack_tiled
from torchq.ops.int4 import int4_tensor_core_mm, int4_xpu_mm, tinygemm_dequantize, unpack_tiled, unpack_xpu, xpu_dequantize

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_pack_reference(b: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """``_convert_weight_to_int4pack``'s per-lane loop (NVIDIA path), written out element by
    element from the kernel's definition: uint8 ``[n, k/2]`` -> int32 ``[n/8, k/(16t), 32, t/2]``."""
    n, half_k = b.shape
    t = inner_k_tiles
    out = torch.zeros(-(-n // 8), half_k * 2 // (16 * t), 32, t // 2, dtype=torch.int64)
    rows = b.tolist()
    for nt in range(out.shape[0]):
        for ko in range(out.shape[1]):
            for lane in range(32):
                for inner in range(0, t, 2):
                    n0 = nt * 8 + lane // 4
                    base0 = (ko * t + inner) * 16 // 2
                    ks = [base0 + lane % 4, base0 + lane % 4 + 4, base0 + 8 + lane % 4, base0 + 8 + lane % 4 + 4]
                    v = [rows[n0][kk] if n0 < n and kk < half_k else 0 for kk in ks]
                    word = ((v[3] & 0xF) << 28) | ((v[2] & 0xF) << 24) | ((v[1] & 0xF) << 20) | ((v[0] & 0xF) << 16)
                    word |= ((v[3] & 0xF0) << 8) | ((v[2] & 0xF0) << 4) | (v[1] & 0xF0) | ((v[0] & 0xF0) >> 4)
                    out[nt, ko, lane, inner // 2] = word
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def cuda_bytes(q: torch.Tensor) -> torch.Tensor:
    """The uint8 input PyTorch's CUDA packer takes: element 2j in the high nibble."""
    return ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8)


# -- tiled packing --------------------------------------------------------------------------------
@pytest.mark.parametrize("inner_k_tiles", [2, 4, 8])
def test_pack_tiled_matches_the_cuda_kernels_lane_formula(inner_k_tiles):
    g = torch.Generator().manual_seed(inner_k_tiles)
    q = torch.randint(0, 16, (16, 32 * inner_k_tiles), generator=g, dtype=torch.uint8)
    packed = pack_tiled(q, inner_k_tiles)
    assert packed.dtype == torch.int32 and packed.shape == (2, 2, 32, inner_k_tiles // 2)
    assert torch.equal(packed, cuda_pack_reference(cuda_bytes(q), inner_k_tiles))


@settings(max_examples=40, **SETTINGS)
@given(t=st.sampled_from([2, 4, 8]), n_tiles=st.integers(1, 5), k_tiles=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_pack_tiled_round_trip(t, n_tiles, k_tiles, seed):
    q = torch.randint(0, 16, (8 * n_tiles, 16 * t * k_tiles), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    assert torch.equal(unpack_tiled(pack_tiled(q, t), *q.shape), q)


def test_pack_tiled_extreme_nibbles_survive_the_sign_bit():
    q = torch.full((8, 32), 15, dtype=torch.uint8)
    packed = pack_tiled(q, 2)
    assert (packed == -1).all()  # 0xFFFFFFFF as int32
    assert torch.equal(unpack_tiled(packed, 8, 32), q)


# -- plain forms the GPU layouts hold -----------------------------------------------------------
@st.composite
def int4_plain_forms(draw, layout: str) -> PlainForm:
    domains = [Z.FLOAT, Z.INT] + ([Z.NONE] if layout == "tiled" else [])
    domain = draw(st.sampled_from(domains))
    qmin, qmax = (-8, 7) if domain is Z.NONE else draw(st.sampled_from([(0, 15), (-8, 7), (0, 7), (3, 12)]))
    g = draw(st.sampled_from([32, 64, 128, 256]))
    n = draw(st.one_of(st.integers(1, 20), st.sampled_from([8, 16, 33])))
    k = draw(st.one_of(st.integers(1, 2 * g + 5), st.sampled_from([g, 2 * g, 300])))
    scale_dtype = torch.bfloat16 if layout == "tiled" else draw(st.sampled_from([torch.bfloat16, torch.float16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    grid = (n, -(-k // g))
    code_dtype = torch.int8 if qmin < 0 else torch.uint8
    codes = torch.randint(qmin, qmax + 1, (n, k), generator=gen, dtype=torch.int16).to(code_dtype)
    scale = (torch.rand(grid, generator=gen) * 2.0 ** torch.randint(-12, 4, grid, generator=gen) + 1e-3).to(scale_dtype)
    if domain is Z.INT:
        zero = torch.randint(qmin, qmax + 1, grid, generator=gen, dtype=torch.int32).to(draw(st.sampled_from([code_dtype, torch.int32])))
    elif domain is Z.FLOAT:
        zero = (torch.randn(grid, generator=gen) * 2).to(scale_dtype)
    else:
        zero = None
    return PlainForm(codes, scale, zero, QuantSpec((1, g), qmin, qmax, domain))


def assert_plain_equal(a: PlainForm, b: PlainForm) -> None:
    assert a.spec == b.spec
    for name in ("codes", "scale", "zero_point"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


@settings(max_examples=60, **SETTINGS)
@given(data=st.data(), t=st.sampled_from([2, 4, 8]))
def test_tiled_layout_is_lossless(data, t):
    plain = data.draw(int4_plain_forms("tiled"))
    layout = TensorCoreTiledLayout(t)
    impl = layout.pack(plain)
    np_, kp = impl.padded_shape
    assert np_ % 8 == 0 and kp % max(plain.spec.block_size[1], 16 * t) == 0
    assert impl.packed.shape == (np_ // 8, kp // (16 * t), 32, t // 2)
    assert impl.scales_and_zeros.shape == (kp // plain.spec.block_size[1], np_, 2)
    assert_plain_equal(impl.to_plain(), plain)
    assert torch.equal(impl.dequantize(torch.float32), plain.dequantize(torch.float32))


@settings(max_examples=40, **SETTINGS)
@given(data=st.data())
def test_tinygemm_arithmetic_is_one_bf16_fma(data):
    """The kernel forms (q' - 8)·s + zero with one bf16 rounding, the zero being the float zero
    (FLOAT), (mid - z)·s rounded to bf16 (INT) or 0 (NONE: then exactly the plain form's value)."""
    plain = data.draw(int4_plain_forms("tiled"))
    impl = TensorCoreTiledLayout().pack(plain)
    w = tinygemm_dequantize(impl.packed, impl.scales_and_zeros, impl.group_size, impl.shape)
    spec, k = plain.spec, plain.shape[1]
    g = spec.block_size[1]
    full = lambda t: t.to(torch.float64).repeat_interleave(g, 1)[:, :k]  # noqa: E731
    q = plain.codes.to(torch.float64) - spec.mid
    if spec.zero_point_domain is Z.NONE:
        assert torch.equal(w, plain.dequantize(torch.bfloat16))
        return
    if spec.zero_point_domain is Z.FLOAT:
        zero = plain.zero_point
    else:
        zero = ((spec.mid - plain.zero_point.to(torch.int32)) * plain.scale).to(torch.bfloat16)
    assert torch.equal(w, (q * full(plain.scale) + full(zero)).to(torch.bfloat16))
    if spec.zero_point_domain is Z.FLOAT:  # close to the plain form's two roundings
        ref = plain.dequantize(torch.float64)
        size = (q * full(plain.scale)).abs() + full(zero).abs()
        assert ((w.double() - ref).abs() <= 2 * torch.finfo(torch.bfloat16).eps * size).all()


def test_tiled_reference_op_matches_float_linear():
    torch.manual_seed(0)
    w = torch.randn(72, 320, dtype=torch.bfloat16)
    aq = torchq.Int4WeightOnlyConfig(group_size=64, layout=TensorCoreTiledLayout(4)).quantize_weight(w)
    impl = aq.tensor_impl
    np_, kp = impl.padded_shape
    x = torch.randn(5, 320, dtype=torch.bfloat16)
    y = int4_tensor_core_mm(F.pad(x, (0, kp - 320)), aq.packed, 64, aq.scales_and_zeros)
    assert y.shape == (5, np_) and y.dtype == torch.bfloat16
    ref = x.float() @ aq.dequantize().float().t()
    assert sqnr(ref, y[:, :72]) > 40
    assert (y[:, 72:] == 0).all()  # padding rows are zero weights


def test_tiled_config_and_layout_validation():
    with pytest.raises(ValueError, match="inner_k_tiles"):
        TensorCoreTiledLayout(3)
    with pytest.raises(ValueError, match=r"layout: TensorCoreTiledLayout.*bf16 scales.*float16"):
        torchq.Int4WeightOnlyConfig(layout=TensorCoreTiledLayout(), scale_dtype=torch.float16)
    cfg = torchq.Int4WeightOnlyConfig(layout=TensorCoreTiledLayout())  # scale dtype: the weight's
    with pytest.raises(ValueError, match="bf16 scales"):
        cfg.quantize_weight(torch.randn(8, 64))
    model = nn.Sequential(nn.Linear(64, 8))
    before = model[0].weight.detach().clone()
    with pytest.raises(Exception, match="bf16 scales"):
        torchq.quantize_(model, cfg)
    assert type(model[0].weight) is nn.Parameter and torch.equal(model[0].weight, before)  # left as it was


def test_tiled_conditions_say_why_on_cpu():
    w = torch.randn(16, 128, dtype=torch.bfloat16)
    aq = torchq.Int4WeightOnlyConfig(layout=TensorCoreTiledLayout()).quantize_weight(w)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    kernels = {k.name: k for k in torchq.linear_kernels()}
    assert "CUDA kernel, tensor is on cpu" in kernels["tensor_core_tiled"].check(x, aq, None)
    assert kernels["tensor_core_tiled"].check(x.half(), aq, None) == "takes bfloat16 inputs, input is torch.float16"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        y = F.linear(x, aq)
    assert any("no linear kernel accepted" in str(r.message) and "tensor_core_tiled" in str(r.message) for r in rec)
    assert torch.equal(y, F.linear(x, aq.dequantize()))
    rejections = torchq.layouts.base.layout_rejections(aq.tensor_impl.spec, (16, 128), torch.bfloat16, "cpu")
    assert rejections["tensor_core_tiled"] == "CUDA kernel, tensor is on cpu"


# -- XPU ----------------------------------------------------------------------------------------
def test_xpu_nibble_order_is_low_nibble_first():
    q = torch.arange(16, dtype=torch.uint8).reshape(1, 16).repeat(16, 1)
    packed = pack_xpu(q)
    assert packed.dtype == torch.int32 and packed.shape == (16, 2)
    assert packed[0, 0].item() == 0x76543210
    assert packed[0, 1].item() == 0xFEDCBA98 - 2**32  # the top nibble holds the sign bit
    assert packed.view(torch.uint8)[0, 0].item() == 0x10  # q_odd << 4 | q_even: the reverse of CUDA's bytes
    assert torch.equal(unpack_xpu(packed), q)


@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_xpu_layout_is_lossless(data):
    plain = data.draw(int4_plain_forms("xpu"))
    impl = Int4XPULayout().pack(plain)
    np_, kp = impl.padded_shape
    assert impl.packed.shape == (np_, kp // 8) and np_ % 16 == 0
    if plain.spec.zero_point_domain is Z.INT:
        assert impl.scale.shape == (kp // impl.group_size, np_) and impl.zero.dtype == torch.int8
    else:
        assert impl.scale_and_zero.shape == (kp // impl.group_size, np_, 2)
    assert_plain_equal(impl.to_plain(), plain)


@settings(max_examples=40, **SETTINGS)
@given(data=st.data())
def test_xpu_kernel_arithmetic_reference(data):
    """INT: (q - z)·s formed in fp32 and rounded once is exactly the plain form's meaning; FLOAT:
    (q - 8)·s + zero in fp32, one rounding (within one ulp of the plain form's two roundings)."""
    plain = data.draw(int4_plain_forms("xpu"))
    impl = Int4XPULayout().pack(plain)
    n, k = plain.shape
    dtype = plain.scale.dtype
    int_zeros = impl.zero if impl.scale is not None else None
    w = xpu_dequantize(impl.packed, impl.group_size, impl.scale if int_zeros is not None else impl.scale_and_zero, int_zeros, dtype)
    w = w[:n, :k]
    if plain.spec.zero_point_domain is Z.INT:
        assert torch.equal(w, plain.dequantize(dtype))
    else:
        g = impl.group_size
        full = lambda t: t.to(torch.float32).repeat_interleave(g, 1)[:, :k]  # noqa: E731
        q = plain.codes.to(torch.float32) - plain.spec.mid
        assert torch.equal(w, (q * full(plain.scale) + full(plain.zero_point)).to(dtype))
        ref = plain.dequantize(torch.float64)
        size = (q * full(plain.scale)).abs() + full(plain.zero_point).abs()
        assert ((w.double() - ref).abs() <= 2 * torch.finfo(dtype).eps * size.double()).all()
    assert (xpu_dequantize(impl.packed, impl.group_size, impl.scale if int_zeros is not None else impl.scale_and_zero,
                           int_zeros, dtype)[n:] == 0).all()


@pytest.mark.parametrize("domain", [Z.INT, Z.FLOAT])
def test_xpu_reference_op_and_cpu_conditions(domain):
    torch.manual_seed(0)
    w = torch.randn(40, 200, dtype=torch.float16)
    aq = torchq.Int4WeightOnlyConfig(group_size=64, layout=Int4XPULayout(), zero_point_domain=domain).quantize_weight(w)
    impl = aq.tensor_impl
    _, kp = impl.padded_shape
    x = torch.randn(3, 200, dtype=torch.float16)
    args = (aq.scale, aq.zero) if domain is Z.INT else (aq.scale_and_zero,)
    y = int4_xpu_mm(F.pad(x, (0, kp - 200)), aq.packed, 64, *args)[:, :40]
    assert sqnr(x.float() @ aq.dequantize().float().t(), y) > 40
    kernel = {k.name: k for k in torchq.linear_kernels()}["int4_xpu"]
    assert kernel.check(x, aq, None) == "XPU kernel, input is on cpu"


def test_xpu_config_validation():
    with pytest.raises(ValueError, match=r"layout: Int4XPULayout\(\).*INT or FLOAT zero point.*NONE"):
        torchq.Int4WeightOnlyConfig(layout=Int4XPULayout(), zero_point_domain=Z.NONE)
    with pytest.raises(ValueError, match="bf16/fp16 scales"):
        torchq.Int4WeightOnlyConfig(layout=Int4XPULayout(), scale_dtype=torch.float32)
    assert "group size" in Int4XPULayout().fit(QuantSpec((1, 512), 0, 15, Z.INT)).cannot_hold
    assert "codebook" not in (Int4XPULayout().fit(QuantSpec((1, 64), 0, 15, Z.FLOAT), scale_dtype=torch.bfloat16).cannot_hold or "")
    cfg = torchq.Int4WeightOnlyConfig(layout=Int4XPULayout(), zero_point_domain=Z.INT)
    assert torchq.config_from_json(cfg.to_json()) == cfg


# -- moving and checkpoints -----------------------------------------------------------------------
@pytest.mark.parametrize("layout", [TensorCoreTiledLayout(2), Int4XPULayout()], ids=["tiled", "xpu"])
def test_gpu_layout_checkpoints_load_on_cpu_through_the_canonical_form(layout, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 24)).to(torch.bfloat16)
    torchq.quantize_(model, torchq.Int4WeightOnlyConfig(group_size=32, layout=layout, zero_point_domain=Z.INT))
    plain = model[0].weight.to_plain()
    assert model[0].weight.quant_layout == layout
    # torch.save / torch.load(weights_only=True): the saved device layout does not run on the CPU,
    # so loading repacks into the CPU's best layout, values unchanged
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    loaded = sd["0.weight"]
    assert loaded.to_plain().equal(plain)
    assert loaded.quant_layout != layout and loaded.quant_layout == torchq.choose_layout(plain.spec, plain.shape, plain.scale.dtype, "cpu")
    # safetensors
    torchq.save_quantized(model, tmp_path / "m.safetensors")
    fresh = nn.Sequential(nn.Linear(96, 24)).to(torch.bfloat16)
    torchq.load_quantized(fresh, tmp_path / "m.safetensors")
    assert fresh[0].weight.to_plain().equal(plain)
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), F.linear(x, fresh[0].weight.dequantize(), fresh[0].bias)) or sqnr(
        F.linear(x, fresh[0].weight.dequantize(), fresh[0].bias), fresh(x)) > 40


def test_device_specific_layout_stays_where_it_belongs():
    """to_device to the same device keeps the layout; the placement rule names why a device
    layout would be left when moving elsewhere."""
    plain = torchq.Int4WeightOnlyConfig(layout=TensorCoreTiledLayout()).quantize_weight(torch.randn(8, 128, dtype=torch.bfloat16)).to_plain()
    layout = TensorCoreTiledLayout()
    assert placement_reason(layout, plain.spec, plain.shape, torch.bfloat16, "cpu") == "CUDA kernel, tensor is on cpu"
    assert placement_reason(Int4XPULayout(), plain.spec, plain.shape, torch.bfloat16, "cpu") is not None
    impl = layout.pack(plain)
    assert impl.to_device(torch.device("cpu")) is impl


# -- CUDA ------------------------------------------------------------------------------------------
@cuda
@pytest.mark.parametrize("inner_k_tiles", [2, 4, 8])
def test_cuda_pack_is_pytorchs(inner_k_tiles):
    q = torch.randint(0, 16, (40, 64 * inner_k_tiles), dtype=torch.uint8)
    got = torch.ops.aten._convert_weight_to_int4pack(cuda_bytes(q).cuda(), inner_k_tiles).cpu()
    assert torch.equal(got, pack_tiled(q, inner_k_tiles))
    assert torch.equal(unpack_tiled(got.cuda(), 40, 64 * inner_k_tiles).cpu(), q)


@cuda
@pytest.mark.parametrize("shape", [(64, 1024), (72, 320), (4096, 4096)])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_cuda_tinygemm_matches_its_reference(shape, m):
    n, k = shape
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    aq = torchq.Int4WeightOnlyConfig(group_size=64, layout=TensorCoreTiledLayout()).quantize_weight(w)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    with torchq.strict():
        y = F.linear(x, aq)
    wd = tinygemm_dequantize(aq.packed, aq.scales_and_zeros, 64, (n, k)).float()
    assert sqnr(x.float() @ wd.t(), y) > 45
    assert sqnr(F.linear(x.float(), aq.dequantize().float()), y) > 40


@cuda
def test_cuda_model_moves_to_cpu_and_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64)).to(torch.bfloat16).cuda()
    torchq.quantize_(model, torchq.int4_weight_only(group_size=64))
    assert isinstance(model[0].weight.quant_layout, TensorCoreTiledLayout)
    plain = model[0].weight.to_plain().map(lambda t: t.cpu())
    model.cpu()
    assert not isinstance(model[0].weight.quant_layout, TensorCoreTiledLayout)
    assert model[0].weight.to_plain().equal(plain)
    model.cuda()
    assert isinstance(model[0].weight.quant_layout, TensorCoreTiledLayout)
    assert model[0].weight.to_plain().map(lambda t: t.cpu()).equal(plain)



QUANTIZE_ON_EITHER_DEVICE = {  # configs whose scales divide by a constant (7.5, 15, 127, 448, ...)
    "int4-g32": lambda: torchq.int4_weight_only(group_size=32),
    "int4-g128-bf16-scales": lambda: torchq.Int4WeightOnlyConfig(group_size=128, scale_dtype=torch.bfloat16),
    "int4-float-zero": lambda: torchq.Int4WeightOnlyConfig(group_size=64, zero_point_domain=Z.FLOAT, scale_dtype=torch.float32),
    "int4-symmetric": lambda: torchq.Int4WeightOnlyConfig(group_size=64, zero_point_domain=Z.NONE),
    "int8wo": lambda: torchq.int8_weight_only(),
    "int8dq": lambda: torchq.int8_dynamic_activation_int8_weight(),
    "intx-3bit": lambda: torchq.intx_weight_only(bits=3, group_size=64),
    "nf4-double": lambda: torchq.nf4_weight_only(block_size=64, double_quant=True),
    "fp8wo": lambda: torchq.float8_weight_only(),
}


@cuda
@pytest.mark.parametrize("name", sorted(QUANTIZE_ON_EITHER_DEVICE))
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_cuda_quantization_has_the_cpu_bits(name, w_dtype):
    """A weight quantized on the GPU holds the CPU's codes and scales bit for bit (CUDA multiplies by
    the reciprocal of a Python divisor: :mod:`torchq.division`)."""
    g = torch.Generator().manual_seed(len(name))
    w = (torch.randn(96, 512, generator=g) * torch.exp(2 * torch.randn(96, 1, generator=g))).to(w_dtype)
    on_cpu = QUANTIZE_ON_EITHER_DEVICE[name]().quantize_weight(w).to_plain()
    on_gpu = QUANTIZE_ON_EITHER_DEVICE[name]().quantize_weight(w.cuda()).to_plain().map(lambda t: t.cpu())
    assert on_gpu.equal(on_cpu), name


@cuda
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_activation_quantization_has_the_cpu_bits(x_dtype):
    from torchq.activation import OutlierInt8, PerBlockInt8, PerTokenInt8
    from torchq.float8 import quantize_float8_activations

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 1000, generator=g) * torch.exp(2 * torch.randn(64, 1, generator=g))).to(x_dtype)
    x[3, 7] = float("nan")
    x[5] = 0
    for name, quantize in (("per-token", PerTokenInt8().quantize), ("per-block", PerBlockInt8().quantize),
                           ("float8-row", lambda v: quantize_float8_activations(v, "row")),
                           ("float8-tensor", lambda v: quantize_float8_activations(v, "tensor")),
                           ("llm.int8", lambda v: (OutlierInt8().fake_quantize(v),))):
        for a, b in zip(quantize(x), quantize(x.cuda()), strict=True):
            assert a.dtype == b.dtype, name
            a, b = (t.cpu().float() if t.is_floating_point() else t.cpu() for t in (a, b))  # float8 exactly in fp32
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)), name


# -- the ops' schemas and fake implementations (what torch.compile traces) -------------------------
def test_device_ops_pass_opcheck():
    torch.manual_seed(0)
    w = torch.randn(24, 128, dtype=torch.bfloat16)
    tiled = torchq.Int4WeightOnlyConfig(group_size=64, layout=TensorCoreTiledLayout(2)).quantize_weight(w)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.torchq.int4_tensor_core_mm, (x, tiled.packed, 64, tiled.scales_and_zeros))
    for domain in (Z.INT, Z.FLOAT):
        xpu = torchq.Int4WeightOnlyConfig(group_size=64, layout=Int4XPULayout(), zero_point_domain=domain).quantize_weight(w)
        args = (xpu.scale, xpu.zero) if domain is Z.INT else (xpu.scale_and_zero,)
        torch.library.opcheck(torch.ops.torchq.int4_xpu_mm, (x, xpu.packed, 64, *args))
