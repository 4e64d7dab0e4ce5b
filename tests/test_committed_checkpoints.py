"""Checkpoints written by earlier torchq code (committed under tests/data/checkpoints, made by
``make_v1.py`` there) load with today's code: the same values, the same objects, and a quantized
state dict pickles again to the very same bytes."""

from __future__ import annotations

import importlib.util
import io
import json
import pathlib
import zipfile

import torch
from torch import nn

import torchq

DATA = pathlib.Path(__file__).parent / "data" / "checkpoints"


def _maker():
    spec = importlib.util.spec_from_file_location("make_v1", DATA / "make_v1.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(32, 24),
                         nn.Linear(24, 16)).to(torch.bfloat16)


def _values(sd: dict) -> dict:
    return {k: (v.dequantize() if isinstance(v, torchq.AffineQuantizedTensor) else v).float() for k, v in sd.items()}


def test_v1_torch_save_loads_with_weights_only():
    saved = torch.load(DATA / "v1_torch_save.pt", weights_only=True)
    expected = torch.load(DATA / "v1_expected_values.pt", weights_only=True)
    sd = saved["state_dict"]
    assert {k for k, v in sd.items() if isinstance(v, torchq.AffineQuantizedTensor)} == {f"{i}.weight" for i in (0, 2, 3, 4, 5)}
    got = _values(sd)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    objects = {k: repr(v) for k, v in saved["objects"].items()}
    assert objects == json.loads((DATA / "v1_expected_objects.json").read_text())
    model = _model()
    model.load_state_dict(sd, assign=True)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert model(x).shape == (3, 16)


def test_v1_state_dict_pickles_to_the_same_bytes():
    """Today's code quantizes the same model and pickles it to the committed bytes (the records with
    their CRCs, the pinned rebuild functions' paths, the objects' JSON)."""
    model, objects = _maker().quantized_model()
    buf = io.BytesIO()
    torch.save({"state_dict": model.state_dict(), "objects": objects}, buf)
    again = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    committed = zipfile.ZipFile(DATA / "v1_torch_save.pt")
    assert again.read(again.namelist()[0].split("/")[0] + "/data.pkl") == committed.read("v1_torch_save/data.pkl")


def test_v1_save_quantized_loads():
    expected = torch.load(DATA / "v1_expected_values.pt", weights_only=True)
    model = _model()
    torchq.load_quantized(model, DATA / "v1_save_quantized.safetensors")
    got = _values(model.state_dict())
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
