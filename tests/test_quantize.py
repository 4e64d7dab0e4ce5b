"""quantize_: selection, per-layer configs, atomicity, device placement, visible skips."""

import copy

import pytest
import torch
from torch import nn

import torchq
from torchq import AffineQuantizedTensor as AQT


def mlp(dtype=torch.float32):
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(),
        nn.Sequential(nn.Linear(128, 128), nn.ReLU()),
        nn.Linear(128, 32),
    ).to(dtype)


def state(model):
    return {k: (type(v), v.detach().clone() if not isinstance(v, AQT) else v.dequantize()) for k, v in model.state_dict().items()}


def same_state(a, b):
    return a.keys() == b.keys() and all(a[k][0] is b[k][0] and torch.equal(a[k][1], b[k][1]) for k in a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "cfg",
    [torchq.int4_weight_only(), torchq.int8_weight_only(), torchq.int8_dynamic_activation_int8_weight(),
     torchq.intx_weight_only(bits=5, group_size=64), torchq.intx_weight_only(bits=8, group_size=None)],
    ids=["int4", "int8", "int8dyn", "intx5", "intx8"],
)
def test_quantizes_every_linear_in_place(dtype, cfg):
    m = mlp(dtype)
    ids = {n: id(mod) for n, mod in m.named_modules()}
    out = torchq.quantize_(m, cfg)
    assert out is m and {n: id(mod) for n, mod in m.named_modules()} == ids
    for name in ("0", "2.0", "3"):
        w = m.get_submodule(name).weight
        assert isinstance(w, AQT) and isinstance(w, nn.Parameter) and not w.requires_grad
        assert w.label == name and w.config == cfg and w.dtype == dtype
    x = torch.randn(3, 64, dtype=dtype)
    if getattr(cfg, "bits", 4) > 4:  # no native 5-8-bit groupwise/asymmetric kernel: visible fallback
        with pytest.warns(torchq.FallbackWarning, match="no linear kernel accepted"):
            y = m(x)
    else:
        y = m(x)
    assert y.dtype == dtype and torch.isfinite(y).all()


def test_memory_shrinks():
    m = nn.Linear(1024, 1024)
    before = m.weight.numel() * m.weight.element_size()
    torchq.quantize_(m, torchq.int4_weight_only())
    assert m.weight.nbytes_quantized() < before / 6


def test_mapping_exact_regex_default_and_none():
    m = mlp()
    torchq.quantize_(m, {"0": torchq.int8_weight_only(), "re:2\\..*": torchq.int4_weight_only(group_size=32), "3": None})
    assert m[0].weight.config == torchq.int8_weight_only()
    assert m[2][0].weight.config == torchq.int4_weight_only(group_size=32)
    assert not isinstance(m[3].weight, AQT)
    m = mlp()
    torchq.quantize_(m, {"3": torchq.int8_weight_only(), "_default": torchq.int4_weight_only(group_size=32)})
    assert m[3].weight.config == torchq.int8_weight_only() and m[0].weight.config.group_size == 32


def test_unknown_module_name_is_an_error_with_suggestions():
    m = mlp()
    before = state(m)
    with pytest.raises(ValueError, match=r"'2\.1' .*close"):
        torchq.quantize_(m, {"2.1": torchq.int8_weight_only()})
    assert same_state(before, state(m))
    with pytest.warns(torchq.SkippedLayerWarning, match="matches no quantizable module"):
        torchq.quantize_(m, {"re:nothing.*": torchq.int8_weight_only()})
    with pytest.raises(TypeError, match="torchq config"):
        torchq.quantize_(m, "int4")
    with pytest.raises(TypeError, match="nn.Module"):
        torchq.quantize_(torch.randn(3), torchq.int8_weight_only())


def test_filter_fn_and_already_quantized_layers_are_left_alone():
    m = mlp()
    torchq.quantize_(m, torchq.int8_weight_only(), filter_fn=lambda mod, name: isinstance(mod, nn.Linear) and name == "3")
    assert isinstance(m[3].weight, AQT) and not isinstance(m[0].weight, AQT)
    w3 = m[3].weight
    torchq.quantize_(m, torchq.int4_weight_only(group_size=32))  # default filter skips quantized layers
    assert m[3].weight is w3 and isinstance(m[0].weight, AQT)


