"""float8 e4m3fn quantization (:mod:`torchq.float8`) and the float8 linear ops (:mod:`torchq.ops.float8`):
the codes against an independent round-to-nearest-even over the 254 finite e4m3fn values, the scale
rules, refused weights, NaN activations, the ops against exact float64 sums, bad arguments."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from torchq.float8 import (
    E4M3_MAX,
    MIN_SCALE,
    dequantize_float8,
    quantize_float8,
    quantize_float8_activations,
)

SETTINGS = dict(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
FLOATS = [torch.float32, torch.bfloat16, torch.float16]

# every byte's value; 0x7F and 0xFF are NaN
BYTES = torch.arange(256, dtype=torch.uint8)
VALUES = BYTES.view(torch.float8_e4m3fn).to(torch.float64)
FINITE = ~VALUES.isnan()


def oracle_codes(q: torch.Tensor) -> torch.Tensor:
    """Bytes of float8_e4m3fn nearest to each fp32 ``q`` (ties: the even byte, i.e. even mantissa),
    saturating at ±448: by search over the finite values, not through torch's cast."""
    q = q.to(torch.float64).reshape(-1, 1)
    dist = (q - VALUES[FINITE].reshape(1, -1)).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = (dist == best) & (BYTES[FINITE].reshape(1, -1) & 1 == 0).logical_or(
        (dist == best).sum(dim=1, keepdim=True) == 1)
    finite_bytes = BYTES[FINITE]
    pick = candidates.to(torch.int8).argmax(dim=1)
    out = finite_bytes[pick]
    # a quotient that rounds to zero keeps its sign (IEEE): -0.0 is byte 0x80
    zero = VALUES[out.long()] == 0
    out[zero] = torch.where(torch.signbit(q.reshape(-1)[zero]), torch.tensor(0x80, dtype=torch.uint8), torch.tensor(0, dtype=torch.uint8))
    return out


def weights(draw_rows: torch.Tensor, edge: str) -> torch.Tensor:
    w = draw_rows.clone()
    if edge == "zero_row":
        w[0] = 0
    elif edge == "tiny":
        w = w * 1e-38
    elif edge == "huge":
        w = w * 1e30
    elif edge == "constant_row":
        w[0] = -3.25
    elif edge == "subnormal_codes":
        w[0, 1:] = w[0, 1:] * 1e-4  # quotients far below 2^-6: subnormal and zero codes
    return w


@settings(**SETTINGS)
@given(n=st.integers(1, 12), k=st.integers(1, 70), dtype=st.sampled_from(FLOATS), granularity=st.sampled_from(["row", "tensor"]),
       edge=st.sampled_from(["none", "zero_row", "tiny", "huge", "constant_row", "subnormal_codes"]), seed=st.integers(0, 2**31 - 1))
def test_weight_codes_are_the_nearest_e4m3fn_values_of_the_fp32_quotients(n, k, dtype, granularity, edge, seed):
    gen = torch.Generator().manual_seed(seed)
    w = weights(torch.randn(n, k, generator=gen) * torch.exp(2 * torch.randn(n, 1, generator=gen)), edge).to(dtype)
    assume(bool(torch.isfinite(w).all()))
    codes, scale = quantize_float8(w, granularity)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (n, k)
    assert scale.dtype == torch.float32 and scale.shape == ((n, 1) if granularity == "row" else (1, 1))
    w32 = w.to(torch.float32)
    amax = w32.abs().amax(dim=1, keepdim=True) if granularity == "row" else w32.abs().amax().reshape(1, 1)
    want_scale = torch.clamp(amax / 448, min=MIN_SCALE)  # fp32 division, then the floor
    assert torch.equal(scale, want_scale)
    quotient = (w32 / scale).clamp(-E4M3_MAX, E4M3_MAX)
    assert torch.equal(codes.view(torch.uint8).reshape(-1), oracle_codes(quotient))
    assert not codes.to(torch.float32).isnan().any()
    big = amax.reshape(-1) >= 448 * MIN_SCALE
    if granularity == "row" and bool(big.any()):  # the largest element of a row maps to ±448
        assert torch.equal(codes.to(torch.float32).abs().amax(dim=1)[big], torch.full((int(big.sum()),), 448.0))


def test_every_finite_byte_round_trips():
    """A weight whose quotients are exactly the 254 finite e4m3fn values (scale 1) keeps every byte."""
    w = VALUES[FINITE].to(torch.float32).reshape(2, -1)
    w[:, 0] = 448.0  # amax 448 per row: scale exactly 1
    codes, scale = quantize_float8(w)
    assert torch.equal(scale, torch.ones(2, 1))
    assert torch.equal(codes.to(torch.float32), w)
    assert torch.equal(dequantize_float8(codes, scale, torch.float32), w)


