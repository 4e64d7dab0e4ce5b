"""torch.compile(fullgraph=True) on quantized models: same outputs, and the generated code calls
the quantized kernel with no dequantize-then-matmul fallback."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import torchq

pytestmark = pytest.mark.slow

# Inductor may keep our torchq:: op opaque or lower it to its own int4 kernel: either is a
# quantized kernel.
INT4 = ("torchq.int4_groupwise_linear", "torchq.int4_cpu_mm", "_weight_int4pack_mm_for_cpu", "int4mm_packed_weight_cpu")
INT8 = ("torchq.int8_weight_linear", "torchq.int8_weight_only_mm", "_weight_int8pack_mm")
CASES = {
    "int4": (torchq.int4_weight_only(group_size=32), INT4),
    "int8_weight_only": (torchq.int8_weight_only(), INT8),
    "int8_dynamic": (torchq.int8_dynamic_activation_int8_weight(), ("torchq.int8_dynamic_linear", "torchq.int8_linear_matmul", "_int_mm")),
    "intx3": (torchq.intx_weight_only(bits=3, group_size=32), INT4),
}
FLOAT_MATMULS = ("extern_kernels.mm(", "extern_kernels.addmm(", "extern_kernels.bmm(", "aten.mm.", "aten.addmm.", "cpp_fused_mm", "mkldnn")


def model(dtype):
    return torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_fullgraph_compile_calls_quantized_kernel(name, dtype):
    cfg, kernel = CASES[name]
    m = model(dtype)
    torchq.quantize_(m, cfg)
    x = torch.randn(3, 128, dtype=dtype)
    eager = m(x)
    torch._dynamo.reset()
    with torch.no_grad():
        y, codes = run_and_get_code(torch.compile(m, fullgraph=True), x)
    src = "\n".join(codes)
    assert any(f"{k}(" in src or f"{k}.default(" in src for k in kernel), f"generated code calls none of {kernel}"
    calls = [line for line in src.splitlines() if any(f in line for f in FLOAT_MATMULS)]
    assert not calls, f"generated code has a float matmul: {calls[:3]}"
    tol = 2e-2  # bf16 and fp16 inputs: compiled and eager kernels round in different places
    assert torch.allclose(y.float(), eager.float(), rtol=tol, atol=tol)


def test_compile_with_grad_enabled_and_backward():
    m = model(torch.float32)
    torchq.quantize_(m, torchq.int4_weight_only(group_size=32))
    x = torch.randn(3, 128, requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(m, fullgraph=True)(x)
    y.sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    m(xr).sum().backward()
    assert torch.allclose(x.grad, xr.grad, rtol=2e-2, atol=2e-2)


def test_compile_fallback_warns_and_strict_raises():
    m = torch.nn.Linear(64, 32)
    torchq.quantize_(m, torchq.intx_weight_only(bits=3, layout=torchq.PackedBitsLayout()))
    x = torch.randn(2, 64)
    torch._dynamo.reset()
    with pytest.warns(torchq.FallbackWarning, match="layer ''|no linear kernel"):
        y = torch.compile(m, fullgraph=True)(x)
    assert torch.allclose(y, torch.nn.functional.linear(x, m.weight.dequantize(), m.bias), atol=1e-5)
    torch._dynamo.reset()
    with torchq.strict(), pytest.raises(Exception, match="strict mode forbids"):
        torch.compile(m, fullgraph=True)(x)


def test_compiled_embedding_lookup_on_a_quantized_weight_does_not_recompile_per_token():
    """A tied lm_head / embedding under torch.compile: the index bounds check is an async assert
    in the graph, not a data-dependent branch (which broke the graph and guarded on each token id)."""
    emb = torch.nn.Embedding(64, 32)
    emb.weight = torch.nn.Parameter(torchq.int8_weight_only().quantize_weight(emb.weight.detach()), requires_grad=False)
    torch._dynamo.reset()
    compiled = torch.compile(emb, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for token in (3, 17, 63):
            idx = torch.tensor([[token]])
            assert torch.equal(compiled(idx), emb.weight.dequantize()[idx])


@pytest.mark.parametrize("config", ["int8_weight_only", "int4_weight_only", "nf4_weight_only", "int8_dynamic_activation_int8_weight"])
def test_dynamic_shapes_when_dynamo_runs_nodes_outside_is_compiling(monkeypatch, config):
    """Some PyTorch versions (2.11) run a graph node on fake tensors with symbolic sizes while
    ``torch.compiler.is_compiling()`` is False: the eager plan cache must not try to hash those
    sizes (it raised "unhashable type: non-nested SymInt" on a recompile for a new batch size)."""
    from torchq import dispatch

    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    torchq.quantize_(model, getattr(torchq, config)())
    ref = [model(torch.randn(m, 64, generator=torch.Generator().manual_seed(m))) for m in (3, 5)]
    monkeypatch.setattr(dispatch.torch.compiler, "is_compiling", lambda: False)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for m, want in zip((3, 5), ref):
        assert torch.allclose(compiled(torch.randn(m, 64, generator=torch.Generator().manual_seed(m))), want, atol=1e-4)


@pytest.mark.parametrize("config", [torchq.int8_weight_only(), torchq.int4_weight_only(group_size=32),
                                    torchq.int4_weight_only(group_size=32, zero_point_domain="int"), torchq.nf4_weight_only(),
                                    torchq.int8_dynamic_activation_4bit_weight(), torchq.intx_weight_only(bits=3, group_size=32)],
                         ids=["int8wo", "int4", "int4-int-zero", "nf4", "int4a8", "intx3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_embedding_lookup_keeps_the_number_of_ids_symbolic(config, dtype):
    """vLLM compiles its model with the token count marked dynamic (strictly: a guard that fixes it
    fails the compile). A quantized tied embedding's lookup must not turn it into a constant (the
    int4 layout's row gather built a weight impl of that many rows, whose constructor took int()),
    and gives the eager rows bit for bit (Inductor, fusing the dequantization written inline,
    skipped the rounding of a bf16 scale's product before the zero point was added)."""
    weight = torch.randn(80, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    emb = torch.nn.Embedding(80, 64)
    emb.weight = torch.nn.Parameter(config.quantize_weight(weight), requires_grad=False)
    table = emb.weight.dequantize()
    torch._dynamo.reset()
    compiled = torch.compile(emb, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (40, 7, 2):  # 1 recompiles in any model (PyTorch specializes sizes 0 and 1)
            idx = torch.arange(n) * 37 % 80
            torch._dynamo.mark_dynamic(idx, 0)
            assert torch.equal(compiled(idx), table[idx])


def _bf16_rounded_weights() -> dict[str, torch.Tensor]:
    """Weights whose dequantization rounds twice in eager (to a bf16 scale's dtype, then to the
    output dtype), the case Inductor's fused arithmetic got wrong."""
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    return {
        "int4-float-zero-bf16": torchq.int4_weight_only(group_size=32).quantize_weight(w.to(torch.bfloat16)),
        "intx3-packed-bf16-scale": torchq.intx_weight_only(bits=3, group_size=32, scale_dtype=torch.bfloat16,
                                                           layout=torchq.PackedBitsLayout()).quantize_weight(w),
    }


@pytest.mark.parametrize("name", ["int4-float-zero-bf16", "intx3-packed-bf16-scale"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_dequantize_and_row_select_keep_the_eager_roundings(name, out_dtype):
    """``weight.dequantize()`` and ``weight[i]`` under torch.compile give the eager values bit for
    bit: a traced dequantization goes through ``torchq::dequantize_affine`` (Inductor fused the
    same arithmetic written inline and skipped the rounding to the bf16 scale's dtype)."""
    weight = _bf16_rounded_weights()[name]
    torch._dynamo.reset()
    table = torch.compile(lambda w: w.dequantize(out_dtype), fullgraph=True)(weight)
    assert table.dtype == out_dtype and torch.equal(table, weight.dequantize(out_dtype))
    row = torch.compile(lambda w: w[5], fullgraph=True)(weight)
    assert torch.equal(row, weight.dequantize()[5])


def test_compiled_dequantize_fallback_linear_keeps_the_eager_roundings():
    """The dequantize + F.linear fallback (a layout with no kernel) under torch.compile: the
    eager output bit for bit (the weight's values come from the op, not fused inline arithmetic)."""
    m = torch.nn.Linear(64, 48, bias=False)
    m.weight = torch.nn.Parameter(_bf16_rounded_weights()["intx3-packed-bf16-scale"], requires_grad=False)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    with pytest.warns(torchq.FallbackWarning):
        eager = m(x)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True)(x)  # (the layer's fallback warning was given once, above)
    assert torch.equal(compiled, eager)
