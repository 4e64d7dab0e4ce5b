"""Checkpoint size, save time and load time of a quantized LLM-like model, per config and format.

A synthetic decoder stack is built in bf16 with a fixed seed: an embedding, ``--layers`` blocks
(RMSNorm, q/k/v/o projections of ``hidden x hidden``, RMSNorm, gate/up ``hidden -> inter`` and
down ``inter -> hidden``, all ``nn.Linear(bias=False)``) and a final RMSNorm. For each config the
model is quantized with ``torchq.quantize_`` (only the Linear weights; embedding and norms stay
float) and written into a temporary directory in two formats:

* ``pt``: ``torch.save(model.state_dict())``, loaded with ``torch.load(weights_only=True)`` +
  ``load_state_dict(assign=True)`` into a model built on the ``meta`` device;
* ``st``: ``torchq.save_quantized`` (float baseline: plain ``safetensors.torch.save_file``), loaded
  with ``torchq.load_quantized(meta_model, device="cpu")`` with ``verify=True`` (CRC checks) and
  ``verify=False``; the float baseline is also loaded with ``safetensors.torch.load_file`` +
  ``load_state_dict(assign=True)``, the reference for this format. The float model is also
  written with ``torchq.save_quantized`` (writer ``save_quantized``), which stores CRCs.

Columns: ``MB`` (10^6 bytes, all files); ``size_x``: this / the float bf16 checkpoint of the same
format; ``bits/w``: bits per Linear weight element (file size less the float embedding and norms,
header overhead included); ``save_s``: median of ``--save-repeats`` writes; ``load_s``: median of
``--repeats`` loads, each into a freshly built meta model (not timed) until a usable CPU model;
``load_x``: this / loading the float checkpoint of the same format with the plain loader
(``torch.load`` for ``pt``, ``safetensors.load_file`` for ``st``; <1 = faster); ``load_xpt``: this /
the float ``torch.load``. ``safetensors`` memory-maps the file and pages data in on first use, so
the ``st`` float reference is near zero (``load_x`` is large there) and ``load_xpt`` compares with
reading every byte. Files are read right after they are written, so from the page cache (warm).
``ok``: the loaded model's output on a fixed input is ``torch.equal`` to the original quantized
model's (``FallbackWarning`` suppressed). The check runs in a forked child (single-threaded), so a
kernel that crashes is reported as ``FAIL (forward CRASHED ...)`` instead of ending the run; any
failure makes the script raise ``AssertionError`` after printing the table.

    python benchmarks/bench_serialization.py               # ~170M params, a few minutes on 2 cores
    python benchmarks/bench_serialization.py --quick       # tiny model, smoke test
    python benchmarks/bench_serialization.py --configs float,int4-g128 --shard-size 200MB --json out.json

Config names: float, int8wo, int8dq, int4-g<G>, intx<B>-g<G>.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

import torchq

DEFAULT_CONFIGS = "float,int8wo,int8dq,int4-g128,intx3-g32"
COLUMNS = [("format", "<"), ("config", "<"), ("writer", "<"), ("loader", "<"), ("MB", ">"), ("size_x", ">"), ("bits/w", ">"),
           ("save_s", ">"), ("load_s", ">"), ("load_x", ">"), ("load_xpt", ">"), ("ok", "<")]
BASE_LOADER = {"pt": "torch.load", "st": "safetensors.load_file"}  # float loads in these are the load_x references


# -- the model -----------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": dtype}
        self.attn_norm = nn.RMSNorm(hidden, dtype=dtype)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden, **kw) for _ in range(4))
        self.mlp_norm = nn.RMSNorm(hidden, dtype=dtype)
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter, **kw), nn.Linear(hidden, inter, **kw)
        self.down_proj = nn.Linear(inter, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn_norm(x)  # a stand-in for attention: every projection is used, no softmax
        x = x + self.o_proj(F.silu(self.q_proj(a)) * self.k_proj(a) + self.v_proj(a))
        m = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, inter: int, layers: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, dtype=dtype)
        self.blocks = nn.ModuleList(Block(hidden, inter, dtype) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def build_model(args, seed: int | None = None) -> TinyLM:
    """The float bf16 model (same weights for a given seed); on the meta device when built under ``torch.device("meta")``."""
    if seed is not None:
        torch.manual_seed(seed)
    return TinyLM(args.vocab, args.hidden, args.inter, args.layers).eval()


def build_meta(args) -> TinyLM:
    with torch.device("meta"):
        return build_model(args)


def linear_numel(args) -> int:
    return args.layers * (4 * args.hidden * args.hidden + 3 * args.hidden * args.inter)


def other_bytes(args) -> int:
    """Bytes of the float (never quantized) tensors: embedding and norms, bf16."""
    return 2 * (args.vocab * args.hidden + (2 * args.layers + 1) * args.hidden)


def forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.FallbackWarning)
        return model(ids)


def free() -> None:
    gc.collect()


# -- writing and loading -------------------------------------------------------------------------
def path_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size


def st_target(d: Path, stem: str, args) -> Path:
    """A ``.safetensors`` file, or a folder when sharding (``--shard-size``)."""
    return d / stem if args.shard_size else d / f"{stem}.safetensors"


def write(writer: str, model: nn.Module, path: Path, args) -> None:
    if writer == "torch.save":
        torch.save(model.state_dict(), path)
    elif writer == "save_file":
        safetensors.torch.save_file(model.state_dict(), str(path))
    elif writer == "save_quantized":
        if args.shard_size:
            torchq.save_quantized(model, path, max_shard_size=args.shard_size)
        else:
            torchq.save_quantized(model, path)
    else:
        raise ValueError(writer)


def timed_load(loader: str, path: Path, args) -> tuple[float, nn.Module]:
    """(seconds, model): one load of ``path`` into a freshly built meta model (building it is not timed)."""
    fresh = build_meta(args)
    t0 = time.perf_counter()
    if loader == "torch.load":
        fresh.load_state_dict(torch.load(path, weights_only=True), assign=True)
    elif loader == "safetensors.load_file":
        fresh.load_state_dict(safetensors.torch.load_file(str(path)), assign=True)
    elif loader in ("load_quantized", "load_quantized(verify=False)"):
        fresh = torchq.load_quantized(fresh, path, device="cpu", verify=loader == "load_quantized")
    else:
        raise ValueError(loader)
    return time.perf_counter() - t0, fresh


def timed_write(writer: str, model: nn.Module, path: Path, args) -> float:
    """Median seconds of ``--save-repeats`` writes of ``model`` to ``path`` (each overwrites the last)."""
    times = []
    for _ in range(args.save_repeats):
        t0 = time.perf_counter()
        write(writer, model, path, args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_loads(loader: str, path: Path, ids: torch.Tensor, ref: torch.Tensor, args) -> dict:
    """Median load time over ``--repeats`` and whether the last loaded model reproduces ``ref`` bit for bit."""
    times = []
    for i in range(args.repeats):
        free()
        t, model = timed_load(loader, path, args)
        times.append(t)
        if i < args.repeats - 1:
            del model
    row = {"load_s": statistics.median(times), "load_min_s": min(times), "unaligned_tensors": len(unaligned_tensors(model))}
    leftover = [n for n, t in model.state_dict().items() if t.device.type == "meta"]
    if leftover:
        row.update(ok=False, note=f"still on meta after loading: {leftover[:4]}")
    else:
        row["ok"], note = check_output(model, ids, ref, args)
        if note and "CRASHED" in note and row["unaligned_tensors"]:
            note += f"; {row['unaligned_tensors']} loaded tensors not 16-byte aligned (memory-mapped)"
        if note:
            row["note"] = note
    del model
    free()
    return row


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``, or the plain tensors inside a tensor subclass (found through ``__tensor_flatten__``)."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [p for n in names for p in _plain_tensors(getattr(t, n))]


def unaligned_tensors(model: nn.Module, align: int = 16) -> list[str]:
    """State-dict entries holding a tensor whose data pointer is not ``align``-byte aligned (e.g. memory-mapped
    at an arbitrary file offset); some CPU kernels (``aten._weight_int8pack_mm`` in bf16) crash on those."""
    out = []
    for name, t in model.state_dict().items():
        try:
            if any(p.numel() and p.data_ptr() % align for p in _plain_tensors(t)):
                out.append(name)
        except Exception:  # a subclass we cannot see into: not counted
            pass
    return out


def check_output(model: nn.Module, ids: torch.Tensor, ref: torch.Tensor, args) -> tuple[bool, str]:
    """(ok, note): is ``model(ids)`` ``torch.equal`` to ``ref``? Run in a forked child (where ``os.fork`` exists and
    ``--no-fork`` is not given) so that a crashing kernel is reported as a failed check instead of ending the run."""

    def check() -> str:
        out = forward(model, ids)
        if torch.equal(out, ref):
            return ""
        if out.shape != ref.shape or out.dtype != ref.dtype:
            return f"output {out.dtype} {list(out.shape)}, expected {ref.dtype} {list(ref.shape)}"
        return f"output differs from the original model's (max abs diff {(out.float() - ref.float()).abs().max().item():.3g})"

    if args.no_fork or not hasattr(os, "fork"):
        note = check()
        return not note, note
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report through the pipe, never return into the benchmark
        code = 0
        try:
            os.close(r)
            torch.set_num_threads(1)  # OpenMP's thread pool does not survive fork (more threads hang)
            msg = check()
        except BaseException as e:
            msg, code = f"forward raised {type(e).__name__}: {e}", 2
        try:
            os.write(w, ("FAIL " + msg if msg else "OK").encode()[:8000])
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + args.check_timeout
    status = None
    while status is None:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return False, f"forward did not finish in {args.check_timeout:.0f}s (killed)"
        else:
            time.sleep(0.01)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode(errors="replace")
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return False, f"forward CRASHED ({signal.Signals(sig).name})"
    if msg == "OK":
        return True, ""
    return False, msg.removeprefix("FAIL ") or f"check exited with status {os.waitstatus_to_exitcode(status)}"


def run_config(name: str, tmp: Path, ids: torch.Tensor, args) -> list[dict]:
    """All rows for one config: build, quantize, write in each format, load each way and check."""
    rows: list[dict] = []
    model = build_model(args, args.seed)
    t_quant = None
    if name != "float":
        t0 = time.perf_counter()
        torchq.quantize_(model, torchq.config_from_name(name))
        t_quant = time.perf_counter() - t0
    ref = forward(model, ids)
    if name == "float":
        plan = [("pt", "torch.save", tmp / f"{name}.pt", ["torch.load"]),
                ("st", "save_file", tmp / f"{name}.safetensors", ["safetensors.load_file", "load_quantized", "load_quantized(verify=False)"]),
                ("st", "save_quantized", st_target(tmp, f"{name}-tq", args), ["load_quantized", "load_quantized(verify=False)"])]
    else:
        plan = [("pt", "torch.save", tmp / f"{name}.pt", ["torch.load"]),
                ("st", "save_quantized", st_target(tmp, name, args), ["load_quantized", "load_quantized(verify=False)"])]
    for fmt, writer, path, loaders in plan:
        base = {"format": fmt, "config": name, "writer": writer}
        try:
            save_s = timed_write(writer, model, path, args)
            size = path_size(path)
        except Exception as e:  # one broken config/format must not stop the run
            rows += [{**base, "loader": ld, "error": f"save: {type(e).__name__}: {e}"} for ld in loaders]
            continue
        files = len(list(path.iterdir())) if path.is_dir() else 1
        for ld in loaders:
            row = {**base, "loader": ld, "bytes": size, "files": files, "save_s": save_s, "quantize_s": t_quant,
                   "bits_per_weight": (size - other_bytes(args)) * 8 / linear_numel(args)}
            try:
                row.update(measure_loads(ld, path, ids, ref, args))
            except Exception as e:
                row["error"] = f"load: {type(e).__name__}: {e}"
            rows.append(row)
            print(f"  {fmt:<3} {name:<10} {writer:<15} {ld:<28} {size / 1e6:9.1f} MB  save {save_s:7.3f}s  "
                  f"load {row.get('load_s', math.nan):7.3f}s  {'ok' if row.get('ok') else 'FAIL'}", flush=True)
        if path.is_dir():
            for f in path.iterdir():
                f.unlink()
            path.rmdir()
        else:
            path.unlink()
    del model, ref
    free()
    return rows


def add_ratios(rows: list[dict]) -> None:
    """size_x vs the float checkpoint of the same format (plain writer); load_x vs its plain load; load_xpt vs
    the float ``torch.load`` (an eager read of every byte, unlike ``safetensors.load_file``'s lazy memory map)."""
    pt_ref = [o for o in rows if o["format"] == "pt" and o["config"] == "float" and "load_s" in o]
    for r in rows:
        if r["format"] not in BASE_LOADER:
            continue
        ref = [o for o in rows if o["format"] == r["format"] and o["config"] == "float" and o["loader"] == BASE_LOADER[o["format"]]]
        if ref and "bytes" in r and "bytes" in ref[0]:
            r["size_x"] = r["bytes"] / ref[0]["bytes"]
        if ref and "load_s" in r and "load_s" in ref[0]:
            r["load_x"] = r["load_s"] / ref[0]["load_s"]
        if pt_ref and "load_s" in r:
            r["load_xpt"] = r["load_s"] / pt_ref[0]["load_s"]


# -- output --------------------------------------------------------------------------------------
def format_table(rows: list[dict]) -> str:
    def cell(r: dict, col: str) -> str:
        if col == "ok":
            if "error" in r:
                return "ERROR: " + r["error"][:120]
            return ("OK" if r.get("ok") else "FAIL") + (f" ({r['note']})" if "note" in r else "")
        if col == "MB":
            return f"{r['bytes'] / 1e6:.1f}" if "bytes" in r else "-"
        if col == "bits/w":
            return f"{r['bits_per_weight']:.2f}" if "bits_per_weight" in r else "-"
        v = r.get(col)
        if v is None:
            return "-"
        if col in ("save_s", "load_s"):
            return f"{v:.3f}"
        if col in ("size_x", "load_x", "load_xpt"):
            return f"{v:.3f}x"
        return str(v)

    table = [[c for c, _ in COLUMNS]] + [[cell(r, c) for c, _ in COLUMNS] for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(COLUMNS))]
    lines = []
    for j, t in enumerate(table):
        if j > 1 and rows[j - 1]["format"] != rows[j - 2]["format"]:
            lines.append("")
        lines.append("  ".join(f"{s:{a}{w}}" for s, (_, a), w in zip(t, COLUMNS, widths)).rstrip())
    return "\n".join(lines)


