"""The hostile files of issue 34, one test each, through every import door: GGUF (read_gguf,
gguf_metadata, from_gguf), compressed-tensors, load_quantized and from_pretrained of torchq
folders. Each must be refused with a CheckpointError naming the file and the tensor or field,
fast and without allocating in proportion to what the file claims. The fuzz suites
(tests/test_import_fuzz.py) try many more."""

from __future__ import annotations

import json
import math
import shutil
import struct
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import torchq
from torchq import CheckpointError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from hostile_imports import _after, _rewrite_header, torchq_base, write_gguf  # noqa: E402

from torchq.hf import from_gguf  # noqa: E402
from torchq.interop.gguf import NonFiniteScaleError, from_gguf_blocks, gguf_metadata, read_gguf  # noqa: E402
from torchq.interop.gguf_file import GGUFFile  # noqa: E402


def gguf_bytes(kvs: list[bytes], tensors: list[bytes] = (), pad: int = 0) -> bytes:
    """A GGUF v3 file from raw key/value and tensor-info records."""
    return b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors) + b"\0" * pad


def gstr(s: str) -> bytes:
    return struct.pack("<Q", len(s.encode())) + s.encode()


def every_reader(path):
    """The three GGUF entry points, each run to completion."""
    return [lambda: gguf_metadata(path), lambda: list(read_gguf(path)), lambda: from_gguf(path)]


# -- GGUF --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("count", [1 << 60, 10**6])
def test_a_tiny_gguf_claiming_a_huge_array_is_refused_before_allocating(tmp_path, count):
    path = tmp_path / "bomb.gguf"
    kv = gstr("general.architecture") + struct.pack("<I", 8) + gstr("llama")
    bomb = gstr("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 0, count)
    head = gguf_bytes([kv, bomb])
    path.write_bytes(head + b"\0" * (288 - len(head)))  # 288 bytes, as the file in the issue
    for read in every_reader(path):
        with pytest.raises(CheckpointError, match=rf"bomb.gguf: key 'tokenizer.ggml.scores''s array of {count} elements needs"):
            read()


def test_string_arrays_and_counts_are_bounded_by_the_file(tmp_path):
    path = tmp_path / "strings.gguf"
    path.write_bytes(gguf_bytes([gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1 << 40)]))
    with pytest.raises(CheckpointError, match="strings.gguf: key 'tokenizer.ggml.tokens': an array of 1099511627776 strings cannot fit"):
        gguf_metadata(path)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 50, 0))
    with pytest.raises(CheckpointError, match="strings.gguf: tensor count 1125899906842624 cannot fit"):
        gguf_metadata(path)
    path.write_bytes(gguf_bytes([gstr("k") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 0, 1) + b"\0"]))
    with pytest.raises(CheckpointError, match="key 'k': arrays of arrays are not supported"):
        gguf_metadata(path)


def test_a_block_count_the_tensors_do_not_back_is_refused(tmp_path):
    path = tmp_path / "blocks.gguf"
    write_gguf(path, block_count=20000)
    for read in every_reader(path):
        with pytest.raises(CheckpointError, match=r"blocks.gguf: key 'llama.block_count' says 20000 blocks, but the file's blk.N "
                                                  r"tensors are for 2 \(missing blocks \[2, 3, 4, 5\], blocks beyond the count \[\]\)"):
            read()


def test_many_blocks_need_tensor_data_to_back_them(tmp_path):
    path = tmp_path / "thin.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(200)
    w.add_embedding_length(8)
    w.add_head_count(1)
    for i in range(200):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert len(GGUFFile(path).tensors) == 200  # a well-formed file ...
    with pytest.raises(CheckpointError, match=r"thin.gguf: key 'llama.block_count' asks for 200, but the file's \d+ bytes of "
                                              r"tensor data can fill at most 64"):
        from_gguf(path)  # ... that would have transformers build 200 blocks from a few kilobytes


