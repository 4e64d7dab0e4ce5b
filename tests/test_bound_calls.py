"""The bound per-call form of a kernel (``LinearKernel.bind``): what a decode-sized eager call runs
after its first call, and the library's CPython entry that it (and ``run_linear``) calls.

* every native config's bound call gives the bits of the kernel's own impl, for every input
  dtype, 2-D and 3-D inputs, with and without bias, through both entries (python, ctypes);
* it is skipped, never wrong, for what it cannot take: a non-contiguous input, an input whose
  storage holds less than its sizes claim (the general path then raises), a bias that is not a
  contiguous fp32 tensor, gradients, ``native.disabled()``, recording; in-place bias updates are seen;
* a user kernel's ``bind`` is called once per cached choice and used when no gradient is needed;
* the CPython entry refuses bad arguments with a TypeError and releases the GIL (threads agree).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from test_native_blockwise import needs_native

import torchq
from torchq import dispatch, native
from torchq.backends.native_cpu import library

CONFIGS = {
    "int4-g32": lambda: torchq.int4_weight_only(group_size=32),
    "int4-g128-bf16-scales": lambda: torchq.int4_weight_only(group_size=128, scale_dtype=torch.bfloat16),
    "int4-g64-fp32-scales": lambda: torchq.int4_weight_only(group_size=64, scale_dtype=torch.float32),
    "nf4": lambda: torchq.nf4_weight_only(),
    "nf4-plain-absmax": lambda: torchq.nf4_weight_only(double_quant=False),
    "int8wo": lambda: torchq.int8_weight_only(),
    "int8dq": lambda: torchq.int8_dynamic_activation_int8_weight(),
    "int8dq-r7": lambda: torchq.int8_dynamic_activation_int8_weight(reduce_range=True),
    "int4a8": lambda: torchq.int8_dynamic_activation_4bit_weight(),
    "nf4a8": lambda: torchq.int8_dynamic_activation_4bit_weight(weight="nf4"),
}
K, N = 256, 40


def quantized(config: str, dtype: torch.dtype = torch.float32, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    m = torch.nn.Linear(K, N, bias=bias).to(dtype)
    torchq.quantize_(m, CONFIGS[config]())
    return m


def plan_of(m: torch.nn.Linear, x: torch.Tensor) -> dispatch.LinearPlan:
    chosen = dispatch._KERNEL_CACHE.get(m.weight.tensor_impl)
    return chosen[dispatch._signature(x, m.weight, m.bias)]


@pytest.fixture(params=library.LINEAR_ENTRIES if library.loaded() is not None else ["ctypes"])
def entry(request):
    if library.loaded() is None:
        pytest.skip("native library not built")
    if request.param == "python" and library._PYTHON_LINEAR is None:
        pytest.skip("the library was built without Python.h")
    saved = library.linear_entry(request.param)
    yield request.param
    library.linear_entry(saved)


@needs_native
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(K,), (1, K), (1, 1, K), (3, K)])
def test_the_bound_call_gives_the_kernels_bits(config, dtype, shape, entry):
    m = quantized(config)
    x = torch.randn(shape).to(dtype)
    bias = m.bias.to(dtype) if dtype != torch.float32 else m.bias
    with torch.inference_mode():
        first = F.linear(x, m.weight, bias)  # plans and binds
        plan = dispatch._KERNEL_CACHE.get(m.weight.tensor_impl)[dispatch._signature(x, m.weight, bias)]
        assert plan.kernel.name.endswith(("native", "linear", "int8_activations")), plan.kernel.name
        assert plan.bound is not None, f"{config}: no bound call for {shape} {dtype}"
        bound = plan.bound(x, m.weight, bias)
        again = F.linear(x, m.weight, bias)
        impl = plan.kernel.impl(x, m.weight, bias)
        no_bias = F.linear(x, m.weight)
        impl_no_bias = plan.kernel.impl(x, m.weight, None)
    for y in (first, bound, again):
        assert y.dtype == dtype and y.shape == (*shape[:-1], N) and y.is_contiguous()
        assert torch.equal(y, impl)
    assert torch.equal(no_bias, impl_no_bias)
    ref = dispatch.dequantized_linear(x.float(), m.weight, bias.float()).to(dtype)
    tol = 5e-2 if "a8" in config or "dq" in config or dtype != torch.float32 else 1e-4
    assert torch.allclose(first.float(), ref.float(), rtol=tol, atol=tol)


@needs_native
@pytest.mark.parametrize("m_rows", [17, 64])
def test_prefill_sized_weight_only_calls_are_not_bound(m_rows):
    m = quantized("int4-g32")
    x = torch.randn(m_rows, K)
    with torch.no_grad():
        m(x)
    assert plan_of(m, x).bound is None  # their path depends on the GEMM switches: the impl decides per call


@needs_native
@pytest.mark.parametrize("config", ["int8dq", "int8dq-vnni", "int8-static"])
@pytest.mark.parametrize("m_rows", [5, 17, 64, 256])
def test_int8_activation_calls_of_every_size_are_bound(config, m_rows):
    """int8 dynamic and static kernels take every row count (only weight-only formats hand larger
    inputs to dequantized tiles), so prefill-sized calls skip the general path's per-call layout
    validation too, with the impl's bits."""
    from torchq.activation import StaticInt8
    from torchq.layouts.int8_vnni import Int8VnniLayout

    torch.manual_seed(0)
    m = torch.nn.Linear(K, N).to(torch.bfloat16)
    if config == "int8-static":
        torchq.quantize_(m, torchq.Int8StaticActivationInt8WeightConfig(activation=StaticInt8(0.02, 3)))
    else:
        layout = Int8VnniLayout() if config == "int8dq-vnni" else None
        torchq.quantize_(m, torchq.int8_dynamic_activation_int8_weight(layout=layout))
    x = torch.randn(m_rows, K).to(torch.bfloat16)
    with torch.no_grad():
        first = m(x)
        plan = plan_of(m, x)
        assert plan.bound is not None, f"{config}: no bound call for {m_rows} rows"
        assert torch.equal(plan.bound(x, m.weight, m.bias), first)
        assert torch.equal(plan.kernel.impl(x, m.weight, m.bias), first)


