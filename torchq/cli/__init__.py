"""The ``torchq`` command: inspect checkpoints, quantize models, benchmark and explain kernels.

    torchq inspect FILE [--json]                    layers, formats, sizes and metadata of a checkpoint
    torchq quantize TARGET (--config C | --plan P) -o OUT [--dtype bf16]
    torchq explain TARGET [--config C | --plan P | --checkpoint F] [--input-shape 1x4096] [--dtype bf16]
    torchq bench [bench options]                    the linear benchmark (torchq bench --help)

``TARGET`` is ``module:factory`` (or ``path/to/file.py:factory``): ``factory()`` returns the
``nn.Module`` (an ``nn.Module`` attribute is used as is). ``C`` is a config name (``int4-g128``,
``int8wo``, ``int8dq``, ``nf4``...) or a config's JSON; ``P`` a plan written by ``autoquant``.
``OUT`` ending in ``.pt``/``.pth`` is written with ``torch.save`` (a state dict), anything else with
:func:`torchq.save_quantized` (``.safetensors`` file or folder). Errors print one line and exit 1.
Sizes: ``inspect`` and ``quantize`` count alike, the bytes the file stores (and its size on disk);
``quantize`` also says what the quantized weights take in memory, in their layouts.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .text import plain_text

__all__ = ["main"]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


class CLIError(Exception):
    """A user error: printed as one line, exit status 1."""


# -- shared helpers ----------------------------------------------------------------------------------
def load_target(target: str) -> nn.Module:
    if ":" not in target:
        raise CLIError(f"target: expected 'module:factory' or 'file.py:factory', got {target!r}")
    where, attr = target.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise CLIError(f"target: no such file {where!r}")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module
            spec.loader.exec_module(module)
        else:
            sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(where)
    except CLIError:
        raise
    except Exception as e:
        raise CLIError(f"target: cannot import {where!r}: {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CLIError(f"target: {where!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    model = obj if isinstance(obj, nn.Module) else obj() if callable(obj) else obj
    if not isinstance(model, nn.Module):
        raise CLIError(f"target: {target!r} gave a {type(model).__name__}, expected a torch.nn.Module")
    return model


def parse_config(text: str):
    import torchq

    try:
        if text.lstrip().startswith("{"):
            return torchq.config_from_json(text)
        return torchq.config_from_name(text)
    except (ValueError, TypeError, KeyError) as e:
        raise CLIError(f"--config: {e}") from None


def config_spec(args) -> Any:
    import torchq

    if getattr(args, "config", None) and getattr(args, "plan", None):
        raise CLIError("--config and --plan exclude each other")
    if getattr(args, "algorithm", None) and not getattr(args, "config", None):
        raise CLIError("--algorithm: applies to --config (a plan records each layer's config, algorithm included)")
    if getattr(args, "plan", None):
        try:
            return torchq.load_plan(args.plan)
        except (OSError, ValueError) as e:
            raise CLIError(f"--plan: {e}") from None
    if getattr(args, "config", None):
        return with_algorithm(parse_config(args.config), getattr(args, "algorithm", None))
    return None


def with_algorithm(config, algorithm: str | None):
    """``config`` with its quantization algorithm set to ``algorithm`` (None: as it is)."""
    import dataclasses

    if algorithm is None:
        return config
    if "algorithm" not in {f.name for f in dataclasses.fields(config)}:
        raise CLIError(f"--algorithm: {type(config).__name__} has no algorithm choice (int4, intx and nf4 / fp4 configs do)")
    try:
        return dataclasses.replace(config, algorithm=algorithm)
    except ValueError as e:
        raise CLIError(f"--algorithm: {e}") from None


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def table(rows: list[tuple], head: tuple) -> str:
    rows = [tuple(str(v) for v in head)] + [tuple(str(v) for v in r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


# -- inspect -------------------------------------------------------------------------------------------
def _inspect_safetensors(files: list[Path]) -> tuple[list[dict], dict]:
    from safetensors import safe_open

    entries: list[dict] = []
    meta: dict = {}
    whole: set[str] = set()
    for file in files:
        with safe_open(str(file), "pt") as f:
            header = f.metadata() or {}
            record = json.loads(header["torchq"]) if "torchq" in header else None
            if record is not None and record.get("shard") == "all":  # save_pretrained: one header in every shard
                if header["torchq"] in whole:
                    continue
                whole.add(header["torchq"])
            if record is None:  # a plain safetensors file
                for key in f.keys():
                    t = f.get_slice(key)
                    shape = list(t.get_shape())
                    dtype = t.get_dtype()
                    entries.append(dict(name=key, kind="tensor", shape=shape, dtype=dtype, format="-", layout="-",
                                        bytes=_numel(shape) * _itemsize(dtype)))
                meta.setdefault("metadata", {}).update({k: v for k, v in header.items() if k != "format"})
                continue
            meta.update({k: record.get(k) for k in ("format", "version", "torchq_version", "user")})
            for name, q in record.get("quantized", {}).items():
                parts = q.get("parts", {})
                nbytes = sum(_numel(p["shape"]) * _itemsize(p["dtype"]) for p in parts.values())
                spec = q.get("spec", {})
                fmt = _describe_spec(spec)
                cfg = config_label(q.get("config"))
                entries.append(dict(name=name, kind="quantized", shape=q.get("shape"), dtype=q.get("dtype"), format=fmt,
                                    layout=(q.get("layout") or {}).get("type", "-"), config=cfg, bytes=nbytes))
            for name, fl in record.get("float", {}).items():
                entries.append(dict(name=name, kind="float", shape=fl["shape"], dtype=fl["dtype"], format="-", layout="-",
                                    bytes=_numel(fl["shape"]) * _itemsize(fl["dtype"])))
            for alias, stored in record.get("aliases", {}).items():
                entries.append(dict(name=alias, kind=f"alias of {stored}", shape="-", dtype="-", format="-", layout="-", bytes=0))
    return entries, meta


def config_label(config: dict | None) -> str:
    """A quantized weight's config as ``inspect`` shows it: its type, with the algorithm that chose
    the codes when it is not round to nearest (``Int4WeightOnlyConfig (hqq)``)."""
    if not config:
        return "-"
    algorithm = config.get("algorithm", "rtn")
    return config.get("type", "-") + ("" if algorithm == "rtn" else f" ({algorithm})")


def _describe_spec(spec: dict) -> str:
    from ..canonical import QuantSpec

    try:
        return QuantSpec.from_json(spec).describe()
    except (ValueError, TypeError, KeyError):
        return json.dumps(spec)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: str) -> int:
    name = str(dtype).lower().removeprefix("torch.")
    table_ = {"f64": 8, "float64": 8, "f32": 4, "float32": 4, "f16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
              "i64": 8, "int64": 8, "i32": 4, "int32": 4, "i16": 2, "int16": 2, "i8": 1, "int8": 1, "u8": 1, "uint8": 1,
              "bool": 1}
    return table_.get(name, 0)


def _inspect_torch(path: Path) -> tuple[list[dict], dict]:
    import torchq

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CLIError(f"{path}: not a safetensors file and torch.load(weights_only=True) failed: {type(e).__name__}: {e}") from None
    if isinstance(obj, nn.Module):
        obj = obj.state_dict()
    if not isinstance(obj, dict):
        raise CLIError(f"{path}: expected a state dict (a mapping of names to tensors), got {type(obj).__name__}")
    entries = []
    for name, t in obj.items():
        if isinstance(t, torchq.AffineQuantizedTensor):
            cfg = config_label(t.config.to_json() if t.config is not None else None)
            entries.append(dict(name=name, kind="quantized", shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                                format=t.tensor_impl.spec.describe(), layout=t.quant_layout.name, config=cfg,
                                bytes=t.nbytes_quantized()))
        elif isinstance(t, torch.Tensor):
            entries.append(dict(name=name, kind="float" if t.is_floating_point() else "tensor", shape=list(t.shape),
                                dtype=str(t.dtype).removeprefix("torch."), format="-", layout="-",
                                bytes=t.numel() * t.element_size()))
        else:
            entries.append(dict(name=name, kind=type(t).__name__, shape="-", dtype="-", format="-", layout="-", bytes=0))
    return entries, {"format": "torch.save"}


def read_entries(path: Path) -> tuple[list[dict], dict]:
    """The entries (name, kind, shape, dtype, format, layout, bytes stored) and metadata of a
    checkpoint file or folder."""
    if not path.exists():
        raise CLIError(f"{path}: no such file or folder")
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CLIError(f"{path}: a folder without .safetensors files")
        entries, meta = _inspect_safetensors(files)
    else:
        with open(path, "rb") as f:
            head = f.read(8)
        is_safetensors = len(head) == 8 and 0 < int.from_bytes(head, "little") < 100_000_000 and path.suffix != ".pt"
        if is_safetensors:
            try:
                entries, meta = _inspect_safetensors([path])
            except Exception:
                entries, meta = _inspect_torch(path)
        else:
            entries, meta = _inspect_torch(path)
    return entries, meta


def size_summary(entries: list[dict], path: Path) -> str:
    """What ``inspect`` and ``quantize`` both print: the bytes the file stores (quantized weights
    in their stored form, and all tensors) and the file's size on disk."""
    quant = [e for e in entries if e["kind"] == "quantized"]
    total = sum(e["bytes"] for e in entries)
    float_equiv = sum(_numel(e["shape"]) * _itemsize(e["dtype"]) for e in quant)
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
    return (f"{len(entries)} entries, {len(quant)} quantized; quantized weights {fmt_bytes(sum(e['bytes'] for e in quant))} "
            f"(float: {fmt_bytes(float_equiv)}); {fmt_bytes(total)} of tensors; file {fmt_bytes(on_disk)}")


