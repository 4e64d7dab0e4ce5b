"""A model's state-dict entries, and installing checkpoint tensors into them atomically.

Entries are parameters and persistent buffers, named as in ``model.state_dict()``; tied
tensors (one object under several names) are kept as one tensor plus aliases. Installing
loads and checks every incoming tensor first and only then touches the model, so a failure
leaves the model exactly as it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..tensor import AffineQuantizedTensor
from .codec import CheckpointError

__all__ = ["Slot", "model_slots", "dedupe", "Incoming", "install_checkpoint", "check_compatible", "check_against_model",
           "check_entry_dtype", "LoadWarning", "install_load_state_dict_guard",
           "init_meta_buffers", "meta_buffers"]


class LoadWarning(UserWarning):
    """Loading finished, but something in the model was not filled from the checkpoint."""


@dataclass
class Slot:
    """One state-dict entry: ``module.<attr>`` is a parameter or a persistent buffer."""

    name: str
    module: nn.Module
    attr: str
    is_buffer: bool
    tensor: torch.Tensor


def model_slots(model: nn.Module) -> dict[str, Slot]:
    """Every parameter and persistent buffer under every name it has (tied ones repeat)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    slots: dict[str, Slot] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in mod._parameters.items():
            if p is not None:
                slots[prefix + attr] = Slot(prefix + attr, mod, attr, False, p)
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set:
                slots[prefix + attr] = Slot(prefix + attr, mod, attr, True, b)
    return slots


