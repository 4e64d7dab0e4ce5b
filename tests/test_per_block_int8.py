"""PerBlockInt8: the int8 activation scheme of the int8-activation 4-bit mode (llama.cpp's Q8_0)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchq.activation import PerBlockInt8, activation_from_json

Q = PerBlockInt8()


@settings(deadline=None, max_examples=60)
@given(rows=st.integers(1, 4), k=st.integers(1, 130), scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**31 - 1))
def test_codes_and_scales_reconstruct_each_block_within_half_a_step(rows, k, scale, dtype, seed):
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    if not torch.isfinite(x).all():
        return  # fp16 cannot hold the magnitude: covered by the non-finite test
    codes, scales = Q.quantize(x)
    kp = -(-k // 32) * 32
    assert codes.dtype == torch.int8 and codes.shape == (rows, kp) and scales.shape == (rows, kp // 32)
    assert (codes[:, k:] == 0).all() and codes.abs().max() <= 127
    x32 = torch.nn.functional.pad(x.float(), (0, kp - k)).reshape(rows, -1, 32)
    want = x32.abs().amax(-1) / 127
    assert torch.equal(scales, want)
    deq = codes.reshape(rows, -1, 32).float() * scales.unsqueeze(-1)
    # half a step, plus the fp32 roundings of x / a (a tie can land on either side) and of a * q
    assert ((deq - x32).abs() <= scales.unsqueeze(-1) / 2 + x32.abs() * 2.0**-21 + 1e-45).all()
    nonzero = want > 0
    assert (codes.reshape(rows, -1, 32).abs().amax(-1)[nonzero] == 127).all()  # the block's largest element maps to 127
    assert torch.equal(Q.fake_quantize(x), deq.reshape(rows, kp)[:, :k].to(dtype))


def test_zero_blocks_and_ties():
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-127, 127, 32)
    x[1, 33] = 0.5  # exactly half a step (scale 1): rounds to even 0
    x[1, 34] = 1.5  # rounds to 2
    codes, scales = Q.quantize(x)
    assert torch.equal(scales, torch.tensor([[0.0, 0.0], [0.0, 1.0]]))
    assert (codes[0] == 0).all() and (codes[1, :32] == 0).all()
    assert codes[1, 33] == 0 and codes[1, 34] == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_makes_its_block_nan_and_leaves_the_others(bad):
    x = torch.randn(1, 96)
    x[0, 40] = bad
    codes, scales = Q.quantize(x)
    assert math.isnan(scales[0, 1]) and torch.isfinite(scales[0, [0, 2]]).all()
    assert (codes[0, 32:64] == 0).all()
    y = Q.fake_quantize(x)
    assert y[0, 32:64].isnan().all() and torch.isfinite(y[0, :32]).all() and torch.isfinite(y[0, 64:]).all()


def test_json_and_arguments():
    assert activation_from_json(Q.to_json()) == Q
    assert "32-block" in Q.describe()
    with pytest.raises(ValueError, match="block_size: expected 32, got 64"):
        PerBlockInt8(64)
    with pytest.raises(ValueError, match="per_block_int8 takes a block_size only"):
        activation_from_json({"type": "per_block_int8", "block_size": 32, "eps": 1})