@pytest.mark.parametrize("kind, field, at, size", [("Q4_0", "d", 0, 2), ("Q4_1", "m", 2, 2), ("Q8_0", "d", 0, 2), ("Q4_K", "d", 0, 2),
                                                   ("Q4_K", "dmin", 2, 2), ("Q2_K", "dmin", 82, 2), ("Q6_K", "d", 208, 2),
                                                   ("Q8_K", "d", 0, 4)])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_block_scales_are_refused(kind, field, at, size, bad):
    from torchq.interop.gguf import BLOCK_BYTES, _elements

    k = _elements(kind)
    raw = torch.zeros(2 * BLOCK_BYTES[kind], dtype=torch.uint8)
    value = torch.tensor([bad], dtype=torch.float16 if size == 2 else torch.float32).view(torch.uint8)
    raw[BLOCK_BYTES[kind] + at:BLOCK_BYTES[kind] + at + size] = value
    with pytest.raises(NonFiniteScaleError, match=rf"{kind} block 0 of row 1 has {field} = -?(nan|inf)"):
        from_gguf_blocks(raw, kind, (2, k))


@pytest.mark.parametrize("tensor, kind, what", [("blk.0.attn_q.weight", "Q4_0", "Q4_0 block 0 of row 0 has d = nan"),
                                                ("blk.0.attn_v.weight", "Q4_1", "Q4_1 block 0 of row 0 has d = nan"),
                                                ("blk.1.attn_output.weight", "F16", "its element 0 is nan"),
                                                ("token_embd.weight", "F32", "its element 0 is nan")])
def test_a_nan_in_a_file_names_the_tensor(tmp_path, tensor, kind, what):
    path = tmp_path / "nan.gguf"
    write_gguf(path, nan=tensor)
    for read in every_reader(path)[1:]:
        with pytest.raises(CheckpointError, match=rf"nan.gguf: tensor '{tensor}' \({kind} \[\d+(, \d+)?\]\): {what}"):
            read()


def _edit_info(path, tensor: str, *, type_id: int | None = None, offset: int | None = None) -> None:
    raw = bytearray(path.read_bytes())
    at = _after(raw, tensor.encode())
    n_dims = struct.unpack_from("<I", raw, at)[0]
    at += 4 + 8 * n_dims
    if type_id is not None:
        raw[at:at + 4] = struct.pack("<I", type_id)
    if offset is not None:
        raw[at + 4:at + 12] = struct.pack("<Q", offset)
    path.write_bytes(bytes(raw))


def test_overlapping_and_out_of_file_tensor_data_are_refused(tmp_path):
    path = tmp_path / "overlap.gguf"
    write_gguf(path)
    with GGUFFile(path) as f:
        q = next(t for t in f.tensors if t.name == "blk.0.attn_q.weight")
        k = next(t for t in f.tensors if t.name == "blk.0.attn_k.weight")
        start = f.data_start
    _edit_info(path, "blk.0.attn_k.weight", offset=q.offset - start)  # k's data offset pointing into q's bytes
    for read in every_reader(path):
        with pytest.raises(CheckpointError, match=r"overlap.gguf: tensors '.*' and '.*' overlap in the data section"):
            read()
    write_gguf(path)
    _edit_info(path, "blk.1.ffn_down.weight", type_id=0)  # Q4_0 -> F32: 7x the bytes, past the end of the file
    with pytest.raises(CheckpointError, match=r"overlap.gguf: tensor 'blk.1.ffn_down.weight' \(F32 \[64, 128\].*lies past the end"):
        gguf_metadata(path)
    write_gguf(path)
    _edit_info(path, "blk.0.attn_q.weight", type_id=1)  # Q4_0 -> F16: reads into the neighbour's bytes
    with pytest.raises(CheckpointError, match="overlap.gguf: tensors 'blk.0.attn_q.weight' and 'blk.0.attn_k.weight' overlap"):
        list(read_gguf(path))
    assert k.nbytes > 0


