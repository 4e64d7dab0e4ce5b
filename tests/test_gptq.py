"""GPTQ (torchq.algorithms.gptq) and the calibration driver (torchq.calibrate)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import torchq
from torchq.algorithms.formats import AffineGroupFormat, CodebookGroupFormat
from torchq.algorithms.gptq import gptq_quantize, proxy_error
from torchq.algorithms.statistics import CalibrationRequired

FORMATS = {
    "int4-float": lambda w: torchq.int4_weight_only(group_size=32).group_format(w),
    "int4-int": lambda w: torchq.int4_weight_only(group_size=32, zero_point_domain="int").group_format(w),
    "int4-sym": lambda w: torchq.int4_weight_only(group_size=32, zero_point_domain="none").group_format(w),
    "intx3-asym": lambda w: torchq.intx_weight_only(bits=3, group_size=8).group_format(w),
    "intx2-sym-channel": lambda w: torchq.intx_weight_only(bits=2, group_size=None, mapping_type="symmetric").group_format(w),
    "nf4": lambda w: torchq.nf4_weight_only(block_size=32, double_quant=False).group_format(w),
    "nf4-dq": lambda w: torchq.nf4_weight_only(block_size=32, double_quant=True).group_format(w),
}


def reference_gptq(weight: torch.Tensor, x: torch.Tensor, fmt, damp_abs: float, order: list[int] | None = None) -> torch.Tensor:
    """GPTQ by its definition, with no Cholesky and no lazy updates: quantize one column (in
    ``order``), then move every column not yet fixed to the least-squares optimum of
    ``||W_orig X^T - W X^T||^2 + damp_abs ||W_orig - W||^2`` given the fixed ones (fp64)."""
    n, k = weight.shape
    order = list(range(k)) if order is None else order
    xa = torch.cat([x.double(), damp_abs**0.5 * torch.eye(k, dtype=torch.float64)])  # [T + K, K]
    target = weight.double() @ xa.T
    w = weight.double().clone()
    g = fmt.group_size
    static = fmt.static_scales or order != list(range(k))
    scale, zero, _ = fmt.static_qparams(weight)
    scale, zero = scale.clone(), None if zero is None else zero.clone()
    codes = torch.zeros(n, k, dtype=fmt.round_to_nearest(weight)[0].dtype)
    fixed: list[int] = []
    q_vals = torch.zeros(n, k, dtype=torch.float64)
    for j in order:
        grp = j // g
        if not static and j % g == 0:
            s, z = fmt.qparams(w[:, j:j + g])
            scale[:, grp:grp + 1] = s
            if zero is not None:
                zero[:, grp:grp + 1] = z
        zg = None if zero is None else zero[:, grp:grp + 1]
        q = fmt.quantize(w[:, j:j + 1], scale[:, grp:grp + 1], zg)
        codes[:, j:j + 1] = q
        q_vals[:, j:j + 1] = fmt.dequantize(q, scale[:, grp:grp + 1], zg).double()
        fixed.append(j)
        free = [c for c in range(k) if c not in fixed]
        if free:
            resid = target - q_vals[:, fixed] @ xa[:, fixed].T
            w[:, free] = torch.linalg.lstsq(xa[:, free], resid.T).solution.T
    return codes


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_gptq_equals_least_squares_definition(name: str) -> None:
    torch.manual_seed(0)
    n, k, t = 5, 64, 96
    w = torch.randn(n, k)
    x = torch.randn(t, k) * torch.linspace(0.1, 2.0, k)  # unequal input scales: compensation matters
    x[:, 5] += 0.8 * x[:, 6]  # correlated inputs
    h = x.double().T @ x.double() / t
    fmt = FORMATS[name](w)
    damp = 0.01
    got = gptq_quantize(w, h, fmt, damp=damp, block_size=16, keep_better=False)
    ref = reference_gptq(w, x / t**0.5, fmt, damp * float(h.diagonal().mean()))
    assert torch.equal(got.codes, ref)


def test_gptq_act_order_stores_codes_in_input_order() -> None:
    torch.manual_seed(1)
    n, k, t = 4, 32, 64
    w = torch.randn(n, k)
    x = torch.randn(t, k) * torch.rand(k).mul(3).add(0.1)
    h = x.double().T @ x.double() / t
    fmt = FORMATS["int4-int"](w)
    got = gptq_quantize(w, h, fmt, damp=0.01, block_size=8, act_order=True, keep_better=False)
    order = torch.argsort(h.diagonal(), descending=True, stable=True).tolist()
    ref = reference_gptq(w, x / t**0.5, fmt, 0.01 * float(h.diagonal().mean()), order=order)
    assert torch.equal(got.codes, ref)
    # the scales are round-to-nearest's (static groups): the plain form is an ordinary weight
    _, rtn_scale, rtn_zero, _ = fmt.round_to_nearest(w)
    assert torch.equal(got.scale, rtn_scale) and torch.equal(got.zero, rtn_zero)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12), groups=st.integers(1, 4), tail=st.sampled_from([0, 5]), t=st.integers(1, 80),
       name=st.sampled_from(sorted(FORMATS)), act_order=st.booleans(), clip=st.booleans(), seed=st.integers(0, 2**16))
def test_gptq_never_worse_than_round_to_nearest(n, groups, tail, t, name, act_order, clip, seed) -> None:
    torch.manual_seed(seed)
    fmt0 = FORMATS[name](torch.zeros(1, 256))
    k = groups * fmt0.group_size + (tail if isinstance(fmt0, AffineGroupFormat) and fmt0.group_size < 256 else 0)
    w = torch.randn(n, k) * torch.rand(n, 1).mul(4)
    x = torch.randn(t, k)
    h = x.T @ x / t
    fmt = FORMATS[name](w)
    r = gptq_quantize(w, h, fmt, act_order=act_order, clip=clip)
    codes, scale, zero, _ = fmt.round_to_nearest(w)
    rtn = proxy_error(w, fmt.dequantize(codes, scale, zero), h.double() if h.dtype == torch.float64 else h)
    mine = proxy_error(w, fmt.dequantize(r.codes, r.scale, r.zero), h)
    assert mine <= rtn * (1 + 1e-5) + 1e-12
    assert r.used in ("gptq", "rtn")


def test_gptq_clip_fixes_clipped_group_parameters() -> None:
    from torchq.algorithms.awq import clip_ratios

    torch.manual_seed(5)
    w = torch.randn(8, 64)
    w[0, 3] = 12.0  # an outlier a group's range should not have to cover at full cost
    x = torch.randn(200, 64)
    h = x.T @ x / 200
    fmt = FORMATS["int4-int"](w)
    ratio = clip_ratios(w, h, fmt)
    assert ratio.shape == (8, 2) and float(ratio.min()) < 1.0
    r = gptq_quantize(w, h, fmt, clip=True, keep_better=False)
    scale, zero, _ = fmt.static_qparams(w * ratio.repeat_interleave(32, dim=1))
    assert torch.equal(r.scale, scale) and torch.equal(r.zero, zero)


def test_gptq_handles_dead_inputs_and_rejects_bad_hessians() -> None:
    torch.manual_seed(2)
    w = torch.randn(8, 64)
    x = torch.randn(100, 64)
    x[:, :10] = 0  # inputs that never fire
    h = x.T @ x / 100
    r = gptq_quantize(w, h, FORMATS["int4-float"](w))
    assert r.error <= r.rtn_error
    with pytest.raises(ValueError, match="hessian: expected shape"):
        gptq_quantize(w, h[:10, :10], FORMATS["int4-float"](w))
    bad = h.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        gptq_quantize(w, bad, FORMATS["int4-float"](w))
    with pytest.raises(ValueError, match="damp"):
        gptq_quantize(w, h, FORMATS["int4-float"](w), damp=-1.0)


def test_codebook_format_codes_are_nearest_values() -> None:
    w = torch.randn(3, 64)
    fmt = CodebookGroupFormat(32, "nf4", False)
    codes, scale, _, _ = fmt.round_to_nearest(w)
    plain = torchq.nf4_weight_only(block_size=32, double_quant=False).quantize_weight(w).to_plain()
    assert torch.allclose(fmt.dequantize(codes, scale, None), plain.dequantize(torch.float32))


# -- calibrate --------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def tiny_llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).eval()


def batches(seed: int = 0, n: int = 3, length: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (1, length), generator=g) for _ in range(n)]


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict(keep_vars=True).items()}


def test_calibrate_quantizes_every_layer_block_by_block() -> None:
    model = tiny_llama()
    before = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.TiedWeightWarning)
        result = torchq.calibrate(model, batches(), torchq.int4_weight_only(group_size=32), algorithm="gptq", progress=False)
    names = [r.name for r in result.layers]
    assert len(names) == 15 and names[-1] == "lm_head" and result.blocks == 2
    assert all(r.error <= r.rtn_error for r in result.layers)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            assert isinstance(mod.weight, torchq.AffineQuantizedTensor), name
            assert mod.weight.config.algorithm == "gptq"
    assert model.model.embed_tokens.weight is model.lm_head.weight  # ties kept
    # calibration data = evaluation data here: the calibrated model tracks the float one better than RTN
    rtn = copy.deepcopy(before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.TiedWeightWarning)
        torchq.quantize_(rtn, torchq.int4_weight_only(group_size=32))
    x = torch.cat(batches())
    with torch.no_grad():
        ref = before(x).logits
        err_gptq = (model(x).logits - ref).pow(2).mean()
        err_rtn = (rtn(x).logits - ref).pow(2).mean()
    assert err_gptq < err_rtn
    assert "lm_head" in result.table() and "model.layers.1.mlp.down_proj" in str(result)


def test_calibrate_is_deterministic() -> None:
    outs = []
    for _ in range(2):
        model = tiny_llama()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torchq.TiedWeightWarning)
            torchq.calibrate(model, batches(), torchq.int4_weight_only(group_size=32, algorithm="gptq"), act_order=True,
                             progress=False)
        outs.append(model.model.layers[1].mlp.down_proj.weight.to_plain())
    assert outs[0].equal(outs[1])


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_calibrate_failure_leaves_the_model_as_it_was(monkeypatch, exc) -> None:
    model = tiny_llama()
    before = state(model)
    import torchq.algorithms.gptq as gptq_mod

    real, calls = gptq_mod.gptq_quantize, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 9:  # in the second block, after the first block was installed
            raise exc("stop")
        return real(*args, **kwargs)

    monkeypatch.setattr(gptq_mod, "gptq_quantize", failing)
    with pytest.raises((exc, torchq.QuantizationError)), warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.TiedWeightWarning)
        torchq.calibrate(model, batches(), torchq.int4_weight_only(group_size=32), algorithm="gptq", gptq_awq_scale=False,
                         progress=False)
    after = state(model)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.use_cache is True


def test_calibrated_configs_round_trip_plans_and_checkpoints(tmp_path) -> None:
    model = tiny_llama()
    spec = {"lm_head": torchq.int4_weight_only(group_size=32), "_default": torchq.int4_weight_only(group_size=32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.TiedWeightWarning)
        result = torchq.calibrate(model, batches(), spec, algorithm="gptq", progress=False)
    plan = torchq.load_plan(result.save_plan(tmp_path / "plan.json"))
    assert plan["model.layers.0.self_attn.q_proj"].algorithm == "gptq"
    torchq.save_quantized(model, tmp_path / "ckpt")
    fresh = tiny_llama(seed=5)
    torchq.load_quantized(fresh, tmp_path / "ckpt")
    w = fresh.model.layers[0].self_attn.q_proj.weight
    assert w.config.algorithm == "gptq"
    assert w.to_plain().equal(model.model.layers[0].self_attn.q_proj.weight.to_plain())


def test_quantize_with_a_calibrated_config_says_to_calibrate() -> None:
    model = nn.Sequential(nn.Linear(64, 32))
    before = model[0].weight
    with pytest.raises(torchq.QuantizationError, match="torchq.calibrate"):
        torchq.quantize_(model, torchq.int4_weight_only(group_size=32, algorithm="gptq"))
    assert model[0].weight is before
    with pytest.raises(CalibrationRequired):
        torchq.int4_weight_only(group_size=32, algorithm="gptq").quantize_weight(torch.randn(8, 64))


def test_calibrate_without_blocks_and_nf4_intx_configs() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    data = [torch.randn(16, 64) for _ in range(3)]
    spec = {"0": torchq.nf4_weight_only(block_size=32, algorithm="gptq"),
            "2": torchq.intx_weight_only(bits=3, group_size=32, algorithm="gptq")}
    result = torchq.calibrate(model, data, spec, progress=False)
    assert [r.name for r in result.layers] == ["0", "2"] and result.blocks == 0
    assert model[0].weight.spec.codebook == "nf4" and model[2].weight.spec.quant_max == 7
    with torch.no_grad():
        assert all(torch.isfinite(model(x)).all() for x in data)
    assert all(r.error < r.rtn_error for r in result.layers), result.table()
    assert result.tokens == 48 and "on 48 tokens" in result.table()


def test_calibrate_rejects_bad_arguments() -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match="batches"):
        torchq.calibrate(model, [], torchq.int4_weight_only(group_size=32), algorithm="gptq")
    with pytest.raises(ValueError, match="algorithm"):
        torchq.calibrate(model, batches(), torchq.int4_weight_only(group_size=32), algorithm="nope")
    with pytest.raises(ValueError, match="has no algorithm choice"):
        torchq.calibrate(model, batches(), torchq.int8_weight_only(), algorithm="gptq")
    with pytest.raises(ValueError, match="blocks"):
        torchq.calibrate(model, batches(), torchq.int4_weight_only(group_size=32), algorithm="gptq", blocks="model.norm")
    with pytest.raises(ValueError, match="algorithm"):
        torchq.nf4_weight_only(algorithm="hqq")


def test_calibrate_gpt2_conv1d() -> None:
    torch.manual_seed(4)
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.TiedWeightWarning)
        result = torchq.calibrate(model, batches(), {"lm_head": None, "_default": torchq.int4_weight_only(group_size=32)},
                                  algorithm="gptq", progress=False)
    assert result.blocks == 2 and len(result.layers) == 8
    attn = model.transformer.h[0].attn.c_attn.weight
    assert isinstance(attn, torchq.AffineQuantizedTensor) and attn.transposed
    with torch.no_grad():
        assert torch.isfinite(model(torch.cat(batches())).logits).all()


def _two_layer_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))


def _hessian(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1]).float()
    return x.T @ x / x.shape[0]


@pytest.mark.parametrize("sequential", [True, False])
def test_calibrate_sequential_gathers_each_stage_after_the_ones_before_are_quantized(sequential: bool) -> None:
    """``sequential=True``: the second layer's Hessian comes from the first layer's *quantized* output
    (the codes equal GPTQ run by hand on that Hessian); ``False``: from the float model's."""
    model = _two_layer_model()
    float_model = copy.deepcopy(model)
    x = torch.randn(4, 16, 64)
    cfg = torchq.int4_weight_only(group_size=32)
    torchq.calibrate(model, [x], cfg, algorithm="gptq", sequential=sequential, gptq_awq_scale=False, progress=False)
    with torch.no_grad():
        first = model[0] if sequential else float_model[0]
        hidden = float_model[1](first(x))
    w = float_model[2].weight.detach()
    expected = gptq_quantize(w, _hessian(hidden), cfg.group_format(w), clip=True, act_order=True)
    got = model[2].weight.to_plain()
    assert torch.equal(got.codes.to(expected.codes.dtype), expected.codes)
    other = gptq_quantize(w, _hessian(float_model[1](float_model[0](x)) if sequential else model[1](model[0](x))),
                          cfg.group_format(w), clip=True, act_order=True)
    assert not torch.equal(other.codes, expected.codes)  # the two Hessians really give different codes


