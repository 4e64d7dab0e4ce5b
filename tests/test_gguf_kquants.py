"""GGUF k-quants (Q2_K-Q6_K) into torchq plain forms, checked bit for bit against gguf-py's own
dequantization; files with formats torchq cannot hold; and from_gguf: a GGUF file as a
transformers model whose quantized weights stay quantized (issue 18 part 4)."""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
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
    with pytest.raises(ValueError, match="Q6_K imports only"):
        to_gguf_bytes(plain, "Q6_K")


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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tensors = {t.name: t for t in read_gguf(path)}
    warned = sorted(str(x.message).split("'")[1] for x in seen if issubclass(x.category, GGUFDequantizedWarning))
    assert warned == ["inexact.Q4_K", "other.TQ1_0"]
    for kind, blocks in exact.items():
        t = tensors[f"exact.{kind}"]
        assert t.exact and isinstance(t.value, torchq.AffineQuantizedTensor)
        assert np.array_equal(t.value.dequantize().numpy().view(np.int32), reference(blocks, kind, 3, 512).view(np.int32))
    assert not tensors["inexact.Q4_K"].exact and torch.equal(
        tensors["inexact.Q4_K"].value, torch.from_numpy(reference(inexact, "Q4_K", 2, 256)))
    assert not tensors["other.TQ1_0"].exact and tuple(tensors["other.TQ1_0"].value.shape) == (4, 256)


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


@pytest.mark.slow
def test_from_gguf_smollm2_weights_equal_transformers_own_load(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from torchq.examples import smollm
    from torchq.interop.gguf_transformers import from_gguf

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
