"""One summary table of a ``gpu_suite.sh`` run: the CUDA tests' counts, the kernels' device time
against bf16 cuBLAS (``bench_gpu.py``) and the end-to-end ratios (``bench_e2e_gpu.py``).

    python benchmarks/gpu_summary.py gpu-results
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def tests_line(folder: Path) -> str:
    xml = folder / "pytest.xml"
    if not xml.exists():
        return "tests: no pytest.xml (did not finish?)"
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname', '')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    line = (f"tests: {total['tests'] - total['failures'] - total['errors'] - total['skipped']} passed, {total['failures']} failed, "
            f"{total['errors']} errors, {total['skipped']} skipped")
    return line + "".join(f"\n  FAILED {name}" for name in failed[:30])


def kernels_table(folder: Path) -> str:
    path = folder / "bench_gpu.json"
    if not path.exists():
        return "kernels: no bench_gpu.json"
    data = json.loads(path.read_text())
    rows = [r for r in data["rows"] if r.get("config") != "bf16"]
    configs = sorted({r["config"] for r in rows})
    keys = sorted({(r["shape"], r["M"]) for r in rows}, key=lambda t: (t[0], t[1]))
    cell = {(r["shape"], r["M"], r["config"]): r.get("gpu_vs_bf16") for r in rows}
    head = ["shape", "M"] + configs
    lines = [head] + [[s, str(m)] + ["-" if cell.get((s, m, c)) is None else f"{cell[(s, m, c)]:.2f}x" for c in configs]
                      for s, m in keys]
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    out = [f"kernels ({data.get('device')}): device time, bf16 cuBLAS / config (>1 = faster)"]
    out += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def e2e_table(folder: Path) -> str:
    path = folder / "e2e_gpu.json"
    if not path.exists():
        return "end to end: no e2e_gpu.json"
    data = json.loads(path.read_text())
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_e2e_gpu import format_table

    errors = [f"  {r['config']}: {r['error']}" for r in data["rows"] if "error" in r]
    return "\n".join([f"end to end ({data.get('device')}, {data.get('layers')} layers):", format_table(data["rows"]), *errors])


def tune_table(folder: Path) -> str:
    path = folder / "tune.json"
    if not path.exists():
        return "tuning: no tune.json"
    data = json.loads(path.read_text())
    sys.path.insert(0, str(Path(__file__).parent))
    from tune_gpu_kernels import best_rows

    rows = sorted(best_rows(data["rows"]), key=lambda r: (r["shape"], r["M"], r["format"], r["us"]))
    out = [f"tuning ({data.get('device')}): the fastest candidate per shape, M, kernel"]
    out += [f"  {r['shape']:>11} M={r['M']:<4} {r['format']:<9} {r['kernel']:<8} {r['params']:<30} {r['vs_bf16']:5.2f}x bf16" for r in rows]
    return "\n".join(out)


def profile_lines(folder: Path) -> str:
    path = folder / "profile.json"
    if not path.exists():
        return "host time: no profile.json"
    data = json.loads(path.read_text())
    results = data["results"]
    base = next((r["us_per_call"] for r in results if r["config"] == "bf16"), None)
    out = [f"host time per eager call ({data.get('device')}, {results[0]['shape'] if results else ''} M=1), top functions by own time:"]
    for r in results:
        extra = f" ({r['us_per_call'] - base:+.1f} us against bf16)" if base is not None and r["config"] != "bf16" else ""
        top = ", ".join(f"{f['function']} {f['self_us']:.1f}" for f in r["functions"][:3])
        out.append(f"  {r['config']:<14} {r['us_per_call']:7.1f} us{extra}: {top}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0] if argv else "gpu-results")
    print("\n\n".join([tests_line(folder), kernels_table(folder), e2e_table(folder), tune_table(folder), profile_lines(folder)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