def test_a_float_tensor_relabelled_integer_is_refused(tmp_path):
    path = tmp_path / "i32.gguf"
    write_gguf(path)
    _edit_info(path, "token_embd.weight", type_id=26)  # F32 -> I32: same size
    assert {t.name: t.kind for t in GGUFFile(path).tensors}["token_embd.weight"] == "I32"
    with pytest.raises(CheckpointError, match=r"i32.gguf: 'model.embed_tokens.weight' is a trainable torch.float32 parameter in "
                                              r"the model but torch.int32 in the checkpoint"):
        from_gguf(path)


def test_truncated_files_and_bad_metadata_name_the_file(tmp_path):
    path = tmp_path / "cut.gguf"
    write_gguf(path)
    full = path.read_bytes()
    for size in (0, 3, 20, 100, len(full) // 2, len(full) - 1):
        path.write_bytes(full[:size])
        for read in every_reader(path):
            with pytest.raises(CheckpointError, match=r"cut.gguf: .*(truncated|not a GGUF file|past the end|cannot fit)"):
                read()
    write_gguf(path, head_count=0)  # transformers divides by it
    with pytest.raises(CheckpointError, match=r"cut.gguf: transformers cannot build a model from this GGUF file's metadata "
                                              r"\(ZeroDivisionError"):
        from_gguf(path)


def test_from_gguf_leaves_gguf_py_as_it_was(tmp_path):
    path = tmp_path / "ok.gguf"
    write_gguf(path)
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = from_gguf(path)
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    assert isinstance(m.model.layers[1].self_attn.q_proj.weight, torchq.AffineQuantizedTensor)
    ours = gguf_metadata(path)
    theirs = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}
    assert ours == theirs  # the bounded reader reads what gguf-py reads


# -- compressed-tensors ------------------------------------------------------------------------------
def _ct_folder(tmp_path, **swap):
    from hostile_imports import _swap, _write_ct, ct_base

    tensors, cfg = ct_base(tmp_path)
    for what in swap.values():
        tensors = _swap(tensors, what)
    return _write_ct(tmp_path / "ct", tensors, cfg)


@pytest.mark.parametrize("swap, message", [
    ("norm.weight:int64", r"'norm.weight' is a trainable torch.float32 parameter in the model but torch.int64"),
    ("norm.weight:bool", r"'norm.weight' is a trainable torch.float32 parameter in the model but torch.bool"),
    ("norm.weight:float64", r"'norm.weight' is a trainable torch.float32 parameter in the model but torch.float64 .*converts only"),
    ("norm.weight:float8", r"'norm.weight' is a trainable torch.float32 parameter in the model but torch.float8_e4m3fn"),
    ("norm.weight:nan", r"tensor 'norm.weight' holds NaN or infinite values"),
    ("layer.weight_scale:inf", r"tensor 'layer.weight': .*weight_scale.*(NaN|inf|finite)"),
])
def test_compressed_tensors_float_entries_are_checked_against_the_model(tmp_path, swap, message):
    from hostile_imports import CTModel

    from torchq.interop.compressed_tensors import load_compressed_tensors

    path = _ct_folder(tmp_path, s=swap)
    model = CTModel()
    before = dict(model.state_dict(keep_vars=True))
    with pytest.raises(CheckpointError, match=rf"{path}: .*{message}"):
        load_compressed_tensors(model, path, dtype=torch.float32)
    assert all(model.state_dict(keep_vars=True)[k] is v for k, v in before.items())


