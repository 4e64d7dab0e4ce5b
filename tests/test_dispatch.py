"""The linear dispatch table, built-in CPU kernels against the reference, fallbacks, explain."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import sqnr
from hypothesis import given, settings
from hypothesis import strategies as st

import torchq
from torchq import dispatch
from torchq.dispatch import dequantized_linear
from torchq.layouts.packed_bits import PackedBitsLayout

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# With torchq's native library, int4 weights pack into Int4NativeLayout and int8 ones run the
# native kernels; without it, PyTorch's aten kernels.
NATIVE = torchq.native.available()
INT4 = "int4_native" if NATIVE else "int4_cpu"
INT8_WO = "int8_weight_only_native" if NATIVE else "int8_weight_only_cpu"
INT8_DYN = "int8_dynamic_native" if NATIVE else "int8_dynamic_cpu"
CONFIGS = {
    "int4_g128": (torchq.int4_weight_only(group_size=128), INT4),
    "int4_g32": (torchq.int4_weight_only(group_size=32), INT4),
    "int4_int_zero": (torchq.int4_weight_only(group_size=64, zero_point_domain="int"), INT4),
    "int4_symmetric": (torchq.int4_weight_only(group_size=64, zero_point_domain="none"), INT4),
    "int8_wo": (torchq.int8_weight_only(), INT8_WO),
    "int8_dyn": (torchq.int8_dynamic_activation_int8_weight(), INT8_DYN),
    "intx2": (torchq.intx_weight_only(bits=2, group_size=32), INT4),
    "intx4_sym": (torchq.intx_weight_only(bits=4, group_size=64, mapping_type="symmetric"), INT4),
}
# Bound on |kernel - reference| relative to the output scale, per input dtype: the kernels and
# the reference round in different places (bf16/fp16 outputs and scales cast to the input dtype).
REL_TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def expected_kernel(kernel, dtype):
    """Every input dtype runs the layout's kernel in its own dtype (no compute_dtype asked)."""
    return kernel


def _close_to_reference(y, ref, dtype, kernel="", x=None, w=None):
    """Max error relative to the output scale, or, given x and w, relative to the accumulation
    bound max(|x| @ |W|^T), which is what rounding errors scale with (robust for tiny outputs)."""
    if x is not None:
        scale = (x.float().abs().reshape(-1, x.shape[-1]) @ w.dequantize(torch.float32).abs().t()).max()
    else:
        scale = ref.float().abs().max()
    err = (y.float() - ref.float()).abs().max() / scale.clamp(min=1e-6)
    assert err <= REL_TOL[dtype], f"max error {float(err):.2e} x output scale"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 7, 32])
def test_builtin_kernels_match_reference(name, dtype, m):
    cfg, kernel = CONFIGS[name]
    w = torch.randn(96, 256, dtype=dtype)
    q = cfg.quantize_weight(w, label=name)
    x = torch.randn(m, 256, dtype=dtype)
    b = torch.randn(96, dtype=dtype)
    report = torchq.explain(q, x)
    kernel = expected_kernel(kernel, dtype)
    assert report.decisions[0].kernel == kernel
    y = F.linear(x, q, b)
    assert y.dtype == dtype and y.shape == (m, 96)
    _close_to_reference(y, dequantized_linear(x, q, b), dtype, kernel)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 80),
    k=st.integers(1, 300),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    name=st.sampled_from(list(CONFIGS)),
    dtype=st.sampled_from(DTYPES),
)
def test_kernels_on_odd_shapes_and_batched_inputs(n, k, lead, name, dtype):
    cfg, kernel = CONFIGS[name]
    torch.manual_seed(n * 1000 + k)
    q = cfg.quantize_weight(torch.randn(n, k, dtype=dtype), label="odd")
    x = torch.randn(*lead, k, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchq.FallbackWarning)  # every built-in config has a kernel
        y = F.linear(x, q)
    assert y.shape == (*lead, n)
    _close_to_reference(y, dequantized_linear(x, q, None), dtype, expected_kernel(kernel, dtype), x, q)


