"""Static activation quantization: the StaticInt8 scheme, the int8_static_linear op's reference,
the config, observers (against PyTorch's own), torchq.static.prepare / convert, SmoothQuant (folds
into norms, refused folds, int8 dynamic), checkpoints, explain and compile."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import torchq
from torchq import native
from torchq.activation import StaticInt8, activation_from_json
from torchq.algorithms import CalibrationRequired
from torchq.configs import config_from_json

SETTINGS = dict(deadline=None, max_examples=30)


# -- the scheme ------------------------------------------------------------------------------------
def test_from_range_asymmetric_and_symmetric():
    a = StaticInt8.from_range(-1.0, 3.0)
    assert a.quant_min == -127 and a.quant_max == 127
    assert a.scale == float(torch.tensor(4.0 / 254, dtype=torch.float32))
    codes, _ = a.quantize(torch.tensor([[-1.0, 0.0, 3.0]]))
    assert codes.tolist() == [[-127, a.zero_point, 127]]
    assert a.fake_quantize(torch.zeros(1, 4)).abs().max() == 0  # zero is exact
    sym = StaticInt8.from_range(-1.0, 3.0, symmetric=True)
    assert sym.zero_point == 0 and sym.scale == float(torch.tensor(3.0 / 127, dtype=torch.float32))
    pos = StaticInt8.from_range(0.5, 2.0)  # widened to hold zero
    assert pos.zero_point == -127
    assert StaticInt8.from_range(0.0, 0.0).scale == 2.0**-126


@pytest.mark.parametrize("kwargs, match", [
    (dict(scale=0.0), "scale"), (dict(scale=float("nan")), "scale"), (dict(scale=float("inf")), "scale"),
    (dict(scale=-1.0), "scale"), (dict(scale=True), "scale"), (dict(scale=1.0, zero_point=128), "zero_point"),
    (dict(scale=1.0, zero_point=1.5), "zero_point"), (dict(scale=1.0, quant_min=-129), "quant_min"),
    (dict(scale=1.0, quant_min=5, quant_max=5, zero_point=5), "quant_min"), (dict(scale=1e-40), "scale"),
])
def test_bad_schemes_are_refused_by_name(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        StaticInt8(**kwargs)
    with pytest.raises(ValueError, match="lo, hi"):
        StaticInt8.from_range(float("nan"), 1.0)


def test_json_round_trip_and_bad_json():
    a = StaticInt8.from_range(-0.3, 7.1)
    assert activation_from_json(a.to_json()) == a
    for bad in ({**a.to_json(), "extra": 1}, {**a.to_json(), "scale": "x"}, {**a.to_json(), "zero_point": 300},
                {k: v for k, v in a.to_json().items() if k != "scale"}):
        with pytest.raises(ValueError, match="static_int8"):
            activation_from_json(bad)


def test_quantize_saturates_inf_and_flags_nan_rows():
    a = StaticInt8(0.5, 3)
    x = torch.tensor([[float("inf"), float("-inf"), 1e30, -1e30], [1.0, float("nan"), 2.0, 0.0], [0.25, 0.75, -0.25, 100.0]])
    codes, scale = a.quantize(x)
    assert codes[0].tolist() == [127, -127, 127, -127]
    assert torch.isnan(scale[1]).all() and scale[0].item() == 0.5 and scale[2].item() == 0.5
    assert codes[2].tolist() == [3 + 0, 3 + 2, 3 + 0, 127]  # ties to even: 0.5 -> 0, 1.5 -> 2, -0.5 -> 0


@settings(**SETTINGS)
@given(lo=st.floats(-1e4, 0.0), width=st.floats(1e-6, 1e4), symmetric=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_fake_quantize_error_within_half_a_step_inside_the_range(lo, width, symmetric, seed):
    hi = lo + width
    a = StaticInt8.from_range(lo, hi, symmetric=symmetric)
    x = torch.empty(64, 32).uniform_(lo, hi, generator=torch.Generator().manual_seed(seed))
    err = (a.fake_quantize(x) - x).abs().max().item()
    assert err <= a.scale * 0.5 * (1 + 1e-5) + 1e-6 * max(abs(lo), abs(hi))


# -- the op's reference ----------------------------------------------------------------------------
@settings(**SETTINGS)
@given(m=st.integers(1, 9), n=st.integers(1, 20), k=st.integers(1, 70), z=st.integers(-127, 127),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**31 - 1))
def test_reference_is_the_zero_point_shifted_integer_product(m, n, k, z, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) / 50
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    a = StaticInt8(0.05, z)
    with native.disabled():
        y = torch.ops.torchq.int8_static_linear(x, codes, scale, a.scale, z, -127, 127, None)
    q, _ = a.quantize(x)
    acc = (q.long() - z) @ codes.long().t()  # exact
    want = ((acc.to(torch.int32).float() * a.scale) * scale).to(dtype)
    assert torch.equal(y, want)


def test_op_checks_arguments_by_name():
    codes = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="zero_point"):
        torch.ops.torchq.int8_static_linear(torch.zeros(2, 8), codes, torch.ones(4), 0.1, 200, -127, 127, None)
    with pytest.raises(ValueError, match="scale"):
        torch.ops.torchq.int8_static_linear(torch.zeros(2, 8), codes, torch.ones(4), -0.1, 0, -127, 127, None)
    with pytest.raises(ValueError, match="last dimension"):
        torch.ops.torchq.int8_static_linear(torch.zeros(2, 7), codes, torch.ones(4), 0.1, 0, -127, 127, None)


# -- the config --------------------------------------------------------------------------------------
def test_config_needs_calibration_and_round_trips():
    cfg = torchq.int8_static_activation_int8_weight(observer="percentile", percentile=99.9)
    assert config_from_json(cfg.to_json_str()) == cfg
    with pytest.raises(CalibrationRequired, match="torchq.static.prepare"):
        cfg.quantize_weight(torch.randn(8, 16))
    model = nn.Sequential(nn.Linear(16, 8))
    before = model[0].weight
    with pytest.raises(torchq.QuantizationError):
        torchq.quantize_(model, cfg)
    assert model[0].weight is before
    done = torchq.Int8StaticActivationInt8WeightConfig(activation=StaticInt8(0.02, -5))
    assert config_from_json(done.to_json()) == done
    for bad, match in ((dict(observer="max"), "observer"), (dict(percentile=10), "percentile"),
                       (dict(averaging_constant=0), "averaging_constant"), (dict(symmetric=1), "symmetric"),
                       (dict(activation=torchq.PerTokenInt8()), "activation")):
        with pytest.raises((ValueError, TypeError), match=match):
            torchq.Int8StaticActivationInt8WeightConfig(**bad)


def _calibrated_linear(k=64, n=48, z=-9, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n)
    cfg = torchq.Int8StaticActivationInt8WeightConfig(activation=StaticInt8(0.03, z))
    torchq.quantize_(lin, cfg, filter_fn=lambda m, name: isinstance(m, nn.Linear))
    return lin


@pytest.mark.parametrize("m", [1, 3, 40, 300])
def test_quantized_linear_native_equals_reference(m):
    lin = _calibrated_linear()
    x = torch.randn(m, 64) * 2
    y = lin(x)
    w = lin.weight
    with native.disabled():
        want = lin(x)
    assert torch.equal(y, want)
    report = torchq.explain(lin, x)
    text = str(report)
    assert "static int8 activations (scale 0.03" in text and "zero point -9" in text
    if native.available():
        assert "int8_static_native" in text
    assert w.act_quant == StaticInt8(0.03, -9)


def test_checkpoints_keep_the_activation_scheme(tmp_path):
    lin = _calibrated_linear()
    x = torch.randn(5, 64)
    y = lin(x)
    buf = io.BytesIO()
    torch.save(lin.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state["weight"].act_quant == lin.weight.act_quant
    torchq.save_quantized(lin, tmp_path / "m")
    fresh = nn.Linear(64, 48)
    torchq.load_quantized(fresh, tmp_path / "m")
    assert fresh.weight.act_quant == lin.weight.act_quant
    assert torch.equal(fresh(x), y)


def test_compiles_fullgraph():
    lin = _calibrated_linear()
    x = torch.randn(4, 64)
    want = lin(x)
    got = torch.compile(lin, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, want)


# -- observers against PyTorch's ---------------------------------------------------------------------
class _Net(nn.Module):
    """norm -> (q, k) sharing one input; then a second linear on q's output; a post-norm residual
    (the norm's output also added back) when ``residual``."""

    def __init__(self, k=32, residual=False):
        super().__init__()
        self.norm = nn.LayerNorm(k)
        self.q = nn.Linear(k, k)
        self.k = nn.Linear(k, k)
        self.out = nn.Linear(k, 16)
        self.residual = residual

    def forward(self, x):
        h = self.norm(x)
        a = F.gelu(self.q(h)) + self.k(h)
        if self.residual:
            a = a + h
        return self.out(a)


def _batches(k=32, n=6, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(3, 10, k, generator=g)
        if outliers:
            x[..., 3] *= 40  # an outlier channel (LayerNorm's output keeps it through its weight)
        out.append(x)
    return out


def _with_outlier_norm(net):
    with torch.no_grad():
        net.norm.weight[5] = 30.0  # an outlier channel after the norm, as LLMs have
    return net


@pytest.mark.parametrize("observer", ["minmax", "moving_average"])
def test_observers_match_pytorch(observer):
    torch.manual_seed(0)
    net = _with_outlier_norm(_Net())
    cfg = torchq.int8_static_activation_int8_weight(observer=observer, averaging_constant=0.2)
    torchq.static.prepare(net, cfg)
    ob = (torch.ao.quantization.MinMaxObserver() if observer == "minmax"
          else torch.ao.quantization.MovingAverageMinMaxObserver(averaging_constant=0.2))
    for b in _batches():
        net(b)
        ob(net.norm(b).detach())
    report = torchq.static.convert(net)
    row = {r.name: r for r in report.layers}
    want = StaticInt8.from_range(float(ob.min_val), float(ob.max_val))
    assert row["q"].activation == want and row["k"].activation == want  # one site: the shared input
    assert net.q.weight.act_quant == want
    assert row["out"].activation != want


class _Masked(nn.Module):
    """A linear called as a transformers model is: ``model(x, attention_mask=mask)``."""

    def __init__(self, k=8):
        super().__init__()
        self.proj = nn.Linear(k, 4)

    def forward(self, x, attention_mask=None):
        return self.proj(x)


@pytest.mark.parametrize("ignore_padding", [True, False])
def test_padding_positions_are_not_observed(ignore_padding):
    torch.manual_seed(0)
    x = torch.rand(2, 5, 8) * 2 - 1  # real tokens in [-1, 1]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    x[0, 3], x[0, 4] = 500.0, 1000.0  # the padding positions: never used, far outside the real range
    real = x[mask.bool()]
    net = _Masked()
    torchq.static.prepare(net, torchq.int8_static_activation_int8_weight(), ignore_padding=ignore_padding)
    net(x, attention_mask=mask)
    net(x[:, :4], attention_mask=mask)  # a mask of another shape than the input's tokens: observed whole
    row = torchq.static.convert(net).layers[0]
    if ignore_padding:  # the second call (no usable mask) saw position 3 of row 0 (500), never position 4 (1000)
        assert row.activation == StaticInt8.from_range(float(real.amin()), 500.0)
    else:
        assert row.activation == StaticInt8.from_range(float(x.amin()), float(x.amax()))


def test_a_batch_of_padding_only_adds_nothing():
    net = _Masked()
    torchq.static.prepare(net)
    x = torch.rand(1, 3, 8)
    net(x, attention_mask=torch.ones(1, 3, dtype=torch.long))
    net(torch.full((1, 3, 8), 1e6), attention_mask=torch.zeros(1, 3, dtype=torch.long))
    row = torchq.static.convert(net).layers[0]
    assert row.activation == StaticInt8.from_range(float(x.amin()), float(x.amax()))


def test_percentile_observer_on_a_full_sample():
    torch.manual_seed(0)
    net = _Net()
    torchq.static.prepare(net, torchq.int8_static_activation_int8_weight(observer="percentile", percentile=99.0),
                          sample_tokens=10_000)
    seen = []
    for b in _batches():
        net(b)
        seen.append(net.norm(b).detach().reshape(-1))
    report = torchq.static.convert(net)
    flat = torch.cat(seen)
    n = flat.numel()
    hi = flat.kthvalue(int(torch.tensor(0.99 * n).ceil())).values.item()
    lo = flat.kthvalue(n - int(torch.tensor(0.99 * n).ceil()) + 1).values.item()
    assert report.layers[0].activation == StaticInt8.from_range(lo, hi)
    assert hi < flat.max().item()  # clipped


def test_reservoir_sample_is_uniform():
    from torchq.static import _Site

    site = _Site(1, 100, 0.01, torch.Generator().manual_seed(0))
    for i in range(100):
        site.observe(torch.arange(i * 100, (i + 1) * 100, dtype=torch.float32).reshape(-1, 1))
    picked = site.sample.reshape(-1)
    assert picked.numel() == 100 and picked.unique().numel() == 100
    assert 3500 < picked.mean().item() < 6500  # the mean of 0..9999 is 4999.5; not the first rows


def test_static_model_is_close_to_float_and_runs_the_static_kernels():
    torch.manual_seed(0)
    net = _Net()
    data = _batches(outliers=False)
    with torch.no_grad():
        ref = [net(b) for b in data]
    torchq.static.prepare(net)
    assert set(torchq.static.prepared_layers(net)) == {"q", "k", "out"}
    for b in data:
        net(b)
    torchq.static.convert(net)
    assert torchq.static.prepared_layers(net) == {}
    for b, r in zip(data, ref):
        y = net(b)
        assert (y - r).norm() / r.norm() < 0.03


# -- errors and atomicity ------------------------------------------------------------------------------
def test_prepare_and_convert_refuse_bad_use():
    net = _Net()
    with pytest.raises(ValueError, match="nothing to calibrate"):
        torchq.static.prepare(net, torchq.int8_weight_only())
    with pytest.raises(ValueError, match="nothing to calibrate"):
        torchq.static.prepare(net, torchq.int8_dynamic_activation_int8_weight())  # dynamic needs smoothquant
    with pytest.raises(ValueError, match="algorithm"):
        torchq.static.prepare(net, algorithm="awq")
    with pytest.raises(ValueError, match="alpha"):
        torchq.static.prepare(net, alpha=0.5)
    with pytest.raises(ValueError, match="ignore_padding: expected a bool, got 'yes'"):
        torchq.static.prepare(net, ignore_padding="yes")
    with pytest.raises(ValueError, match="not prepared"):
        torchq.static.convert(net)
    torchq.static.prepare(net)
    with pytest.raises(ValueError, match="already prepared"):
        torchq.static.prepare(net)
    net.q(torch.randn(2, 32))  # only q ran
    with pytest.raises(ValueError, match=r"saw no calibration input: \['k', 'out'\]"):
        torchq.static.convert(net)
    net(torch.full((2, 32), float("nan")))
    with pytest.raises(ValueError, match="inf or NaN"):
        torchq.static.convert(net)
    torchq.static.unprepare(net)
    assert not net.q._forward_pre_hooks and isinstance(net.q.weight, nn.Parameter)


def test_failed_convert_leaves_the_model_as_it_was(monkeypatch):
    torch.manual_seed(0)
    net = _with_outlier_norm(_Net())
    state = {k: v.clone() for k, v in net.state_dict().items()}
    params = {k: p for k, p in net.named_parameters()}
    torchq.static.prepare(net, algorithm="smoothquant")
    for b in _batches():
        net(b)

    def boom(*a, **k):
        raise torchq.QuantizationError("injected")

    monkeypatch.setattr(torchq.static, "quantize_", boom)
    with pytest.raises(torchq.QuantizationError, match="injected"):
        torchq.static.convert(net)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())
    assert all(p is dict(net.named_parameters())[k] for k, p in params.items())
    assert torchq.static.prepared_layers(net)  # still prepared
    monkeypatch.undo()
    torchq.static.convert(net)  # and converts afterwards


# -- SmoothQuant ---------------------------------------------------------------------------------------
def _calibrated(net, data, **kwargs):
    torchq.static.prepare(net, kwargs.pop("config", None), **kwargs)
    for b in data:
        net(b)
    return torchq.static.convert(net)


def _error(net, data, ref):
    with torch.no_grad():
        return sum(((net(b) - r).norm() / r.norm()).item() for b, r in zip(data, ref)) / len(data)


def test_smoothquant_folds_into_the_norm_and_beats_plain_static():
    torch.manual_seed(0)
    base = _with_outlier_norm(_Net())
    data = _batches()
    with torch.no_grad():
        ref = [base(b) for b in data]
    import copy

    plain, smooth = copy.deepcopy(base), copy.deepcopy(base)
    _calibrated(plain, data)
    report = _calibrated(smooth, data, algorithm="smoothquant")
    rows = {r.name: r for r in report.layers}
    assert rows["q"].smoothing == "norm norm" and rows["k"].smoothing == "norm norm"
    assert rows["q"].error < rows["q"].unsmoothed_error
    assert smooth.q.weight.input_scale is None  # folded: nothing left to multiply at run time
    assert rows["out"].smoothing in ("-", "input_scale")
    assert not torch.equal(smooth.norm.weight, base.norm.weight)
    assert _error(smooth, data, ref) < 0.7 * _error(plain, data, ref)
    assert "alpha" in report.table()


def test_smoothquant_refuses_a_fold_the_residual_would_see():
    torch.manual_seed(0)
    net = _with_outlier_norm(_Net(residual=True))
    data = _batches()
    with torch.no_grad():
        ref = [net(b) for b in data]
    norm_before = net.norm.weight.detach().clone()
    report = _calibrated(net, data, algorithm="smoothquant", alpha=0.5)
    rows = {r.name: r for r in report.layers}
    assert rows["q"].smoothing == "input_scale" and rows["q"].alpha == 0.5
    assert torch.equal(net.norm.weight, norm_before)  # the norm is untouched
    assert net.q.weight.input_scale is not None and net.k.weight.input_scale is not None
    assert _error(net, data, ref) < 0.05


def test_smoothquant_composes_with_int8_dynamic():
    torch.manual_seed(0)
    base = _with_outlier_norm(_Net())
    data = _batches()
    with torch.no_grad():
        ref = [base(b) for b in data]
    import copy

    dyn = copy.deepcopy(base)
    torchq.quantize_(dyn, torchq.int8_dynamic_activation_int8_weight())
    smooth = copy.deepcopy(base)
    report = _calibrated(smooth, data, config=torchq.int8_dynamic_activation_int8_weight(), algorithm="smoothquant")
    assert all(r.activation is None for r in report.layers)
    assert isinstance(smooth.q.weight.act_quant, torchq.PerTokenInt8)
    assert _error(smooth, data, ref) <= _error(dyn, data, ref) * 1.0001


def test_smoothquant_on_transformers_llama_folds_into_rmsnorms_and_saves(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    data = [torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad():
        ref = [model(b).logits for b in data]
    with pytest.warns(RuntimeWarning, match="lm_head"):
        report = _calibrated(model, data, algorithm="smoothquant")
    rows = {r.name: r for r in report.layers}
    assert rows["model.layers.0.self_attn.q_proj"].smoothing == "norm model.layers.0.input_layernorm"
    assert rows["model.layers.1.mlp.up_proj"].smoothing == "norm model.layers.1.post_attention_layernorm"
    assert rows["model.layers.0.mlp.down_proj"].smoothing in ("-", "input_scale")
    with torch.no_grad():
        out = [model(b).logits for b in data]
    err = sum(((o - r).norm() / r.norm()).item() for o, r in zip(out, ref)) / len(ref)
    assert err < 0.05
    model.save_pretrained(tmp_path / "sq")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sq")
    assert loaded.model.layers[0].self_attn.q_proj.weight.act_quant == model.model.layers[0].self_attn.q_proj.weight.act_quant
    with torch.no_grad():
        assert torch.equal(loaded(data[0]).logits, out[0])


# -- review cases: outputs the replay must read, atomicity after quantize_, reused buffers, odd norms,
# -- tied layers, hostile JSON, exact percentiles ----------------------------------------------------
def test_a_fold_is_refused_when_the_model_returns_a_dataclass():
    import dataclasses as dc

    @dc.dataclass
    class Out:
        y: torch.Tensor

    class Wrapped(_Net):
        def forward(self, x):
            return Out(super().forward(x))

    torch.manual_seed(0)
    net = _with_outlier_norm(Wrapped(residual=True))
    data = _batches()
    with torch.no_grad():
        ref = [net(b).y for b in data]
    report = _calibrated(net, data, algorithm="smoothquant", alpha=0.5)
    assert {r.name: r for r in report.layers}["q"].smoothing == "input_scale"
    with torch.no_grad():
        assert sum(((net(b).y - r).norm() / r.norm()).item() for b, r in zip(data, ref)) / len(ref) < 0.05


def test_a_failure_after_quantize_puts_every_weight_back(monkeypatch):
    torch.manual_seed(0)
    net = _with_outlier_norm(_Net(residual=True))  # no fold: the smoothed layers get input_scale
    params = dict(net.named_parameters())
    state = {k: v.clone() for k, v in net.state_dict().items()}
    torchq.static.prepare(net, algorithm="smoothquant", alpha=0.5)
    for b in _batches():
        net(b)

    orig = torchq.AffineQuantizedTensor._replace

    def boom(self, *a, **kw):
        if "input_scale" in kw:
            raise RuntimeError("injected after quantize_")
        return orig(self, *a, **kw)

    monkeypatch.setattr(torchq.AffineQuantizedTensor, "_replace", boom)
    with pytest.raises(RuntimeError, match="injected"):
        torchq.static.convert(net)
    assert all(p is dict(net.named_parameters())[k] for k, p in params.items())
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())
    assert torchq.static.prepared_layers(net)


def test_prepare_refuses_weights_it_cannot_quantize():
    net = _Net()
    net.out.double()
    with pytest.raises(ValueError, match="'out'.*not fp32 / bf16 / fp16"):
        torchq.static.prepare(net)
    assert not net.q._forward_pre_hooks


def test_a_reused_input_buffer_is_observed_every_batch():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4))
    torchq.static.prepare(net)
    buf = torch.empty(5, 8)
    for scale in (1.0, 10.0, 100.0):
        buf.copy_(torch.linspace(-scale, scale, 40).reshape(5, 8))
        net(buf)
    report = torchq.static.convert(net)
    assert report.layers[0].activation == StaticInt8.from_range(-100.0, 100.0)
    assert report.layers[0].tokens == 15