def test_a_zero_row_gets_the_smallest_normal_scale_and_zero_codes():
    codes, scale = quantize_float8(torch.zeros(3, 8))
    assert torch.equal(scale, torch.full((3, 1), MIN_SCALE)) and not codes.to(torch.float32).any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_weight_row_with_nan_or_inf_is_refused_by_row(bad):
    w = torch.randn(4, 16)
    w[2, 5] = bad
    with pytest.raises(ValueError, match="row 2 holds NaN or inf"):
        quantize_float8(w)


@pytest.mark.parametrize("w,match", [
    (torch.randn(4), "2-D"), (torch.randn(2, 3, dtype=torch.float64), "fp32, bf16 or fp16"), ("w", "str"),
])
def test_quantize_float8_names_bad_input(w, match):
    with pytest.raises(ValueError, match=match):
        quantize_float8(w)
    with pytest.raises(ValueError, match="granularity: expected 'row' or 'tensor', got 'block'"):
        quantize_float8(torch.randn(2, 2), "block")


def test_activations_with_nan_or_inf_get_a_nan_scale_and_zero_codes():
    x = torch.randn(3, 32)
    x[1, 4] = float("inf")
    codes, scale = quantize_float8_activations(x, "row")
    assert scale[1].isnan().all() and not codes[1].to(torch.float32).any()
    assert torch.isfinite(scale[[0, 2]]).all()
    codes_t, scale_t = quantize_float8_activations(x, "tensor")
    assert scale_t.shape == (1, 1) and scale_t.isnan().all() and not codes_t.to(torch.float32).any()
    ok_codes, ok_scale = quantize_float8(x[[0, 2]])
    assert torch.equal(codes[[0, 2]].view(torch.uint8), ok_codes.view(torch.uint8)) and torch.equal(scale[[0, 2]], ok_scale)