def header() -> str:
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"torch {torch.__version__} | torchq {torchq.__version__} | safetensors {safetensors.__version__} | "
            f"python {platform.python_version()} | {platform.machine()} | threads {torch.get_num_threads()} | "
            f"cpu capability {torch.backends.cpu.get_cpu_capability()} | load avg {load_avg:.1f} on {os.cpu_count()} cpus")


def describe_model(args) -> str:
    n_lin, n_other = linear_numel(args), other_bytes(args) // 2
    return (f"model: vocab {args.vocab}, hidden {args.hidden}, inter {args.inter}, {args.layers} layers, bf16: "
            f"{(n_lin + n_other) / 1e6:.1f}M params ({n_lin / 1e6:.1f}M in Linear weights, {n_other / 1e6:.1f}M float embedding/norms); "
            f"input [1, {args.seq}] token ids; load repeats {args.repeats}, save repeats {args.save_repeats}" + (f"; shards of at most {args.shard_size}" if args.shard_size else ""))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 2048; --quick: 256)")
    p.add_argument("--inter", type=int, default=None, help="MLP intermediate size (default 5632; --quick: 512)")
    p.add_argument("--layers", type=int, default=None, help="decoder blocks (default 2; --quick: 2)")
    p.add_argument("--vocab", type=int, default=None, help="embedding rows (default 32000; --quick: 1000)")
    p.add_argument("--seq", type=int, default=8, help="tokens in the check input (default 8)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated configs (default {DEFAULT_CONFIGS})")
    p.add_argument("--repeats", type=int, default=3, help="timed loads per cell, median reported (default 3)")
    p.add_argument("--save-repeats", type=int, default=1, help="timed saves per file, median reported (default 1)")
    p.add_argument("--shard-size", default=None, help="write save_quantized checkpoints as a sharded folder, e.g. 500MB")
    p.add_argument("--tmpdir", default=None, help="where the temporary directory goes (default: the system's)")
    p.add_argument("--no-fork", action="store_true", help="run the output check in this process (a crashing kernel ends the run)")
    p.add_argument("--check-timeout", type=float, default=300, help="seconds the forked output check may take (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--quick", action="store_true", help="tiny model (smoke test)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    a = p.parse_args(argv)
    for attr, full, quick in (("hidden", 2048, 256), ("inter", 5632, 512), ("layers", 2, 2), ("vocab", 32000, 1000)):
        if getattr(a, attr) is None:
            setattr(a, attr, quick if a.quick else full)
    a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    if "float" not in a.configs:
        a.configs.insert(0, "float")  # the reference for every ratio
    a.configs.sort(key=lambda c: c != "float")
    if a.repeats < 1 or a.save_repeats < 1:
        p.error("--repeats and --save-repeats must be at least 1")
    try:
        [torchq.config_from_name(c) for c in a.configs if c != "float"]
    except ValueError as e:
        p.error(f"--configs: {e}")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(header())
    print(describe_model(args))
    if hasattr(os, "getloadavg") and os.getloadavg()[0] > 0.75 * (os.cpu_count() or 1):
        print("note: the machine is busy; timings will be noisy (try --threads 1, or rerun when idle)")
    t0 = time.perf_counter()
    ids = torch.randint(args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(args.seed + 1))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="torchq-bench-ser-", dir=args.tmpdir) as d:
        for name in args.configs:
            try:
                rows += run_config(name, Path(d), ids, args)
            except Exception as e:  # e.g. quantize_ failed: note it and go on
                rows.append({"format": "-", "config": name, "writer": "-", "loader": "-", "error": f"{type(e).__name__}: {e}"})
                free()
    add_ratios(rows)
    order = {"pt": 0, "st": 1, "-": 2}
    rows.sort(key=lambda r: order[r["format"]])  # stable: keeps config order within a format
    print()
    print(format_table(rows))
    quant_s = {r["config"]: r["quantize_s"] for r in rows if r.get("quantize_s") is not None}
    if quant_s:
        print("quantize_ took: " + ", ".join(f"{c} {s:.2f}s" for c, s in quant_s.items()))
    print(f"MB = 10^6 bytes; size_x / load_x = this / the float bf16 checkpoint of the same format (plain writer / loader: "
          f"{BASE_LOADER['pt']} for pt, {BASE_LOADER['st']} for st); load_xpt = this / the float torch.load. "
          f"safetensors loads memory-map the file (data is paged in on first use), so the st float reference is near zero "
          f"and st load_x is large; load_xpt compares with reading every byte. Loads: median of {args.repeats}, saves: median "
          f"of {args.save_repeats}, warm page cache. Total {time.perf_counter() - t0:.1f}s.")
    if args.json:
        clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
        with open(args.json, "w") as f:
            json.dump({"header": header(), "model": describe_model(args), "rows": clean}, f, indent=1)
        print(f"wrote {len(rows)} rows to {args.json}")
    failed = [f"{r['format']} {r['config']} {r['loader']}" for r in rows if "error" not in r and not r.get("ok")]
    assert not failed, f"loaded model output differs from the original for: {', '.join(failed)}"
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
