"""HQQ zero points (torchq.algorithms.hqq, ``algorithm="hqq"`` on the int4 / intx configs): never
worse than round-to-nearest per group in the format's own arithmetic, better on weights with
outliers, deterministic, and recorded in configs, plans and checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchq
from torchq.algorithms import hqq_zero_points
from torchq.primitives import MappingType, ZeroPointDomain, choose_qparams_affine, dequantize_affine, quantize_affine

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _rtn(weight, g, qmin, qmax, domain, scale_dtype):
    """Round-to-nearest's scale and zero point, as the int4 / intx configs choose them."""
    if domain is ZeroPointDomain.FLOAT:
        return choose_qparams_affine(weight, MappingType.ASYMMETRIC, (1, g), torch.uint8, qmin, qmax, 1e-6, scale_dtype, scale_dtype,
                                     domain, False)
    return choose_qparams_affine(weight, MappingType.ASYMMETRIC, (1, g), torch.uint8, qmin, qmax, 1e-6, scale_dtype, None, domain)


def _group_sse(weight, g, qmin, qmax, scale, zero, domain):
    """``[rows, ceil(cols / g)]``: each group's squared error (a partial last group on its own columns)."""
    codes = quantize_affine(weight, (1, g), scale, zero, torch.uint8, qmin, qmax, domain)
    approx = dequantize_affine(codes, (1, g), scale, zero, qmin, qmax, domain, torch.float32)
    sq = (weight.float() - approx) ** 2
    return torch.stack([sq[:, c:c + g].sum(1) for c in range(0, weight.shape[1], g)], dim=1)


def _weight(rows: int, cols: int, kinds: list[str], seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    for r, kind in zip(range(rows), kinds * rows):
        if kind == "zeros":
            w[r] = 0
        elif kind == "constant":
            w[r] = 0.3
        elif kind == "tiny":
            w[r] *= 1e-6
        elif kind == "huge":
            w[r] *= 1e3
        elif kind == "outliers":
            w[r, ::7] *= 20
    return w.to(dtype)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 12), groups=st.integers(0, 4), extra=st.sampled_from([0, 0, 1, 7, 64]),
    g=st.sampled_from([32, 64, 128, 256]), dtype=st.sampled_from(FLOATS),
    bits=st.sampled_from([2, 3, 4, 8]), domain=st.sampled_from([ZeroPointDomain.FLOAT, ZeroPointDomain.INT]),
    kinds=st.lists(st.sampled_from(["randn", "zeros", "constant", "tiny", "huge", "outliers"]), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_hqq_is_never_worse_than_its_start_in_any_group(rows, groups, extra, g, dtype, bits, domain, kinds, seed):
    """Per group, HQQ's squared error is never above that of its start: round to nearest with the
    zero point on the code grid (0.0 exactly representable: the float zero ``(mid - round(mid - z/s)) s``),
    or, with ``round_start=False``, plain round to nearest. Including a partial last group (``extra``
    columns past the whole groups), optimised on its own."""
    qmin, qmax = 0, 2**bits - 1
    cols = groups * g + min(extra, g - 1)
    if cols == 0:
        cols = g
    w = _weight(rows, cols, kinds, seed, dtype)
    scale, zero = _rtn(w, g, qmin, qmax, domain, dtype)
    if domain is ZeroPointDomain.FLOAT:
        mid = (qmin + qmax + 1) // 2
        s = scale.float()
        start = ((mid - torch.round(mid - zero.float() / s)) * s).to(zero.dtype)
    else:
        start = zero
    for round_start, reference in ((True, start), (False, zero)):
        refined = hqq_zero_points(w, (1, g), qmin, qmax, scale, zero, domain, round_start=round_start)
        assert refined.dtype == zero.dtype and refined.shape == zero.shape
        ref = _group_sse(w, g, qmin, qmax, scale, reference, domain)
        hqq = _group_sse(w, g, qmin, qmax, scale, refined, domain)
        assert bool((hqq <= ref).all()), (round_start, (hqq - ref).max())
        if domain is ZeroPointDomain.INT:
            assert bool((refined >= qmin).all() and (refined <= qmax).all())


@pytest.mark.parametrize("g", [32, 128])
def test_hqq_lowers_the_error_of_weights_with_outliers(g):
    """Gaussian weights with a heavy tail (the case min-max grids waste codes on): HQQ's float
    zero points cut the squared error by a few percent overall."""
    w = _weight(64, 512, ["outliers", "randn"], 0, torch.float32)
    rtn = torchq.int4_weight_only(group_size=g).quantize_weight(w).dequantize(torch.float32)
    hqq = torchq.int4_weight_only(group_size=g, algorithm="hqq").quantize_weight(w).dequantize(torch.float32)
    assert float(((hqq - w) ** 2).sum()) < 0.97 * float(((rtn - w) ** 2).sum())


def test_hqq_is_deterministic_and_changes_only_zero_points():
    w = _weight(32, 256, ["outliers", "randn"], 1, torch.bfloat16)
    cfg = torchq.int4_weight_only(group_size=64, algorithm="hqq")
    a, b = cfg.quantize_weight(w).to_plain(), cfg.quantize_weight(w).to_plain()
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)
    rtn = torchq.int4_weight_only(group_size=64).quantize_weight(w).to_plain()
    assert torch.equal(a.scale, rtn.scale) and a.spec == rtn.spec and a.zero_point.dtype == rtn.zero_point.dtype
    assert not torch.equal(a.zero_point, rtn.zero_point)


