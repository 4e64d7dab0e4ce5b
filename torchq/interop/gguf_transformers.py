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
import io
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..canonical import PlainForm
from ..checkpoint.model_state import Incoming, install_checkpoint
from ..tensor import AffineQuantizedTensor
from .gguf import GGUFDequantizedWarning, read_gguf

__all__ = ["from_gguf"]

if TYPE_CHECKING:
    import transformers


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
    import numpy as np
    import transformers
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    from .gguf import gguf_metadata
    from .transformers import attach

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no GGUF file at {str(path)!r}")
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        parsed = load_gguf_checkpoint(str(path))  # config and tokenizer metadata, no tensors
    config = transformers.AutoConfig.for_model(**parsed["config"])
    cls = model_class or transformers.AutoModelForCausalLM
    with torch.device("meta"):
        if hasattr(cls, "from_config"):  # an auto class
            model = cls.from_config(config, dtype=dtype)
        elif hasattr(cls, "_from_config"):  # a PreTrainedModel subclass
            model = cls._from_config(config, dtype=dtype)
        else:
            raise ValueError(f"model_class: expected a transformers auto class or PreTrainedModel subclass, got {cls!r}")
    model.eval()
    arch = gguf_metadata(path).get("general.architecture", "")
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    mapping = get_gguf_hf_weights_map(model, processor)
    kwargs = {"tensor_key_mapping": mapping, "parsed_parameters": parsed}

    incoming: dict[str, Incoming] = {}
    unmapped: list[str] = []
    users = _linear_users(model)
    no_kernel: list[str] = []
    params = dict(model.named_parameters(remove_duplicate=False))
    for t in read_gguf(path, dtype=dtype, layout=layout, plain=True):
        value = t.value
        if isinstance(value, PlainForm):
            try:
                name, order = _row_order(processor, t.name, value.shape[0], kwargs)
            except ValueError as e:
                warnings.warn(f"GGUF tensor {t.name!r} ({t.kind}): {e}; imported dequantized to float",
                              GGUFDequantizedWarning, stacklevel=2)
                value = value.dequantize(torch.float32)
            else:
                if name not in mapping:
                    unmapped.append(t.name)
                    continue
                plain = value if order is None else value.rows(order)
                q = AffineQuantizedTensor.from_plain(plain, dtype, layout=layout, label=mapping[name])
                linears = users.get(id(model.get_parameter(mapping[name])), []) if mapping[name] in params else []
                if linears and not _has_kernel(q, dtype) and without_kernel == "keep":
                    no_kernel.append(f"{t.name} ({t.kind})")
                elif linears and without_kernel == "float" and not _has_kernel(q, dtype):
                    warnings.warn(f"GGUF tensor {t.name!r} ({t.kind}): no torchq linear kernel runs {plain.spec.describe()} "
                                  f"on this device for {linears}; imported dequantized to float (without_kernel='keep' "
                                  f"keeps it quantized)", GGUFDequantizedWarning, stacklevel=2)
                    f = q.dequantize(dtype)
                    incoming[mapping[name]] = Incoming(mapping[name], tuple(f.shape), False, f"{t.kind} as float",
                                                       lambda device, f=f: f if device is None else f.to(device))
                    continue
                incoming[mapping[name]] = Incoming(mapping[name], tuple(q.shape), True, f"{t.kind} as {plain.spec.describe()}",
                                                   lambda device, q=q: q if device is None else q.to(device))
                continue
        result = processor.process(weights=np.asarray(value.numpy()), name=t.name, **kwargs)
        if result.name not in mapping:
            unmapped.append(t.name)
            continue
        f = torch.from_numpy(np.array(result.weights)).to(dtype)
        incoming[mapping[result.name]] = Incoming(mapping[result.name], tuple(f.shape), False, f"{t.kind} as float",
                                                  lambda device, f=f: f if device is None else f.to(device))
    if no_kernel:
        from ..dispatch import FallbackWarning

        warnings.warn(f"from_gguf: {len(no_kernel)} linear weight(s) have no torchq kernel on this device and run "
                      f"dequantize + F.linear on every call (slow): {', '.join(no_kernel[:6])}"
                      f"{' ...' if len(no_kernel) > 6 else ''}; without_kernel='float' imports them in float",
                      FallbackWarning, stacklevel=2)
    if unmapped and strict:
        from ..checkpoint.codec import CheckpointError

        raise CheckpointError(f"{path}: GGUF tensors with no parameter in {type(model).__name__}: {unmapped[:8]}")
    install_checkpoint(model, incoming, {}, device=torch.device("cpu"), strict=strict, source=str(path), init_buffers="auto")
    return attach(model)
