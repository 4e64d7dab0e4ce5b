"""compressed-tensors checkpoints (built with the compressed-tensors package itself) <-> torchq weights:
bit-exact dequantization against the package's own decoding, kernels, export round trips, legacy
activation-order ``g_idx`` through ``AffineQuantizedTensor.input_perm``, hostile inputs, and a tiny
Llama compressed with ``ModelCompressor`` end to end."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torchq
from torchq.checkpoint import CheckpointError, codec
from torchq.dispatch import plan_linear
from torchq.interop.compressed_tensors import (
    from_compressed_tensors,
    load_compressed_tensors,
    pack_int32,
    to_compressed_tensors,
    unpack_int32,
)
from torchq.layouts import choose_layout

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::torchq.dispatch.FallbackWarning")

SCALE_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}  # linear outputs, relative to their size
FAST = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- building checkpoints with compressed-tensors ------------------------------------------------------------
def minmax_qparams(w: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """A calibration-free min/max observer: compressed-tensors' calculate_qparams on each
    group's / row's / the tensor's range."""
    if args.strategy == "group":
        g = w.unflatten(-1, (-1, args.group_size))
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    else:
        raise AssertionError(args.strategy)
    return calculate_qparams(lo, hi, args)


def scheme_dict(scheme: QuantizationScheme, **weights_override) -> dict:
    d = scheme.model_dump()
    d["weights"].update(weights_override)
    return d


