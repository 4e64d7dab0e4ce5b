"""Quantized weights under torch.distributed: row parts, the sharding ops, FSDP2's all-gather
extension, tensor parallelism, distributed checkpoints and sharded single-file loads.

The multi-process tests spawn 2 and 4 gloo processes on the CPU (the NCCL variants run when
there are enough CUDA devices) from :mod:`distributed_workers`."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import torchq
from torchq import AffineQuantizedTensor
from torchq.canonical import PlainForm, QuantSpec
from torchq.distributed import checkpoint as tqdcp
from torchq.distributed.fsdp import post_all_gather, pre_all_gather
from torchq.distributed.rows import from_row_parts, to_row_parts, zero_plain
from torchq.primitives import ZeroPointDomain

sys.path.insert(0, str(Path(__file__).parent))
import distributed_workers as dw  # noqa: E402

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

NCCL = torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()

FORMATS = [
    QuantSpec((1, 32), 0, 15, ZeroPointDomain.FLOAT),  # int4 asymmetric, float zero (tinygemm)
    QuantSpec((1, 16), -8, 7, ZeroPointDomain.NONE),  # int4 symmetric
    QuantSpec((1, 32), 0, 7, ZeroPointDomain.INT),  # 3-bit with integer zero points
    QuantSpec((1, 24), -128, 127, ZeroPointDomain.NONE),  # int8 groups
    QuantSpec((1, 64), 0, 15, ZeroPointDomain.NONE, codebook="nf4"),
    QuantSpec((1, 64), 0, 15, ZeroPointDomain.NONE, codebook="fp4", double_quant=True),
    QuantSpec((1, 32), 0, 255, ZeroPointDomain.NONE, codebook="e4m3fn"),  # float8 bytes
]


ROW_FORMATS = [  # one block per row (a per-row scale): these split along K anywhere
    QuantSpec((1, 40), -128, 127, ZeroPointDomain.NONE),  # int8 per channel
    QuantSpec((1, 40), 0, 15, ZeroPointDomain.INT),  # intx per channel, an integer zero point per row
    QuantSpec((1, 40), 0, 15, ZeroPointDomain.FLOAT),  # a float zero point per row
    QuantSpec((1, 40), 0, 255, ZeroPointDomain.NONE, codebook="e4m3fn"),  # float8 per row
]


def _weight(spec: QuantSpec, shape, scale_dtype=torch.float32, seed=0) -> AffineQuantizedTensor:
    if spec.codebook is not None:
        scale_dtype = torch.float32
    return AffineQuantizedTensor.from_plain(PlainForm.example(spec, shape, scale_dtype, seed=seed), torch.float32)


def _values_equal(a: PlainForm, b: PlainForm) -> bool:
    return (torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
            and (a.zero_point is None) == (b.zero_point is None)
            and (a.zero_point is None or torch.equal(a.zero_point, b.zero_point)))


# -- row parts -----------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(spec=st.sampled_from(FORMATS), n=st.integers(1, 19), groups=st.integers(1, 4), seed=st.integers(0, 2**16),
       bf16=st.booleans())
def test_row_parts_round_trip_any_row_range(spec, n, groups, seed, bf16):
    """Row parts decode to the same codes, scales and zero points, and cutting the parts at any
    row range gives the parts of that row range of the weight (blocks are never split)."""
    k = spec.block_size[1] * groups
    scale_dtype = torch.bfloat16 if bf16 else torch.float32
    w = _weight(spec, (n, k), scale_dtype, seed)
    plain = w.to_plain()
    fmt, parts = to_row_parts(plain)
    assert fmt.row_bytes() * n == sum(p.numel() * p.element_size() for p in parts)
    assert _values_equal(from_row_parts(fmt, parts), plain)
    lo = seed % n
    hi = lo + 1 + (seed // 7) % (n - lo)
    cut = from_row_parts(fmt, [p[lo:hi] for p in parts])
    assert _values_equal(cut, plain.narrow(0, lo, hi - lo))


def test_row_parts_codes_out_of_range_are_an_error():
    spec = QuantSpec((1, 32), 0, 7, ZeroPointDomain.INT)  # 3-bit: a packed value of 7+ cannot come from it... 8 can
    fmt, parts = to_row_parts(_weight(spec, (4, 32)).to_plain())
    bad = [p.clone() for p in parts]
    bad[0].fill_(0xFF)  # every 3-bit field 7: in range
    from_row_parts(fmt, bad)
    spec8 = QuantSpec((1, 32), -100, 100, ZeroPointDomain.NONE)
    fmt8, parts8 = to_row_parts(_weight(spec8, (4, 32)).to_plain())
    bad8 = [p.clone() for p in parts8]
    bad8[0][0, 0] = 127
    with pytest.raises(ValueError, match=r"codes outside \[-100, 100\]"):
        from_row_parts(fmt8, bad8)
    with pytest.raises(ValueError, match="scale: expected"):
        from_row_parts(fmt8, [parts8[0], parts8[1][:, :0]])


def test_blocks_spanning_rows_cannot_be_row_sharded():
    spec = QuantSpec((4, 32), -8, 7, ZeroPointDomain.NONE)
    w = _weight(spec, (8, 64))
    with pytest.raises(ValueError, match="blocks span 4 rows"):
        to_row_parts(w.to_plain(), "quantized weight 'x'")
    with pytest.raises(ValueError, match="multiples of 4"):
        torch.chunk(w, 3, dim=0)


@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: s.describe())
def test_zero_plain_dequantizes_to_zero(spec):
    z = zero_plain(spec, (3, spec.block_size[1] * 2), torch.float32,
                   None if spec.zero_point_domain is ZeroPointDomain.NONE else
                   (torch.float32 if spec.zero_point_domain is ZeroPointDomain.FLOAT else torch.uint8), "cpu")
    assert not z.spec.double_quant
    assert torch.equal(z.dequantize(), torch.zeros(3, spec.block_size[1] * 2))


# -- sharding ops ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["int4-g32", "int8wo", "nf4-single", "intx3-g32", "fp8wo", "fp8dq-row"])
@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_chunk_of_a_quantized_weight_is_the_quantized_chunk(name, world):
    """torch.chunk (FSDP2's and DTensor's cut) of a quantized weight along rows gives each piece
    exactly as quantizing that piece of the float weight would, in a layout that holds it
    (double-quantized scales are the exception: their statistics span the whole weight, so a
    piece holds the fp32 scales they stand for; the hypothesis tests above cover those)."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 10)
    w_float = lin.weight.detach().clone()
    torchq.quantize_(lin, dw.config(name))
    pieces = torch.chunk(lin.weight, world, dim=0)
    assert [p.shape[0] for p in pieces] == [p.shape[0] for p in torch.chunk(w_float, world, dim=0)]
    for piece, fpiece in zip(pieces, torch.chunk(w_float, world, dim=0)):
        q = nn.Linear(128, fpiece.shape[0], bias=False)
        q.weight.data.copy_(fpiece)
        torchq.quantize_(nn.Sequential(q), dw.config(name))
        assert isinstance(piece, AffineQuantizedTensor)
        assert _values_equal(piece.to_plain(), q.weight.to_plain())


