"""No buffer reaches C unless it holds the bytes its metadata claims, and no bias is dropped.

* Every ``TensorImpl`` construction checks each inner tensor against the shape, dtype (and, for
  opaque packed formats, contiguity) that the layout, spec and shape imply; so does the
  ``AffineQuantizedTensor`` constructor for an impl that was never constructed (a pickle fills
  ``__dict__`` without running ``__init__``).
* Defense in depth: the native entry points check every pointer right before the call (CPU,
  dtype, contiguity, element count for the N, K, group arguments, storage size), so an impl
  altered after construction raises instead of letting the kernel read foreign memory.
* A bias on the wrong device (a meta bias's null pointer reads as "no bias" in C), of the wrong
  dtype or shape raises, as float ``F.linear`` does, for every kernel.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_native_blockwise import needs_native

import torchq
from torchq import AffineQuantizedTensor
from torchq.activation import PerTokenInt8
from torchq.backends.native_cpu import library as native_library
from torchq.layouts.blockwise_4bit import Blockwise4bitImpl
from torchq.layouts.int4_cpu import Int4CPULayout
from torchq.layouts.int4_native import Int4NativeImpl, Int4NativeLayout
from torchq.layouts.int8_vnni import Int8VnniImpl, Int8VnniLayout
from torchq.layouts.packed_bits import PackedBitsLayout
from torchq.layouts.plain import PlainImpl, PlainLayout

K = 256


def _aqt(kind: str, n: int = 8) -> AffineQuantizedTensor:
    w = torch.randn(n, K)
    if kind == "int4":
        return AffineQuantizedTensor.from_float(w, "asymmetric", (1, 32), 0, 15, zero_point_domain="float",
                                                layout=Int4NativeLayout())
    if kind == "int4_int_zero":
        return AffineQuantizedTensor.from_float(w, "asymmetric", (1, 64), 0, 15, zero_point_domain="int",
                                                layout=Int4NativeLayout())
    if kind == "nf4":
        return torchq.nf4_weight_only(block_size=64).quantize_weight(w)
    if kind == "nf4_plain_scales":
        return torchq.nf4_weight_only(block_size=64, double_quant=False).quantize_weight(w)
    if kind == "int8wo":
        return torchq.int8_weight_only(layout=PlainLayout()).quantize_weight(w)
    if kind == "int8dq":
        return torchq.int8_dynamic_activation_int8_weight(layout=PlainLayout()).quantize_weight(w)
    if kind == "int8dq_vnni":
        return torchq.int8_dynamic_activation_int8_weight(layout=Int8VnniLayout()).quantize_weight(w)
    raise AssertionError(kind)


NATIVE_KINDS = ["int4", "int4_int_zero", "nf4", "nf4_plain_scales", "int8wo", "int8dq", "int8dq_vnni"]
IMPL_CLASSES = {"int4": Int4NativeImpl, "nf4": Blockwise4bitImpl, "int8wo": PlainImpl, "int8dq": PlainImpl,
                "int8dq_vnni": Int8VnniImpl}
BIG_FIELD = {Int4NativeImpl: "packed", Blockwise4bitImpl: "packed", PlainImpl: "codes", Int8VnniImpl: "panels"}
# what a forged 4096-row claim around an 8-row weight's biggest buffer says (expected, then got)
FORGED_SHAPES = {Int8VnniImpl: (r"\[1048576\]", r"\[4096\]")}


def _forged(impl, **changes):
    """What a pickle can build: the impl's class, ``__dict__`` filled freely, no ``__init__``."""
    forged = object.__new__(type(impl))
    forged.__dict__.update(vars(impl))
    forged.__dict__.update(changes)
    return forged