def test_gptq_on_awq_scaled_columns_is_kept_only_where_it_lowers_the_error(tmp_path) -> None:
    """``gptq_awq_scale=True`` (the default) runs GPTQ on AWQ-scaled columns too and keeps, per layer,
    the lower proxy error: never above plain GPTQ's on the same statistics. Where it wins, the weight
    carries AWQ's input scale, through checkpoints too."""
    gen = torch.Generator().manual_seed(1)
    outliers = torch.ones(64)
    outliers[[3, 17, 40, 61]] = 20.0  # a few input features with large activations: what AWQ is for
    x = [torch.randn(4, 16, 64, generator=gen) * outliers for _ in range(2)]
    results = {}
    models = {}
    for awq_scale in (False, True):
        models[awq_scale] = model = _two_layer_model()
        results[awq_scale] = torchq.calibrate(model, x, torchq.int4_weight_only(group_size=32), algorithm="gptq",
                                              gptq_awq_scale=awq_scale, sequential=False, progress=False)
    for plain, scaled in zip(results[False].layers, results[True].layers):
        assert plain.name == scaled.name and scaled.error <= plain.error
        assert plain.used in ("gptq", "rtn")
    first = results[True].layers[0]
    assert first.used == "gptq+awq" and first.alpha > 0 and first.error < results[False].layers[0].error
    w = models[True][0].weight
    assert w.input_scale is not None and w.config.algorithm == "gptq"
    torchq.save_quantized(models[True], tmp_path / "ckpt")
    fresh = _two_layer_model()
    torchq.load_quantized(fresh, tmp_path / "ckpt")
    assert torch.equal(fresh[0].weight.input_scale, w.input_scale)
    with torch.no_grad():
        assert torch.equal(fresh(x[0]), models[True](x[0]))
