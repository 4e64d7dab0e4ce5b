"""torchq.optim: AdamW8bit / AdamW4bit against their reference, torch.optim.AdamW and bitsandbytes' rule.

The fused native kernel (csrc/optim_adamw.cpp) must equal the pure-PyTorch reference bit for bit
(codes, absmax, parameters); the drop-in surface (groups, schedulers, state dicts, errors) is
checked against torch.optim.AdamW; FSDP2 runs on two gloo processes."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchq
from torchq import native as tq_native
from torchq.optim import FORMAT_4BIT, FORMAT_8BIT, AdamW4bit, AdamW8bit
from torchq.optim import native as optim_native
from torchq.optim.formats import dequantize_state, pack_nibbles, quantize_state, unpack_nibbles

ROOT = Path(__file__).resolve().parents[1]
CLASSES = [AdamW8bit, AdamW4bit]
STATE_KEYS = ("exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax")

needs_native = pytest.mark.skipif(
    optim_native.available() is not None and os.environ.get("TORCHQ_REQUIRE_NATIVE") != "1",
    reason=f"native optimizer kernel: {optim_native.available()}")


def test_native_status_names_the_reason():
    why = optim_native.available()
    if os.environ.get("TORCHQ_REQUIRE_NATIVE") == "1":  # CI: the install must have built it
        assert why is None, why
    if why is None:
        assert optim_native.kernel() is not None
    else:
        assert optim_native.kernel() is None and why


def _pair(cls, shape, dtype=torch.float32, seed=0, **kw):
    """Two identical parameters with one optimizer each: native and reference."""
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(shape, generator=g).to(dtype)
    pa, pb = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    return (pa, cls([pa], backend="native", **kw)), (pb, cls([pb], backend="reference", **kw))


def _assert_same(pa, oa, pb, ob):
    torch.testing.assert_close(pa, pb, rtol=0, atol=0, equal_nan=True)
    sa, sb = oa.state[pa], ob.state[pb]
    assert sa["state_bits"] == sb["state_bits"]
    for k in STATE_KEYS if sa["state_bits"] != 32 else ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, equal_nan=True, msg=k)
    assert torch.equal(sa["step"], sb["step"])


# -- the fast path equals the reference ---------------------------------------------------------------
@needs_native
@settings(max_examples=150, deadline=None)
@given(cls=st.sampled_from(CLASSES), n=st.integers(4096, 9000), cols=st.sampled_from([1, 3, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), scales=st.lists(st.sampled_from([0.0, 1e-30, 1e-6, 1.0, 1e4, 1e18]),
       min_size=1, max_size=4), wd=st.sampled_from([0.0, 0.1]), maximize=st.booleans(), seed=st.integers(0, 2**16))
def test_native_equals_reference(cls, n, cols, dtype, scales, wd, maximize, seed):
    shape = (n // cols, cols) if cols > 1 else (n,)
    (pa, oa), (pb, ob) = _pair(cls, shape, dtype, seed, lr=1e-2, weight_decay=wd, maximize=maximize)
    g = torch.Generator().manual_seed(seed + 1)
    for scale in scales:
        grad = (torch.randn(shape, generator=g) * scale).to(dtype)
        grad.reshape(-1)[: n // 7] = 0  # a run of zeros, whole blocks of them
        pa.grad, pb.grad = grad.clone(), grad.clone()
        oa.step()
        ob.step()
        _assert_same(pa, oa, pb, ob)


@needs_native
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_path_equals_reference(cls, dtype):
    """The kernel's portable (non-AVX2) path: the same bits as the reference too."""
    before = tq_native.status().isa
    tq_native.set_isa("scalar")
    try:
        (pa, oa), (pb, ob) = _pair(cls, (4099,), dtype, lr=1e-2, weight_decay=0.1)
        for scale in (1.0, 1e-3, 0.0):
            pa.grad = pb.grad = (torch.randn(4099) * scale).to(dtype)
            oa.step()
            ob.step()
            _assert_same(pa, oa, pb, ob)
    finally:
        tq_native.set_isa(before)