def test_failure_part_way_leaves_model_unchanged():
    m = mlp()
    with torch.no_grad():
        m[3].weight[0, 0] = float("nan")
    before = state(m)
    params_before = {k: id(v) for k, v in m.named_parameters()}
    with pytest.raises(torchq.QuantizationError, match=r"layer '3'.*NaN/inf.*nothing was changed"):
        torchq.quantize_(m, torchq.int4_weight_only(group_size=32))
    assert {k: id(v) for k, v in m.named_parameters()} == params_before
    assert not any(isinstance(p, AQT) for p in m.parameters())
    for k in before:  # NaN != NaN, compare with equal_nan
        assert torch.allclose(before[k][1], state(m)[k][1], equal_nan=True)


def test_layout_that_cannot_hold_the_weight_fails_atomically():
    m = mlp()
    before = state(m)
    with pytest.raises(torchq.QuantizationError, match="cannot hold"):
        torchq.quantize_(m, torchq.int8_weight_only(layout=torchq.PackedBitsLayout()))
    assert same_state(before, state(m))


class Conv1x1(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8, 1, 1))


def test_structurally_unsupported_layer_is_skipped_visibly_or_raises_in_strict():
    m = nn.Sequential(nn.Linear(64, 8), Conv1x1())

    def pick(mod, name):
        return hasattr(mod, "weight")

    with pytest.warns(torchq.SkippedLayerWarning, match=r"skipped layer '1'.*4-D"):
        torchq.quantize_(m, torchq.int8_weight_only(), filter_fn=pick)
    assert isinstance(m[0].weight, AQT) and not isinstance(m[1].weight, AQT)
    m = nn.Sequential(nn.Linear(64, 8), Conv1x1())
    before = state(m)
    with torchq.strict(), pytest.raises(torchq.QuantizationError, match="strict"):
        torchq.quantize_(m, torchq.int8_weight_only(), filter_fn=pick)
    assert same_state(before, state(m))


def test_k_not_a_multiple_of_group_size_is_padded_correctly():
    lin = nn.Linear(100, 20)  # 100 = 3 groups of 32 + a partial group of 4
    x = torch.randn(5, 100)
    ref = lin(x)
    torchq.quantize_(lin, torchq.int4_weight_only(group_size=32))
    w = lin.weight
    assert w.to_plain().scale.shape == (20, 4)
    assert torchq.explain(lin, x).decisions[0].kernel == ("int4_native" if torchq.native.available() else "int4_cpu_bf16_compute")
    y = lin(x)
    assert torch.allclose(y, torch.nn.functional.linear(x, w.dequantize(), lin.bias), atol=3e-2)
    xb = x.bfloat16()  # the native-dtype kernel on the padded layout
    assert torch.allclose(lin.to(torch.bfloat16)(xb).float(), torch.nn.functional.linear(xb, lin.weight.dequantize(), lin.bias).float(), atol=3e-2)
    assert float(20 * torch.log10(ref.norm() / (ref - y).norm()).detach()) > 15


def test_device_argument_places_quantized_modules():
    m = mlp()
    torchq.quantize_(m, torchq.int8_weight_only(), device="cpu")
    assert all(p.device.type == "cpu" for p in m.parameters())
    m = nn.Linear(64, 64)
    torchq.quantize_(m, torchq.int4_weight_only(group_size=32), device="meta")
    assert m.weight.device.type == "meta" and m.bias.device.type == "meta"


def test_deepcopy_and_module_to_of_quantized_model():
    m = mlp(torch.bfloat16)
    torchq.quantize_(m, torchq.int4_weight_only(group_size=32))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    c = copy.deepcopy(m)
    assert torch.equal(c(x), m(x))
    h = c.to(torch.float16)
    assert h[0].weight.dtype == torch.float16 and h(x.half()).dtype == torch.float16