@needs_native
def test_a_non_contiguous_input_takes_the_general_path():
    m = quantized("int4-g32")
    wide = torch.randn(1, 2 * K)
    x = wide[:, ::2]
    assert not x.is_contiguous()
    with torch.no_grad():
        m(x.contiguous())  # binds for the signature (dtype, shape): contiguity is checked per call
        assert plan_of(m, x).bound(x, m.weight, m.bias) is None
        assert torch.equal(m(x), m(x.contiguous()))


@needs_native
def test_an_input_whose_storage_is_short_raises_instead_of_reading():
    m = quantized("int8wo")
    with torch.no_grad():
        m(torch.randn(1, K))
        x = torch.randn(1, K)
        x.untyped_storage().resize_(K * 4 - 4)  # the sizes now claim one float more than the storage holds
        assert plan_of(m, x).bound(x, m.weight, m.bias) is None
        with pytest.raises(ValueError, match="x: its storage holds"):
            m(x)


@needs_native
def test_bias_updates_and_other_bias_dtypes():
    m = quantized("nf4")
    x = torch.randn(1, K)
    with torch.no_grad():
        before = m(x)
        m.bias.add_(1.0)
        after = m(x)
        assert torch.equal(after, plan_of(m, x).kernel.impl(x, m.weight, m.bias))
        assert not torch.equal(before, after)
        # a bias that is a view with a stride: not the fp32 contiguous buffer the kernel reads
        strided = torch.randn(2 * N)[::2]
        assert plan_of(m, x).bound(x, m.weight, strided) is None
        assert torch.equal(F.linear(x, m.weight, strided), plan_of(m, x).kernel.impl(x, m.weight, strided))


@needs_native
def test_gradients_take_the_autograd_path():
    m = quantized("int4-g32")
    x = torch.randn(1, K)
    with torch.no_grad():
        m(x)  # bound
    xg = x.clone().requires_grad_(True)
    y = m(xg)
    assert y.grad_fn is not None
    y.sum().backward()
    assert xg.grad is not None and m.bias.grad is not None
    # only the bias requires grad (an nn.Linear's default): the addition records it
    m.bias.grad = None
    y = m(x)
    assert y.grad_fn is not None
    y.sum().backward()
    assert torch.equal(m.bias.grad, torch.ones(N))


