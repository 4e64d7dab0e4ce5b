"""torchq's vLLM method without vLLM: a rank's shard of a layer's stored parts, cut the way vLLM's
loaders cut them (column-parallel rows, row-parallel input columns, fused q/k/v and gate/up
weights), becomes exactly that piece of the full quantized weight; folders are checked before
vLLM builds a model. The served path itself runs in ``tests/vllm`` (vLLM's CPU backend)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import torchq
from torchq.checkpoint import codec
from torchq.checkpoint.codec import CheckpointError
from torchq.vllm.folder import ServedCheckpoint
from torchq.vllm.weights import build_weight, nested_scale, plan_shard, whole_offsets

CONFIGS = {
    "int4-g32": lambda: torchq.int4_weight_only(group_size=32),
    "int4-g32-hqq": lambda: torchq.config_from_name("int4-g32-hqq"),
    "intx3-g32": lambda: torchq.config_from_name("intx3-g32"),
    "int8wo": lambda: torchq.int8_weight_only(),
    "int8dq": lambda: torchq.int8_dynamic_activation_int8_weight(),
    "nf4-double": lambda: torchq.nf4_weight_only(block_size=64, double_quant=True),
    "nf4": lambda: torchq.nf4_weight_only(block_size=64, double_quant=False),
    "fp4": lambda: torchq.config_from_name("fp4"),
    "int4a8": lambda: torchq.config_from_name("int4a8"),
    "fp8wo": lambda: torchq.config_from_name("fp8wo"),
}


def _stored(cfg_name: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, codec.ParsedRecord, dict[str, torch.Tensor]]:
    """A quantized [n, k] weight: its dequantized values, its record and its stored parts."""
    torch.manual_seed(seed)
    lin = nn.Sequential(nn.Linear(k, n, bias=False))
    torchq.quantize_(lin, CONFIGS[cfg_name]())
    w = lin[0].weight
    record, parts = codec.encode(w)
    return w.dequantize(), codec.parse_record(record, f"w{seed}"), parts


def _cut(t: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int] | None) -> torch.Tensor:
    t = t[rows[0]:rows[1]]
    return t if cols is None else t[:, cols[0]:cols[1]]


def _load(plan, stored: list[dict[str, torch.Tensor]], row_ranges: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """What vLLM's loaders leave in the layer's parameters: each fused weight's rows of every part
    (its input columns on a row-parallel rank), whole parts one after the other."""
    rec, spec, k0, kl = plan.record, plan.record.spec, plan.k_start, plan.k_local
    g, bits = spec.block_size[1], spec.bits
    params = {}
    for p in plan.parts:
        if p.whole:
            params[p.name] = torch.cat([s[p.name].reshape(-1) for s in stored])
            assert params[p.name].shape == p.shape
            continue
        if p.name == "scale" and spec.double_quant:
            continue
        cols = None
        if p.input_dim is not None:
            cols = ((k0 * bits // 8, (k0 + kl) * bits // 8) if p.name == "codes" and rec.encoding == "bitstream"
                    else (k0, k0 + kl) if p.name == "codes" else (k0 // g, (k0 + kl) // g))
        params[p.name] = torch.cat([_cut(s[p.name], r, cols) for s, r in zip(stored, row_ranges)])
        assert params[p.name].shape == p.shape, (p, params[p.name].shape)
    if spec.double_quant:
        full = [nested_scale(plan, params, i) for i in range(len(stored))]
        cols = None if plan.part("scale").input_dim is None else (k0 // g, (k0 + kl) // g)
        params["scale"] = torch.cat([_cut(f, r, cols) for f, r in zip(full, row_ranges)])
    return params


@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
@pytest.mark.parametrize("tp,rank,row_parallel", [(1, 0, False), (2, 1, False), (2, 0, True), (2, 1, True), (4, 3, True)])
def test_shard_is_that_piece_of_the_weight(cfg_name: str, tp: int, rank: int, row_parallel: bool) -> None:
    """Fused q/k/v-like weights (different row counts), cut for one rank: the built weight
    dequantizes to exactly that rank's rows / columns of each full weight."""
    k = 256
    rows_each = [128, 64, 64]
    full, recs, stored = zip(*(_stored(cfg_name, n, k, seed) for seed, n in enumerate(rows_each)))
    if row_parallel:
        local_rows, row_ranges = rows_each, [(0, n) for n in rows_each]
        k_local, k_start = k // tp, rank * (k // tp)
    else:
        local_rows = [n // tp for n in rows_each]
        row_ranges = [(rank * n // tp, (rank + 1) * n // tp) for n in rows_each]
        k_local, k_start = k, 0
    plan = plan_shard("layers.0.qkv_proj", ["q", "k", "v"], list(recs), local_rows, k, k_local, k_start)
    params = _load(plan, list(stored), row_ranges)
    weight = build_weight(plan, params, "layers.0.qkv_proj", torch.float32)
    want = torch.cat([f[r0:r1, k_start:k_start + k_local] for f, (r0, r1) in zip(full, row_ranges)])
    assert weight.shape == want.shape
    torch.testing.assert_close(weight.dequantize(), want, rtol=0, atol=0)
    assert weight.act_quant == recs[0].act_quant and weight.label == "layers.0.qkv_proj"


@settings(max_examples=25, deadline=None)
@given(cfg_name=st.sampled_from(["int4-g32", "int8wo", "nf4-double", "intx3-g32"]),
       groups=st.integers(1, 6), tp=st.sampled_from([1, 2, 4]), n=st.sampled_from([8, 24, 40]), seed=st.integers(0, 50))
def test_row_parallel_any_split(cfg_name: str, groups: int, tp: int, n: int, seed: int) -> None:
    """Row-parallel ranks of input features split at multiples of the group: every rank's
    weight is its columns, and the ranks' partial products sum to the full product."""
    g = 64 if cfg_name.startswith("nf4") else 32
    k = g * groups * tp
    full, rec, stored = _stored(cfg_name, n, k, seed)
    x = torch.randn(3, k)
    total = torch.zeros(3, n)
    for rank in range(tp):
        kl = k // tp
        plan = plan_shard("o_proj", ["o"], [rec], [n], k, kl, rank * kl)
        w = build_weight(plan, _load(plan, [stored], [(0, n)]), "o_proj", torch.float32)
        torch.testing.assert_close(w.dequantize(), full[:, rank * kl:(rank + 1) * kl], rtol=0, atol=0)
        total += torch.nn.functional.linear(x[:, rank * kl:(rank + 1) * kl], w)
    torch.testing.assert_close(total, torch.nn.functional.linear(x, full), rtol=1e-4, atol=1e-4)


def test_whole_offsets_follow_each_weight() -> None:
    recs = [_stored("nf4-double", n, 128, i)[1] for i, n in enumerate([64, 32])]
    plan = plan_shard("gate_up_proj", ["gate", "up"], recs, [64, 32], 128, 128, 0)
    sizes = [math.prod(r.parts["scale_codes"][1]) for r in recs]
    assert whole_offsets(plan, "scale_codes") == [(0, sizes[0]), (sizes[0], sizes[1])]
    assert plan.part("scale").dtype == torch.float32 and plan.part("scale_codes").whole


def test_refusals_name_the_layer_and_sizes() -> None:
    _, rec32, _ = _stored("int4-g32", 64, 256, 0)
    _, rec8, _ = _stored("int8wo", 64, 256, 1)
    with pytest.raises(CheckpointError, match=r"'layers.0.qkv_proj'.*quantized differently"):
        plan_shard("layers.0.qkv_proj", ["q", "k"], [rec32, rec8], [64, 64], 256, 256, 0)
    with pytest.raises(CheckpointError, match=r"'down_proj'.*holds 48 of the 256 input features.*groups of 32"):
        plan_shard("down_proj", ["down"], [rec32], [64], 256, 48, 48)
    _, rec3, _ = _stored("intx3-g32", 8, 12 * 32, 2)  # K = 384; 3 ranks of 128 are whole groups and bytes
    plan_shard("down_proj", ["down"], [rec3], [8], 384, 128, 128)
    with pytest.raises(CheckpointError, match=r"'x' has 256 input features, the model 128"):
        plan_shard("x", ["x"], [rec32], [64], 128, 128, 0)
    # vLLM's loaders would cut 32 of 64 rows without a word: the model's row counts are checked
    plan_shard("layers.0.gate_up_proj", ["g", "u"], [rec32, rec32], [32, 32], 256, 256, 0, full_rows=[64, 64])
    with pytest.raises(CheckpointError, match=r"'layers.0.gate_up_proj'.*'u' has 64 output rows, the model 48"):
        plan_shard("layers.0.gate_up_proj", ["g", "u"], [rec32, rec32], [32, 24], 256, 256, 0, full_rows=[64, 48])
    with pytest.raises(CheckpointError, match=r"the model has 1 weights here, the checkpoint \['g', 'u'\]"):
        plan_shard("layers.0.gate_up_proj", ["g", "u"], [rec32, rec32], [32, 32], 256, 256, 0, full_rows=[128])
    per_tensor = codec.parse_record({**codec.encode(_tensor_scaled())[0], "label": None}, "t")
    with pytest.raises(CheckpointError, match="blocks spanning"):
        plan_shard("x", ["x"], [per_tensor], [per_tensor.shape[0]], per_tensor.shape[1], per_tensor.shape[1], 0)


def _tensor_scaled():
    lin = nn.Sequential(nn.Linear(64, 32, bias=False))
    torchq.quantize_(lin, torchq.config_from_name("fp8dq-tensor"))
    return lin[0].weight


def test_per_row_scales_stay_whole_on_row_parallel_ranks() -> None:
    """int8 per-channel scales: one group per row, kept whole by every rank; the local spec's
    block is the rank's width."""
    full, rec, stored = _stored("int8wo", 32, 256, 3)
    plan = plan_shard("o_proj", ["o"], [rec], [32], 256, 128, 128)
    assert plan.part("scale").input_dim is None and plan.part("scale").shape == (32, 1)
    assert plan.spec.block_size == (1, 128)
    w = build_weight(plan, _load(plan, [stored], [(0, 32)]), "o_proj", torch.float32)
    torch.testing.assert_close(w.dequantize(), full[:, 128:], rtol=0, atol=0)


def _folder(tmp_path, cfg: str = "int4-g32"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 32))
    torchq.quantize_(model, CONFIGS[cfg]())
    torchq.save_quantized(model, tmp_path)
    return tmp_path, model


def test_served_checkpoint_reads_records_and_floats(tmp_path) -> None:
    folder, model = _folder(tmp_path)
    ckpt = ServedCheckpoint(folder)
    assert set(ckpt.records) == {"0.weight", "2.weight"}
    assert {"0.bias", "1.weight", "1.bias", "2.bias"} <= ckpt.floats
    assert ckpt.record("0.weight").shape == (64, 64) and ckpt.record("1.weight") is None
    assert ckpt.holds("2.bias") and not ckpt.holds("3.weight")


@pytest.mark.parametrize("target", ["0.weight:codes", "0.weight:scale", "1.weight"])
def test_a_flipped_byte_anywhere_is_refused_before_serving(tmp_path, target: str) -> None:
    folder, _ = _folder(tmp_path)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    import json

    entry = json.loads(data[8:8 + header_len])[target]
    data[8 + header_len + entry["data_offsets"][0]] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupted \(crc32 mismatch\)") as e:
        ServedCheckpoint(folder)
    assert repr(target.split(":")[0]) in str(e.value)


def test_a_float_folder_is_not_served_as_torchq(tmp_path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no torchq header"):
        ServedCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        ServedCheckpoint(tmp_path / "nothing-here")


def _edit_header(path, edit) -> None:
    """Rewrite the torchq header of a safetensors file through ``edit(header dict)``, its CRC
    recomputed (a crafted file, not a corrupted one)."""
    from test_checkpoint_fuzz import StFile

    f = StFile(path.read_bytes())
    tq = f.tq()
    edit(tq)
    f.set_tq(tq)
    path.write_bytes(f.to_bytes())


def test_a_record_bigger_than_its_stored_parts_is_refused(tmp_path) -> None:
    """A header whose record claims 2**30 rows over the stored 64 (the parts' CRCs those of the
    small tensors): each worker would allocate the record's size before reading a byte (here 32
    GiB of codes and 1 GiB of scale codes), so the folder is refused in the front process."""
    folder, _ = _folder(tmp_path, "nf4-double")

    def grow(tq: dict) -> None:
        rec = tq["quantized"]["0.weight"]
        rows = 2**30
        rec["shape"][0] = rows
        rec["parts"]["codes"]["shape"][0] = rows
        rec["parts"]["scale_codes"]["shape"][0] = rows
        rec["parts"]["scale_absmax"]["shape"] = [math.ceil(rows / 256)]

    _edit_header(folder / "model.safetensors", grow)
    with pytest.raises(CheckpointError, match=r"'0.weight': part 'codes' is stored as torch.uint8 \[64, 32\], its record "
                                              r"says torch.uint8 \[1073741824, 32\]"):
        ServedCheckpoint(folder)


def test_an_alias_of_nothing_is_refused(tmp_path) -> None:
    folder, _ = _folder(tmp_path)
    _edit_header(folder / "model.safetensors", lambda tq: tq["aliases"].update({"3.weight": "9.weight"}))
    with pytest.raises(CheckpointError, match=r"aliases \['3.weight'\] name tensors the checkpoint does not store "
                                              r"\(\['9.weight'\]\)"):
        ServedCheckpoint(folder)
    folder2, _ = _folder(tmp_path / "tied")
    _edit_header(folder2 / "model.safetensors", lambda tq: tq["aliases"].update({"3.weight": "2.weight"}))
    ckpt = ServedCheckpoint(folder2)
    assert ckpt.holds("3.weight") and not ckpt.stores("3.weight") and ckpt.stores("2.weight")
    assert ckpt.record("3.weight").shape == (32, 64)


def test_safetensors_files_vllm_would_load_beside_the_checkpoint_are_refused(tmp_path) -> None:
    """Without an index vLLM loads every *.safetensors file of the folder, and with consolidated*
    files (Mistral's format) only those, index or not: a file torchq did not check could replace
    tensors unchecked. Other files beside an indexed checkpoint are not loaded, and pass."""
    from safetensors.torch import save_file

    folder, _ = _folder(tmp_path / "single")
    save_file({"1.weight": torch.ones(64)}, str(folder / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"holds \['extra.safetensors'\] beside the checkpoint's "
                                              r"\['model.safetensors'\]; vLLM would load every \*.safetensors file of a "
                                              r"folder without model.safetensors.index.json unchecked"):
        ServedCheckpoint(folder)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 32))
    torchq.quantize_(model, CONFIGS["int4-g32"]())
    sharded = tmp_path / "sharded"
    assert len(torchq.save_quantized(model, sharded, max_shard_size=4096)) > 1
    save_file({"1.weight": torch.ones(64)}, str(sharded / "extra.safetensors"))
    ServedCheckpoint(sharded)
    save_file({"1.weight": torch.ones(64)}, str(sharded / "consolidated.safetensors"))
    with pytest.raises(CheckpointError, match=r"holds \['consolidated.safetensors'\] beside the checkpoint's .*vLLM "
                                              r"would load them unchecked"):
        ServedCheckpoint(sharded)


@pytest.mark.parametrize("cfg_name", ["int8wo", "int8dq"])
def test_int8_weights_are_packed_in_the_layout_their_kernels_win_in(cfg_name: str) -> None:
    """Under the "auto" policy the plugin packs int8-activation weights in panel order where the
    VNNI kernels run, and keeps weight-only int8 in the plain layout (its kernels sum in row-major
    order: on panels they would run on unpacked rows, slower); a named layout is kept."""
    from torchq.layouts.int8_vnni import Int8VnniLayout
    from torchq.layouts.plain import PlainLayout

    _, rec, stored = _stored(cfg_name, 64, 128, 0)
    plan = plan_shard("layers.0.o_proj", ["o"], [rec], [64], 128, 128, 0)
    params = _load(plan, [stored], [(0, 64)])
    vnni_runs = Int8VnniLayout().fit(rec.spec, (64, 128), torch.float32, torch.device("cpu")).automatic
    want = "int8_vnni" if cfg_name == "int8dq" and vnni_runs else "plain"
    assert build_weight(plan, params, "layers.0.o_proj", torch.float32).tensor_impl.layout.name == want
    assert build_weight(plan, params, "layers.0.o_proj", torch.float32, PlainLayout()).tensor_impl.layout.name == "plain"
    assert build_weight(plan, params, "layers.0.o_proj", torch.float32, Int8VnniLayout()).tensor_impl.layout.name == "int8_vnni"