def test_new_zeros_empty_view_and_as_strided():
    w = _weight(FORMATS[0], (6, 64))
    z = w.new_zeros((9, 64))
    assert isinstance(z, AffineQuantizedTensor) and z.shape == (9, 64) and z.spec == w.spec
    assert torch.equal(z.dequantize(), torch.zeros(9, 64))
    e = w.new_empty(0)
    assert e.shape == (0, 64)
    assert w.view(6, 64) is not w and w.view(6, 64).shape == w.shape
    with pytest.raises(NotImplementedError, match=r"view\(\[-1\]\)"):
        w.view(-1)  # no 1-D form (FSDP2 alone gets its 2-D alias as a handle)
    assert torch.as_strided(w, (6, 64), (64, 1), 0).shape == (6, 64)
    narrow = w.new_zeros((6, 32))  # fewer columns: whole groups of zeros (an empty column shard's form)
    assert narrow.spec == w.spec and torch.equal(narrow.dequantize(), torch.zeros(6, 32))
    assert w.new_zeros((6, 0)).shape == (6, 0)
    with pytest.raises(NotImplementedError, match=r"new_zeros\(\[2, 3, 4\]\).*2-D"):
        w.new_zeros((2, 3, 4))
    with pytest.raises(NotImplementedError, match=r"view\(\[3, 128\]\)"):
        w.view(3, 128)
    with pytest.raises(NotImplementedError, match="as_strided"):
        torch.as_strided(w, (3, 64), (64, 1), 0)
    assert not w.is_pinned()


def test_narrow_copy_into_padded_rows():
    """FSDP2's padding sequence: new_zeros(padded).narrow(0, 0, n).copy_(shard)."""
    w = _weight(FORMATS[4], (10, 128))
    shard = torch.chunk(w, 4, dim=0)[3]  # 1 row
    padded = w.new_zeros((3, 128))
    padded.narrow(0, 0, 1).copy_(shard)
    got = padded.to_plain()
    assert _values_equal(got.narrow(0, 0, 1), shard.to_plain())
    assert torch.equal(got.narrow(0, 1, 2).dequantize(), torch.zeros(2, 128))