def cmd_inspect(args) -> int:
    path = Path(args.file)
    entries, meta = read_entries(path)
    if args.json:
        print(json.dumps({"file": str(path), "metadata": meta, "entries": entries}, indent=1))
        return 0
    rows = [(e["name"], e["kind"], "x".join(map(str, e["shape"])) if isinstance(e["shape"], list) else e["shape"], e["dtype"],
             e["format"], e["layout"], fmt_bytes(e["bytes"])) for e in entries]
    print(table(rows, ("name", "kind", "shape", "dtype", "format", "layout", "bytes")))
    print(f"# {size_summary(entries, path)} (bytes as stored in the file)")
    if meta:
        print("# metadata: " + json.dumps(meta, sort_keys=True))
    return 0


# -- quantize ------------------------------------------------------------------------------------------
def cmd_quantize(args) -> int:
    import torchq

    spec = config_spec(args)
    if spec is None:
        raise CLIError("quantize: pass --config NAME_OR_JSON or --plan FILE")
    calibrated = _calibrated_layers(spec)
    if calibrated and not args.calibration:
        raise CLIError(f"quantize: algorithm {calibrated} needs calibration data: pass --calibration FILE (a torch.save "
                       f"file of input batches, or a .safetensors file of them)")
    if args.calibration and not calibrated:
        raise CLIError("--calibration: only the calibrated algorithms (--algorithm gptq or awq) use calibration data")
    batches = load_calibration(args.calibration) if args.calibration else None
    model = load_target(args.target)
    if args.dtype:
        model = model.to(DTYPES[args.dtype])
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    try:
        if batches is not None:
            result = torchq.calibrate(model, batches, spec, progress=not args.quiet)
            print(result.table())
        else:
            torchq.quantize_(model, spec)
    except Exception as e:
        raise CLIError(f"quantize: {e}") from None
    # distinct quantized weights (a tied weight, e.g. an embedding sharing lm_head's, counts once)
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), torchq.AffineQuantizedTensor)}
    if not weights:
        raise CLIError("quantize: no layer was quantized (no float nn.Linear or transformers Conv1D matched)")
    out = Path(args.output)
    if out.suffix in (".pt", ".pth"):
        torch.save(model.state_dict(), out)
    else:
        torchq.save_quantized(model, out)
    in_memory = sum(w.nbytes_quantized() for w in weights.values())
    entries, _ = read_entries(out)  # the same count as torchq inspect: what the file stores
    print(f"quantized {len(weights)} weights (model parameters were {fmt_bytes(before)}); wrote {out}: "
          f"{size_summary(entries, out)} (bytes as stored in the file; in memory, in their layouts, the quantized "
          f"weights take {fmt_bytes(in_memory)})")
    return 0


