"""torchq.optim.AdamW8bit against bitsandbytes.optim.AdamW8bit on the CPU, bit for bit.

bitsandbytes (0.50.2 checked) steps CPU parameters with ``_optimizer_update_8bit_blockwise_cpu``: torch
eager ops in fp32, then its C++ ``quantize_blockwise``. Identical to torchq: the two maps, the
block (256), the absmax rule (max |updated value| per block, fp32), decoding (``map[code] *
absmax``), ``min_8bit_size`` 4096, step counting, the fp32 scalars, weight decay before the Adam
step. Different, each pinned exactly below:

1. The encoder. bitsandbytes' CPU ``quantize_blockwise`` does not take the map value nearest
   ``x / absmax``: it snaps ``x / absmax`` to a 65536-point uniform grid over [-1, 1] (a lookup
   table; 0 is not a grid point) and takes the map value nearest the grid point, with no sign
   rule. torchq takes the nearest map value itself, plus the sign rule (exp_avg) and its zero-free
   rule (exp_avg_sq: a positive value never takes the code of 0.0).
2. The fp32 rounding of the update (same formula, same scalars): bitsandbytes' ``add_(alpha=)``
   and ``addcmul_`` fuse a multiply-add, its ``sqrt`` is torch's fp32 one (not correctly rounded),
   and ``addcdiv_`` scales ``m`` before dividing.

Both optimizers are rebuilt from one skeleton (decode with the shared decoder, update, encode)
with those two parts swapped, and each must equal its rebuild bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from torchq.optim import FORMAT_8BIT, AdamW8bit
from torchq.optim.formats import dequantize_state, quantize_state

bnb = pytest.importorskip("bitsandbytes")

SIGNED, UNSIGNED = FORMAT_8BIT.signed_map, FORMAT_8BIT.unsigned_map
GRID = 65536  # bitsandbytes' CPU lookup table: grid point i is -1 + 2 i / 65535
INF = torch.tensor(float("inf"))
SETTINGS = [  # lr, betas, eps, weight_decay
    (1e-3, (0.9, 0.999), 1e-8, 1e-2),
    (3e-3, (0.8, 0.99), 1e-6, 0.0),
]


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern (so -0.0 != 0.0 and NaN == NaN)."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _steps_ok(p: torch.Tensor) -> None:
    """Skip where this bitsandbytes cannot step a CPU parameter."""
    opt = bnb.optim.AdamW8bit([p], min_8bit_size=4096)
    p.grad = torch.zeros_like(p)
    try:
        opt.step()
    except (RuntimeError, NotImplementedError) as e:  # builds without the CPU optimizer kernels
        pytest.skip(f"bitsandbytes' AdamW8bit does not step {p.dtype} CPU parameters here: {e}")


# -- the two encoders --------------------------------------------------------------------------------
def _absmax(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    return torch.cat([x, x.new_zeros(-n % 256)]).reshape(-1, 256).abs().amax(1)


def _grid_codes(x: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' CPU quantize_blockwise (csrc/cpu_ops.cpp, quantize_cpu_impl), in fp32: a
    table of the map index nearest each grid point (midpoints ``0.5 * (c[i] + c[i + 1])``, a tie
    to the lower), indexed by ``(uint16)((clamp(x * (1 / absmax), -1, 1) + 1) * 0.5 * 65535 + 0.5)``;
    an all-zero block gets code 0."""
    n = x.numel()
    absmax = _absmax(x)
    s = (torch.cat([x, x.new_zeros(-n % 256)]).reshape(-1, 256) * (1.0 / absmax)[:, None]).reshape(-1)[:n]
    points = -1.0 + (2.0 * torch.arange(GRID, dtype=torch.float32)) / (GRID - 1)
    table = torch.searchsorted((code[:-1] + code[1:]) * 0.5, points, side="left")
    index = ((s.clamp(-1, 1) + 1.0) * 0.5 * (GRID - 1) + 0.5).to(torch.int64)  # truncation, as the C++ cast
    zero_block = absmax.repeat_interleave(256)[:n] == 0
    return torch.where(zero_block, 0, table[index.clamp(0, GRID - 1)]).to(torch.uint8), absmax