# -- the ops ------------------------------------------------------------------------------------------
@settings(**SETTINGS)
@given(m=st.integers(1, 9), n=st.integers(1, 20), k=st.integers(1, 80), dtype=st.sampled_from(FLOATS),
       granularity=st.sampled_from(["row", "tensor"]), w_granularity=st.sampled_from(["row", "tensor"]), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_float8_dynamic_linear_sums_the_exact_products_in_fp32(m, n, k, dtype, granularity, w_granularity, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    codes, scale = quantize_float8(torch.randn(n, k, generator=gen), w_granularity)
    x = (torch.randn(2, m, k, generator=gen) * 3).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = torch.ops.torchq.float8_dynamic_linear(x, codes, scale, granularity, b)
    assert y.dtype == dtype and y.shape == (2, m, n)
    xq, xs = quantize_float8_activations(x.reshape(-1, k), granularity)
    prod = xq.double() @ codes.double().T  # exact: the fp8 products and their sum in float64
    exact = prod * xs.double() * scale.double().reshape(1, -1)
    mag = (xq.double().abs() @ codes.double().abs().T) * xs.double() * scale.double().reshape(1, -1)
    unit = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    got = y.reshape(-1, n).double() - (0 if b is None else b.double())
    bound = (k + 4) * 2.0**-24 * mag + 2 * unit * (exact.abs() + (0 if b is None else b.double().abs())) + torch.finfo(dtype).tiny
    assert ((got - exact).abs() <= bound).all()


def test_float8_dynamic_linear_a_nan_row_stays_in_its_row():
    codes, scale = quantize_float8(torch.randn(6, 16))
    x = torch.randn(3, 16)
    x[1, 0] = float("nan")
    y = torch.ops.torchq.float8_dynamic_linear(x, codes, scale, "row")
    assert y[1].isnan().all() and torch.isfinite(y[[0, 2]]).all()
    assert torch.ops.torchq.float8_dynamic_linear(x, codes, scale, "tensor").isnan().all()


@pytest.mark.parametrize("dtype", FLOATS)
def test_float8_weight_linear_is_f_linear_on_the_dequantized_weight(dtype):
    codes, scale = quantize_float8(torch.randn(10, 48))
    x = torch.randn(4, 48).to(dtype)
    b = torch.randn(10).to(dtype)
    want = F.linear(x, (codes.to(torch.float32) * scale).to(dtype), b)
    assert torch.equal(torch.ops.torchq.float8_weight_linear(x, codes, scale, b), want)


def test_the_float8_ops_name_bad_arguments():
    codes, scale = quantize_float8(torch.randn(6, 16))
    x = torch.randn(2, 16)
    op = torch.ops.torchq.float8_dynamic_linear
    with pytest.raises(ValueError, match=r"codes: expected float8_e4m3fn \[N, K\], got torch.int8"):
        op(x, codes.view(torch.int8), scale, "row")
    with pytest.raises(ValueError, match=r"scale: expected fp32 \[6, 1\] \(per row\) or \[1, 1\] \(per tensor\), got torch.float32 \[6\]"):
        op(x, codes, scale.reshape(-1), "row")
    with pytest.raises(ValueError, match="x: expected last dimension K=16"):
        op(torch.randn(2, 15), codes, scale, "row")
    with pytest.raises(TypeError, match="x: expected fp32, bf16 or fp16, got torch.float64"):
        op(x.double(), codes, scale, "row")
    with pytest.raises(ValueError, match=r"bias: expected \[6\]"):
        op(x, codes, scale, "row", torch.zeros(5))
    with pytest.raises(ValueError, match="granularity: expected 'row' or 'tensor', got 'token'"):
        op(x, codes, scale, "token")


def test_the_float8_ops_compile_fullgraph():
    codes, scale = quantize_float8(torch.randn(8, 32))
    x = torch.randn(3, 32)

    def f(x):
        return torch.ops.torchq.float8_dynamic_linear(x, codes, scale, "row") + torch.ops.torchq.float8_weight_linear(x, codes, scale)

    eager = f(x)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(x), eager)


def test_midpoints_round_to_the_even_byte():
    """Every midpoint between adjacent finite e4m3fn values (exact in fp32) goes to the even byte
    (a row whose amax is 448 has scale 1, so the quotients are the midpoints themselves)."""
    pos = VALUES[FINITE & (VALUES >= 0)].unique().to(torch.float32)
    mids = (pos[:-1] + pos[1:]) / 2
    w = torch.cat([torch.tensor([448.0]), mids, -mids]).reshape(1, -1)
    codes, scale = quantize_float8(w)
    assert torch.equal(scale, torch.ones(1, 1))
    assert torch.equal(codes.view(torch.uint8).reshape(-1), oracle_codes(w))
    assert bool((codes.view(torch.uint8).reshape(-1)[1:] & 1 == 0).all())  # every tie went to an even mantissa
    codes_s, _ = quantize_float8_activations(torch.tensor([[1.0, 2.0]]), "row")
    assert torch.equal(codes_s.to(torch.float32), torch.tensor([[224.0, 448.0]]))


# -- the configs, the layout, checkpoints -------------------------------------------------------------
import copy  # noqa: E402
import io  # noqa: E402
import warnings  # noqa: E402

from torch import nn  # noqa: E402

import torchq  # noqa: E402
from torchq.backends.aten import float8_dynamic_linear_scaled_mm  # noqa: E402
from torchq.canonical import PlainForm, QuantSpec, decode_codes  # noqa: E402
from torchq.serialization import CheckpointError  # noqa: E402

FP8_CONFIGS = {"fp8dq-row": torchq.float8_dynamic_activation_float8_weight("row"),
               "fp8dq-tensor": torchq.float8_dynamic_activation_float8_weight("tensor"), "fp8wo": torchq.float8_weight_only()}


def small_model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 32, bias=False)).to(dtype)


@pytest.mark.parametrize("name", sorted(FP8_CONFIGS))
def test_configs_by_name_and_json(name):
    cfg = torchq.config_from_name(name)
    assert cfg == FP8_CONFIGS[name]
    assert torchq.config_from_json(cfg.to_json_str()) == cfg
    with pytest.raises(ValueError, match="granularity: expected 'row' or 'tensor', got 'channel'"):
        torchq.float8_dynamic_activation_float8_weight("channel")


@pytest.mark.parametrize("name", sorted(FP8_CONFIGS))
def test_a_quantized_model_runs_the_ops_reference_on_the_cpu_with_one_warning(name):
    model = small_model()
    torchq.quantize_(model, FP8_CONFIGS[name])
    w = model[0].weight
    assert isinstance(w, torchq.AffineQuantizedTensor) and isinstance(w.tensor_impl.layout, torchq.Float8Layout)
    assert w.tensor_impl.codes.dtype == torch.float8_e4m3fn
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    with pytest.warns(torchq.FallbackWarning, match="float8 on cpu has no fast kernel"):
        y = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per layer
        assert torch.equal(model(x), y)
    h = model[0].requires_grad_(False)  # a bias that wants a gradient is added outside the kernel
    impl = h.weight.tensor_impl
    if name == "fp8wo":
        want = torch.ops.torchq.float8_weight_linear(x, impl.codes, impl.scale, h.bias)
    else:
        want = torch.ops.torchq.float8_dynamic_linear(x, impl.codes, impl.scale, name.removeprefix("fp8dq-"), h.bias)
    assert torch.equal(h(x), want)
    with torchq.strict(), pytest.raises(torchq.NoKernelError, match="strict mode forbids the float8 reference path"):
        model(x)
    report = str(torchq.explain(model, x))
    assert "float8_reference" in report and "float8_scaled_mm" in report