def test_a_norm_whose_weight_is_not_per_feature_is_not_folded():
    class Grouped(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(4, 4)  # channels on dim 1, the linear reads dim -1
            self.lin = nn.Linear(16, 8)

        def forward(self, x):
            return self.lin(self.norm(x))

    torch.manual_seed(0)
    net = Grouped()
    data = [torch.randn(2, 4, 16) for _ in range(3)]
    report = _calibrated(net, data, algorithm="smoothquant", alpha=0.5)
    assert report.layers[0].smoothing == "input_scale"


def test_tied_layers_fed_different_inputs_share_one_scheme():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x) * 3)

    torch.manual_seed(0)
    net = Tied()
    report = _calibrated(net, [torch.randn(4, 16) for _ in range(3)])
    acts = {r.name: r.activation for r in report.layers}
    assert acts["a"] == acts["b"] and net.a.weight is net.b.weight


def test_hostile_static_json_is_refused_cleanly():
    from torchq.checkpoint.codec import CheckpointError  # noqa: F401  (the codec's error type exists)

    for scale in (10**400, 1e300, -0.0, float("nan")):
        with pytest.raises(ValueError, match="static_int8"):
            activation_from_json({"type": "static_int8", "scale": scale, "zero_point": 0, "quant_min": -127, "quant_max": 127})
    with pytest.raises(ValueError):
        activation_from_json({"type": "static_int8", "scale": 1.0, "zero_point": 10**30, "quant_min": -127, "quant_max": 127})