def test_hqq_optimises_a_partial_last_group_too():
    """A row length that is not a multiple of the group (SmolLM2's 576 inputs at g128: 4 whole
    groups and one of 64): every group, the partial one included, gets HQQ's zero points, and the
    error falls as it does for whole groups."""
    w = _weight(64, 576, ["outliers", "randn"], 2, torch.float32)
    cfg = torchq.int4_weight_only(group_size=128, algorithm="hqq")
    hqq = cfg.quantize_weight(w).to_plain()
    rtn = torchq.int4_weight_only(group_size=128).quantize_weight(w).to_plain()
    assert hqq.scale.shape == rtn.scale.shape == (64, 5) and torch.equal(hqq.scale, rtn.scale)
    changed = (hqq.zero_point != rtn.zero_point).float().mean(dim=0)
    assert bool((changed > 0.3).all()), changed  # the last (partial) group's zero points move as the others do
    err = {name: float(((p.dequantize(torch.float32) - w) ** 2).sum()) for name, p in (("hqq", hqq), ("rtn", rtn))}
    assert err["hqq"] < 0.97 * err["rtn"], err
    last = {name: float(((p.dequantize(torch.float32) - w)[:, 512:] ** 2).sum()) for name, p in (("hqq", hqq), ("rtn", rtn))}
    assert last["hqq"] < 0.97 * last["rtn"], last


def test_hqq_arguments_are_checked():
    with pytest.raises(ValueError, match=r"algorithm: expected one of \('rtn', 'hqq', 'gptq', 'awq'\), got 'gptq2'"):
        torchq.int4_weight_only(algorithm="gptq2")
    with pytest.raises(ValueError, match="algorithm: 'hqq' optimises zero points; zero_point_domain=NONE has none"):
        torchq.int4_weight_only(zero_point_domain=ZeroPointDomain.NONE, algorithm="hqq")
    with pytest.raises(ValueError, match="mapping_type=SYMMETRIC has none"):
        torchq.intx_weight_only(bits=3, mapping_type=MappingType.SYMMETRIC, algorithm="hqq")
    w = torch.randn(4, 64)
    scale, zero = _rtn(w, 32, 0, 15, ZeroPointDomain.INT, torch.float32)
    with pytest.raises(ValueError, match="zero_point_domain: HQQ optimises zero points"):
        hqq_zero_points(w, (1, 32), 0, 15, scale, zero, ZeroPointDomain.NONE)
    with pytest.raises(ValueError, match=r"block_size: HQQ needs groups \(1, g\)"):
        hqq_zero_points(w, (2, 32), 0, 15, scale, zero, ZeroPointDomain.INT)
    with pytest.raises(ValueError, match=r"scale, zero_point: expected shape \(4, 3\) for groups of 24"):
        hqq_zero_points(w, (1, 24), 0, 15, scale, zero, ZeroPointDomain.INT)
    with pytest.raises(ValueError, match="lp_norm: expected a value in"):
        hqq_zero_points(w, (1, 32), 0, 15, scale, zero, ZeroPointDomain.INT, lp_norm=2.0)


def test_the_algorithm_travels_with_the_config_names_plans_and_checkpoints(tmp_path):
    cfg = torchq.config_from_name("int4-g128-hqq")
    assert cfg.algorithm == "hqq" and cfg.group_size == 128
    assert torchq.config_from_name("intx3-g32-hqq").algorithm == "hqq"
    assert torchq.config_from_name("int4-g32-fp32-hqq").scale_dtype == torch.float32
    again = torchq.configs.config_from_json(cfg.to_json_str())
    assert again == cfg and again.algorithm == "hqq"
    assert torchq.configs.config_from_json(torchq.int4_weight_only().to_json()).algorithm == "rtn"

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    torchq.quantize_(model, cfg)
    path = tmp_path / "m.safetensors"
    torchq.save_quantized(model, path)
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    torchq.load_quantized(fresh, path)
    for a, b in ((model[0], fresh[0]), (model[2], fresh[2])):
        assert b.weight.config.algorithm == "hqq"
        assert torch.equal(a.weight.dequantize(torch.float32), b.weight.dequantize(torch.float32))
    x = torch.randn(3, 256)
    assert torch.equal(copy.deepcopy(model)(x), fresh(x))