@pytest.mark.parametrize(
    "cfg, floor",
    [
        (torchq.int8_weight_only(), 40),
        (torchq.int8_dynamic_activation_int8_weight(), 35),
        (torchq.int4_weight_only(group_size=128), 18),
        (torchq.int4_weight_only(group_size=32), 20),
    ],
    ids=["int8_wo", "int8_dyn", "int4_g128", "int4_g32"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sqnr_of_quantized_linear_vs_float(cfg, floor, dtype):
    lin = torch.nn.Linear(1024, 512).to(dtype)
    x = torch.randn(16, 1024, dtype=dtype)
    ref = lin(x)
    torchq.quantize_(lin, cfg)
    assert sqnr(ref, lin(x)) >= floor


def test_fallback_warns_once_names_layer_and_reasons():
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    torchq.quantize_(m, torchq.intx_weight_only(bits=3, layout=PackedBitsLayout()))
    x = torch.randn(2, 64)
    with pytest.warns(torchq.FallbackWarning) as rec:
        y1 = m(x)
        m(x)
    msgs = [str(r.message) for r in rec if issubclass(r.category, torchq.FallbackWarning)]
    assert len(msgs) == 2  # once per layer, not per call
    assert "layer '0'" in msgs[0] and "layer '1'" in msgs[1]
    assert "the layout has no linear kernel" in msgs[0]
    ref = dequantized_linear(dequantized_linear(x, m[0].weight, m[0].bias), m[1].weight, m[1].bias)
    assert torch.equal(y1, ref)
    with torchq.strict(), pytest.raises(torchq.NoKernelError, match="layer '0'"):
        m(x)
    torchq.set_strict(True)
    with pytest.raises(torchq.NoKernelError):
        m(x)


def test_register_user_kernel_takes_priority_and_can_be_removed():
    from torchq.layouts import Int4CPULayout, PlainLayout

    calls = []

    def cond(x, w, b):
        return None if x.shape[0] == 3 else f"wants M=3, got {x.shape[0]}"

    def impl(x, w, b):
        calls.append(x.shape)
        return F.linear(x, w.dequantize(x.dtype), b)

    with pytest.raises(TypeError, match="layout: register_linear_kernel needs"):
        torchq.register_linear_kernel("my_kernel", cond, impl)
    k = torchq.register_linear_kernel("my_kernel", cond, impl, description="test", layout=Int4CPULayout)
    try:
        assert torchq.linear_kernels(Int4CPULayout)[0] is k
        assert k not in torchq.linear_kernels(PlainLayout)
        q = torchq.int4_weight_only(group_size=32, layout=torchq.Int4CPULayout()).quantize_weight(torch.randn(16, 64))
        F.linear(torch.randn(3, 64), q)
        assert calls == [torch.Size([3, 64])]
        report = torchq.explain(q, torch.randn(2, 64))
        assert report.decisions[0].kernel == "int4_cpu"
        assert ("my_kernel", "wants M=3, got 2") in report.decisions[0].rejected
        with pytest.raises(ValueError, match="already registered"):
            torchq.register_linear_kernel("my_kernel", cond, impl, layout=Int4CPULayout)
        torchq.register_linear_kernel("my_kernel", lambda x, w, b: False, impl, replace=True, layout=Int4CPULayout)
        assert torchq.explain(q, torch.randn(3, 64)).decisions[0].rejected[0] == ("my_kernel", "condition returned False")
    finally:
        torchq.unregister_linear_kernel("my_kernel")
    assert "my_kernel" not in [k.name for k in torchq.linear_kernels()]
    with pytest.raises(KeyError, match="no linear kernel named"):
        torchq.unregister_linear_kernel("my_kernel")
    with pytest.raises(KeyError, match="before: Int4CPULayout has no kernel named 'nope'"):
        torchq.register_linear_kernel("x", cond, impl, before="nope", layout=Int4CPULayout)
    with pytest.raises(ValueError, match="already one of Int4CPULayout's kernels"):
        torchq.register_linear_kernel("int4_cpu", cond, impl, layout=Int4CPULayout)


def test_kernels_take_their_place_in_a_layouts_list():
    from torchq.layouts import PlainLayout

    def impl(x, w, b):
        return F.linear(x, w.dequantize(x.dtype), b)

    names = [k.name for k in torchq.linear_kernels(PlainLayout)]
    torchq.register_linear_kernel("after_native", lambda x, w, b: None, impl, layout=PlainLayout, after=names[0])
    torchq.register_linear_kernel("everywhere", lambda x, w, b: "no", impl, layout=torchq.ALL_LAYOUTS)
    try:
        walk = [k.name for k in torchq.linear_kernels(PlainLayout)]
        assert walk == ["everywhere", names[0], "after_native", *names[1:]]
        assert "everywhere" in [k.name for k in torchq.linear_kernels(torchq.Int4CPULayout)]
        with torchq.native.disabled():
            q = torchq.int8_weight_only().quantize_weight(torch.randn(8, 16))
            assert torchq.explain(q, torch.randn(1, 16)).decisions[0].kernel == "after_native"
        with pytest.raises(ValueError, match="before/after: only a kernel registered for one layout"):
            torchq.register_linear_kernel("x", lambda x, w, b: None, impl, layout=torchq.ALL_LAYOUTS, before=names[0])
    finally:
        torchq.unregister_linear_kernel("after_native")
        torchq.unregister_linear_kernel("everywhere")
    assert [k.name for k in torchq.linear_kernels(PlainLayout)] == names
    # a layout's own kernel can be removed and put back
    k = torchq.unregister_linear_kernel("int8_weight_only_cpu", layout=PlainLayout)
    try:
        assert "int8_weight_only_cpu" not in [k.name for k in torchq.linear_kernels(PlainLayout)]
    finally:
        torchq.register_linear_kernel(k.name, k.condition, k.impl, layout=PlainLayout, before="int8_dynamic_cpu")
    assert [k.name for k in torchq.linear_kernels(PlainLayout)] == names


def test_condition_returning_garbage_is_a_clear_error():
    torchq.register_linear_kernel("bad", lambda x, w, b: 3, lambda x, w, b: x, layout=torchq.ALL_LAYOUTS)
    try:
        q = torchq.int8_weight_only().quantize_weight(torch.randn(8, 8))
        with pytest.raises(TypeError, match="condition must return"):
            F.linear(torch.randn(1, 8), q)
    finally:
        torchq.unregister_linear_kernel("bad")


def test_input_validation_errors_name_the_layer():
    q = torchq.int8_weight_only().quantize_weight(torch.randn(8, 16), label="proj")
    with pytest.raises(ValueError, match="layer 'proj'.*in_features=16"):
        F.linear(torch.randn(2, 15), q)
    with pytest.raises(TypeError, match="layer 'proj'.*floating"):
        F.linear(torch.ones(2, 16, dtype=torch.int32), q)
    with pytest.raises(ValueError, match="bias must have shape"):
        F.linear(torch.randn(2, 16), q, torch.randn(7))


def test_empty_batch_and_mixed_dtype_input():
    q = torchq.int4_weight_only(group_size=32).quantize_weight(torch.randn(16, 64, dtype=torch.bfloat16))
    assert F.linear(torch.randn(0, 64, dtype=torch.bfloat16), q).shape == (0, 16)
    y = F.linear(torch.randn(2, 64), q)  # fp32 input on a bf16 weight: computes and returns fp32
    assert y.dtype == torch.float32


def test_explain_model_table_and_no_input_mode():
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    torchq.quantize_(m, {"0": torchq.int8_weight_only(), "2": torchq.intx_weight_only(bits=3, layout=PackedBitsLayout())})
    with pytest.warns(torchq.FallbackWarning):
        report = torchq.explain(m, torch.randn(2, 64))
    assert report.kernels() == {"0": INT8_WO if NATIVE else "int8_weight_only_cpu", "2": "FALLBACK: dequantize + F.linear"}
    text = str(report)
    assert "Int8WeightOnlyConfig" in text and "PackedBitsLayout" in text and "compute float32" in text
    static = torchq.explain(m)
    assert static.kernels() == report.kernels()
    assert static.to_dict()[0]["layer"] == "0"
    with pytest.raises(TypeError, match="nn.Module or an AffineQuantizedTensor"):
        torchq.explain(42)


def test_gradient_flows_to_input_and_bias_through_frozen_weight():
    lin = torch.nn.Linear(64, 32)
    torchq.quantize_(lin, torchq.int4_weight_only(group_size=32))
    x = torch.randn(4, 64, requires_grad=True)
    lin(x).square().sum().backward()
    assert x.grad is not None and lin.bias.grad is not None
    xr = x.detach().clone().requires_grad_(True)
    br = lin.bias.detach().clone().requires_grad_(True)
    F.linear(xr, lin.weight.dequantize(), br).square().sum().backward()
    assert torch.allclose(x.grad, xr.grad, rtol=1e-3, atol=1e-3)
    assert torch.allclose(lin.bias.grad, br.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_only_gradient_skips_the_autograd_function(dtype, monkeypatch):
    """An input without grad and a bias that wants one (an nn.Linear outside no_grad): the kernel
    runs without the autograd Function, the bias gets its gradient from the addition, and the
    output is the one the Function path gives (bias added after the kernel's rounding)."""
    lin = torch.nn.Linear(64, 32).to(dtype)
    torchq.quantize_(lin, torchq.int4_weight_only(group_size=32))
    x = torch.randn(3, 64, dtype=dtype)
    applied = []
    real_apply = dispatch._QuantizedLinearGrad.apply
    monkeypatch.setattr(dispatch._QuantizedLinearGrad, "apply", lambda *a: applied.append(1) or real_apply(*a))
    y = lin(x)
    assert not applied and y.requires_grad
    y.float().square().sum().backward()
    with torch.no_grad():
        kernel_only = F.linear(x, lin.weight)
    assert torch.equal(y.detach(), kernel_only + lin.bias.detach())
    assert torch.equal(lin.bias.grad, (2 * y.detach().float()).sum(0).to(dtype))
    xg = x.clone().requires_grad_(True)  # an input that wants a gradient still takes the Function
    assert torch.equal(lin(xg).detach(), y.detach()) and applied


# -- the kernel-choice cache -----------------------------------------------------------------------

def _counting_kernel(name: str, calls: list, accept=lambda x: True):
    def cond(x, w, b):
        calls.append(("cond", x.dtype, tuple(x.shape)))
        return None if accept(x) else "declined"

    def impl(x, w, b):
        calls.append(("impl", x.dtype, tuple(x.shape)))
        return F.linear(x, w.dequantize(x.dtype), b)

    return torchq.register_linear_kernel(name, cond, impl, layout=torchq.ALL_LAYOUTS)


def test_kernel_choice_is_cached_per_weight_and_input_signature():
    calls: list = []
    _counting_kernel("counting", calls)
    try:
        q = torchq.int8_weight_only().quantize_weight(torch.randn(8, 16))
        x = torch.randn(2, 16)
        for _ in range(3):
            F.linear(x, q)
        assert [c[0] for c in calls] == ["cond", "impl", "impl", "impl"]  # asked once, run three times
        calls.clear()
        F.linear(torch.randn(3, 16), q)  # new shape
        F.linear(x.to(torch.bfloat16), q)  # new dtype
        F.linear(x, q, torch.randn(8))  # with a bias
        assert [c[0] for c in calls] == ["cond", "impl"] * 3
        calls.clear()
        q2 = torchq.int8_weight_only().quantize_weight(torch.randn(8, 16))  # another weight: its own entry
        F.linear(x, q2)
        assert [c[0] for c in calls] == ["cond", "impl"]
    finally:
        torchq.unregister_linear_kernel("counting")


def test_table_changes_and_state_providers_invalidate_the_cache():
    q = torchq.int8_weight_only().quantize_weight(torch.randn(8, 16))
    x = torch.randn(1, 16)
    F.linear(x, q)  # cache the built-in choice
    calls: list = []
    _counting_kernel("late", calls)  # registering clears the cache: the new kernel wins at once
    try:
        F.linear(x, q)
        assert [c[0] for c in calls] == ["cond", "impl"]
    finally:
        torchq.unregister_linear_kernel("late")
    calls.clear()
    F.linear(x, q)  # unregistered: not called from a stale cache entry
    assert calls == []

    flag = [False]
    torchq.dispatch.add_selection_state(lambda: flag[0])
    try:
        _counting_kernel("flagged", calls, accept=lambda x: flag[0])
        F.linear(x, q)
        F.linear(x, q)
        assert [c[0] for c in calls] == ["cond"]  # declined once, the built-in kernel cached
        flag[0] = True  # part of the key: asked again, now accepts
        F.linear(x, q)
        assert [c[0] for c in calls] == ["cond", "cond", "impl"]
    finally:
        torchq.dispatch._STATE_PROVIDERS.pop()
        torchq.unregister_linear_kernel("flagged")


@pytest.mark.skipif(not NATIVE, reason="needs the native library")
def test_native_disabled_is_part_of_the_cache_key():
    q = torchq.int8_weight_only().quantize_weight(torch.randn(16, 64))
    x = torch.randn(1, 64)
    F.linear(x, q)
    with torchq.native.disabled():
        F.linear(x, q)
    F.linear(x, q)
    chosen = torchq.dispatch._KERNEL_CACHE.get(q.tensor_impl)
    assert sorted(p.kernel.name for p in chosen.values()) == ["int8_weight_only_cpu", "int8_weight_only_native"]


def test_invalid_inputs_are_never_cached_and_dead_weights_leave_the_cache():
    import gc

    q = torchq.int8_weight_only().quantize_weight(torch.randn(8, 16), label="proj")
    F.linear(torch.randn(2, 16), q)
    with pytest.raises(ValueError, match="in_features=16"):
        F.linear(torch.randn(2, 15), q)
    with pytest.raises(ValueError, match="bias must have shape"):
        F.linear(torch.randn(2, 16), q, torch.randn(7))
    with pytest.raises(ValueError, match="bias must have shape"):  # still raised the second time
        F.linear(torch.randn(2, 16), q, torch.randn(7))
    before = len(torchq.dispatch._KERNEL_CACHE)
    del q
    gc.collect()
    assert len(torchq.dispatch._KERNEL_CACHE) == before - 1


def test_explain_says_why_automatic_layout_choice_passed_over_layouts():
    auto = torch.nn.Sequential(torch.nn.Linear(64, 32))
    torchq.quantize_(auto, torchq.int8_weight_only())
    report = torchq.explain(auto, torch.randn(2, 64))
    passed_over = dict(report.decisions[0].layouts_passed_over)
    expected = torchq.layouts.layout_rejections(auto[0].weight.tensor_impl.spec, (32, 64), torch.float32, "cpu")
    ahead = list(expected)[:list(expected).index(auto[0].weight.quant_layout.name)]
    assert passed_over == {name: expected[name] for name in ahead} and all(passed_over.values())
    assert "layout chosen automatically" in str(report) and report.to_dict()[0]["layouts_passed_over"] == passed_over
    named = torch.nn.Sequential(torch.nn.Linear(64, 32))
    torchq.quantize_(named, torchq.int8_weight_only(layout=torchq.layouts.PlainLayout()))
    report = torchq.explain(named, torch.randn(2, 64))
    assert report.decisions[0].layouts_passed_over == [] and "layout chosen automatically" not in str(report)