def test_a_weight_with_nan_is_refused_and_the_model_is_unchanged():
    model = small_model(torch.float32)
    with torch.no_grad():
        model[2].weight[7, 3] = float("nan")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(Exception, match="row 7 holds NaN or inf"):
        torchq.quantize_(model, torchq.float8_weight_only())
    after = model.state_dict()
    assert set(after) == set(before)
    for k, v in before.items():  # the same plain tensors, NaN where it was
        assert type(after[k]) is torch.Tensor and torch.equal(after[k].nan_to_num(), v.nan_to_num())
        assert torch.equal(after[k].isnan(), v.isnan())
    assert not any(isinstance(p, torchq.AffineQuantizedTensor) for p in model.parameters())


@pytest.mark.parametrize("name", sorted(FP8_CONFIGS))
def test_torch_save_with_weights_only_and_safetensors_round_trip(name, tmp_path):
    model = small_model()
    torchq.quantize_(model, FP8_CONFIGS[name])
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.FallbackWarning)
        y = model(x)
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        buf.seek(0)
        again = small_model()
        again.load_state_dict(torch.load(buf, weights_only=True), assign=True)
        assert torch.equal(again(x), y)
        torchq.save_quantized(model, tmp_path / "m")
        fresh = small_model()
        torchq.load_quantized(fresh, tmp_path / "m")
        assert torch.equal(fresh(x), y)
    a, b = model[0].weight.tensor_impl, fresh[0].weight.tensor_impl
    assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    from safetensors import safe_open

    files = sorted((tmp_path / "m").glob("*.safetensors")) or [tmp_path / "m"]
    with safe_open(str(files[0]), "pt") as f:  # the codes as F8_E4M3, readable by any safetensors tool
        codes_keys = [key for key in f.keys() if key.endswith("codes")]
        assert codes_keys and all(f.get_tensor(key).dtype == torch.float8_e4m3fn for key in codes_keys)


@pytest.mark.parametrize("name", sorted(FP8_CONFIGS))
def test_a_quantized_linear_compiles_fullgraph_to_the_same_bits(name):
    """(One layer: inductor keeps bf16 intermediates such as a GELU's in fp32, which would change
    the next layer's float8 activations.)"""
    model = small_model()[:1]
    torchq.quantize_(model, FP8_CONFIGS[name])
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.FallbackWarning)
        eager = model(x)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(model, fullgraph=True)(x), eager)


def test_nan_codes_are_refused_in_the_plain_form_and_in_checkpoints():
    spec = QuantSpec((1, 8), 0, 255, "none", codebook="e4m3fn")
    codes = torch.zeros(2, 8, dtype=torch.uint8)
    codes[1, 3] = 0xFF
    with pytest.raises(ValueError, match="1 float8_e4m3fn code"):
        PlainForm(codes, torch.ones(2, 1), None, spec)
    with pytest.raises(CheckpointError, match="w.codes: float8_e4m3fn codes that are NaN"):
        decode_codes(codes, spec, 8, "bytes", "w.codes")
    with pytest.raises(ValueError, match="codebook 'e4m3fn': codes are float8_e4m3fn bytes"):
        QuantSpec((1, 8), 0, 15, "none", codebook="e4m3fn")


@settings(**SETTINGS)
@given(m=st.integers(1, 9), n=st.integers(1, 20), k=st.integers(1, 80), dtype=st.sampled_from(FLOATS),
       granularity=st.sampled_from(["row", "tensor"]), w_granularity=st.sampled_from(["row", "tensor"]), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_the_scaled_mm_implementation_keeps_the_ops_contract(m, n, k, dtype, granularity, w_granularity, bias, seed):
    """``torch._scaled_mm`` (the CUDA implementation; it has a CPU kernel too): the same codes and
    scales, fp32 summation order and scale order only."""
    gen = torch.Generator().manual_seed(seed)
    codes, scale = quantize_float8(torch.randn(n, k, generator=gen), w_granularity)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = float8_dynamic_linear_scaled_mm(x, codes, scale, granularity, b)
    ref = torch.ops.torchq.float8_dynamic_linear(x, codes, scale, granularity, b)
    assert y.dtype == ref.dtype == dtype and y.shape == ref.shape
    xq, xs = quantize_float8_activations(x, granularity)
    mag = (xq.double().abs() @ codes.double().abs().T) * xs.double() * scale.double().reshape(1, -1)
    unit = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    bound = (k + 4) * 2.0**-23 * mag + 2 * unit * (ref.double().abs() + mag) + torch.finfo(dtype).tiny
    assert ((y.double() - ref.double()).abs() <= bound).all()
