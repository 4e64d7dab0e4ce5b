"""The hostile files of issue 34 against torchq's import doors and against the peer path a user
would otherwise take (gguf-py's ``GGUFReader``, which transformers' GGUF loader uses; Python's ``re``
for compressed-tensors patterns), each case in a fresh child process under a 6 GiB address-space
cap and a time limit, after one valid file went through the same path (imports, allocator pools).
Columns: the file's size; for torchq and the peer, the outcome (``refused``: a named error;
``loaded``; ``finished``: the pattern's match call returned; ``MemoryError`` / ``timeout``: the cap
or the limit was hit; another name: that exception), the seconds, and the peak
resident memory the case added (VmHWM, reset before it).

    python benchmarks/bench_hostile_files.py                 # every case, 60 s limit
    python benchmarks/bench_hostile_files.py --limit 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = r"""
import json, resource, sys, time, warnings, contextlib, io, struct
sys.path.insert(0, {tests!r})
warnings.simplefilter("ignore")
import torch, torchq, gguf
from hostile_imports import write_gguf, hostile_file
def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
case, side, folder, limit = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
import signal
class Hang(Exception):
    pass
def hang(signum, frame):
    raise Hang()
path = hostile_file(case, folder)
import os
size = os.path.getsize(path) if os.path.isfile(path) else 0
valid = os.path.join(folder, side + "-valid.gguf")
write_gguf(valid)  # warm-up: imports and allocator pools a valid file costs too, so the columns are the case's own
if side == "torchq":
    from torchq.hf import from_gguf
    from_gguf(valid)
else:
    import transformers
    transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=os.path.basename(valid))
def run():
    if case == "regex (.|.)*Z":
        name = "model.layers.0.self_attn.q_proj" * 2
        if side == "torchq":
            from torchq.patterns import compile_pattern
            return compile_pattern("(.|.)*Z", where="ignore").match(name)
        import re
        return re.match("(.|.)*Z", name)
    if side == "torchq":
        from torchq.hf import from_gguf
        return from_gguf(path)
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
start = status("VmRSS"); t0 = time.perf_counter()
signal.signal(signal.SIGALRM, hang)
signal.setitimer(signal.ITIMER_REAL, limit)
try:
    with contextlib.redirect_stderr(io.StringIO()):
        run()
    outcome = "finished" if case.startswith("regex") else "loaded"
except torchq.CheckpointError:
    outcome = "refused"
except Hang:
    outcome = "timeout"
except MemoryError:
    outcome = "MemoryError"
except Exception as e:
    kind = type(e)
    outcome = kind.__name__ if kind.__module__ == "builtins" else kind.__module__ + "." + kind.__name__
print(json.dumps({{"outcome": outcome, "seconds": time.perf_counter() - t0, "peak_mb": (status("VmHWM") - start) / 2**20,
                  "size": size}}))
"""
CASES = ["u8 array of 2^60", "u8 array of 10^6", "block_count 20000", "NaN scale (Q4_0 d)", "overlapping tensor data",
         "truncated file", "regex (.|.)*Z"]


def run(case: str, side: str, limit: float, folder: str) -> dict:
    code = CHILD.format(tests=str(ROOT / "tests"))
    try:
        p = subprocess.run([sys.executable, "-c", code, case, side, folder, str(limit)], capture_output=True, text=True,
                           timeout=limit + 120, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"outcome": "timeout", "seconds": limit, "peak_mb": float("nan"), "size": 0}
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"outcome": "crashed" if p.returncode else "no result", "seconds": float("nan"), "peak_mb": float("nan"), "size": 0}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=float, default=60.0, help="seconds per case before it counts as a hang")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from: {', '.join(CASES)}")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'case':28} {'bytes':>7} | {'torchq':>9} {'s':>7} {'MB':>7} | {'peer':>20} {'s':>7} {'MB':>7}")
    with tempfile.TemporaryDirectory() as folder:
        for case in args.cases.split(","):
            if case not in CASES:
                raise SystemExit(f"--cases: unknown case {case!r}; expected some of {CASES}")
            mine, peer = run(case, "torchq", args.limit, folder), run(case, "peer", args.limit, folder)
            rows.append({"case": case, "torchq": mine, "peer": peer})
            print(f"{case:28} {mine['size']:>7} | {mine['outcome']:>9} {mine['seconds']:>7.3f} {mine['peak_mb']:>7.1f} | "
                  f"{peer['outcome']:>20} {peer['seconds']:>7.3f} {peer['peak_mb']:>7.1f}", flush=True)
    print("peer: transformers' from_pretrained(folder, gguf_file=...) (gguf-py's reader); Python's re for the pattern")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
