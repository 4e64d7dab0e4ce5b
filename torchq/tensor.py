"""``AffineQuantizedTensor``: a float-looking weight that holds integer codes in a layout.

The wrapper has the float weight's shape and dtype (the dtype its dequantized values and
linear outputs take) and owns a :class:`~torchq.layouts.base.TensorImpl`. Its inner tensors are
mirrored as attributes (``weight.codes``, ``weight.scale``...) so ``__tensor_flatten__`` can
name them and ``torch.compile`` sees plain tensors. ``F.linear`` goes to the dispatch table;
the aten ops listed in ``supported_ops()`` work; any other op raises ``NotImplementedError``
naming the op and the layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import return_and_correct_aliasing

from . import dispatch
from .canonical import PlainForm, QuantSpec, code_dtype_for
from .layouts.base import Layout, TensorImpl, choose_layout
from .ops.affine import dequantize_plain
from .primitives import MappingType, ZeroPointDomain, choose_qparams_affine, quantize_affine
from .serialization import reduce_quantized_tensor
from .tracing import traced

__all__ = ["AffineQuantizedTensor"]

aten = torch.ops.aten
_OPS: dict[Any, Any] = {}


def implements(*ops):
    """Register the decorated function as the handler of aten ``ops`` on quantized weights (the
    extension point :mod:`torchq.distributed.shard_ops` adds FSDP2's ops through)."""
    def deco(fn):
        for op in ops:
            _OPS[op] = fn
        return fn

    return deco


class FlattenContext(tuple):
    """The metadata half of :meth:`AffineQuantizedTensor.__tensor_flatten__`: a plain tuple of
    immutable parts (impl metadata, wrapper dtype, transposed, activation scheme, label, config,
    compute dtype) that deep-copies as itself, so the copy a compiled graph's guard keeps is the
    object the cached flatten returns, and the guard's check is an identity test
    (:meth:`AffineQuantizedTensor.__metadata_guard__`)."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict) -> FlattenContext:
        return self

    def __copy__(self) -> FlattenContext:
        return self


class AffineQuantizedTensor(torch.Tensor):
    """A quantized ``[N, K]`` linear weight (``[K, N]`` when ``transposed``).

    Attributes: ``tensor_impl`` (codes in a layout), ``transposed``, ``act_quant`` (dynamic
    activation quantization applied by kernels, or None), ``label`` (the layer's name, used in
    warnings and errors), ``config`` (the config that produced it, or None), ``compute_dtype``
    (the dtype linears compute in: inputs of another dtype are cast to it and outputs cast back;
    None: the input's dtype), ``input_scale`` (None, or fp32 ``[K]``: a per-input-feature factor
    applied to a linear's input before the codes multiply it, as AWQ leaves where it cannot fold
    it into the previous op; the weight's value is then ``dequantized codes * input_scale`` per
    column), ``input_perm`` (None, or int64/int32 ``[K]``, a permutation: the codes' column ``j``
    multiplies input feature ``input_perm[j]``, so a linear computes ``x[..., input_perm] @ codes^T``
    and the weight's value is the dequantized codes with their columns put back in input order:
    activation-order checkpoints whose groups are not contiguous in input order, see
    :mod:`torchq.interop.compressed_tensors`).
    """

    tensor_impl: TensorImpl

    @staticmethod
    def __new__(
        cls,
        tensor_impl: TensorImpl,
        dtype: torch.dtype,
        *,
        transposed: bool = False,
        act_quant: Any = None,
        label: str | None = None,
        config: Any = None,
        compute_dtype: torch.dtype | None = None,
        input_scale: torch.Tensor | None = None,
        input_perm: torch.Tensor | None = None,
    ):
        if not isinstance(tensor_impl, TensorImpl):
            raise TypeError(f"tensor_impl: expected a torchq TensorImpl, got {type(tensor_impl).__name__}")
        tensor_impl.ensure_valid()  # validates an impl that was not built by its constructor (a pickle)
        n, k = tensor_impl.shape
        shape, strides = ((k, n), (1, k)) if transposed else ((n, k), (k, 1))
        r = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=strides, dtype=dtype, device=tensor_impl.device, requires_grad=False
        )
        r.tensor_impl = tensor_impl
        r.wrapper_dtype = dtype  # self.dtype goes through __torch_function__ (1.5 us): __tensor_flatten__ runs per guard check
        for name in tensor_impl.tensor_names():
            setattr(r, name, getattr(tensor_impl, name))
        r.transposed = bool(transposed)
        r.act_quant = act_quant
        r.label = label
        r.config = config
        r.compute_dtype = check_compute_dtype(compute_dtype)
        if input_scale is not None:
            check_input_scale(input_scale, k, tensor_impl.device)
        r.input_scale = input_scale
        if input_perm is not None:
            check_input_perm(input_perm, k, tensor_impl.device)
        r.input_perm = input_perm
        return r

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # all work is done in __new__
        pass

    def __reduce_ex__(self, proto):  # type: ignore[override]
        """Pickles as its device-independent checkpoint record (see :mod:`torchq.checkpoint.pickling`)."""
        return reduce_quantized_tensor(self)

    def requires_grad_(self, requires_grad: bool = True) -> AffineQuantizedTensor:  # type: ignore[override]
        """Quantized weights are frozen: gradients flow to a linear's input and bias, never to
        the codes, so ``requires_grad`` stays False (``nn.Parameter(w, requires_grad=True)`` and
        ``load_state_dict(assign=True)`` into a trainable float model still work)."""
        return self

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        mapping_type: MappingType | str,
        block_size: Sequence[int],
        quant_min: int,
        quant_max: int,
        *,
        eps: float | None = None,
        scale_dtype: torch.dtype | None = None,
        zero_point_dtype: torch.dtype | None = None,
        zero_point_domain: ZeroPointDomain | str = ZeroPointDomain.INT,
        preserve_zero: bool = True,
        layout: Layout | None = None,
        act_quant: Any = None,
        label: str | None = None,
        config: Any = None,
        compute_dtype: torch.dtype | None = None,
        refine_zero: Any = None,
    ) -> AffineQuantizedTensor:
        """Quantize a float 2-D weight. The layout defaults to the best one for its device;
        ``compute_dtype`` defaults to the config's (None: linears compute in the input's dtype).
        ``refine_zero(weight, scale, zero)``, if given, replaces round-to-nearest's zero points
        (same dtype and shape) before the codes are taken: an algorithm such as HQQ
        (:mod:`torchq.algorithms`)."""
        where = f" (layer {label!r})" if label else ""
        if not isinstance(weight, torch.Tensor) or isinstance(weight, AffineQuantizedTensor):
            raise TypeError(f"weight{where}: expected a float torch.Tensor, got {type(weight).__name__}")
        if not weight.is_floating_point():
            raise TypeError(f"weight{where}: expected a floating dtype, got {weight.dtype}")
        if weight.dim() != 2:
            raise ValueError(f"weight{where}: expected a 2-D [out_features, in_features] tensor, got shape {tuple(weight.shape)}")
        if weight.numel() == 0:
            raise ValueError(f"weight{where}: expected a non-empty tensor, got shape {tuple(weight.shape)}")
        if weight.device.type != "meta" and not bool(torch.isfinite(weight).all()):
            bad = int((~torch.isfinite(weight)).sum())
            raise ValueError(f"weight{where}: contains {bad} NaN/inf value(s); quantization needs finite weights")
        weight = weight.detach()
        code_dtype = code_dtype_for(quant_min, quant_max)
        scale, zero = choose_qparams_affine(
            weight, mapping_type, block_size, code_dtype, quant_min, quant_max, eps,
            scale_dtype, zero_point_dtype, zero_point_domain, preserve_zero,
        )
        if refine_zero is not None and weight.device.type != "meta":
            zero = refine_zero(weight, scale, zero)
        codes = quantize_affine(weight, block_size, scale, zero, code_dtype, quant_min, quant_max, zero_point_domain)
        plain = PlainForm(codes, scale, zero, QuantSpec(tuple(block_size), quant_min, quant_max, ZeroPointDomain(zero_point_domain)))
        if weight.device.type != "meta" and not bool(torch.isfinite(plain.dequantize(weight.dtype)).all()):
            raise ValueError(
                f"weight{where}: its range overflows {scale.dtype} scale arithmetic (|w| up to "
                f"{float(weight.abs().max()):.4g}), so some dequantized values are not finite; "
                f"quantize with scale_dtype=torch.float32"
            )
        return cls.from_plain(plain, weight.dtype, layout=layout, act_quant=act_quant, label=label, config=config,
                              compute_dtype=compute_dtype)

    @classmethod
    def from_plain(
        cls,
        plain: PlainForm,
        dtype: torch.dtype,
        *,
        layout: Layout | None = None,
        act_quant: Any = None,
        label: str | None = None,
        config: Any = None,
        compute_dtype: torch.dtype | None = None,
    ) -> AffineQuantizedTensor:
        """Wrap a plain form, packed into ``layout`` (default: best for the plain form's device).
        ``compute_dtype`` defaults to ``config.compute_dtype`` (None: the input's dtype)."""
        if len(plain.shape) != 2:
            raise ValueError(f"plain: expected 2-D codes, got shape {plain.shape}")
        if layout is None:
            layout = choose_layout(plain.spec, plain.shape, plain.scale.dtype, plain.device)
        elif not isinstance(layout, Layout):
            raise TypeError(f"layout: expected a torchq Layout, got {type(layout).__name__}")
        if compute_dtype is None:
            compute_dtype = getattr(config, "compute_dtype", None)
        return cls(layout.pack(plain), dtype, act_quant=act_quant, label=label, config=config, compute_dtype=compute_dtype)

    def _replace(self, impl: TensorImpl | None = None, **changes: Any) -> AffineQuantizedTensor:
        kw = dict(transposed=self.transposed, act_quant=self.act_quant, label=self.label, config=self.config,
                  compute_dtype=self.compute_dtype, input_scale=self.input_scale, input_perm=self.input_perm)
        kw.update(changes)
        dtype = kw.pop("dtype", self.dtype)
        out = AffineQuantizedTensor(self.tensor_impl if impl is None else impl, dtype, **kw)
        rows = self.__dict__.get("_fsdp_rows")  # an FSDP2 shard's (whole, padded) row counts, kept by .to()
        if rows is not None and out.shape == self.shape:
            out._fsdp_rows = rows
        return out

    # -- public helpers ----------------------------------------------------------------------
    @property
    def quant_layout(self) -> Layout:
        """The torchq layout (``Tensor.layout`` keeps its torch meaning, ``torch.strided``)."""
        return self.tensor_impl.layout

    @property
    def spec(self) -> QuantSpec:
        return self.tensor_impl.spec

    def to_plain(self) -> PlainForm:
        """The canonical plain form of the underlying ``[N, K]`` weight (lossless)."""
        return self.tensor_impl.to_plain()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:  # type: ignore[override]
        """Float values in ``dtype`` (default: this tensor's dtype), in this tensor's shape
        (with an ``input_scale``: the codes' values times it, per input column, in fp32 then cast;
        with an ``input_perm``: the codes' columns put back in input order)."""
        dtype = self.dtype if dtype is None else dtype
        out = _in_input_order(self, self.tensor_impl.dequantize, dtype)
        return out.t() if self.transposed else out

    def to_plain_codes(self) -> PlainForm:
        """:meth:`to_plain` where there is no ``input_scale`` (the plain form alone is the weight);
        a ValueError naming the layer otherwise, for exporters that cannot carry the scale
        (likewise for an ``input_perm``)."""
        if self.input_scale is not None:
            raise ValueError(
                f"weight {self.label or tuple(self.shape)!r} has an input_scale (AWQ): its codes alone are not the "
                f"weight; this format cannot hold the scale"
            )
        if self.input_perm is not None:
            raise ValueError(
                f"weight {self.label or tuple(self.shape)!r} has an input_perm (activation order): its codes are in "
                f"permuted column order; this format cannot hold the permutation"
            )
        return self.to_plain()

    def to_layout(self, layout: Layout) -> AffineQuantizedTensor:
        """The same codes repacked into another layout (lossless; never re-quantizes)."""
        if not isinstance(layout, Layout):
            raise TypeError(f"layout: expected a torchq Layout, got {type(layout).__name__}")
        return self._replace(layout.pack(self.to_plain()))

    def nbytes_quantized(self) -> int:
        """Bytes held by the inner tensors (codes, scales, zeros)."""
        return self.tensor_impl.nbytes()

    def __repr__(self) -> str:  # type: ignore[override]
        extra = f", act={self.act_quant.describe()}" if self.act_quant is not None else ""
        name = f", label={self.label!r}" if self.label else ""
        t = ", transposed" if self.transposed else ""
        if self.compute_dtype is not None:
            t += f", compute_dtype={self.compute_dtype}"
        if self.input_scale is not None:
            t += ", input_scale"
        if self.input_perm is not None:
            t += ", input_perm"
        return (
            f"AffineQuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"layout={self.tensor_impl.layout!r}, {self.tensor_impl.spec.describe()}{extra}{t}{name})"
        )

    # -- FSDP2 all-gather extension (see torchq.distributed.fsdp) ----------------------------
    def fsdp_pre_all_gather(self, mesh):
        """FSDP2 hook: this rank's row parts (bit-packed codes, scales, zero points), padded."""
        from .distributed.fsdp import pre_all_gather

        return pre_all_gather(self, mesh)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2 hook: the whole quantized weight from the gathered row parts."""
        from .distributed.fsdp import post_all_gather

        return post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)

    # -- subclass protocol ---------------------------------------------------------------------
    def __tensor_flatten__(self):
        # A compiled graph's guards call this for every quantized weight at every call, and its
        # runtime wrapper again to unwrap the inner tensors: built once per wrapper and reused while
        # each part is the very same object (SmolLM2 int4, compiled decode: 21.5 -> 20.3 ms/token).
        d = self.__dict__
        impl, wrapper_dtype, transposed, act, label, config, compute, in_scale, in_perm = (
            self.tensor_impl, d.get("wrapper_dtype"), self.transposed, self.act_quant, self.label, self.config,
            self.compute_dtype, d.get("input_scale"), d.get("input_perm"))
        c = d.get("_flatten_cache")
        if (c is not None and c[0] is impl and c[1] is wrapper_dtype and c[2] is transposed and c[3] is act
                and c[4] is label and c[5] is config and c[6] is compute and c[9] is in_scale and c[10] is in_perm):
            return list(c[7]), c[8]
        ctx = FlattenContext((impl.metadata(), wrapper_dtype or self.dtype, transposed, act, label, config, compute))
        names = (impl.tensor_names() + (["input_scale"] if in_scale is not None else [])
                 + (["input_perm"] if in_perm is not None else []))
        d["_flatten_cache"] = (impl, wrapper_dtype, transposed, act, label, config, compute, tuple(names), ctx, in_scale,
                               in_perm)
        return names, ctx

    @classmethod
    def __metadata_guard__(cls, expected: tuple, found: tuple) -> bool:
        """A compiled graph's guard on a quantized weight's metadata (run per weight per call):
        the very context object it was compiled with (the cached flatten, :class:`FlattenContext`
        copies as itself) passes at once; anything else is compared field by field."""
        return expected is found or expected == found

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, ctx: tuple, outer_size, outer_stride):
        meta, dtype, transposed, act_quant, label, config, compute_dtype = ctx
        input_scale, input_perm = inner.get("input_scale"), inner.get("input_perm")
        if input_scale is not None or input_perm is not None:
            inner = {k: v for k, v in inner.items() if k not in ("input_scale", "input_perm")}
        impl = TensorImpl.rebuild(meta, inner)
        return cls(impl, dtype, transposed=transposed, act_quant=act_quant, label=label, config=config,
                   compute_dtype=compute_dtype, input_scale=input_scale, input_perm=input_perm)

    def _stable_hash_for_caching(self) -> str:
        _, ctx = self.__tensor_flatten__()
        return hashlib.sha256(repr(ctx).encode()).hexdigest()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(w, cls) and not isinstance(x, cls) and not w.transposed:
                return dispatch.quantized_linear(x, w, b)
        if func is torch.Tensor.storage:  # serializers reading raw bytes (safetensors, save_pretrained)
            w = args[0]
            raise TypeError(
                f"torchq: {w.label or tuple(w.shape)!r} is a quantized weight ({w.tensor_impl.spec.describe()}) whose "
                f"values live in several packed tensors, not in one {w.dtype} storage, so safetensors "
                f"(safetensors.torch.save_file, or save_pretrained of a transformers model without torchq's "
                f"quantizer) cannot write it. Save with torchq.save_quantized(model, folder) and load with "
                f"torchq.load_quantized(model, folder), or use torch.save(model.state_dict()); for "
                f"save_pretrained, call torchq.hf.attach(model) first (quantize_ and "
                f"load_quantized do it for the model they are given)"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is None:
            aqt = _first_quantized(list(args) + list(kwargs.values()))
            if func.namespace in ("c10d", "_c10d_functional"):
                raise NotImplementedError(
                    f"torchq: {func} on the quantized weight {aqt.label or tuple(aqt.shape)!r}: this collective does "
                    f"not move quantized weights (reducing, gathering or exchanging packed codes has no meaning). "
                    f"Supported: scatter and broadcast (distribute_tensor / parallelize_module with Shard or Replicate "
                    f"placements, any src_data_rank); FSDP2 gathers row parts itself. To collect a sharded quantized "
                    f"weight, save it with torchq.distributed.checkpoint (its row parts are ordinary tensors), or call "
                    f".dequantize() on the local shard first"
                )
            if func._schema.is_mutable and args and args[0] is aqt:  # e.g. peft's merge: weight.data += delta
                raise NotImplementedError(
                    f"torchq: {func} would modify the quantized weight {aqt.label or tuple(aqt.shape)!r} in place; "
                    f"quantized weights are immutable. To change one, dequantize, modify and quantize again "
                    f"(for a PEFT adapter: torchq.hf.merge_and_unload(peft_model) does it with each weight's own "
                    f"config; requantize=False merges into float)"
                )
            raise NotImplementedError(
                f"torchq: {func} is not supported on AffineQuantizedTensor with layout "
                f"{aqt.tensor_impl.layout!r}; call .dequantize() first, or see "
                f"torchq.AffineQuantizedTensor.supported_ops()"
            )
        return handler(func, args, kwargs)

    @staticmethod
    def supported_ops() -> list[str]:
        return sorted(str(op) for op in _OPS)


AQT = AffineQuantizedTensor


def _first_quantized(values: list) -> AQT | None:
    """The first quantized weight in ``values``, looking into lists and tuples (c10d ops take lists)."""
    for v in values:
        if isinstance(v, AQT):
            return v
        if isinstance(v, (list, tuple)):
            found = _first_quantized(list(v))
            if found is not None:
                return found
    return None


def check_compute_dtype(compute_dtype: Any, arg: str = "compute_dtype") -> torch.dtype | None:
    """``compute_dtype`` if it is fp32/bf16/fp16 or None, else a ValueError naming ``arg``."""
    if compute_dtype is not None and compute_dtype not in dispatch.FLOAT_DTYPES:
        raise ValueError(f"{arg}: expected torch.float32/bfloat16/float16 or None, got {compute_dtype!r}")
    return compute_dtype


def check_input_scale(s: Any, k: int, device: torch.device, arg: str = "input_scale") -> None:
    """``s`` must be a 1-D fp32 tensor of ``k`` entries on ``device`` (values are checked where they
    come from a file: finite and positive)."""
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != (k,):
        got = f"{s.dtype} {list(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"{arg}: expected a float32 tensor of shape [{k}] (one factor per input feature), got {got}")
    if s.device != device:
        raise ValueError(f"{arg}: expected device {device} (the codes'), got {s.device}")


def check_input_perm(p: Any, k: int, device: torch.device, arg: str = "input_perm") -> None:
    """``p`` must be a 1-D int64/int32 tensor of ``k`` entries on ``device`` (that its values are a
    permutation of ``0..k-1`` is checked where they come from a file or another format:
    :func:`is_permutation`)."""
    if not isinstance(p, torch.Tensor) or p.dtype not in (torch.int64, torch.int32) or tuple(p.shape) != (k,):
        got = f"{p.dtype} {list(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__
        raise ValueError(f"{arg}: expected an int64 or int32 tensor of shape [{k}] (a permutation of the input features), got {got}")
    if p.device != device:
        raise ValueError(f"{arg}: expected device {device} (the codes'), got {p.device}")


def is_permutation(p: torch.Tensor) -> bool:
    """Whether the 1-D integer tensor ``p`` holds each of ``0..len(p)-1`` exactly once."""
    k = p.numel()
    return p.dim() == 1 and bool(torch.equal(torch.sort(p.long()).values, torch.arange(k, device=p.device)))


def _in_input_order(w: AQT, dequantize, dtype: torch.dtype) -> torch.Tensor:
    """The weight's values in ``dtype`` from ``dequantize(dtype)`` (the codes' values, in their own
    column order): columns put back in input order (``input_perm``), then times ``input_scale``
    (in fp32, one cast)."""
    s, p = w.input_scale, w.input_perm
    if s is None and p is None:
        return dequantize(dtype)
    out = dequantize(dtype if s is None else torch.float32)
    if p is not None:
        out = out.index_select(-1, torch.argsort(p))
    return out if s is None else (out * s).to(dtype)


def _untransposed(w: AQT) -> AQT:
    return w._replace(transposed=False) if w.transposed else w


def _dequant_op_fallback(what: str, w: AQT) -> None:
    """Ops that are not a linear but must touch a quantized weight compute on its dequantized
    values: visible like any fallback (warn once, or raise in strict mode)."""
    name = w.label or f"<unnamed {tuple(w.shape)} weight>"
    msg = f"layer {name!r} ({w.tensor_impl.layout!r}): {what} has no quantized kernel"
    dispatch.warn_fallback_once((name, what), msg, instead="computing with the dequantized weight",
                                forbids="computing on dequantized weights", stacklevel=4)


# -- metadata-only and copying ops ---------------------------------------------------------------
@implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    self = args[0]
    return return_and_correct_aliasing(func, args, kwargs, self._replace(self.tensor_impl.map(func)))


@implements(aten.clone.default)
def _clone(func, args, kwargs):
    self = args[0]
    s, p = self.input_scale, self.input_perm
    return self._replace(self.tensor_impl.map(torch.clone), input_scale=None if s is None else s.clone(),
                         input_perm=None if p is None else p.clone())


def _layout_left_open(w: AQT) -> bool:
    """Whether ``w``'s layout was left to automatic choice: a weight-only config without a
    layout, and ``w`` in the layout automatic choice gives on its device (a config whose mode picks
    its own layout, such as int8 activations, or a layout named later, keeps its layout)."""
    config = w.config
    return (config is not None and getattr(config, "layout", False) is None and w.act_quant is None
            and w.tensor_impl.automatic_layout())


@implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    self: AQT = args[0]
    dtype = kwargs.get("dtype") or self.dtype
    device = kwargs.get("device") or self.device
    if not dtype.is_floating_point:
        raise TypeError(
            f"to: a quantized weight's dtype is the float dtype of its dequantized values; "
            f"expected a floating dtype, got {dtype}"
        )
    impl = self.tensor_impl
    device = torch.device(device)
    moved = impl.to_device(device, automatic=device.type != impl.device.type and _layout_left_open(self))
    if moved is impl:
        moved = impl.map(torch.clone)
    s, p = self.input_scale, self.input_perm
    return self._replace(moved, dtype=dtype, input_scale=None if s is None else s.to(moved.device, copy=True),
                         input_perm=None if p is None else p.to(moved.device, copy=True))


@implements(aten.t.default, aten.transpose.int, aten.permute.default)
def _transpose(func, args, kwargs):
    self: AQT = args[0]
    if func is aten.permute.default and [d % 2 for d in args[1]] != [1, 0]:
        return return_and_correct_aliasing(func, args, kwargs, self._replace())
    if func is aten.transpose.int and args[1] % 2 == args[2] % 2:
        return return_and_correct_aliasing(func, args, kwargs, self._replace())
    return return_and_correct_aliasing(func, args, kwargs, self._replace(transposed=not self.transposed))


# -- linear ops -----------------------------------------------------------------------------------
@implements(aten.linear.default)
def _linear(func, args, kwargs):
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    if isinstance(x, AQT) or not isinstance(w, AQT) or w.transposed:
        return _matmul_on_dequantized("linear", func, args, kwargs)
    return dispatch.quantized_linear(x, w, b)


@implements(aten.mm.default)
def _mm(func, args, kwargs):
    a, b = args
    if isinstance(b, AQT) and b.transposed and not isinstance(a, AQT):
        return dispatch.quantized_linear(a, _untransposed(b), None)
    return _matmul_on_dequantized("mm", func, args, kwargs)


@implements(aten.addmm.default)
def _addmm(func, args, kwargs):
    bias, a, b = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if isinstance(b, AQT) and b.transposed and not isinstance(a, AQT) and not isinstance(bias, AQT):
        w = _untransposed(b)
        if beta == 1 and alpha == 1 and tuple(bias.shape) == (w.shape[0],):
            return dispatch.quantized_linear(a, w, bias)
        y = dispatch.quantized_linear(a, w, None)
        return beta * bias + alpha * y
    return _matmul_on_dequantized("addmm", func, args, kwargs)


def _matmul_on_dequantized(what, func, args, kwargs):
    qs = [a for a in args if isinstance(a, AQT)]
    for w in qs:
        _dequant_op_fallback(f"aten.{what} with this operand order (e.g. the input-gradient matmul)", w)
    plain_args = [a.dequantize() if isinstance(a, AQT) else a for a in args]
    return func(*plain_args, **kwargs)


# -- slicing and copying ----------------------------------------------------------------------------
def _norm_range(size: int, start, end) -> tuple[int, int]:
    start = 0 if start is None else int(start)
    end = size if end is None else int(end)
    start = max(0, start + size if start < 0 else start)
    end = min(size, max(0, end + size if end < 0 else end))
    return start, max(start, end)


@implements(aten.slice.Tensor)
def slice_weight(func, args, kwargs):
    self: AQT = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    if step != 1:
        raise NotImplementedError(f"torchq: slicing a quantized weight with step {step} is not supported (only step 1)")
    dim = dim % 2
    inner_dim = 1 - dim if self.transposed else dim
    start, end = _norm_range(self.shape[dim], start, end)
    impl = self.tensor_impl
    in_scale = self.input_scale
    if in_scale is not None and inner_dim == 1:
        in_scale = in_scale[start:end]
    if self.input_perm is not None and inner_dim == 1 and (start, end) != (0, impl.shape[1]):
        raise NotImplementedError(
            f"torchq: input features [{start}, {end}) of the quantized weight {self.label or tuple(self.shape)!r}, which "
            f"has an input_perm (activation order): its codes' columns are permuted, so a range of input features is "
            f"no range of its columns or groups and cannot be cut out (e.g. RowwiseParallel, Shard(1)); slice rows "
            f"(ColwiseParallel), quantize without activation order, or dequantize() first"
        )
    view = impl.narrow_view(inner_dim, start, end - start)
    if view is not None:
        out = self._replace(view, input_scale=in_scale)
        return return_and_correct_aliasing(func, args, kwargs, out)
    plain = impl.to_plain().narrow(inner_dim, start, end - start)
    layout = impl.layout
    if not layout.fit(plain.spec, plain.shape, plain.scale.dtype, plain.device).holds:
        layout = choose_layout(plain.spec, plain.shape, plain.scale.dtype, plain.device)
    out = self._replace(layout.pack(plain.map(torch.clone)), input_scale=in_scale)
    # Not a storage view: remember where it came from so copy_ into it reaches the parent.
    out._narrow_parent = (self, inner_dim, start, end - start)
    return out


def _metadata_diff(dst: AQT, src: AQT) -> list[str]:
    diffs = []
    a, b = dst.tensor_impl, src.tensor_impl
    if tuple(dst.shape) != tuple(src.shape):
        diffs.append(f"shape {tuple(dst.shape)} vs {tuple(src.shape)}")
    if dst.transposed != src.transposed:
        diffs.append(f"transposed {dst.transposed} vs {src.transposed}")
    if a.spec != b.spec and a.spec != _without_nesting(b.spec):
        diffs.append(f"format {a.spec.describe()} vs {b.spec.describe()}")
    if dst.dtype != src.dtype:
        diffs.append(f"dtype {dst.dtype} vs {src.dtype}")
    if dst.act_quant != src.act_quant:
        diffs.append(f"activation quantization {dst.act_quant} vs {src.act_quant}")
    if dst.compute_dtype != src.compute_dtype:
        diffs.append(f"compute_dtype {dst.compute_dtype} vs {src.compute_dtype}")
    for name in ("input_scale", "input_perm"):
        a_has, b_has = getattr(dst, name) is not None, getattr(src, name) is not None
        if a_has != b_has:
            diffs.append(f"{name} {'present' if a_has else 'absent'} vs {'present' if b_has else 'absent'}")
    return diffs


def _without_nesting(spec: QuantSpec) -> QuantSpec:
    """``spec`` with single-quantized scales: a weight with double-quantized scales copies into one
    that holds the fp32 scales they reconstruct to (the same values; a shard's form)."""
    return dataclasses.replace(spec, double_quant=False) if spec.double_quant else spec


def _copy_impl_tensors(dst: TensorImpl, src: TensorImpl) -> None:
    if dst.metadata() != src.metadata():
        raise ValueError(f"copy_: packed metadata differs after repacking: {dst.metadata()} vs {src.metadata()}")
    for n in dst.tensor_names():
        getattr(dst, n).copy_(getattr(src, n))


@implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, AQT):
        raise TypeError(
            "copy_: cannot copy a quantized weight into a float tensor. To load a quantized checkpoint "
            "into a float or meta-device model use model.load_state_dict(sd, assign=True) or "
            "torchq.load_quantized; for float values use weight.dequantize()"
        )
    if not isinstance(src, AQT):
        raise TypeError(
            f"copy_: cannot copy a float tensor into quantized weight {dst.label or tuple(dst.shape)!r} "
            f"({dst.tensor_impl.spec.describe()}); quantize it first (torchq.quantize_) so nothing "
            f"is re-quantized implicitly"
        )
    diffs = _metadata_diff(dst, src)
    if diffs:
        raise ValueError(f"copy_: source and destination quantized tensors differ: {'; '.join(diffs)}")
    src_impl = src.tensor_impl
    if src_impl.metadata() != dst.tensor_impl.metadata():  # same values, other layout: repack
        plain = src_impl.to_plain()
        if plain.nested is not None and not dst.tensor_impl.spec.double_quant:  # keep the fp32 scales they reconstruct to
            plain = PlainForm(plain.codes, plain.scale, plain.zero_point, dst.tensor_impl.spec)
        src_impl = dst.tensor_impl.layout.pack(plain)
    parent = getattr(dst, "_narrow_parent", None)
    if parent is not None and dst.input_scale is not None:
        raise NotImplementedError("copy_: into a slice of a weight with an input_scale (AWQ); copy the whole weight")
    if parent is not None and dst.input_perm is not None:
        raise NotImplementedError("copy_: into a slice of a weight with an input_perm (activation order); copy the whole weight")
    if parent is not None:
        p, dim, start, length = parent
        if getattr(p, "_narrow_parent", None) is not None:
            raise NotImplementedError("copy_: into a narrow of a narrow of a packed layout; narrow once")
        full = p.tensor_impl.to_plain().map(torch.clone)
        if full.nested is not None:  # the slice's scales would have to be double-quantized again with the rest
            raise NotImplementedError(
                f"copy_: into a slice of {p.label or tuple(p.shape)!r}, whose scales are double-quantized "
                f"({full.spec.describe()}): their nested statistics span the whole scale grid, so a slice cannot be "
                f"written without changing the other rows' scales; copy the whole weight"
            )
        region = full.narrow(dim, start, length)
        for t_dst, t_src in zip(region.tensors().values(), src_impl.to_plain().tensors().values()):
            if t_dst is not None:
                t_dst.copy_(t_src)
        _copy_impl_tensors(p.tensor_impl, p.tensor_impl.layout.pack(full))
    _copy_impl_tensors(dst.tensor_impl, src_impl)
    if dst.input_scale is not None:
        dst.input_scale.copy_(src.input_scale)
    if dst.input_perm is not None:
        dst.input_perm.copy_(src.input_perm)
    return dst


