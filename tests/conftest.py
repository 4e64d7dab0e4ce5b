import atexit
import os
import shutil
import tempfile

# Inductor's on-disk caches outlive code changes: a local run could replay a graph compiled from
# older code and pass where a clean CI machine fails. Every test session compiles from scratch in
# its own cache folder (set before torch is imported; an explicit TORCHINDUCTOR_CACHE_DIR wins).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache = tempfile.mkdtemp(prefix="torchq-inductor-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import pytest
import torch
from hypothesis import settings

# Without a GPU, Triton kernels run in triton's CPU interpreter (read when a kernel is defined,
# so before any torchq.backends.triton module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torchq import dispatch, native, prefill

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
# Local runs (random, as CI's are not) also print a failure's @reproduce_failure blob: a rare
# example (a float bound missed once in thousands) survives a cut log or a lost database.
settings.register_profile("local", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "local"))


@pytest.fixture(autouse=True)
def _clean_state():
    """Each test starts non-strict, with no remembered fallback warnings and a fixed seed."""
    torch.manual_seed(0)
    dispatch.reset_fallback_warnings()
    native.reset_warnings()
    saved = dispatch.is_strict()
    dispatch.set_strict(False)
    yield
    dispatch.set_strict(saved)
    dispatch.reset_fallback_warnings()


@pytest.fixture
def isa(request):
    """Cap the native library at ISA ``request.param`` for one test (indirect parametrization)."""
    saved = native.status().isa
    native.set_isa(request.param)
    yield request.param
    native.set_isa(saved)


@pytest.fixture
def fast_bf16(request, monkeypatch):
    """Force :data:`torchq.prefill.FAST_BF16_MATMUL` to ``request.param`` for one test (indirect
    parametrization): bf16 inputs then take bf16 tiles (AMX / AVX512_BF16 CPUs) or fp32 tiles
    (every other CPU) whatever this machine has, so both paths run everywhere. The bf16
    dot-product GEMM, which takes those rows first on AVX512_BF16 CPUs, is off meanwhile."""
    from torchq.backends.native_cpu import library

    monkeypatch.setattr(prefill, "FAST_BF16_MATMUL", bool(request.param))
    with library.bf16_dp_gemm("off"):
        yield bool(request.param)


@pytest.fixture
def threads(request):
    """Run one test with ``request.param`` torch threads (indirect parametrization)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.detach().double(), y.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - y).norm()))


@pytest.fixture(autouse=True)
def _grad_mode_is_restored():
    """A test (or a script's main() it calls) that turns autograd off globally and leaves it off
    breaks every gradient test after it: fail that test instead."""
    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("the test left autograd disabled (torch.set_grad_enabled(False) not undone)")
