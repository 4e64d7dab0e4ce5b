"""AdamW with blockwise-quantized states: :class:`AdamW8bit` and :class:`AdamW4bit`.

Drop-in for :class:`torch.optim.AdamW` (same arguments, param groups, ``state_dict`` round trip,
lr schedulers, lr as a float or a 0-d tensor). Per parameter and step, in fp32:

    g = -grad if maximize else grad
    m = m * beta1 + g * (1 - beta1)            (m, v decoded from their codes first)
    v = v * beta2 + (g * g) * (1 - beta2)
    p = p * (1 - lr * weight_decay)            (decoupled weight decay, as torch.optim.AdamW)
    p = p - (m / (sqrt(v) / sqrt(1 - beta2^step) + eps)) * (lr / (1 - beta1^step))

with the scalars computed in Python floats and rounded once to fp32, every tensor operation one
correctly rounded fp32 operation on every device (no fused multiply-add, no reciprocal; sqrt computed in fp64 and rounded once,
since torch's fp32 CPU sqrt is not correctly rounded): torch.optim.AdamW's formula, bias correction included,
evaluated in a fixed order. The parameter moves with the *unquantized* new moments; then each
moment is re-encoded (:mod:`torchq.optim.formats`: new absmax per block = max |updated value|).

Parameters with fewer than ``min_quantized_numel`` (4096, bitsandbytes' ``min_8bit_size``)
elements keep fp32 states (``exp_avg``, ``exp_avg_sq`` like torch's, in fp32 whatever the
parameter's dtype). A DTensor parameter (FSDP2) is updated shard by shard: its blocks run over the
flattened *local* shard, so the states depend on the sharding (not on the world's other shards) and
a checkpoint of them loads onto the same mesh and sharding only.

Non-finite gradients: an element whose gradient is NaN or +-inf gets a NaN parameter at once, as
torch.optim.AdamW gives (a finite gradient whose square overflows fp32, |g| > ~1.8e19, leaves it
unchanged, v = inf, also as torch's). A quantized block holding a non-finite moment is stored
with ``absmax = NaN`` (codes of 0.0), so every parameter of that block turns NaN at the next step
(a block cannot hold one NaN among finite values). Skip such steps (``torch.amp.GradScaler``
does) or clip gradients.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from ..division import divide
from ..native import warn_reference
from ..tensor import AffineQuantizedTensor
from . import native
from .formats import FORMAT_4BIT, FORMAT_8BIT, StateFormat, dequantize_state, quantize_state

__all__ = ["QuantizedAdamW", "AdamW8bit", "AdamW4bit", "BACKENDS", "MIN_QUANTIZED_NUMEL", "reference_update", "step_scalars"]

BACKENDS = ("auto", "native", "reference")
MIN_QUANTIZED_NUMEL = 4096
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (overflow: +-inf)."""
    return ctypes.c_float(x).value


def step_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> dict[str, float]:
    """The fp32 scalars of one step (names: :data:`torchq.optim.native.SCALARS`), from Python
    floats as torch.optim.AdamW computes them."""
    return {
        "beta1": _f32(beta1), "one_minus_beta1": _f32(1 - beta1), "beta2": _f32(beta2), "one_minus_beta2": _f32(1 - beta2),
        "decay": _f32(1 - lr * weight_decay), "step_size": _f32(lr / (1 - beta1**step)),
        "bias_correction2_sqrt": _f32((1 - beta2**step) ** 0.5), "eps": _f32(eps),
    }