def test_collectives_that_cannot_move_quantized_weights_name_the_way_out():
    """Scatter and broadcast move quantized weights (below); a reduction or a gather of packed codes has
    no meaning: the error names the collectives that work and the ways out."""
    w = _weight(FORMATS[0], (4, 32))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for call in (lambda: dist.all_reduce(w), lambda: dist.all_gather([w.new_zeros((4, 32))], w)):
            with pytest.raises(NotImplementedError, match=r"(?s)does not move quantized weights.*Supported: scatter and "
                                                          r"broadcast.*torchq.distributed.checkpoint.*dequantize\(\)"):
                call()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("spec", FORMATS + ROW_FORMATS, ids=lambda s: s.describe())
def test_scatter_and_broadcast_on_one_process(spec):
    """distribute_tensor's default (src_data_rank=0) on a one-rank group: Shard(0) and Shard(1) go
    through torch.chunk, empty_like and the c10d scatter; Replicate through the broadcast. The shard
    is bit for bit the weight, in its layout (double-quantized scales stay double-quantized)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    w = _weight(spec, (12, spec.block_size[1] * (1 if spec in ROW_FORMATS else 2)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for placement in (Shard(0), Shard(1), Replicate()):
            d = distribute_tensor(w, mesh, [placement])
            assert d.to_local() is not w
            assert d.to_local().to_plain().equal(w.to_plain()), placement
            assert d.to_local().tensor_impl.metadata() == w.tensor_impl.metadata(), placement
        out = torch.empty_like(w)
        assert torch.equal(out.dequantize(), torch.zeros(w.shape)) and out.spec == w.spec
        dist.scatter(out, [w], src=0)
        assert out.to_plain().equal(w.to_plain())
    finally:
        dist.destroy_process_group()


def test_encode_decode_round_trips_every_part():
    """The scatter payload carries the codes (bit-packed), scales, zero points, double-quantized
    scales' parts, input_scale and input_perm; a receiver of another format is refused."""
    from torchq.distributed.collectives import decode_into, describe, encode

    spec = QuantSpec((1, 32), 0, 7, ZeroPointDomain.INT)
    w = _weight(spec, (5, 64), seed=3)
    w = w._replace(input_scale=torch.rand(64) + 0.5, input_perm=torch.randperm(64))
    payload = encode(w)
    assert payload.dtype == torch.uint8 and payload.numel() == 5 * 24 + 5 * 2 * 4 + 5 * 2 * 1 + 64 * 4 + 64 * 8
    out = torch.empty_like(w)
    decode_into(out, payload, "test")
    assert out.to_plain().equal(w.to_plain())
    assert torch.equal(out.input_scale, w.input_scale) and torch.equal(out.input_perm, w.input_perm)
    nf4 = _weight(FORMATS[5], (6, 128))
    out = torch.empty_like(nf4)
    decode_into(out, encode(nf4), "test")
    assert out.to_plain().nested is not None and out.to_plain().equal(nf4.to_plain())
    assert describe(out) == describe(nf4)
    with pytest.raises(ValueError, match="test: expected 288 bytes"):
        decode_into(_weight(FORMATS[1], (6, 64)), payload[:10], "test")


