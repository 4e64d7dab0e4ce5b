"""AffineQuantizedTensor: construction, generic ops, slicing, copy_, errors."""

import copy

import pytest
import torch
import torch.nn.functional as F

import torchq
from torchq import AffineQuantizedTensor as AQT
from torchq.layouts.int4_cpu import Int4CPULayout
from torchq.layouts.packed_bits import PackedBitsLayout
from torchq.layouts.plain import PlainLayout

LAYOUTS = [PlainLayout(), PackedBitsLayout(), Int4CPULayout()]


def int4(w, layout=None, label="layer"):
    return torchq.int4_weight_only(group_size=32, layout=layout).quantize_weight(w, label=label)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_wrapper_looks_like_the_float_weight(layout):
    w = torch.randn(64, 96, dtype=torch.bfloat16)
    q = int4(w, layout)
    assert isinstance(q, torch.Tensor) and isinstance(q, AQT)
    assert q.shape == w.shape and q.dtype == w.dtype and q.device == w.device
    assert q.layout == torch.strided and q.quant_layout == layout
    assert not q.requires_grad
    d = q.dequantize()
    assert d.shape == w.shape and d.dtype == torch.bfloat16
    assert torch.equal(q.dequantize(torch.float32), q.to_plain().dequantize(torch.float32))
    r = repr(q)
    assert "AffineQuantizedTensor" in r and type(layout).__name__ in r
    assert "4-bit" in r and "'layer'" in r


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_detach_clone_to_deepcopy_keep_values(layout):
    q = int4(torch.randn(64, 64), layout)
    ref = q.dequantize()
    for other in (q.detach(), q.clone(), copy.deepcopy(q), q.to("cpu"), torch.nn.Parameter(q, requires_grad=False)):
        assert isinstance(other, AQT)
        assert torch.equal(other.dequantize(), ref)
        assert other.to_plain().equal(q.to_plain())
    c = q.clone()
    assert all(getattr(c, n).data_ptr() != getattr(q, n).data_ptr() for n in q.tensor_impl.tensor_names())


def test_to_dtype_changes_output_dtype_not_codes():
    q = int4(torch.randn(64, 64))
    h = q.to(torch.float16)
    assert h.dtype == torch.float16 and h.to_plain().equal(q.to_plain())
    with pytest.raises(TypeError, match="floating dtype"):
        q.to(torch.int8)


def test_to_meta_device_repacks_into_a_layout_that_lives_there():
    q = int4(torch.randn(64, 64), Int4CPULayout())
    m = q.to("meta")
    assert m.device.type == "meta" and not isinstance(m.quant_layout, Int4CPULayout)
    assert m.shape == q.shape


def test_transpose_and_mm_addmm_use_the_kernel():
    w = torch.randn(48, 64)
    q = int4(w)
    x = torch.randn(5, 64)
    expected = F.linear(x, q)
    assert q.t().shape == (64, 48) and q.t().transposed
    assert torch.equal(q.t().t().dequantize(), q.dequantize())
    assert torch.equal(torch.mm(x, q.t()), expected)
    assert torch.equal(torch.matmul(x, q.t()), expected)
    b = torch.randn(48)
    assert torch.allclose(torch.addmm(b, x, q.t()), expected + b, atol=1e-6)
    assert torch.allclose(torch.addmm(b, x, q.t(), beta=0.5, alpha=2.0), 0.5 * b + 2 * expected, atol=1e-5)
    assert torch.equal(q.t().dequantize(), q.dequantize().t())
    report = torchq.explain(q, x)
    assert report.decisions[0].kernel == ("int4_native" if torchq.native.available() else "int4_cpu")


def test_untransposed_mm_computes_on_dequantized_weight_with_warning():
    q = int4(torch.randn(48, 64))
    g = torch.randn(5, 48)
    with pytest.warns(torchq.FallbackWarning, match="layer 'layer'"):
        out = torch.mm(g, q)
    assert torch.allclose(out, g @ q.dequantize(), atol=1e-5)
    with torchq.strict(), pytest.raises(torchq.NoKernelError):
        torch.mm(g, q)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("dim", [0, 1])