# -- row access (embedding-style use) -------------------------------------------------------------
@implements(aten.select.int)
def _select(func, args, kwargs):
    self: AQT = args[0]
    dim, index = args[1] % 2, int(args[2])
    if dim != 0 or self.transposed:
        raise NotImplementedError("torchq: select on a quantized weight is supported on dim 0 of an [N, K] weight only")
    n = self.shape[0]
    if not -n <= index < n:
        raise IndexError(f"select: index {index} out of range for dim 0 of size {n}")
    idx = torch.tensor([index % n], device=self.device)
    return _dequantized_rows(self, self.tensor_impl.plain_rows(idx))[0]


@implements(aten.index.Tensor)
def _index(func, args, kwargs):
    self: AQT = args[0]
    indices = args[1]
    if self.transposed or len(indices) != 1 or indices[0] is None:
        raise NotImplementedError("torchq: indexing a quantized weight is supported with one index tensor on dim 0")
    idx = indices[0]
    if idx.dtype == torch.bool:
        idx = idx.nonzero().flatten()
    n = self.shape[0]
    if idx.numel():
        if traced(idx):  # no data-dependent branch in a graph (it would break and guard on the ids)
            torch._assert_async(((idx >= -n) & (idx < n)).all(), f"index: indices out of range for dim 0 of size {n}")
        elif int(idx.min()) < -n or int(idx.max()) >= n:
            raise IndexError(f"index: indices out of range for dim 0 of size {n}")
    flat = idx.flatten() % n
    if flat.numel() == 0:
        return torch.empty(*idx.shape, self.shape[1], dtype=self.dtype, device=self.device)
    rows = _dequantized_rows(self, self.tensor_impl.plain_rows(flat))
    return rows.reshape(*idx.shape, self.shape[1])


def _dequantized_rows(self: AQT, plain: PlainForm) -> torch.Tensor:
    """Rows of ``self`` (their plain form ``plain``) in its dtype, in input order, with the eager
    roundings under ``torch.compile`` too (ops.affine.dequantize_plain)."""
    return _in_input_order(self, lambda dtype: dequantize_plain(plain, dtype), self.dtype)


@implements(aten.embedding.default)
def _embedding(func, args, kwargs):
    weight, indices = args[0], args[1]
    return _index(aten.index.Tensor, (weight, [indices]), {})