# -- row-wise tensor parallelism of per-row formats -----------------------------------------------------
# config names (torchq.config_from_name, and dw.per_channel_config for the configs that have no short name)
CONFIG_NAMES = ["int8wo", "int8dq", "int8dq-r7", "int8static", "fp8wo", "fp8dq-row", "fp8dq-tensor", "llm_int8",
                "intx4-per-channel", "int4-g32", "int4-g128", "intx3-g32", "nf4", "fp4-b128", "int4a8", "nf4a8"]


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_column_shards_of_formats_whose_blocks_span_the_row(name):
    """For every config: a weight whose blocks span the row (one scale per row or per tensor) splits
    along its input features anywhere, each piece the weight's columns with the full per-row scale
    (and zero point), its block the piece's width, its values the whole weight's columns; a grouped
    format splits at group boundaries only, and a cut through a group names the way out."""
    torch.manual_seed(0)
    lin = nn.Linear(512, 256)
    torchq.quantize_(nn.Sequential(lin), dw.per_channel_config(name))
    w = lin.weight
    full, values = w.to_plain(), w.dequantize()
    spans = full.spec.block_size[1] == 512
    for world in (2, 3, 4, 7):
        if not spans and -(-512 // world) % full.spec.block_size[1]:
            with pytest.raises(ValueError, match=r"(?s)multiples of .*world size.*group size"):
                torch.chunk(w, world, dim=1)
            continue
        start = 0
        for piece in torch.chunk(w, world, dim=1):
            width = piece.shape[1]
            plain = piece.to_plain()
            assert _values_equal(plain, full.narrow(1, start, width)), (name, world, start)
            if spans:
                assert plain.spec.block_size == (full.spec.block_size[0], width)
                assert torch.equal(plain.scale, full.scale)  # the whole per-row (or per-tensor) scale
                assert plain.zero_point is None or torch.equal(plain.zero_point, full.zero_point)
            assert torch.equal(piece.dequantize(), values[:, start:start + width]), (name, world, start)
            start += width
    assert spans == (name in ("int8wo", "int8dq", "int8dq-r7", "int8static", "fp8wo", "fp8dq-row", "fp8dq-tensor",
                              "llm_int8", "intx4-per-channel"))


def test_rowwise_split_of_a_weight_with_an_input_perm_names_the_way_out():
    """Activation order permutes the codes' columns: a range of input features is no range of
    columns, so row-wise tensor parallelism refuses it, naming the weight and the ways out."""
    w = _weight(QuantSpec((1, 512), -128, 127, ZeroPointDomain.NONE), (16, 512))
    w = w._replace(input_perm=torch.randperm(512), label="layers.0.o_proj.weight")
    with pytest.raises(NotImplementedError, match=r"(?s)'layers.0.o_proj.weight'.*input_perm.*RowwiseParallel.*"
                                                  r"ColwiseParallel.*without activation order"):
        torch.chunk(w, 2, dim=1)
    assert all(p.input_perm is w.input_perm or torch.equal(p.input_perm, w.input_perm) for p in torch.chunk(w, 2, dim=0))


@settings(max_examples=40, deadline=None)
@given(spec=st.sampled_from(FORMATS + ROW_FORMATS), n=st.integers(0, 9), inner=st.sampled_from([0, 1]),
       extra=st.integers(0, 40), seed=st.integers(0, 2**16), transposed=st.booleans())
def test_padding_keeps_every_value_and_cuts_back_to_the_shard(spec, n, inner, extra, seed, transposed):
    """F.pad at the end of a dimension (DTensor's padding of uneven shards) keeps the weight's codes,
    scales and zero points; the padding is 0 where the format holds 0 (a float zero point's block
    holds the value nearest 0); narrowing the padding off gives the weight back bit for bit
    (double-quantized scales as the fp32 scales they stand for)."""
    k = spec.block_size[1]
    w = _weight(spec, (max(n, 1), k), seed=seed)
    if n == 0:
        w = w.new_zeros((0, k))
    w = w.t() if transposed else w
    dim = 1 - inner if transposed else inner  # the wrapper's dim of the inner [N, K] weight's dim `inner`
    padded = torch.nn.functional.pad(w, [0, extra] if dim == 1 else [0, 0, 0, extra])
    size = list(w.shape)
    size[dim] += extra
    assert list(padded.shape) == size and padded.transposed == transposed
    with pytest.raises(NotImplementedError, match=r"only zero padding at the end"):
        torch.nn.functional.pad(w, [1, 0])
    back, whole = padded.narrow(dim, 0, w.shape[dim]).to_plain(), w.to_plain()
    assert _values_equal(back, whole)
    assert back.spec == (whole.spec if extra == 0 else dataclasses.replace(whole.spec, double_quant=False))
    if padded.numel() == 0:  # nothing to dequantize
        return
    tail = padded.dequantize().narrow(dim, w.shape[dim], extra)
    tail = tail.t() if transposed else tail
    if spec.zero_point_domain is not ZeroPointDomain.FLOAT or inner == 0:
        assert torch.equal(tail, torch.zeros_like(tail))
    else:  # the padded columns share the row's scale and float zero point: the code nearest 0 there
        assert bool((tail.abs() <= whole.scale.float() / 2 * 1.0001).all())


# -- FSDP2 extension hooks without processes ---------------------------------------------------------
class _Mesh:
    def __init__(self, world: int) -> None:
        self.world = world

    def size(self) -> int:
        return self.world


@settings(max_examples=30, deadline=None)
@given(spec=st.sampled_from(FORMATS), n=st.integers(1, 13), world=st.integers(1, 5), dtype=st.sampled_from(
    [torch.float32, torch.bfloat16]))
def test_gather_hooks_rebuild_the_weight_from_padded_shards(spec, n, world, dtype):
    """pre_all_gather on each rank's chunk (padded to ceil(N/world) rows, empty ranks sending
    only padding) and post_all_gather on their concatenation give the whole weight's values in
    the requested dtype; with ``out`` the same tensors are refilled."""
    w = _weight(spec, (n, spec.block_size[1] * 2))
    chunks = list(torch.chunk(w, world, dim=0))
    chunks += [w.new_empty(0)] * (world - len(chunks))
    padded = -(-n // world)
    inputs = []
    for c in chunks:
        c._fsdp_rows = (n, padded)  # what the first all-reduce finds
        parts, meta = pre_all_gather(c, _Mesh(world))
        assert all(p.shape[0] == padded for p in parts)
        inputs.append(parts)
    gathered = tuple(torch.cat([r[i] for r in inputs]) for i in range(len(inputs[0])))
    full, inner = post_all_gather(gathered, meta, dtype)
    assert full.dtype == dtype and full.shape == (n, w.shape[1])
    assert _values_equal(full.to_plain(), w.to_plain())
    for t in inner:  # each inner tensor owns its whole storage (FSDP2 frees and re-allocates it)
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert all(t.untyped_storage().data_ptr() != g.untyped_storage().data_ptr() for g in gathered)
    for t in inner:
        t.untyped_storage().resize_(0)
    for t in inner:
        t.untyped_storage().resize_(t.numel() * t.element_size())
    assert post_all_gather(gathered, meta, dtype, out=full) is None
    assert _values_equal(full.to_plain(), w.to_plain())


def test_native_weights_follow_reallocated_storage():
    """A native kernel's cached weight (and the dispatch's bound call) must not keep pointers into
    storage that FSDP2 frees and re-allocates between forward and backward."""
    torch.manual_seed(0)
    for name in ("int8wo", "int4-g32", "nf4"):
        lin = nn.Linear(64, 48)
        torchq.quantize_(lin, dw.config(name))
        x = torch.randn(3, 64)
        y0 = lin(x)
        impl = lin.weight.tensor_impl
        saved = {n: getattr(impl, n).clone() for n in impl.tensor_names()}
        for n in saved:
            getattr(impl, n).untyped_storage().resize_(0)
        keep = [torch.empty(s.numel() * s.element_size() // 4 + 1) for s in saved.values()]  # take the freed blocks
        for n, s in saved.items():
            getattr(impl, n).untyped_storage().resize_(s.numel() * s.element_size())
            getattr(impl, n).copy_(s)
        assert torch.equal(lin(x), y0), name
        del keep


@pytest.mark.parametrize("name", ["nf4", "int4-g32"])
def test_fsdp2_on_one_process(name):
    """A one-rank mesh takes FSDP2's single-process path (it copies the first all-gather input
    only): the same losses as without FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh

    ref, _ = dw.train(dw.quantized_net(name), 2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        losses, _ = dw.train(dw.shard(dw.quantized_net(name), init_device_mesh("cpu", (1,))), 2)
    finally:
        dist.destroy_process_group()
    assert losses == ref


# -- multi-process ---------------------------------------------------------------------------------------
def _check_qlora(results: list, configs) -> None:
    r0 = results[0]
    for name in configs:
        d = r0[name]
        assert d["losses"] == d["ref_losses"], name  # the same floats, bit for bit
        for g, ref in zip(d["grads"], d["ref_grads"]):
            assert set(g) == set(ref)
            for k in g:
                torch.testing.assert_close(g[k], ref[k], rtol=1e-6, atol=1e-7, msg=f"{name} {k}")
        world = len(results)
        for key, whole in d["whole"].items():  # a rank holds about 1/world of each weight's parts
            local = max(r[name]["local"][key] for r in results)
            assert local <= whole / world * 1.35 + 64, (name, key, local, whole)


@pytest.mark.slow
def test_fsdp2_qlora_two_processes_matches_one(tmp_path):
    configs = ("nf4", "nf4-single", "int4-g32", "int8wo", "fp8wo")
    results = dw.spawn("fsdp_qlora", 2, tmp_path, configs)
    _check_qlora(results, configs)
    for name in configs:  # the all-gathers carried the quantized parts, not float weights
        d = results[0][name]
        float_bytes = sum(4 * 64 * 128 for _ in range(4)) + 4 * 6 * 64
        assert d["gathered"] < d["steps"] * 2 * float_bytes / 2, (name, d["gathered"])


@pytest.mark.slow
def test_fsdp2_qlora_four_processes_uneven_and_empty_shards(tmp_path):
    configs = ("nf4", "int4-g32")
    _check_qlora(dw.spawn("fsdp_qlora", 4, tmp_path, configs), configs)


@pytest.mark.slow
def test_fsdp2_mixed_precision_and_cpu_offload_change_no_bit(tmp_path):
    r = dw.spawn("fsdp_policies", 2, tmp_path, "nf4")[0]
    assert r["same"] and all(dtype == torch.bfloat16 and equal for dtype, equal in r["same"].values()), r["same"]
    assert r["offload_losses"] == r["plain_losses"]
    assert all(abs(a - b) < 0.02 for a, b in zip(r["mp_losses"], r["plain_losses"]))


@pytest.mark.slow
@pytest.mark.parametrize("name,world", [("int4-g32", 2), ("nf4", 2), ("int4-g32", 4)])
def test_tensor_parallel_matches_one_process(tmp_path, name, world):
    results = dw.spawn("tensor_parallel", world, tmp_path, name)
    for r in results:
        assert all(r["shard_is_quantized_shard"].values()), r["shard_is_quantized_shard"]
        assert all(r["col_equal"].values())  # ColwiseParallel: each output column is computed as on one process
    r = results[0]
    # RowwiseParallel sums partial products across ranks: fp32 summation-order bound
    # |y - y_ref| <= 2 * K * eps * (|x| |W|^T) per output, K = 128 the reduced length
    diff = (r["out"] - r["ref_out"]).abs().max().item()
    assert diff <= 2 * 128 * torch.finfo(torch.float32).eps * 64, diff
    assert torch.allclose(r["out"], r["ref_out"], rtol=1e-5, atol=1e-5)


# configs of the per-channel RowwiseParallel runs: weight-only (the fp32 summation bound), static int8
# activations (the same codes on every rank: the same bound) and dynamic per-token activations (bounded below)
PER_CHANNEL = ("int8wo", "fp8wo", "intx4-per-channel", "int8static", "int8dq", "int8dq-r7", "llm_int8", "fp8dq-row",
               "int4a8")  # int4a8: grouped weights, per-32 activation blocks that start at each rank's first feature


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def tp_from_rank(request, tmp_path_factory):
    """One spawn per world size: every layout through ColwiseParallel + RowwiseParallel with
    src_data_rank 0, the last rank and None, uneven splits, and the per-channel RowwiseParallel runs."""
    world = request.param
    return world, dw.spawn("tp_src_rank", world, tmp_path_factory.mktemp(f"tp{world}"), PER_CHANNEL)


@pytest.mark.slow
def test_tensor_parallel_from_a_source_rank_gives_each_rank_its_chunk(tp_from_rank):
    """parallelize_module's default src_data_rank=0 (and the last rank, and None): every rank's
    shard of every layout is bit for bit torch.chunk of the source's weight, in the layout the rank
    would have cut itself, although the other ranks held other values; uneven splits (rows 4+3,
    2+2+2+1, 2+2+2+0; columns of per-row formats 36+35, 18+18+18+17, 1+1+1+0) too."""
    world, results = tp_from_rank
    cases = {c[0] for c in dw.tp_layout_cases()}
    for rank, r in enumerate(results):
        shards = r["layouts"]["shards"]
        assert {k.split(" ")[0] for k in shards} == cases
        bad = [k for k, ok in shards.items() if not ok]
        assert not bad, (world, rank, bad)
        assert any("Shard(1)" in k for k in shards) and any("(6, 64)" in k for k in shards)


@pytest.mark.slow
def test_tensor_parallel_from_a_source_rank_matches_one_process(tp_from_rank):
    """Column-parallel outputs equal one process's bit for bit; row-parallel outputs are within the
    fp32 summation-order bound of a K-long dot product (per element: 2 K eps (|h| |W|^T + |b|))."""
    world, results = tp_from_rank
    for rank, r in enumerate(results):
        col = r["layouts"]["col_equal"]
        assert all(col.values()), (world, rank, [k for k, ok in col.items() if not ok])
    for key, (y, y_ref, bound) in results[0]["layouts"]["rowwise"].items():
        assert bool(((y - y_ref).abs() <= bound).all()), (world, key, ((y - y_ref).abs() - bound).max().item())


def _linear_bound(x, w, b, k):
    """fp32 summation-order bound of ``x @ w.T + b`` with K-long dot products, per element."""
    return 2 * k * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().t() + b.abs())


@pytest.mark.slow
def test_rowwise_parallel_of_per_channel_weights_matches_one_process(tp_from_rank):
    """RowwiseParallel on nn.Linear(512, 256) with one scale per output row (issue 39, item 3): each rank
    holds its 512/world columns of the codes with the whole per-row scale (and zero point), its block
    1 x 512/world. Weight-only formats and static int8 activations (the same codes on every rank) give
    one process's outputs within the fp32 summation bound. Dynamic per-token activations are quantized
    over each rank's slice of the features: not bit-equal to one process, but a rank's scale s_r <= s,
    the whole row's, so each element moves by at most s_r/2 + s/2 <= s and
    |y_tp - y_1| <= s * sum_k |W_nk| (+ the fp32 bound); float8 rounds relatively (2^-4 |x| + 2^-10 s per element).
    Per-block int8 activations (int4a8: blocks of 32 along K) start at each rank's first feature, a group
    boundary, so they are quantized as on one process."""
    world, results = tp_from_rank
    for r in results:
        for name in PER_CHANNEL:
            for src in (0, None):
                d = r["per_channel"][f"{name} src={src}"]
                assert d["same"], (world, name, src)
                if name != "int4a8":
                    assert d["block"][1] == 512 and d["local_block"][1] == 512 // world, (name, d["local_block"])
    r = results[0]["per_channel"]
    for name in PER_CHANNEL:
        x, w, b = r[name]["x"], r[name]["w"], r[name]["b"]
        fp32 = _linear_bound(x, w, b, 512)
        for src in (0, None):
            d = r[f"{name} src={src}"]
            diff = (d["y"] - d["y_ref"]).abs()
            if name in ("int8wo", "fp8wo", "intx4-per-channel", "int8static"):
                bound = fp32
            elif name == "int4a8":  # every rank's blocks of 32 features are one process's: the same codes
                bound = 2 * fp32
            elif name == "fp8dq-row":
                s = (x.abs().amax(dim=1, keepdim=True) / 448).clamp(min=2.0**-126)
                bound = 2 * fp32 + 2.0**-3 * (x.abs() @ w.abs().t()) + 2.0**-9 * s * w.abs().sum(dim=1)
            else:  # per-token int8 over [-127, 127] (int8dq-r7: [-63, 63]); LLM.int8's absmax excludes outliers (<= amax)
                s = (x.abs().amax(dim=1, keepdim=True) / (63 if name == "int8dq-r7" else 127)).clamp(min=1e-5)
                bound = 2 * fp32 + s * w.abs().sum(dim=1)
                assert not torch.equal(d["y"], d["y_ref"]), name  # the caveat is real: each rank's own token scales
            assert bool((diff <= bound).all()), (world, name, src, (diff - bound).max().item())


@pytest.mark.slow
def test_scatter_of_another_format_fails_on_every_rank(tmp_path):
    """A rank whose weight has another format than the source's: every rank raises (none waits for a
    collective that never comes), the mismatched rank naming the differences, all naming the way out."""
    errors = dw.spawn("tp_mismatch", 2, tmp_path)
    assert errors[0] and "rank(s) [1] hold a quantized weight of another format" in errors[0]
    assert errors[1] and "this rank (1) holds a quantized weight of another format" in errors[1]
    assert "spec:" in errors[1] and "on rank 0" in errors[1]
    assert all("src_data_rank=None" in e and "same config" in e for e in errors)


@pytest.mark.slow
def test_dcp_round_trips_and_reshards(tmp_path):
    """FSDP2 on 2 ranks -> DCP -> FSDP2 on 4 ranks, and 4 -> 2: the loaded models give the saved
    model's outputs exactly; TP on 2 ranks -> FSDP2 on 4."""
    name = "nf4"
    saved2 = dw.spawn("dcp_save", 2, tmp_path, name, "ck2")[0]
    assert any(k.endswith(".torchq.codes") for k in saved2["keys"])
    assert not any(k.endswith("base.weight") for k in saved2["keys"])
    loaded4 = dw.spawn("dcp_load", 4, tmp_path, name, "ck2")
    for r in loaded4:
        assert torch.equal(r["y"], saved2["y"])
    saved4 = dw.spawn("dcp_save", 4, tmp_path, name, "ck4")[0]
    loaded2 = dw.spawn("dcp_load", 2, tmp_path, name, "ck4")
    for r in loaded2:
        assert torch.equal(r["y"], saved4["y"])
    tp = dw.spawn("dcp_save", 2, tmp_path, "int4-g32", "tp2", "tp")[0]
    from_tp = dw.spawn("dcp_load", 4, tmp_path, "int4-g32", "tp2", False)
    torch.testing.assert_close(from_tp[0]["y"], tp["y"], rtol=1e-5, atol=1e-5)  # TP's output summed across ranks


@pytest.mark.slow
@pytest.mark.parametrize("kind,name", [("fsdp", "nf4"), ("tp", "int4-g32"), ("tp", "int8wo")])
def test_single_file_checkpoint_into_sharded_model(tmp_path, kind, name):
    """torchq.save_quantized -> a model quantized on the meta device and sharded: each rank reads
    only its own rows (FSDP2, ColwiseParallel) or columns (RowwiseParallel; per-row int8: its columns
    of the codes and every row's scale) of the codes, and the weights land in the CPU's layouts (the
    meta device's choice has no CPU kernel for int4)."""
    torch.manual_seed(0)
    m = dw.build_net()
    torchq.quantize_(m, dw.config(name))
    path = tmp_path / "model.safetensors"
    torchq.save_quantized(m, path)
    x = dw.batches(1)[0][0]
    with torch.no_grad():
        ref = m(x)
    results = dw.spawn("single_file_load", 2, tmp_path, name, str(path), kind)
    for r in results:
        if kind == "fsdp":
            assert torch.equal(r["y"], ref)
        else:
            torch.testing.assert_close(r["y"], ref, rtol=1e-5, atol=1e-5)
        codes = [shape for key, shape in r["reads"] if key.endswith(":codes")]
        bits = 8 if name == "int8wo" else 4
        assert codes and all(s[0] * s[1] <= 128 * 64 * bits // 8 // 2 for s in codes), codes  # half of a 128x64 weight


def test_dcp_state_dict_of_a_whole_model_round_trips(tmp_path):
    """Without a process group: the row-part state dict saves with DCP and loads into a model
    quantized the same way, bit for bit."""
    import torch.distributed.checkpoint as dcp

    m = dw.quantized_net("int4-g32", lora=False)
    sd = tqdcp.state_dict(m)
    assert "head.weight.torchq.format" in sd and "head.weight" not in sd
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    torch.manual_seed(5)
    other = dw.build_net()
    torchq.quantize_(other, dw.config("int4-g32"))
    sd2 = tqdcp.state_dict(other)
    dcp.load(sd2, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    tqdcp.load_state_dict(other, sd2)
    x = torch.randn(3, 64)
    assert torch.equal(other(x), m(x))
    wrong = dw.build_net()
    torchq.quantize_(wrong, dw.config("int8wo"))
    sd3 = tqdcp.state_dict(wrong)
    sd3.update({k: v for k, v in sd2.items() if k.endswith("format")})
    before = {n: p.to_plain().codes.clone() for n, p in dw.quantized_weights(wrong).items()}
    with pytest.raises(torchq.CheckpointError, match="quantize the model with the same config"):
        tqdcp.load_state_dict(wrong, sd3)
    assert all(torch.equal(p.to_plain().codes, before[n]) for n, p in dw.quantized_weights(wrong).items())
    sd2["blocks.1.up.weight.torchq.scale"][3, 1] = float("nan")  # a hostile file's scale
    with pytest.raises(torchq.CheckpointError, match="'blocks.1.up.weight': scale contains NaN"):
        tqdcp.load_state_dict(other, sd2)
    assert torch.equal(other(x), m(x))  # nothing was installed


@pytest.mark.slow
def test_a_failing_rank_reports_its_traceback(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*rank one fails"):
        dw.spawn("failing", 2, tmp_path)


@pytest.mark.skipif(not NCCL, reason="needs 2 CUDA devices and NCCL")
def test_fsdp2_qlora_nccl(tmp_path):
    configs = ("nf4", "int4-g32", "int8wo")
    _check_qlora(dw.spawn("fsdp_qlora", 2, tmp_path, configs, backend="nccl"), configs)


@pytest.mark.skipif(not NCCL, reason="needs 2 CUDA devices and NCCL")
def test_tensor_parallel_nccl(tmp_path):
    for r in dw.spawn("tensor_parallel", 2, tmp_path, "int4-g32", backend="nccl"):
        assert all(r["shard_is_quantized_shard"].values()) and all(r["col_equal"].values())


@pytest.mark.skipif(not NCCL, reason="needs 2 CUDA devices and NCCL")
def test_tensor_parallel_from_a_source_rank_nccl(tmp_path):
    """The scatter and broadcast with NCCL: the header, verdict and payload are CUDA tensors."""
    names = ("plain-int8-per-row", "int4_native-g32", "tensor_core_tiled-g32", "blockwise_4bit-nf4-double", "float8-per-row")
    for r in dw.spawn("tp_src_rank", 2, tmp_path, ("int8wo", "int8dq"), names, backend="nccl"):
        assert all(r["layouts"]["shards"].values()), [k for k, ok in r["layouts"]["shards"].items() if not ok]
        assert all(r["layouts"]["col_equal"].values())
        assert all(d["same"] for k, d in r["per_channel"].items() if "src=" in k)


def test_sharded_file_loader_checks_before_installing(tmp_path):
    """Without a process group the sliced loader reads whole weights; a flipped byte is a CRC
    error naming the part, a float target is refused, and a failed load changes nothing."""
    torch.manual_seed(0)
    m = dw.build_net()
    torchq.quantize_(m, dw.config("nf4"))
    path = tmp_path / "m.safetensors"
    torchq.save_quantized(m, path)
    target = dw.build_net()
    torchq.quantize_(target, dw.config("nf4"))
    tqdcp.load_quantized_sharded(target, str(path))
    x = torch.randn(2, 64)
    assert torch.equal(target(x), m(x))
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40  # a byte of the last tensor's data
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    fresh = dw.build_net()
    torchq.quantize_(fresh, dw.config("nf4"))
    before = {n: t.clone() if not isinstance(t, AffineQuantizedTensor) else t.to_plain().codes.clone()
              for n, t in fresh.state_dict().items()}
    with pytest.raises(torchq.CheckpointError, match="crc32"):
        tqdcp.load_quantized_sharded(fresh, str(bad))
    for n, t in fresh.state_dict().items():
        assert torch.equal(t.to_plain().codes if isinstance(t, AffineQuantizedTensor) else t, before[n]), n
    with pytest.raises(torchq.CheckpointError, match="quantize the model"):
        tqdcp.load_quantized_sharded(dw.build_net(), str(path))
