"""One quantized weight as device-independent plain tensors plus a JSON record (format v1).

Both checkpoint formats (``torch.save`` pickles and safetensors files) store a quantized weight
this way, never as a layout's packed bytes, so a checkpoint loads on any device and any layout.

The record is a JSON object::

    format      "torchq.aqt"
    version     1
    shape       [N, K]          the logical weight shape, before ``transposed``
    dtype       "bfloat16"      dtype of the dequantized values (and of linear outputs)
    transposed  false
    spec        QuantSpec JSON  block size, code range, zero-point domain
    layout      Layout JSON     the layout it was saved from (a hint: loading may repack)
    act_quant   null | JSON     activation quantization: dynamic (e.g. per-token int8) or static (its calibrated scale, zero point)
    config      null | JSON     the config that produced it (informational)
    label       null | "name"   the layer name, used in messages
    compute_dtype "bfloat16"    optional: the dtype linears compute in (absent: the input's dtype)
    codes_encoding "bitstream" | "bytes" | "float8" (float8_e4m3fn codes: the e4m3fn codebook's bytes)
    parts       {"codes": P, "scale": P, "zero_point": P}   (no zero_point when the domain is NONE;
                "input_scale": P, fp32 [K], only for a weight with an input scale: AWQ's;
                "input_perm": P, int64/int32 [K], a permutation of 0..K-1, only for a weight with an
                input permutation: activation-order imports)
                P = {"dtype": "uint8", "shape": [...], "crc32": int | null}

Bytes of the parts for an ``[N, K]`` weight with ``b``-bit codes and ``G = ceil([N, K] / block)``
scale entries:

* ``codes``: ``bitstream`` when ``b <= 7``: uint8 ``[N, ceil(K/8)*b]``, the values
  ``q - quant_min`` as one big-endian bit stream per row (see :mod:`torchq.bitpack`);
  ``bytes`` when ``b == 8``: the int8/uint8 codes ``[N, K]`` themselves;
* ``scale``: ``G`` floats of the scale dtype; ``zero_point``: ``G`` entries, integer (INT domain)
  or float (FLOAT domain).

``crc32`` is zlib's CRC-32 of each part's bytes (little-endian, row-major); it is required (null
only for a part saved without data, on the ``meta`` device) and loading verifies it, so a flipped
bit anywhere in the codes or scales is an error rather than a wrong weight.

Loading trusts no size a file claims: every part must be a contiguous tensor whose storage holds
exactly its bytes (no expanded or strided views: a few stored bytes cannot stand for a large part)
and whose shape is what the record's weight shape implies, all checked before anything is
allocated in proportion to the weight; so memory use is bounded by the bytes actually present.
"""

from __future__ import annotations

import ctypes
import math
import zlib
from typing import Any

import torch

from ..activation import activation_from_json
from ..bitpack import packed_width
from ..canonical import FLOAT8_CODEBOOK, NestedScale, PlainForm, QuantSpec, decode_codes, encode_codes, has_data
from ..configs import config_from_json
from ..float8 import FLOAT8_DTYPE
from ..layouts.base import Layout, choose_layout, layout_from_json, placement_reason, registered_layouts
from ..primitives import ZeroPointDomain, scale_shape
from ..serialization import CheckpointError, check_version, dumps, is_int, loads
from ..tensor import AffineQuantizedTensor, is_permutation

__all__ = [
    "CheckpointError",
    "FORMAT",
    "FORMAT_VERSION",
    "encode",
    "decode",
    "parse_record",
    "tensor_crc32",
    "dtype_name",
    "dtype_from_name",
    "resolve_layout",
    "LayoutPolicy",
    "dumps",
    "loads",
    "check_version",
    "is_int",
]

FORMAT = "torchq.aqt"
FORMAT_VERSION = 1
LayoutPolicy = str | Layout  # "saved", "auto", or a Layout instance
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_NUMEL = 2**48  # a weight claiming more elements is refused before any arithmetic on it


# -- small helpers -------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any, what: str) -> torch.dtype:
    d = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype) or dtype_name(d) != name:  # canonical names only, no aliases
        raise CheckpointError(f"{what}: unknown dtype {name!r}")
    return d


