"""Configs: frozen, hashable, JSON round trips, validation errors."""

import dataclasses
import json

import pytest
import torch

import torchq
from torchq.layouts import layout_from_json

CONFIGS = [
    torchq.int4_weight_only(),
    torchq.int4_weight_only(group_size=32, layout=torchq.Int4CPULayout(), zero_point_domain="int", scale_dtype=torch.float32),
    torchq.int8_weight_only(layout=torchq.PlainLayout()),
    torchq.int8_dynamic_activation_int8_weight(),
    torchq.int8_dynamic_activation_int8_weight(reduce_range=True),
    torchq.intx_weight_only(bits=3, group_size=None, mapping_type="symmetric", layout=torchq.PackedBitsLayout()),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=repr)
def test_json_round_trip_and_frozen(cfg):
    d = cfg.to_json()
    assert d["type"] == type(cfg).__name__ and d["version"] == 1
    text = json.dumps(d)
    again = torchq.config_from_json(text)
    assert again == cfg and hash(again) == hash(cfg)
    assert torchq.config_from_json(cfg.to_json_str()) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.layout = None
    assert type(cfg).__name__ in repr(cfg)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torchq.int4_weight_only(group_size=100), "group_size: expected one of 32, 64, 128, 256, got 100"),
        (lambda: torchq.int4_weight_only(zero_point_domain="bogus"), "bogus"),
        (lambda: torchq.intx_weight_only(bits=9), "bits: expected an int in 1..8, got 9"),
        (lambda: torchq.intx_weight_only(bits=0), "bits"),
        (lambda: torchq.intx_weight_only(group_size=0), "group_size: expected a positive int"),
        (lambda: torchq.intx_weight_only(bits=1, mapping_type="symmetric"), "SYMMETRIC needs at least 2 bits"),
        (lambda: torchq.int8_weight_only(layout="plain"), "layout: expected a torchq Layout"),
        (lambda: torchq.int4_weight_only(scale_dtype=torch.int8), "scale_dtype"),
        (lambda: torchq.int8_dynamic_activation_int8_weight(reduce_range=1), "reduce_range: expected a bool, got int 1"),
    ],
)
def test_bad_config_arguments(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_bad_json():
    with pytest.raises(ValueError, match="unknown config type"):
        torchq.config_from_json({"type": "Nope"})
    with pytest.raises(ValueError, match="newer than this torchq"):
        torchq.config_from_json({"type": "Int8WeightOnlyConfig", "version": 99})
    with pytest.raises(ValueError, match="has no field 'bits'"):
        torchq.config_from_json({"type": "Int8WeightOnlyConfig", "bits": 3})
    with pytest.raises(ValueError, match="unknown layout type"):
        layout_from_json({"type": "nope"})
    with pytest.raises(ValueError, match="unknown dtype"):
        torchq.config_from_json({"type": "Int4WeightOnlyConfig", "scale_dtype": "float99"})


def test_automatic_layout_choice_by_device():
    w = torch.randn(64, 64)
    best = torchq.Int4NativeLayout() if torchq.native.available() else torchq.Int4CPULayout()
    assert torchq.int4_weight_only(group_size=32).quantize_weight(w).quant_layout == best
    assert torchq.int8_weight_only().quantize_weight(w).quant_layout == torchq.PlainLayout()
    assert torchq.intx_weight_only(bits=6).quantize_weight(w).quant_layout == torchq.PackedBitsLayout()
    meta = torchq.int4_weight_only(group_size=32).quantize_weight(w.to("meta"))
    assert meta.quant_layout == torchq.PackedBitsLayout()  # the CPU layout only lives on the CPU


def test_config_from_name():
    assert torchq.config_from_name("int4-g64") == torchq.int4_weight_only(group_size=64)
    assert torchq.config_from_name("int4-g32-fp32") == torchq.int4_weight_only(group_size=32, scale_dtype=torch.float32)
    assert torchq.config_from_name("intx3-g32") == torchq.intx_weight_only(bits=3, group_size=32)
    assert torchq.config_from_name("int8wo") == torchq.int8_weight_only()
    assert torchq.config_from_name("int8dq-r7") == torchq.int8_dynamic_activation_int8_weight(reduce_range=True)
    assert torchq.config_from_name("nf4") == torchq.nf4_weight_only()
    assert torchq.config_from_name("fp4-b128") == torchq.fp4_weight_only(block_size=128)
    with pytest.raises(ValueError, match="config name"):
        torchq.config_from_name("int3")


def test_reduce_range_quantizes_activations_to_seven_bits():
    """int8 dynamic with reduce_range: activations per token in [-63, 63] (s = amax / 63), and the
    layer (native kernels where present) gives the reference's bits at decode and prefill sizes."""
    from torchq import native
    from torchq.activation import PerTokenInt8

    lin = torch.nn.Linear(96, 40)
    torchq.quantize_(lin, torchq.int8_dynamic_activation_int8_weight(reduce_range=True))
    assert lin.weight.act_quant == PerTokenInt8(-63, 63)
    codes, scale = lin.weight.act_quant.quantize(torch.tensor([[2.0, -1.5, 0.5]]))
    assert codes.tolist() == [[63, -47, 16]] and scale.item() == torch.tensor(2.0 / 63).item()
    for m in (1, 9, 40):
        x = torch.randn(m, 96)
        with torch.no_grad():
            y = lin(x)
            with native.disabled():
                ref = lin(x)
        assert torch.equal(y, ref)
