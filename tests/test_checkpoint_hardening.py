"""Hand-made checkpoints: what ``torch.load(weights_only=True)`` and the loaders refuse, and that
they do it with a CheckpointError (or UnpicklingError) quickly and without allocating memory in
proportion to what a file claims (issue 14, items 1, 2 and 10)."""

from __future__ import annotations

import base64
import copyreg
import io
import json
import lzma
import math
import os
import subprocess
import sys
import threading
import zlib

import pytest
import torch
from torch import nn

import torchq
from torchq import AffineQuantizedTensor, CheckpointError
from torchq.checkpoint import codec
from torchq.layouts.int4_native import Int4NativeLayout


# -- crafting pickles -----------------------------------------------------------------------------
class Reduce:
    """Pickles as ``fn(*args)`` (then ``BUILD state`` when given)."""

    def __init__(self, fn, args: tuple, state=None) -> None:
        self.r = (fn, args) if state is None else (fn, args, state)

    def __reduce_ex__(self, proto):
        return self.r


class NewObj:
    """Pickles as ``NEWOBJ cls`` + ``BUILD state``: an instance made without running ``__init__``."""

    def __init__(self, cls: type, state: dict) -> None:
        self._cls, self._state = cls, state

    @property
    def __class__(self):  # what pickle checks for copyreg.__newobj__
        return self._cls

    def __reduce_ex__(self, proto):
        return (copyreg.__newobj__, (self._cls,), self._state)


def saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load(blob: bytes):
    return torch.load(io.BytesIO(blob), weights_only=True)


def torchq_safe_globals() -> set[str]:
    return {f"{g.__module__}.{g.__qualname__}" for g in torch.serialization.get_safe_globals()
            if getattr(g, "__module__", "").startswith("torchq")}


# -- item 1: the allow-list -------------------------------------------------------------------------
def test_allow_list_holds_only_the_two_rebuild_functions():
    assert torchq_safe_globals() == {"torchq._rebuild_quantized_tensor", "torchq._rebuild_object"}


def fake_int4_impl() -> NewObj:
    """An allow-listed class built without its checks, its ``__dict__`` claiming 4096 rows
    around a 16-byte buffer."""
    return NewObj(Int4NativeLayout, {"shape": (4096, 32), "packed": torch.zeros(1, 16, dtype=torch.uint8),
                                     "spec": None, "layout": None})


def test_crafted_layout_with_fake_dict_is_refused():
    with pytest.raises(pickle_error()):
        load(saved(fake_int4_impl()))


def test_crafted_quantized_tensor_around_fake_buffers_is_refused():
    carrier = torch.zeros(1, 1, dtype=torch.bfloat16)
    fn, args = carrier.__reduce_ex__(2)
    state = {"tensor_impl": fake_int4_impl(), "transposed": False, "act_quant": None, "label": "x", "config": None}
    blob = saved(Reduce(torch._tensor._rebuild_from_type_v2, (fn, AffineQuantizedTensor, args, state)))
    with pytest.raises(pickle_error(), match="AffineQuantizedTensor|Int4NativeLayout"):
        load(blob)


def test_crafted_config_instance_is_refused():
    """Configs are rebuilt from JSON by their constructor, never by NEWOBJ + BUILD."""
    blob = saved(NewObj(torchq.Int4WeightOnlyConfig, {"group_size": -7, "layout": "nonsense"}))
    with pytest.raises(pickle_error()):
        load(blob)


def pickle_error() -> type[Exception]:
    import pickle

    return pickle.UnpicklingError