def dedupe(named: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(unique, aliases)``: the first name of each tensor object, and every other name -> it."""
    first: dict[int, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in named.items():
        key = id(t)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
            unique[name] = t
    return unique, aliases


BufferInit = Callable[[nn.Module], None] | str | None


def meta_buffers(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Non-persistent buffers still on the meta device: ``{qualified name: (owner, attr)}``."""
    out: dict[str, tuple[nn.Module, str]] = {}
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        for attr, b in mod._buffers.items():
            if b is not None and _is_meta(b) and attr in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{attr}" if mod_name else attr] = (mod, attr)
    return out


def _auto_initializer(model: nn.Module, owner_name: str) -> Callable[[nn.Module], None]:
    """The ``_init_weights`` of the innermost enclosing transformers model (composite models
    dispatch to each sub-model's own, as transformers' ``initialize_weights`` does)."""
    modules = dict(model.named_modules())
    parts = owner_name.split(".")[:-1]
    for i in range(len(parts), -1, -1):
        mod = modules.get(".".join(parts[:i]))
        fn = getattr(mod, "_init_weights", None)
        if callable(fn) and hasattr(mod, "config"):
            return fn
    raise TypeError(
        f"init_buffers='auto': no module enclosing buffer {owner_name!r} defines _init_weights (a transformers "
        f"PreTrainedModel does); pass a function(module) that fills the module's non-persistent buffers"
    )


def init_meta_buffers(
    model: nn.Module, init: Callable[[nn.Module], None] | str = "auto", *, device: torch.device | str | None = None
) -> list[str]:
    """Materialize the model's non-persistent buffers left on ``meta`` and compute their values;
    returns their names.

    A model built on the ``meta`` device has no values for buffers its modules compute in
    ``__init__`` (rotary ``inv_freq``, ``position_ids``), and no checkpoint holds them. Each one
    becomes a tensor on ``device`` (default CPU; float ones NaN-filled, integer ones zero-filled),
    then ``init(owner)`` is called once per owning module and must fill them. ``init="auto"``:
    the ``_init_weights`` of the enclosing transformers model, the method ``from_pretrained``
    uses for the same job. All or nothing: if ``init`` raises, or leaves a NaN in a float
    buffer, every buffer is put back on meta and the error is raised.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not (callable(init) or init == "auto"):
        raise TypeError(f"init_buffers: expected 'auto', a function(module) or None, got {init!r}")
    found = meta_buffers(model)
    if not found:
        return []
    target = torch.device("cpu") if device is None else torch.device(device)
    if target.type == "meta":
        raise ValueError("device: buffers cannot be initialized on the meta device; pass a real device")
    owners: dict[int, tuple[str, nn.Module, list[str]]] = {}
    for name, (mod, attr) in found.items():
        owners.setdefault(id(mod), (name, mod, []))[2].append(attr)
    fns = {key: (init if callable(init) else _auto_initializer(model, name)) for key, (name, _, _) in owners.items()}
    originals: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for key, (_, mod, attrs) in owners.items():
                for attr in attrs:
                    old = mod._buffers[attr]
                    originals.append((mod, attr, old))
                    fill = float("nan") if old.is_floating_point() or old.is_complex() else 0
                    mod._buffers[attr] = torch.full(old.shape, fill, dtype=old.dtype, device=target)
                fns[key](mod)
        unfilled = [n for n, (mod, attr) in found.items()
                    if _is_meta(mod._buffers[attr]) or (mod._buffers[attr].is_floating_point() and bool(mod._buffers[attr].isnan().any()))]
        if unfilled:
            raise ValueError(f"init_buffers: left {_fmt_names(unfilled)} unset (on meta, or NaN where it filled nothing)")
    except BaseException:
        for mod, attr, old in originals:
            mod._buffers[attr] = old
        raise
    return sorted(found)


@dataclass
class Incoming:
    """What a checkpoint holds for one name: its visible shape, whether it is quantized, and a
    loader that reads, checks and decodes it onto a device (raising CheckpointError)."""

    name: str
    shape: tuple[int, ...]
    quantized: bool
    describe: str
    load: Callable[[torch.device], torch.Tensor]
    record: Any = None  # a quantized entry's validated record (codec.ParsedRecord)
    dtype: torch.dtype | None = None  # a float entry's stored dtype, where the file states it


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc_functions():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2, trim = libc.mallinfo2, libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (or older than 2.33): nothing to do
        return None, None
    mallinfo2.restype = _MallInfo2
    trim.argtypes = [ctypes.c_size_t]
    return mallinfo2, trim


_MALLINFO2, _MALLOC_TRIM = _glibc_functions() if sys.platform.startswith("linux") else (None, None)
RETAINED_LIMIT = 1 << 30


def release_free_memory(limit: int = RETAINED_LIMIT) -> None:
    """Give freed heap memory back to the OS once more than ``limit`` bytes of it are retained
    (glibc only; a no-op elsewhere).

    Decoding a weight allocates temporaries of a few times its size between the long-lived
    tensors of earlier weights; glibc keeps those holes, so without this the resident memory of
    a load grows with the model instead of staying near model + one weight's temporaries.
    Trimming on every weight would cost page faults on the next one, hence the threshold."""
    if _MALLOC_TRIM is not None and _MALLINFO2().fordblks > limit:
        _MALLOC_TRIM(0)


def _is_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta"


def _fmt_names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


COMPUTE_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "floating-point"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "integer"


def check_entry_dtype(name: str, model_dtype: torch.dtype, stored: torch.dtype, source: str, what: str = "entry",
                      trainable: bool = False) -> None:
    """CheckpointError unless a stored float (or integer, bool) entry of dtype ``stored`` may fill the
    model's ``model_dtype`` entry ``name``: the same kind of number, and for floats either the same
    dtype or two of float32 / bfloat16 / float16 (an fp64 or float8 tensor never silently becomes,
    or sits beside, a model's compute dtype; an integer never becomes a weight)."""
    desc = f"a {'trainable ' if trainable else ''}{model_dtype} {what}"
    if _kind(stored) != _kind(model_dtype):
        raise CheckpointError(
            f"{source}: {name!r} is {desc} in the model but {stored} in the checkpoint ({_kind(stored)} "
            f"values for a {_kind(model_dtype)} {what}); is it a checkpoint of another model? The model was not changed"
        )
    if stored != model_dtype and stored.is_floating_point and not (stored in COMPUTE_FLOATS and model_dtype in COMPUTE_FLOATS):
        raise CheckpointError(
            f"{source}: {name!r} is {desc} in the model but {stored} in the checkpoint; torchq converts only "
            f"between float32, bfloat16 and float16 (cast the checkpoint, or build the model in {stored}). "
            f"The model was not changed"
        )


def _final_value(slot: Slot, value: torch.Tensor, inc: Incoming, source: str) -> tuple[torch.Tensor, bool]:
    """``(object to install, copy in place?)`` for one loaded tensor; raises CheckpointError
    (the model untouched) when it cannot take the slot."""
    old = slot.tensor
    if not isinstance(value, AffineQuantizedTensor) and not isinstance(old, AffineQuantizedTensor):
        check_entry_dtype(slot.name, old.dtype, value.dtype, source, "buffer" if slot.is_buffer else "parameter",
                          old.requires_grad and not slot.is_buffer)
        if value.dtype != old.dtype and value.numel() and _kind(value.dtype) in ("integer", "floating-point"):
            info = torch.iinfo(old.dtype) if _kind(old.dtype) == "integer" else torch.finfo(old.dtype)
            lo, hi = value.min(), value.max()  # NaN propagates: refused below only where the value was finite
            if bool(lo < info.min) or bool(hi > info.max):
                raise CheckpointError(f"{source}: {slot.name!r} holds {value.dtype} values from {lo.item()!r} to {hi.item()!r}, "
                                      f"beyond the model's {old.dtype}; the model was not changed")
    in_place = (
        not inc.quantized and not isinstance(old, AffineQuantizedTensor) and not _is_meta(old)
        and old.device == value.device and type(old) in (torch.Tensor, nn.Parameter) and not old.is_inference()
    )
    if in_place or slot.is_buffer:
        return value, in_place
    if isinstance(value, AffineQuantizedTensor):
        return nn.Parameter(value, requires_grad=False), False
    return nn.Parameter(value, requires_grad=old.requires_grad), False


def check_compatible(slot: Slot, inc: Incoming, source: str) -> None:
    """CheckpointError (before any data is read) unless the entry ``inc`` can fill ``slot``: the same
    shape, not a float tensor for a quantized weight, and a stored dtype :func:`check_entry_dtype` accepts."""
    if tuple(slot.tensor.shape) != tuple(inc.shape):
        raise CheckpointError(
            f"{source}: {slot.name!r} has shape {list(slot.tensor.shape)} in the model but "
            f"{list(inc.shape)} in the checkpoint ({inc.describe}); is it a checkpoint of another model? "
            f"The model was not changed"
        )
    if isinstance(slot.tensor, AffineQuantizedTensor):
        if not inc.quantized:
            raise CheckpointError(
                f"{source}: {slot.name!r} is quantized in the model ({slot.tensor.spec.describe()}) but a float "
                f"tensor in the checkpoint; load into a float or meta model, or quantize_ the model the "
                f"checkpoint came from. The model was not changed"
            )
    elif not inc.quantized and inc.dtype is not None:
        check_entry_dtype(slot.name, slot.tensor.dtype, inc.dtype, source, "buffer" if slot.is_buffer else "parameter",
                          slot.tensor.requires_grad and not slot.is_buffer)


def check_against_model(model: nn.Module, incoming: Mapping[str, Incoming], source: str) -> None:
    """:func:`check_compatible` for every incoming entry whose name the model has (others are a
    loader's business: renamed, or missing)."""
    slots = model_slots(model)
    for name, inc in incoming.items():
        if name in slots:
            check_compatible(slots[name], inc, source)


def install_checkpoint(
    model: nn.Module,
    incoming: Mapping[str, Incoming],
    aliases: Mapping[str, str],
    *,
    device: torch.device | str | None,
    strict: bool,
    source: str,
    init_buffers: BufferInit = None,
) -> tuple[list[str], list[str]]:
    """Load every incoming tensor into ``model``; returns ``(missing, unexpected)`` names.

    Quantized tensors replace the entry (a frozen ``nn.Parameter``, or a buffer); float
    tensors are copied into existing float tensors on the target device (keeping their dtype
    and identity, as ``load_state_dict`` does) and replace meta or other-device ones.
    """
    slots = model_slots(model)
    ckpt_names = set(incoming) | set(aliases)
    for alias, target in aliases.items():
        if target not in incoming:
            raise CheckpointError(f"{source}: alias {alias!r} points to {target!r}, which the checkpoint does not hold")
    ties: dict[int, list[Slot]] = {}  # every name of each tensor object the model holds
    for slot in slots.values():
        ties.setdefault(id(slot.tensor), []).append(slot)
    # a name tied to one the checkpoint holds is filled through the tie (save_pretrained stores a tied
    # head once, under the embedding's name)
    filled = {s.name for group in ties.values() if any(s.name in ckpt_names for s in group) for s in group}
    missing = sorted(n for n in slots if n not in filled)
    unexpected = sorted(n for n in ckpt_names if n not in slots)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_fmt_names(missing)}")
        if unexpected:
            parts.append(f"not in the model: {_fmt_names(unexpected)}")
        raise CheckpointError(
            f"{source}: checkpoint does not match the model ({'; '.join(parts)}); is it a checkpoint of "
            f"another model? Pass strict=False to load the matching entries only. The model was not changed"
        )

    # Which checkpoint entry fills each slot, and the groups of slots the model ties together.
    plan: list[tuple[str, list[Slot]]] = []
    for group in ties.values():
        if not any(s.name in ckpt_names for s in group):
            continue
        sources = {aliases.get(s.name, s.name) for s in group if s.name in ckpt_names}
        if len(sources) > 1:
            raise CheckpointError(
                f"{source}: the model ties {_fmt_names([s.name for s in group])} to one tensor, but the "
                f"checkpoint stores them as different tensors ({_fmt_names(sorted(sources))})"
            )
        plan.append((sources.pop(), group))

    for src, group in plan:  # check compatibility before reading any data
        for slot in group:
            check_compatible(slot, incoming[src], source)

    # Stage: read, check and build every final object (Parameters included); only then commit,
    # and the commit is copies into checked same-shape tensors and dict assignments, which cannot fail.
    staged: list[tuple[list[Slot], torch.Tensor, bool]] = []  # (slots, value, copy_in_place)
    for src, group in plan:
        inc = incoming[src]
        slot0 = group[0]
        target = torch.device(device) if device is not None else (
            torch.device("cpu") if _is_meta(slot0.tensor) else slot0.tensor.device
        )
        value = inc.load(target)
        release_free_memory()
        staged.append((group, *_final_value(slot0, value, inc, source)))

    if init_buffers is not None:  # before the commit: it cannot change what the checkpoint fills
        init_meta_buffers(model, init_buffers, device=device)

    with torch.no_grad():  # commit
        for group, value, in_place in staged:
            if in_place:
                group[0].tensor.copy_(value)
                continue
            for slot in group:
                table = slot.module._buffers if slot.is_buffer else slot.module._parameters
                table[slot.attr] = value

    left_on_meta = sorted(
        n for mod_name, mod in model.named_modules()
        for n in [f"{mod_name}.{a}" if mod_name else a for a, t in [*mod._parameters.items(), *mod._buffers.items()]
                  if t is not None and _is_meta(t)]
    )
    if left_on_meta:
        warnings.warn(
            f"{source}: {len(left_on_meta)} tensor(s) are still on the meta device after loading (not in the "
            f"checkpoint, e.g. non-persistent buffers): {_fmt_names(left_on_meta)}; initialize them before use "
            f"(for non-persistent buffers: pass init_buffers='auto' for a transformers model, or a function that "
            f"fills a module's buffers)",
            LoadWarning, stacklevel=3,
        )
    if not strict and (missing or unexpected):
        warnings.warn(
            f"{source}: loaded with strict=False; missing from the checkpoint: {_fmt_names(missing) or 'none'}; "
            f"not in the model: {_fmt_names(unexpected) or 'none'}",
            LoadWarning, stacklevel=3,
        )
    return missing, unexpected


# -- plain load_state_dict of quantized entries into a float model ---------------------------------
_LOAD_FROM_STATE_DICT = nn.Module._load_from_state_dict.__code__
_LOAD_STATE_DICT = nn.Module.load_state_dict.__code__
PLAIN_LOAD_MESSAGE = (
    "cannot load a quantized weight into float {what} {name!r} with load_state_dict(sd) (assign=False); "
    "use model.load_state_dict(sd, assign=True) or torchq.load_quantized, or quantize_ the model first"
)


def _caller_assign() -> bool | None:
    """When called under ``nn.Module._load_from_state_dict`` assigning a tensor: the ``assign``
    argument the user passed to the enclosing ``load_state_dict``; None otherwise."""
    f = sys._getframe(2)
    for _ in range(4):  # hook <- register_parameter/register_buffer <- __setattr__ <- _load_from_state_dict
        if f is None or f.f_code is _LOAD_FROM_STATE_DICT:
            break
        f = f.f_back
    else:
        return None
    while f is not None and f.f_code is not _LOAD_STATE_DICT:
        f = f.f_back
    assign = None if f is None else f.f_locals.get("assign")
    return assign if isinstance(assign, bool) else None


def _guard(kind: str):
    def hook(module: nn.Module, name: str, value):
        if not isinstance(value, AffineQuantizedTensor):
            return None
        table = module._parameters if kind == "parameter" else module._buffers
        old = table.get(name)
        if old is None or isinstance(old, AffineQuantizedTensor) or _caller_assign() is not False:
            return None
        raise TypeError(PLAIN_LOAD_MESSAGE.format(what=kind, name=name))

    return hook


_GUARD_HANDLES: list = []


def install_load_state_dict_guard() -> None:
    """Make ``model.load_state_dict(sd)`` (assign=False) of a quantized entry into a float model
    always raise, as ``copy_`` does (idempotent).

    PyTorch's ``load_state_dict(sd, assign=True)`` writes ``assign_to_params_buffers`` into
    ``sd._metadata`` (pytorch/pytorch#188166), so a later plain load of the same ``sd`` (or of a
    file saved from it) assigns instead of copying and would silently convert a float model.
    Global parameter/buffer registration hooks refuse a quantized tensor replacing a float one
    while the enclosing ``load_state_dict`` call was made with ``assign=False``."""
    if _GUARD_HANDLES:
        return
    from torch.nn.modules.module import (
        register_module_buffer_registration_hook,
        register_module_parameter_registration_hook,
    )

    _GUARD_HANDLES.append(register_module_parameter_registration_hook(_guard("parameter")))
    _GUARD_HANDLES.append(register_module_buffer_registration_hook(_guard("buffer")))
