"""A GGUF file as a transformers model whose quantized weights stay quantized.

transformers' own GGUF loader (``from_pretrained(folder, gguf_file=...)``) dequantizes every
tensor to float. :func:`from_gguf` builds the same model (config and tensor names from
transformers' GGUF support, so every architecture transformers reads is covered) on the ``meta``
device and installs each GGUF weight that torchq can hold exactly (Q4_0, Q4_1, Q8_0, Q2_K-Q6_K:
:mod:`torchq.interop.gguf`) as an :class:`~torchq.AffineQuantizedTensor` on torchq's kernels, the
rest in float (``GGUFDequantizedWarning`` names each tensor kept in float that was quantized in
the file). A quantized weight whose format has no torchq linear kernel on this device stays
quantized by default and runs dequantize + ``F.linear`` (one warning lists them; ``without_kernel``).

transformers rewrites some tensors as it loads them (its per-architecture ``TensorProcessor``):
llama.cpp's converter permutes the rows of Llama's Q and K projections for its RoPE, and
transformers permutes them back. A quantized weight's groups run along its rows, so a row
permutation moves codes, scales and zero points exactly; :func:`from_gguf` finds the permutation
by running the processor on the row indices. A processor that does anything else to a quantized
tensor (changes values, reshapes it) gets the dequantized tensor instead, with a warning.

The dequantized values of every imported weight equal transformers' float weights bit for bit
(tested on SmolLM2's Q4_1 file). The model has torchq's transformers quantizer attached, so
``save_pretrained`` writes torchq's format and ``from_pretrained`` reads it back quantized.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..canonical import PlainForm
from ..checkpoint.codec import CheckpointError
from ..checkpoint.model_state import Incoming, install_checkpoint
from ..interop.gguf import GGUFDequantizedWarning, read_tensors
from ..interop.gguf_file import ARRAY, STRING, GGUFField, GGUFFile, open_gguf
from ..tensor import AffineQuantizedTensor

__all__ = ["from_gguf"]

if TYPE_CHECKING:
    import transformers


class _Elements:
    """gguf-py's ``ReaderField.parts`` as transformers indexes it: element ``i`` of an array (or the
    value of a scalar at 0) as a one-element numpy array, a string as its UTF-8 bytes; made on demand."""

    def __init__(self, field: GGUFField) -> None:
        self.field = field

    def __getitem__(self, i: int) -> Any:
        import numpy as np

        f = self.field
        if f.type == ARRAY:
            return f.value[i].encode("utf-8", "surrogateescape") if f.element_type == STRING else f.value[i:i + 1]
        return f.value.encode("utf-8", "surrogateescape") if f.type == STRING else np.array([f.value])


class _FieldView:
    """What transformers reads of a gguf-py ``ReaderField``: ``types``, ``data`` (indices into
    ``parts``), ``parts`` and ``contents()``; backed by the bounded reader's values."""

    def __init__(self, field: GGUFField) -> None:
        from gguf import GGUFValueType

        self.name, self._field = field.name, field
        self.types = [GGUFValueType(field.type)] + ([GGUFValueType(field.element_type)] if field.type == ARRAY else [])
        self.data = range(len(field.value)) if field.type == ARRAY else [0]
        self.parts = _Elements(field)

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        value = self._field.contents()
        return value[index_or_slice] if self._field.type == ARRAY else value


class _TensorView:
    """What transformers reads of a gguf-py ``ReaderTensor`` (the data read only on request)."""

    def __init__(self, file: GGUFFile, t: Any) -> None:
        import numpy as np
        from gguf import GGMLQuantizationType

        self._file, self._t = file, t
        self.name, self.tensor_type = t.name, GGMLQuantizationType(t.type_id)
        self.shape = np.array(t.ne, dtype=np.uint64)
        self.n_elements, self.n_bytes, self.data_offset = t.numel, t.nbytes, t.offset

    @property
    def data(self) -> Any:
        return self._file.tensor_array(self._t)


class _ReaderView:
    """gguf-py's ``GGUFReader`` interface (``fields``, ``tensors``, ``get_field``) over a checked :class:`GGUFFile`."""

    def __init__(self, file: GGUFFile) -> None:
        self.fields = {k: _FieldView(f) for k, f in file.fields.items()}
        self.tensors = [_TensorView(file, t) for t in file.tensors]

    def get_field(self, key: str) -> Any:
        return self.fields.get(key)


_GGUF_PY_LOCK = threading.Lock()
MODULE_BYTES = 4096  # tensor bytes a file must hold per block / expert beyond the first 64


