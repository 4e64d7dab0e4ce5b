"""Checkpoints: torch.save / torch.load(weights_only=True), safetensors, portability, tied weights."""

from __future__ import annotations

import io
import json
import pickletools
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import torchq
from torchq import CheckpointError, Int4CPULayout, PackedBitsLayout, PlainLayout
from torchq.checkpoint import codec

CONFIGS = {
    "int4-g32": lambda layout=None: torchq.int4_weight_only(group_size=32, layout=layout),
    "int4-int-zero": lambda layout=None: torchq.int4_weight_only(group_size=64, layout=layout, zero_point_domain="int"),
    "int4-sym": lambda layout=None: torchq.int4_weight_only(group_size=32, layout=layout, zero_point_domain="none"),
    "int8wo": lambda layout=None: torchq.int8_weight_only(layout=layout),
    "intx5-channel": lambda layout=None: torchq.intx_weight_only(bits=5, group_size=None, layout=layout),
    "int8dq": lambda layout=None: torchq.int8_dynamic_activation_int8_weight(layout=layout),
    "intx3": lambda layout=None: torchq.intx_weight_only(bits=3, group_size=32, layout=layout),
    "intx2-sym": lambda layout=None: torchq.intx_weight_only(bits=2, group_size=32, mapping_type="symmetric", layout=layout),
}
SUB_BYTE = [k for k in CONFIGS if not k.startswith("int8")]
LAYOUTS = {"plain": PlainLayout(), "packed": PackedBitsLayout(), "int4cpu": Int4CPULayout()}
# The CPU's best int4 layout: torchq's native one when its library is built, else PyTorch's.
BEST_INT4 = torchq.Int4NativeLayout() if torchq.native.available() else Int4CPULayout()


def layouts_for(cfg_name: str) -> list[str]:
    if cfg_name == "intx5-channel":
        return ["plain", "packed"]
    return list(LAYOUTS) if cfg_name in SUB_BYTE else ["plain"]


CASES = [(c, lay) for c in CONFIGS for lay in layouts_for(c)]


class Net(nn.Module):
    """Odd sizes (K not a multiple of the group), a bias, a buffer and a tied pair of weights."""

    def __init__(self, dtype=torch.bfloat16, tie: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 96, dtype=dtype)
        self.up = nn.Linear(96, 72, dtype=dtype)
        self.down = nn.Linear(72, 40, bias=False, dtype=dtype)
        self.head = nn.Linear(96, 11, bias=False, dtype=dtype)
        self.register_buffer("scale", torch.full((40,), 0.5, dtype=dtype))
        self.register_buffer("cache", torch.zeros(3), persistent=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.down(torch.relu(self.up(h))) * self.scale, self.head(h)


def quantized_net(cfg_name: str, layout_name: str | None = None, dtype=torch.bfloat16, tie=False) -> Net:
    torch.manual_seed(0)
    net = Net(dtype, tie)
    layout = None if layout_name is None else LAYOUTS[layout_name]
    torchq.quantize_(net, CONFIGS[cfg_name](layout), filter_fn=lambda m, n: n in ("up", "down"))
    return net


def meta_net(dtype=torch.bfloat16, tie=False) -> Net:
    with torch.device("meta"):
        return Net(dtype, tie)


IDS = torch.tensor([[1, 5, 10, 0], [3, 3, 7, 2]])


def outputs(net: nn.Module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return net(IDS)


def assert_same_outputs(a: nn.Module, b: nn.Module) -> None:
    for ya, yb in zip(outputs(a), outputs(b)):
        assert torch.equal(ya, yb)


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        x, y = sa[k], sb[k]
        assert type(x) is type(y), k
        if isinstance(x, torchq.AffineQuantizedTensor):
            assert x.to_plain().equal(y.to_plain()), k
            assert x.dtype == y.dtype and x.transposed == y.transposed and x.act_quant == y.act_quant, k
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), k


def pt_roundtrip(obj, **load_kw):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True, **load_kw)