def _nearest_codes(x: torch.Tensor, code: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torchq's encoder as docs/optim.md writes it: the nearest map value to ``x * (1 / absmax)``
    (exact midpoints, a tie to the lower), the sign rule for exp_avg and the zero-free rule for exp_avg_sq."""
    n = x.numel()
    absmax = _absmax(x)
    s = (torch.cat([x, x.new_zeros(-n % 256)]).reshape(-1, 256) * (1.0 / absmax)[:, None]).reshape(-1)[:n]
    s = torch.where(absmax.repeat_interleave(256)[:n] == 0, 0.0, s)
    mids = ((code.double()[:-1] + code.double()[1:]) / 2).float()
    idx = torch.searchsorted(mids, s, side="left")
    if signed:
        zero = int(torch.nonzero(code == 0)[0, 0])
        idx = torch.where((x < 0) & (idx == zero), zero - 1, idx)
    else:
        idx = torch.where((x > 0) & (code[idx] == 0), idx + 1, idx)
    return idx.to(torch.uint8), absmax


# -- the two update orders ---------------------------------------------------------------------------
def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once: the product is exact in fp64, TwoSum gives the sum's exact
    error, which decides the fp32 rounding where the fp64 sum sits on an fp32 midpoint."""
    prod, cd = a.double() * b.double(), c.double()
    s = prod + cd
    bv = s - prod
    err = (prod - (s - bv)) + (cd - bv)
    r = s.float()
    up, down = torch.nextafter(r, INF), torch.nextafter(r, -INF)
    r = torch.where((err > 0) & ((r.double() + up.double()) / 2 == s), up, r)
    return torch.where((err < 0) & ((r.double() + down.double()) / 2 == s), down, r)


def _torch_kernels_round_as_modelled() -> str | None:
    """None when this torch's fp32 CPU kernels round as bitsandbytes' rebuild assumes (its vector
    kernels fuse ``add_(alpha=)`` and ``addcmul_``: AVX2 / AVX-512 builds), else what differs."""
    gen = torch.Generator().manual_seed(5)
    a, b, d = (torch.randn(4099, generator=gen) for _ in range(3))
    c = _f32(0.1)
    if not torch.equal(a.clone().add_(b, alpha=0.1), _fma32(b, c.expand_as(b), a)):
        return "add_(alpha=) is not one fused multiply-add"
    if not torch.equal(a.clone().addcmul_(b, b, value=0.1), _fma32(c * b, b, a)):
        return "addcmul_ is not fma(value * t1, t2, self)"
    if not torch.equal(a.clone().addcdiv_(b, d, value=0.1), a + (c * b) / d):
        return "addcdiv_ is not self + (value * t1) / t2"
    return None


needs_modelled_kernels = pytest.mark.skipif(_torch_kernels_round_as_modelled() is not None,
                                            reason=f"torch's CPU kernels: {_torch_kernels_round_as_modelled()}")

BNB_ORDER = dict(fused_m=True, fused_v=True, torch_sqrt=True, scale_first=True)
TORCHQ_ORDER = dict(fused_m=False, fused_v=False, torch_sqrt=False, scale_first=False)


def _update(p, g, m, v, lr, betas, eps, wd, step, *, fused_m, fused_v, torch_sqrt, scale_first):
    """One AdamW step in fp32 (flat fp32 tensors in, ``(p, m, v)`` out), the formula of
    docs/optim.md with the scalars rounded once to fp32; the flags pick each rounding:

    * ``fused_m``: ``m = fma(g, 1 - b1, m * b1)`` (torch's ``add_(alpha=)``), else two roundings;
    * ``fused_v``: ``v = fma((1 - b2) * g, g, v * b2)`` (torch's ``addcmul_``), else
      ``v * b2 + (g * g) * (1 - b2)``;
    * ``torch_sqrt``: torch's fp32 ``sqrt``, else the correctly rounded one;
    * ``scale_first``: ``p + ((-step_size) * m) / denom`` (torch's ``addcdiv_``), else
      ``p - (m / denom) * step_size``."""
    b1, b2 = betas
    m_b1, v_b2 = m * _f32(b1), v * _f32(b2)
    m = _fma32(g, _f32(1 - b1).expand_as(g), m_b1) if fused_m else m_b1 + g * _f32(1 - b1)
    v = _fma32(g * _f32(1 - b2), g, v_b2) if fused_v else v_b2 + (g * g) * _f32(1 - b2)
    root = v.sqrt() if torch_sqrt else v.double().sqrt().float()
    denom = root / _f32(math.sqrt(1 - b2**step)) + _f32(eps)
    p = p * _f32(1 - lr * wd)
    step_size = _f32(lr / (1 - b1**step))
    p = p + (-step_size * m) / denom if scale_first else p - (m / denom) * step_size
    return p, m, v


def _skeleton_step(p, g, state, setting, step, order, encoder):
    """Decode (the shared decoder), update in ``order``, encode with ``encoder``: the new
    parameter (p's dtype) and ``(codes1, absmax1, codes2, absmax2)``."""
    lr, betas, eps, wd = setting
    n = p.numel()
    c1, a1, c2, a2 = state
    m = dequantize_state(c1, a1, n, FORMAT_8BIT, signed=True)
    v = dequantize_state(c2, a2, n, FORMAT_8BIT, signed=False)
    new_p, m, v = _update(p.reshape(-1).float(), g.reshape(-1).float(), m, v, lr, betas, eps, wd, step, **order)
    if encoder == "grid":
        (q1, am1), (q2, am2) = _grid_codes(m, SIGNED), _grid_codes(v, UNSIGNED)
    else:
        (q1, am1), (q2, am2) = _nearest_codes(m, SIGNED, True), _nearest_codes(v, UNSIGNED, False)
    return new_p.to(p.dtype).view(p.shape), (q1.view(p.shape), am1, q2.view(p.shape), am2)


def _pair(shape, dtype, setting, seed=0):
    lr, betas, eps, wd = setting
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    pb, pt = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    ob = bnb.optim.AdamW8bit([pb], lr=lr, betas=betas, eps=eps, weight_decay=wd, min_8bit_size=4096)
    ot = AdamW8bit([pt], lr=lr, betas=betas, eps=eps, weight_decay=wd, min_quantized_numel=4096)
    return (pb, ob), (pt, ot)


def _grad(shape, dtype, gen):
    """Heavy-tailed gradients (|g| over ~6 decades), some exact zeros and tiny negatives."""
    g = torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape, generator=gen))
    g.view(-1)[:50] = 0.0
    g.view(-1)[50:90] = -1e-12
    return g.to(dtype)


