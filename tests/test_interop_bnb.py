"""bitsandbytes 4-bit state dicts <-> torchq NF4/FP4 weights (lossless both ways)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

import torchq
from torchq import CheckpointError
from torchq.blockwise import codebook, dynamic_map
from torchq.interop import from_bitsandbytes, to_bitsandbytes

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
CASES = [("nf4", True), ("nf4", False), ("fp4", True), ("fp4", False)]


def quantized(qt: str, nested: bool, dtype=torch.bfloat16) -> nn.Linear:
    torch.manual_seed(0)
    lin = nn.Linear(128, 96).to(dtype)
    torchq.quantize_(nn.Sequential(lin), torchq.NF4WeightOnlyConfig(quant_type=qt, double_quant=nested))
    return lin


@pytest.mark.parametrize("qt,nested", CASES)
def test_export_layout_matches_the_bitsandbytes_format(qt, nested):
    lin = quantized(qt, nested)
    sd = to_bitsandbytes(lin.state_dict())
    keys = {"weight", "bias", "weight.absmax", "weight.quant_map", f"weight.quant_state.bitsandbytes__{qt}"}
    if nested:
        keys |= {"weight.nested_absmax", "weight.nested_quant_map"}
    assert set(sd) == keys
    assert sd["weight"].dtype == torch.uint8 and sd["weight"].shape == (96 * 128 // 2, 1)
    assert torch.equal(sd["weight"].reshape(-1), lin.weight.tensor_impl.packed.reshape(-1))
    assert torch.equal(sd["weight.quant_map"], codebook(qt))
    meta = json.loads(bytes(sd[f"weight.quant_state.bitsandbytes__{qt}"].tolist()).decode())
    assert meta["quant_type"] == qt and meta["blocksize"] == 64 and meta["dtype"] == "bfloat16" and meta["shape"] == [96, 128]
    if nested:
        assert sd["weight.absmax"].dtype == torch.uint8 and sd["weight.absmax"].shape == (192,)
        assert torch.equal(sd["weight.nested_quant_map"], dynamic_map())
        assert meta["nested_blocksize"] == 256 and meta["nested_dtype"] == "float32"
        assert torch.tensor(meta["nested_offset"], dtype=torch.float32) == lin.weight.tensor_impl.nested_offset
    else:
        assert sd["weight.absmax"].dtype == torch.float32 and "nested_offset" not in meta


@pytest.mark.parametrize("qt,nested", CASES)
def test_exported_group_feeds_gemm_4bit(qt, nested):
    """A bitsandbytes group's entries are gemm_4bit's arguments (as bitsandbytes' Linear4bit passes
    them); the result is the torchq layer's output, bit for bit."""
    lin = quantized(qt, nested)
    sd = to_bitsandbytes(lin.state_dict())
    meta = json.loads(bytes(sd[f"weight.quant_state.bitsandbytes__{qt}"].tolist()).decode())
    if nested:
        scales = {"absmax": sd["weight.nested_absmax"], "absmax_8bit": sd["weight.absmax"],
                  "absmax_code": sd["weight.nested_quant_map"], "absmax_offset": torch.tensor(meta["nested_offset"])}
    else:
        scales = {"absmax": sd["weight.absmax"]}
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    y = torch.ops.torchq.gemm_4bit(x, sd["weight"], meta["shape"], blocksize=meta["blocksize"], quant_type=qt, bias=sd["bias"], **scales)
    with torch.no_grad():
        assert torch.equal(y, lin(x))


@pytest.mark.parametrize("qt,nested", CASES)
def test_roundtrip_is_lossless(qt, nested):
    lin = quantized(qt, nested)
    back = from_bitsandbytes(to_bitsandbytes(lin.state_dict()))
    assert set(back) == {"weight", "bias"}
    w = back["weight"]
    assert w.quant_layout == torchq.Blockwise4bitLayout() and w.dtype == torch.bfloat16
    assert w.to_plain().equal(lin.weight.to_plain())
    assert w.config == torchq.NF4WeightOnlyConfig(quant_type=qt, double_quant=nested)
    with torch.device("meta"):
        fresh = nn.Linear(128, 96).to(torch.bfloat16)
    fresh.load_state_dict(back, assign=True)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fresh(x), lin(x))


def test_import_errors_name_the_weight_and_the_problem():
    sd = to_bitsandbytes(quantized("nf4", True).state_dict())
    bad = dict(sd)
    bad["weight.quant_map"] = codebook("fp4")
    with pytest.raises(CheckpointError, match="'weight': quant_map is not the standard nf4"):
        from_bitsandbytes(bad)
    bad = dict(sd)
    del bad["weight.nested_absmax"]
    with pytest.raises(CheckpointError, match="missing entries"):
        from_bitsandbytes(bad)
    bad = dict(sd)
    bad["weight.quant_state.bitsandbytes__nf4"] = torch.tensor(list(b"{not json"), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="not UTF-8 JSON"):
        from_bitsandbytes(bad)
    meta = json.loads(bytes(sd["weight.quant_state.bitsandbytes__nf4"].tolist()).decode())
    meta["shape"] = [96, 100]
    bad = dict(sd)
    bad["weight.quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="in_features 100 is not a multiple of blocksize 64"):
        from_bitsandbytes(bad)
    with pytest.raises(ValueError, match="only NF4/FP4"):
        lin = nn.Linear(128, 8)
        torchq.quantize_(nn.Sequential(lin), torchq.int8_weight_only())
        to_bitsandbytes(lin.state_dict())


def _bnb_param(sd, name="weight"):
    import bitsandbytes as bnb

    stats = {k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".")}
    return bnb.nn.Params4bit.from_prequantized(data=sd[name], quantized_stats=stats, device="cpu")


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")
@pytest.mark.parametrize("qt,nested", CASES)
def test_with_bitsandbytes_both_ways(qt, nested):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    torch.manual_seed(0)
    lin = bnb.nn.Linear4bit(128, 96, bias=True, compute_dtype=torch.bfloat16, compress_statistics=nested, quant_type=qt)
    lin.weight = bnb.nn.Params4bit(torch.randn(96, 128).to(torch.bfloat16), requires_grad=False,
                                   compress_statistics=nested, quant_type=qt)
    lin = lin.to("cpu")  # bitsandbytes quantizes on the move
    sd = lin.state_dict()
    ours = from_bitsandbytes(sd)
    ref = bnbf.dequantize_4bit(lin.weight.data, lin.weight.quant_state)
    assert torch.equal(ours["weight"].dequantize(), ref)
    back = to_bitsandbytes(ours)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k  # the same bytes, quant-state JSON included
    p = _bnb_param(back)
    assert torch.equal(bnbf.dequantize_4bit(p.data, p.quant_state), ref)
