"""The per-call path of the native CPU ops when called through the dispatcher (what a
``torch.compile`` graph does at every linear):

* the op's weight is built once per packed tensor and reused while every tensor argument is the
  same object at the same address (``library.op_weight``); in-place updates are seen, another
  tensor or other parameters rebuild it, copies (non-contiguous, other scale dtypes) are never
  cached, and the cache does not keep a freed weight alive;
* a cached call still checks the per-call arguments (x, bias) and honours ``native.disabled()``;
* the direct no-grad path (``registration.register_cpu_kernel``) gives the same bits as the
  custom op's own path, and gradients, fake tensors and dispatch modes still take the latter.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from test_native_blockwise import needs_native
from torch.utils._python_dispatch import TorchDispatchMode

import torchq
from torchq import native
from torchq.backends.native_cpu import library, registration
from torchq.ops.int4 import int4_groupwise_linear
from torchq.ops.int8 import int8_dynamic_linear, int8_weight_linear

pytestmark = needs_native


def int4_args(n: int = 24, k: int = 64, g: int = 32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // g, generator=gen) + 0.1
    zero = torch.randn(n, k // g, generator=gen)
    return packed, scale, zero


def call_int4(x, packed, scale, zero, bias=None, n=24, k=64):
    return int4_groupwise_linear(x, packed, scale, None, zero, [n, k], 32, -8.0, 0, 0, bias)


def int4_reference(x, packed, scale, zero, bias=None, n=24, k=64):
    with native.disabled():
        return call_int4(x, packed, scale, zero, bias, n, k)


def test_the_weight_is_built_once_and_reused_for_the_same_tensors():
    packed, scale, zero = int4_args()
    x = torch.randn(1, 64)
    with torch.no_grad():
        first = call_int4(x, packed, scale, zero)
        cached = library.cached_op_weight(packed, (scale, None, zero), ("int4", 24, 64, 32, -8.0, 0, 0))
        assert cached is not None
        second = call_int4(x, packed, scale, zero)
        assert library.cached_op_weight(packed, (scale, None, zero), ("int4", 24, 64, 32, -8.0, 0, 0)) is cached
    assert torch.equal(first, second)
    assert torch.allclose(first, int4_reference(x, packed, scale, zero), rtol=1e-5, atol=1e-5)


def test_in_place_updates_are_seen_and_other_tensors_rebuild():
    packed, scale, zero = int4_args()
    x = torch.randn(2, 64)
    call_int4(x, packed, scale, zero)
    scale.mul_(2)  # the cached weight points into scale's memory
    packed.copy_(int4_args(seed=1)[0])
    assert torch.allclose(call_int4(x, packed, scale, zero), int4_reference(x, packed, scale, zero), rtol=1e-5, atol=1e-5)
    other_scale = scale.clone() * 3  # another object: the weight is rebuilt for it
    assert torch.allclose(call_int4(x, packed, other_scale, zero), int4_reference(x, packed, other_scale, zero), rtol=1e-5, atol=1e-5)
    assert library.cached_op_weight(packed, (scale, None, zero), ("int4", 24, 64, 32, -8.0, 0, 0)) is None


def test_copies_are_not_cached():
    packed, scale, zero = int4_args()
    x = torch.randn(1, 64)
    strided = torch.randn(2, 24, 2).transpose(0, 2)[0]  # non-contiguous [24, 2] scales: the kernel takes a copy
    out = call_int4(x, packed, strided, zero)
    assert torch.allclose(out, int4_reference(x, packed, strided, zero), rtol=1e-5, atol=1e-5)
    assert library.cached_op_weight(packed, (strided, None, zero), ("int4", 24, 64, 32, -8.0, 0, 0)) is None
    strided.mul_(2)  # a cached copy would miss this
    assert torch.allclose(call_int4(x, packed, strided, zero), int4_reference(x, packed, strided, zero), rtol=1e-5, atol=1e-5)

    codes = torch.randint(-127, 128, (8, 16), dtype=torch.int8)
    scale16 = torch.rand(8, dtype=torch.bfloat16)  # converted to fp32 per call
    int8_weight_linear(torch.randn(1, 16), codes, scale16)
    assert library.cached_op_weight(codes, (scale16,), ("int8_weight_linear", 8, 16)) is None


def test_the_cache_does_not_keep_a_freed_weight_alive():
    packed, scale, zero = int4_args()
    call_int4(torch.randn(1, 64), packed, scale, zero)
    ref = weakref.ref(packed)
    gc.collect()  # earlier tests' garbage cycles would otherwise drop their entries during the count below
    before = len(library._OP_WEIGHTS)
    del packed
    gc.collect()
    assert ref() is None
    assert len(library._OP_WEIGHTS) == before - 1


def test_a_cached_call_still_checks_x_and_bias_and_honours_disabled():
    packed, scale, zero = int4_args()
    call_int4(torch.randn(1, 64), packed, scale, zero)
    with pytest.raises(ValueError, match="x: expected last dimension"):
        call_int4(torch.randn(1, 63), packed, scale, zero)
    with pytest.raises(ValueError, match="bias"):
        call_int4(torch.randn(1, 64), packed, scale, zero, bias=torch.randn(5))
    with pytest.raises(TypeError, match="x: expected fp32, bf16 or fp16"):
        call_int4(torch.randn(1, 64, dtype=torch.float64), packed, scale, zero)
    bad_shape = [24, 64, 1]  # other parameters: no cache hit, the checks run
    with pytest.raises(ValueError, match="shape"):
        int4_groupwise_linear(torch.randn(1, 64), packed, scale, None, zero, bad_shape, 32, -8.0, 0, 0)
    x = torch.randn(1, 64)
    calls = []
    original = library.run_linear
    library.run_linear = lambda *a: calls.append(a) or original(*a)
    try:
        with native.disabled(), warnings.catch_warnings():
            warnings.simplefilter("ignore", native.NativeMissingWarning)
            call_int4(x, packed, scale, zero)
    finally:
        library.run_linear = original
    assert calls == []  # the reference ran


def test_int8_dynamic_cached_calls_check_a_new_activation_range():
    codes = torch.randint(-127, 128, (8, 32), dtype=torch.int8)
    scale = torch.rand(8) + 0.01
    x = torch.randn(2, 32)
    first = int8_dynamic_linear(x, codes, scale, -127, 127, 1e-5)
    assert torch.equal(int8_dynamic_linear(x, codes, scale, -127, 127, 1e-5), first)
    with pytest.raises(ValueError, match="quant_min|quant_max"):
        int8_dynamic_linear(x, codes, scale, 5, -5, 1e-5)


@pytest.mark.parametrize("op", ["int8_weight_linear", "int8_dynamic_linear", "int4_groupwise_linear", "blockwise_4bit_linear",
                                "int4_groupwise_linear_a8", "blockwise_4bit_linear_a8", "gemv_4bit", "gemm_4bit"])
def test_every_native_op_has_the_direct_path(op):
    assert registration.direct_path_registered(op)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torchq::{op}", "AutogradCPU")


def test_the_direct_path_gives_the_custom_op_paths_bits():
    packed, scale, zero = int4_args()
    x = torch.randn(3, 64)
    bias = torch.randn(24)
    with torch.no_grad():
        direct = call_int4(x, packed, scale, zero, bias)
    with torch.inference_mode():  # no autograd key: the custom op's own CPU registration
        general = call_int4(x, packed, scale, zero, bias)
    assert torch.equal(direct, general)


def test_gradients_fake_tensors_and_modes_take_the_custom_op_path():
    packed, scale, zero = int4_args()
    x = torch.randn(3, 64, requires_grad=True)
    bias = torch.randn(24, requires_grad=True)
    call_int4(x, packed, scale, zero, bias).sum().backward()
    w = int4_reference(torch.eye(64), packed, scale, zero).t()  # [24, 64]: the dequantized weight
    assert torch.allclose(x.grad, w.sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)
    assert torch.equal(bias.grad, torch.full((24,), 3.0))

    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = mode.from_tensor(torch.randn(5, 64))
        out = call_int4(fx, *(mode.from_tensor(t) for t in (packed, scale, zero)))
    assert out.shape == (5, 24)

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Seen() as seen:
        call_int4(torch.randn(1, 64), packed, scale, zero)
    assert "torchq.int4_groupwise_linear.default" in seen.ops


def test_a_compiled_quantized_model_matches_eager_and_reuses_its_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 32))
    torchq.quantize_(model, torchq.int4_weight_only(group_size=32))
    compiled = torch.compile(model)
    x = torch.randn(1, 64)
    with torch.no_grad():
        eager = model(x)
        compiled(x)
        entries = len(library._OP_WEIGHTS)
        out = compiled(x)
        assert len(library._OP_WEIGHTS) == entries  # nothing built again
    assert torch.allclose(out, eager, rtol=1e-5, atol=1e-5)