def _bnb_state(opt, p):
    s = opt.state[p]
    return s["state1"], s["absmax1"], s["state2"], s["absmax2"]


def _tq_state(opt, p):
    s = opt.state[p]
    return s["exp_avg"], s["exp_avg_absmax"], s["exp_avg_sq"], s["exp_avg_sq_absmax"]


def _torchq_state_dict_from_bnb(opt_bnb, p_bnb, opt_tq) -> dict:
    """A torchq AdamW8bit state dict holding bitsandbytes' states (same maps, block and decoding:
    codes and absmax carry over unchanged); ``opt_tq``'s param groups."""
    s = opt_bnb.state[p_bnb]
    state = {"step": torch.tensor(float(s["step"])), "state_bits": 8, "exp_avg": s["state1"].clone(),
             "exp_avg_absmax": s["absmax1"].clone(), "exp_avg_sq": s["state2"].clone(), "exp_avg_sq_absmax": s["absmax2"].clone()}
    groups = opt_tq.state_dict()["param_groups"]
    return {"state": {0: state}, "param_groups": groups}


# -- identical ---------------------------------------------------------------------------------------
def test_maps_block_absmax_layout_and_decoding_are_identical():
    n = 16 * 256 + 77  # a partial last block
    p = torch.nn.Parameter(torch.randn(n))
    _steps_ok(p)
    opt = bnb.optim.AdamW8bit([p], min_8bit_size=4096)
    p.grad = torch.randn(n)
    opt.step()
    s = opt.state[p]
    assert _same_bits(s["qmap1"], SIGNED) and _same_bits(s["qmap2"], UNSIGNED)
    for codes, absmax in ((s["state1"], s["absmax1"]), (s["state2"], s["absmax2"])):
        assert codes.dtype == torch.uint8 and codes.shape == p.shape
        assert absmax.dtype == torch.float32 and absmax.shape == (FORMAT_8BIT.blocks(n),)
    # every code under random absmax decodes to the same bits with bitsandbytes' dequantize and torchq's
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    codes[:256] = torch.arange(256, dtype=torch.uint8)
    absmax = torch.rand(FORMAT_8BIT.blocks(n), generator=gen) * 10.0 ** torch.randint(-12, 3, (FORMAT_8BIT.blocks(n),), generator=gen)
    for code, signed in ((SIGNED, True), (UNSIGNED, False)):
        theirs = bnb.functional.dequantize_blockwise(codes, absmax=absmax, code=code, blocksize=256)
        ours = dequantize_state(codes, absmax, n, FORMAT_8BIT, signed)
        assert _same_bits(theirs, ours)
    # fresh states decode to zero in both (bitsandbytes: code 0 = -1.0 times absmax 0 = -0.0)
    q = torch.nn.Parameter(torch.randn(n))
    fresh = bnb.optim.AdamW8bit([q], min_8bit_size=4096)
    fresh.init_state(fresh.param_groups[0], q, 0, 0)
    c1, a1, c2, a2 = _bnb_state(fresh, q)
    assert torch.equal(bnb.functional.dequantize_blockwise(c1, absmax=a1, code=SIGNED, blocksize=256), torch.zeros(n))
    assert torch.equal(bnb.functional.dequantize_blockwise(c2, absmax=a2, code=UNSIGNED, blocksize=256), torch.zeros(n))