def config_of(schemes: dict[str, dict], fmt: str, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": schemes, "ignore": [], **extra}


def build(n: int, k: int, fmt: str, sdt: torch.dtype, seed: int, actorder: str | None = None,
          input_activations: QuantizationArgs | None = None, prefix: str = "layer", **args):
    """``(tensors, quantization_config, reference weight)`` of one Linear weight compressed by the
    package's compressor for ``fmt``; the reference is the package's decompression. ``actorder=
    "group"`` (removed in compressed-tensors 0.20) is built from the package's pieces the way GPTQ
    writes it: codes of the activation-permuted weight, put back in column order, with
    ``g_idx = (arange(K) // group_size)[invperm]``; its reference is the package's dequantize of
    the permuted codes, permuted back (what compressed-tensors < 0.20 did with a g_idx)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(sdt)
    qargs = QuantizationArgs(**args, actorder="weight" if actorder is not None else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=qargs, input_activations=input_activations, format=fmt)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    perm = torch.randperm(k, generator=g) if actorder == "group" else torch.arange(k)
    inv = torch.argsort(perm)
    wp = w[:, perm]
    scale, zero = minmax_qparams(wp, qargs)
    sd = {"weight": wp, "weight_scale": scale}
    if not qargs.symmetric:
        sd["weight_zero_point"] = zero
    comp = compressor.compress(sd, scheme)
    ref = compressor.decompress(comp, scheme)["weight"][:, inv]
    cfg = config_of({"group_0": scheme_dict(scheme)}, fmt)
    if actorder == "group":
        if fmt == "pack-quantized":
            codes = unpack_from_int32(comp["weight_packed"], qargs.num_bits, torch.Size([n, k]))[:, inv]
            comp["weight_packed"] = pack_to_int32(codes.contiguous(), qargs.num_bits)
        else:
            comp["weight"] = comp["weight"][:, inv].contiguous()
        comp["weight_g_idx"] = (torch.arange(k) // qargs.group_size)[inv].to(torch.int32)
        cfg["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    tensors = {f"{prefix}.{key}": v for key, v in comp.items()}
    return tensors, cfg, ref


def legacy_g_idx_dequantize(codes, scale, zero, g_idx, args: QuantizationArgs) -> torch.Tensor:
    """compressed-tensors < 0.20's group dequantization with a g_idx, on 0.20's dequantize:
    sort the columns by group, dequantize contiguous groups, sort back."""
    order = torch.argsort(g_idx.long())
    out = ct_dequantize(codes[:, order], scale, zero, args)
    return out[:, torch.argsort(order)]


def check_linear(q: torchq.AffineQuantizedTensor, ref: torch.Tensor, seed: int) -> None:
    sdt = ref.dtype
    x = (torch.randn(3, ref.shape[1], generator=torch.Generator().manual_seed(seed))).to(sdt)
    y = F.linear(x, q)
    exact = F.linear(x.float(), ref.float())
    err = float((y.float() - exact).abs().max())
    assert err <= TOL[sdt] * (1 + float(exact.abs().max())), err
    plan = plan_linear(x, q, None)
    if plan.kernel is None and q.input_perm is None:  # the plain path is F.linear of the same values
        assert torch.equal(y, F.linear(x, ref))


# -- bit packing --------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 8), rows=st.integers(1, 5), cols=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_packing_is_compressed_tensors_byte_for_byte(bits, rows, cols, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (rows, cols), generator=g).to(torch.int8)
    packed = pack_to_int32(v, bits)
    assert torch.equal(pack_int32(v, bits), packed)
    assert torch.equal(unpack_int32(packed, bits, cols), v)
    along0 = pack_to_int32(v, bits, packed_dim=0)  # zero points: packed along the rows
    assert torch.equal(pack_int32(v.t().contiguous(), bits).t(), along0)
    assert torch.equal(unpack_int32(along0.t().contiguous(), bits, rows).t(), v)
    with pytest.raises(ValueError, match="int32 words per row"):
        unpack_int32(packed[:, :-1], bits, cols)


# -- import / export matrix ----------------------------------------------------------------------------------
@pytest.mark.parametrize("actorder", [None, "weight", "group"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("strategy", ["group", "channel"])
@pytest.mark.parametrize("bits", [4, 8])
@FAST
@given(data=st.data())
def test_pack_quantized_imports_bit_exactly(bits, strategy, symmetric, actorder, data) -> None:
    if strategy == "channel" and actorder == "group":
        actorder = "weight"  # GPTQ's channel g_idx is all zeros: covered by test_trivial_g_idx
    sdt = data.draw(st.sampled_from(SCALE_DTYPES), label="scale dtype")
    # more than 8 rows: compressed-tensors 0.20 cannot decompress its own 4-bit zero points when a column of them
    # packs into one int32 word (transpose, then .contiguous() is a no-op and .view(torch.uint8) raises)
    n = data.draw(st.integers(9, 24), label="n")
    gs = data.draw(st.sampled_from([8, 16, 32, 64]), label="group size")  # one group: exported as channel (see below)
    k = gs * data.draw(st.integers(2, 4), label="groups") if strategy == "group" else data.draw(st.integers(1, 70), label="k")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    extra = {"group_size": gs} if strategy == "group" else {}
    tensors, cfg, ref = build(n, k, "pack-quantized", sdt, seed, actorder, num_bits=bits, symmetric=symmetric,
                              strategy=strategy, **extra)
    out = from_compressed_tensors(tensors, cfg)
    assert set(out) == {"layer.weight"}
    q = out["layer.weight"]
    assert isinstance(q, torchq.AffineQuantizedTensor) and q.dtype == sdt and ref.dtype == sdt
    assert torch.equal(q.dequantize(sdt), ref)
    assert torch.equal(q.dequantize(torch.float32), ref.float())
    plain = q.to_plain()
    assert q.quant_layout == choose_layout(plain.spec, plain.shape, plain.scale.dtype, plain.device)
    if "layer.weight_g_idx" in tensors:
        g_idx = tensors["layer.weight_g_idx"]
        trivial = torch.equal(g_idx.long(), torch.arange(k) // gs)
        assert (q.input_perm is None) == trivial
        codes = unpack_from_int32(tensors["layer.weight_packed"], bits, torch.Size([n, k]))
        zero = tensors.get("layer.weight_zero_point")
        if zero is not None:
            zero = unpack_from_int32(zero, bits, torch.Size([n, k // gs]), packed_dim=0)
        legacy = legacy_g_idx_dequantize(codes, tensors["layer.weight_scale"], zero, g_idx,
                                         QuantizationArgs(num_bits=bits, symmetric=symmetric, strategy="group", group_size=gs))
        assert torch.equal(q.dequantize(sdt), legacy)
    else:
        assert q.input_perm is None
    check_linear(q, ref, seed)
    back, back_cfg = to_compressed_tensors(out)
    assert set(back) == set(tensors)
    for key, t in tensors.items():
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key
    weights = back_cfg["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["symmetric"], weights["strategy"]) == (bits, symmetric, strategy)
    assert weights.get("actorder") == ("group" if q.input_perm is not None else None)
    if q.input_perm is None:  # compressed-tensors 0.20 reads the exported config and decodes the same values
        scheme = QuantizationConfig.model_validate(back_cfg).config_groups["group_0"]
        local = {key.removeprefix("layer."): t for key, t in back.items()}
        assert torch.equal(BaseCompressor.get_value_from_registry("pack-quantized").decompress(local, scheme)["weight"], ref)


def test_one_group_and_one_row_export_as_channel() -> None:
    """torchq's block (1, K) is a channel scheme; a one-group group scheme and a one-row tensor
    scheme import to it and come back as channel: other metadata, the same decoded values."""
    for n, k, args in [(6, 32, {"strategy": "group", "group_size": 32}), (1, 40, {"strategy": "tensor"})]:
        tensors, cfg, ref = build(n, k, "pack-quantized", torch.bfloat16, 0, num_bits=4, symmetric=False, **args)
        q = from_compressed_tensors(tensors, cfg)["layer.weight"]
        back, back_cfg = to_compressed_tensors({"layer.weight": q})
        assert back_cfg["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
        scheme = QuantizationConfig.model_validate(back_cfg).config_groups["group_0"]
        local = {key.removeprefix("layer."): t for key, t in back.items()}
        assert torch.equal(BaseCompressor.get_value_from_registry("pack-quantized").decompress(local, scheme)["weight"], ref)


@pytest.mark.parametrize("fmt", ["int-quantized", "naive-quantized"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("strategy", ["channel", "group", "tensor"])
@FAST
@given(sdt=st.sampled_from(SCALE_DTYPES), n=st.integers(2, 24), groups=st.integers(2, 3), seed=st.integers(0, 2**16))
def test_int_quantized_int8_imports_bit_exactly(fmt, strategy, symmetric, sdt, n, groups, seed) -> None:
    acts = QuantizationArgs(num_bits=8, symmetric=True, strategy="token", dynamic=True) if fmt == "int-quantized" else None
    extra = {"group_size": 32} if strategy == "group" else {}
    tensors, cfg, ref = build(n, 32 * groups, fmt, sdt, seed, input_activations=acts, num_bits=8, symmetric=symmetric,
                              strategy=strategy, **extra)
    assert tensors["layer.weight"].dtype == torch.int8
    q = from_compressed_tensors(tensors, cfg)["layer.weight"]
    assert torch.equal(q.dequantize(sdt), ref)
    check_linear(q, ref, seed)
    back, back_cfg = to_compressed_tensors({"layer.weight": q}, format="naive-quantized")  # int-quantized's bytes
    assert set(back) == set(tensors) and all(torch.equal(back[key], t) and back[key].dtype == t.dtype for key, t in tensors.items())
    assert back_cfg["format"] == "naive-quantized" and back_cfg["config_groups"]["group_0"]["input_activations"] is None
    refused = pytest.raises(ValueError, match="activations='error'.*group_0") if acts is not None else contextlib.nullcontext()
    with refused:
        from_compressed_tensors(tensors, cfg, activations="error")


@settings(max_examples=10, deadline=None)
@given(bits=st.sampled_from([1, 2, 3, 5, 6, 7]), symmetric=st.booleans(), n=st.integers(1, 20), groups=st.integers(2, 3),
       sdt=st.sampled_from(SCALE_DTYPES), seed=st.integers(0, 2**16))
def test_other_bit_widths_import_bit_exactly(bits, symmetric, n, groups, sdt, seed) -> None:
    tensors, cfg, ref = build(n, 16 * groups, "pack-quantized", sdt, seed, num_bits=bits, symmetric=symmetric,
                              strategy="group", group_size=16)
    q = from_compressed_tensors(tensors, cfg)["layer.weight"]
    assert torch.equal(q.dequantize(sdt), ref)
    back, _ = to_compressed_tensors({"layer.weight": q})
    assert all(torch.equal(back[key], t) for key, t in tensors.items())


def test_block_strategy_with_partial_blocks() -> None:
    args = QuantizationArgs(num_bits=8, symmetric=False, strategy="block", block_structure=[16, 32])
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="naive-quantized")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 80, generator=g).to(torch.bfloat16)
    grid = (3, 3)
    scale = (torch.rand(grid, generator=g) * 0.02 + 0.01).to(torch.bfloat16)
    zero = torch.randint(-20, 20, grid, generator=g).to(torch.int8)
    comp = BaseCompressor.get_value_from_registry("naive-quantized").compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)
    ref = BaseCompressor.get_value_from_registry("naive-quantized").decompress(comp, scheme)["weight"]
    tensors = {f"m.{k}": v for k, v in comp.items()}
    cfg = config_of({"group_0": scheme_dict(scheme)}, "naive-quantized")
    q = from_compressed_tensors(tensors, cfg, dtype=torch.float32)["m.weight"]
    assert q.dtype == torch.float32 and q.spec.block_size == (16, 32)
    assert torch.equal(q.dequantize(torch.bfloat16), ref) and torch.equal(q.dequantize(), ref.float())
    back, back_cfg = to_compressed_tensors({"m.weight": q}, format="naive-quantized")
    assert all(torch.equal(back[k], t) for k, t in tensors.items())
    assert back_cfg["config_groups"]["group_0"]["weights"]["block_structure"] == [16, 32]


# -- activation order ------------------------------------------------------------------------------------------
def test_trivial_g_idx_imports_as_plain_groups() -> None:
    tensors, cfg, ref = build(16, 64, "pack-quantized", torch.float16, 1, num_bits=4, symmetric=False,
                              strategy="group", group_size=16)
    for g_idx in (torch.arange(64, dtype=torch.int32) // 16, torch.full((64,), -1, dtype=torch.int32)):
        q = from_compressed_tensors({**tensors, "layer.weight_g_idx": g_idx}, cfg)["layer.weight"]
        assert q.input_perm is None and torch.equal(q.dequantize(), ref)
    tensors, cfg, ref = build(8, 40, "pack-quantized", torch.float16, 1, num_bits=4, symmetric=True, strategy="channel")
    q = from_compressed_tensors({**tensors, "layer.weight_g_idx": torch.zeros(40, dtype=torch.int32)}, cfg)["layer.weight"]
    assert q.input_perm is None and torch.equal(q.dequantize(), ref)


def test_gptq_g_idx_is_a_permutation_with_full_groups() -> None:
    """GPTQ's g_idx ((arange // group_size)[invperm]) puts exactly group_size columns in every
    group; sorting the columns by group (the import's input_perm) makes the groups contiguous."""
    tensors, cfg, ref = build(16, 128, "pack-quantized", torch.bfloat16, 7, actorder="group", num_bits=4,
                              symmetric=True, strategy="group", group_size=32)
    g_idx = tensors["layer.weight_g_idx"].long()
    assert torch.equal(torch.bincount(g_idx), torch.full((4,), 32))
    q = from_compressed_tensors(tensors, cfg)["layer.weight"]
    assert torch.equal(g_idx[q.input_perm], torch.arange(128) // 32)
    assert torch.equal(q.tensor_impl.dequantize(torch.bfloat16), ref[:, q.input_perm])


@pytest.mark.parametrize("mutate, message", [
    (lambda g: torch.cat([g[:1] * 0 - 1, g[1:]]), "mixes -1"),
    (lambda g: torch.where(g == 1, torch.zeros_like(g), g), "group 0 has 64 columns"),
    (lambda g: g + 4, r"group indices must be in \[0, 3\]"),
    (lambda g: g.to(torch.int16), "weight_g_idx: expected dtype"),
    (lambda g: g[:-1], "weight_g_idx: expected shape"),
])
def test_bad_g_idx_is_refused(mutate, message) -> None:
    tensors, cfg, _ = build(8, 128, "pack-quantized", torch.float32, 2, actorder="group", num_bits=4, symmetric=True,
                            strategy="group", group_size=32)
    tensors["layer.weight_g_idx"] = mutate(tensors["layer.weight_g_idx"])
    with pytest.raises(CheckpointError, match=message):
        from_compressed_tensors(tensors, cfg)


def permuted_weight(dtype: torch.dtype = torch.float32, seed: int = 0) -> torchq.AffineQuantizedTensor:
    tensors, cfg, _ = build(24, 64, "pack-quantized", dtype, seed, actorder="group", num_bits=4, symmetric=False,
                            strategy="group", group_size=16)
    q = from_compressed_tensors(tensors, cfg)["layer.weight"]
    assert q.input_perm is not None
    return q


def test_input_perm_follows_ops() -> None:
    w = permuted_weight()
    full = w.dequantize()
    assert "input_perm" in repr(w)
    assert torch.equal(w[4:12].dequantize(), full[4:12])
    assert torch.equal(w[5], full[5]) and torch.equal(F.embedding(torch.tensor([3, 7]), w), full[[3, 7]])
    assert torch.equal(w.t().dequantize(), full.t()) and torch.equal(w[:, 0:64].dequantize(), full)
    with pytest.raises(NotImplementedError, match="input_perm"):
        w[:, 0:32]
    c = w.clone()
    assert c.input_perm is not w.input_perm and torch.equal(c.input_perm, w.input_perm)
    assert torch.equal(w.to(torch.bfloat16).dequantize(torch.float32), full)
    dst = permuted_weight(seed=1)
    dst.copy_(w)
    assert torch.equal(dst.input_perm, w.input_perm) and torch.equal(dst.dequantize(), full)
    plain = from_compressed_tensors(*build(24, 64, "pack-quantized", torch.float32, 0, num_bits=4, symmetric=False,
                                           strategy="group", group_size=16)[:2])["layer.weight"]
    with pytest.raises(ValueError, match="input_perm"):
        plain.copy_(w)
    with pytest.raises(ValueError, match="input_perm: expected an int64 or int32 tensor of shape"):
        w._replace(input_perm=torch.arange(63))
    with pytest.raises(ValueError, match="input_perm"):
        w.to_plain_codes()
    s = torch.rand(64) + 0.5  # with an AWQ input scale too: x * s, then permuted
    ws = w._replace(input_scale=s)
    assert torch.allclose(ws.dequantize(), full * s)
    x = torch.randn(5, 64)
    assert torch.allclose(F.linear(x, ws), F.linear(x, ws.dequantize()), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_perm_linear_and_grad(dtype) -> None:
    w = permuted_weight(dtype)
    x = torch.randn(4, 64, dtype=dtype, requires_grad=True)
    y = F.linear(x, w)
    ref = F.linear(x.detach().float(), w.dequantize(torch.float32))
    assert float((y.detach().float() - ref).abs().max()) <= TOL[dtype] * (1 + float(ref.abs().max()))
    y.float().sum().backward()
    assert torch.allclose(x.grad.float(), w.dequantize(torch.float32).sum(0).expand(4, 64), atol=TOL[dtype] * 4)


def test_input_perm_compiles_fullgraph() -> None:
    lin = nn.Linear(64, 24, bias=True)
    lin.weight = nn.Parameter(permuted_weight(), requires_grad=False)
    x = torch.randn(3, 64)
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(x), lin(x), atol=1e-6)


def test_input_perm_round_trips_checkpoints(tmp_path) -> None:
    lin = nn.Linear(64, 24)
    lin.weight = nn.Parameter(permuted_weight(), requires_grad=False)
    model = nn.Sequential(lin)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert torch.equal(sd["0.weight"].input_perm, lin.weight.input_perm)
    torchq.save_quantized(model, tmp_path / "ckpt")
    fresh = nn.Sequential(nn.Linear(64, 24))
    torchq.load_quantized(fresh, tmp_path / "ckpt")
    x = torch.randn(4, 64)
    assert torch.equal(fresh(x), model(x)) and torch.equal(fresh[0].weight.input_perm, lin.weight.input_perm)


@pytest.mark.parametrize("bad, message", [
    (lambda p: torch.cat([p[:1], p[:-1]]), "input_perm must be a permutation"),
    (lambda p: p + 1, "input_perm must be a permutation"),
    (lambda p: p.float(), "input_perm must be int64 or int32"),
    (lambda p: p[:10], "input_perm"),
])
def test_hostile_input_perm_is_rejected(bad, message) -> None:
    record, tensors = codec.encode(permuted_weight())
    tensors["input_perm"] = bad(tensors["input_perm"]).contiguous()
    record["parts"]["input_perm"] = codec.part_record(tensors["input_perm"], True)
    with pytest.raises(CheckpointError, match=message):
        codec.decode(record, tensors, name="w")


# -- hostile checkpoints and configs -----------------------------------------------------------------------------
def _valid(fmt: str = "pack-quantized", **args):
    args = {"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": 16, **args}
    tensors, cfg, _ = build(16, 64, fmt, torch.bfloat16, 5, **args)
    return tensors, cfg


def _set(key, value):
    def f(t, c):
        t[key] = value(t[key]) if callable(value) else value
    return f


def _drop(key):
    return lambda t, c: t.pop(key)


@pytest.mark.parametrize("mutate, message", [
    (_set("layer.weight_packed", lambda v: v.to(torch.int64)), "weight_packed: expected dtype torch.int32"),
    (_set("layer.weight_packed", lambda v: v[:, :-1]), r"weight_shape: \[16, 64\] does not fit"),
    (_set("layer.weight_packed", lambda v: v.reshape(2, 8, 8)), "3-D fused"),
    (_set("layer.weight_shape", torch.tensor([16, 10**12])), "does not fit"),
    (_set("layer.weight_shape", torch.tensor([16.0, 64.0])), "weight_shape: expected dtype"),
    (_drop("layer.weight_shape"), "missing tensor 'layer.weight_shape'"),
    (_set("layer.weight_scale", lambda v: v[:, :-1]), r"weight_scale: expected shape \[16, 4\]"),
    (_set("layer.weight_scale", lambda v: v.double()), "weight_scale: expected dtype"),
    (_set("layer.weight_scale", lambda v: v.index_fill(1, torch.tensor([0]), float("nan"))), "weight_scale: contains NaN"),
    (_set("layer.weight_zero_point", lambda v: v.to(torch.int8)), "weight_zero_point: expected dtype torch.int32"),
    (_drop("layer.weight_zero_point"), "missing tensor 'layer.weight_zero_point'"),
    (lambda t, c: c["config_groups"]["group_0"].update(targets=["re:other.*"]), "no config group quantizes"),
    (lambda t, c: c.update(ignore=["layer"]), "no config group quantizes"),
    (lambda t, c: t.update({"layer.weight": torch.zeros(16, 64)}), "expected weight_packed, found 'layer.weight_packed' and 'layer.weight'"),
    (lambda t, c: c["config_groups"]["group_0"].update(format="naive-quantized"), "expected an int8 weight, found 'layer.weight_packed'"),
])
def test_hostile_pack_quantized_is_refused(mutate, message) -> None:
    tensors, cfg = _valid()
    mutate(tensors, cfg)
    with pytest.raises(CheckpointError, match=message):
        from_compressed_tensors(tensors, cfg)


@pytest.mark.parametrize("mutate, message", [
    (_set("layer.weight", lambda v: v.clamp(-8, 7).index_fill(0, torch.tensor([0]), 9)), r"codes outside \[-8, 7\]"),
    (_set("layer.weight_zero_point", lambda v: v.index_fill(0, torch.tensor([0]), 12)), r"zero points outside \[-8, 7\]"),
    (_set("layer.weight", lambda v: v.float()), "weight: expected dtype torch.int8"),
])
def test_hostile_int_quantized_is_refused(mutate, message) -> None:
    tensors, cfg = _valid("naive-quantized")
    mutate(tensors, cfg)
    with pytest.raises(CheckpointError, match=message):
        from_compressed_tensors(tensors, cfg)


def test_sharded_folder_and_options(tmp_path) -> None:
    from safetensors.torch import save_file

    a, cfg, ref_a = build(16, 64, "pack-quantized", torch.bfloat16, 1, prefix="a", num_bits=4, symmetric=False,
                          strategy="group", group_size=32)
    b, _, ref_b = build(16, 64, "pack-quantized", torch.bfloat16, 2, prefix="b", num_bits=4, symmetric=False,
                        strategy="group", group_size=32)
    save_file(a, tmp_path / "model-00001-of-00002.safetensors")
    save_file({**b, "b.bias": torch.ones(16)}, tmp_path / "model-00002-of-00002.safetensors")
    index = {"weight_map": {**{k: "model-00001-of-00002.safetensors" for k in a},
                            **{k: "model-00002-of-00002.safetensors" for k in [*b, "b.bias"]}}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": cfg}))
    model = nn.Module()
    model.a, model.b = nn.Linear(64, 16, bias=False), nn.Linear(64, 16)
    load_compressed_tensors(model, tmp_path, dtype=torch.float32, device="cpu")
    assert model.a.weight.dtype == torch.float32 and torch.equal(model.a.weight.dequantize(torch.bfloat16), ref_a)
    assert torch.equal(model.b.weight.dequantize(torch.bfloat16), ref_b) and torch.equal(model.b.bias, torch.ones(16))
    index["weight_map"]["b.bias"] = "../elsewhere.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lists files that are not in"):
        load_compressed_tensors(model, tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    save_file({"b.bias": torch.ones(16)}, tmp_path / "extra.safetensors")
    with pytest.raises(CheckpointError, match="'b.bias' is also stored in another file"):
        load_compressed_tensors(model, tmp_path)


def test_symmetric_zero_points_must_be_zero() -> None:
    tensors, cfg = _valid("naive-quantized", symmetric=True)
    ref = from_compressed_tensors(tensors, cfg)["layer.weight"].dequantize()
    zeros = torch.zeros(16, 4, dtype=torch.int8)
    assert torch.equal(from_compressed_tensors({**tensors, "layer.weight_zero_point": zeros}, cfg)["layer.weight"].dequantize(), ref)
    with pytest.raises(CheckpointError, match="symmetric but the zero points are not all 0"):
        from_compressed_tensors({**tensors, "layer.weight_zero_point": zeros + 1}, cfg)


@pytest.mark.parametrize("edit, message", [
    ({"quant_method": "gptq"}, "quant_method: expected 'compressed-tensors'"),
    ({"format": "marlin-24"}, "format: torchq imports"),
    ({"format": "nvfp4-pack-quantized"}, "format: torchq imports"),
    ({"transform_config": {"config_groups": {"r": {}}}}, "transform_config"),
    ({"config_groups": {"W4A16": ["Linear"]}}, "preset scheme name"),
    ({"config_groups": {}}, "config_groups: expected a non-empty object"),
    ({"ignore": "lm_head"}, "ignore: expected a list of strings"),
])
def test_bad_configs_are_refused(edit, message) -> None:
    tensors, cfg = _valid()
    with pytest.raises(ValueError, match=message):
        from_compressed_tensors(tensors, {**cfg, **edit})


@pytest.mark.parametrize("weights, message", [
    ({"type": "float", "num_bits": 8, "symmetric": True}, r"format: 'pack-quantized' does not store float weights"),
    ({"type": "float", "num_bits": 4}, r"num_bits: torchq imports 8-bit float weights \(FP8 e4m3\); 4-bit float \(NVFP4/MXFP4\)"),
    ({"type": "float", "num_bits": 8, "symmetric": False}, "symmetric: float weights have no zero point"),
    ({"num_bits": 16}, r"num_bits: expected an int in 1..8"),
    ({"strategy": "tensor_group"}, "strategy: expected tensor, channel, group or block"),
    ({"group_size": 0}, "group_size: strategy group needs a positive int"),
    ({"actorder": "sideways"}, "actorder: expected null"),
    ({"dynamic": True}, "dynamic: weights must be static"),
])
def test_bad_weight_args_are_refused(weights, message) -> None:
    tensors, cfg = _valid()
    cfg["config_groups"]["group_0"]["weights"].update(weights)
    with pytest.raises(ValueError, match=message):
        from_compressed_tensors(tensors, cfg)


def test_group_size_must_divide_in_features() -> None:
    tensors, cfg = _valid()
    cfg["config_groups"]["group_0"]["weights"]["group_size"] = 24
    with pytest.raises(CheckpointError, match="in_features 64 is not a multiple of group_size 24"):
        from_compressed_tensors(tensors, cfg)


def test_class_targets_need_the_model_and_scheme_precedence() -> None:
    a, cfg_a, ref_a = build(8, 32, "pack-quantized", torch.float32, 1, prefix="emb", num_bits=8, symmetric=True, strategy="channel")
    b, cfg_b, ref_b = build(16, 32, "pack-quantized", torch.float32, 2, prefix="proj.lin", num_bits=4, symmetric=False,
                            strategy="group", group_size=16)
    emb_scheme = {**cfg_a["config_groups"]["group_0"], "targets": ["Embedding"]}
    lin_scheme = {**cfg_b["config_groups"]["group_0"], "targets": ["Linear", "re:proj.*"]}
    cfg = config_of({"e": emb_scheme, "l": lin_scheme}, "pack-quantized")
    with pytest.raises(CheckpointError, match="emb.weight_shape.*'emb' took config group 'l' by its 'Linear'.*pass model="):
        from_compressed_tensors({**a, **b}, cfg)
    model = nn.Module()
    model.emb, model.proj = nn.Embedding(8, 32), nn.Module()
    model.proj.lin = nn.Linear(32, 16)
    out = from_compressed_tensors({**a, **b}, cfg, model=model)
    assert torch.equal(out["emb.weight"].dequantize(), ref_a) and torch.equal(out["proj.lin.weight"].dequantize(), ref_b)
    assert torch.equal(F.embedding(torch.tensor([1, 5]), out["emb.weight"]), ref_a[[1, 5]])


def test_activation_scales_are_dropped() -> None:
    acts = QuantizationArgs(num_bits=8, symmetric=True, strategy="tensor")
    tensors, cfg, ref = build(8, 32, "int-quantized", torch.bfloat16, 4, input_activations=acts, num_bits=8, symmetric=True,
                              strategy="channel")
    tensors["layer.input_scale"] = torch.ones(1, dtype=torch.bfloat16)
    tensors["layer.bias"] = torch.zeros(8)
    tensors["attn.k_scale"] = torch.ones(1)
    cfg["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    out = from_compressed_tensors(tensors, cfg)
    assert set(out) == {"layer.weight", "layer.bias"} and torch.equal(out["layer.weight"].dequantize(), ref)
    with pytest.raises(ValueError, match="activations='error'.*kv_cache_scheme"):
        from_compressed_tensors(tensors, cfg, activations="error")
    with pytest.raises(ValueError, match="activations: expected 'ignore' or 'error'"):
        from_compressed_tensors(tensors, cfg, activations="fake")


# -- export of torchq's own weights -------------------------------------------------------------------------------
def test_torchq_int_zero_point_weights_export_exactly() -> None:
    w = torch.randn(16, 64)
    q = torchq.int4_weight_only(group_size=32, zero_point_domain="int").quantize_weight(w, label="m")
    assert q.spec.quant_min == 0  # unsigned codes: exported shifted by 8 with their zero points
    tensors, cfg = to_compressed_tensors({"m.weight": q})
    scheme = QuantizationConfig.model_validate(cfg).config_groups["group_0"]
    local = {k.removeprefix("m."): v for k, v in tensors.items()}
    ref = BaseCompressor.get_value_from_registry("pack-quantized").decompress(local, scheme)["weight"]
    assert torch.equal(ref, q.dequantize(q.to_plain().scale.dtype))
    again = from_compressed_tensors(tensors, cfg)["m.weight"]
    assert torch.equal(again.dequantize(torch.float32), q.dequantize(torch.float32))
    sym = torchq.int8_weight_only().quantize_weight(w, label="m")
    tensors, cfg = to_compressed_tensors({"m.weight": sym})
    assert cfg["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert torch.equal(from_compressed_tensors(tensors, cfg)["m.weight"].dequantize(), sym.dequantize())


def test_export_refuses_what_compressed_tensors_cannot_hold() -> None:
    w = torch.randn(16, 64)
    with pytest.raises(ValueError, match="'a.weight'.*float zero points"):
        to_compressed_tensors({"a.weight": torchq.int4_weight_only(group_size=32).quantize_weight(w)})
    with pytest.raises(ValueError, match="'a.weight'.*codebook"):
        to_compressed_tensors({"a.weight": torchq.NF4WeightOnlyConfig(block_size=64).quantize_weight(w)})
    q = torchq.int4_weight_only(group_size=32, zero_point_domain="int").quantize_weight(w)
    with pytest.raises(ValueError, match="input_scale"):
        to_compressed_tensors({"a.weight": q._replace(input_scale=torch.ones(64))})
    with pytest.raises(ValueError, match="parameters named 'weight'"):
        to_compressed_tensors({"a.kernel": q})
    with pytest.raises(ValueError, match="format: expected 'pack-quantized' or 'naive-quantized'"):
        to_compressed_tensors({"a.weight": q}, format="int-quantized")


# -- a tiny Llama, end to end ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A tiny LlamaForCausalLM quantized by compressed-tensors (int4 group asym with actorder
    weight on attention, W8A8 int8 channel on gate/up, int4 channel sym on down_proj; lm_head
    ignored), compressed by ModelCompressor and saved with save_pretrained."""
    transformers = pytest.importorskip("transformers")

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    qc = QuantizationConfig(config_groups={
        "attn": QuantizationScheme(targets=["re:.*self_attn.*"], weights=QuantizationArgs(
            num_bits=4, symmetric=False, strategy="group", group_size=32, actorder="weight")),
        "w8a8": QuantizationScheme(targets=["re:.*mlp.(gate|up)_proj$"], weights=QuantizationArgs(
            num_bits=8, symmetric=True, strategy="channel"), input_activations=QuantizationArgs(
            num_bits=8, symmetric=True, strategy="token", dynamic=True)),
        "down": QuantizationScheme(targets=["re:.*down_proj$"], weights=QuantizationArgs(
            num_bits=4, symmetric=True, strategy="channel")),
    }, ignore=["lm_head"])
    folder = tmp_path_factory.mktemp("ct_llama")
    save_compressed(model, qc, folder)
    return transformers, cfg, folder


def save_compressed(model, qc, folder) -> None:
    """``model`` quantized by compressed-tensors' own pieces as llm-compressor does (the scheme
    applied, min/max scales, frozen), compressed by ``ModelCompressor`` and written with
    ``save_pretrained`` into ``folder``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config

    apply_quantization_config(model, qc, show_progress=False)
    with torch.no_grad():
        for _, m in model.named_modules():
            scheme = getattr(m, "quantization_scheme", None)
            if scheme is not None:
                scale, zero = minmax_qparams(m.weight, scheme.weights)
                m.weight_scale.copy_(scale)
                if hasattr(m, "weight_zero_point"):
                    m.weight_zero_point.copy_(zero)
                m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))


def test_llama_end_to_end(llama_checkpoint, tmp_path) -> None:
    transformers, cfg, folder = llama_checkpoint
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file, save_file

    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "mixed-precision"
    tensors = load_file(folder / "model.safetensors")
    reference = CompressedTensorsDequantizer(folder, dtype=torch.float32).process(dict(tensors))
    ref_model = transformers.LlamaForCausalLM(cfg)
    ref_model.load_state_dict(reference, strict=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    load_compressed_tensors(model, folder, init_buffers="auto")
    quantized = {n: p for n, p in model.named_parameters() if isinstance(p, torchq.AffineQuantizedTensor)}
    assert len(quantized) == 14 and "lm_head.weight" not in quantized
    for name, p in quantized.items():
        assert torch.equal(p.dequantize(torch.float32), reference[name]), name
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, ref_model(ids).logits
    assert float((got - want).abs().max()) <= 1e-5

    # back to compressed-tensors (weights only: the W8A8 modules' int8 codes come back pack-quantized, the others'
    # tensors byte for byte), in a config the package decodes to the same values
    back, back_cfg = to_compressed_tensors(model)
    w8a8 = {n.removesuffix(".weight") for n in reference if ".mlp.gate" in n or ".mlp.up" in n}
    for key, t in tensors.items():
        module, _, part = key.rpartition(".")
        if module in w8a8 and part == "weight":
            assert torch.equal(unpack_int32(back[f"{module}.weight_packed"], 8, t.shape[1]), t)
        else:
            assert back[key].dtype == t.dtype and torch.equal(back[key], t), key
    assert back_cfg["format"] == "pack-quantized" and back_cfg["ignore"] == ["lm_head"]
    out = tmp_path / "exported"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in back.items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**cfg.to_dict(), "quantization_config": back_cfg}))
    again = CompressedTensorsDequantizer(out, dtype=torch.float32).process(load_file(out / "model.safetensors"))
    for key, v in reference.items():
        assert torch.equal(again[key], v), key


