"""``quantize_``: replace linear weights with quantized tensors, in place and atomically."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from . import dispatch
from .canonical import PlainForm
from .configs import ROW_CHUNK_BYTES, LayerNotSupported, QuantConfig
from .hooks import prepare_weights_installed
from .patterns import PatternError, SafePattern, check_total_states, compile_pattern
from .tensor import AffineQuantizedTensor

__all__ = ["quantize_", "QuantizationError", "SkippedLayerWarning", "TiedWeightWarning", "default_filter", "is_conv1d",
           "config_resolver", "warn_skipped", "UNSET", "tensor_slots"]

ConfigSpec = QuantConfig | Mapping[str, QuantConfig | None]


class QuantizationError(RuntimeError):
    """quantize_ failed; the model was left exactly as it was."""


class SkippedLayerWarning(UserWarning):
    """A selected layer was left as it was: it could not take its config, its weight is computed by a
    parametrization or is not a registered tensor, or it is already quantized."""


class TiedWeightWarning(UserWarning):
    """A module that was not selected shares its weight with a quantized one, so it now holds
    the quantized weight too (quantize_ keeps ties)."""


def is_conv1d(module: nn.Module) -> bool:
    """True for a transformers ``Conv1D`` (GPT-2's transposed linear: weight ``[in, out]``,
    ``y = x @ W + b``), recognised by duck typing (class name, ``nf``/``nx``, weight shape) so
    transformers is never imported."""
    w = getattr(module, "weight", None) if type(module).__name__ == "Conv1D" else None
    nf, nx = getattr(module, "nf", None), getattr(module, "nx", None)
    return isinstance(w, torch.Tensor) and isinstance(nf, int) and isinstance(nx, int) and tuple(w.shape) == (nx, nf)


def float_linear_filter(module: nn.Module, name: str) -> bool:
    """``nn.Linear`` layers whose weight is a float tensor (not already quantized)."""
    return (
        isinstance(module, nn.Linear)
        and not isinstance(module.weight, AffineQuantizedTensor)
        and module.weight.is_floating_point()
    )


def default_filter(module: nn.Module, name: str) -> bool:
    """``nn.Linear`` and transformers ``Conv1D`` layers whose weight is a float tensor (not
    already quantized)."""
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        return False
    w = module.weight
    return isinstance(w, torch.Tensor) and not isinstance(w, AffineQuantizedTensor) and w.is_floating_point()


UNSET = object()  # a mapping config that names no rule for a module (as opposed to an explicit None)


def config_resolver(config: ConfigSpec, names: list[str]) -> Callable[[str], object]:
    """``name -> config`` for the modules ``names`` under ``config`` (one config, or a mapping of
    names / patterns to configs): a config, None (explicitly left in float) or :data:`UNSET` (no
    rule names the module). Shared by ``quantize_``, ``calibrate`` and the transformers quantizer."""
    if isinstance(config, QuantConfig):
        return lambda name: config
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config: expected a torchq config (e.g. torchq.int4_weight_only()) or a mapping from module "
            f"names / 're:<regex>' / '_default' to configs, got {type(config).__name__}"
        )
    exact: dict[str, QuantConfig | None] = {}
    patterns: list[tuple[str, SafePattern, QuantConfig | None]] = []
    default: object = UNSET
    for key, cfg in config.items():
        if cfg is not None and not isinstance(cfg, QuantConfig):
            raise TypeError(f"config[{key!r}]: expected a torchq config or None, got {type(cfg).__name__}")
        if not isinstance(key, str):
            raise TypeError(f"config: keys must be module names, got {key!r}")
        if key == "_default":
            default = cfg
        elif key.startswith("re:"):
            try:  # plans may come from files: a linear-time matcher, not re's backtracking one
                patterns.append((key, compile_pattern(key[3:], where=f"config[{key!r}]"), cfg))
            except PatternError as e:
                raise PatternError(e.where, e.pattern, e.reason, f"config[{key!r}]: invalid regular expression: {e.reason}") from None
        else:
            exact[key] = cfg
    check_total_states([pat for _, pat, _ in patterns], where="config ('re:' keys)")
    missing = [k for k in exact if k not in names]
    if missing:
        hints = {k: difflib.get_close_matches(k, names, n=3) for k in missing}
        raise ValueError(
            "config: these module names match no quantizable module (wrong name, already quantized, "
            "or excluded by filter_fn): " + "; ".join(f"{k!r} (close: {hints[k]})" for k in missing)
        )
    for key, pat, _ in patterns:
        if not any(pat.fullmatch(n) for n in names):
            warnings.warn(f"quantize_: pattern {key!r} matches no quantizable module", SkippedLayerWarning, stacklevel=3)

    def resolve(name: str) -> object:  # a config, None (explicitly float) or UNSET
        if name in exact:
            return exact[name]
        for _, pat, cfg in patterns:
            if pat.fullmatch(name):
                return cfg
        return default

    return resolve


def quantize_in_row_chunks(cfg: QuantConfig, weight: torch.Tensor, label: str | None = None,
                           chunk_bytes: int = ROW_CHUNK_BYTES) -> AffineQuantizedTensor:
    """``cfg.quantize_weight(weight, label=label)``, bit for bit, with temporaries bounded by
    ``chunk_bytes`` of float rows where ``cfg.rows_independent(weight)``: quantizing takes several
    times a weight's float size in temporaries (SmolLM2's 49152 x 576 tied embedding: 0.3-0.7 GB at
    once), so weights above two chunks are quantized a few rows at a time, their plain forms joined
    and packed once. (1 MiB chunks quantize 512-3072-row weights as fast as whole, measured on int4,
    int8 and NF4 configs.)"""
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    if weight.dim() != 2 or n * k * weight.element_size() <= 2 * chunk_bytes or not cfg.rows_independent(weight):
        return cfg.quantize_weight(weight, label=label)
    rows = max(1, chunk_bytes // (k * weight.element_size()))
    first = None
    codes, scales, zeros = [], [], []
    for r0 in range(0, n, rows):
        q = cfg.quantize_weight(weight[r0:r0 + rows], label=label)
        plain = q.to_plain()
        first = first or (q, plain.spec)
        codes.append(plain.codes)
        scales.append(plain.scale)
        zeros.append(plain.zero_point)
        del q, plain
    q0, spec = first
    zero = None if zeros[0] is None else torch.cat(zeros)
    plain = PlainForm(torch.cat(codes), torch.cat(scales), zero, spec)
    del codes, scales, zeros
    whole = AffineQuantizedTensor.from_plain(plain, q0.dtype, layout=getattr(cfg, "layout", None), act_quant=q0.act_quant, label=label,
                                             config=q0.config, compute_dtype=q0.compute_dtype)
    return q0._replace(impl=whole.tensor_impl)


@dataclass
class _Staged:
    """One weight tensor to replace: the configs asked of it and the quantized result."""

    old: torch.Tensor
    cfg: QuantConfig
    transposed: bool
    names: list[str]
    modules: set[int]
    new: torch.Tensor


def tensor_slots(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str, bool]]]:
    """Every registered parameter and buffer, by tensor identity: ``[(qualified name, module,
    attribute, is_buffer)]`` (a tied tensor has several)."""
    out: dict[int, list[tuple[str, nn.Module, str, bool]]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for table, is_buffer in ((mod._parameters, False), (mod._buffers, True)):
            for attr, t in table.items():
                if t is not None:
                    out.setdefault(id(t), []).append((prefix + attr, mod, attr, is_buffer))
    return out


def _move_others(mod: nn.Module, weight: torch.Tensor, device: torch.device | None, moved: dict[int, torch.Tensor]) -> None:
    """Stage copies on ``device`` of a quantized module's other parameters and buffers."""
    if device is None:
        return
    for t in [*mod._parameters.values(), *mod._buffers.values()]:
        if t is not None and t is not weight and id(t) not in moved:
            v = t.detach().to(device)
            moved[id(t)] = nn.Parameter(v, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else v


def warn_skipped(msg: str, stacklevel: int = 3) -> None:
    """A skipped layer: a ``SkippedLayerWarning``, or a ``QuantizationError`` under strict mode."""
    if dispatch.is_strict():
        raise QuantizationError(msg + " (strict mode); nothing was changed")
    warnings.warn(msg, SkippedLayerWarning, stacklevel=stacklevel)


def _fmt(names: list[str], limit: int = 8, quote: bool = True) -> str:
    shown = ", ".join(repr(n) if quote else n for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def quantize_(
    model: nn.Module,
    config: ConfigSpec,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Quantize the weights of the selected modules of ``model`` in place; returns ``model``.

    ``config``: one config for every selected module, or a mapping from module names (exact),
    ``"re:<regex>"`` (full match, first match wins; matched in linear time by :mod:`torchq.patterns`,
    which refuses backreferences and lookaround) and ``"_default"`` to a config or None
    (leave in float). ``filter_fn(module, fqn)`` gets every module and its fully qualified name
    (as in ``model.named_modules()``) and returns True to select it (default:
    :func:`default_filter`, float ``nn.Linear`` and transformers ``Conv1D``, whose ``[in, out]``
    weight is quantized as ``[out, in]`` and installed transposed). ``device``: quantize module
    by module on that device and leave the quantized modules there (bounds peak memory to one
    float weight on the device).

    Tied weights stay tied: a tensor shared by several modules is quantized once and the one
    quantized parameter is installed everywhere it was, including in modules that were not
    selected (e.g. the embedding tied to ``lm_head``; a :class:`TiedWeightWarning` names them;
    embedding lookups dequantize the rows they read). Tied modules given different configs are a
    :class:`QuantizationError`.

    A layer that cannot be quantized (its structure cannot take the config, its weight is
    computed by a ``torch.nn.utils.parametrize`` parametrization or is not a registered
    tensor, or it is already quantized) is skipped with a :class:`SkippedLayerWarning` naming
    it (a :class:`QuantizationError` in strict mode). Any other failure raises
    :class:`QuantizationError` and leaves the model unchanged: every new tensor is computed
    before the first one is installed, and installing cannot fail.

    A transformers ``PreTrainedModel`` also gets torchq's ``hf_quantizer`` and
    ``quantization_config``, so that ``save_pretrained`` writes its torchq weights (see
    :mod:`torchq.hf.saving`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    custom_filter = filter_fn is not None
    filter_fn = filter_fn or default_filter
    selected, already = [], []
    for name, mod in model.named_modules():
        picked = filter_fn(mod, name)
        if isinstance(getattr(mod, "weight", None), AffineQuantizedTensor) and (
            picked or (not custom_filter and (isinstance(mod, nn.Linear) or is_conv1d(mod)))
        ):
            already.append(name)
        elif picked:
            selected.append((name, mod))
    resolve = config_resolver(config, [n for n, _ in selected] + already)
    already = [n for n in already if resolve(n) not in (None, UNSET)]
    if already:
        warn_skipped(
            f"quantize_: skipped {len(already)} layer(s) that are already quantized (re-quantizing needs "
            f"the float weights): {_fmt(already)}"
        )
    device = None if device is None else torch.device(device)
    slots = tensor_slots(model)

    staged: dict[int, _Staged] = {}
    left_float: dict[int, str] = {}  # weights a selected module is explicitly mapped to None (float)
    moved: dict[int, torch.Tensor] = {}  # other tensors of selected modules, moved to ``device``
    for name, mod in selected:
        cfg = resolve(name)
        weight = mod._parameters.get("weight")
        if weight is None:
            weight = mod._buffers.get("weight")
        if cfg is None or cfg is UNSET:
            if cfg is None and weight is not None:
                left_float.setdefault(id(weight), name)
            continue
        if parametrize.is_parametrized(mod, "weight"):
            warn_skipped(
                f"quantize_: skipped layer {name!r} ({type(mod).__name__}): its weight is computed by a "
                f"torch.nn.utils.parametrize parametrization; call "
                f"torch.nn.utils.parametrize.remove_parametrizations(module, 'weight') first to quantize it"
            )
            continue
        if weight is None:
            attr = getattr(mod, "weight", None)
            if not isinstance(attr, torch.Tensor):
                raise QuantizationError(
                    f"quantize_: module {name!r} ({type(mod).__name__}) has no weight tensor; nothing was changed"
                )
            warn_skipped(
                f"quantize_: skipped layer {name!r} ({type(mod).__name__}): its weight is not a registered "
                f"parameter or buffer (a property or a plain attribute), so quantize_ cannot replace it"
            )
            continue
        assert isinstance(cfg, QuantConfig)
        transposed = is_conv1d(mod)
        prev = staged.get(id(weight))
        if prev is not None:
            if prev.cfg != cfg or prev.transposed != transposed:
                what = "a Conv1D and a Linear orientation" if prev.transposed != transposed else f"{prev.cfg!r} vs {cfg!r}"
                raise QuantizationError(
                    f"quantize_: {prev.names[0]!r} and {name!r} share one weight tensor (tied weights) but get "
                    f"different configs ({what}); give them the same config or untie them first; nothing was changed"
                )
            prev.names.append(name)
            prev.modules.add(id(mod))
            _move_others(mod, weight, device, moved)
            continue
        w = weight.detach()
        if transposed:
            w = w.t().contiguous()  # Conv1D holds [in, out]: quantize the [out, in] linear weight
        if device is not None:
            w = w.to(device)
        try:
            q = quantize_in_row_chunks(cfg, w, label=name)
        except LayerNotSupported as e:
            warn_skipped(f"quantize_: skipped layer {name!r} ({type(mod).__name__}, weight {tuple(weight.shape)}): {e}")
            continue
        except Exception as e:
            raise QuantizationError(
                f"quantize_: layer {name!r} ({type(mod).__name__}, weight {tuple(weight.shape)} {weight.dtype}) "
                f"could not take {cfg!r}: {e}; nothing was changed"
            ) from e
        if transposed:
            q = q._replace(transposed=True)
        new = nn.Parameter(q, requires_grad=False) if isinstance(weight, nn.Parameter) else q
        staged[id(weight)] = _Staged(weight, cfg, transposed, [name], {id(mod)}, new)
        _move_others(mod, weight, device, moved)

    for key, name in left_float.items():
        if key in staged:
            s = staged[key]
            raise QuantizationError(
                f"quantize_: {s.names[0]!r} and {name!r} share one weight tensor (tied weights) but {name!r} is "
                f"mapped to None (float) and {s.names[0]!r} to {s.cfg!r}; give them the same config or untie them "
                f"first; nothing was changed"
            )
    through_tie = sorted(
        f"{qn!r} (tied to {s.names[0]!r})" for key, s in staged.items() for qn, mod, attr, _ in slots.get(key, [])
        if not (id(mod) in s.modules and attr == "weight")
    )
    if through_tie:
        warnings.warn(
            f"quantize_: tied weights stay tied, so these tensors now hold the quantized weight too: "
            f"{_fmt(through_tie, quote=False)}; "
            f"untie them first to keep them in float",
            TiedWeightWarning, stacklevel=2,
        )

    attach = prepare_weights_installed(model) if staged else None  # e.g. transformers' save_pretrained
    # commit: plain dict assignments, which cannot fail
    replace = {key: s.new for key, s in staged.items()}
    replace.update(moved)
    for key, new in replace.items():
        for _, mod, attr, is_buffer in slots.get(key, []):
            (mod._buffers if is_buffer else mod._parameters)[attr] = new
    if attach is not None:
        attach()  # two attribute assignments
    return model