def _adamw_fp32(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: dict[str, float],
                maximize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(new param fp32, new m, new v) by the module docstring's formula (flat fp32 inputs)."""
    if maximize:
        g = -g
    m = m * s["beta1"] + g * s["one_minus_beta1"]
    v = v * s["beta2"] + (g * g) * s["one_minus_beta2"]
    p = p * s["decay"]
    # sqrt correctly rounded (in fp64, rounded once): torch's fp32 CPU sqrt is not (an ulp off at times)
    # divided, not multiplied by a reciprocal (CUDA's division by a Python number): the CPU's bits everywhere
    denom = divide(v.double().sqrt().float(), s["bias_correction2_sqrt"]) + s["eps"]
    return p - (m / denom) * s["step_size"], m, v


def reference_update(param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], fmt: StateFormat, scalars: dict[str, float],
                     maximize: bool) -> None:
    """One step of one local (non-DTensor) tensor in place, in torch ops: decode the states with
    ``torch.ops.torchq.dequantize_blockwise``, update, encode with ``quantize_blockwise``."""
    n = param.numel()
    if n == 0:
        return
    nb = fmt.blocks(n)
    c1, a1, c2, a2 = (_local(state[k]) for k in ("exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"))
    m = dequantize_state(c1, a1[:nb], n, fmt, signed=True)
    v = dequantize_state(c2, a2[:nb], n, fmt, signed=False)
    p, m, v = _adamw_fp32(param.reshape(-1).float(), grad.reshape(-1).float(), m, v, scalars, maximize)
    param.copy_(p.view(param.shape))
    for codes, absmax, x, signed in ((c1, a1, m, True), (c2, a2, v, False)):
        q, amax = quantize_state(x, fmt, signed)
        codes.reshape(-1)[: q.numel()].copy_(q)
        absmax[:nb].copy_(amax)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _number(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{what}: expected a number or a 1-element tensor, got a tensor of shape {list(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def _check_hyperparameters(group: dict[str, Any], where: str) -> None:
    lr = _number(group["lr"], f"{where}lr")
    if not lr >= 0:
        raise ValueError(f"{where}lr: expected a learning rate >= 0, got {lr}")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}betas: expected a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        b = _number(b, f"{where}betas[{i}]")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{where}betas[{i}]: expected a value in [0, 1), got {b}")
    eps = _number(group["eps"], f"{where}eps")
    if not eps >= 0:
        raise ValueError(f"{where}eps: expected eps >= 0, got {eps}")
    wd = _number(group["weight_decay"], f"{where}weight_decay")
    if not wd >= 0:
        raise ValueError(f"{where}weight_decay: expected weight_decay >= 0, got {wd}")
    if group.get("amsgrad"):
        raise ValueError(f"{where}amsgrad: expected False (quantized-state AdamW keeps no max of exp_avg_sq), got True")


def _check_param(p: Any, where: str) -> None:
    if isinstance(p, AffineQuantizedTensor) or isinstance(_local(p) if isinstance(p, DTensor) else p, AffineQuantizedTensor):
        raise TypeError(f"{where}: a torchq AffineQuantizedTensor (a quantized weight) cannot be optimized; train float "
                        "parameters (adapters, QAT's float weights) and keep quantized weights frozen")
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(p).__name__}")
    if type(p) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(p, DTensor):
        raise TypeError(f"{where}: expected a plain tensor, nn.Parameter or DTensor, got the tensor subclass {type(p).__name__}")
    if p.dtype not in _FLOATS:
        raise TypeError(f"{where}: expected a floating-point parameter (fp32, bf16 or fp16), got {p.dtype}")
    if isinstance(p, DTensor) and any(pl.is_partial() for pl in p.placements):
        raise ValueError(f"{where}: expected a DTensor with Shard / Replicate placements, got {p.placements}")


def _max_local_numel(p: DTensor) -> tuple[int, int]:
    """(the largest local shard's numel over the mesh (torch.chunk rule), how many shards)."""
    shape, shards = list(p.shape), 1
    for dim_size, pl in zip(p.device_mesh.shape, p.placements):
        if isinstance(pl, Shard):
            shape[pl.dim] = -(-shape[pl.dim] // dim_size)
            shards *= dim_size
    return math.prod(shape), shards


def _flat_state(p: torch.Tensor, local_len: int, dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
    """A 1-D state of ``local_len`` entries on p's device: a DTensor sharded over every mesh
    dimension that shards p (the shards are the local blocks, padded to the largest) when p is one."""
    local = torch.full((local_len,), fill, dtype=dtype, device=_local(p).device if isinstance(p, DTensor) else p.device)
    if not isinstance(p, DTensor):
        return local
    shards = _max_local_numel(p)[1]
    placements = tuple(Shard(0) if isinstance(pl, Shard) else pl for pl in p.placements)
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False, shape=torch.Size([local_len * shards]),
                              stride=(1,))


class QuantizedAdamW(torch.optim.Optimizer):
    """AdamW whose two moments are stored in ``state_format`` (:mod:`torchq.optim.formats`); use
    :class:`AdamW8bit` or :class:`AdamW4bit`. Arguments as :class:`torch.optim.AdamW`
    (``amsgrad=True``, ``capturable=True`` and ``differentiable=True`` are refused; ``foreach``
    and ``fused`` are accepted and ignored: the update is always fused per tensor), plus
    ``min_quantized_numel`` (smaller parameters keep fp32 states) and ``backend``: ``"native"``
    (the fused C++ kernel, fp32 and bf16 CPU parameters), ``"reference"`` (torch ops, any device),
    or ``"auto"`` (native where it applies, else the reference, warned once when the library is
    missing)."""

    state_format: StateFormat

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False, fused: bool | None = None,
                 min_quantized_numel: int = MIN_QUANTIZED_NUMEL, backend: str = "auto") -> None:
        if capturable:
            raise ValueError("capturable: expected False (CUDA-graph capture is not supported), got True")
        if differentiable:
            raise ValueError("differentiable: expected False, got True")
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if isinstance(min_quantized_numel, bool) or not isinstance(min_quantized_numel, int) or min_quantized_numel < 1:
            raise ValueError(f"min_quantized_numel: expected a positive int, got {min_quantized_numel!r}")
        if backend == "native" and native.available() is not None:
            raise RuntimeError(f"backend: 'native' is not available: {native.available()}")
        self.backend = backend
        self.min_quantized_numel = min_quantized_numel
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (list, tuple)) else betas, eps=eps,
                        weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=False,
                        differentiable=False, fused=fused)
        _check_hyperparameters(defaults, "")
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As :meth:`torch.optim.Optimizer.add_param_group`, checking the group's parameters and
        hyperparameters first."""
        index = len(self.param_groups)
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):  # a set: torch's add_param_group refuses it
            param_group["params"] = params = list(params)
        for i, p in enumerate([params] if isinstance(params, torch.Tensor) else params):
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):  # named parameters
                p = p[1]
            _check_param(p, f"params (group {index}, parameter {i})")
        merged = {**self.defaults, **param_group}
        _check_hyperparameters(merged, f"param_groups[{index}].")
        super().add_param_group(param_group)

    # -- states --------------------------------------------------------------------------------
    def _format_of(self, p: torch.Tensor) -> StateFormat | None:
        return self.state_format if p.numel() >= self.min_quantized_numel else None

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        fmt = self._format_of(p)
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["state_bits"] = 32 if fmt is None else fmt.bits
        if fmt is None:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            return
        n = _max_local_numel(p)[0] if isinstance(p, DTensor) else p.numel()
        zero1 = int(torch.nonzero(fmt.signed_map == 0)[0, 0])  # decodes to 0 whatever the absmax
        if fmt.bits == 8 and not isinstance(p, DTensor):
            state["exp_avg"] = torch.full(p.shape, zero1, dtype=torch.uint8, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
        else:
            state["exp_avg"] = _flat_state(p, fmt.code_bytes(n), torch.uint8, zero1 * (17 if fmt.bits == 4 else 1))
            state["exp_avg_sq"] = _flat_state(p, fmt.code_bytes(n), torch.uint8)
        state["exp_avg_absmax"] = _flat_state(p, fmt.blocks(n), torch.float32)
        state["exp_avg_sq_absmax"] = _flat_state(p, fmt.blocks(n), torch.float32)

    def _expected_states(self, p: torch.Tensor) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """name -> (dtype, local shape) of a parameter's state tensors."""
        fmt = self._format_of(p)
        local_shape = tuple(_local(p).shape) if isinstance(p, DTensor) else tuple(p.shape)
        if fmt is None:
            return {"exp_avg": (torch.float32, local_shape), "exp_avg_sq": (torch.float32, local_shape)}
        n = _max_local_numel(p)[0] if isinstance(p, DTensor) else p.numel()
        codes = (fmt.code_bytes(n),) if fmt.bits == 4 or isinstance(p, DTensor) else local_shape
        return {"exp_avg": (torch.uint8, codes), "exp_avg_sq": (torch.uint8, codes),
                "exp_avg_absmax": (torch.float32, (fmt.blocks(n),)), "exp_avg_sq_absmax": (torch.float32, (fmt.blocks(n),))}

    def state_bytes(self) -> int:
        """Bytes of every state tensor held now (local shards for DTensors; ``step`` excluded)."""
        total = 0
        for state in self.state.values():
            for k, v in state.items():
                if k != "step" and isinstance(v, torch.Tensor):
                    t = _local(v)
                    total += t.numel() * t.element_size()
        return total

    # -- step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step over every parameter with a gradient (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        kernel = native.kernel() if self.backend != "reference" else None
        if kernel is None and self.backend == "auto" and native.available() not in (None, "disabled by torchq.native.disabled()"):
            warn_reference("adamw_blockwise", native.available())
        for group in self.param_groups:
            lr = _number(group["lr"], "lr")
            beta1, beta2 = (_number(b, "betas") for b in group["betas"])
            eps, wd, maximize = float(group["eps"]), float(group["weight_decay"]), bool(group["maximize"])
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError(f"params (parameter {i}): sparse gradients are not supported by {type(self).__name__}")
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                scalars = step_scalars(lr, beta1, beta2, eps, wd, int(state["step"].item()))
                self._update(p, grad, state, scalars, maximize, kernel)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], scalars: dict[str, float], maximize: bool,
                kernel: Any) -> None:
        fmt = self._format_of(p)
        pl, gl = _local(p), _local(grad)
        if fmt is None:
            m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            new_p, new_m, new_v = _adamw_fp32(pl.float(), gl.float(), m, v, scalars, maximize)
            pl.copy_(new_p)
            m.copy_(new_m)
            v.copy_(new_v)
            return
        if (kernel is not None and pl.device.type == "cpu" and pl.dtype in (torch.float32, torch.bfloat16) and pl.is_contiguous()
                and gl.dtype == pl.dtype and gl.device == pl.device and pl.numel() > 0):
            native.fused_update(kernel, pl, gl.contiguous(), *(_local(state[k]) for k in ("exp_avg", "exp_avg_absmax", "exp_avg_sq",
                                                                            "exp_avg_sq_absmax")),
                                fmt, scalars, maximize)
            return
        if kernel is not None and self.backend == "native" and pl.numel() > 0:
            raise RuntimeError(f"backend: 'native' takes contiguous fp32 / bf16 CPU parameters with gradients of their dtype, "
                               f"got {pl.dtype} on {pl.device} (contiguous: {pl.is_contiguous()}), gradient {gl.dtype}; "
                               "use backend='auto' or 'reference'")
        reference_update(pl, gl, state, fmt, scalars, maximize)

    # -- state dict ----------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`torch.optim.Optimizer.load_state_dict`, for this optimizer's own state dicts:
        a state of another format (torch.optim.AdamW's fp32 moments for a quantized parameter, 8-bit
        states in :class:`AdamW4bit` ...) raises a ValueError naming the parameter. States keep
        their dtypes (codes uint8, absmax fp32) and move to the parameter's device."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict: expected an optimizer state dict with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict: expected {len(self.param_groups)} param groups, got {len(saved_groups)}")
        id_map: dict[Any, torch.Tensor] = {}
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"state_dict: param group {gi} has {len(saved['params'])} parameters, this optimizer's "
                                 f"has {len(group['params'])}")
            _check_hyperparameters({**self.defaults, **saved}, f"state_dict param_groups[{gi}].")
            id_map.update(zip(saved["params"], group["params"]))
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        for key, saved in state_dict["state"].items():
            if key not in id_map:
                raise ValueError(f"state_dict: state for parameter id {key!r} that no param group lists")
            p = id_map[key]
            new_state[p] = self._checked_state(p, saved, key)
        groups_only = {"state": {}, "param_groups": saved_groups}
        super().load_state_dict(groups_only)
        for p, s in new_state.items():
            self.state[p] = s

    def _checked_state(self, p: torch.Tensor, saved: dict[str, Any], key: Any) -> dict[str, Any]:
        name = type(self).__name__
        fmt = self._format_of(p)
        want_bits = 32 if fmt is None else fmt.bits
        bits = saved.get("state_bits")
        if bits is None:
            raise ValueError(f"state_dict: the state of parameter {key!r} has no 'state_bits': it comes from another optimizer "
                             f"(torch.optim.AdamW?); {name} expects {want_bits}-bit states for this {p.numel()}-element parameter")
        if bits != want_bits:
            raise ValueError(f"state_dict: the state of parameter {key!r} holds {bits}-bit states, {name} expects {want_bits}-bit "
                             f"states for this {p.numel()}-element parameter (min_quantized_numel {self.min_quantized_numel})")
        out: dict[str, Any] = {"state_bits": want_bits}
        step = saved.get("step")
        out["step"] = torch.tensor(float(step.item() if isinstance(step, torch.Tensor) else step), dtype=torch.float32)
        for k, (dtype, shape) in self._expected_states(p).items():
            v = saved.get(k)
            local = _local(v) if isinstance(v, torch.Tensor) else None
            if local is None or local.dtype != dtype or tuple(local.shape) != shape:
                got = "nothing" if local is None else f"{local.dtype} {list(local.shape)}"
                raise ValueError(f"state_dict: state {k!r} of parameter {key!r}: expected {dtype} {list(shape)} "
                                 f"({want_bits}-bit {name} state of the local tensor), got {got}")
            # a copy: the optimizer updates it in place, the caller's state dict stays as it was
            local = local.to(device=_local(p).device if isinstance(p, DTensor) else p.device, copy=True)
            if not isinstance(p, DTensor):
                out[k] = local
            elif fmt is None:
                out[k] = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
            else:
                out[k] = _flat_state(p, local.numel(), local.dtype)
                _local(out[k]).copy_(local)
        return out


class AdamW8bit(QuantizedAdamW):
    """AdamW with bitsandbytes' blockwise 8-bit states: blocks of 256, signed dynamic map for
    ``exp_avg``, unsigned for ``exp_avg_sq``, one fp32 absmax per block: 2.03 bytes of state per
    parameter (torch.optim.AdamW: 8). Arguments: :class:`QuantizedAdamW`."""

    state_format = FORMAT_8BIT


class AdamW4bit(QuantizedAdamW):
    """AdamW with 4-bit states (torchao's format): blocks of 128, a signed 4-bit dynamic-exponent
    map for ``exp_avg``, the zero-free linear map ``k / 16`` for ``exp_avg_sq``, two codes per
    byte, one fp32 absmax per block: 1.0625 bytes of state per parameter. Arguments:
    :class:`QuantizedAdamW`."""

    state_format = FORMAT_4BIT