def _calibrated_layers(spec) -> str | None:
    """The calibrated algorithm(s) a config or plan asks for ("gptq", "awq", "gptq/awq"), or None."""
    from ..algorithms import CALIBRATED

    configs = spec.values() if isinstance(spec, dict) else [spec]
    found = sorted({getattr(c, "algorithm", None) for c in configs if c is not None} & set(CALIBRATED))
    return "/".join(found) or None


def load_calibration(path: str) -> list:
    """Calibration batches from a file: ``torch.save`` of a tensor (one batch), a list / tuple of tensors
    or of dicts of tensors (keyword inputs, e.g. ``input_ids`` and ``attention_mask``), loaded with
    ``weights_only=True``; or a ``.safetensors`` file, one batch per tensor in name order."""
    p = Path(path)
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            data = load_file(str(p))
            return [data[k] for k in sorted(data)]
        obj = torch.load(p, weights_only=True)
    except Exception as e:
        raise CLIError(f"--calibration: cannot read {path}: {type(e).__name__}: {e}") from None
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)) and obj and all(
            isinstance(b, torch.Tensor) or (isinstance(b, dict) and all(isinstance(v, torch.Tensor) for v in b.values())) for b in obj):
        return list(obj)
    raise CLIError(f"--calibration: {path} holds {type(obj).__name__}; expected a tensor, or a non-empty list of tensors "
                   f"or of dicts of tensors (one model input per entry)")


