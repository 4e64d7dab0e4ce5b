"""autoquant: per-layer choice from measured times, the SQNR floor, the timing cache, and plans
that re-apply to identical weights without timing."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import torchq
from torchq import autotune as aq_module


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 32))


CANDIDATES = {"int8wo": torchq.int8_weight_only(), "int4-g64": torchq.int4_weight_only(group_size=64),
              "intx2": torchq.intx_weight_only(bits=2, group_size=32)}


def test_picks_a_config_per_layer_and_applies_it(tmp_path):
    model = small_model()
    x = torch.randn(3, 256)
    ref = model(x)
    result = torchq.autoquant(model, x, candidates=CANDIDATES, cache=tmp_path / "t.json", progress=False, budget_s=0.02)
    assert [c.layer for c in result.choices] == ["0", "2", "4"]
    for c in result.choices:
        assert c.chosen in {"float", *CANDIDATES}
        assert set(c.candidates) == {"float", *CANDIDATES}
        assert c.signatures == {(3, "torch.float32", "cpu"): 1}
        fastest = min((v["ms"], name) for name, v in c.candidates.items() if v["status"] == "ok")
        assert c.candidates[c.chosen]["ms"] == fastest[0]  # no floor: the fastest wins
        layer = dict(model.named_modules())[c.layer]
        assert isinstance(layer.weight, torchq.AffineQuantizedTensor) == (c.chosen != "float")
    table = result.table()
    assert "layer" in table and "speedup" in table and "sqnr_db" in table
    assert model(x).shape == ref.shape


@pytest.mark.parametrize("floor", [30.0, 1000.0])
def test_min_sqnr_is_respected(floor, tmp_path):
    model = small_model()
    x = torch.randn(2, 256)
    result = torchq.autoquant(model, x, candidates=CANDIDATES, min_sqnr=floor, cache=tmp_path / "t.json", progress=False,
                              budget_s=0.02)
    for c in result.choices:
        assert c.sqnr >= floor
        assert c.chosen != "intx2"  # 2-bit weights are ~10 dB: never above the floor
        assert c.candidates["intx2"]["sqnr"] < 30
    if floor == 1000.0:
        assert all(c.chosen == "float" for c in result.choices)
        assert all(cfg is None for cfg in result.plan.values())
        assert not any(isinstance(m.weight, torchq.AffineQuantizedTensor) for m in model if isinstance(m, nn.Linear))


def test_timings_are_cached_on_disk(tmp_path, monkeypatch):
    cache = tmp_path / "timings.json"
    x = torch.randn(2, 256)
    first = torchq.autoquant(small_model(), x, candidates=CANDIDATES, cache=cache, progress=False, budget_s=0.02)
    assert first.timed > 0 and cache.exists()
    entries = json.loads(cache.read_text())["entries"]
    assert any("256x512" in k or "512x256" in k for k in entries) and all("torch " in k for k in entries)

    def no_timing(*a, **k):
        raise AssertionError("a cached timing was measured again")

    monkeypatch.setattr(aq_module, "_time_interleaved", no_timing)
    second = torchq.autoquant(small_model(), x, candidates=CANDIDATES, cache=cache, progress=False)
    assert second.timed == 0 and second.cached == first.timed + first.cached
    assert [c.chosen for c in second.choices] == [c.chosen for c in first.choices]


def test_saved_plan_reapplies_to_identical_weights(tmp_path):
    x = torch.randn(2, 256)
    model = small_model()
    result = torchq.autoquant(model, x, candidates=CANDIDATES, min_sqnr=20, cache=tmp_path / "t.json", progress=False,
                              budget_s=0.02)
    path = result.save_plan(tmp_path / "plan.json")
    plan = torchq.load_plan(path)
    assert plan == result.plan
    fresh = small_model()
    torchq.quantize_(fresh, plan)
    for (name, a), (_, b) in zip(model.named_modules(), fresh.named_modules()):
        if isinstance(a, nn.Linear):
            assert type(a.weight) is type(b.weight), name
            if isinstance(a.weight, torchq.AffineQuantizedTensor):
                assert a.weight.to_plain().equal(b.weight.to_plain()) and a.weight.quant_layout == b.weight.quant_layout
            else:
                assert torch.equal(a.weight, b.weight)
    # hand-edited plans: a layer forced to a config, another to float
    data = json.loads(path.read_text())
    data["layers"]["0"] = torchq.int4_weight_only(group_size=32).to_json()
    data["layers"]["2"] = None
    path.write_text(json.dumps(data))
    edited = small_model()
    torchq.quantize_(edited, torchq.load_plan(path))
    assert edited[0].weight.config == torchq.int4_weight_only(group_size=32)
    assert not isinstance(edited[2].weight, torchq.AffineQuantizedTensor)


def test_records_every_input_signature_with_counts(tmp_path):
    class TwoCalls(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

        def forward(self, a, b):
            return self.proj(a) + self.proj(b).sum()

    model = TwoCalls()
    result = torchq.autoquant(model, torch.randn(5, 64), torch.randn(1, 64), candidates=["int8wo"], cache=False, progress=False,
                              budget_s=0.01)
    assert result.choices[0].signatures == {(5, "torch.float32", "cpu"): 1, (1, "torch.float32", "cpu"): 1}


def test_bad_arguments_say_what_is_wrong(tmp_path):
    model = small_model()
    with pytest.raises(ValueError, match="example input"):
        torchq.autoquant(model)
    with pytest.raises(TypeError, match="candidates"):
        torchq.autoquant(model, torch.randn(1, 256), candidates={"x": 3})
    with pytest.raises(ValueError, match="float"):
        torchq.autoquant(model, torch.randn(1, 256), candidates={"float": torchq.int8_weight_only()})
    (tmp_path / "bad.json").write_text('{"layers": {}}')
    with pytest.raises(ValueError, match="torchq.plan"):
        torchq.load_plan(tmp_path / "bad.json")
    (tmp_path / "bad2.json").write_text(json.dumps({"format": "torchq.plan", "version": 1, "layers": {"0": {"type": "Nope"}}}))
    with pytest.raises(ValueError, match="layer '0'"):
        torchq.load_plan(tmp_path / "bad2.json")


@pytest.mark.slow
def test_autoquant_then_compile(tmp_path):
    model = small_model()
    x = torch.randn(2, 256)
    torchq.autoquant(model, x, candidates=CANDIDATES, cache=tmp_path / "t.json", progress=False, budget_s=0.02)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)
    assert torch.allclose(compiled(x), eager, rtol=1e-4, atol=1e-4)


def test_default_candidates_cover_layouts_and_their_kernels(tmp_path):
    model = nn.Sequential(nn.Linear(256, 256))
    result = torchq.autoquant(model, torch.randn(1, 256), cache=tmp_path / "t.json", progress=False, budget_s=0.01, apply=False)
    per = result.choices[0].candidates
    assert {"float", "int8wo", "int8dq", "int4-g128", "int4-g32", "nf4", "int4-g128@int4_cpu"} <= set(per)
    assert per["int4-g128@int4_cpu"]["kernel"].startswith("int4_cpu")
    assert per["nf4"]["kernel"] == "blockwise_4bit_linear"
    assert all(v["ms"] > 0 for v in per.values())
    assert "int4-g128-fp32" not in per  # an fp32 model's int4 scales are fp32 already


def test_default_candidates_add_fp32_scales_for_half_models_on_cpu():
    names = set(torchq.autotune.default_candidates("cpu", torch.bfloat16))
    assert {"int4-g128-fp32", "int4-g32-fp32"} <= names
    assert torchq.autotune.default_candidates("cpu", torch.bfloat16)["int4-g128-fp32"].scale_dtype == torch.float32
    assert not {"int4-g128-fp32", "int4-g32-fp32"} & set(torchq.autotune.default_candidates("cpu", torch.float32))


def test_calibrated_candidates_have_their_own_accuracy(tmp_path):
    model = small_model()
    x = torch.randn(64, 256)
    x[:, :8] *= 20  # salient input features, as real activations have
    cands = {"int4-g64": torchq.int4_weight_only(group_size=64), "int4-g64-gptq": torchq.config_from_name("int4-g64-gptq"),
             "int4-g64-awq": torchq.config_from_name("int4-g64-awq")}
    result = torchq.autoquant(model, x, candidates=cands, cache=tmp_path / "t.json", progress=False, budget_s=0.02)
    for c in result.choices:
        assert c.candidates["int4-g64-gptq"]["status"] == "ok" and c.candidates["int4-g64-awq"]["status"] == "ok"
        assert c.candidates["int4-g64-gptq"]["sqnr"] > c.candidates["int4-g64"]["sqnr"]
        layer = dict(model.named_modules())[c.layer]
        if c.chosen != "float":
            assert layer.weight.config == cands[c.chosen]
    # a calibrated candidate outside autoquant and calibrate needs the data: quantize_ refuses it
    with pytest.raises(torchq.QuantizationError, match="calibrate"):
        torchq.quantize_(small_model(), cands["int4-g64-gptq"])