def test_narrow_matches_plain_narrow(layout, dim):
    w = torch.randn(128, 128)
    q = int4(w, layout)
    s = q.narrow(dim, 64, 64)
    assert s.shape[dim] == 64
    assert s.to_plain().equal(q.to_plain().narrow(dim, 64, 64))
    assert torch.equal(s.dequantize(), q.dequantize().narrow(dim, 64, 64))
    assert torch.equal(q[32:96].dequantize(), q.dequantize()[32:96])


def test_narrow_off_group_boundary_is_an_error():
    q = int4(torch.randn(64, 128))
    with pytest.raises(ValueError, match="multiples of 32"):
        q.narrow(1, 10, 32)
    with pytest.raises(NotImplementedError, match="step"):
        q[::2]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("dim", [0, 1])
def test_tensor_parallel_shard_loading_pattern(layout, dim):
    """Serving engines allocate the full weight, then copy each shard into a narrowed view."""
    full = int4(torch.randn(128, 128), layout)
    target = int4(torch.zeros(128, 128), layout)
    for start in (0, 64):
        shard = full.narrow(dim, start, 64).clone()
        target.narrow(dim, start, 64).copy_(shard)
    assert target.to_plain().equal(full.to_plain())
    assert torch.equal(target.dequantize(), full.dequantize())


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_copy_between_same_metadata(layout):
    a = int4(torch.randn(64, 64), layout)
    b = int4(torch.randn(64, 64), layout)
    ptrs = [getattr(b, n).data_ptr() for n in b.tensor_impl.tensor_names()]
    b.copy_(a)
    assert b.to_plain().equal(a.to_plain())
    assert ptrs == [getattr(b, n).data_ptr() for n in b.tensor_impl.tensor_names()]  # in place


def test_copy_across_layouts_repacks_losslessly():
    a = int4(torch.randn(64, 64), PlainLayout())
    b = int4(torch.zeros(64, 64), Int4CPULayout())
    b.copy_(a)
    assert b.quant_layout == Int4CPULayout() and b.to_plain().equal(a.to_plain())


def test_copy_mismatch_says_what_differs():
    a = int4(torch.randn(64, 64))
    with pytest.raises(ValueError, match="shape"):
        a.copy_(int4(torch.randn(32, 64)))
    with pytest.raises(ValueError, match="format"):
        a.copy_(torchq.int8_weight_only().quantize_weight(torch.randn(64, 64)))
    with pytest.raises(ValueError, match="dtype"):
        a.copy_(int4(torch.randn(64, 64, dtype=torch.bfloat16)))
    with pytest.raises(TypeError, match="float tensor into quantized"):
        a.copy_(torch.randn(64, 64))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_select_and_index_rows(layout):
    q = int4(torch.randn(64, 96), layout)
    d = q.dequantize()
    assert torch.equal(q[3], d[3]) and torch.equal(q[-1], d[-1])
    idx = torch.tensor([[0, 5], [63, 5]])
    assert torch.equal(q[idx], d[idx])
    assert torch.equal(F.embedding(torch.tensor([1, 2, 2]), q), d[[1, 2, 2]])
    with pytest.raises(IndexError):
        q[64]


def test_unsupported_op_names_op_and_layout():
    q = int4(torch.randn(64, 64), Int4CPULayout())
    with pytest.raises(NotImplementedError, match=r"aten\.add.*Int4CPULayout"):
        q + 1
    with pytest.raises(NotImplementedError, match="view"):
        q.view(-1)