# -- construction: the metadata decides what the tensors must be ---------------------------------------
@pytest.mark.parametrize("kind", NATIVE_KINDS)
def test_a_forged_impl_claiming_more_rows_than_its_buffers_hold_is_rejected(kind):
    """The issue's attack: shape (4096, K) around the buffers of an 8-row weight. Wrapping it
    (as a pickle's AffineQuantizedTensor would) raises, naming the tensor, expected and given."""
    impl = _aqt(kind).tensor_impl
    # (a forger keeps the metadata consistent: the int8_vnni impl's remembered scale shape too)
    extra = {"scale_shape": (4096, 1)} if isinstance(impl, Int8VnniImpl) else {}
    forged = _forged(impl, shape=(4096, K), **extra)
    field = BIG_FIELD[type(impl)]
    claimed, held = FORGED_SHAPES.get(type(impl), (r"\[4096, ", r"\[8, "))
    with pytest.raises(ValueError, match=rf"{field}: expected .*{claimed}.*got .*{held}"):
        AffineQuantizedTensor(forged, torch.float32)
    with pytest.raises(ValueError, match=rf"{field}: expected"):
        forged.validate()
    with pytest.raises(ValueError, match=rf"{field}: expected"):  # every construction path: rebuild (unflatten), map
        type(impl).rebuild(forged.metadata(), {n: getattr(forged, n) for n in forged.tensor_names()})


@pytest.mark.parametrize("kind", NATIVE_KINDS)
def test_inner_tensors_of_the_wrong_dtype_shape_or_presence_are_rejected(kind):
    impl = _aqt(kind).tensor_impl
    meta, tensors = impl.metadata(), {n: getattr(impl, n) for n in impl.tensor_names()}
    for name, t in tensors.items():
        wrong_dtype = t.to(torch.int16 if t.is_floating_point() else torch.float32)
        with pytest.raises(ValueError, match=rf"{name}: expected .* got (int16|float32)"):
            type(impl).rebuild(meta, {**tensors, name: wrong_dtype})
        if t.dim():
            with pytest.raises(ValueError, match=rf"{name}: expected"):
                type(impl).rebuild(meta, {**tensors, name: t[:-1]})
        with pytest.raises(ValueError, match=rf"{name}: expected .* got None"):
            type(impl).rebuild(meta, {n: v for n, v in tensors.items() if n != name})
    missing = [n for n in impl.tensor_fields if getattr(impl, n) is None]
    for name in missing:  # a tensor the format does not have
        with pytest.raises(ValueError, match=rf"{name}: expected no tensor"):
            type(impl).rebuild(meta, {**tensors, name: tensors[impl.tensor_names()[0]]})


@pytest.mark.parametrize("kind", NATIVE_KINDS)
def test_expanded_and_mixed_device_inner_tensors_are_rejected(kind):
    impl = _aqt(kind).tensor_impl
    meta, tensors = impl.metadata(), {n: getattr(impl, n) for n in impl.tensor_names()}
    name = BIG_FIELD[type(impl)]
    t = tensors[name]
    expanded = t[:1].expand_as(t)  # right shape and dtype, one row of storage (stride 0)
    with pytest.raises(ValueError, match=rf"{name}: .*expanded \(stride 0\)"):
        type(impl).rebuild(meta, {**tensors, name: expanded})
    with pytest.raises(ValueError, match=r": expected device (cpu|meta) .*got (meta|cpu)"):
        type(impl).rebuild(meta, {**tensors, name: t.to("meta")})


def test_a_tensor_whose_storage_was_shrunk_is_rejected():
    impl = _aqt("int4").tensor_impl
    packed = impl.packed.clone()
    packed.untyped_storage().resize_(16)
    tensors = {n: getattr(impl, n) for n in impl.tensor_names()}
    with pytest.raises(ValueError, match=r"packed: its storage holds 16 bytes"):
        type(impl).rebuild(impl.metadata(), {**tensors, "packed": packed})


def test_opaque_packed_formats_must_be_contiguous():
    impl = _aqt("int4").to_layout(Int4CPULayout()).tensor_impl
    tensors = {n: getattr(impl, n) for n in impl.tensor_names()}
    p = impl.packed
    strided = torch.empty(p.shape[1], p.shape[0], dtype=p.dtype).t()  # same shape, column-major
    strided.copy_(p)
    with pytest.raises(ValueError, match=r"packed: expected contiguous uint8"):
        type(impl).rebuild(impl.metadata(), {**tensors, "packed": strided})