def test_load_into_float_model_and_errors(llama_checkpoint, tmp_path) -> None:
    transformers, cfg, folder = llama_checkpoint
    model = transformers.LlamaForCausalLM(cfg)
    small = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)
    wrong = transformers.LlamaForCausalLM(small)
    with pytest.raises(CheckpointError, match="intermediate|shape"):
        load_compressed_tensors(wrong, folder)
    assert not any(isinstance(p, torchq.AffineQuantizedTensor) for p in wrong.parameters())  # unchanged
    load_compressed_tensors(model, folder)
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, torchq.AffineQuantizedTensor)
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="no config.json"):
        load_compressed_tensors(transformers.LlamaForCausalLM(cfg), tmp_path / "model.safetensors")
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    fresh = transformers.LlamaForCausalLM(cfg)
    load_compressed_tensors(fresh, tmp_path / "model.safetensors", quantization_config=qcfg, dtype=torch.bfloat16)
    assert fresh.model.layers[1].mlp.down_proj.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="activations='error'"):
        load_compressed_tensors(transformers.LlamaForCausalLM(cfg), folder, activations="error")


# -- FP8 (float-quantized) ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["channel", "tensor", "group"])
@pytest.mark.parametrize("sdt", SCALE_DTYPES)
@pytest.mark.parametrize("dynamic", ["token", "tensor", None])
def test_fp8_weights_import_bit_for_bit(strategy, sdt, dynamic) -> None:
    """llm-compressor's FP8 schemes as compressed-tensors' own compressor writes them: the float8
    bytes and scales dequantize to the package's own decompression bit for bit; channel / tensor
    weights land in Float8Layout, dynamic float8 activations are carried over."""
    act = None if dynamic is None else QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=dynamic, dynamic=True)
    fmt = "float-quantized" if act is not None else "naive-quantized"
    extra = {"group_size": 16} if strategy == "group" else {}
    tensors, cfg, ref = build(24, 64, fmt, sdt, 3, input_activations=act, num_bits=8, type="float", symmetric=True,
                              strategy=strategy, **extra)
    assert tensors["layer.weight"].dtype == torch.float8_e4m3fn
    q = from_compressed_tensors(tensors, cfg)["layer.weight"]
    assert isinstance(q, torchq.AffineQuantizedTensor) and q.dtype == sdt
    assert torch.equal(q.dequantize(sdt), ref)
    assert torch.equal(q.tensor_impl.to_plain().codes, tensors["layer.weight"].view(torch.uint8))
    layout = type(q.tensor_impl.layout).__name__
    assert layout == ("PlainLayout" if strategy == "group" else "Float8Layout")
    assert q.act_quant == (None if dynamic is None else torchq.Float8Activations("row" if dynamic == "token" else "tensor"))
    x = torch.randn(3, 64).to(sdt)
    assert torch.isfinite(F.linear(x, q)).all()