@pytest.mark.parametrize("p, n_rows", [(99.9, 125), (99.0, 50), (95.5, 8)])
def test_percentile_is_the_exact_inverted_cdf(p, n_rows):
    """The p-th percentile is the ceil(p n / 100)-th smallest value, in exact arithmetic (numpy's
    inverted_cdf computes p / 100 * n in floating point: 99.9 / 100 * 1000 = 999.0000000000001,
    so it returns the maximum where the definition gives the 999th value)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4))
    torchq.static.prepare(net, torchq.int8_static_activation_int8_weight(observer="percentile", percentile=p),
                          sample_tokens=10_000)
    x = torch.randn(n_rows, 8)  # n_rows * 8 values: p / 100 * n is a whole number for the first two
    net(x)
    report = torchq.static.convert(net)
    flat = x.reshape(-1).sort().values
    n = flat.numel()
    k = -(-(round(p * 10) * n) // 1000)  # ceil(p n / 100), in integers
    hi, lo = flat[k - 1].item(), flat[n - k].item()
    assert hi < flat[-1].item()  # something is clipped
    assert report.layers[0].activation == StaticInt8.from_range(lo, hi)


def test_reservoir_inclusion_is_uniform_by_decile():
    """Over many seeds every tenth of the stream is sampled equally often (chi-square, 9 dof)."""
    from torchq.static import _Site

    counts = torch.zeros(10)
    for seed in range(300):
        site = _Site(1, 10, 0.01, torch.Generator().manual_seed(seed))
        for i in range(10):
            site.observe(torch.arange(i * 100, (i + 1) * 100, dtype=torch.float32).reshape(-1, 1))
        counts += torch.bincount((site.sample.reshape(-1) // 100).long(), minlength=10).float()
    expected = counts.sum() / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert counts.sum() == 3000 and chi2 < 27.9  # p = 0.001 for 9 degrees of freedom


def test_the_range_search_clips_a_heavy_tail():
    """Laplace inputs: the observed range is set by rare extremes, and a clipped range quantizes the
    bulk finely enough to lower the output error (the search without smoothing, as a tied layer's)."""
    from torchq.static import _Site, _smoothing

    torch.manual_seed(0)
    site = _Site(32, 4096, 0.01, torch.Generator().manual_seed(0))
    site.observe(torch.distributions.Laplace(0.0, 1.0).sample((4096, 32)))
    weights = {"lin": torch.randn(16, 32)}
    configs = {"lin": torchq.int8_static_activation_int8_weight()}
    s, alpha, clip, err, base = _smoothing(site, weights, configs, None, 21, smooth=False)
    assert s is None and alpha is None
    assert clip < 1.0 and err < base
