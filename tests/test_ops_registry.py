"""The op registry: every ``torch.ops.torchq`` op is defined in :mod:`torchq.ops`, has a fake
(Meta) and a reference (CompositeExplicitAutograd) implementation, and is listed in the table of
``torchq.ops``' docstring with exactly the device implementations the backends register."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import torchq

ROOT = Path(torchq.__file__).parent
DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU"}


def registered_ops() -> list[str]:
    """Every ``torchq::`` op overload as ``name`` or ``name.overload``."""
    names = []
    for name in dir(torch.ops.torchq):
        packet = getattr(torch.ops.torchq, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        names += [name if overload == "default" else f"{name}.{overload}" for overload in packet.overloads()]
    return sorted(names)


def documented_ops() -> dict[str, tuple[str, str]]:
    """The docstring table of torchq.ops: op -> (module, implementations)."""
    lines = [line.strip() for line in torchq.ops.__doc__.splitlines()]
    rules = [i for i, line in enumerate(lines) if line.startswith("=====")]
    rows = {}
    for line in lines[rules[1] + 1 : rules[2]]:  # between the header's rule and the closing one
        op, module, impls = re.split(r"\s{2,}", line, maxsplit=2)
        rows[op] = (module, impls)
    return rows


def qualified(op: str) -> str:
    return f"torchq::{op}"


def test_every_op_has_a_fake_and_a_reference():
    for op in registered_ops():
        for key in ("Meta", "CompositeExplicitAutograd"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified(op), key), f"{op}: no {key} implementation"


def test_the_table_lists_every_op_with_its_device_implementations():
    table = documented_ops()
    ops = registered_ops()
    assert sorted(table) == ops
    for op, (module, impls) in table.items():
        claimed = {device for device, key in DEVICE_KEYS.items() if f"{device}:" in impls}
        registered = {device for device, key in DEVICE_KEYS.items()
                      if torch._C._dispatch_has_kernel_for_dispatch_key(qualified(op), key)}
        assert claimed == registered, f"{op}: table says {sorted(claimed)}, backends register {sorted(registered)}"
        source = (ROOT / "ops" / f"{module}.py").read_text()
        assert f'"torchq::{op.split(".")[0]}' in source or f'define_out_overload("{op.split(".")[0]}"' in source, \
            f"{op}: not defined in torchq/ops/{module}.py"


def test_no_op_is_defined_outside_torchq_ops():
    # a Library opened with "IMPL" only registers kernels for ops defined elsewhere
    pattern = re.compile(r"custom_op\(|\.define\(|library\.Library\((?![^)]*\"IMPL\")")
    offenders = [str(path.relative_to(ROOT)) for path in ROOT.rglob("*.py")
                 if path.parent.name != "ops" and pattern.search(path.read_text())]
    assert offenders == []