@pytest.mark.parametrize("m", [1, 200], ids=["decode", "prefill"])
@pytest.mark.parametrize("kind", NATIVE_KINDS)
def test_non_contiguous_inner_tensors_of_portable_layouts_compute_the_same(kind, m):
    """Layouts whose kernels copy a non-contiguous tensor accept one (a column-major copy of the
    same values); the native call then reads the contiguous copy, never the strided buffer."""
    w = _aqt(kind)
    impl = w.tensor_impl
    name = BIG_FIELD[type(impl)]
    t = getattr(impl, name)
    if t.dim() == 1:  # every other element of a buffer twice as long
        strided = torch.empty(t.numel() * 2, dtype=t.dtype)[::2]
    else:
        strided = torch.empty(t.shape[1], t.shape[0], dtype=t.dtype).t()
    strided.copy_(t)
    assert not strided.is_contiguous()
    tensors = {n: getattr(impl, n) for n in impl.tensor_names()}
    other = w._replace(type(impl).rebuild(impl.metadata(), {**tensors, name: strided}))
    x = torch.randn(m, K)
    assert torch.equal(F.linear(x, other), F.linear(x, w))


def test_forged_metadata_itself_is_rejected():
    impl = _aqt("int4").tensor_impl
    with pytest.raises(ValueError, match="group size"):
        _forged(impl, spec=torchq.QuantSpec((1, 48), 0, 15, "float")).validate()
    with pytest.raises(ValueError, match="scale dtype"):
        _forged(impl, scale_dtype=torch.int32).validate()
    with pytest.raises(ValueError, match="zero_dtype"):
        _forged(impl, zero_dtype=torch.int32).validate()
    with pytest.raises(TypeError, match="layout"):
        _forged(impl, layout=PlainLayout()).validate()
    with pytest.raises(ValueError, match="shape"):
        _forged(impl, shape=(8, K, 1)).validate()
    with pytest.raises(TypeError, match="tensor_impl"):
        AffineQuantizedTensor(object(), torch.float32)


def test_valid_impls_still_build_on_meta_and_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for kind in NATIVE_KINDS:
        w = _aqt(kind)
        on_meta = w.to("meta")
        assert on_meta.device.type == "meta" and on_meta.tensor_impl.shape == w.tensor_impl.shape
        with FakeTensorMode() as mode:
            impl = w.tensor_impl
            fake = {n: mode.from_tensor(getattr(impl, n)) for n in impl.tensor_names()}
            rebuilt = type(impl).rebuild(impl.metadata(), fake)
            assert rebuilt.shape == impl.shape


# -- defense in depth: the native entry points check every pointer ---------------------------------------
@needs_native
@pytest.mark.parametrize("m", [1, 200], ids=["decode", "prefill"])
@pytest.mark.parametrize("kind", NATIVE_KINDS)
def test_an_impl_altered_after_construction_never_reaches_the_kernel(kind, m):
    """Bypassing every constructor check (``__dict__`` changed after the wrapper was built),
    F.linear still raises before the library sees the pointers: first a claimed shape larger
    than the buffers, then a buffer swapped for a smaller one, then one whose storage shrank."""
    x = torch.randn(m, K)
    field = None
    for change in ("shape", "small", "shrunk"):
        w = _aqt(kind)
        impl = w.tensor_impl
        field = BIG_FIELD[type(impl)]
        if change == "shape":
            impl.__dict__["shape"] = (4096, K)
        elif change == "small":
            impl.__dict__[field] = getattr(impl, field)[:1].clone()
        else:
            t = getattr(impl, field).clone()
            t.untyped_storage().resize_(16)
            impl.__dict__[field] = t
        # (int8_vnni's remembered scale shape no longer matching a forged row count is caught first)
        with pytest.raises(ValueError, match=rf"({field}|scale_shape): (expected|its storage)"):
            F.linear(x, w)


@needs_native
@pytest.mark.parametrize("kind", NATIVE_KINDS)
def test_cached_pointers_are_not_reused_for_another_claimed_shape(kind):
    """The decode path caches a weight's pointers per impl; a shape changed after a call is
    checked again instead of reusing pointers checked for the old shape."""
    w = _aqt(kind)
    x = torch.randn(1, K)
    F.linear(x, w)
    w.tensor_impl.__dict__["shape"] = (4096, K)
    with pytest.raises(ValueError, match=rf"torchq .*{BIG_FIELD[type(w.tensor_impl)]}: expected"):
        F.linear(x, w)