def _objects() -> dict:
    """Every kind of torchq object a state dict, or a file next to one, holds."""
    from torchq.canonical import QuantSpec
    from torchq.layouts.base import registered_layouts

    torch.manual_seed(0)
    configs = {
        "int4-native": torchq.int4_weight_only(group_size=32),
        "int4-cpu": torchq.int4_weight_only(group_size=32, layout=torchq.Int4CPULayout()),
        "int4-packed": torchq.int4_weight_only(group_size=32, layout=torchq.PackedBitsLayout()),
        "int4-plain-int-zero": torchq.int4_weight_only(group_size=64, layout=torchq.PlainLayout(), zero_point_domain="int"),
        "int8wo": torchq.int8_weight_only(),
        "int8dq": torchq.int8_dynamic_activation_int8_weight(),
        "intx3": torchq.intx_weight_only(bits=3, group_size=32),
        "intx5-sym": torchq.intx_weight_only(bits=5, group_size=None, mapping_type="symmetric"),
        "nf4": torchq.nf4_weight_only(block_size=64),
        "nf4-no-dq": torchq.nf4_weight_only(block_size=32, double_quant=False),
        "fp4": torchq.fp4_weight_only(block_size=64),
        "llm_int8": torchq.llm_int8(threshold=5.0),
    }
    out: dict = {}
    for name, cfg in configs.items():
        m = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 8, bias=False)).to(torch.bfloat16)
        torchq.quantize_(m, cfg)
        out[f"sd/{name}"] = m.state_dict()
        out[f"param/{name}"] = m[0].weight  # an nn.Parameter
        out[f"tensor/{name}"] = m[0].weight.detach()
        out[f"transposed/{name}"] = m[1].weight.detach().t()
        out[f"config/{name}"] = cfg
        out[f"spec/{name}"] = m[0].weight.spec
        out[f"act/{name}"] = m[0].weight.act_quant
    for lname, cls in registered_layouts().items():
        out[f"layout/{lname}"] = cls()
    out["act/per_token"] = torchq.PerTokenInt8()
    out["act/outlier"] = torchq.OutlierInt8(4.0)
    out["enum/zpd"] = list(torchq.ZeroPointDomain)
    out["enum/mapping"] = list(torchq.MappingType)
    out["spec/plain"] = QuantSpec((1, 32), -8, 7, torchq.ZeroPointDomain.NONE)
    return out