def tensor_crc32(t: torch.Tensor) -> int | None:
    """zlib CRC-32 of a tensor's bytes in row-major order (None for meta/fake tensors)."""
    if not has_data(t):
        return None
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return zlib.crc32(b"")
    return zlib.crc32((ctypes.c_ubyte * n).from_address(t.data_ptr()))


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor whose storage holds exactly its bytes (savers write whole storages)."""
    t = t.detach().contiguous()
    if has_data(t) and (t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        t = t.clone()
    return t


def check_own_storage(t: torch.Tensor, what: str) -> None:
    """A loaded tensor must be contiguous and its storage hold exactly its bytes: an expanded or
    strided view lets a few stored bytes claim a large tensor (then every copy of it is large)."""
    nbytes = t.numel() * t.element_size()
    if not t.is_contiguous() or t.storage_offset() != 0:
        raise CheckpointError(
            f"{what}: expected a contiguous tensor that starts its storage, got strides {list(t.stride())} "
            f"and storage offset {t.storage_offset()} for shape {list(t.shape)}"
        )
    if t.untyped_storage().nbytes() != nbytes:
        raise CheckpointError(
            f"{what}: its storage holds {t.untyped_storage().nbytes()} bytes, but shape {list(t.shape)} of "
            f"{t.dtype} needs exactly {nbytes}"
        )


def part_record(t: torch.Tensor, checksum: bool) -> dict:
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "crc32": tensor_crc32(t) if checksum else None}


# -- encoding ------------------------------------------------------------------------------------
def encode(w: AffineQuantizedTensor, *, checksum: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(record, tensors)`` for one quantized weight; tensors stay on the weight's device."""
    if not isinstance(w, AffineQuantizedTensor):
        raise TypeError(f"encode: expected an AffineQuantizedTensor, got {type(w).__name__}")
    plain = w.to_plain()
    spec = plain.spec
    codes, encoding = encode_codes(plain.codes, spec)
    if spec.codebook == FLOAT8_CODEBOOK:  # stored as float8_e4m3fn (safetensors F8_E4M3): what other tools read
        codes, encoding = codes.view(FLOAT8_DTYPE), "float8"
    tensors = {"codes": own_storage(codes)}
    if plain.nested is None:
        tensors["scale"] = own_storage(plain.scale)
    else:  # the fp32 scales are exactly the reconstruction of these
        tensors.update({f"scale_{k}": own_storage(v) for k, v in plain.nested.tensors().items()})
    if plain.zero_point is not None:
        tensors["zero_point"] = own_storage(plain.zero_point)
    if w.input_scale is not None:
        tensors["input_scale"] = own_storage(w.input_scale)
    if w.input_perm is not None:
        tensors["input_perm"] = own_storage(w.input_perm)
    record = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "shape": list(plain.shape),
        "dtype": dtype_name(w.dtype),
        "transposed": bool(w.transposed),
        "spec": spec.to_json(),
        "layout": w.tensor_impl.layout.to_json(),
        "act_quant": None if w.act_quant is None else w.act_quant.to_json(),
        "config": None if w.config is None else w.config.to_json(),
        "label": w.label,
        **({} if w.compute_dtype is None else {"compute_dtype": dtype_name(w.compute_dtype)}),
        "codes_encoding": encoding,
        "parts": {name: part_record(t, checksum) for name, t in tensors.items()},
    }
    return record, tensors