@needs_native
def test_checked_ptr_rejects_every_unsafe_buffer():
    good = torch.zeros(4, 8, dtype=torch.uint8)
    assert native_library.checked_ptr("t", good, torch.uint8, 32) == good.data_ptr()
    assert native_library.checked_ptr("t", None, torch.uint8, 32) is None
    assert native_library.checked_ptr("t", torch.zeros(64, dtype=torch.uint8)[32:], torch.uint8, 32) is not None  # an offset view
    whole = torch.zeros(64, dtype=torch.uint8)
    shrunk = whole[:32]
    whole.untyped_storage().resize_(16)  # the view still claims 32 elements
    bad = {
        "meta": (torch.zeros(32, dtype=torch.uint8, device="meta"), "on meta"),
        "dtype": (torch.zeros(32, dtype=torch.int8), "torch.int8"),
        "count": (torch.zeros(31, dtype=torch.uint8), r"\[31\]"),
        "strided": (good.t(), "non-contiguous"),
        "expanded": (torch.zeros(1, dtype=torch.uint8).expand(32), "non-contiguous"),
        "shrunk": (shrunk, "storage holds 16 bytes"),
    }
    for why, (t, message) in bad.items():
        with pytest.raises(ValueError, match=rf"t: .*{message}"):
            native_library.checked_ptr("t", t, torch.uint8, 32)
        assert why