# -- torch.save / torch.load -------------------------------------------------------------------------
@pytest.mark.parametrize("cfg_name,layout_name", CASES)
def test_torch_save_meta_assign_roundtrip(cfg_name, layout_name):
    net = quantized_net(cfg_name, layout_name)
    sd = pt_roundtrip(net.state_dict())
    fresh = meta_net()
    fresh.load_state_dict(sd, assign=True)
    fresh.cache = torch.zeros(3)
    assert_same_outputs(net, fresh)
    assert_same_state(net, fresh)
    assert fresh.up.weight.quant_layout == net.up.weight.quant_layout
    assert not fresh.up.weight.requires_grad


@pytest.mark.parametrize("cfg_name", CONFIGS)
def test_torch_save_into_quantized_model_copies_in_place(cfg_name):
    net = quantized_net(cfg_name)
    sd = pt_roundtrip(net.state_dict())
    other = quantized_net(cfg_name, "plain")
    with torch.no_grad():
        other.up.bias.zero_()
    w = other.up.weight
    other.load_state_dict(sd)
    assert other.up.weight is w  # copied into the existing tensor, repacked into its layout
    assert other.up.weight.quant_layout == PlainLayout()
    assert_same_state(net, other)  # same codes; outputs may differ by kernel when the layouts differ
    if net.up.weight.quant_layout == PlainLayout():
        assert_same_outputs(net, other)


def test_torch_save_into_float_model_errors_clearly_and_assign_converts():
    net = quantized_net("int4-g32")
    sd = pt_roundtrip(net.state_dict())
    flt = Net()
    with pytest.raises(RuntimeError, match="assign=True"):
        flt.load_state_dict(sd)
    flt = Net()
    flt.load_state_dict(sd, assign=True)
    assert isinstance(flt.up.weight, torchq.AffineQuantizedTensor)
    assert_same_outputs(net, flt)


