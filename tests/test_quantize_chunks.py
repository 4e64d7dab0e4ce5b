"""Quantizing a large weight a few rows at a time (bounded temporaries) gives the same bits as
quantizing it whole: quantize_in_row_chunks for configs whose rows are independent, and NF4 /
FP4's own chunked quantization (its double quantization still spans the whole weight)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchq
from torchq import configs
from torchq.quantize import quantize_in_row_chunks

ROWWISE = ["int8wo", "int8dq", "int4-g32", "int4-g128", "int4-g64-hqq", "int4-g32-fp32", "intx3-g32", "intx5-g32-hqq"]


def same_bits(a, b):
    pa, pb = a.to_plain(), b.to_plain()
    assert pa.spec == pb.spec and type(a.tensor_impl.layout) is type(b.tensor_impl.layout)
    for x, y in ((pa.codes, pb.codes), (pa.scale, pb.scale), (pa.zero_point, pb.zero_point)):
        assert (x is None and y is None) or torch.equal(x, y)
    assert torch.equal(a.dequantize(), b.dequantize())
    assert (a.config, a.label, a.act_quant, a.compute_dtype) == (b.config, b.label, b.act_quant, b.compute_dtype)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(ROWWISE), n=st.integers(1, 40), k=st.sampled_from([64, 128, 192, 576]),
       rows=st.integers(1, 9), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_row_chunks_equal_the_whole_weight(name, n, k, rows, dtype, seed):
    cfg = torchq.config_from_name(name)
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)
    w[0, : k // 2] = 0.0  # a constant half row
    assert cfg.rows_independent(w)
    chunk = rows * k * w.element_size()
    same_bits(quantize_in_row_chunks(cfg, w, label="x", chunk_bytes=chunk), cfg.quantize_weight(w, label="x"))


@pytest.mark.parametrize("name", ["nf4", "fp4", "nf4-b128"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_blockwise_4bit_in_row_chunks_equals_whole(monkeypatch, name, double_quant):
    cfg = dataclasses.replace(torchq.config_from_name(name), double_quant=double_quant)
    w = torch.randn(37, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    whole = cfg.quantize_weight(w, label="x")
    monkeypatch.setattr(configs, "ROW_CHUNK_BYTES", 3 * 256 * 4)  # three rows at a time
    same_bits(cfg.quantize_weight(w, label="x"), whole)


def test_configs_that_are_not_row_independent_are_quantized_whole():
    w = torch.randn(8, 64)
    for cfg in (torchq.config_from_name("int4-g32-gptq"), torchq.nf4_weight_only(), torchq.llm_int8()):
        assert not cfg.rows_independent(w)
