import os

import pytest
import torch
from hypothesis import settings

from torchq import dispatch

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _clean_state():
    """Each test starts non-strict, with no remembered fallback warnings and a fixed seed."""
    torch.manual_seed(0)
    dispatch.reset_fallback_warnings()
    saved = dispatch.is_strict()
    dispatch.set_strict(False)
    yield
    dispatch.set_strict(saved)
    dispatch.reset_fallback_warnings()


def sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.detach().double(), y.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - y).norm()))
