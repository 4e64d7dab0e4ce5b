"""bitsandbytes' own op tests (its ``tests/test_ops.py``) run against ``torch.ops.torchq``.

The test file and its helpers (``tests/helpers.py``, ``tests/conftest.py``, ``tests/__init__.py``)
are copied unchanged into a temporary folder, except two edits to ``test_ops.py``: every
``torch.ops.bitsandbytes.<op>`` becomes ``torch.ops.torchq.<op>``, but ``quantize_4bit`` stays
bitsandbytes' real op (so bitsandbytes produces the packed weights and statistics the other ops
read), and ``import torchq`` is added after ``import bitsandbytes``. bitsandbytes' Python helpers
(``bitsandbytes.functional.quantize_4bit``, ``get_4bit_type``, ``create_dynamic_map``, ...) stay
bitsandbytes' own and keep calling ``torch.ops.bitsandbytes`` internally. The tests run on the CPU
(``BNB_TEST_DEVICE=cpu``) in a child pytest; the table counts outcomes per test class.

Note: ``Test4bitBlockwiseQuantOps::test_gemv_4bit`` takes another branch where
``bitsandbytes.functional.has_avx512bf16()`` is true: the weight is repacked into bitsandbytes'
CPU-only layout (``_convert_weight_packed_for_cpu``) and absmax becomes a transposed bf16
``[K / blocksize, N]`` tensor. torchq reads the standard layout, so there the test's checks
(shape, dtype, finiteness, opcheck) pass on values that do not mean that weight; the report says
which branch ran; ``--emulate-avx512bf16`` makes that branch run on any CPU.

    python benchmarks/peer_bnb_ops.py                                   # the snapshot's HEAD
    python benchmarks/peer_bnb_ops.py --source ~/src/bitsandbytes --json peer.json
    python benchmarks/peer_bnb_ops.py --emulate-avx512bf16 -- -k test_gemv_4bit
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = Path("/work/.mirror/bitsandbytes-foundation+bitsandbytes/repo")
FILES = ("tests/test_ops.py", "tests/helpers.py", "tests/conftest.py", "tests/__init__.py")
KEPT = ("quantize_4bit",)  # ops that stay bitsandbytes' own
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")

# A pytest plugin (loaded in the child with -p) that records each test's outcome as JSON lines and,
# with PEER_BNB_EMULATE_AVX512BF16=1, makes bitsandbytes.functional.has_avx512bf16() answer True for
# the tests (after bitsandbytes registered its backends with the real answer), so test_gemv_4bit
# takes its AVX512-BF16 branch (bitsandbytes' own repacking code) on any CPU.
PLUGIN = r'''
import json, os

_PATH = os.environ["PEER_BNB_RESULTS"]


def pytest_configure(config):
    if os.environ.get("PEER_BNB_EMULATE_AVX512BF16") == "1":
        import bitsandbytes.functional

        bitsandbytes.functional.has_avx512bf16 = lambda: True


def _write(row):
    with open(_PATH, "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_runtest_logreport(report):
    xfail = hasattr(report, "wasxfail")
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed") or (
            report.when == "teardown" and report.outcome == "failed"):
        if report.outcome == "passed":
            outcome = "xpassed" if xfail else "passed"
        elif report.outcome == "skipped":
            outcome = "xfailed" if xfail else "skipped"
        else:
            outcome = "failed" if report.when == "call" else "error"
        message = ""
        if outcome in ("failed", "error") and report.longrepr:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = (crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1])[:400]
        elif outcome == "skipped" and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2])[:200]
        _write({"nodeid": report.nodeid, "outcome": outcome, "message": message})
'''


def rename_namespace(text: str, kept: tuple[str, ...] = KEPT) -> tuple[str, Counter]:
    """``text`` with ``torch.ops.bitsandbytes.<op>`` renamed to ``torch.ops.torchq.<op>`` for every
    op not in ``kept``, and the number of renamed references per op."""
    renamed: Counter = Counter()

    def sub(m: re.Match) -> str:
        if m.group(1) in kept:
            return m.group(0)
        renamed[m.group(1)] += 1
        return f"torch.ops.torchq.{m.group(1)}"

    out = re.sub(r"torch\.ops\.bitsandbytes\.(\w+)", sub, text)
    out, added = re.subn(r"^import bitsandbytes$", "import bitsandbytes\nimport torchq  # noqa: F401  (registers torch.ops.torchq)",
                         out, count=1, flags=re.M)
    if not added:
        raise ValueError("test_ops.py: expected a line 'import bitsandbytes' to add 'import torchq' after")
    return out, renamed


def read_sources(source: Path, rev: str) -> tuple[dict[str, str], str]:
    """The text of each of :data:`FILES` from ``source`` (a git directory, bare or not, read at
    ``rev``; or a checkout folder holding ``tests/``), and a description of where it came from."""
    if (source / "tests" / "test_ops.py").is_file():
        return {f: (source / f).read_text() for f in FILES}, str(source)
    if not (source / "HEAD").is_file() and not (source / ".git").exists():
        raise FileNotFoundError(f"--source: expected a bitsandbytes checkout (with tests/test_ops.py) or its git directory, got {source}")
    git = ["git", "--git-dir", str(source if (source / "HEAD").is_file() else source / ".git")]
    commit = subprocess.run([*git, "rev-parse", rev], check=True, capture_output=True, text=True).stdout.strip()
    texts = {f: subprocess.run([*git, "show", f"{commit}:{f}"], check=True, capture_output=True, text=True).stdout for f in FILES}
    return texts, f"{source} @ {commit}"


def environment() -> dict:
    """Versions, and which branch bitsandbytes' test_gemv_4bit takes on this machine."""
    import torch

    info: dict = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnbf

        info["bitsandbytes"] = bitsandbytes.__version__
        info["bnb_has_avx512bf16"] = bool(bnbf.has_avx512bf16())
    except Exception as e:  # not installed or broken: the child run reports the same
        info["bitsandbytes"] = f"not importable ({type(e).__name__}: {e})"
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
        info["cpu_avx512_bf16"] = "avx512_bf16" in flags
    except (OSError, StopIteration):
        pass
    return info