@needs_native
def test_run_linear_checks_the_input_and_the_bias():
    w = _aqt("int8wo")
    impl = w.tensor_impl
    weight = native_library.weight_args(impl, lambda i: native_library.int8_weight("int8", i.codes, i.scale.reshape(-1), 8, K))
    run = lambda x, b=None: native_library.run_linear(weight, x, b)  # noqa: E731
    assert run(torch.randn(2, K)).shape == (2, 8)
    with pytest.raises(ValueError, match=r"x: expected a contiguous CPU torch.float32 tensor of 512 elements, got .*\[2, 255\]"):
        run(torch.randn(2, K - 1))
    with pytest.raises(ValueError, match=r"x: expected last dimension K=256"):
        run(torch.randn(2, 1, K - 1))
    with pytest.raises(TypeError, match=r"x: expected fp32, bf16 or fp16, got torch.float64"):
        run(torch.randn(2, K, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x: expected a contiguous CPU"):
        run(torch.randn(2, K, device="meta"))
    for b in (torch.randn(8, device="meta"), torch.randn(7), torch.randn(8, dtype=torch.bfloat16, device="meta")):
        with pytest.raises(ValueError, match=r"bias: expected a contiguous CPU torch.float32 tensor of 8 elements"):
            run(torch.randn(2, K), b)
    whole = torch.randn(16)
    shrunk = whole[:8]
    whole.untyped_storage().resize_(8)
    with pytest.raises(ValueError, match=r"bias: its storage holds 8 bytes"):
        run(torch.randn(2, K), shrunk)


# -- bias: device, dtype and shape, for every kernel ----------------------------------------------------
def _bias_weights() -> dict[str, AffineQuantizedTensor]:
    w = torch.randn(8, K)
    return {
        "int4_native": _aqt("int4"),
        "nf4": _aqt("nf4"),
        "int8wo": _aqt("int8wo"),
        "int8dq": _aqt("int8dq"),
        "int4_cpu": _aqt("int4").to_layout(Int4CPULayout()),
        "llm_int8": torchq.llm_int8().quantize_weight(w),
        "fallback": _aqt("int4").to_layout(PackedBitsLayout()),  # dequantize + F.linear
    }


BIAS_KINDS = list(_bias_weights())


@pytest.mark.parametrize("m", [1, 3, 200])
@pytest.mark.parametrize("kind", BIAS_KINDS)
def test_a_bias_on_the_wrong_device_dtype_or_shape_raises(kind, m):
    """Before the fix a meta bias gave the no-bias result (its data pointer is 0)."""
    w = _bias_weights()[kind]
    x = torch.randn(m, K)
    good = torch.randn(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = F.linear(x, w, good)  # also caches the kernel for this signature
        assert torch.allclose(ref, F.linear(x, w) + good, atol=1e-4)
        with pytest.raises(ValueError, match=r"bias: expected device cpu .*got meta"):
            F.linear(x, w, good.to("meta"))
        with pytest.raises(TypeError, match=r"bias: expected dtype torch.float32 .*got torch.bfloat16"):
            F.linear(x, w, good.to(torch.bfloat16))
        with pytest.raises(TypeError, match=r"bias: expected dtype torch.float32 .*got torch.int64"):
            F.linear(x, w, torch.arange(8))
        for shape in [(7,), (1,), (1, 8), (9,)]:
            with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
                F.linear(x, w, torch.randn(shape))
        x_bf16 = x.to(torch.bfloat16)
        assert F.linear(x_bf16, w, good.to(torch.bfloat16)).dtype == torch.bfloat16  # matching dtypes: fine
        with pytest.raises(TypeError, match=r"bias: expected dtype torch.bfloat16"):
            F.linear(x_bf16, w, good)


def test_float_linear_raises_for_the_same_biases():
    """What the checks match: float F.linear rejects these biases too."""
    x, w = torch.randn(2, K), torch.randn(8, K)
    for b in (torch.randn(8, device="meta"), torch.randn(8, dtype=torch.bfloat16), torch.randn(7)):
        with pytest.raises(RuntimeError):
            F.linear(x, w, b)


def test_an_autocast_bias_of_another_float_dtype_is_accepted():
    w = _aqt("int8wo")
    x = torch.randn(2, K, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.linear(x, w, torch.randn(8))
    assert y.shape == (2, 8)


@needs_native
@pytest.mark.parametrize("op", ["int4", "nf4", "int8wo", "int8dq"])
def test_the_ops_reject_a_meta_bias(op):
    """The torchq:: ops called directly (as a compiled graph does) check the bias too."""
    x = torch.randn(2, K)
    b = torch.randn(8, device="meta")
    if op == "int4":
        impl = _aqt("int4").tensor_impl
        call = lambda: torch.ops.torchq.int4_groupwise_linear(  # noqa: E731
            x, impl.packed, impl.scale, impl.shift, impl.zero, [8, K], impl.group_size, impl.code_base, *impl.round_kinds, b)
    elif op == "nf4":
        impl = _aqt("nf4").tensor_impl
        call = lambda: torch.ops.torchq.blockwise_4bit_linear(  # noqa: E731
            x, impl.packed, impl.absmax, impl.nested_codes, impl.nested_absmax, impl.nested_offset, [8, K], 64, "nf4", b)
    elif op == "int8wo":
        impl = _aqt("int8wo").tensor_impl
        call = lambda: torch.ops.torchq.int8_weight_linear(x, impl.codes, impl.scale, b)  # noqa: E731
    else:
        impl = _aqt("int8dq").tensor_impl
        act = PerTokenInt8()
        call = lambda: torch.ops.torchq.int8_dynamic_linear(  # noqa: E731
            x, impl.codes, impl.scale, act.quant_min, act.quant_max, act.eps, b)
    with pytest.raises((ValueError, RuntimeError), match=r"bias|meta|device"):
        call()


def test_ops_called_directly_with_a_meta_argument_among_cpu_ones_raise():
    """An eager call mixing devices dispatches to the fake kernel; it must raise, not return
    uninitialized memory (checked for the bitsandbytes-style, LLM.int8 and affine ops)."""
    a = torch.zeros(128, dtype=torch.uint8)
    meta = torch.ones(2, device="meta")
    code = torch.linspace(-1, 1, 256)
    with pytest.raises(ValueError, match="absmax: expected device cpu"):
        torch.ops.torchq.dequantize_blockwise(a, meta, code, 64, torch.float32)
    with pytest.raises(ValueError, match="expected device cpu"):
        torch.ops.torchq.dequantize_4bit(a, meta, 64, "nf4", [16, 16], torch.float32)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="expected device cpu"):
        torch.ops.torchq.int8_vectorwise_dequant(x.to(torch.int8), torch.ones(4, device="meta"))
    with pytest.raises(ValueError, match="expected device cpu"):
        torch.ops.torchq.int8_linear_matmul(x.to(torch.int8), torch.ones(3, 8, dtype=torch.int8, device="meta"))
