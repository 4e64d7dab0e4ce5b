"""``torchq.dispatch.DirectLinear``: ``F.linear`` on a quantized weight for a caller that owns the
call site (vLLM's ``apply``), calling the dispatch's cached bound form directly after a signature's
first call.

* every native config gives ``F.linear``'s bits, for 1-D to 3-D inputs, every float dtype, with
  and without bias, and the repeated calls do take the bound form;
* everything that changes the dispatch's choice or forbids the bound form takes ``F.linear``:
  gradients, ``clear_kernel_cache`` / a new registration, ``native.disabled()``, recording, another
  weight (or the same tensor impl with another compute dtype), an input scale, a non-contiguous
  input (the bound form declines it), tracing by ``torch.compile``;
* it keeps nothing alive and at most ``MAX_SIGNATURES`` signatures.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_bound_calls import CONFIGS, K, quantized
from test_native_blockwise import needs_native

import torchq
from torchq import dispatch, native
from torchq.tensor import AffineQuantizedTensor


def _plan(weight, x, bias) -> dispatch.LinearPlan:
    return dispatch._KERNEL_CACHE.get(weight.tensor_impl)[dispatch._signature(x, weight, bias)]


def _spy(weight, x, bias) -> list:
    """Count the cached bound form's calls for ``x``'s signature."""
    plan = _plan(weight, x, bias)
    real, calls = plan.bound, []
    object.__setattr__(plan, "bound", lambda *a: calls.append(1) or real(*a))
    return calls


@needs_native
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(K,), (1, K), (1, 1, K), (4, K)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_direct_calls_give_f_linears_bits(config, dtype, shape, with_bias):
    m = quantized(config)
    torch.manual_seed(1)
    x = torch.randn(shape).to(dtype)
    bias = m.bias.to(dtype) if with_bias else None
    direct = dispatch.DirectLinear()
    with torch.inference_mode():
        first = direct(x, m.weight, bias)
        assert len(direct) == 1
        calls = _spy(m.weight, x, bias)
        again = [direct(x, m.weight, bias) for _ in range(3)]
        expected = F.linear(x, m.weight, bias)
    assert calls == [1, 1, 1, 1]  # three direct calls and F.linear's own
    for y in (first, *again):
        assert y.dtype == dtype and y.shape == expected.shape and y.is_contiguous()
        assert torch.equal(y, expected)


@pytest.fixture
def general(monkeypatch) -> list:
    """Count the calls DirectLinear hands to ``F.linear`` (its general path)."""
    calls: list = []

    def linear(x, w, b=None):
        calls.append(1)
        return F.linear(x, w, b)

    monkeypatch.setattr(dispatch, "F", SimpleNamespace(linear=linear))
    return calls


@needs_native
def test_the_general_path_runs_whenever_f_linear_would_choose_afresh(general):
    m = quantized("int8wo")
    x = torch.randn(2, K)
    direct = dispatch.DirectLinear()
    with torch.no_grad():
        ref = direct(x, m.weight, m.bias)
        assert len(general) == 1 and len(direct) == 1
        assert torch.equal(direct(x, m.weight, m.bias), ref) and len(general) == 1
        stale = _plan(m.weight, x, m.bias)  # held: only the generation tells it is no longer the choice
        dispatch.clear_kernel_cache()
        assert torch.equal(direct(x, m.weight, m.bias), ref) and len(general) == 2
        assert _plan(m.weight, x, m.bias) is not stale
        direct(x, m.weight, m.bias)  # the new choice, remembered
        assert len(general) == 2
        with native.disabled():  # another selection state: F.linear's choice for it
            off = direct(x, m.weight, m.bias)
            assert len(general) == 3
            direct(x, m.weight, m.bias)  # the reference kernel binds nothing: F.linear, remembered as such
            assert len(general) == 4 and len(direct) == 1
        assert torch.allclose(off, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(direct(x, m.weight, m.bias), ref) and len(general) == 5
        direct(x, m.weight, m.bias)
        assert len(general) == 5
        with dispatch.recording() as records:
            direct(x, m.weight, m.bias)
        assert len(records) == 1 and len(general) == 6
        # the same packed data under another wrapper with another compute dtype: the same key
        other = AffineQuantizedTensor(m.weight.tensor_impl, torch.float32, compute_dtype=torch.bfloat16)
        assert not torch.equal(direct(x, other, m.bias), ref) and len(general) == 7
        assert torch.equal(direct(x, m.weight, m.bias), ref) and len(general) == 8
        direct(x, m.weight, m.bias)
        assert len(general) == 8
    xg = x.clone().requires_grad_(True)
    y = direct(xg, m.weight, m.bias)  # gradients: F.linear's autograd path
    assert len(general) == 9 and y.grad_fn is not None
    y.sum().backward()
    assert xg.grad is not None and m.bias.grad is not None
    with torch.no_grad():
        direct(x, m.weight, m.bias)
    assert len(general) == 9


def test_a_user_kernels_bound_form_is_what_runs(general):
    bounds = []

    def impl(x, w, b):
        return F.linear(x, w.tensor_impl.dequantize(x.dtype), b)

    def bind(x, w, b):
        return lambda x2, w2, b2: bounds.append(1) or impl(x2, w2, b2)

    torchq.register_linear_kernel("direct_test_kernel", lambda x, w, b: None, impl, layout=torchq.ALL_LAYOUTS, bind=bind)
    try:
        m = quantized("int8wo")
        x = torch.randn(3, K)
        direct = dispatch.DirectLinear()
        with torch.no_grad():
            ys = [direct(x, m.weight, m.bias) for _ in range(3)]
        assert len(general) == 1 and bounds == [1, 1]
        assert all(torch.equal(y, ys[0]) for y in ys)
    finally:
        torchq.unregister_linear_kernel("direct_test_kernel")


def test_a_weight_with_an_input_scale_is_never_taken_directly(general):
    m = quantized("int8wo", bias=False)
    w = m.weight
    scaled = AffineQuantizedTensor(w.tensor_impl, torch.float32, input_scale=torch.full((K,), 0.5))
    x = torch.randn(1, K)
    direct = dispatch.DirectLinear()
    with torch.no_grad():
        for _ in range(3):
            y = direct(x, scaled, None)
        assert len(direct) == 0 and len(general) == 3
        assert torch.equal(y, F.linear(x * 0.5, w))


@needs_native
def test_an_input_the_bound_form_declines_runs_f_linear(general):
    m = quantized("int4-g32")
    direct = dispatch.DirectLinear()
    wide = torch.randn(1, 2 * K)
    x = wide[:, ::2]
    with torch.no_grad():
        direct(x.contiguous(), m.weight, m.bias)
        assert len(direct) == 1
        assert torch.equal(direct(x, m.weight, m.bias), F.linear(x.contiguous(), m.weight, m.bias))
        assert len(general) == 2


@needs_native
def test_compiled_callers_trace_f_linear(general):
    m = quantized("int8dq")
    direct = dispatch.DirectLinear()
    x = torch.randn(1, K)
    with torch.no_grad():
        eager = direct(x, m.weight, m.bias)
        direct(x, m.weight, m.bias)
        assert len(general) == 1
        compiled = torch.compile(lambda x: direct(x, m.weight, m.bias), fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), eager)
        assert len(general) == 2  # traced through F.linear


@needs_native
def test_weights_sharing_one_direct_linear_each_get_their_own_bits(general):
    """A DirectLinear called with another weight of the same shape (or a weight whose data
    torch.utils.swap_tensors replaced) asks F.linear, never the other weight's bound form."""
    a = quantized("int4-g32")
    torch.manual_seed(5)
    b = torch.nn.Linear(K, a.out_features)
    torchq.quantize_(b, CONFIGS["int4-g32"]())  # the same shape and layout, other codes
    x = torch.randn(1, K)
    direct = dispatch.DirectLinear()
    with torch.no_grad():
        ya, yb = F.linear(x, a.weight, a.bias), F.linear(x, b.weight, a.bias)
        assert not torch.equal(ya, yb)
        for _ in range(2):
            assert torch.equal(direct(x, a.weight, a.bias), ya)
            assert torch.equal(direct(x, a.weight, a.bias), ya)
            assert torch.equal(direct(x, b.weight, a.bias), yb)
        torch.utils.swap_tensors(a.weight, b.weight)  # a's weight object now holds b's packed data
        assert torch.equal(direct(x, a.weight, a.bias), yb)
        assert torch.equal(direct(x, b.weight, a.bias), ya)