def run(source: Path, rev: str, pytest_args: list[str], timeout: float, emulate_avx512bf16: bool = False) -> dict:
    texts, origin = read_sources(source, rev)
    with tempfile.TemporaryDirectory(prefix="peer-bnb-ops-") as tmp:
        folder = Path(tmp)
        for name, text in texts.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
        renamed_text, renamed = rename_namespace(texts["tests/test_ops.py"])
        (folder / "tests/test_ops.py").write_text(renamed_text)
        (folder / "_peer_bnb_plugin.py").write_text(PLUGIN)
        results = folder / "results.jsonl"
        env = dict(os.environ, BNB_TEST_DEVICE="cpu", PEER_BNB_RESULTS=str(results),
                   PEER_BNB_EMULATE_AVX512BF16="1" if emulate_avx512bf16 else "0",
                   PYTHONPATH=os.pathsep.join(p for p in (str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        cmd = [sys.executable, "-m", "pytest", "tests/test_ops.py", "-p", "_peer_bnb_plugin", "-p", "no:cacheprovider", "-q",
               "-o", "addopts=", "--rootdir", str(folder), *pytest_args]
        proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
        rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    if not rows:
        raise RuntimeError(f"the child pytest reported no tests (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"source": origin, "renamed": dict(renamed), "kept": list(KEPT), "environment": environment(),
            "emulate_avx512bf16": emulate_avx512bf16,
            "exit_code": proc.returncode, "tests": rows, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Outcome counts per test class (``Class::test`` from each node id), plus ``runnable``
    (passed + failed + error) and a ``total`` row."""
    table: dict[str, Counter] = {}
    for row in rows:
        parts = row["nodeid"].split("::")
        group = parts[1] if len(parts) > 2 else parts[0]
        table.setdefault(group, Counter())[row["outcome"]] += 1
    table["total"] = sum(table.values(), Counter())
    return {g: {**{o: c[o] for o in OUTCOMES}, "runnable": c["passed"] + c["failed"] + c["error"]} for g, c in table.items()}


def format_table(summary: dict[str, dict[str, int]]) -> str:
    cols = ("runnable", *OUTCOMES)
    width = max(len(g) for g in summary)
    lines = [f"{'class':<{width}}  " + "  ".join(f"{c:>8}" for c in cols)]
    for group, counts in summary.items():
        lines.append(f"{group:<{width}}  " + "  ".join(f"{counts[c]:>8}" for c in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE,
                   help="bitsandbytes checkout folder, or its git directory (read at --rev)")
    p.add_argument("--rev", default="HEAD", help="commit to read when --source is a git directory")
    p.add_argument("--json", type=Path, help="write every test's outcome and the summary here")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the whole child pytest run")
    p.add_argument("--emulate-avx512bf16", action="store_true",
                   help="make bitsandbytes.functional.has_avx512bf16() true for the tests (test_gemv_4bit's AVX512-BF16 branch)")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --), e.g. -k gemv")
    args = p.parse_args(argv)
    result = run(args.source, args.rev, args.pytest_args, args.timeout, args.emulate_avx512bf16)
    env = result["environment"]
    print(f"bitsandbytes tests: {result['source']}")
    print(f"bitsandbytes {env.get('bitsandbytes')}, torch {env['torch']}; renamed to torch.ops.torchq: "
          f"{', '.join(sorted(result['renamed']))}; kept bitsandbytes': {', '.join(result['kept'])}")
    if env.get("bnb_has_avx512bf16") or args.emulate_avx512bf16:
        why = "emulated (--emulate-avx512bf16)" if args.emulate_avx512bf16 else "true on this machine"
        print(f"note: bitsandbytes.functional.has_avx512bf16() {why}: test_gemv_4bit passes bitsandbytes' CPU-repacked "
              "weight and a bf16 [K/blocksize, N] absmax, which torchq reads as the standard layout (its checks pass; the "
              "values are not that weight's product)")
    else:
        print("bitsandbytes.functional.has_avx512bf16() is false here: test_gemv_4bit passes the standard layout and fp32 absmax")
    print(format_table(result["summary"]))
    for row in result["tests"]:
        if row["outcome"] in ("failed", "error", "xpassed"):
            print(f"{row['outcome'].upper()} {row['nodeid']}: {row['message']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    total = result["summary"]["total"]
    return 0 if total["failed"] == total["error"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