@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg", "exp_avg_sq"])
def test_encoder_absmax_identical_codes_snap_to_a_grid(signed):
    """Same fp32 input to both encoders: absmax bit-identical; bitsandbytes' codes are exactly the
    grid rule, torchq's exactly the nearest-value rule; the consequences docs/optim.md states."""
    code = SIGNED if signed else UNSIGNED
    gen = torch.Generator().manual_seed(2)
    n = 40 * 256 + 77
    x = torch.randn(n, generator=gen) * torch.exp(3 * torch.randn(n, generator=gen))
    x = x if signed else x * x
    x[256:512] = 0.0  # an all-zero block
    x[600:640] = 0.0
    if signed:
        x[640:680] = -1e-12 * x[512:768].abs().max()
    theirs, theirs_absmax = torch.ops.bitsandbytes.quantize_blockwise(x, code, 256)
    ours, ours_absmax = quantize_state(x, FORMAT_8BIT, signed)
    assert _same_bits(theirs_absmax, ours_absmax)
    assert torch.equal(theirs, _grid_codes(x, code)[0])
    assert torch.equal(ours, _nearest_codes(x, code, signed)[0])
    assert (theirs != ours).any()
    theirs_codes = theirs

    # a dense sweep of x / absmax over [-1, 1]: the codes bitsandbytes' CPU encoder never emits
    sweep = torch.cat([torch.linspace(-1, 1, 1 << 18), torch.linspace(-2e-4, 2e-4, 1 << 14)])
    sweep = sweep if signed else sweep.abs()
    rows = -(-sweep.numel() // 255)
    sweep = torch.cat([torch.ones(rows, 1), torch.cat([sweep, sweep.new_zeros(rows * 255 - sweep.numel())]).view(rows, 255)], 1)
    sweep = sweep.reshape(-1)  # a 1.0 in every block: absmax 1, codes of x itself
    emitted = set(torch.ops.bitsandbytes.quantize_blockwise(sweep, code, 256)[0].unique().tolist())
    never = set(range(256)) - emitted
    small = [i for i in range(256) if abs(code[i].item()) < 1e-4]
    if signed:
        assert never == set(range(124, 131))  # |value| <= 7.75e-6, zero included
    else:
        assert never == {0, 1, 2, 3, 4, 5, 6, 8, 9, 11, 13}  # |value| <= 8.3e-5 but 1.5625e-5 (code 7): 0 only in all-zero blocks
    assert never <= set(small) and set(quantize_state(sweep, FORMAT_8BIT, signed)[0].unique().tolist()) >= never

    # 1, 0, -1e-9, -1e-6, 1e-6 of absmax: bitsandbytes' encoder snaps the small ones to the grid points
    # +-1.526e-5, whose nearest map values are +-2.125e-5 (signed: codes 131 / 123) and 1.5625e-5
    # (unsigned: code 7); torchq keeps 0, by the sign rule the sign of -1e-9 (-5.5e-7: code 126), and by
    # the zero-free rule a positive 1e-9 above 0 (3.25e-7: code 1)
    probe = torch.tensor([1.0, 0.0, -1e-9, -1e-6, 1e-6] + [0.0] * 251)
    probe = probe if signed else probe.abs()
    theirs_probe = torch.ops.bitsandbytes.quantize_blockwise(probe, code, 256)[0][:5].tolist()
    ours_probe = quantize_state(probe, FORMAT_8BIT, signed)[0][:5].tolist()
    assert theirs_probe == ([255, 131, 131, 123, 131] if signed else [255, 7, 7, 7, 7])  # -1e-9 turns positive
    assert ours_probe == ([255, 127, 126, 126, 128] if signed else [255, 0, 1, 2, 2])

    # every interval of the map narrower than the grid step lies below 1e-4: where |x / absmax| >= 1e-4
    # the snap (at most half a step) crosses at most one midpoint, so the codes differ by at most one
    narrow = (code[1:] - code[:-1]) < 2 / (GRID - 1)
    assert torch.maximum(code[1:].abs(), code[:-1].abs())[narrow].max() < 1e-4
    block_absmax = ours_absmax.repeat_interleave(256)[:n]
    big = (x.abs() >= 1e-4 * block_absmax) & (block_absmax > 0)
    assert (theirs_codes[~big & (block_absmax > 0)] != ours[~big & (block_absmax > 0)]).any()
    # an all-zero block: code 0 in bitsandbytes (signed: -1.0 * 0 = -0.0), the code of 0.0 in torchq
    zero_block = slice(256, 512)
    assert (theirs_codes[zero_block] == 0).all() and (code[ours[zero_block].long()] == 0).all()
    assert (theirs_codes[big].int() - ours[big].int()).abs().max() == 1


# -- the optimizers, rebuilt -------------------------------------------------------------------------
@needs_modelled_kernels
@pytest.mark.parametrize("setting", SETTINGS, ids=["lr1e-3-wd0.01", "lr3e-3-betas0.8,0.99-eps1e-6-wd0"])
@pytest.mark.parametrize("shape", [(16 * 256 + 77,), (65, 67), (4096,)], ids=["4173", "65x67", "4096"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_optimizers_are_one_skeleton_with_two_parts_swapped(dtype, shape, setting):
    """Free-running for 6 steps: bitsandbytes' parameters, codes and absmax equal, bit for bit, the
    shared skeleton with the grid encoder and bitsandbytes' rounding; torchq's equal it with the
    nearest encoder and torchq's rounding. Nothing else differs."""
    (pb, ob), (pt, ot) = _pair(shape, dtype, setting)
    _steps_ok(torch.nn.Parameter(torch.randn(4096).to(dtype)))
    zero = torch.zeros(FORMAT_8BIT.blocks(pb.numel()))
    rebuilt = {"bnb": (pb.detach().clone(), (None, zero, None, zero)), "torchq": (pt.detach().clone(), (None, zero, None, zero))}
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 7):
        g = _grad(shape, dtype, gen)
        pb.grad, pt.grad = g.clone(), g.clone()
        ob.step()
        ot.step()
        assert ob.state[pb]["step"] == step and ot.state[pt]["step"].item() == step
        for name, p, state, order, encoder in (("bnb", pb, _bnb_state(ob, pb), BNB_ORDER, "grid"),
                                               ("torchq", pt, _tq_state(ot, pt), TORCHQ_ORDER, "nearest")):
            p_prev, s_prev = rebuilt[name]
            if step == 1:  # fresh states: any codes with absmax 0 decode to (+-)0
                s_prev = (state[0].new_zeros(state[0].shape), zero, state[2].new_zeros(state[2].shape), zero)
            new_p, new_s = _skeleton_step(p_prev, g, s_prev, setting, step, order, encoder)
            assert _same_bits(p.detach(), new_p), (name, step, "parameter")
            for key, ours, theirs in zip(("codes1", "absmax1", "codes2", "absmax2"), new_s, state, strict=True):
                assert _same_bits(theirs, ours), (name, step, key)
            rebuilt[name] = (new_p, new_s)


@needs_modelled_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_from_identical_states_each_rounding_difference_is_needed(dtype):
    """Lockstep: before each step torchq is given bitsandbytes' parameter and states (a torchq state
    dict holding bitsandbytes' codes and absmax unchanged). Then (a) both decode the same values,
    (b) the new absmax and codes are what each encoder makes of each update's moments, (c) the
    parameters are each rounding order's; each of the four rounding differences changes something,
    so none of them is superfluous, and with all four swapped the orders agree bit for bit."""
    setting = SETTINGS[0]
    shape = (64 * 256 + 77,)
    (pb, ob), (pt, ot) = _pair(shape, dtype, setting)
    _steps_ok(torch.nn.Parameter(torch.randn(4096).to(dtype)))
    n = pb.numel()
    gen = torch.Generator().manual_seed(4)
    needed = {flag: False for flag in BNB_ORDER}
    for step in range(1, 6):
        if step > 1:
            ot.load_state_dict(_torchq_state_dict_from_bnb(ob, pb, ot))
            with torch.no_grad():
                pt.copy_(pb)
            sb = tuple(t.clone() for t in _bnb_state(ob, pb))
            st = _tq_state(ot, pt)
            # (a) the same codes and absmax decode to the same bits
            for (cb, ab, ct, at), signed in (((sb[0], sb[1], st[0], st[1]), True), ((sb[2], sb[3], st[2], st[3]), False)):
                code = SIGNED if signed else UNSIGNED
                assert _same_bits(bnb.functional.dequantize_blockwise(cb, absmax=ab, code=code, blocksize=256).reshape(-1),
                                  dequantize_state(ct, at, n, FORMAT_8BIT, signed))
        p0 = pb.detach().reshape(-1).float().clone()
        if step == 1:  # fresh states decode to zero in both
            m0 = v0 = torch.zeros(n)
        else:
            m0 = dequantize_state(sb[0], sb[1], n, FORMAT_8BIT, True)
            v0 = dequantize_state(sb[2], sb[3], n, FORMAT_8BIT, False)
        g = _grad(shape, dtype, gen)
        pb.grad, pt.grad = g.clone(), g.clone()
        ob.step()
        ot.step()
        lr, betas, eps, wd = setting
        gf = g.reshape(-1).float()
        for name, p, state, order, encode in (
                ("bnb", pb, _bnb_state(ob, pb), BNB_ORDER, lambda x, signed: _grid_codes(x, SIGNED if signed else UNSIGNED)),
                ("torchq", pt, _tq_state(ot, pt), TORCHQ_ORDER, lambda x, signed: quantize_state(x, FORMAT_8BIT, signed))):
            new_p, m, v = _update(p0, gf, m0, v0, lr, betas, eps, wd, step, **order)
            # (c) the parameters
            assert _same_bits(p.detach().reshape(-1), new_p.to(dtype)), (name, step)
            # (b) absmax and codes: each encoder applied to its own order's moments
            for (codes, absmax), x, signed in (((state[0], state[1]), m, True), ((state[2], state[3]), v, False)):
                want_codes, want_absmax = encode(x, signed)
                assert _same_bits(absmax, want_absmax) and torch.equal(codes.reshape(-1), want_codes), (name, step, signed)
        if step == 1:  # from zero states m = g * (1 - b1) is one rounding in both: exp_avg's absmax agrees
            assert _same_bits(ob.state[pb]["absmax1"], ot.state[pt]["exp_avg_absmax"])
        # each rounding difference alone changes the fp32 update (parameter, m or v) on this data
        bnb_out = _update(p0, gf, m0, v0, lr, betas, eps, wd, step, **BNB_ORDER)
        for flag in BNB_ORDER:
            flipped = _update(p0, gf, m0, v0, lr, betas, eps, wd, step, **{**BNB_ORDER, flag: False})
            needed[flag] |= not all(_same_bits(a, b) for a, b in zip(flipped, bnb_out, strict=True))
    assert all(needed.values()), needed


def test_a_bitsandbytes_state_dict_is_refused():
    p = torch.nn.Parameter(torch.randn(64, 128))
    _steps_ok(torch.nn.Parameter(torch.randn(4096)))
    theirs = bnb.optim.AdamW8bit([p], min_8bit_size=4096)
    p.grad = torch.randn_like(p)
    theirs.step()
    sd = theirs.state_dict()
    with pytest.raises(ValueError, match=r"state of parameter 0 has no 'state_bits': it comes from another optimizer.*"
                                         r"AdamW8bit expects 8-bit states"):
        AdamW8bit([p]).load_state_dict(sd)


def _side_by_side() -> None:
    """The numbers of docs/optim.md's "bitsandbytes' AdamW8bit, side by side": both optimizers and
    torch.optim.AdamW free-running on one 16461-element fp32 parameter, lr 1e-3, weight decay 0.01,
    gradients ``randn * exp(sigma * randn)`` (sigma: how many decades one block's gradients span)."""
    n = 64 * 256 + 77
    print("sigma | codes equal after 1 / 30 steps (exp_avg, exp_avg_sq) | max |p - p_AdamW| / lr, 30 steps: torchq, bitsandbytes")
    for sigma in (0.0, 1.0, 1.5, 2.0):
        gen = torch.Generator().manual_seed(0)
        p0 = torch.randn(n, generator=gen)
        ps = [torch.nn.Parameter(p0.clone()) for _ in range(3)]
        opts = [AdamW8bit([ps[0]], lr=1e-3, weight_decay=0.01), bnb.optim.AdamW8bit([ps[1]], lr=1e-3, weight_decay=0.01),
                torch.optim.AdamW([ps[2]], lr=1e-3, weight_decay=0.01)]
        worst, equal = [0.0, 0.0], []
        for step in range(1, 31):
            g = torch.randn(n, generator=gen) * torch.exp(sigma * torch.randn(n, generator=gen))
            for p, opt in zip(ps, opts, strict=True):
                p.grad = g.clone()
                opt.step()
            worst = [max(w, (p - ps[2]).abs().max().item() / 1e-3) for w, p in zip(worst, ps[:2], strict=True)]
            if step in (1, 30):
                st, sb = _tq_state(opts[0], ps[0]), _bnb_state(opts[1], ps[1])
                equal.append(f"{(st[0] == sb[0]).float().mean():.1%}, {(st[2] == sb[2]).float().mean():.1%}")
        print(f"{sigma} | {' / '.join(equal)} | {worst[0]:.2f}, {worst[1]:.2f}")


if __name__ == "__main__":  # python tests/test_optim_bnb.py
    _side_by_side()