def test_fp8_static_activation_scales_follow_the_activations_option() -> None:
    act = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
    tensors, cfg, ref = build(16, 32, "float-quantized", torch.bfloat16, 0, input_activations=act, num_bits=8, type="float",
                              symmetric=True, strategy="channel")
    tensors["layer.input_scale"] = torch.tensor([0.02])
    out = from_compressed_tensors(tensors, cfg)
    assert "layer.input_scale" not in out and out["layer.weight"].act_quant is None
    assert torch.equal(out["layer.weight"].dequantize(torch.bfloat16), ref)
    with pytest.raises(ValueError, match="activations='error'"):
        from_compressed_tensors(tensors, cfg, activations="error")


def test_a_format_that_does_not_store_the_weights_type_is_refused() -> None:
    tensors, cfg = _valid()
    cfg["config_groups"]["group_0"]["format"] = "float-quantized"
    with pytest.raises(ValueError, match="format: 'float-quantized' does not store int weights"):
        from_compressed_tensors(tensors, cfg)


def test_fp8_nan_bytes_and_wrong_dtypes_are_refused() -> None:
    tensors, cfg, _ = build(16, 32, "naive-quantized", torch.bfloat16, 0, num_bits=8, type="float", symmetric=True,
                            strategy="channel")
    bad = tensors["layer.weight"].view(torch.uint8).clone()
    bad[2, 5] = 0x7F
    with pytest.raises(CheckpointError, match="float8_e4m3fn code.*NaN"):
        from_compressed_tensors({**tensors, "layer.weight": bad.view(torch.float8_e4m3fn)}, cfg)
    with pytest.raises(CheckpointError, match="weight: expected dtype torch.float8_e4m3fn"):
        from_compressed_tensors({**tensors, "layer.weight": tensors["layer.weight"].view(torch.int8)}, cfg)


