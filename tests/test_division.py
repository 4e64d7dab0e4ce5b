"""torchq.division: quotients by a constant are the correctly rounded ones, with the CPU's bits in
both forms (the Python divisor on the CPU, the 0-d tensor divisor that other devices take)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchq.division import divide, divide_by_tensor

DIVISORS = [127, 127.0, 7.5, 15, 448.0, 16129.0, 3, -8, 2.5]


def values(dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(4096, generator=g, dtype=torch.float64) * torch.exp(8 * torch.randn(4096, generator=g, dtype=torch.float64))
    v[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40], dtype=torch.float64)
    return v.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)) \
        and torch.equal(a.nan_to_num(0.0).signbit(), b.nan_to_num(0.0).signbit())


@settings(deadline=None, max_examples=30)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]), divisor=st.sampled_from(DIVISORS),
       seed=st.integers(0, 2**31 - 1))
def test_both_forms_give_the_cpu_quotient(dtype, divisor, seed):
    t = values(dtype, seed)
    want = t / divisor
    assert same(divide(t, divisor), want)
    assert same(divide_by_tensor(t, divisor), want)


@pytest.mark.parametrize("divisor", [127.0, 7.5, 448.0])
def test_the_quotient_is_correctly_rounded_where_the_reciprocal_is_not(divisor):
    """fp32: the quotient equals the exactly rounded one (division in double, then one rounding:
    innocuous for division), while ``t · fl(1/d)``, what CUDA computes for ``t / d``, is off for some."""
    t = values(torch.float32, 0)
    exact = (t.double() / divisor).float()
    assert same(divide_by_tensor(t, divisor), exact)
    assert not same(t * (1 / divisor), exact)


def test_integer_tensors_divide_as_torch_does():
    t = torch.arange(-20, 20, dtype=torch.int32)
    assert same(divide(t, 3), t / 3)