def test_to_layout_is_lossless_and_explicit():
    q = int4(torch.randn(64, 64), PlainLayout())
    for layout in LAYOUTS:
        r = q.to_layout(layout)
        assert r.quant_layout == layout and r.to_plain().equal(q.to_plain())
    with pytest.raises(TypeError, match="Layout"):
        q.to_layout("plain")


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (torch.randn(4, 4, 4), ValueError, "2-D"),
        (torch.randn(0, 64), ValueError, "non-empty"),
        (torch.randint(0, 5, (64, 64)), TypeError, "floating"),
        (torch.tensor([[float("nan")] * 64] * 2), ValueError, "NaN/inf"),
        (torch.tensor([[float("inf")] * 64] * 2), ValueError, "NaN/inf"),
    ],
)
def test_from_float_rejects_bad_weights(bad, exc, match):
    with pytest.raises(exc, match=match):
        AQT.from_float(bad, torchq.MappingType.SYMMETRIC, (1, 32), -8, 7, label="x")


def test_subclass_flatten_roundtrip():
    q = torchq.int8_dynamic_activation_int8_weight().quantize_weight(torch.randn(32, 64), label="l")
    names, ctx = q.__tensor_flatten__()
    r = AQT.__tensor_unflatten__({n: getattr(q, n) for n in names}, ctx, q.shape, q.stride())
    assert r.act_quant == q.act_quant and r.label == "l" and r.to_plain().equal(q.to_plain())
    assert isinstance(q._stable_hash_for_caching(), str)


def test_tensor_flatten_is_reused_until_a_part_changes():
    """Compiled graphs' guards call __tensor_flatten__ per weight per call: it is built once, and a
    reassigned part (label, impl, ...) gives a new context, never a stale one."""
    import copy

    w = torchq.int4_weight_only(group_size=32).quantize_weight(torch.randn(16, 64), label="proj")
    names, ctx = w.__tensor_flatten__()
    again_names, again = w.__tensor_flatten__()
    assert again is ctx and again_names == names and again_names is not names  # a fresh list each time
    again_names.append("mutated")
    assert w.__tensor_flatten__()[0] == names
    w.label = "other"
    relabelled = w.__tensor_flatten__()[1]
    assert relabelled is not ctx and relabelled[4] == "other" and relabelled[0] == ctx[0]
    twin = copy.deepcopy(w)
    assert twin.__tensor_flatten__()[1] == w.__tensor_flatten__()[1]
    rebuilt = type(w).__tensor_unflatten__({n: getattr(w, n) for n in w.__tensor_flatten__()[0]}, w.__tensor_flatten__()[1], None, None)
    assert torch.equal(rebuilt.dequantize(), w.dequantize())
    w.tensor_impl = torchq.int4_weight_only(group_size=64).quantize_weight(torch.randn(16, 64)).tensor_impl
    assert w.__tensor_flatten__()[1][0] != ctx[0]


def test_compiled_graph_metadata_guard_is_an_identity_test_and_still_catches_changes():
    """The context a guard keeps is a deep copy: FlattenContext copies as itself, so the per-call
    check of an unchanged weight is an identity test; a changed weight's context differs and fails
    the guard (compared field by field), and an equal one built anew passes."""
    import copy

    from torchq.tensor import FlattenContext

    weight = torch.randn(16, 64)
    w = torchq.int4_weight_only(group_size=32).quantize_weight(weight, label="proj")
    ctx = w.__tensor_flatten__()[1]
    assert isinstance(ctx, FlattenContext) and isinstance(ctx, tuple) and repr(ctx) == repr(tuple(ctx))
    kept = copy.deepcopy(ctx)
    assert kept is ctx and copy.copy(ctx) is ctx
    assert AQT.__metadata_guard__(kept, w.__tensor_flatten__()[1])
    twin = torchq.int4_weight_only(group_size=32).quantize_weight(weight, label="proj")  # a new, equal context
    assert twin.__tensor_flatten__()[1] is not ctx and AQT.__metadata_guard__(kept, twin.__tensor_flatten__()[1])
    w.label = "other"
    assert not AQT.__metadata_guard__(kept, w.__tensor_flatten__()[1])
    w.label = "proj"
    w.tensor_impl = torchq.int4_weight_only(group_size=64).quantize_weight(torch.randn(16, 64)).tensor_impl
    assert not AQT.__metadata_guard__(kept, w.__tensor_flatten__()[1])
