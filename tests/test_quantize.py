"""quantize_: selection, per-layer configs, atomicity, device placement, visible skips."""

import copy
import warnings

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
    assert torchq.explain(lin, x).decisions[0].kernel == ("int4_native" if torchq.native.available() else "int4_cpu")
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


# -- tied weights (issue 14, item 7) ------------------------------------------------------------
class Tied(nn.Module):
    """An embedding tied to the LM head, and two Linears sharing one weight."""

    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.b.weight = self.a.weight
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, i):
        return self.head(self.b(self.a(self.emb(i))))


def tied(seed=0):
    torch.manual_seed(seed)
    return Tied()


def identities(model):
    return {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}


def test_tied_weights_are_quantized_once_and_stay_tied():
    m = tied()
    with pytest.warns(torchq.TiedWeightWarning, match=r"'emb\.weight'"):
        torchq.quantize_(m, torchq.int8_weight_only())
    assert isinstance(m.head.weight, AQT) and m.emb.weight is m.head.weight
    assert isinstance(m.a.weight, AQT) and m.a.weight is m.b.weight
    assert m.head.weight.label == "head" and m.a.weight.label == "a"
    assert len(list(m.parameters())) == 4  # emb/head weight, a/b weight, a's and b's biases
    i = torch.randint(0, 64, (2, 5))
    w1, w2 = m.a.weight.dequantize(), m.head.weight.dequantize()
    h = torch.nn.functional.linear(torch.nn.functional.linear(w2[i], w1, m.a.bias), w1, m.b.bias)
    assert torch.allclose(m(i), torch.nn.functional.linear(h, w2), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("cfg", [torchq.int8_weight_only(), torchq.int4_weight_only(group_size=32), torchq.nf4_weight_only(),
                                 torchq.int8_dynamic_activation_int8_weight(), torchq.intx_weight_only(bits=3, group_size=16)],
                         ids=["int8", "int4", "nf4", "int8dyn", "intx3"])
def test_embedding_lookup_on_a_quantized_weight_is_exact(cfg):
    emb = nn.Embedding(64, 64)
    emb.weight = nn.Parameter(cfg.quantize_weight(emb.weight.detach()), requires_grad=False)
    idx = torch.tensor([[0, 5, 63], [7, 7, 1]])
    assert torch.equal(emb(idx), emb.weight.dequantize()[idx])


def test_tied_modules_with_different_configs_raise_and_change_nothing():
    m = tied()
    before, ids = state(m), identities(m)
    with pytest.raises(torchq.QuantizationError, match=r"'a' and 'b' share one weight tensor.*different configs"):
        torchq.quantize_(m, {"a": torchq.int8_weight_only(), "b": torchq.int4_weight_only(group_size=32)})
    with pytest.raises(torchq.QuantizationError, match=r"'b' is mapped to None"):
        torchq.quantize_(m, {"b": None, "_default": torchq.int8_weight_only()})
    assert same_state(before, state(m)) and identities(m) == ids


def test_tie_with_an_unselected_partner_is_kept():
    m = tied()
    with pytest.warns(torchq.TiedWeightWarning, match=r"'b\.weight'"):
        torchq.quantize_(m, torchq.int8_weight_only(), filter_fn=lambda mod, name: name == "a")
    assert isinstance(m.b.weight, AQT) and m.a.weight is m.b.weight and not isinstance(m.head.weight, AQT)


@pytest.mark.parametrize("strict", [True, False])
def test_tied_model_save_quantized_load_quantized_round_trip(tmp_path, strict):
    m = tied()
    with pytest.warns(torchq.TiedWeightWarning):
        torchq.quantize_(m, torchq.int4_weight_only(group_size=32))
    torchq.save_quantized(m, tmp_path / "m.safetensors")
    i = torch.randint(0, 64, (2, 5))
    for fresh in (tied(seed=1), m):  # a float model, and the quantized model itself
        torchq.load_quantized(fresh, tmp_path / "m.safetensors", strict=strict)
        assert fresh.emb.weight is fresh.head.weight and fresh.a.weight is fresh.b.weight
        assert isinstance(fresh.head.weight, AQT) and torch.equal(fresh(i), m(i))


def test_tied_model_torch_save_weights_only_and_assign(tmp_path):
    m = tied()
    with pytest.warns(torchq.TiedWeightWarning):
        torchq.quantize_(m, torchq.int8_weight_only())
    torch.save(m.state_dict(), tmp_path / "sd.pt")
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    fresh = tied(seed=1)
    fresh.load_state_dict(sd, assign=True)
    i = torch.randint(0, 64, (2, 5))
    assert isinstance(fresh.head.weight, AQT) and torch.equal(fresh(i), m(i))


def test_failure_in_a_tied_model_leaves_it_bit_identical():
    m = tied()
    with torch.no_grad():
        m.a.weight[0, 0] = float("inf")
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    ids = identities(m)
    with pytest.raises(torchq.QuantizationError, match="nothing was changed"):
        torchq.quantize_(m, torchq.int8_weight_only())
    assert identities(m) == ids and m.emb.weight is m.head.weight
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in sd.items())


# -- parametrized weights (item 10) and already-quantized layers (item 11) ---------------------------
class Double(nn.Module):
    def forward(self, w):
        return 2 * w