def test_a_pathological_target_pattern_loads_in_linear_time(tmp_path):
    from hostile_imports import CTModel

    from torchq.interop.compressed_tensors import load_compressed_tensors

    path = _ct_folder(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["re:(.|.)*Z", "re:(a+)+$"]
    (path / "config.json").write_text(json.dumps(config))
    model = CTModel()
    load_compressed_tensors(model, path, dtype=torch.float32)  # backtracking re took minutes per name here
    assert isinstance(model.layer.weight, torchq.AffineQuantizedTensor)
    config["quantization_config"]["ignore"] = ["re:(a)\\1"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"ct: .*quantization_config.ignore.*backreference"):
        load_compressed_tensors(CTModel(), path, dtype=torch.float32)


# -- load_quantized ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float64, torch.float8_e4m3fn])
def test_load_quantized_checks_float_dtypes_against_the_model(tmp_path, dtype):
    src = nn.Sequential(nn.Embedding(8, 64), nn.Linear(64, 32))
    torchq.quantize_(src, torchq.int8_weight_only())
    state = src.state_dict()
    state["0.weight"] = state["0.weight"].to(dtype)
    torchq.save_quantized(state, tmp_path / "m.safetensors")
    with torch.device("meta"):
        target = nn.Sequential(nn.Embedding(8, 64), nn.Linear(64, 32))
    before = dict(target.state_dict(keep_vars=True))
    with pytest.raises(CheckpointError, match=rf"m.safetensors: '0.weight' is a trainable torch.float32 parameter in the model "
                                              rf"but {dtype}"):
        torchq.load_quantized(target, tmp_path / "m.safetensors")
    assert all(target.state_dict(keep_vars=True)[k] is v for k, v in before.items())


# -- from_pretrained of torchq folders ---------------------------------------------------------------
@pytest.fixture(scope="module")
def torchq_folder(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torchq_base(tmp_path_factory.mktemp("torchq-folder"))


def _copy(src, tmp_path):
    dst = tmp_path / "case"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("edit, message", [
    ("record shape", r"model.safetensors: '.*' has shape \[\d+, \d+\] in the model but \[\d+, \d+\] in the checkpoint"),
    ("float int64", r"model.safetensors: '.*' is a (trainable )?torch.float32 parameter in the model but torch.int64"),
    ("float dtype", r"model.safetensors: '.*' is a (trainable )?torch.float32 parameter in the model but torch.float64"),
    ("part dtype", r"model.safetensors: quantized tensor '.*': scale must be floating point, got torch.int64"),
    ("scale nan", r"model.safetensors: .*(finite|NaN|nan)"),
])
def test_from_pretrained_makes_load_quantized_checks(torchq_folder, tmp_path, edit, message):
    case = _copy(torchq_folder, tmp_path)
    _rewrite_header(case / "model.safetensors", edit, 0)
    with pytest.raises(CheckpointError, match=message):
        transformers.AutoModelForCausalLM.from_pretrained(case)


def test_from_pretrained_checks_float_crcs_and_the_config(torchq_folder, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    case = _copy(torchq_folder, tmp_path)
    f = case / "model.safetensors"
    with safe_open(str(f), "pt") as h:
        meta, tensors = h.metadata(), {k: h.get_tensor(k) for k in h.keys()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors["model.norm.weight"][0] += 1
    save_file(tensors, str(f), metadata=meta)
    with pytest.raises(CheckpointError, match=r"case/model.safetensors: tensor 'model.norm.weight': data is corrupted \(crc32"):
        transformers.AutoModelForCausalLM.from_pretrained(case)
    shutil.copy(torchq_folder / "model.safetensors", f)
    config = json.loads((case / "config.json").read_text())
    for key, value, message in [("version", 99, "version 99 is newer than this torchq reads"),
                                ("format", "other", "format: expected 'torchq.checkpoint', got 'other'"),
                                ("layout", {"type": "nope"}, "unknown layout type 'nope'")]:
        broken = json.loads(json.dumps(config))
        broken["quantization_config"][key] = value
        (case / "config.json").write_text(json.dumps(broken))
        with pytest.raises(CheckpointError, match=rf"case/config.json: quantization_config: .*{message}"):
            transformers.AutoModelForCausalLM.from_pretrained(case)
    (case / "config.json").write_text(json.dumps(config))
    transformers.AutoModelForCausalLM.from_pretrained(case)  # the untouched folder still loads
    raw = bytearray(f.read_bytes())
    at = raw.index(b'"torchq"')
    raw[at + 1] = ord(" ")  # the metadata key damaged: the file would read as a plain float checkpoint
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"case/model.safetensors: has no torchq header .* but .*case/config.json says its "
                                              r"weights are torchq's"):
        transformers.AutoModelForCausalLM.from_pretrained(case)


# -- what a review found ------------------------------------------------------------------------------
def _writer(path, arch="llama"):
    return gguf.GGUFWriter(str(path), arch)


def _close(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_huge_block_index_does_not_allocate(tmp_path):
    path = tmp_path / "index.gguf"
    w = _writer(path)
    w.add_block_count((1 << 32) - 1)
    w.add_tensor(f"blk.{(1 << 32) - 2}.attn_norm.weight", np.ones(8, np.float32))
    _close(w)
    with pytest.raises(CheckpointError, match=r"index.gguf: key 'llama.block_count' says 4294967295 blocks, but the file's blk.N "
                                              r"tensors are for 1 \(missing blocks \[0, 1, 2, 3\]"):
        gguf_metadata(path)


def test_block_counts_under_any_architecture_key_or_config_name_are_bounded(tmp_path):
    path = tmp_path / "other.gguf"
    write_gguf(path, extra={"mistral.block_count": 100000})  # transformers reads any architecture's keys
    with pytest.raises(CheckpointError, match=r"other.gguf: key 'mistral.block_count' asks for 100000, but the file's \d+ bytes"):
        from_gguf(path)
    array_arch = gstr("general.architecture") + struct.pack("<IIQ", 9, 8, 1) + gstr("llama")
    path.write_bytes(gguf_bytes([array_arch, gstr("llama.block_count") + struct.pack("<II", 4, 100000)]))
    with pytest.raises(CheckpointError, match=r"other.gguf: key 'general.architecture' must be a string, got \['llama'\]"):
        from_gguf(path)
    path.write_bytes(gguf_bytes([gstr("general.architecture") + struct.pack("<I", 8) + gstr("llama"),
                                 gstr("llama.block_count") + struct.pack("<II", 4, 100)], pad=1 << 20))
    with pytest.raises(CheckpointError, match=r"other.gguf: key 'llama.block_count' asks for 100, but the file's 0 bytes of tensor"):
        from_gguf(path)  # a megabyte of padding backs no block
    path.write_bytes(gguf_bytes([gstr(f"k{i}") + struct.pack("<II", 4, i) for i in range(5000)]))
    with pytest.raises(CheckpointError, match=r"other.gguf: 5000 metadata keys; torchq hands transformers at most 4096"):
        from_gguf(path)


def test_t5_and_split_files_keep_their_block_counts(tmp_path):
    path = tmp_path / "t5.gguf"
    w = _writer(path, "t5")
    w.add_block_count(2)
    for family in ("enc.blk", "dec.blk"):
        for i in range(2):
            w.add_tensor(f"{family}.{i}.attn_norm.weight", np.ones(8, np.float32))
    _close(w)
    assert len(GGUFFile(path).tensors) == 4
    w = _writer(path, "t5")
    w.add_block_count(2)
    w.add_tensor("enc.blk.0.attn_norm.weight", np.ones(8, np.float32))
    w.add_tensor("enc.blk.1.attn_norm.weight", np.ones(8, np.float32))
    w.add_tensor("dec.blk.0.attn_norm.weight", np.ones(8, np.float32))
    _close(w)
    with pytest.raises(CheckpointError, match=r"t5.gguf: .* dec.blk.N tensors are for 1 \(missing blocks \[1\]"):
        GGUFFile(path)
    w = _writer(path)
    w.add_block_count(4)
    w.add_uint16("split.count", 2)  # the first file of a split model holds blocks 0 and 1 only
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    w.add_tensor("blk.1.attn_norm.weight", np.ones(8, np.float32))
    _close(w)
    assert len(GGUFFile(path).tensors) == 2


def test_not_utf8_strings_keep_their_bytes(tmp_path):
    path = tmp_path / "bytes.gguf"
    token = b"\xff\xfe"
    arr = gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + gstr("a") + struct.pack("<Q", 2) + token
    path.write_bytes(gguf_bytes([arr]))
    assert gguf_metadata(path)["tokenizer.ggml.tokens"][1].encode("utf-8", "surrogateescape") == token
    path.write_bytes(gguf_bytes([struct.pack("<Q", 2) + token + struct.pack("<I", 4) + b"\0\0\0\0"]))
    with pytest.raises(CheckpointError, match=r"bytes.gguf: key/value 0's key is not UTF-8"):
        gguf_metadata(path)


def _patch_data(path, tensor: str, at: int, data: bytes) -> None:
    with GGUFFile(path) as f:
        start = next(t.offset for t in f.tensors if t.name == tensor)
    raw = bytearray(path.read_bytes())
    raw[start + at:start + at + len(data)] = data
    path.write_bytes(bytes(raw))


def test_values_that_overflow_the_import_dtype_are_refused(tmp_path):
    path = tmp_path / "big.gguf"
    write_gguf(path)
    _patch_data(path, "token_embd.weight", 0, np.float32(1e5).tobytes())
    with pytest.raises(CheckpointError, match=r"big.gguf: tensor 'token_embd.weight' \(F32\): values overflow torch.float16"):
        from_gguf(path, dtype=torch.float16)
    write_gguf(path)
    _patch_data(path, "blk.0.attn_k.weight", 0, np.float16(60000).tobytes())  # Q8_0: finite d, 127·d beyond fp16
    with pytest.raises(CheckpointError, match=r"big.gguf: tensor 'blk.0.attn_k.weight' \(Q8_0\): block scales up to 60000.0"):
        from_gguf(path, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = from_gguf(path, dtype=torch.bfloat16)  # bfloat16 holds it
    assert bool(torch.isfinite(m.model.layers[0].self_attn.k_proj.weight.dequantize()).all())


def test_integer_and_float_entries_must_fit_the_model_dtype(tmp_path):
    src = nn.Module()
    src.register_buffer("idx", torch.tensor([1, 200], dtype=torch.uint8))
    src.register_buffer("w", torch.tensor([1.0, 1e5]))
    torchq.save_quantized(src, tmp_path / "m.safetensors")
    dst = nn.Module()
    dst.register_buffer("idx", torch.zeros(2, dtype=torch.int8))
    dst.register_buffer("w", torch.zeros(2, dtype=torch.float16))
    with pytest.raises(CheckpointError, match=r"m.safetensors: 'idx' holds torch.uint8 values from 1 to 200, beyond the model's "
                                              r"torch.int8"):
        torchq.load_quantized(dst, tmp_path / "m.safetensors")
    dst.register_buffer("idx", torch.zeros(2, dtype=torch.int64))
    with pytest.raises(CheckpointError, match=r"'w' holds torch.float32 values from 1.0 to 100000.0, beyond the model's torch.float16"):
        torchq.load_quantized(dst, tmp_path / "m.safetensors")
    dst.register_buffer("w", torch.zeros(2, dtype=torch.bfloat16))
    torchq.load_quantized(dst, tmp_path / "m.safetensors")  # in range: cast as load_state_dict would
    assert dst.idx.tolist() == [1, 200] and dst.w.dtype == torch.bfloat16


def test_bf16_gguf_tensors_import(tmp_path):
    path = tmp_path / "bf16.gguf"
    write_gguf(path, bf16=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = from_gguf(path)
    tensors = {t.name: t for t in read_gguf(path)}
    expected = tensors["blk.1.attn_output.weight"].value
    assert expected.dtype == torch.bfloat16
    assert torch.equal(m.model.layers[1].self_attn.o_proj.weight, expected.float())


def test_other_threads_get_gguf_pys_own_reader(tmp_path):
    import threading

    from torchq.hf.gguf import _bounded_gguf_py, _ReaderView

    path = tmp_path / "ok.gguf"
    write_gguf(path)
    real = gguf.GGUFReader
    seen = {}
    with GGUFFile(path) as f, _bounded_gguf_py(f):
        seen["here"] = gguf.GGUFReader(str(path))
        thread = threading.Thread(target=lambda: seen.update(there=gguf.GGUFReader(str(path))))
        thread.start()
        thread.join()
    assert isinstance(seen["here"], _ReaderView)
    assert isinstance(seen["there"], real) and len(seen["there"].tensors) == len(seen["here"].tensors)
    assert gguf.GGUFReader is real
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError):
        from_gguf(path)
    assert gguf.GGUFReader is real