def test_fp8_dynamic_llama_end_to_end(tmp_path) -> None:
    """llm-compressor's FP8_DYNAMIC scheme on a tiny Llama, compressed by ModelCompressor and saved
    with save_pretrained: every weight equals the package's dequantizer's, the model runs with
    torchq's float8 activations, and save_quantized / load_quantized keep it."""
    transformers = pytest.importorskip("transformers")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from compressed_tensors.quantization import preset_name_to_scheme
    from safetensors.torch import load_file

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    qc = QuantizationConfig(config_groups={"fp8": preset_name_to_scheme("FP8_DYNAMIC", ["re:.*_proj$"])}, ignore=["lm_head"])
    folder = tmp_path / "fp8"
    save_compressed(model, qc, folder)
    reference = CompressedTensorsDequantizer(folder, dtype=torch.bfloat16).process(dict(load_file(folder / "model.safetensors")))
    with torch.device("meta"):
        loaded = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    load_compressed_tensors(loaded, folder, init_buffers="auto")
    quantized = {n: p for n, p in loaded.named_parameters() if isinstance(p, torchq.AffineQuantizedTensor)}
    assert len(quantized) == 14
    for name, p in quantized.items():
        assert isinstance(p.tensor_impl.layout, torchq.Float8Layout) and p.act_quant == torchq.Float8Activations("row")
        assert torch.equal(p.dequantize(torch.bfloat16), reference[name]), name
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = loaded(ids).logits
    assert torch.isfinite(logits).all()
    torchq.save_quantized(loaded, tmp_path / "torchq")
    with torch.device("meta"):
        again = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    torchq.load_quantized(again, tmp_path / "torchq", init_buffers="auto")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, logits)