def with_parametrized():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    torch.nn.utils.parametrize.register_parametrization(m[1], "weight", Double())
    return m


def test_parametrized_weight_is_skipped_visibly():
    m = with_parametrized()
    with pytest.warns(torchq.SkippedLayerWarning, match=r"skipped layer '1'.*parametriz.*remove_parametrizations"):
        torchq.quantize_(m, torchq.int8_weight_only())
    assert isinstance(m[0].weight, AQT)
    assert torch.nn.utils.parametrize.is_parametrized(m[1], "weight") and not isinstance(m[1].weight, AQT)
    assert torch.equal(m[1].weight, 2 * m[1].parametrizations.weight.original)


def test_parametrized_weight_in_strict_mode_raises_and_leaves_the_model_bit_identical():
    m = with_parametrized()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    ids = identities(m)
    with torchq.strict(), pytest.raises(torchq.QuantizationError, match=r"'1'.*parametriz.*strict.*nothing was changed"):
        torchq.quantize_(m, torchq.int8_weight_only())
    assert identities(m) == ids and m.state_dict().keys() == sd.keys()
    assert all(type(v) is torch.Tensor and torch.equal(v, sd[k]) for k, v in m.state_dict().items())


def test_already_quantized_layers_warn_or_raise_in_strict():
    m = mlp()
    torchq.quantize_(m, torchq.int8_weight_only(), filter_fn=lambda mod, name: name == "3")
    w3 = m[3].weight
    with pytest.warns(torchq.SkippedLayerWarning, match=r"already quantized.*'3'"):
        torchq.quantize_(m, torchq.int4_weight_only(group_size=32))
    assert m[3].weight is w3 and isinstance(m[0].weight, AQT)
    ids = identities(m)
    with torchq.strict(), pytest.raises(torchq.QuantizationError, match=r"already quantized.*'0', '2\.0', '3'.*strict"):
        torchq.quantize_(m, torchq.int4_weight_only(group_size=32))
    with pytest.warns(torchq.SkippedLayerWarning, match=r"already quantized.*'3'"):  # a torchao-style filter too
        torchq.quantize_(m, torchq.int8_weight_only(), filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))
    assert identities(m) == ids


# -- transformers-style Conv1D (GPT-2's transposed linear), matched by duck typing (item 11) -------
class Conv1D(nn.Module):
    """The same structure as transformers.pytorch_utils.Conv1D."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


@pytest.mark.parametrize("cfg,min_sqnr", [(torchq.int8_weight_only(), 35), (torchq.int4_weight_only(group_size=32), 15)],
                         ids=["int8", "int4"])
def test_conv1d_is_quantized_transposed_and_runs_the_quantized_kernel(cfg, min_sqnr, tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(Conv1D(96, 64), nn.ReLU(), Conv1D(32, 96))
    x = torch.randn(2, 3, 64)
    ref = m(x)
    torchq.quantize_(m, cfg)
    w = m[0].weight
    assert isinstance(w, AQT) and w.transposed and tuple(w.shape) == (64, 96) and w.label == "0"
    assert torch.allclose(w.dequantize(), m[0].weight.dequantize())
    with torchq.strict():  # no dequantize fallback
        y = m(x)
    assert torch.allclose(y, torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(
        x, m[0].weight.dequantize().t(), m[0].bias)), m[2].weight.dequantize().t(), m[2].bias), atol=3e-2)
    assert float(20 * torch.log10(ref.norm() / (ref - y).norm()).detach()) > min_sqnr
    torchq.save_quantized(m, tmp_path / "c.safetensors")
    torch.manual_seed(1)
    fresh = nn.Sequential(Conv1D(96, 64), nn.ReLU(), Conv1D(32, 96))
    torchq.load_quantized(fresh, tmp_path / "c.safetensors")
    assert fresh[0].weight.transposed and torch.equal(fresh(x), y)


def test_safetensors_cannot_write_a_quantized_weight_and_says_what_to_use(tmp_path):
    from safetensors.torch import save_file

    m = mlp()
    torchq.quantize_(m, torchq.int8_weight_only())
    with pytest.raises(TypeError, match=r"'0' is a quantized weight.*torchq\.save_quantized"):
        save_file({"w": m[0].weight}, str(tmp_path / "w.safetensors"))


def test_already_quantized_layers_are_reported_only_when_the_config_asks_for_them():
    m = mlp()
    torchq.quantize_(m, torchq.int8_weight_only(), filter_fn=lambda mod, name: name == "3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchq.quantize_(m, {"0": torchq.int8_weight_only()})  # '3' is not asked for: nothing to say
    with pytest.warns(torchq.SkippedLayerWarning, match=r"already quantized.*'3'"):
        torchq.quantize_(m, {"3": torchq.int4_weight_only(group_size=32)})


def test_tied_weights_with_device_stay_tied():
    m = tied()
    with pytest.warns(torchq.TiedWeightWarning):
        torchq.quantize_(m, torchq.int8_weight_only(), device="meta")
    assert m.emb.weight is m.head.weight and m.a.weight is m.b.weight and m.head.weight.device.type == "meta"
    assert m.a.bias.device.type == "meta" and m.b.bias.device.type == "meta"