MAX_KEYS = 4096  # metadata keys from_gguf hands transformers (its parser is quadratic in them; real files: ~40)
_SIZED = re.compile(r"(layers?|experts)$")  # config values transformers builds that many modules for


def _allowance(file: GGUFFile) -> tuple[int, int]:
    """(tensor bytes, the most blocks / experts they can back): 64, or one per :data:`MODULE_BYTES`."""
    data = sum(t.nbytes for t in file.tensors)
    return data, max(64, data // MODULE_BYTES)


def _check_model_size(file: GGUFFile) -> None:
    """CheckpointError when the metadata asks for more blocks or experts than the file's tensor data
    can fill: transformers builds each block as Python modules (~0.4 MB each, even on ``meta``) before
    any tensor is read, so a few bytes claiming 20000 blocks would cost gigabytes. Up to 64 are always
    allowed, beyond that one per :data:`MODULE_BYTES` bytes of tensor data (real files hold megabytes
    per block). Also refuses more than :data:`MAX_KEYS` keys and an architecture that is not a string.
    :func:`_check_config_size` checks what transformers parsed (any architecture's keys count there)."""
    arch = file.fields.get("general.architecture")
    if arch is not None and not isinstance(arch.value, str):
        raise CheckpointError(f"{file.path}: key 'general.architecture' must be a string, got {arch.contents()!r}")
    if len(file.fields) > MAX_KEYS:
        raise CheckpointError(f"{file.path}: {len(file.fields)} metadata keys; torchq hands transformers at most {MAX_KEYS}")
    data, limit = _allowance(file)
    for key, field in file.fields.items():
        if key.endswith((".block_count", ".expert_count")) and isinstance(field.value, int) and field.value > limit:
            raise CheckpointError(f"{file.path}: key {key!r} asks for {field.value}, but the file's {data} bytes of tensor "
                                  f"data can fill at most {limit} (transformers builds every one before reading a tensor)")


def _check_config_size(file: GGUFFile, config: dict) -> None:
    """:func:`_check_model_size` on the config transformers parsed from ``file`` (layer and expert counts)."""
    data, limit = _allowance(file)
    for key, value in config.items():
        if _SIZED.search(key) and isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise CheckpointError(f"{file.path}: transformers' config {key} = {value}, but the file's {data} bytes of tensor "
                                  f"data can fill at most {limit}")


class _Dispatch(threading.local):
    view: tuple[str, GGUFFile] | None = None  # (real path, checked file) while this thread runs from_gguf


_DISPATCH = _Dispatch()


@contextlib.contextmanager
def _bounded_gguf_py(file: GGUFFile):
    """While this thread's transformers reads ``file``: gguf-py's ``GGUFReader`` of that path is the
    bounded reader's view (gguf-py's own allocates a numpy object per array element and reads past a
    short file's end), and ``get_tensor_name_map`` is cached (transformers builds the whole name map
    once per module of the model: quadratic in the block count). ``gguf.GGUFReader`` is a subclass of
    gguf-py's for that time: other threads, and other paths, construct gguf-py's own reader, and get
    gguf-py's name map; both names are restored on exit."""
    import gguf

    with _GGUF_PY_LOCK:
        real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
        cached = functools.lru_cache(maxsize=4)(real_map)

        class GGUFReader(real_reader):  # type: ignore[misc, valid-type]
            def __new__(cls, path: Any, *args: Any, **kwargs: Any) -> Any:
                view = _DISPATCH.view
                if view is not None and os.path.realpath(os.fspath(path)) == view[0]:
                    return _ReaderView(view[1])
                return super().__new__(cls)

        def get_tensor_name_map(*args: Any) -> Any:
            return cached(*args) if _DISPATCH.view is not None else real_map(*args)

        GGUFReader.__qualname__ = real_reader.__qualname__
        gguf.GGUFReader, gguf.get_tensor_name_map = GGUFReader, get_tensor_name_map
        _DISPATCH.view = (os.path.realpath(file.path), file)
        try:
            yield
        finally:
            _DISPATCH.view = None
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _row_order(processor: Any, name: str, n: int, kwargs: dict) -> tuple[Any, torch.Tensor | None]:
    """(the processor's name for ``name``, the row permutation it applies to an ``[n, ...]`` weight
    (None: rows unchanged)); raises ValueError when it does more than permute rows."""
    import numpy as np

    probe = np.arange(n, dtype=np.float64).reshape(n, 1)
    result = processor.process(weights=probe.copy(), name=name, **kwargs)
    out = np.asarray(result.weights)
    if out.shape != (n, 1) or not np.array_equal(np.sort(out[:, 0]), probe[:, 0]):
        raise ValueError("the transformers tensor processor changes more than the order of its rows")
    order = out[:, 0].astype(np.int64)
    return result.name, None if np.array_equal(order, probe[:, 0].astype(np.int64)) else torch.from_numpy(order)


def _check_range(plain: PlainForm, dtype: torch.dtype, path: Path, t: Any) -> None:
    """CheckpointError when a quantized weight's values may overflow ``dtype`` (float16: finite block
    scales as large as 65504 times codes up to 127 do): a bound from the scales and zero points, no
    dequantized copy."""
    if dtype != torch.float16:  # float32 / bfloat16 hold any fp16 scale times any code
        return
    spec = plain.spec
    span = float(plain.scale.abs().max()) * (spec.quant_max - spec.quant_min) if plain.scale.numel() else 0.0
    zero = float(plain.zero_point.abs().max()) if plain.zero_point is not None and plain.zero_point.numel() else 0.0
    if span + zero > torch.finfo(dtype).max:
        raise CheckpointError(f"{path}: tensor {t.name!r} ({t.kind}): block scales up to {float(plain.scale.abs().max())!r} "
                              f"can give values beyond float16's range; import it with dtype=torch.float32 or bfloat16")


def _linear_users(model: nn.Module) -> dict[int, list[str]]:
    """id of each parameter -> the names of the ``nn.Linear`` modules whose weight it is (ties included)."""
    users: dict[int, list[str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        w = mod._parameters.get("weight") if isinstance(mod, nn.Linear) else None
        if w is not None:
            users.setdefault(id(w), []).append(name)
    return users


def _has_kernel(q: AffineQuantizedTensor, dtype: torch.dtype) -> bool:
    from ..dispatch import plan_linear

    x = torch.zeros(1, q.shape[1], dtype=dtype, device=q.device)
    return plan_linear(x, q, None).kernel is not None


def from_gguf(path: str | os.PathLike, model_class: Any = None, *, dtype: torch.dtype = torch.float32,
              layout: Any = None, strict: bool = True, without_kernel: str = "keep") -> transformers.PreTrainedModel:
    """The transformers model of the GGUF file at ``path`` with its quantized weights kept quantized
    (see the module docstring). ``model_class``: a transformers auto class or model class (default
    ``AutoModelForCausalLM``); ``dtype``: the float dtype of the model (and of the quantized weights'
    outputs); ``layout``: the torchq layout of the quantized weights (default: the device's best);
    ``strict``: every model tensor must come from the file (tied ones through their tie) and every
    file tensor must map to one, else :class:`torchq.CheckpointError`. ``without_kernel``: a
    quantized weight that a linear layer uses but for whose format no torchq linear kernel runs on
    this device (Q5_0, Q6_K, a head tied to a Q8_0 embedding, ...) is kept quantized (``"keep"``,
    default: its memory stays small and each call dequantizes it, one :class:`torchq.FallbackWarning`
    here lists them) or imported dequantized to float (``"float"``: fast, float-sized, each one
    warned)."""
    if without_kernel not in ("float", "keep"):
        raise ValueError(f"without_kernel: expected 'float' or 'keep', got {without_kernel!r}")
    path = Path(path)
    with open_gguf(path) as file:  # the whole header checked before transformers or gguf-py sees the file
        _check_model_size(file)
        return _from_checked_gguf(path, file, model_class, dtype, layout, strict, without_kernel)


def _from_checked_gguf(path: Path, file: GGUFFile, model_class: Any, dtype: torch.dtype, layout: Any, strict: bool,
                       without_kernel: str) -> Any:
    import transformers
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    cls = model_class or transformers.AutoModelForCausalLM
    if not (hasattr(cls, "from_config") or hasattr(cls, "_from_config")):
        raise ValueError(f"model_class: expected a transformers auto class or PreTrainedModel subclass, got {cls!r}")
    try:
        with _bounded_gguf_py(file), warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            parsed = load_gguf_checkpoint(str(path))  # config and tokenizer metadata, no tensors
            _check_config_size(file, parsed["config"])
            config = transformers.AutoConfig.for_model(**parsed["config"])
            with torch.device("meta"):
                build = cls.from_config if hasattr(cls, "from_config") else cls._from_config  # auto class / model class
                model = build(config, dtype=dtype)
            model.eval()
            arch = file.get("general.architecture", "")
            processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
            mapping = get_gguf_hf_weights_map(model, processor)
    except (ImportError, CheckpointError):
        raise
    except Exception as e:  # transformers' own errors on a malformed config: the file named, the cause kept
        raise CheckpointError(f"{path}: transformers cannot build a model from this GGUF file's metadata "
                              f"({type(e).__name__}: {e})") from e
    return _install(path, file, model, processor, mapping, parsed, dtype, layout, strict, without_kernel)


def _install(path: Path, file: GGUFFile, model: nn.Module, processor: Any, mapping: dict, parsed: dict, dtype: torch.dtype,
              layout: Any, strict: bool, without_kernel: str) -> Any:
    """Read ``file``'s tensors into the meta-built ``model`` (see :func:`from_gguf`)."""
    import numpy as np

    from .saving import attach

    kwargs = {"tensor_key_mapping": mapping, "parsed_parameters": parsed}
    incoming: dict[str, Incoming] = {}
    unmapped: list[str] = []
    users = _linear_users(model)
    no_kernel: list[str] = []
    params = dict(model.named_parameters(remove_duplicate=False))
    def one(t: Any) -> None:  # one file tensor -> incoming (or unmapped)
        value = t.value
        if isinstance(value, PlainForm):
            try:
                name, order = _row_order(processor, t.name, value.shape[0], kwargs)
            except ValueError as e:
                warnings.warn(f"GGUF tensor {t.name!r} ({t.kind}): {e}; imported dequantized to float",
                              GGUFDequantizedWarning, stacklevel=4)
                value = value.dequantize(torch.float32)
            else:
                if name not in mapping:
                    unmapped.append(t.name)
                    return
                plain = value if order is None else value.rows(order)
                _check_range(plain, dtype, path, t)
                q = AffineQuantizedTensor.from_plain(plain, dtype, layout=layout, label=mapping[name])
                linears = users.get(id(model.get_parameter(mapping[name])), []) if mapping[name] in params else []
                if linears and not _has_kernel(q, dtype) and without_kernel == "keep":
                    no_kernel.append(f"{t.name} ({t.kind})")
                elif linears and without_kernel == "float" and not _has_kernel(q, dtype):
                    warnings.warn(f"GGUF tensor {t.name!r} ({t.kind}): no torchq linear kernel runs {plain.spec.describe()} "
                                  f"on this device for {linears}; imported dequantized to float (without_kernel='keep' "
                                  f"keeps it quantized)", GGUFDequantizedWarning, stacklevel=4)
                    f = q.dequantize(dtype)
                    incoming[mapping[name]] = Incoming(mapping[name], tuple(f.shape), False, f"{t.kind} as float",
                                                       lambda device, f=f: f if device is None else f.to(device))
                    return
                incoming[mapping[name]] = Incoming(mapping[name], tuple(q.shape), True, f"{t.kind} as {plain.spec.describe()}",
                                                   lambda device, q=q: q if device is None else q.to(device))
                return
        numbers = value.float() if value.dtype == torch.bfloat16 else value  # numpy has no bfloat16
        result = processor.process(weights=np.asarray(numbers.numpy()), name=t.name, **kwargs)
        if result.name not in mapping:
            unmapped.append(t.name)
            return
        f = torch.from_numpy(np.array(result.weights))
        if f.is_floating_point():  # integer tensors keep their type: loading checks it against the parameter's
            f = f.to(dtype)
            if not bool(torch.isfinite(f).all()):
                raise CheckpointError(f"{path}: tensor {t.name!r} ({t.kind}): values overflow {dtype} (up to "
                                      f"{float(value.double().abs().max())!r}); import it with a wider dtype=")
        incoming[mapping[result.name]] = Incoming(mapping[result.name], tuple(f.shape), False, f"{t.kind} as float",
                                                  lambda device, f=f: f if device is None else f.to(device))

    for t in read_tensors(file, dtype=dtype, layout=layout, plain=True):
        try:
            one(t)
        except CheckpointError:
            raise
        except Exception as e:  # transformers' processor or a shape the model cannot take: the tensor named
            raise CheckpointError(f"{path}: tensor {t.name!r} ({t.kind} {list(t.shape)}): cannot be imported "
                                  f"({type(e).__name__}: {e})") from e
    if no_kernel:
        from ..dispatch import FallbackWarning

        warnings.warn(f"from_gguf: {len(no_kernel)} linear weight(s) have no torchq kernel on this device and run "
                      f"dequantize + F.linear on every call (slow): {', '.join(no_kernel[:6])}"
                      f"{' ...' if len(no_kernel) > 6 else ''}; without_kernel='float' imports them in float",
                      FallbackWarning, stacklevel=3)
    if unmapped and strict:
        raise CheckpointError(f"{path}: GGUF tensors with no parameter in {type(model).__name__}: {unmapped[:8]}")
    install_checkpoint(model, incoming, {}, device=torch.device("cpu"), strict=strict, source=str(path), init_buffers="auto")
    return attach(model)
