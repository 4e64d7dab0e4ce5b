"""GGUF k-quants (Q2_K-Q6_K) and Q8_K into torchq plain forms, checked bit for bit against gguf-py's
own dequantization, and back to the same bytes; files with formats torchq cannot hold; and
from_gguf: a GGUF file as a transformers model whose quantized weights stay quantized (a tiny
synthetic Llama with k-quant tensors, and SmolLM2's Q4_1 file, slow)."""

import contextlib
import io
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchq
from torchq.interop.gguf import BLOCK_BYTES, K_QUANTS, GGUFDequantizedWarning, from_gguf_blocks, read_gguf, to_gguf_bytes

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

# byte offsets of each k-quant's fp16 d (and dmin) inside its super-block
FP16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind, n, k, seed, sign=1.0, spread=1.0):
    """Valid random super-blocks: random bytes, with finite fp16 d / dmin of moderate magnitude."""
    rng = np.random.default_rng(seed)
    nb = k // 256
    blocks = rng.integers(0, 256, size=(n, nb, BLOCK_BYTES[kind]), dtype=np.uint8)
    for i, off in enumerate(FP16_FIELDS[kind]):
        mag = np.abs(rng.standard_normal((n, nb))) * 0.01 * (spread if i else 1.0) + 1e-4
        blocks[..., off:off + 2] = (sign * mag).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return blocks


def exact_blocks(kind, n, k, seed):
    """Random super-blocks, each redrawn until its float zero point is exact (as every Q4_K / Q6_K
    super-block of a llama.cpp Q4_K_M file of SmolLM2 was: random scale/minimum bytes miss for
    about 1 super-block in 40)."""
    blocks = random_blocks(kind, n, k, seed)
    rng = np.random.default_rng(seed + 1)
    for i in range(n):
        for j in range(k // 256):
            for _ in range(100):
                try:
                    from_gguf_blocks(torch.from_numpy(blocks[i, j].copy()), kind, (1, 256))
                    break
                except ValueError:
                    blocks[i, j] = random_blocks(kind, 1, 256, int(rng.integers(2**31)))[0, 0]
    return blocks


def q8_k_blocks(n, k, seed):
    """Random Q8_K blocks (fp32 d of varied magnitude and sign, int8 q, their 16 int16 sums)."""
    rng = np.random.default_rng(seed)
    nb = k // 256
    d = (rng.choice([-1, 1], (n, nb)) * 10.0 ** rng.uniform(-30, 30, (n, nb))).astype(np.float32)
    d[0, 0] = 0.0
    q = rng.integers(-128, 128, size=(n, nb, 256), dtype=np.int8)
    sums = q.astype(np.int16).reshape(n, nb, 16, 16).sum(-1, dtype=np.int16)
    blocks = np.concatenate([d.reshape(n, nb, 1).view(np.uint8), q.view(np.uint8), sums.view(np.uint8)], axis=-1)
    return blocks, (d[..., None] * q.astype(np.float32)).reshape(n, k)


def reference(blocks, kind, n, k):
    return dequantize(blocks.reshape(n, -1), getattr(QT, kind)).reshape(n, k).astype(np.float32)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(K_QUANTS), n=st.integers(1, 6), nb=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_k_quants_dequantize_bit_for_bit_as_gguf_py(kind, n, nb, seed):
    k = 256 * nb
    blocks = exact_blocks(kind, n, k, seed)
    plain = from_gguf_blocks(torch.from_numpy(blocks.reshape(-1).copy()), kind, (n, k))
    assert plain.spec.block_size == (1, 32 if kind in ("Q4_K", "Q5_K") else 16)
    got = plain.dequantize(torch.float32).numpy()
    assert np.array_equal(got.view(np.int32), reference(blocks, kind, n, k).view(np.int32))
    q = torchq.AffineQuantizedTensor.from_plain(plain, torch.float32)  # packs into a layout and back
    assert np.array_equal(q.dequantize().numpy().view(np.int32), got.view(np.int32))
    raw = to_gguf_bytes(q.to_plain(), kind)  # random bytes: equal values back (from the packed tensor)
    assert np.array_equal(reference(raw.numpy(), kind, n, k).view(np.int32), got.view(np.int32))


@pytest.mark.parametrize("kind", K_QUANTS)
def test_negative_scales_give_equal_values(kind):
    n, k = 4, 256
    blocks = exact_blocks(kind, n, k, 3)
    for off in FP16_FIELDS[kind][:1]:  # negate d
        blocks[..., off + 1] ^= 0x80
    got = from_gguf_blocks(torch.from_numpy(blocks.reshape(-1).copy()), kind, (n, k)).dequantize(torch.float32).numpy()
    ref = reference(blocks, kind, n, k)
    assert np.array_equal(got, ref)  # equal values; a zero may be +0.0 where gguf-py's is -0.0
    nonzero = ref != 0
    assert np.array_equal(got[nonzero].view(np.int32), ref[nonzero].view(np.int32))


@pytest.mark.parametrize("kind", ["Q2_K", "Q4_K", "Q5_K"])
def test_a_float_zero_point_that_is_not_exact_is_refused(kind):
    n, k = 2, 256
    blocks = random_blocks(kind, n, k, 5, spread=1e4)  # dmin much larger than d: mid*s - dmin*m rounds
    with pytest.raises(ValueError, match=rf"{kind} element \d+ .*not exact in fp32"):
        from_gguf_blocks(torch.from_numpy(blocks.reshape(-1).copy()), kind, (n, k))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"shape: Q4_K rows hold whole blocks of 256"):
        from_gguf_blocks(torch.zeros(144, dtype=torch.uint8), "Q4_K", (1, 128))
    with pytest.raises(ValueError, match=r"raw: expected 144 uint8 bytes for Q4_K \[1, 256\], got torch.uint8 with 143"):
        from_gguf_blocks(torch.zeros(143, dtype=torch.uint8), "Q4_K", (1, 256))
    with pytest.raises(ValueError, match="kind: expected one of"):
        from_gguf_blocks(torch.zeros(8, dtype=torch.uint8), "IQ2_XS", (1, 256))
    plain = from_gguf_blocks(torch.from_numpy(random_blocks("Q6_K", 1, 256, 0).reshape(-1).copy()), "Q6_K", (1, 256))
    with pytest.raises(ValueError, match=r"plain: Q4_K needs the format .*, got "):
        to_gguf_bytes(plain, "Q4_K")
    with pytest.raises(ValueError, match="kind: expected one of"):
        to_gguf_bytes(plain, "IQ4_NL")