@needs_native
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 3e38])
def test_nonfinite_gradients(cls, bad):
    """A non-finite moment: that parameter becomes NaN or inf at once (as torch.optim.AdamW), its
    state block is stored with absmax NaN, so the whole block turns NaN at the next step; other
    blocks are untouched. Native and reference agree."""
    (pa, oa), (pb, ob) = _pair(cls, (5000,), lr=1e-3)
    grad = torch.randn(5000) * 1e-3
    grad[300] = bad
    pa.grad, pb.grad = grad.clone(), grad.clone()
    oa.step()
    ob.step()
    _assert_same(pa, oa, pb, ob)
    block = cls.state_format.block_size
    s = oa.state[pa]
    # NaN / inf: the parameter turns NaN at once (as torch's); 3e38 only overflows g * g: v = inf, update 0
    assert torch.isfinite(pa[300]) == (bad == 3e38) and torch.isfinite(pa[:300]).all() and torch.isfinite(pa[301:]).all()
    assert torch.isnan(s["exp_avg_sq_absmax"][300 // block])  # g * g is NaN or inf for every bad value
    assert torch.isfinite(s["exp_avg_sq_absmax"][300 // block + 1:]).all()
    pa.grad = pb.grad = torch.randn(5000) * 1e-3
    oa.step()
    ob.step()
    _assert_same(pa, oa, pb, ob)
    lo = 300 // block * block
    assert torch.isnan(pa[lo: lo + block]).all() and torch.isfinite(pa[lo + block:]).all()


@needs_native
def test_gradient_of_another_dtype_takes_the_reference():
    """bf16 parameter, fp32 gradient: auto runs the reference (the kernel reads one dtype), exactly."""
    a, b = (torch.nn.Parameter(torch.randn(5000).bfloat16()) for _ in range(2))
    with torch.no_grad():
        b.copy_(a)
    oa, ob = AdamW8bit([a]), AdamW8bit([b], backend="reference")
    a.grad_dtype = b.grad_dtype = torch.float32  # torch >= 2.10 asks for it (mixed-precision training sets it)
    a.grad = torch.randn(5000)
    b.grad = a.grad.clone()
    oa.step()
    ob.step()
    _assert_same(a, oa, b, ob)
    with pytest.raises(RuntimeError, match="backend: 'native' takes contiguous fp32 / bf16 CPU parameters"):
        AdamW8bit([a], backend="native").step()


@pytest.mark.parametrize("cls", CLASSES)
def test_reference_backend_runs_without_the_library(cls):
    p = torch.nn.Parameter(torch.randn(4096))
    p.grad = torch.randn(4096)
    with tq_native.disabled():
        opt = cls([p])  # auto: the reference, silently (disabled on purpose)
        opt.step()
        assert opt.state[p]["exp_avg"].dtype == torch.uint8
        with pytest.raises(RuntimeError, match="backend: 'native' is not available"):
            cls([p], backend="native")


# -- formats -----------------------------------------------------------------------------------------
def test_maps_and_bytes():
    s8, u8 = FORMAT_8BIT.signed_map, FORMAT_8BIT.unsigned_map
    assert s8.numel() == u8.numel() == 256 and s8[127] == 0 and s8[255] == 1 and u8[0] == 0 and u8[255] == 1
    assert (s8[1:] > s8[:-1]).all() and (u8[1:] > u8[:-1]).all() and (u8 >= 0).all()
    s4, u4 = FORMAT_4BIT.signed_map, FORMAT_4BIT.unsigned_map
    assert s4.tolist() == pytest.approx([-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0, 0.0055, 0.0325,
                                         0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0])
    assert u4.tolist() == [k / 16 for k in range(1, 17)]  # no zero
    x = torch.randn(1001)
    codes, absmax = quantize_state(x, FORMAT_4BIT, signed=True)
    assert codes.shape == (501,) and absmax.shape == (8,) and codes.dtype == torch.uint8
    idx = unpack_nibbles(codes, 1001)
    assert codes[0] == (idx[0] << 4 | idx[1]) and codes[-1] == idx[-1] << 4  # high nibble first, odd tail padded with 0
    assert torch.equal(pack_nibbles(idx), codes)
    back = dequantize_state(codes, absmax, 1001, FORMAT_4BIT, signed=True)
    assert (back - x).abs().max() <= 0.2 * x.abs().max()


@pytest.mark.parametrize("cls, limit", [(AdamW8bit, 2.1), (AdamW4bit, 1.1)])
def test_state_bytes_per_parameter(cls, limit):
    big, small = torch.nn.Parameter(torch.randn(1000, 37)), torch.nn.Parameter(torch.randn(4095))
    opt = cls([big, small])
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    opt.step()
    nbytes = lambda p: sum(v.numel() * v.element_size() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and k != "step")
    assert nbytes(big) / big.numel() <= limit
    assert nbytes(small) == 8 * small.numel() and opt.state[small]["exp_avg"].dtype == torch.float32
    assert opt.state_bytes() == nbytes(big) + nbytes(small)


# -- bitsandbytes' rule, reimplemented independently ---------------------------------------------------
def _bnb_dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes.functional.create_dynamic_map(signed, 7, 8), as its source writes it."""
    data, non_sign_bits, max_exponent_bits = [], 7, 7
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0, 1.0]
    data += [0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def _bnb_quantize(x: torch.Tensor, code: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """kOptimizer8bit2StateBlockwise's requantization: blocks of 256, absmax = max |x|, nearest code
    of x / absmax, and for state 1 a value whose code has the other sign moves one code towards it.
    x / absmax as x * (1 / absmax) in fp32 (torchq's rule, numerics.md section 4; the CUDA kernel's
    __fdividef may differ by an ulp)."""
    n = x.numel()
    pad = (-n) % 256
    blocks = torch.cat([x, x.new_zeros(pad)]).reshape(-1, 256)
    absmax = blocks.abs().amax(1)
    s = (blocks * (1 / absmax)[:, None]).reshape(-1)[:n].double()
    idx = (s[:, None] - code.double()[None, :]).abs().argmin(1)
    if signed:
        flipped = (torch.signbit(code[idx]) != torch.signbit(x)) & (x != 0)
        idx = torch.where(flipped & (x > 0), idx + 1, torch.where(flipped & (x < 0), idx - 1, idx))
    else:  # torchq's zero-free rule (not bitsandbytes'): a positive second moment never takes the code of 0.0
        idx = torch.where((x > 0) & (code[idx] == 0), idx + 1, idx)
    return idx.to(torch.uint8), absmax


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_8bit_states_follow_bitsandbytes_rule(backend):
    if backend == "native" and optim_native.available() is not None:
        pytest.skip(optim_native.available())
    assert torch.equal(_bnb_dynamic_map(True), FORMAT_8BIT.signed_map)
    assert torch.equal(_bnb_dynamic_map(False), FORMAT_8BIT.unsigned_map)
    n, b1, b2 = 16 * 256 + 77, 0.9, 0.999
    p = torch.nn.Parameter(torch.randn(n))
    opt = AdamW8bit([p], lr=1e-3, betas=(b1, b2), backend=backend)
    m = torch.zeros(n)
    v = torch.zeros(n)
    for step in range(3):
        g = torch.randn(n) * 10.0 ** -step
        g[:40] = -1e-9  # tiny negatives: the sign rule keeps them negative
        g[40:80] = 1e-9  # tiny second moments next to large ones: the zero-free rule keeps them above 0
        p.grad = g
        opt.step()
        m = m * b1 + g * (1 - b1)
        v = v * b2 + (g * g) * (1 - b2)
        for key, x, code, signed in (("exp_avg", m, FORMAT_8BIT.signed_map, True), ("exp_avg_sq", v, FORMAT_8BIT.unsigned_map, False)):
            codes, absmax = _bnb_quantize(x, code, signed)
            assert torch.equal(opt.state[p][key + "_absmax"], absmax)
            assert torch.equal(opt.state[p][key], codes), key
            # continue from the decoded states, as the optimizer does
            decoded = code[codes.long()] * absmax.repeat_interleave(256)[:n]
            if signed:
                m = decoded
            else:
                v = decoded
        assert (FORMAT_8BIT.signed_map[opt.state[p]["exp_avg"][:40].long()] < 0).all()
        assert (FORMAT_8BIT.unsigned_map[opt.state[p]["exp_avg_sq"][:80].long()] > 0).all()


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("cls, bound", [(AdamW8bit, 10.0), (AdamW4bit, 30.0)])
def test_heavy_tailed_gradients_stay_near_adamw(cls, bound, backend):
    """Gradients ``randn · exp(2 · randn)`` (a block's second moments span ~10 decades): 30 steps stay
    within ``bound · lr`` of torch.optim.AdamW (measured 4.6 / 17.3 lr). With nearest rounding
    alone, a small second moment decoded to 0 next to a nonzero first moment and the next step
    divided by ~eps: 98,443 lr (8-bit); the zero-free rule keeps it above 0."""
    if backend == "native" and optim_native.available() is not None:
        pytest.skip(optim_native.available())
    torch.manual_seed(0)
    n, lr = 64 * 256 + 77, 1e-3
    p0 = torch.randn(n)
    ours, ref = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt, opt_ref = cls([ours], lr=lr, weight_decay=0.01, backend=backend), torch.optim.AdamW([ref], lr=lr, weight_decay=0.01)
    worst = 0.0
    for _ in range(30):
        g = torch.randn(n) * torch.exp(2 * torch.randn(n))
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        opt_ref.step()
        worst = max(worst, float((ours - ref).detach().abs().max()) / lr)
    assert worst < bound, worst


# -- drop-in for torch.optim.AdamW ------------------------------------------------------------------
def _train(opt_factory, params, steps=5, scheduler=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = opt_factory(params)
    sched = scheduler(opt) if scheduler else None
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        if sched:
            sched.step()
    return opt


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("maximize", [False, True])
def test_small_parameters_follow_torch_adamw(cls, maximize):
    """fp32 states (< 4096 elements): torch.optim.AdamW's numbers (within an ulp or two: the same
    formula, a fixed operation order), weight decay, bias correction, two groups, a tensor lr."""
    shapes = [(17, 3), (100,), (64, 63)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    kw = dict(betas=(0.8, 0.99), eps=1e-6, maximize=maximize)
    groups = lambda ps: [{"params": ps[:2], "weight_decay": 0.5}, {"params": ps[2:], "lr": torch.tensor(3e-2)}]
    _train(lambda ps: torch.optim.AdamW(groups(ps), lr=1e-2, weight_decay=0.1, foreach=False, **kw), a)
    _train(lambda ps: cls(groups(ps), lr=1e-2, weight_decay=0.1, **kw), b)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls, tol", [(AdamW8bit, 0.05), (AdamW4bit, 0.5)])
def test_quantized_parameters_track_torch_adamw(cls, tol):
    """A noisy quadratic, 20 steps: the quantized states follow torch.optim.AdamW's path (8-bit within
    2% here; 4-bit's coarse second moment, at least absmax / 16 per block, shrinks small updates: ~30%)
    and reach the same loss."""
    start, target = torch.randn(64, 128), torch.randn(64, 128)

    def train(make):
        p = torch.nn.Parameter(start.clone())
        opt, g = make([p]), torch.Generator().manual_seed(0)
        for _ in range(20):
            p.grad = (p.detach() - target) + 0.3 * torch.randn(p.shape, generator=g)
            opt.step()
        return p.detach()

    ref, ours = train(lambda ps: torch.optim.AdamW(ps, lr=1e-2)), train(lambda ps: cls(ps, lr=1e-2))
    assert (ours - ref).norm() / (ref - start).norm() < tol
    assert (ours - target).norm() < 1.02 * (ref - target).norm()


@pytest.mark.parametrize("cls", CLASSES)
def test_lr_schedulers_and_param_groups(cls):
    p1, p2 = torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(30))
    opt = cls([p1], lr=torch.tensor(0.1))
    opt.add_param_group({"params": [p2], "lr": 0.05, "weight_decay": 0.0})
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        p1.grad, p2.grad = torch.randn(5000), torch.randn(30)
        opt.step()
        sched.step()
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.1 / 8) and opt.param_groups[1]["lr"] == pytest.approx(0.05 / 8)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    opt.zero_grad()
    assert p1.grad is None and p2.grad is None
    with pytest.raises(ValueError, match=r"param_groups\[2\]\.betas\[1\]: expected a value in \[0, 1\), got 1.5"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "betas": (0.9, 1.5)})


@pytest.mark.parametrize("cls", CLASSES)
def test_state_dict_round_trip(cls, tmp_path):
    """Stop after 3 steps, save with torch.save, load with weights_only=True into a fresh optimizer:
    the next steps are bit-equal to the uninterrupted run."""
    def params():
        g = torch.Generator().manual_seed(3)
        return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(70, 90), (33,), (4097,)]]

    def grads(step):
        g = torch.Generator().manual_seed(100 + step)
        return [torch.randn(s, generator=g) for s in [(70, 90), (33,), (4097,)]]

    a = params()
    opt_a = cls([{"params": a[:2]}, {"params": a[2:], "lr": 1e-2}], lr=1e-3)
    sched_a = torch.optim.lr_scheduler.ExponentialLR(opt_a, 0.9)
    b = params()
    opt_b = cls([{"params": b[:2]}, {"params": b[2:], "lr": 1e-2}], lr=1e-3)
    sched_b = torch.optim.lr_scheduler.ExponentialLR(opt_b, 0.9)
    for step in range(3):
        for ps, opt, sched in ((a, opt_a, sched_a), (b, opt_b, sched_b)):
            for p, g in zip(ps, grads(step)):
                p.grad = g
            opt.step()
            sched.step()
    torch.save({"opt": opt_b.state_dict(), "sched": sched_b.state_dict()}, tmp_path / "opt.pt")
    del opt_b, sched_b
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    opt_c = cls([{"params": b[:2]}, {"params": b[2:], "lr": 1e-2}], lr=1e-3)
    opt_c.load_state_dict(loaded["opt"])
    sched_c = torch.optim.lr_scheduler.ExponentialLR(opt_c, 0.9)
    sched_c.load_state_dict(loaded["sched"])
    for step in range(3, 5):
        for ps, opt, sched in ((a, opt_a, sched_a), (b, opt_c, sched_c)):
            for p, g in zip(ps, grads(step)):
                p.grad = g
            opt.step()
            sched.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for x, y in zip(a, b):
        for k, v in opt_a.state[x].items():
            assert torch.equal(v, opt_c.state[y][k]) if isinstance(v, torch.Tensor) else v == opt_c.state[y][k]
    # loading copies: stepping the loaded optimizer leaves the saved dict as it was
    again = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert all(torch.equal(loaded["opt"]["state"][0][k], again["opt"]["state"][0][k]) for k in STATE_KEYS)



# -- CUDA (run by benchmarks/gpu_suite.sh where a GPU is lent; skipped elsewhere) -----------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("cls", CLASSES)
def test_reference_takes_the_division_every_device_rounds_alike(cls, monkeypatch):
    """The reference divides by the bias correction through torchq.division (a 0-d tensor divisor
    off the CPU, where CUDA would multiply by a reciprocal); that form gives the CPU's bits here."""
    from torchq.division import divide_by_tensor
    from torchq.optim import adamw

    def run() -> tuple[torch.Tensor, dict]:
        p = torch.nn.Parameter(torch.randn(5000, generator=torch.Generator().manual_seed(2)))
        opt, g = cls([p], backend="reference", lr=1e-2), torch.Generator().manual_seed(3)
        for _ in range(4):
            p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return p.detach(), opt.state[p]

    p_cpu, s_cpu = run()
    monkeypatch.setattr(adamw, "divide", divide_by_tensor)
    p_dev, s_dev = run()
    assert torch.equal(p_cpu, p_dev) and all(torch.equal(s_cpu[k], s_dev[k]) for k in STATE_KEYS)


@needs_cuda
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_steps_equal_the_cpu_reference(cls, dtype):
    """A CUDA parameter takes the reference's torch ops (``backend="auto"``), each a correctly
    rounded fp32 operation there too (the bias correction divided, not multiplied by CUDA's
    reciprocal): after steps with gradients of every scale, its states and values are the CPU
    reference's, bit for bit."""
    g = torch.Generator().manual_seed(5)
    p0 = torch.randn(3 * 4096 + 37, generator=g).to(dtype)
    pc, pg = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone().cuda())
    oc = cls([pc], backend="reference", lr=1e-2, weight_decay=0.1)
    og = cls([pg], lr=1e-2, weight_decay=0.1)
    for scale in (1.0, 1e-3, 0.0, 10.0):
        grad = (torch.randn(p0.shape, generator=g) * scale).to(dtype)
        pc.grad, pg.grad = grad.clone(), grad.cuda()
        oc.step()
        og.step()
    assert og.state[pg]["exp_avg"].device.type == "cuda"
    differ = (pg.detach().cpu() != pc.detach()).float().mean().item()
    assert differ == 0, f"{differ:.2%} of the parameters differ from the CPU reference's"
    for k in STATE_KEYS:
        assert torch.equal(og.state[pg][k].cpu(), oc.state[pc][k]), k


@needs_cuda
@pytest.mark.parametrize("cls", CLASSES)
def test_cuda_state_dict_loads_on_the_cpu_and_back(cls, tmp_path):
    """States saved from a CUDA run load (``weights_only=True``) into an optimizer of CPU
    parameters and back onto CUDA, unchanged."""
    p = torch.nn.Parameter(torch.randn(5000, device="cuda"))
    opt = cls([p], lr=1e-3)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    saved = torch.load(tmp_path / "opt.pt", weights_only=True)
    q = torch.nn.Parameter(p.detach().cpu())
    on_cpu = cls([q], lr=1e-3)
    on_cpu.load_state_dict(saved)
    for k in STATE_KEYS:
        assert on_cpu.state[q][k].device.type == "cpu" and torch.equal(on_cpu.state[q][k], opt.state[p][k].cpu()), k
    back = cls([p], lr=1e-3)
    back.load_state_dict(on_cpu.state_dict())
    for k in STATE_KEYS:
        assert back.state[p][k].device.type == "cuda" and torch.equal(back.state[p][k], opt.state[p][k]), k

# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES)
def test_bad_arguments_are_named(cls):
    p = torch.nn.Parameter(torch.randn(10))
    with pytest.raises(ValueError, match=r"^lr: expected a learning rate >= 0, got -0.1"):
        cls([p], lr=-0.1)
    with pytest.raises(ValueError, match=r"^betas\[0\]: expected a value in \[0, 1\), got 1.0"):
        cls([p], betas=(1.0, 0.999))
    with pytest.raises(ValueError, match=r"^betas\[1\]: expected a value in \[0, 1\), got -0.5"):
        cls([p], betas=(0.9, -0.5))
    with pytest.raises(ValueError, match=r"^eps: expected eps >= 0, got -1"):
        cls([p], eps=-1.0)
    with pytest.raises(ValueError, match=r"^weight_decay: expected weight_decay >= 0, got -0.01"):
        cls([p], weight_decay=-0.01)
    with pytest.raises(ValueError, match=r"^amsgrad: expected False .* got True"):
        cls([p], amsgrad=True)
    with pytest.raises(ValueError, match=r"^capturable: expected False"):
        cls([p], capturable=True)
    with pytest.raises(ValueError, match=r"^backend: expected one of \('auto', 'native', 'reference'\), got 'cuda'"):
        cls([p], backend="cuda")
    with pytest.raises(TypeError, match=r"params \(group 0, parameter 1\): expected a floating-point parameter .* got torch.int32"):
        cls([p, torch.zeros(4096, dtype=torch.int32)])


@pytest.mark.parametrize("cls", CLASSES)
def test_quantized_weights_are_refused(cls):
    lin = torch.nn.Linear(128, 64)
    torchq.quantize_(lin, torchq.int8_weight_only())
    with pytest.raises(TypeError, match=r"params \(group 0, parameter 0\): a torchq AffineQuantizedTensor"):
        cls([lin.weight])


@pytest.mark.parametrize("cls", CLASSES)
def test_sparse_gradients_are_refused(cls):
    emb = torch.nn.Embedding(100, 64, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    opt = cls(emb.parameters())
    with pytest.raises(RuntimeError, match="sparse gradients are not supported"):
        opt.step()


def _stepped(opt_cls, p, **kw):
    opt = opt_cls([p], **kw)
    p.grad = torch.randn_like(p)
    opt.step()
    return opt


@pytest.mark.parametrize("cls", CLASSES)
def test_state_dicts_of_other_formats_are_refused(cls):
    p = torch.nn.Parameter(torch.randn(64, 128))
    torch_sd = _stepped(torch.optim.AdamW, p).state_dict()
    with pytest.raises(ValueError, match=r"state of parameter 0 has no 'state_bits': it comes from another optimizer"):
        cls([p]).load_state_dict(torch_sd)
    other = AdamW4bit if cls is AdamW8bit else AdamW8bit
    sd = _stepped(other, p).state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    want, got = cls.state_format.bits, other.state_format.bits
    with pytest.raises(ValueError, match=rf"holds {got}-bit states, {cls.__name__} expects {want}-bit states"):
        cls([p]).load_state_dict(sd)
    sd = _stepped(cls, p).state_dict()
    sd["state"][0]["exp_avg_absmax"] = sd["state"][0]["exp_avg_absmax"][:-1]
    with pytest.raises(ValueError, match=r"state 'exp_avg_absmax' of parameter 0: expected torch.float32"):
        cls([p]).load_state_dict(sd)


# -- FSDP2 --------------------------------------------------------------------------------------------
def fsdp_worker(rank: int, world: int, cls_name: str) -> dict:
    """Two-layer MLP sharded with fully_shard (uneven rows: 101); AdamW{8,4}bit with both backends
    and torch AdamW; a state-dict round trip on the sharded optimizer."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import torchq.optim as tqo

    torch.set_num_threads(1)
    cls = getattr(tqo, cls_name)

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 101), torch.nn.ReLU(), torch.nn.Linear(101, 64))
        for layer in (m[0], m[2]):
            fully_shard(layer)
        fully_shard(m)
        return m

    def run(make_opt, steps):
        model = build()
        opt = make_opt(model.parameters())
        for step in range(steps):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    full = lambda m: [p.full_tensor() for p in m.parameters()]
    m_nat, o_nat = run(lambda ps: cls(ps, lr=1e-2, backend="native" if tqo.native.available() is None else "reference"), 4)
    m_ref, _ = run(lambda ps: cls(ps, lr=1e-2, backend="reference"), 4)
    m_torch, _ = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2), 4)
    states = {k: type(v).__name__ for k, v in o_nat.state[next(iter(m_nat.parameters()))].items()}
    # round trip: 2 steps, state dict, fresh optimizer, 2 more == 4 uninterrupted
    m_a, o_a = run(lambda ps: cls(ps, lr=1e-2), 2)
    sd = o_a.state_dict()
    o_b = cls(m_a.parameters(), lr=1e-2)
    o_b.load_state_dict(sd)
    for step in range(2, 4):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        m_a(x).square().mean().backward()
        o_b.step()
        o_b.zero_grad()
    dist.barrier()
    return dict(native=full(m_nat), reference=full(m_ref), torch=full(m_torch), resumed=full(m_a), states=states,
                dtensor_states=all(isinstance(v, DTensor) for s in o_nat.state.values() for k, v in s.items() if k != "step"
                                   and isinstance(v, torch.Tensor)))


@pytest.mark.slow
@pytest.mark.parametrize("cls", CLASSES)
def test_fsdp2_sharded_parameters(cls, tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    sys.path.insert(0, str(Path(__file__).parent))
    from examples.processes import run_local

    results = run_local(fsdp_worker, 2, cls.__name__)
    r0 = results[0]
    assert r0["dtensor_states"] and r0["states"]["exp_avg"] == "DTensor"
    for r in results:
        for a, b, c, d in zip(r["native"], r["reference"], r["torch"], r0["native"]):
            assert torch.equal(a, b)  # fast path == reference, shard by shard
            assert torch.equal(a, d)  # every rank sees the same full parameters
            assert (a - c).abs().max() < 0.05  # and they stay near torch AdamW's
        for a, b in zip(r["native"], r["resumed"]):
            assert torch.equal(a, b)