@needs_native
def test_disabled_and_recording_do_not_use_the_bound_call():
    m = quantized("int8dq")
    x = torch.randn(1, K)
    calls = []
    with torch.no_grad():
        m(x)
        plan = plan_of(m, x)
        real = plan.bound
        object.__setattr__(plan, "bound", lambda x, w, b: calls.append(1) or real(x, w, b))
        m(x)
        assert calls == [1]
        with native.disabled():
            ref = m(x)
        with dispatch.recording() as records:
            m(x)
        assert calls == [1] and len(records) == 1
    assert torch.allclose(ref, m(x), rtol=5e-2, atol=5e-2)


def test_a_user_kernel_is_bound_once_and_used_without_gradients():
    binds, bound_calls = [], []

    def impl(x, w, b):
        return F.linear(x, w.dequantize(x.dtype), b)

    def bind(x, w, b):
        binds.append(tuple(x.shape))
        return lambda x2, w2, b2: bound_calls.append(1) or impl(x2, w2, b2)

    torchq.register_linear_kernel("bound_user_kernel", lambda x, w, b: None, impl, layout=torchq.ALL_LAYOUTS, bind=bind)
    try:
        m = quantized("int8wo")
        x = torch.randn(2, K)
        with torch.no_grad():
            first = m(x)
            second = m(x)
            third = m(x)
        assert binds == [(2, K)] and bound_calls == [1, 1]
        assert torch.equal(first, second) and torch.equal(second, third)
        m(x.requires_grad_(True))  # grad needed: impl, not the bound call
        assert bound_calls == [1, 1]
    finally:
        torchq.unregister_linear_kernel("bound_user_kernel")


def test_bind_must_be_callable():
    with pytest.raises(TypeError, match="bind: expected None or a callable"):
        dispatch.LinearKernel("k", lambda x, w, b: None, lambda x, w, b: x, bind=3)


@needs_native
def test_linear_entry_switch():
    with pytest.raises(ValueError, match="kind: expected one of"):
        library.linear_entry("cffi")
    saved = library.linear_entry()
    assert saved in library.LINEAR_ENTRIES
    assert library.linear_entry("ctypes") == saved
    assert library.linear_entry(saved) == "ctypes"


@needs_native
def test_the_python_entry_is_built_and_checks_its_arguments():
    fn = library._PYTHON_LINEAR
    if fn is None:
        if os.environ.get("TORCHQ_REQUIRE_NATIVE") == "1":
            pytest.fail("TORCHQ_REQUIRE_NATIVE=1: the native library was built without its CPython entry")
        pytest.skip("built without Python.h")
    with pytest.raises(TypeError, match="expected 7 arguments"):
        fn(1, 2, 3)
    with pytest.raises(TypeError, match="expected an int address, got str"):
        fn("w", 1, 0, 1, None, 1, 1)
    with pytest.raises(TypeError, match="expected an int address or None, got float"):
        fn(1, 1, 0, 1, 1.5, 1, 1)
    assert fn(0, 1, 0, 1, None, 1, 1) == 1  # a null weight: BAD_ARGUMENT, nothing read