@needs_native
def test_other_fields_on_the_same_packed_data_ask_f_linear(general):
    from torchq.activation import PerTokenInt8

    m = quantized("int8wo", bias=False)
    impl = m.weight.tensor_impl
    x = torch.randn(1, K)
    direct = dispatch.DirectLinear()
    perm = torch.randperm(K)
    permuted = AffineQuantizedTensor(impl, torch.float32, input_perm=perm)
    dynamic = AffineQuantizedTensor(impl, torch.float32, act_quant=PerTokenInt8())
    with torch.no_grad():
        plain = direct(x, m.weight)
        direct(x, m.weight)
        assert len(general) == 1
        assert torch.equal(direct(x, permuted), F.linear(x, permuted))
        assert torch.equal(direct(x, permuted), F.linear(x.index_select(-1, perm), m.weight))
        assert torch.equal(direct(x, dynamic), F.linear(x, dynamic))
        assert not torch.equal(direct(x, dynamic), plain)  # int8 activations
        assert torch.equal(direct(x, m.weight), plain)


@needs_native
def test_a_bias_that_wants_a_gradient_takes_the_autograd_path():
    m = quantized("nf4")
    x = torch.randn(1, K)
    direct = dispatch.DirectLinear()
    with torch.no_grad():
        direct(x, m.weight, m.bias)
    y = direct(x, m.weight, m.bias)  # grad enabled, only the bias wants one
    assert y.grad_fn is not None
    y.sum().backward()
    assert torch.equal(m.bias.grad, torch.ones_like(m.bias))


@needs_native
def test_a_torch_function_mode_sees_every_call():
    from torch.overrides import TorchFunctionMode

    seen = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.linear:
                seen.append(1)
            return func(*args, **(kwargs or {}))

    m = quantized("int8dq")
    x = torch.randn(1, K)
    direct = dispatch.DirectLinear()
    with torch.no_grad():
        ref = direct(x, m.weight, m.bias)
        direct(x, m.weight, m.bias)
        with Count():
            for _ in range(3):
                assert torch.equal(direct(x, m.weight, m.bias), ref)
    assert len(seen) == 3


@needs_native
def test_it_keeps_nothing_alive_and_a_bounded_number_of_signatures():
    m = quantized("int8dq")  # bound at every row count
    direct = dispatch.DirectLinear()
    cap = dispatch.DirectLinear.MAX_SIGNATURES
    with torch.no_grad():
        for rows in range(1, cap + 3):
            direct(torch.randn(rows, K), m.weight, m.bias)
            assert len(direct) == min(rows, cap)
    shapes = [k[0][0] for k in direct._calls]
    assert shapes == list(range(3, cap + 3))  # the oldest dropped first
    impl = weakref.ref(m.weight.tensor_impl)
    del m
    gc.collect()
    assert impl() is None
    direct.clear()
    assert len(direct) == 0