# -- explain -------------------------------------------------------------------------------------------
def cmd_explain(args) -> int:
    import torchq

    model = load_target(args.target)
    if args.dtype:
        model = model.to(DTYPES[args.dtype])
    spec = config_spec(args)
    if spec is not None and args.checkpoint:
        raise CLIError("--checkpoint excludes --config and --plan (the checkpoint says how each layer is quantized)")
    if spec is not None:
        try:
            torchq.quantize_(model, spec)
        except Exception as e:
            raise CLIError(f"quantize: {e}") from None
    elif args.checkpoint:
        try:
            if Path(args.checkpoint).suffix in (".pt", ".pth"):
                model.load_state_dict(torch.load(args.checkpoint, weights_only=True), assign=True)
            else:
                torchq.load_quantized(model, args.checkpoint)
        except Exception as e:
            raise CLIError(f"--checkpoint: {type(e).__name__}: {e}") from None
    if args.input_shape:
        try:
            shape = [int(v) for v in args.input_shape.lower().split("x")]
        except ValueError:
            raise CLIError(f"--input-shape: expected sizes like 1x4096, got {args.input_shape!r}") from None
        dtype = DTYPES[args.dtype] if args.dtype else next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        report = torchq.explain(model, torch.randn(*shape).to(dtype))
    else:
        report = torchq.explain(model)
    if not len(report):
        raise CLIError("explain: the model has no quantized linear layers (pass --config, --plan or --checkpoint)")
    print(report)
    return 0


# -- bench ---------------------------------------------------------------------------------------------
def cmd_bench(argv: list[str]) -> int:
    from . import bench_table

    return bench_table.main(argv, prog="torchq bench")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchq", description=plain_text(__doc__.split("\n\n")[0]),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=plain_text(__doc__.split("\n\n", 1)[1]))
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("inspect", help="list a checkpoint's layers, formats, sizes and metadata")
    s.add_argument("file", help="a .safetensors file or folder, or a torch.save file")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s = sub.add_parser("quantize", help="quantize a model and write a checkpoint")
    s.add_argument("target", help="module:factory returning the nn.Module")
    s.add_argument("--config", help="a config name (int4-g128, int8wo, int8dq, nf4, ...) or a config's JSON")
    s.add_argument("--plan", help="a plan JSON written by autoquant")
    s.add_argument("--algorithm", help="how --config's codes are chosen: rtn (round to nearest, the "
                   "default), hqq (HQQ zero points, no data; int4 and intx configs), gptq or awq (calibrated: "
                   "need --calibration; int4, intx, nf4 / fp4 configs)")
    s.add_argument("--calibration", help="calibration inputs for gptq / awq: a torch.save file of a tensor or a list "
                   "of tensors / dicts of tensors (one model call each), or a .safetensors file (one tensor per call)")
    s.add_argument("--quiet", action="store_true", help="no calibration progress lines")
    s.add_argument("--dtype", choices=sorted(DTYPES), help="cast the model to this dtype before quantizing")
    s.add_argument("-o", "--output", required=True, help="out.safetensors, a folder, or out.pt")
    s = sub.add_parser("explain", help="print the kernel each quantized linear uses and why the others were rejected")
    s.add_argument("target", help="module:factory returning the nn.Module")
    s.add_argument("--config", help="quantize the model with this config first: a name (int4-g128, int8wo, ...) or JSON")
    s.add_argument("--plan", help="quantize the model with this autoquant plan (JSON file) first")
    s.add_argument("--checkpoint", help="quantized weights to load into the model (instead of --config / --plan)")
    s.add_argument("--input-shape", help="run the model on a random input of this shape (e.g. 1x4096); "
                   "default: check each layer against a one-row input")
    s.add_argument("--dtype", choices=sorted(DTYPES), help="cast the model (and the input) to this dtype first")
    sub.add_parser("bench", help="the linear benchmark (options: torchq bench --help)", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return {"inspect": cmd_inspect, "quantize": cmd_quantize, "explain": cmd_explain}[args.command](args)
    except CLIError as e:
        print(f"torchq {args.command}: error: {_one_line(str(e))}", file=sys.stderr)
        return 1
    except Exception as e:  # an unexpected failure still ends in one line
        print(f"torchq {args.command}: error: {type(e).__name__}: {_one_line(str(e))}", file=sys.stderr)
        return 1


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
