"""Quantization-aware training: train through the quantizer, then convert with ``quantize_``.

``prepare(model, config)`` turns every selected linear into a QAT layer (its class is swapped in
place, as FSDP2 does, so parameters, hooks, optimizers and state-dict keys stay as they were):
its forward quantizes the current float weight with the layer's config, exactly as ``quantize_``
would, and computes the output with that quantized weight through torchq's own kernels. The
prepared model's outputs are therefore the converted model's, bit for bit, for every config
(weight-only and activation-quantizing alike: the activation quantization is the kernel's own).

The backward is straight-through: the rounding of the weight (and of the activations, for the
int8 / float8 activation configs) counts as the identity, so

* ``grad_input = grad_output @ W_q`` (``W_q``: the dequantized weight, in the gradient's dtype);
* ``grad_weight = grad_output^T @ input`` (the float input: the activation rounding is skipped);
* ``grad_bias = sum of grad_output`` over the rows.

Scales and zero points are recomputed from the current weights at every step (the default). With
``scales="learned"`` they become trainable fp32 parameters of the layer (``weight_qat_scale``,
``weight_qat_zero``), initialised from the weight, with LSQ's gradient (the rounding is
straight-through, a clipped value's code is a constant); ``convert`` then uses them. Learned scales
are for the formats calibrated algorithms use (int4, intx, NF4 / FP4 without double quantization).

``prepare_float_tuning(model)`` is the other way to train a quantized model: its quantized weights
stay as they are (after ``quantize_`` or a calibrated algorithm such as GPTQ) and only the
parameters it keeps in float train: the normalization layers' weights and biases and the layers'
biases. Gradients reach them through the quantized layers' kernels (``grad_input = grad_output @
W_q``), so a step costs a forward and a backward of the quantized model, and there is nothing to
convert: the tuned model is the deployed one.

Every forward quantizes the layer's weight anew (as ``quantize_`` would: the cost of a ``quantize_``
of the layer per forward, small next to a training step's matmuls): no cache can tell when
FSDP2's all-gather or a ``.data`` write changed a weight, since neither bumps its version counter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .algorithms.formats import AffineGroupFormat, CodebookGroupFormat, GroupFormat
from .algorithms.statistics import CALIBRATED
from .blockwise.codebooks import codebook as codebook_values
from .configs import LayerNotSupported, QuantConfig
from .primitives import ZeroPointDomain, expand_grid, mid_code
from .quantize import (
    UNSET,
    ConfigSpec,
    QuantizationError,
    config_resolver,
    default_filter,
    is_conv1d,
    quantize_,
    quantize_in_row_chunks,
    tensor_slots,
    warn_skipped,
)
from .tensor import AffineQuantizedTensor

__all__ = ["prepare", "convert", "unprepare", "prepared_layers", "prepare_float_tuning", "SCALE_MODES", "FLOAT_KINDS"]

SCALE_MODES = ("recompute", "learned")
#: What :func:`prepare_float_tuning` may train: normalization layers' parameters, layers' biases.
FLOAT_KINDS = ("norms", "biases")
_STATE = "_torchq_qat"
_SCALE, _ZERO = "weight_qat_scale", "weight_qat_zero"


@dataclass
class _LayerState:
    """What a QAT layer remembers: its config and name, the class it had, how it holds its weight."""

    config: QuantConfig
    label: str
    base: type
    transposed: bool  # a transformers Conv1D ([in, out] weight)
    learned: GroupFormat | None = None  # the format of learned scales (None: recomputed each step)
    last: AffineQuantizedTensor | None = field(default=None, repr=False)  # the quantized weight of the last forward


# -- the autograd functions ------------------------------------------------------------------------
class _QuantizedLinear(torch.autograd.Function):
    """``F.linear(x, q, bias)`` with the quantized weight ``q``; straight-through backward to
    ``carrier`` (the float weight, or the learned-scale surrogate of the dequantized weight)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, carrier: torch.Tensor, bias: torch.Tensor | None,
                q: AffineQuantizedTensor, transposed: bool) -> torch.Tensor:
        ctx.q, ctx.transposed = q, transposed
        ctx.wdtype, ctx.bdtype = carrier.dtype, None if bias is None else bias.dtype
        ctx.save_for_backward(x)
        if transposed:  # Conv1D's own arithmetic: addmm on the rows, as the converted layer does
            return F.linear(x.reshape(-1, x.shape[-1]), q, bias).reshape(*x.shape[:-1], q.shape[0])
        return F.linear(x, q, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gw = gb = None
        g2 = grad.reshape(-1, grad.shape[-1])
        if need_x:
            w = ctx.q.dequantize(grad.dtype)
            gx = (g2 @ w).reshape(x.shape).to(x.dtype)
        if need_w:
            gw = (g2.t().to(x.dtype) @ x.reshape(-1, x.shape[-1])).to(ctx.wdtype)
            gw = gw.t() if ctx.transposed else gw
        if need_b:
            gb = g2.sum(0).to(ctx.bdtype)
        return gx, gw, gb, None, None


class _QuantizedEmbedding(torch.autograd.Function):
    """``F.embedding(ids, q)`` (rows of the quantized weight, as a converted tied embedding
    reads them); straight-through backward to the float weight."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, q: AffineQuantizedTensor, padding_idx: int,
                scale_grad_by_freq: bool) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.num, ctx.padding_idx, ctx.freq, ctx.wdtype = weight.shape[0], padding_idx, scale_grad_by_freq, weight.dtype
        return F.embedding(ids, q)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        gw = None
        if ctx.needs_input_grad[1]:
            gw = torch.ops.aten.embedding_dense_backward(grad, ids, ctx.num, ctx.padding_idx, ctx.freq).to(ctx.wdtype)
        return None, gw, None, None, None


# -- learned scales: LSQ surrogates of the dequantized weight --------------------------------------
def _ste_round(v: torch.Tensor) -> torch.Tensor:
    return v + (torch.round(v) - v).detach()


def _learned_qparams(st: _LayerState, mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The learned scale (and zero) as the format stores them, straight-through from the fp32
    parameters: the scale clamped to the format's eps and cast to its dtype, an integer zero rounded
    and clamped to the code range."""
    fmt = st.learned
    s = mod._parameters[_SCALE]
    z = mod._parameters.get(_ZERO)
    if isinstance(fmt, AffineGroupFormat):
        sv = s.clamp_min(fmt.eps)
        s_used = sv + (sv.to(fmt.scale_dtype).float() - sv).detach()
        if z is None:
            return s_used, None
        if fmt.zero_point_domain is ZeroPointDomain.INT:
            zv = z.clamp(fmt.quant_min, fmt.quant_max)
            return s_used, zv + (torch.round(zv) - zv).detach()
        return s_used, z + (z.to(fmt.zero_point_dtype or fmt.scale_dtype).float() - z).detach()
    sv = s.clamp_min(torch.finfo(torch.float32).tiny)  # codebook absmax: fp32 already
    return sv, None


def _stored(fmt: GroupFormat, scale: torch.Tensor, zero: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The values of :func:`_learned_qparams` in the dtypes the format stores."""
    if isinstance(fmt, AffineGroupFormat):
        scale = scale.detach().to(fmt.scale_dtype)
        if zero is not None:
            zero = zero.detach()
            zero = zero.to(torch.uint8 if fmt.quant_min >= 0 else torch.int8) if fmt.zero_point_domain is ZeroPointDomain.INT \
                else zero.to(fmt.zero_point_dtype or fmt.scale_dtype)
        return scale, zero
    return scale.detach().float(), None


def _surrogate(fmt: GroupFormat, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    """The dequantized weight as a differentiable function of ``w``, ``s``, ``z`` (LSQ): unclipped
    values round straight through (d/dw = 1, d/ds = code - w/s), clipped ones keep their code."""
    g = fmt.group_size
    shape = w.shape
    grid = (1, g)
    se = expand_grid(s, grid, shape)
    wf = w.float()
    if isinstance(fmt, CodebookGroupFormat):
        v = wf / se
        book = codebook_values(fmt.quant_type).to(w.device)
        codes = fmt.quantize(w.detach(), s.detach(), None)
        c = book[codes.long()]
        inside = v.abs() <= 1
        q = torch.where(inside, v + (c - v).detach(), c)
        return q * se
    assert isinstance(fmt, AffineGroupFormat)
    qmin, qmax = fmt.quant_min, fmt.quant_max
    if fmt.zero_point_domain is ZeroPointDomain.FLOAT:
        ze = expand_grid(z, grid, shape)
        mid = mid_code(qmin, qmax)
        v = (wf - (ze - se * mid)) / se
        q = _clipped_round(v, qmin, qmax)
        return (q - mid) * se + ze
    v = wf * (1.0 / se)
    if fmt.zero_point_domain is ZeroPointDomain.INT:
        ze = expand_grid(z, grid, shape)
        q = _clipped_round(_ste_round(v) + ze, qmin, qmax, straight=False)
        return (q - ze) * se
    return _clipped_round(v, qmin, qmax) * se


def _clipped_round(v: torch.Tensor, qmin: int, qmax: int, straight: bool = True) -> torch.Tensor:
    """``clamp(round(v))`` with a straight-through round; a clipped value is the constant bound
    (clamp passes no gradient there)."""
    return torch.clamp(_ste_round(v) if straight else v, qmin, qmax)


# -- the QAT layers --------------------------------------------------------------------------------
@torch._dynamo.disable  # quantizing is data-dependent Python: it runs eagerly between compiled graphs
def _quantized_weight(mod: nn.Module, st: _LayerState) -> tuple[AffineQuantizedTensor, torch.Tensor]:
    """``(q, carrier)``: the layer's quantized weight now and the tensor the straight-through
    gradient goes to. Quantized at every call: no cache can tell when FSDP2's all-gather or a
    ``.data`` write changed the weight (neither bumps its version counter)."""
    w = mod.weight
    if st.learned is None:
        w2 = w.detach()
        q = quantize_in_row_chunks(st.config, w2.t().contiguous() if st.transposed else w2, label=st.label)
        st.last = q
        return q, w
    s, z = _learned_qparams(st, mod)
    w2 = w.t() if st.transposed else w
    if torch.is_grad_enabled():
        carrier = _surrogate(st.learned, w2, s, z).to(w.dtype)
        carrier = carrier.t() if st.transposed else carrier
    else:
        carrier = w
    q = _learned_quantized(st, w2.detach(), s.detach(), None if z is None else z.detach())
    st.last = q
    return q, carrier


def _learned_quantized(st: _LayerState, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> AffineQuantizedTensor:
    """The quantized weight of learned scales: codes chosen against them, in the config's layout."""
    fmt = st.learned
    scale, zero = _stored(fmt, s, z)
    codes = fmt.quantize(w, scale, zero)
    plain = fmt.plain(codes, scale, zero)
    return AffineQuantizedTensor.from_plain(plain, w.dtype, layout=getattr(st.config, "layout", None), label=st.label,
                                            config=st.config, compute_dtype=getattr(st.config, "compute_dtype", None))


class _QATLinearMixin:
    """The forward of a QAT linear (``nn.Linear`` or transformers ``Conv1D``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st: _LayerState = self.__dict__[_STATE]
        q, carrier = _quantized_weight(self, st)
        return _QuantizedLinear.apply(x, carrier, self.bias, q, st.transposed)


class _QATEmbeddingMixin:
    """The forward of an embedding tied to a QAT linear: rows of the quantized weight."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        st: _LayerState = self.__dict__[_STATE]
        q, carrier = _quantized_weight(self, st)
        pad = -1 if self.padding_idx is None else self.padding_idx
        return _QuantizedEmbedding.apply(ids, carrier, q, pad, self.scale_grad_by_freq)


class QATLinear(_QATLinearMixin, nn.Linear):
    """An ``nn.Linear`` prepared for QAT (see :mod:`torchq.qat`)."""


class QATEmbedding(_QATEmbeddingMixin, nn.Embedding):
    """An ``nn.Embedding`` tied to a QAT linear (see :mod:`torchq.qat`)."""


_CLASSES: dict[tuple[type, type], type] = {(_QATLinearMixin, nn.Linear): QATLinear, (_QATEmbeddingMixin, nn.Embedding): QATEmbedding}


def _qat_class(mixin: type, base: type) -> type:
    cls = _CLASSES.get((mixin, base))
    if cls is None:
        cls = type(f"QAT{base.__name__}", (mixin, base), {"__module__": __name__})
        _CLASSES[(mixin, base)] = cls
    return cls


def _trainable_through(mod: nn.Module, name: str) -> str | None:
    """Why QAT cannot compute this selected module as a linear, or None."""
    if is_conv1d(mod):
        return None
    if isinstance(mod, nn.Linear):
        if type(mod).forward is not nn.Linear.forward:
            return (f"{type(mod).__name__} overrides nn.Linear.forward, so its output is not known to be the linear "
                    f"QAT computes")
        return None
    return f"{type(mod).__name__} is not an nn.Linear or a transformers Conv1D"


def _check_config(cfg: QuantConfig, name: str) -> None:
    algorithm = getattr(cfg, "algorithm", "rtn")
    if algorithm in CALIBRATED:
        raise ValueError(
            f"config for {name!r}: {type(cfg).__name__}(algorithm={algorithm!r}) chooses codes from calibration data "
            f"once, which cannot be trained through; QAT learns the rounding itself: use algorithm='rtn' (or 'hqq')"
        )


def _learned_format(cfg: QuantConfig, w: torch.Tensor, name: str) -> GroupFormat:
    try:
        fmt = cfg.group_format(w)
    except LayerNotSupported:
        fmt = None
    if fmt is None or fmt.static_scales or not isinstance(fmt, (AffineGroupFormat, CodebookGroupFormat)):
        why = "double-quantized scales are themselves quantized over the whole weight" if fmt is not None and \
            fmt.static_scales else "it has no group format (int8 / float8 / int8-activation 4-bit configs)"
        raise ValueError(
            f"scales='learned' for {name!r}: {type(cfg).__name__} cannot learn its scales ({why}); use "
            f"scales='recompute', or an int4 / intx / NF4 / FP4 (double_quant=False) config"
        )
    if getattr(cfg, "algorithm", "rtn") != "rtn":
        raise ValueError(f"scales='learned' for {name!r}: the scales start from round to nearest's; got "
                         f"algorithm={cfg.algorithm!r} (use 'rtn')")
    return fmt


def prepared_layers(model: nn.Module) -> dict[str, QuantConfig]:
    """The QAT layers of ``model`` and their configs (tied embeddings excluded)."""
    return {name: mod.__dict__[_STATE].config for name, mod in model.named_modules()
            if _STATE in mod.__dict__ and isinstance(mod, _QATLinearMixin)}


def prepare(model: nn.Module, config: ConfigSpec, filter_fn: Callable[[nn.Module, str], bool] | None = None, *,
            scales: str = "recompute") -> nn.Module:
    """Prepare the selected linears of ``model`` for quantization-aware training, in place; returns
    ``model``.

    ``config`` and ``filter_fn`` select and configure layers as in :func:`torchq.quantize_`. Every
    config ``quantize_`` takes trains, except the calibrated algorithms (GPTQ, AWQ: refused by
    name). ``scales``: ``"recompute"`` (default: from the current weights at every step) or
    ``"learned"`` (see the module docstring). A weight tied to an embedding (``lm_head`` /
    ``embed_tokens``) makes the embedding read the quantized rows too, as after ``quantize_``.

    Each selected weight is quantized once here: a layer that cannot take its config is skipped with
    a ``SkippedLayerWarning`` naming it (an error in strict mode); any other failure raises
    :class:`~torchq.quantize.QuantizationError` and leaves the model unchanged. Train, then
    :func:`convert`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if scales not in SCALE_MODES:
        raise ValueError(f"scales: expected one of {SCALE_MODES}, got {scales!r}")
    filter_fn = filter_fn or default_filter
    selected = []
    for name, mod in model.named_modules():
        if _STATE in mod.__dict__:
            if filter_fn(mod, name) and isinstance(mod, _QATLinearMixin):
                raise ValueError(f"model: layer {name!r} is already prepared for QAT; convert or unprepare it first")
            continue
        if filter_fn(mod, name):
            selected.append((name, mod))
    resolve = config_resolver(config, [n for n, _ in selected])
    slots = tensor_slots(model)
    staged: list[tuple[nn.Module, _LayerState, dict[str, nn.Parameter]]] = []
    owners: dict[int, str] = {}
    for name, mod in selected:
        cfg = resolve(name)
        if cfg is None or cfg is UNSET:
            continue
        why = _trainable_through(mod, name)
        if why is not None:
            raise QuantizationError(f"qat.prepare: layer {name!r}: {why}; nothing was changed")
        _check_config(cfg, name)
        if parametrize.is_parametrized(mod, "weight"):
            warn_skipped(f"qat.prepare: skipped layer {name!r}: its weight is computed by a parametrization")
            continue
        weight = mod._parameters.get("weight")
        if not isinstance(weight, torch.Tensor) or isinstance(weight, AffineQuantizedTensor) or not weight.is_floating_point():
            warn_skipped(f"qat.prepare: skipped layer {name!r}: its weight is not a float parameter")
            continue
        if id(weight) in owners:
            raise QuantizationError(
                f"qat.prepare: {owners[id(weight)]!r} and {name!r} share one weight tensor; QAT trains one weight "
                f"per layer: untie them or select one; nothing was changed"
            )
        transposed = is_conv1d(mod)
        w2 = weight.detach().t().contiguous() if transposed else weight.detach()
        st = _LayerState(cfg, name, type(mod), transposed, _learned_format(cfg, w2, name) if scales == "learned" else None)
        try:
            q = quantize_in_row_chunks(cfg, w2, label=name)
            params: dict[str, nn.Parameter] = {}
            if st.learned is not None:
                s, z = st.learned.qparams(w2)
                params[_SCALE] = nn.Parameter(s.detach().float().clone())
                if z is not None and st.learned.zero_point_domain is not ZeroPointDomain.NONE:
                    params[_ZERO] = nn.Parameter(z.detach().float().clone())
            del q
        except LayerNotSupported as e:
            warn_skipped(f"qat.prepare: skipped layer {name!r} ({type(mod).__name__}, weight {tuple(weight.shape)}): {e}")
            continue
        except Exception as e:
            raise QuantizationError(f"qat.prepare: layer {name!r} could not take {cfg!r}: {e}; nothing was changed") from e
        owners[id(weight)] = name
        staged.append((mod, st, params))
        for other_name, other, attr, is_buffer in slots.get(id(weight), []):
            if other is mod and not is_buffer:
                continue
            if is_buffer or attr != "weight" or not isinstance(other, nn.Embedding) or type(other).forward is not nn.Embedding.forward:
                raise QuantizationError(
                    f"qat.prepare: the weight of {name!r} is also {other_name!r} ({type(other).__name__}); QAT can tie a "
                    f"linear's weight to an nn.Embedding only: untie it or leave {name!r} in float; nothing was changed"
                )
            if other.max_norm is not None or other.sparse:
                raise QuantizationError(
                    f"qat.prepare: {other_name!r} (tied to {name!r}) has max_norm or sparse=True, which write to or "
                    f"skip the quantized weight; nothing was changed"
                )
            if scales == "learned":
                raise QuantizationError(f"qat.prepare: scales='learned' does not train tied weights ({name!r} and "
                                        f"{other_name!r}); untie them or use scales='recompute'; nothing was changed")
            staged.append((other, _LayerState(cfg, name, type(other), False), {}))
    # commit: class swaps and dict assignments, which cannot fail
    for mod, st, params in staged:
        mixin = _QATLinearMixin if not isinstance(mod, nn.Embedding) else _QATEmbeddingMixin
        base = st.base
        mod.__dict__[_STATE] = st
        for k, p in params.items():
            mod._parameters[k] = p.to(mod.weight.device)
        mod.__class__ = QATLinear if base is nn.Linear and mixin is _QATLinearMixin else _qat_class(mixin, base)
    return model


def _restore(mod: nn.Module) -> _LayerState:
    st = mod.__dict__.pop(_STATE)
    mod.__class__ = st.base
    mod._parameters.pop(_SCALE, None)
    mod._parameters.pop(_ZERO, None)
    return st


def unprepare(model: nn.Module) -> nn.Module:
    """Undo :func:`prepare`: the QAT layers become their float classes again (learned scales are
    dropped); returns ``model``."""
    for _, mod in list(model.named_modules()):
        if _STATE in mod.__dict__:
            _restore(mod)
    return model


def convert(model: nn.Module) -> nn.Module:
    """Quantize the QAT layers of ``model`` with their configs (:func:`torchq.quantize_`) and make
    them ordinary layers again, in place; returns ``model``. With recomputed scales the codes are
    those the prepared model computed with, so the outputs are unchanged, bit for bit; learned
    scales are used as trained. On failure the model is left prepared, as it was."""
    layers = [(name, mod) for name, mod in model.named_modules() if _STATE in mod.__dict__]
    if not layers:
        raise ValueError("model: no layer is prepared for QAT (call torchq.qat.prepare first)")
    learned: dict[str, AffineQuantizedTensor] = {}
    plan: dict[str, QuantConfig] = {}
    for name, mod in layers:  # every learned weight is computed before anything is installed
        st: _LayerState = mod.__dict__[_STATE]
        if not isinstance(mod, _QATLinearMixin):
            continue  # a tied embedding: quantize_ installs its linear's weight there too
        if st.learned is None:
            plan[name] = st.config
            continue
        w = mod.weight.detach()
        with torch.no_grad():
            s, z = _learned_qparams(st, mod)
            q = _learned_quantized(st, w.t() if st.transposed else w, s, z)
        learned[name] = q._replace(transposed=True) if st.transposed else q
    if plan:
        ids = {id(mod) for name, mod in layers if name in plan}
        classes = [(mod, mod.__class__) for _, mod in layers]
        for mod, _ in classes:  # quantize_ recognises a transformers Conv1D by its class name
            mod.__class__ = mod.__dict__[_STATE].base
        try:
            quantize_(model, plan, filter_fn=lambda m, n: id(m) in ids)  # atomic: raises with the model as it was
        except BaseException:
            for mod, cls in classes:
                mod.__class__ = cls
            raise
    # commit: dict assignments and class swaps, which cannot fail
    for name, mod in layers:
        _restore(mod)
        if name in learned:
            mod._parameters["weight"] = nn.Parameter(learned[name], requires_grad=False)
    return model


def _is_norm(mod: nn.Module) -> bool:
    """A normalization layer: torch's (LayerNorm, RMSNorm, GroupNorm, BatchNorm, ...) or a model's
    own class named like one (transformers' ``LlamaRMSNorm``, ``T5LayerNorm``, ...)."""
    torch_norms = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)
    return isinstance(mod, torch_norms) or type(mod).__name__.endswith("Norm")


def prepare_float_tuning(model: nn.Module, kinds: Iterable[str] = FLOAT_KINDS) -> list[nn.Parameter]:
    """Make ``model`` train only what it keeps in float beside its quantized weights, and return
    those parameters (for the optimizer; each once, in ``model.parameters()`` order, tied ones once).

    ``kinds``: ``"norms"`` (every parameter of a normalization layer: torch's, or a class whose name
    ends in ``Norm``, as transformers' ``LlamaRMSNorm``) and / or ``"biases"`` (every other
    parameter named ``bias``, a quantized layer's too). Those require grad; every other parameter
    (float embeddings and heads included) is frozen. Quantized weights never train. On an error
    nothing is changed.

    After post-training quantization (round to nearest, GPTQ, AWQ), a short distillation from the
    float model through these few parameters recovers part of the loss without touching a code
    ("norm tweaking"): SmolLM2-135M int4 g128 after GPTQ, perplexity 31.69 -> 30.81 against float's
    29.54 (docs/qat.md)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    unknown = [k for k in kinds if k not in FLOAT_KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds: expected some of {list(FLOAT_KINDS)}, got {list(kinds)}")
    chosen: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        norm = _is_norm(mod)
        for pname, p in mod.named_parameters(recurse=False):
            if isinstance(p, AffineQuantizedTensor) or not p.is_floating_point():
                continue
            if (norm and "norms" in kinds) or (pname == "bias" and not norm and "biases" in kinds):
                chosen[id(p)] = p
    if not chosen:
        raise ValueError(f"model: no parameter of kinds {list(kinds)} to tune (no normalization layer or bias found)")
    ordered = [p for p in model.parameters() if id(p) in chosen]
    for p in model.parameters():  # cannot fail from here on
        p.requires_grad_(id(p) in chosen)
    return ordered