def test_files_keep_exact_tensors_quantized_and_warn_about_the_rest(tmp_path):
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    exact = {kind: exact_blocks(kind, 3, 512, i) for i, kind in enumerate(K_QUANTS)}
    for kind, blocks in exact.items():
        w.add_tensor(f"exact.{kind}", blocks.reshape(3, -1), raw_dtype=getattr(QT, kind))
    inexact = random_blocks("Q4_K", 2, 256, 9, spread=1e4)
    w.add_tensor("inexact.Q4_K", inexact.reshape(2, -1), raw_dtype=QT.Q4_K)
    t1 = gguf.quants.quantize(np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32), QT.TQ1_0)
    w.add_tensor("other.TQ1_0", t1, raw_dtype=QT.TQ1_0)
    iq4 = np.random.default_rng(1).integers(0, 256, size=(2, 8, 18), dtype=np.uint8)  # fp16 d + 16 bytes of 4-bit indices
    iq4[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    w.add_tensor("other.IQ4_NL", iq4.reshape(2, -1), raw_dtype=QT.IQ4_NL)
    q8k, q8k_values = q8_k_blocks(3, 512, 4)
    w.add_tensor("exact.Q8_K", q8k.reshape(3, -1), raw_dtype=QT.Q8_K)
    w.add_tensor("three_d.Q8_K", q8k.reshape(3, 1, -1), raw_dtype=QT.Q8_K)  # gguf-py cannot decode Q8_K: torchq's decoder
    q6k_3d = exact_blocks("Q6_K", 2, 256, 7)
    w.add_tensor("three_d.Q6_K", q6k_3d.reshape(2, 1, -1), raw_dtype=QT.Q6_K)
    w.add_tensor("ints.I32", np.arange(6, dtype=np.int32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tensors = {t.name: t for t in read_gguf(path)}
    warned = sorted(str(x.message).split("'")[1] for x in seen if issubclass(x.category, GGUFDequantizedWarning))
    assert warned == ["inexact.Q4_K", "other.IQ4_NL", "other.TQ1_0", "three_d.Q6_K", "three_d.Q8_K"]
    assert tensors["exact.Q8_K"].exact and torch.equal(tensors["exact.Q8_K"].value.dequantize(), torch.from_numpy(q8k_values))
    assert torch.equal(tensors["three_d.Q8_K"].value, torch.from_numpy(q8k_values).reshape(3, 1, 512))
    assert torch.equal(tensors["three_d.Q6_K"].value, torch.from_numpy(reference(q6k_3d, "Q6_K", 2, 256)).reshape(2, 1, 256))
    assert torch.equal(tensors["other.IQ4_NL"].value, torch.from_numpy(dequantize(iq4.reshape(2, -1), QT.IQ4_NL)))
    assert tensors["ints.I32"].exact and torch.equal(tensors["ints.I32"].value, torch.arange(6, dtype=torch.int32).reshape(2, 3))
    for kind, blocks in exact.items():
        t = tensors[f"exact.{kind}"]
        assert t.exact and isinstance(t.value, torchq.AffineQuantizedTensor)
        assert np.array_equal(t.value.dequantize().numpy().view(np.int32), reference(blocks, kind, 3, 512).view(np.int32))
    assert not tensors["inexact.Q4_K"].exact and torch.equal(
        tensors["inexact.Q4_K"].value, torch.from_numpy(reference(inexact, "Q4_K", 2, 256)))
    assert not tensors["other.TQ1_0"].exact and tuple(tensors["other.TQ1_0"].value.shape) == (4, 256)


# -- byte round trips: blocks as llama.cpp's quantizers write them ---------------------------------
# the magnitude of d (and dmin): zero blocks, fp16 subnormals, tiny, ordinary, large, near fp16's max
MAGNITUDES = {"zero": 0.0, "subnormal": 2.0**-20, "tiny": 1e-4, "normal": 1e-2, "large": 40.0, "huge": 6e4}


def set_extreme(blocks, kind, i):
    """Give sub-block ``i`` of every super-block the extreme integer llama.cpp gives its largest sub-block
    (sc = -128 for Q6_K, -32 for Q3_K, sc = m = 63 for Q4_K / Q5_K, sc = m = 15 for Q2_K)."""
    if kind == "Q6_K":
        blocks[..., 192 + i] = 0x80
    elif kind == "Q3_K":  # 6-bit u = sc + 32 = 0
        blocks[..., 96 + i % 8] &= 0x0F if i >= 8 else 0xF0  # low nibble: nibble i // 8 of byte i % 8
        blocks[..., 104 + i % 4] &= ~np.uint8(3 << (2 * (i // 4)))
    elif kind == "Q2_K":
        blocks[..., i] = 0xFF
    elif i < 4:  # Q4_K / Q5_K
        blocks[..., 4 + i] |= 0x3F
        blocks[..., 8 + i] |= 0x3F
    else:
        blocks[..., 12 + i - 4] = 0xFF
        blocks[..., 4 + i - 4] |= 0xC0
        blocks[..., 8 + i - 4] |= 0xC0


def llama_cpp_blocks(kind, n, k, seed, magnitude):
    """Random super-blocks in llama.cpp's form: one sub-block at the extreme integer, d (dmin) fp16 of
    the given magnitude (a random sign for the symmetric formats), all-zero scale bytes where d = 0;
    each FLOAT-zero super-block redrawn until its zero point is exact."""
    rng = np.random.default_rng(seed)
    nb = k // 256
    groups = 8 if kind in ("Q4_K", "Q5_K") else 16
    out = np.empty((n, nb, BLOCK_BYTES[kind]), np.uint8)
    for r in range(n):
        for b in range(nb):
            for _ in range(200):
                blk = rng.integers(0, 256, size=(1, 1, BLOCK_BYTES[kind]), dtype=np.uint8)
                set_extreme(blk, kind, int(rng.integers(groups)))
                sign = rng.choice([-1.0, 1.0]) if kind in ("Q3_K", "Q6_K") else 1.0
                for off in FP16_FIELDS[kind]:
                    d = np.float16(sign * MAGNITUDES[magnitude] * rng.uniform(0.5, 1.0) + 0.0)  # +0.0, as llama.cpp
                    blk[..., off:off + 2] = np.frombuffer(d.tobytes(), np.uint8)
                if magnitude == "zero":  # llama.cpp writes all-zero scales (and minimums) for such blocks
                    scale_bytes = {"Q6_K": slice(192, 208), "Q3_K": slice(96, 108), "Q2_K": slice(0, 16)}
                    blk[..., scale_bytes.get(kind, slice(4, 16))] = 0
                try:
                    from_gguf_blocks(torch.from_numpy(blk.reshape(-1).copy()), kind, (1, 256))
                    break
                except ValueError:
                    continue
            out[r, b] = blk[0, 0]
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(K_QUANTS), n=st.integers(1, 5), nb=st.integers(1, 3), magnitude=st.sampled_from(sorted(MAGNITUDES)),
       seed=st.integers(0, 2**16), constant_rows=st.booleans())
def test_llama_cpp_k_quant_bytes_round_trip_byte_for_byte(kind, n, nb, magnitude, seed, constant_rows):
    k = 256 * nb
    blocks = llama_cpp_blocks(kind, 1 if constant_rows else n, k, seed, magnitude)
    if constant_rows:  # every row the same bytes (one super-block repeated: constant scales per row too)
        blocks = np.broadcast_to(blocks[:, :1], (n, nb, blocks.shape[-1])).copy()
    raw = torch.from_numpy(blocks.reshape(-1).copy())
    plain = from_gguf_blocks(raw, kind, (n, k))
    ref = reference(blocks, kind, n, k)
    got = plain.dequantize(torch.float32).numpy()
    assert np.array_equal(got, ref)
    assert np.array_equal(got[ref != 0].view(np.int32), ref[ref != 0].view(np.int32))  # bit for bit but zeros' signs
    assert torch.equal(to_gguf_bytes(plain, kind).reshape(-1), raw)
    q = torchq.AffineQuantizedTensor.from_plain(plain, torch.float32)
    assert torch.equal(q.dequantize(), plain.dequantize(torch.float32))


@pytest.mark.parametrize("kind", K_QUANTS)
def test_all_zero_bytes_and_constant_values(kind):
    n, k = 3, 512
    zeros = torch.zeros(n * 2 * BLOCK_BYTES[kind], dtype=torch.uint8)
    plain = from_gguf_blocks(zeros, kind, (n, k))
    assert torch.equal(plain.dequantize(torch.float32), torch.zeros(n, k))
    assert torch.equal(to_gguf_bytes(plain, kind).reshape(-1), zeros)
    # a constant row: one code everywhere, equal scales
    spec = plain.spec
    code = spec.quant_max
    s = torch.full_like(plain.scale, 0.125)
    z = None if plain.zero_point is None else torch.full_like(plain.zero_point, 0.5)
    const = type(plain)(torch.full((n, k), code, dtype=spec.code_dtype), s, z, spec)
    raw = to_gguf_bytes(const, kind)
    assert np.array_equal(reference(raw.numpy(), kind, n, k), const.dequantize(torch.float32).numpy())


@pytest.mark.parametrize("kind", K_QUANTS)
def test_plain_forms_with_no_k_quant_bytes_are_refused(kind):
    spec = from_gguf_blocks(torch.zeros(BLOCK_BYTES[kind], dtype=torch.uint8), kind, (1, 256)).spec
    plain = torchq.PlainForm.example(spec, (2, 512), seed=1)  # arbitrary fp32 scales: not fp16 times small integers
    with pytest.raises(ValueError, match=rf"plain: {kind} super-block 0 \(row 0, columns 0..255\): its sub-block scales .* "
                                         rf"are not one fp16 value times integers in \[-?\d+, \d+\], so it has no {kind} bytes"):
        to_gguf_bytes(plain, kind)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 4), nb=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_q8_k_is_exact_and_round_trips(n, nb, seed):
    blocks, want = q8_k_blocks(n, 256 * nb, seed)  # gguf-py has no Q8_K dequantizer: llama.cpp's d·q in fp32
    raw = torch.from_numpy(blocks.reshape(-1).copy())
    plain = from_gguf_blocks(raw, "Q8_K", (n, 256 * nb))
    assert plain.spec.block_size == (1, 256) and plain.scale.dtype == torch.float32
    assert np.array_equal(plain.dequantize(torch.float32).numpy().view(np.int32), want.view(np.int32))
    assert torch.equal(to_gguf_bytes(plain, "Q8_K").reshape(-1), raw)


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q8_0"]), n=st.integers(1, 5), nb=st.integers(1, 4),
       scale=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2**16))
def test_legacy_quants_from_gguf_py_quantizer(kind, n, nb, scale, seed):
    x = (np.random.default_rng(seed).standard_normal((n, 32 * nb)) * scale).astype(np.float32)
    x[0, :16] = 0.0  # a constant half block
    raw = gguf.quants.quantize(x, getattr(QT, kind))
    ref = dequantize(raw, getattr(QT, kind)).reshape(n, 32 * nb).astype(np.float32)
    try:
        plain = from_gguf_blocks(torch.from_numpy(raw.reshape(-1).copy()), kind, (n, 32 * nb))
    except ValueError as e:  # Q4_1 / Q5_1: m + mid*d not exact in fp32 is refused, never wrong
        assert kind in ("Q4_1", "Q5_1") and "exact" in str(e)
        return
    assert np.array_equal(plain.dequantize(torch.float32).numpy().view(np.int32), ref.view(np.int32))
    assert np.array_equal(to_gguf_bytes(plain, kind).numpy(), raw)


# -- from_gguf: a tiny synthetic Llama with k-quant tensors, against transformers' own GGUF load ----
TINY = dict(hidden=256, ffn=512, vocab=96, layers=2, heads=4, kv_heads=2)
TINY_KINDS = [["Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "Q4_K", "Q6_K"],  # q, k, v, o, gate, up, down
              ["Q6_K", "Q4_K", "Q8_0", "Q5_K", "TQ1_0", "Q3_K", "Q2_K"]]


def write_tiny_llama(path, seed=0):
    """A 2-layer Llama GGUF (hidden 256, 4 heads, 2 KV heads, tied Q8_0 embedding) whose projections are
    random valid k-quant blocks, one Q8_0 and one TQ1_0 (no torchq form) weight."""
    h, f, v, hd = TINY["hidden"], TINY["ffn"], TINY["vocab"], TINY["hidden"] // TINY["heads"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(h)
    w.add_block_count(TINY["layers"])
    w.add_feed_forward_length(f)
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(v)

    def add(name, n, k, kind):
        if kind in ("Q8_0", "TQ1_0"):
            x = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            w.add_tensor(name, gguf.quants.quantize(x, getattr(QT, kind)), raw_dtype=getattr(QT, kind))
        else:
            w.add_tensor(name, exact_blocks(kind, n, k, int(rng.integers(1 << 16))).reshape(n, -1), raw_dtype=getattr(QT, kind))

    add("token_embd.weight", v, h, "Q8_0")
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    shapes = [("attn_q", h, h), ("attn_k", TINY["kv_heads"] * hd, h), ("attn_v", TINY["kv_heads"] * hd, h),
              ("attn_output", h, h), ("ffn_gate", f, h), ("ffn_up", f, h), ("ffn_down", h, f)]
    for i, kinds in enumerate(TINY_KINDS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
        for (name, n, k), kind in zip(shapes, kinds, strict=True):
            add(f"blk.{i}.{name}.weight", n, k, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_from_gguf_tiny_llama_k_quants_equal_transformers_own_load(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torchq.hf import from_gguf

    write_tiny_llama(tmp_path / "tiny.gguf")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m = from_gguf(tmp_path / "tiny.gguf")
    dequantized = [str(x.message) for x in seen if issubclass(x.category, GGUFDequantizedWarning)]
    assert len(dequantized) == 1 and "'blk.1.ffn_gate.weight' (TQ1_0)" in dequantized[0]
    assert any(issubclass(x.category, torchq.FallbackWarning) and "token_embd.weight (Q8_0)" in str(x.message) for x in seen)
    assert m.config.num_key_value_heads == 2 and m.config.tie_word_embeddings
    assert m.lm_head.weight is m.model.embed_tokens.weight
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    state = ref.state_dict()
    kept = 0
    for name, param in m.named_parameters():
        quantized = isinstance(param, torchq.AffineQuantizedTensor)
        kept += quantized
        value = param.dequantize(torch.float32) if quantized else param
        assert torch.equal(value, state[name]), name  # Q/K rows un-permuted on the codes exactly as transformers does
    assert kept == 1 + 2 * 7 - 1  # every weight but the TQ1_0 one (the embedding counted once, tied to the head)
    layer = m.model.layers[0]
    assert layer.self_attn.q_proj.weight.spec.block_size == (1, 32)
    assert layer.self_attn.k_proj.weight.spec.block_size == (1, 16)
    assert isinstance(m.model.layers[1].mlp.gate_proj.weight, torch.nn.Parameter)
    assert not isinstance(m.model.layers[1].mlp.gate_proj.weight, torchq.AffineQuantizedTensor)
    assert torch.isfinite(m.model.rotary_emb.inv_freq).all()  # non-persistent buffers computed
    ids = torch.randint(0, TINY["vocab"], (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.FallbackWarning)
        torch.testing.assert_close(m(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
        out = m.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(out, ref.generate(ids, max_new_tokens=4, do_sample=False))
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        m.save_pretrained(tmp_path / "saved")  # torchq's quantizer attached: the k-quant forms saved and loaded as they are
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    mine = dict(m.named_parameters())
    for name, param in again.named_parameters():
        if isinstance(param, torchq.AffineQuantizedTensor):
            assert param.spec == mine[name].spec and torch.equal(param.dequantize(), mine[name].dequantize()), name
        else:
            assert torch.equal(param, mine[name]), name


def test_from_gguf_arguments_are_checked(tmp_path):
    pytest.importorskip("transformers")
    from torchq.hf import from_gguf

    with pytest.raises(FileNotFoundError, match="path: no GGUF file"):
        from_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="without_kernel: expected 'float' or 'keep', got 'drop'"):
        from_gguf(tmp_path / "missing.gguf", without_kernel="drop")


@pytest.mark.slow
def test_from_gguf_smollm2_weights_equal_transformers_own_load(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from examples import smollm
    from torchq.hf import from_gguf

    try:
        path = smollm.gguf_path()
    except ImportError as e:
        pytest.skip(str(e))
    with pytest.warns(torchq.FallbackWarning, match=r"1 linear weight\(s\) have no torchq kernel.*token_embd.weight \(Q8_0\)"):
        kept = from_gguf(path)  # default: stays quantized, runs dequantize + F.linear
    assert isinstance(kept.lm_head.weight, torchq.AffineQuantizedTensor)
    del kept
    with pytest.warns(GGUFDequantizedWarning, match="token_embd.weight.*no torchq linear kernel"):
        m = from_gguf(path, without_kernel="float")
    assert not isinstance(m.lm_head.weight, torchq.AffineQuantizedTensor)
    assert isinstance(m.model.layers[0].self_attn.q_proj.weight, torchq.AffineQuantizedTensor)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    ref = transformers.AutoModelForCausalLM.from_config(m.config, dtype=torch.float32)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)["tensors"]
    params = dict(m.named_parameters())
    for name, value in state.items():  # Q/K rows un-permuted exactly as transformers does
        mine = params[name]
        mine = mine.dequantize(torch.float32) if isinstance(mine, torchq.AffineQuantizedTensor) else mine
        assert torch.equal(mine, value), name
    ref.load_state_dict(state, strict=False)
    ref.tie_weights()
    ids = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, ref.eval()(ids).logits, atol=5e-4, rtol=1e-4)
    tokens = m.generate(ids, max_new_tokens=6, do_sample=False)
    m.save_pretrained(tmp_path)  # torchq's quantizer is attached: a torchq folder that loads quantized
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(again.model.layers[0].mlp.up_proj.weight, torchq.AffineQuantizedTensor)
    assert torch.equal(again.generate(ids, max_new_tokens=6, do_sample=False), tokens)
