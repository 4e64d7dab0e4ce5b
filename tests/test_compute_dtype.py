"""``compute_dtype``: an fp32 model never computes in bf16 unless its config asks for it or a
warning says so; asking reproduces the former bf16 path exactly; the setting survives JSON,
tensor ops and both checkpoint formats."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchq
from torchq.dispatch import dequantized_linear, plan_linear
from torchq.layouts import Int4CPULayout, PackedBitsLayout, PlainLayout, registered_layouts

Z = torchq.ZeroPointDomain
CONFIGS = {
    "int4_g32": torchq.int4_weight_only(32),
    "int4_g128_int_zero": torchq.int4_weight_only(128, zero_point_domain=Z.INT),
    "int4_g32_sym": torchq.int4_weight_only(32, zero_point_domain=Z.NONE),
    "int8_weight_only": torchq.int8_weight_only(),
    "int8_dynamic": torchq.int8_dynamic_activation_int8_weight(),
    "intx3_g32": torchq.intx_weight_only(3, 32),
    "nf4_dq": torchq.nf4_weight_only(64),
    "llm_int8": torchq.llm_int8(),
}
# bf16 keeps 8 significant bits: one rounding of the input or output is ~2e-3 relative, far
# above what fp32 accumulation-order differences reach at K=256
FP32_REL_TOL = 2e-5


def _cases():
    """(config name, layout name, config) for every config in every CPU layout that holds it."""
    for cname, base in CONFIGS.items():
        yield cname, "auto", base
        for lname, cls in sorted(registered_layouts().items()):
            with contextlib.suppress(TypeError, ValueError):
                yield cname, lname, type(base)(**{**base.__dict__, "layout": cls()})


def _fp32_violations() -> list[str]:
    """Cases where an fp32 input computes in another dtype without a FallbackWarning, or whose
    output is not within fp32 rounding of the fp32 reference."""
    bad = []
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(48)
    for cname, lname, cfg in _cases():
        try:
            q = cfg.quantize_weight(w, label=f"{cname}@{lname}")
        except (TypeError, ValueError):  # this layout cannot hold this weight on the CPU
            continue
        plan = plan_linear(x, q, bias)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            y = F.linear(x, q, bias)
        warned = any(issubclass(r.category, torchq.FallbackWarning) for r in rec)
        if plan.run_dtype != torch.float32 and not warned:
            bad.append(f"{cname}@{lname}: kernel {plan.kernel and plan.kernel.name} ran in {plan.run_dtype} silently")
        if plan.run_dtype == torch.float32:
            ref = dequantized_linear(x, q, bias)
            err = float((y - ref).abs().max() / ref.abs().max())
            if err > FP32_REL_TOL:
                bad.append(f"{cname}@{lname}: kernel {plan.kernel and plan.kernel.name}: error {err:.2e} vs the fp32 reference")
    return bad


@pytest.mark.parametrize("native", ["enabled", "disabled"])
def test_fp32_model_computes_in_fp32(native):
    ctx = torchq.native.disabled() if native == "disabled" else contextlib.nullcontext()
    with ctx:
        assert _fp32_violations() == []


def test_fp32_model_computes_in_fp32_without_the_native_library():
    code = "import sys; sys.path.insert(0, 'tests'); import test_compute_dtype as t; print(t._fp32_violations())"
    env = {**os.environ, "TORCHQ_NATIVE": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("layout, kernel", [(Int4CPULayout(), "int4_cpu"), (PlainLayout(), "int8_weight_only_cpu")])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.float16], ids=str)
def test_bf16_compute_dtype_is_the_former_bf16_path(layout, kernel, xdtype):
    base = torchq.int4_weight_only(32) if kernel == "int4_cpu" else torchq.int8_weight_only()
    cfg = type(base)(**{**base.__dict__, "layout": layout, "compute_dtype": torch.bfloat16})
    q = cfg.quantize_weight(torch.randn(48, 256, dtype=torch.bfloat16))
    assert q.compute_dtype == torch.bfloat16
    x = torch.randn(3, 256, dtype=xdtype)
    bias = torch.randn(48, dtype=xdtype)
    with torchq.native.disabled(), torchq.strict():  # asked for: no warning, no error
        plan = plan_linear(x, q, bias)
        assert (plan.kernel.name, plan.run_dtype, plan.fallback) == (kernel, torch.bfloat16, None)
        y = F.linear(x, q, bias)
        impl = {k.name: k for k in torchq.linear_kernels(layout)}[kernel].impl
        old = impl(x.to(torch.bfloat16), q, None).to(xdtype)
        assert y.dtype == xdtype and torch.equal(y, old + bias.to(old.dtype))
        report = torchq.explain(q, x)
    assert report.decisions[0].compute == f"bfloat16 (input {str(xdtype)[6:]} cast, output cast back)"
    assert "compute_dtype=torch.bfloat16" in repr(q)


def test_cast_fallback_warns_once_and_strict_raises():
    calls = []

    def impl(x, w, b):
        calls.append(x.dtype)
        return F.linear(x, w.dequantize(x.dtype), b)

    torchq.register_linear_kernel("bf16_only", lambda x, w, b: None, impl, layout=PackedBitsLayout, dtypes=(torch.bfloat16,))
    try:
        q = torchq.intx_weight_only(3, 32, layout=PackedBitsLayout()).quantize_weight(torch.randn(16, 64), label="proj")
        x = torch.randn(2, 64)
        with pytest.warns(torchq.FallbackWarning, match=r"layer 'proj'.*no linear kernel takes a torch.float32.*"
                                                        r"'bf16_only' runs on the input cast to torch.bfloat16") as rec:
            y = F.linear(x, q)
            F.linear(x, q)
        assert sum(issubclass(r.category, torchq.FallbackWarning) for r in rec) == 1
        assert y.dtype == torch.float32 and calls == [torch.bfloat16, torch.bfloat16]
        assert "FALLBACK: no kernel takes float32" in torchq.explain(q, x).decisions[0].compute
        with torchq.strict(), pytest.raises(torchq.NoKernelError, match="strict mode forbids the cast fallback"):
            F.linear(x, q)  # a cached choice too
        torchq.dispatch.clear_kernel_cache()
        with torchq.strict(), pytest.raises(torchq.NoKernelError, match="bf16_only"):
            F.linear(x, q)
        with torchq.strict():  # bf16 input: the kernel's own dtype, no fallback
            assert F.linear(x.bfloat16(), q).dtype == torch.bfloat16
    finally:
        torchq.unregister_linear_kernel("bf16_only")


def test_compute_dtype_is_validated_and_round_trips_through_json():
    for make in (lambda d: torchq.int4_weight_only(32, compute_dtype=d), lambda d: torchq.int8_weight_only(compute_dtype=d),
                 lambda d: torchq.nf4_weight_only(compute_dtype=d), lambda d: torchq.llm_int8(compute_dtype=d),
                 lambda d: torchq.intx_weight_only(3, compute_dtype=d),
                 lambda d: torchq.int8_dynamic_activation_int8_weight(compute_dtype=d)):
        cfg = make(torch.bfloat16)
        again = torchq.config_from_json(json.loads(cfg.to_json_str()))
        assert again == cfg and again.compute_dtype == torch.bfloat16
        assert torchq.config_from_json(make(None).to_json()).compute_dtype is None
        with pytest.raises(ValueError, match="compute_dtype: expected torch.float32/bfloat16/float16 or None, got torch.float64"):
            make(torch.float64)
    with pytest.raises(ValueError, match="compute_dtype"):
        torchq.AffineQuantizedTensor.from_float(torch.randn(8, 32), "symmetric", (1, 32), -8, 7, compute_dtype=torch.int8)


def test_compute_dtype_survives_tensor_ops_and_checkpoints(tmp_path):
    lin = torch.nn.Linear(64, 16)
    torchq.quantize_(lin, torchq.int8_weight_only(compute_dtype=torch.float16))
    w = lin.weight
    assert w.compute_dtype == torch.float16
    names, ctx = w.__tensor_flatten__()
    rebuilt = type(w).__tensor_unflatten__({n: getattr(w, n) for n in names}, ctx, w.shape, w.stride())
    for t in (rebuilt, w.detach(), w.clone(), w.to("cpu"), w.to(torch.bfloat16), w.t().t(), w[:8]):
        assert t.compute_dtype == torch.float16
    kwarg = torchq.AffineQuantizedTensor.from_plain(w.to_plain(), torch.float32, compute_dtype=torch.bfloat16)
    assert kwarg.compute_dtype == torch.bfloat16
    other = torch.nn.Linear(64, 16)
    torchq.quantize_(other, torchq.int8_weight_only(compute_dtype=torch.float16))
    with torch.no_grad():
        other.weight.copy_(w)
    assert other.weight.compute_dtype == torch.float16
    with pytest.raises(ValueError, match="compute_dtype"), torch.no_grad():
        other.weight.copy_(kwarg)
    x = torch.randn(3, 64)
    y = lin(x)

    torch.save(lin.state_dict(), tmp_path / "sd.pt")
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert sd["weight"].compute_dtype == torch.float16

    torchq.save_quantized(lin, tmp_path / "st")
    fresh = torch.nn.Linear(64, 16)
    torchq.load_quantized(fresh, tmp_path / "st")
    assert fresh.weight.compute_dtype == torch.float16
    assert torch.equal(fresh(x), y)