@needs_native
def test_threads_calling_bound_layers_agree():
    layers = {c: quantized(c) for c in ("int4-g32", "nf4", "int8dq", "int4a8")}
    xs = [torch.randn(1, K) for _ in range(4)]
    with torch.no_grad():
        expected = {c: [m(x) for x in xs] for c, m in layers.items()}
    errors: list[str] = []

    def work(seed: int) -> None:
        with torch.no_grad():
            for i in range(60):
                c = list(layers)[(seed + i) % len(layers)]
                j = (seed * 7 + i) % len(xs)
                if not torch.equal(layers[c](xs[j]), expected[c][j]):
                    errors.append(f"{c} x{j}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@needs_native
@pytest.mark.parametrize("fast_bf16", [False], indirect=True)
def test_a_bound_call_asks_the_tile_switch_again_above_the_fused_rows(fast_bf16, monkeypatch):
    from torchq import prefill

    m = quantized("int8wo", torch.bfloat16)
    x = torch.randn(8, K, dtype=torch.bfloat16)  # fused on CPUs without fast bf16 matmul, tiles on those with it
    # on AMX-BF16 CPUs the fused kernel takes 5-64 bf16 rows, on AVX512_BF16 ones its dot path 2-32:
    # both off here (the dot path with the switch of the reordering small-M paths)
    with torch.no_grad(), library.bf16_amx("off"), library.lut4_paths(decode=False):
        fused = m(x)
        plan = plan_of(m, x)
        assert plan.bound is not None and torch.equal(plan.bound(x, m.weight, m.bias), fused)
        monkeypatch.setattr(prefill, "FAST_BF16_MATMUL", True)
        assert plan.bound(x, m.weight, m.bias) is None  # the impl decides: bf16 tiles now
        assert torch.equal(m(x), plan.kernel.impl(x, m.weight, m.bias))


@contextlib.contextmanager
def _nf4_table_dot(mode: str) -> Iterator[None]:
    """The scaled dot path's table kind (NF4) switched on (off in mode "off"), the path in ``mode``."""
    with library.lut4_table_dot("off" if mode == "off" else "on"), library.lut4_scaled_dot(mode):
        yield


DOT_PATHS = {  # config -> its bf16 dot path's mode switch and call counter
    "int8wo": (library.int8_dot, library.int8_dot_calls),
    "int4-g64-fp32-scales": (library.lut4_scaled_dot, library.lut4_scaled_dot_calls),
    "nf4": (_nf4_table_dot, library.lut4_scaled_dot_calls),
}


@needs_native
@pytest.mark.parametrize("fast_bf16", [True], indirect=True)
@pytest.mark.parametrize("config", list(DOT_PATHS))
@pytest.mark.parametrize("mode", ["on", "emulated"])
def test_a_bound_call_asks_the_dot_path_switch_again(fast_bf16, config, mode):
    """bf16 rows above the fused ones (bf16 AMX GEMM off): int8 weight-only's bf16 dot path, int4
    with fp32 scales' scaled dot path and NF4's table kind of it, take them in the bound call while their switch allows it (on
    AVX512_BF16 CPUs; emulated on every CPU); switched off, the bound call declines and the impl
    takes dequantized tiles. On other CPUs in mode "on" the bound call declines both times."""
    switch, calls = DOT_PATHS[config]
    m = quantized(config, torch.bfloat16)
    x = torch.randn(8, K, dtype=torch.bfloat16)
    runs = mode == "emulated" or ("avx512_bf16" in native.status().features and native.status().isa == "avx512")
    with torch.no_grad(), library.bf16_amx("off"), switch(mode):
        expected = m(x)
        plan = plan_of(m, x)
        before = calls()
        got = plan.bound(x, m.weight, m.bias) if plan.bound is not None else None
        assert (got is not None and torch.equal(got, expected)) == runs
        assert calls() - before == runs
        with library.lut4_paths(decode=False):
            assert plan.bound is None or plan.bound(x, m.weight, m.bias) is None
            assert torch.equal(m(x), plan.kernel.impl(x, m.weight, m.bias))
        with switch("off"):
            assert plan.bound is None or plan.bound(x, m.weight, m.bias) is None


@needs_native
@pytest.mark.parametrize("fast_bf16", [True], indirect=True)
@pytest.mark.parametrize("config", ["int8wo", "nf4"])
def test_a_bound_call_asks_the_bf16_amx_mode_again(fast_bf16, config):
    """bf16 rows above the fused ones: the fused kernel's while the bf16 AMX GEMM may run (emulated
    here, so on every CPU), dequantized tiles once it is off, per call as the impl decides."""
    m = quantized(config, torch.bfloat16)
    x = torch.randn(8, K, dtype=torch.bfloat16)
    with torch.no_grad():
        with library.bf16_amx("emulated"):
            expected = m(x)
            plan = plan_of(m, x)
            assert plan.bound is not None and torch.equal(plan.bound(x, m.weight, m.bias), expected)
        with library.bf16_amx("off"), library.lut4_paths(decode=False):  # (and int8's bf16 dot path off)
            assert plan.bound(x, m.weight, m.bias) is None
            assert torch.equal(m(x), plan.kernel.impl(x, m.weight, m.bias))


@needs_native
@pytest.mark.parametrize("config", ["int4-g32", "nf4", "int8dq", "int4a8"])
def test_a_bound_call_does_not_keep_its_weight_alive(config):
    import gc
    import weakref

    m = quantized(config)
    x = torch.randn(1, K)
    with torch.no_grad():
        m(x)
        m(x)
    assert plan_of(m, x).bound is not None
    impl = weakref.ref(m.weight.tensor_impl)
    packed = weakref.ref(getattr(m.weight.tensor_impl, m.weight.tensor_impl.tensor_names()[0]))
    before = len(dispatch._KERNEL_CACHE)
    del m
    gc.collect()
    assert impl() is None and packed() is None
    assert len(dispatch._KERNEL_CACHE) == before - 1