def test_torch_load_weights_only_needs_only_import_torchq(tmp_path):
    net = quantized_net("int4-g32")
    torch.save(net.state_dict(), tmp_path / "m.pt")
    y = outputs(net)
    torch.save({"y0": y[0], "y1": y[1]}, tmp_path / "y.pt")
    script = f"""
import warnings, torch, torchq
sys_path = {str(Path(__file__).parent)!r}
import sys; sys.path.insert(0, sys_path)
from test_checkpoint import meta_net, outputs
sd = torch.load({str(tmp_path / 'm.pt')!r}, weights_only=True)
fresh = meta_net(); fresh.load_state_dict(sd, assign=True); fresh.cache = torch.zeros(3)
ref = torch.load({str(tmp_path / 'y.pt')!r}, weights_only=True)
y = outputs(fresh)
assert torch.equal(y[0], ref["y0"]) and torch.equal(y[1], ref["y1"])
print("OK")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout


def _pickle_globals(data: bytes) -> set[str]:
    z = zipfile.ZipFile(io.BytesIO(data))
    pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(z.read(pkl)):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add(f"{strings[-2]}.{strings[-1]}")
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
    return found


def test_pickled_paths_are_pinned():
    """Old checkpoints must keep loading when modules move: torchq objects pickle only through
    two functions at fixed top-level paths."""
    assert torchq._rebuild_quantized_tensor.__module__ == "torchq"
    assert torchq._rebuild_object.__module__ == "torchq"
    net = quantized_net("int8dq")
    obj = {
        "sd": net.state_dict(), "config": torchq.int4_weight_only(layout=PackedBitsLayout()),
        "layout": Int4CPULayout(), "enum": torchq.ZeroPointDomain.FLOAT, "mapping": torchq.MappingType.SYMMETRIC,
        "spec": net.up.weight.spec, "act": net.up.weight.act_quant,
    }
    buf = io.BytesIO()
    torch.save(obj, buf)
    torchq_globals = {g for g in _pickle_globals(buf.getvalue()) if g.startswith("torchq")}
    assert torchq_globals == {"torchq._rebuild_quantized_tensor", "torchq._rebuild_object"}
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    for k in ("config", "layout", "enum", "mapping", "spec", "act"):
        assert back[k] == obj[k] and type(back[k]) is type(obj[k]), k


def test_safe_globals_registered_at_import():
    """Only the two rebuild functions: an allow-listed class could be built by a pickle without its
    checks (see tests/test_checkpoint_hardening.py)."""
    safe = {f"{g.__module__}.{g.__qualname__}" for g in torch.serialization.get_safe_globals() if hasattr(g, "__qualname__")}
    assert {s for s in safe if s.startswith("torchq")} == {"torchq._rebuild_quantized_tensor", "torchq._rebuild_object"}


def test_whole_aqt_and_parameter_pickle():
    net = quantized_net("int4-g32")
    w = net.up.weight
    back = pt_roundtrip({"p": w, "t": w.detach(), "tt": w.detach().t()})
    assert isinstance(back["p"], nn.Parameter) and isinstance(back["p"], torchq.AffineQuantizedTensor)
    assert not isinstance(back["t"], nn.Parameter)
    assert back["tt"].transposed and torch.equal(back["tt"].dequantize(), w.t().dequantize())
    assert back["p"].label == "up" and back["p"].config == w.config


def test_pickle_of_narrowed_weight_saves_only_the_slice():
    net = quantized_net("int8wo")
    part = net.up.weight.detach()[8:16]
    buf = io.BytesIO()
    torch.save(part, buf)
    assert buf.getbuffer().nbytes < 4096  # not the whole 72x96 storage
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True).dequantize(), part.dequantize())


def test_pickle_detects_corrupted_codes():
    net = quantized_net("int4-g32")
    buf = io.BytesIO()
    torch.save(net.state_dict(), buf)
    data = bytearray(buf.getvalue())
    codes = codec.encode(net.up.weight)[1]["codes"]
    raw = bytes(codes.reshape(-1)[:32].tolist())
    at = data.find(raw)
    assert at > 0
    data[at + 3] ^= 0x10
    with pytest.raises(CheckpointError, match="'up'.*corrupted"):
        torch.load(io.BytesIO(bytes(data)), weights_only=True)


def test_map_location_repacks_for_the_device():
    net = quantized_net("int4-g32", "int4cpu")
    sd = pt_roundtrip(net.state_dict(), map_location="meta")
    assert sd["up.weight"].device.type == "meta"
    assert sd["up.weight"].quant_layout != Int4CPULayout()  # the CPU layout cannot live on meta


# -- safetensors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg_name,layout_name", CASES)
def test_safetensors_meta_roundtrip(tmp_path, cfg_name, layout_name):
    net = quantized_net(cfg_name, layout_name)
    files = torchq.save_quantized(net, tmp_path / "m.safetensors")
    assert files == [tmp_path / "m.safetensors"]
    fresh = meta_net()
    with pytest.warns(torchq.LoadWarning, match="cache"):  # the non-persistent buffer stays on meta
        out = torchq.load_quantized(fresh, tmp_path / "m.safetensors", device="cpu")
    assert out is fresh
    fresh.cache = torch.zeros(3)
    assert_same_state(net, fresh)
    assert_same_outputs(net, fresh)
    assert fresh.up.weight.quant_layout == net.up.weight.quant_layout
    assert fresh.up.weight.config == net.up.weight.config


def test_safetensors_file_is_plain_and_self_describing(tmp_path):
    net = quantized_net("int4-g32")
    torchq.save_quantized(net, tmp_path / "m.safetensors", metadata={"model": "Net"})
    tensors = load_file(tmp_path / "m.safetensors")  # readable without torchq
    assert set(tensors) == {"emb.weight", "up.weight:codes", "up.weight:scale", "up.weight:zero_point", "up.bias",
                            "down.weight:codes", "down.weight:scale", "down.weight:zero_point", "head.weight", "scale"}
    assert tensors["up.weight:codes"].dtype == torch.uint8 and tuple(tensors["up.weight:codes"].shape) == (72, 48)
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["model"] == "Net"
    header = json.loads(meta["torchq"])
    rec = header["quantized"]["up.weight"]
    assert header["version"] == 1 and rec["version"] == 1 and rec["codes_encoding"] == "bitstream"
    assert rec["layout"]["type"] == BEST_INT4.name and rec["config"]["type"] == "Int4WeightOnlyConfig"
    assert rec["shape"] == [72, 96] and rec["dtype"] == "bfloat16"
    # the documented decoding by hand: unpack the bit stream, add quant_min, dequantize
    from torchq.bitpack import unpack_bits

    codes = unpack_bits(tensors["up.weight:codes"], 4, 96)
    spec = torchq.QuantSpec.from_json(rec["spec"])
    plain = torchq.PlainForm(codes + spec.quant_min, tensors["up.weight:scale"], tensors["up.weight:zero_point"], spec)
    assert torch.equal(plain.dequantize(torch.bfloat16), net.up.weight.dequantize())


def test_safetensors_shards_and_index(tmp_path):
    net = quantized_net("intx3")
    files = torchq.save_quantized(net, tmp_path / "ckpt", max_shard_size=3000)
    names = [f.name for f in files]
    assert names[-1] == "model.safetensors.index.json" and len(names) >= 3
    index = json.loads((tmp_path / "ckpt" / names[-1]).read_text())
    assert set(index["weight_map"].values()) == set(names[:-1])
    assert len({index["weight_map"][f"up.weight:{p}"] for p in ("codes", "scale", "zero_point")}) == 1
    fresh = meta_net()
    with pytest.warns(torchq.LoadWarning):
        torchq.load_quantized(fresh, tmp_path / "ckpt")
    fresh.cache = torch.zeros(3)
    assert_same_outputs(net, fresh)
    # re-saving unsharded into the same folder removes the old shards
    torchq.save_quantized(net, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["model.safetensors"]
    # and re-saving sharded (with other shard counts) leaves exactly the new checkpoint
    for size in (3000, 20000):
        again = torchq.save_quantized(net, tmp_path / "ckpt", max_shard_size=size)
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(f.name for f in again)
        fresh = meta_net()
        with pytest.warns(torchq.LoadWarning):
            torchq.load_quantized(fresh, tmp_path / "ckpt")
        assert fresh.up.weight.to_plain().equal(net.up.weight.to_plain())


def test_missing_shard_is_an_error(tmp_path):
    net = quantized_net("intx3")
    files = torchq.save_quantized(net, tmp_path / "ckpt", max_shard_size=3000)
    files[1].unlink()
    fresh = meta_net()
    with pytest.raises(CheckpointError, match="missing"):
        torchq.load_quantized(fresh, tmp_path / "ckpt")
    assert fresh.up.weight.device.type == "meta"


def test_tied_weights_saved_once_and_retied(tmp_path):
    torch.manual_seed(0)
    net = Net(tie=True)
    torchq.save_quantized(net, tmp_path / "m.safetensors")
    assert "head.weight" not in load_file(tmp_path / "m.safetensors")
    fresh = meta_net(tie=True)
    with pytest.warns(torchq.LoadWarning):
        torchq.load_quantized(fresh, tmp_path / "m.safetensors")
    assert fresh.head.weight is fresh.emb.weight
    assert torch.equal(fresh.head.weight, net.emb.weight)


def test_load_into_float_model_converts_and_into_quantized_replaces(tmp_path):
    net = quantized_net("int8dq")
    torchq.save_quantized(net, tmp_path / "m.safetensors")
    flt = Net()
    emb = flt.emb.weight
    torchq.load_quantized(flt, tmp_path / "m.safetensors")
    assert isinstance(flt.up.weight, torchq.AffineQuantizedTensor)
    assert flt.emb.weight is emb  # float entries are copied in place
    assert_same_outputs(net, flt)
    q = quantized_net("int4-g32")
    torchq.load_quantized(q, tmp_path / "m.safetensors")
    assert q.up.weight.spec == net.up.weight.spec
    assert_same_outputs(net, q)


def test_float_checkpoint_into_quantized_model_is_an_error(tmp_path):
    torch.manual_seed(1)
    torchq.save_quantized(Net(), tmp_path / "f.safetensors")
    q = quantized_net("int4-g32")
    before = {k: v for k, v in q.state_dict().items()}
    with pytest.raises(CheckpointError, match="'up.weight' is quantized in the model"):
        torchq.load_quantized(q, tmp_path / "f.safetensors")
    assert all(q.state_dict()[k] is before[k] or torch.equal(q.state_dict()[k], before[k]) for k in before
               if not isinstance(before[k], torchq.AffineQuantizedTensor))
    assert q.up.weight is q.state_dict()["up.weight"] or q.up.weight.to_plain().equal(before["up.weight"].to_plain())


def test_plain_float_safetensors_file_loads(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(2)
    src = Net()
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "plain.safetensors"))
    fresh = meta_net()
    with pytest.warns(torchq.LoadWarning):
        torchq.load_quantized(fresh, tmp_path / "plain.safetensors")
    fresh.cache = torch.zeros(3)
    assert_same_outputs(src, fresh)


def test_strict_false_loads_matching_entries_with_a_warning(tmp_path):
    net = quantized_net("int4-g32")
    sd = {k: v for k, v in net.state_dict().items() if k != "scale"}
    torchq.save_quantized(sd, tmp_path / "m.safetensors")
    fresh = Net()
    with pytest.raises(CheckpointError, match="missing from the checkpoint: 'scale'"):
        torchq.load_quantized(fresh, tmp_path / "m.safetensors")
    with pytest.warns(torchq.LoadWarning, match="strict=False"):
        torchq.load_quantized(fresh, tmp_path / "m.safetensors", strict=False)
    assert isinstance(fresh.up.weight, torchq.AffineQuantizedTensor)


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="meta"):
        torchq.save_quantized(meta_net(), tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="max_shard_size"):
        torchq.save_quantized(Net(), tmp_path / "m.safetensors", max_shard_size="1GB")
    with pytest.raises(ValueError, match="max_shard_size"):
        torchq.save_quantized(Net(), tmp_path / "d", max_shard_size="lots")
    with pytest.raises(ValueError, match="metadata"):
        torchq.save_quantized(Net(), tmp_path / "m.safetensors", metadata={"torchq": "x"})
    with pytest.raises(TypeError, match="nn.Module or a state dict"):
        torchq.save_quantized(42, tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="layout"):
        torchq.load_quantized(Net(), tmp_path / "m.safetensors", layout="fastest")
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        torchq.load_quantized(Net(), tmp_path / "nothing.safetensors")


# -- portability -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg_name", ["int4-g32", "int4-int-zero", "intx3"])
@pytest.mark.parametrize("src", list(LAYOUTS))
@pytest.mark.parametrize("dst", list(LAYOUTS))
def test_save_in_one_layout_load_in_another(tmp_path, cfg_name, src, dst):
    net = quantized_net(cfg_name, src)
    torchq.save_quantized(net, tmp_path / "m.safetensors")
    fresh = meta_net()
    with pytest.warns(torchq.LoadWarning):
        torchq.load_quantized(fresh, tmp_path / "m.safetensors", layout=LAYOUTS[dst])
    assert fresh.up.weight.quant_layout == LAYOUTS[dst]
    assert torch.equal(fresh.up.weight.dequantize(), net.up.weight.dequantize())
    assert fresh.up.weight.to_plain().equal(net.up.weight.to_plain())
    # and through torch.save into an existing model of the destination layout
    other = quantized_net(cfg_name, dst)
    other.load_state_dict(pt_roundtrip(net.state_dict()))
    assert other.up.weight.quant_layout == LAYOUTS[dst]
    assert other.up.weight.to_plain().equal(net.up.weight.to_plain())


def test_layout_auto_picks_the_device_best(tmp_path):
    net = quantized_net("int4-g32", "packed")
    torchq.save_quantized(net, tmp_path / "m.safetensors")
    fresh = meta_net()
    with pytest.warns(torchq.LoadWarning):
        torchq.load_quantized(fresh, tmp_path / "m.safetensors", layout="auto")
    assert fresh.up.weight.quant_layout == BEST_INT4


def test_unknown_saved_layout_falls_back_to_the_device_best():
    net = quantized_net("int4-g32", "packed")
    record, parts = codec.encode(net.up.weight)
    record["layout"] = {"type": "some_future_layout", "tile": 8}
    w = codec.decode(record, parts, name="up.weight")
    assert w.quant_layout == BEST_INT4
    assert torch.equal(w.dequantize(), net.up.weight.dequantize())


def test_to_device_meta_and_back_never_requantizes():
    net = quantized_net("int4-g32", "int4cpu")
    w = net.up.weight
    plain = w.to_plain()
    moved = w.to("meta")
    assert moved.device.type == "meta" and moved.spec == w.spec
    assert w.to("cpu") is w or w.to("cpu").to_plain().equal(plain)
    assert w.to_layout(PackedBitsLayout()).to_layout(Int4CPULayout()).to_plain().equal(plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cfg_name", ["int4-g32", "int8wo", "intx3"])
def test_cuda_cpu_portability(tmp_path, cfg_name):
    net = quantized_net(cfg_name)
    gpu = quantized_net(cfg_name).to("cuda")
    assert torch.equal(gpu.up.weight.dequantize().cpu(), net.up.weight.dequantize())
    torchq.save_quantized(gpu, tmp_path / "g.safetensors")
    back = meta_net()
    with pytest.warns(torchq.LoadWarning):
        torchq.load_quantized(back, tmp_path / "g.safetensors", device="cpu")
    assert back.up.weight.to_plain().equal(net.up.weight.to_plain())
    sd = pt_roundtrip(gpu.state_dict(), map_location="cpu")
    assert sd["up.weight"].device.type == "cpu"
    assert sd["up.weight"].to_plain().equal(net.up.weight.to_plain())
    on_gpu = meta_net()
    with pytest.warns(torchq.LoadWarning):
        torchq.load_quantized(on_gpu, tmp_path / "g.safetensors", device="cuda")
    assert torch.equal(on_gpu.up.weight.dequantize().cpu(), net.up.weight.dequantize())


# -- atomicity -----------------------------------------------------------------------------------------
def test_failed_load_leaves_model_unchanged(tmp_path):
    net = quantized_net("int4-g32")
    torchq.save_quantized(net, tmp_path / "m.safetensors")
    data = bytearray((tmp_path / "m.safetensors").read_bytes())
    data[-5] ^= 0xFF  # corrupt the last tensor's data: detected only after earlier ones are read
    (tmp_path / "bad.safetensors").write_bytes(bytes(data))
    target = quantized_net("int8wo")
    before = {k: (v.to_plain() if isinstance(v, torchq.AffineQuantizedTensor) else v.clone()) for k, v in target.state_dict().items()}
    objs = {k: v for k, v in target.named_parameters()}
    with pytest.raises(CheckpointError, match="corrupted"):
        torchq.load_quantized(target, tmp_path / "bad.safetensors")
    for k, v in target.state_dict().items():
        if isinstance(v, torchq.AffineQuantizedTensor):
            assert v.to_plain().equal(before[k])
        else:
            assert torch.equal(v, before[k])
    assert all(getattr_path(target, k) is p for k, p in objs.items())


def getattr_path(mod: nn.Module, name: str):
    for part in name.split("."):
        mod = getattr(mod, part)
    return mod


def test_loaded_tensors_are_aligned_and_independent_of_the_file(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(40, 24), nn.Linear(24, 40)).to(torch.bfloat16)
    torchq.quantize_(net, torchq.int8_weight_only())
    torchq.save_quantized(net, tmp_path / "m.safetensors")
    with torch.device("meta"):
        fresh = nn.Sequential(nn.Linear(40, 24), nn.Linear(24, 40)).to(torch.bfloat16)
    torchq.load_quantized(fresh, tmp_path / "m.safetensors")
    (tmp_path / "m.safetensors").write_bytes(b"")  # the loaded model must not read the file any more
    for p in fresh.parameters():
        for t in [getattr(p, n) for n in p.tensor_impl.tensor_names()] if isinstance(p, torchq.AffineQuantizedTensor) else [p]:
            assert t.data_ptr() % 16 == 0
    x = torch.randn(8, 40, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), net(x))


def test_int8_kernel_with_unaligned_codes_does_not_crash():
    """PyTorch's bf16 int8 weight-only kernel segfaults for M > 1 on codes that are not 16-byte
    aligned; the op copies such codes (and warns once)."""
    torch.manual_seed(0)
    lin = nn.Linear(2048, 64).to(torch.bfloat16)
    torchq.quantize_(lin, torchq.int8_weight_only())
    buf = torch.zeros(64 * 2048 + 64, dtype=torch.int8)
    unaligned = buf[8:8 + 64 * 2048].view(64, 2048)
    unaligned.copy_(lin.weight.codes)
    assert unaligned.data_ptr() % 16 == 8
    x = torch.randn(8, 2048, dtype=torch.bfloat16)
    ref = torchq.layouts.plain.int8_weight_only_mm(x, lin.weight.codes, lin.weight.scale)
    with pytest.warns(RuntimeWarning, match="16-byte"):
        y = torchq.layouts.plain.int8_weight_only_mm(x, unaligned, lin.weight.scale)
    assert torch.equal(y, ref)