def _expected(obj):
    """A plain description of ``obj`` that loads without torchq (str, plain tensors, lists)."""
    if isinstance(obj, AffineQuantizedTensor):
        record, parts = codec.encode(obj)
        return ["aqt", isinstance(obj, nn.Parameter), codec.dumps(record), parts]
    if isinstance(obj, dict):
        return {k: _expected(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_expected(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return ["tensor", obj]
    return ["object", f"{type(obj).__module__}.{type(obj).__qualname__}", repr(obj)]


_CHECK = """
import sys, torch, torchq
from torchq.checkpoint import codec
from torch import nn
got = torch.load(sys.argv[1], weights_only=True)
want = torch.load(sys.argv[2], weights_only=True)

def check(g, w, where):
    if isinstance(w, dict):
        assert isinstance(g, dict) and g.keys() == w.keys(), where
        for k in w:
            check(g[k], w[k], f"{where}/{k}")
    elif w[0] == "aqt":
        assert isinstance(g, torchq.AffineQuantizedTensor), (where, type(g))
        assert isinstance(g, nn.Parameter) == w[1], (where, "Parameter")
        record, parts = codec.encode(g)
        assert codec.dumps(record) == w[2], where
        assert parts.keys() == w[3].keys() and all(torch.equal(parts[k], w[3][k]) for k in parts), where
    elif w[0] == "tensor":
        assert type(g) is type(w[1]) and torch.equal(g, w[1]), where
    elif w[0] == "object":
        assert f"{type(g).__module__}.{type(g).__qualname__}" == w[1] and repr(g) == w[2], (where, repr(g), w[2])
    else:
        assert isinstance(g, list) and len(g) == len(w), where
        for i, (a, b) in enumerate(zip(g, w)):
            check(a, b, f"{where}[{i}]")

check(got, want, "")
safe = {f"{x.__module__}.{x.__qualname__}" for x in torch.serialization.get_safe_globals() if x.__module__.startswith("torchq")}
print("OK", len(got), sorted(safe))
"""


def test_everything_torchq_pickles_loads_weights_only_with_just_import_torchq(tmp_path):
    """Every config's state dict, its weights as Parameter, tensor and transposed view, configs,
    specs, activation schemes, layouts and enums, pickled standalone: a fresh process loads them
    with ``weights_only=True`` after ``import torchq`` alone, every one equal to what was saved."""
    objs = _objects()
    torch.save(objs, tmp_path / "objs.pt")
    torch.save(_expected(objs), tmp_path / "want.pt")
    r = subprocess.run([sys.executable, "-c", _CHECK, str(tmp_path / "objs.pt"), str(tmp_path / "want.pt")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK" in r.stdout and "'torchq._rebuild_object', 'torchq._rebuild_quantized_tensor']" in r.stdout


# Written by torchq before the allow-list shrank (commit 2373bca): a state dict with int4 (native
# layout), int8 dynamic and NF4 weights, a detached weight, an LLM.int8 config, a layout, a
# per-token activation scheme, a spec and two enums. torch.save bytes, lzma, base64.
_GOLDEN = """
/Td6WFoAAATm1rRGAgAhARYAAAB0L+Wj4B8BCk5dACgSvGAn5w2LqFI1E1uufUG5t7MwMxiuxXflOLahidrkXpqIyP24JTUA+Tft
K6V9+4eCvwwZpT9KGo3nUrHwh4ug5QpMggObilEntBnXUhglNEhlJJysI24AHOWgYgBbs+IprC5Aqv+GqzfSJ02UMjPhnHchhwUS
Gyh0lmxlllQwIHtAnKE7/tUjs0KtOAkRNWMd84tvb3FUBbRs6JV0ka056Pxsq9Tpm25310irGtJxAqHSZwtVGg5dnwDuuOHKsOMh
+HGhd1zAULLUwQdzwzlf8RZr+7YSRYonaTNVHL2JPfYgR6xKu0EOHfB/eiVz/DkxGaeNUOLNP3fsADSHuDuSyGXm689JEvep7Db1
kYknMW6/fYDFsYtm6aKI2KCReDkGZkwkBfmR68LpBJDVReQqTmzt/x2+fEUrencjN+CUYhp2KWalR7az246/yiOhWiAm9AXQ/HVe
FB1uJ33zxezGx6TGfsWe4uOGrVzXCLqSdzHDQTlBq11zuJZxMrTi1SzEnGjLzHHpxcnG4Y0MsZu11lVYNQJDp1MfqKybe9FKBLtb
0PJKGSd/AL8y4lgrYYxm7xX3VyRbtx4YlfzAaJTk3O3jWYtOTQDmubTJPMq1RA/YXEnj4N9CdOamC0sHP2MUgC6Z1+xZINi4aCWj
bHp7hIhrjR47fhyy/CvYuotUh4lWXpUVb9Q56zgbmebNsZJyRB+uUkuw8jp7hGPu78XBFP/chgcPR7QghxBQwa8lvloszIleq/bu
Na7bApS93PogInRo9r0WaaaAWWIVgBYTxqpI+AL0u3w7+OV3qc3DjMWMEuuOeAqhFKeIdNFrflbSo1eEltglHeu5EGQerHLukHLy
KTZfTg5NsXT66i02yyVCxm8gId/sdMSF3pSyVxZoSVTEbkZl1TEmFlpxnD9d2Jv2/PbwPjH8ENFaGNe+BL2owlqbPXkxpla80yp3
YjEajzPBBhp5f6VGaHfIyW+pVUYOT16DQvyvhSArA8XDL4tFfqH/xpIyeQ0qC6qLey1JNfFomoYksFSXmNb0fXLVtCpUOLSsJKRc
WRJCUoy1U8UYApV947TDRc+bPwrttn8R/aTFQo6ZqyVIS7dRejkXOfr+Y5cP5SxZqa6FDOXGyDIZhW6Yj3Sz5mLiyKPBmrmIth0I
asrNTeKXTHIHTRfA4DfyJV3jVoFP3bXZMoXfrFgzL9rQWLJTn9YspKB22EmBOYkoBfPWolRHw3h1S/ojLFQeLj7ZYJXYI0H/+N+l
6s0Hkwwhs7XwlkIZIb/f1y8vrBapTQucmHguJbLj4uD7Jhs7G2VwR6kf7rqWJJ6r8PQwm3NAnp3qS36Mkqp3t8f9xYC/Q8JLDmvW
D7qm9S8QsWnpSRgR0Ljh+Tm/dpHafA0UXmGIzJ9UP2255oALs9xNoQxYag8p6vLAIDTa6f9dmtUCjc1DEDTULDrmTj3El1nyX2+R
C+o3/eGPTomnajA7MakSRvlMZKKBpshUahLLpnje1dlURRKnzf1oJvDieN4xVflFT1VxI6YTL/pJE+CWZUt1w9UqGT2iLMLoUWVs
0g8rXP+RMdfnhtYrvMJGQML+KY570owPW098mc7R4y9yw5boWjSHw6ac1ObmAXTgxNM1rDCZDB5NP6TO+MwKluOf6APfW06Dr2C7
XXg27NK5q03Yh9I32Tv6pW5CXiRfjiCv7+8bF7q6fzdXTSZKTaL2f1KgexYAdeQxN5Hgs7LPjl/Ue4KBjpQQS4yNHms/kU2tBvZX
EO+8ThSTk0Z8kcIom84wiVeNHtqEuHFiRJbaPrjUpZUpzKYtuitAFqM2WeDSSDjE/Wv5Y0+I+WtjExwjYXUm1XwxlL6GwFU6ioBw
kwlIE75lmoZ3Bb6tELpjc3cEIWMxhroyf7+KeXE0+GAV3HmAHpjQVfxY1q0Jbv5thUu2bn4LpB7gfZU56AmQnb0H51dcuEjKnVwj
HAekIzFnQg5xIdBbIUVuxrrgj3hDjpm3PeUAL3kZkZb/o8In7zRb9EzSe/wWENyQuq9QUINF06MoqiqqAGI8V6KUE1mK8fkcMSQM
WKD2BuoDLWdW005twD1KAEQRFOfNfrkfY/ci4srpNFakWeYyEJTljUL+j9Yr/+oje1WB7kgLi7l64FL+LXAALhCJv3HwCtKolcpX
i9mWn4Yu0raaWTha+mq4qx4A3AV/AcE8WWisE4+g6hn0CAbdkmoeDUmt7ijDPKy4E1EpNWDiU4B6HFY900mU1LNp7RutWLidzgHa
mIvELp0/UhnCkChD5E1zFb6YxfQ1GYu4/rGqyvrq5iZftkz4CS9iFLx0PQuH7nkwzdOAV07JGhzL3GasWqAcXKATMGBU5h37FtIJ
blZphFsTlpncztPjmCnx5DcBpXvSGwSeaKMxRNsQo0J2fS0lqXlHpwP1rH77y8GPRh5fJPKi5lzR7CDFWWhG9QLkUCsFJRt2Ie7M
pZXKnc5scm3nPRguoXip8O10QA9jU5Vp4a/NXaWKCa/yvpbxLp6AsE5IKARwLOvFvBhtyP0m/pXYmh0iVVEZlXAKAN4KjywCfnnQ
AnxY0z6r+h0+wwU977/jG1NOPDWcFOXQ9vQaaqvkFZcY+NEYlQ6Np9KkSba+Snb4D3/wSd7EdHA8bO8vInM5Qq3HsRnTz7F0le47
A/G7K90cno58nPlvZ2y6PK8FeCI3IJL1JZ7QJ1nf82/q4LbGN4g1LkctIST7J4abpz/DEzBoybJuLX8I0hDh55lDAIYuoBs5Mjvb
KSKp06g39anS13rTeZtqUuAZboU1zejT9dcvagsBC2I9s+kuZ0463WDf8oNBKYVwL8JjADCeKy4nXOUrG48mk7J3wrqzYOin4yZL
yy2tmUdju6sND2AtnJwkUuL755sERhMbxL3fZPVV3sOrv2fD5D4qfE+Zlf7PWsU4EsYEfQINAB7bBa+FYYT2YjiLirGEkhYoVOUU
tb5j/j8LkFsYiT6lxIljnmvUeLVfKvlGkHAFyi65lhzB14qIsvFxHSplYUE+jg3nD7WqRecvETV98NdGvjjOGeyo04Dp+41hDbE2
KtZCS9tocRDlFzRMFVO69guP/0NfEDOKlKYUPB9dMe8K+FOxOY3UQ6az83Yjb3sU3Jvux2RP1mlKCI6M0zlRl6JQZoRLdvRPxRF2
Nc/AKzB7FHh+W5Ul4/a1HDppD3w/dDt0tZRjFQdRnvXmJEr4U7gLrYx/FTVVNkZKQjVHRlXNz8P2eBx0rr/MafVGUSWdog3VfrGx
LyK78VaEchzlGX861KXQlNbhYiM/ZN0GdZEwnFtyKLgeoGIPsvzCmpVrA0kyAGvdY5lVR1BhcN1y3Yk5bOFbwkI/ReRIEeKslQw6
9dH9sJmlSuwtdXEFceYtz4VjIM0TSCmhNKNvaZAggXYGDsm0yILBMlKqBxpdGryadsNmf2ghQEA6hWb3DyHSZ3YXxNXM3P98W4a4
R1pAbTnebfTYDItVZRM2rtcTe2f/NTHf2GzF4LGrClRBvP2casfZSnu4EQAAAAAHmTLQuYnH/wAB6hSCPgAAUWtPiLHEZ/sCAAAA
AARZWg==
"""


def test_checkpoint_written_before_the_change_still_loads():
    obj = load(lzma.decompress(base64.b64decode("".join(_GOLDEN.split()))))
    sd = obj["sd"]
    assert sorted(sd) == ["0.bias", "0.weight", "1.weight", "2.weight"]
    for k in ("0.weight", "1.weight", "2.weight"):
        assert isinstance(sd[k], AffineQuantizedTensor) and not isinstance(sd[k], nn.Parameter), k
    assert sd["0.weight"].spec.bits == 4 and sd["1.weight"].act_quant == torchq.PerTokenInt8()
    assert sd["2.weight"].spec.codebook == "nf4" and sd["2.weight"].spec.double_quant
    assert isinstance(obj["t"], AffineQuantizedTensor) and not isinstance(obj["t"], nn.Parameter)
    assert obj["t"].to_plain().equal(sd["0.weight"].to_plain())
    assert obj["cfg"] == torchq.llm_int8(5.0) and obj["layout"] == Int4NativeLayout()
    assert obj["act"] == torchq.PerTokenInt8() and obj["spec"] == sd["1.weight"].spec
    assert obj["enum"] is torchq.ZeroPointDomain.FLOAT and obj["mt"] is torchq.MappingType.SYMMETRIC
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(torch.nn.functional.linear(x, sd["2.weight"])).all()


# -- item 2: memory bombs ---------------------------------------------------------------------------
BOMB_CONFIGS = {
    "int4": lambda: torchq.int4_weight_only(group_size=32),  # bitstream codes, float zero point
    "int8wo": lambda: torchq.int8_weight_only(),  # byte codes
    "nf4": lambda: torchq.nf4_weight_only(block_size=64),  # double-quantized scale parts
}


def _expected_shapes(record: dict, n: int, k: int) -> dict[str, tuple[int, ...]]:
    from torchq.bitpack import packed_width
    from torchq.canonical import QuantSpec
    from torchq.primitives import scale_shape

    spec = QuantSpec.from_json(record["spec"])
    grid = scale_shape((n, k), spec.block_size)
    codes = (n, packed_width(k, spec.bits)) if record["codes_encoding"] == "bitstream" else (n, k)
    shapes = {"codes": codes, "scale": grid, "zero_point": grid, "scale_codes": grid,
              "scale_absmax": (-(-(grid[0] * grid[1]) // 256),), "scale_offset": ()}
    return {p: shapes[p] for p in record["parts"]}


def rebuild_args(cfg: str, n: int = 16384, k: int = 16384, *, part_kind: str = "expand",
                 crc: str = "null") -> tuple:
    """Arguments of ``torchq._rebuild_quantized_tensor`` for a weight claiming ``[n, k]``.

    ``part_kind``: ``expand`` (stride-0 views of one element), ``slice`` (contiguous views at an
    offset into a larger storage), ``real`` (contiguous tensors of their own, zero-filled);
    ``crc``: ``null`` or ``real`` (each part's true CRC)."""
    m = nn.Linear(64, 8).to(torch.bfloat16)
    torchq.quantize_(m, BOMB_CONFIGS[cfg]())
    record, small = codec.encode(m.weight)
    record["shape"] = [n, k]
    parts = {}
    for p, shape in _expected_shapes(record, n, k).items():
        seed = small[p].reshape(-1)[:1]
        if part_kind == "expand":
            t = seed.reshape([1] * len(shape)).expand(*shape) if shape else seed.reshape(())
        elif part_kind == "slice":
            t = torch.cat([seed.repeat(8), torch.zeros(math.prod(shape), dtype=seed.dtype)])[8:].view(shape)
        else:
            t = torch.zeros(shape, dtype=seed.dtype)
            if p == "scale" or p == "scale_absmax":
                t.fill_(0.5)
        parts[p] = t
        record["parts"][p] = {"dtype": codec.dtype_name(t.dtype), "shape": list(shape),
                              "crc32": codec.tensor_crc32(t) if crc == "real" else None}
    text = codec.dumps(record)
    return (codec.FORMAT_VERSION, text, zlib.crc32(text.encode()), parts, False)


def bomb_file(cfg: str, n: int = 16384, k: int = 16384, **kw) -> bytes:
    return saved(Reduce(torchq._rebuild_quantized_tensor, rebuild_args(cfg, n, k, **kw)))


@pytest.mark.parametrize("cfg", BOMB_CONFIGS)
@pytest.mark.parametrize("n, k", [(16384, 16384), (10**6, 10**5)])
def test_expanded_parts_are_refused(cfg, n, k):
    """A 3 KB pickle whose parts are stride-0 views claiming a 16384x16384 weight grew the
    process by 1.3 GB; a larger claim ended in an allocator RuntimeError."""
    blob = bomb_file(cfg, n, k)
    assert len(blob) < 8000
    with pytest.raises(CheckpointError, match=r"part '\w+': expected a contiguous tensor .* strides \[0"):
        load(blob)


@pytest.mark.parametrize("cfg", BOMB_CONFIGS)
def test_parts_inside_a_larger_storage_are_refused(cfg):
    with pytest.raises(CheckpointError, match=r"storage offset 8|storage holds \d+ bytes"):
        load(bomb_file(cfg, 64, 64, part_kind="slice", crc="real"))


@pytest.mark.parametrize("cfg", BOMB_CONFIGS)
def test_a_part_without_crc_is_refused(cfg):
    with pytest.raises(CheckpointError, match="has no crc32 in its record; torchq requires one"):
        load(bomb_file(cfg, 64, 64, part_kind="real", crc="null"))
    w = load(bomb_file(cfg, 64, 64, part_kind="real", crc="real"))  # the same with CRCs loads
    assert isinstance(w, AffineQuantizedTensor) and w.shape == (64, 64)


@pytest.mark.parametrize("shape", [[2**40, 2**40], [2**62, 2], [1, 2**63]])
def test_huge_shape_claims_are_refused(shape):
    args = list(rebuild_args("int8wo", 64, 64, part_kind="real", crc="real"))
    record = json.loads(args[1])
    record["shape"] = shape
    args[1] = codec.dumps(record)
    args[2] = zlib.crc32(args[1].encode())
    with pytest.raises(CheckpointError, match=r"more than 2\*\*48 elements"):
        torchq._rebuild_quantized_tensor(*args)


def test_shape_claim_not_matching_the_parts_is_refused():
    args = list(rebuild_args("int4", 64, 64, part_kind="real", crc="real"))
    record = json.loads(args[1])
    record["shape"] = [64, 128]  # parts are for 64x64
    args[1] = codec.dumps(record)
    args[2] = zlib.crc32(args[1].encode())
    with pytest.raises(CheckpointError, match=r"part 'codes' has shape \[64, 32\].*needs \[64, 64\]"):
        torchq._rebuild_quantized_tensor(*args)


_MEASURE = """
import resource, sys, torch, torchq, torchq.cli
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for f in sys.argv[1:]:
    try:
        torch.load(f, weights_only=True)
    except torchq.CheckpointError:
        pass
    else:
        raise SystemExit(f"{f} loaded")
print("base_kb", base, "growth_kb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
"""


def test_bombs_stay_within_bounded_memory(tmp_path):
    """Peak RSS of a fresh process loading every bomb grows by less than 50 MB (it grew by 1.3 GB
    per 16384x16384 claim); ``python -m torchq inspect`` of one exits 1 with one line, its peak
    RSS within 100 MB of a process that only imported torchq."""
    files = []
    for cfg in BOMB_CONFIGS:
        for n, k in [(16384, 16384), (10**6, 10**5)]:
            f = tmp_path / f"{cfg}-{n}.pt"
            f.write_bytes(bomb_file(cfg, n, k))
            files.append(str(f))
    r = subprocess.run([sys.executable, "-c", _MEASURE, *files], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    _, base_kb, _, growth_kb = r.stdout.split()
    assert int(growth_kb) / 1024 < 50, growth_kb

    err_file = tmp_path / "stderr.txt"
    with open(err_file, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "torchq", "inspect", files[0]], stdout=subprocess.DEVNULL, stderr=err)
        killer = threading.Timer(120, p.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)  # this child's own peak RSS
        finally:
            killer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
    lines = err_file.read_text().strip().splitlines()
    assert p.returncode == 1, lines
    assert len(lines) == 1 and lines[0].startswith("torchq inspect: error:"), lines
    assert "CheckpointError" in lines[0] and "expected a contiguous tensor" in lines[0], lines
    assert (usage.ru_maxrss - int(base_kb)) / 1024 < 100, (usage.ru_maxrss, base_kb)


# -- item 10: loading is all or nothing; plain load_state_dict never converts a float model ---------
class WithIndex(nn.Module):
    """Two linears, then (registered last) a submodule holding a parameter the file stores as int32."""

    def __init__(self, int_index: bool) -> None:
        super().__init__()
        self.a = nn.Linear(64, 32)
        self.b = nn.Linear(32, 16)
        self.c = nn.Module()
        if int_index:
            self.c.idx = nn.Parameter(torch.arange(4, dtype=torch.int32), requires_grad=False)
        else:
            self.c.idx = nn.Parameter(torch.zeros(4))


def test_load_quantized_refuses_before_installing_anything(tmp_path):
    src = WithIndex(int_index=True)
    torchq.quantize_(src, torchq.int8_weight_only())
    torchq.save_quantized(src, tmp_path / "m.safetensors")  # a consistent file
    with torch.device("meta"):
        target = WithIndex(int_index=False)  # c.idx: a trainable float parameter
    before = {k: v for k, v in target.state_dict(keep_vars=True).items()}
    with pytest.raises(CheckpointError, match=r"'c.idx' is a trainable torch.float32 parameter .* torch.int32 .* not changed"):
        torchq.load_quantized(target, tmp_path / "m.safetensors")
    after = target.state_dict(keep_vars=True)
    assert all(after[k] is v and v.device.type == "meta" for k, v in before.items())


def _quantized_sd() -> dict:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    torchq.quantize_(m, torchq.int4_weight_only(group_size=32), filter_fn=lambda mod, n: n == "0")
    return load(saved(m.state_dict()))


def _float_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))


def test_plain_load_state_dict_raises_even_after_assign_true():
    """PyTorch's load_state_dict(sd, assign=True) leaves assign_to_params_buffers in sd._metadata
    (pytorch/pytorch#188166): a later plain load of the same sd converted the float model."""
    sd = _quantized_sd()
    with pytest.raises(RuntimeError, match="assign=True"):
        _float_model().load_state_dict(sd)
    first = _float_model()
    first.load_state_dict(sd, assign=True)
    assert isinstance(first[0].weight, AffineQuantizedTensor)
    for again in (sd, load(saved(sd))):  # the same dict, and a file saved from it (the flag is pickled)
        other = _float_model()
        w = other[0].weight
        with pytest.raises(RuntimeError, match=r"cannot load a quantized weight into float parameter 'weight'.*assign=True"):
            other.load_state_dict(again)
        assert other[0].weight is w and not isinstance(other[0].weight, AffineQuantizedTensor)
        third = _float_model()
        third.load_state_dict(again, assign=True)  # assign=True still converts
        assert isinstance(third[0].weight, AffineQuantizedTensor)


def test_plain_load_into_a_float_buffer_raises_even_after_assign_true():
    sd = {"w": _quantized_sd()["0.weight"]}

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", torch.zeros(32, 64))

    Holder().load_state_dict(sd, assign=True)
    sd = dict(sd)
    sd_meta = type("SD", (dict,), {})(sd)
    sd_meta._metadata = {"": {"assign_to_params_buffers": True}}  # what a leaked flag looks like
    with pytest.raises(RuntimeError, match="into float buffer 'w'"):
        Holder().load_state_dict(sd_meta)