# -- record validation ---------------------------------------------------------------------------
class ParsedRecord:
    """A validated record: typed fields and the expected dtype/shape of every part."""

    def __init__(self, record: Any, name: str) -> None:
        where = f"quantized tensor {name!r}"
        if not isinstance(record, dict):
            raise CheckpointError(f"{where}: record must be a JSON object, got {type(record).__name__}")
        if record.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not a torchq quantized-tensor record (format {record.get('format')!r})")
        check_version(record.get("version"), FORMAT_VERSION, f"{where}: quantized-tensor format")
        known = {"format", "version", "shape", "dtype", "transposed", "spec", "layout", "act_quant", "config",
                 "label", "compute_dtype", "codes_encoding", "parts"}
        unknown = set(record) - known
        if unknown:
            raise CheckpointError(f"{where}: unknown record fields {sorted(unknown)}")
        try:
            shape = record["shape"]
            if not (isinstance(shape, list) and len(shape) == 2 and all(_is_pos_int(s) for s in shape)):
                raise CheckpointError(f"{where}: shape must be two positive ints, got {shape!r}")
            if shape[0] * shape[1] > MAX_NUMEL:
                raise CheckpointError(f"{where}: shape {shape!r} has more than 2**48 elements")
            self.shape: tuple[int, int] = (shape[0], shape[1])
            self.dtype = dtype_from_name(record["dtype"], f"{where}: dtype")
            if self.dtype not in _FLOAT_DTYPES:
                raise CheckpointError(f"{where}: dtype must be a floating dtype, got {self.dtype}")
            if not isinstance(record["transposed"], bool):
                raise CheckpointError(f"{where}: transposed must be true/false, got {record['transposed']!r}")
            self.transposed: bool = record["transposed"]
            try:
                self.spec = QuantSpec.from_json(record["spec"])
            except (KeyError, TypeError, ValueError, OverflowError) as e:
                raise CheckpointError(f"{where}: invalid spec {record['spec']!r}: {e}") from None
            if len(self.spec.block_size) != 2 or not all(_is_pos_int(b) for b in self.spec.block_size):
                raise CheckpointError(f"{where}: spec block_size must be two positive ints, got {self.spec.block_size}")
            try:
                self.act_quant = activation_from_json(record["act_quant"])
            except (TypeError, ValueError, OverflowError) as e:
                raise CheckpointError(f"{where}: {e}") from None
            self.config = _optional_config(record["config"], where)
            label = record["label"]
            if label is not None and not isinstance(label, str):
                raise CheckpointError(f"{where}: label must be a string or null, got {label!r}")
            self.label: str | None = label
            self.compute_dtype = None
            if record.get("compute_dtype") is not None:
                self.compute_dtype = dtype_from_name(record["compute_dtype"], f"{where}: compute_dtype")
                if self.compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise CheckpointError(f"{where}: compute_dtype must be float32/bfloat16/float16, got {self.compute_dtype}")
            self.saved_layout = _optional_layout(record["layout"])
            self.encoding = record["codes_encoding"]
            parts = record["parts"]
        except KeyError as e:
            raise CheckpointError(f"{where}: record is missing field {e.args[0]!r}") from None
        self.parts = self._expected_parts(parts, where)

    def _expected_parts(self, parts: Any, where: str) -> dict[str, tuple[torch.dtype, tuple[int, ...], int | None]]:
        spec, (n, k) = self.spec, self.shape
        if self.encoding == "bitstream":
            if spec.bits > 7:
                raise CheckpointError(f"{where}: bitstream codes need at most 7 bits, spec has {spec.bits}")
            codes = (torch.uint8, (n, packed_width(k, spec.bits)))
        elif self.encoding == "bytes":
            codes = (spec.code_dtype, (n, k))
        elif self.encoding == "float8":
            if spec.codebook != FLOAT8_CODEBOOK:
                raise CheckpointError(f"{where}: codes_encoding 'float8' is for the {FLOAT8_CODEBOOK} codebook, spec is {spec.describe()}")
            codes = (FLOAT8_DTYPE, (n, k))
        else:
            raise CheckpointError(f"{where}: unknown codes_encoding {self.encoding!r} (expected 'bitstream', 'bytes' or 'float8')")
        grid = scale_shape((n, k), spec.block_size)
        if spec.double_quant:
            want = {"codes": codes, "scale_codes": (torch.uint8, grid),
                    "scale_absmax": (torch.float32, (-(-math.prod(grid) // 256),)), "scale_offset": (torch.float32, ())}
        else:
            want = {"codes": codes, "scale": (torch.float32 if spec.codebook else None, grid)}
        if spec.zero_point_domain is not ZeroPointDomain.NONE:
            want["zero_point"] = (None, grid)
        if isinstance(parts, dict) and "input_scale" in parts:  # optional: its presence is the flag
            want["input_scale"] = (torch.float32, (k,))
        if isinstance(parts, dict) and "input_perm" in parts:  # optional: its presence is the flag
            want["input_perm"] = (None, (k,))
        if not isinstance(parts, dict) or set(parts) != set(want):
            got = sorted(parts) if isinstance(parts, dict) else parts
            raise CheckpointError(f"{where}: parts must be {sorted(want)} for {spec.describe()}, got {got}")
        out = {}
        for pname, (dtype, shape) in want.items():
            p = parts[pname]
            if not isinstance(p, dict) or set(p) != {"dtype", "shape", "crc32"}:
                raise CheckpointError(f"{where}: part {pname!r} must have dtype, shape and crc32, got {p!r}")
            rec_dtype = dtype_from_name(p["dtype"], f"{where}: part {pname!r}")
            rec_shape = tuple(p["shape"]) if isinstance(p["shape"], list) else None
            crc = p["crc32"]
            if crc is not None and not (is_int(crc) and 0 <= crc < 2**32):
                raise CheckpointError(f"{where}: part {pname!r} has an invalid crc32 {crc!r}")
            if rec_shape != shape:
                raise CheckpointError(f"{where}: part {pname!r} has shape {p['shape']!r}; {spec.describe()} of a {n}x{k} weight needs {list(shape)}")
            if dtype is not None and rec_dtype != dtype:
                raise CheckpointError(f"{where}: part {pname!r} has dtype {rec_dtype}; expected {dtype}")
            if pname == "input_perm" and rec_dtype not in (torch.int64, torch.int32):
                raise CheckpointError(f"{where}: input_perm must be int64 or int32, got {rec_dtype}")
            if pname == "scale" and not rec_dtype.is_floating_point:
                raise CheckpointError(f"{where}: scale must be floating point, got {rec_dtype}")
            if pname == "zero_point":
                want_float = spec.zero_point_domain is ZeroPointDomain.FLOAT
                if rec_dtype.is_floating_point != want_float or rec_dtype.is_complex or rec_dtype == torch.bool:
                    raise CheckpointError(
                        f"{where}: zero_point dtype {rec_dtype} does not fit zero_point_domain {spec.zero_point_domain.name}"
                    )
            out[pname] = (rec_dtype, shape, crc)
        return out


def _is_pos_int(v: Any) -> bool:
    return is_int(v) and v > 0


def _optional_config(d: Any, where: str):
    """The config; None when absent, or when a newer torchq wrote a config type or version this
    one does not know (the config is informational: it never changes how a loaded weight
    computes). A known config with invalid fields is an error, not silently dropped."""
    if d is None:
        return None
    from ..configs import registered_configs

    cls = registered_configs().get(d.get("type")) if isinstance(d, dict) and isinstance(d.get("type"), str) else None
    if cls is None or (is_int(d.get("version", 1)) and d.get("version", 1) > cls.version):
        return None
    try:
        return config_from_json(d)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"{where}: invalid config {d!r}: {e}") from None


def _optional_layout(d: Any) -> Layout | None:
    """The saved layout, or None when this torchq does not know it (loading then picks the
    target device's best layout; the values are the same in every layout)."""
    if not isinstance(d, dict) or not isinstance(d.get("type"), str) or d["type"] not in registered_layouts():
        return None
    try:
        return layout_from_json(d)
    except (TypeError, ValueError):
        return None


def parse_record(record: Any, name: str) -> ParsedRecord:
    return ParsedRecord(record, name)


# -- decoding ------------------------------------------------------------------------------------
def resolve_layout(policy: LayoutPolicy, saved: Layout | None, plain: PlainForm) -> Layout:
    """``"saved"``: the saved layout when it belongs on the weight's device (it can hold it there
    and, if device-specific, its kernels run there), else the device's best;
    ``"auto"``: the device's best registered layout; a Layout: exactly that one."""
    if isinstance(policy, Layout):
        return policy
    if policy == "saved" and saved is not None and placement_reason(saved, plain.spec, plain.shape, plain.scale.dtype, plain.device) is None:
        return saved
    if policy not in ("saved", "auto"):
        raise ValueError(f"layout: expected 'saved', 'auto' or a torchq Layout, got {policy!r}")
    return choose_layout(plain.spec, plain.shape, plain.scale.dtype, plain.device)


def check_part(rec: ParsedRecord, pname: str, t: Any, name: str, verify: bool) -> torch.Tensor:
    """The part tensor after checking type, dtype, shape and (when ``verify``) its CRC."""
    where = f"quantized tensor {name!r}"
    dtype, shape, crc = rec.parts[pname]
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise CheckpointError(f"{where}: part {pname!r} must be a plain tensor, got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise CheckpointError(
            f"{where}: part {pname!r} is {t.dtype} {list(t.shape)}, but its record says {dtype} {list(shape)}"
        )
    check_own_storage(t, f"{where}: part {pname!r}")
    if crc is None and has_data(t):
        raise CheckpointError(f"{where}: part {pname!r} has no crc32 in its record; torchq requires one")
    if verify and crc is not None and has_data(t):
        actual = tensor_crc32(t)
        if actual != crc:
            raise CheckpointError(
                f"{where}: part {pname!r} is corrupted (crc32 {actual:#010x}, recorded {crc:#010x})"
            )
    return t


def check_values(where: str, scale: torch.Tensor, zero: torch.Tensor | None, input_scale: torch.Tensor | None,
                 input_perm: torch.Tensor | None, k: int) -> None:
    """The value checks every decoded weight passes before it is packed, whoever read its parts
    (:func:`decode`, vLLM's per-rank loader): finite scales and float zero points, a finite
    positive input scale, an input permutation of ``0..k-1``. Meta and fake tensors are skipped."""
    if has_data(scale) and not bool(torch.isfinite(scale).all()):
        raise CheckpointError(f"{where}: scale contains NaN/inf")
    if zero is not None and has_data(zero) and zero.is_floating_point() and not bool(torch.isfinite(zero).all()):
        raise CheckpointError(f"{where}: zero_point contains NaN/inf")
    if input_scale is not None and has_data(input_scale) and not bool((torch.isfinite(input_scale) & (input_scale > 0)).all()):
        raise CheckpointError(f"{where}: input_scale must be finite and positive")
    if input_perm is not None and has_data(input_perm) and not is_permutation(input_perm):
        raise CheckpointError(f"{where}: input_perm must be a permutation of 0..{k - 1} (each index once)")


def pack_plain(where: str, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec,
               nested: NestedScale | None, layout: LayoutPolicy, saved_layout: str | None) -> Any:
    """The plain form of these parts, packed into the layout ``layout`` resolves to (see
    :func:`resolve_layout`); the plain form's or the layout's refusal (``TypeError`` /
    ``ValueError``: a part of the wrong dtype or shape, a format the layout cannot hold) becomes a
    :class:`CheckpointError` naming ``where``."""
    try:
        plain_form = PlainForm(codes, scale, zero, spec, nested)
        return resolve_layout(layout, saved_layout, plain_form).pack(plain_form)
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{where}: {e}") from e


def decode(
    record: Any,
    tensors: dict[str, torch.Tensor],
    *,
    name: str,
    device: torch.device | str | None = None,
    layout: LayoutPolicy = "saved",
    verify: bool = True,
) -> AffineQuantizedTensor:
    """Rebuild a quantized weight from its record and part tensors, moved to ``device`` (default:
    where the parts are) and packed per ``layout`` (see :func:`resolve_layout`)."""
    rec = record if isinstance(record, ParsedRecord) else parse_record(record, name)
    where = f"quantized tensor {name!r}"
    if not isinstance(tensors, dict) or set(tensors) != set(rec.parts):
        got = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
        raise CheckpointError(f"{where}: expected parts {sorted(rec.parts)}, got {got}")
    parts = {p: check_part(rec, p, tensors[p], name, verify) for p in rec.parts}
    if device is not None:
        parts = {p: t.to(device) for p, t in parts.items()}
    spec = rec.spec
    real = has_data(parts["codes"])
    codes = decode_codes(parts["codes"], spec, rec.shape[1], rec.encoding, where)
    nested = None
    if spec.double_quant:
        nested = NestedScale(parts["scale_codes"], parts["scale_absmax"], parts["scale_offset"])
        if real and not bool(torch.isfinite(nested.absmax).all() and torch.isfinite(nested.offset)):
            raise CheckpointError(f"{where}: double-quantized scale statistics contain NaN/inf")
        scale = nested.dequantize() if real else torch.empty(nested.codes.shape, dtype=torch.float32, device=codes.device)
    else:
        scale = parts["scale"]
    zero = parts.get("zero_point")
    in_scale, in_perm = parts.get("input_scale"), parts.get("input_perm")
    check_values(where, scale, zero, in_scale, in_perm, rec.shape[1])
    impl = pack_plain(where, codes.contiguous(), scale, zero, spec, nested, layout, rec.saved_layout)
    return AffineQuantizedTensor(
        impl, rec.dtype, transposed=rec.transposed, act_quant=rec.act_quant, label=rec.label, config=rec.config,
        compute_dtype=rec.compute_dtype, input_scale=None if in_scale is None else in_scale.contiguous(),
        input_perm=None if in_perm is None else in_perm.contiguous(),
    )


def logical_shape(rec: ParsedRecord) -> tuple[int, int]:
    """The tensor's visible shape (``[K, N]`` when transposed)."""
    n, k = rec.shape
    return (k, n) if rec.transposed else (n, k)


