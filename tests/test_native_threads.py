"""The native thread pool (csrc/threadpool.cpp, ``tq::parallel_for``) under concurrency.

* stress: several Python threads call int4 / NF4 / int8 weight-only / int8 dynamic layers (int8 also in the int8_vnni layout) of
  alternating shapes (N = 8 and 64, M = 1 and 3; every call split, TORCHQ_NATIVE_MIN_PARALLEL_WORK=0)
  while the torch thread count cycles through
  1, 2, 3, 4, 8 (more threads than cores: contention is the point); every output must equal the
  single-threaded one bit for bit. It runs in a child process under a time limit, so a hang (the
  caller spinning on a work counter that never reaches zero) fails instead of blocking CI;
* the least work per thread: a call kept on one thread and the same call split agree bit for bit;
* the pool alone: a small C++ driver (tests/native/tsan_driver.cpp) hammers ``parallel_for``
  from several threads with varying sizes, part counts and spins, built with -O2 (every element
  visited once, no hang) and with ``-fsanitize=thread`` (TSan must report nothing; an
  instrumented library cannot be loaded into Python, hence the driver);
* the fused AdamW step of torchq.optim the same way (tests/native/tsan_adamw_driver.cpp): concurrent
  callers, every call split, equal to one thread bit for bit, and TSan-clean;
* benchmarks/bench_threads.py runs (``--quick``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_native_blockwise import needs_native

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "native" / "tsan_driver.cpp"
REQUIRE_NATIVE = os.environ.get("TORCHQ_REQUIRE_NATIVE", "").strip().lower() in ("1", "true", "yes", "on")

# The child: builds the layers, takes single-threaded references, then per phase lets that many
# Python threads call them concurrently under changing torch thread counts for that many seconds;
# exit 0 with the calls per thread and phase (JSON), 1 with the first mismatch, 2 if a native
# kernel did not run.
STRESS_CHILD = textwrap.dedent(
    r"""
    import json, sys, threading, time
    import torch
    import torch.nn.functional as F
    import torchq
    from torchq import native
    from torchq.backends.native_cpu import library as native_library
    from torchq.layouts.int8_vnni import Int8VnniLayout

    phases = [tuple(map(float, p.split(":"))) for p in sys.argv[1].split(",")]  # "threads:seconds,..."
    counts = [1, 2, 3, 4, 8]
    configs = {
        "int4": torchq.int4_weight_only(group_size=32),
        "nf4": torchq.nf4_weight_only(block_size=32),
        "int8_wo": torchq.int8_weight_only(),
        "int8_dyn": torchq.int8_dynamic_activation_int8_weight(),
        "int8_vnni_wo": torchq.int8_weight_only(layout=Int8VnniLayout()),
        "int8_vnni_dyn": torchq.int8_dynamic_activation_int8_weight(layout=Int8VnniLayout()),
    }
    calls = {}
    real_run_linear = native_library.run_linear
    def counting(weight, *args, **kwargs):
        calls[weight.op] = calls.get(weight.op, 0) + 1
        return real_run_linear(weight, *args, **kwargs)
    native_library.run_linear = counting

    gen = torch.Generator().manual_seed(0)
    cases = []  # (name, weight, bias, x): N = 8 and 64 alternate, M = 1 and 3
    for name, config in configs.items():
        for n in (8, 64):
            lin = torch.nn.Linear(128, n, bias=True)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(n, 128, generator=gen))
                lin.bias.copy_(torch.randn(n, generator=gen))
            model = torch.nn.Sequential(lin)
            torchq.quantize_(model, config)
            for m in (1, 3):
                cases.append((f"{name} N={n} M={m}", model[0].weight, model[0].bias, torch.randn(m, 128, generator=gen)))
    torch.set_num_threads(1)
    with torch.no_grad():
        expected = [F.linear(x, w, b) for _, w, b, x in cases]
    missing = sorted({"int4_groupwise_linear", "blockwise_4bit_linear", "int8_weight_linear", "int8_dynamic_linear",
                      "int8_panel_weight_linear"} - set(calls))
    if missing:
        print(f"the native kernels were not called: {missing}", flush=True)
        sys.exit(2)

    failures, summary = [], []

    def work(t, stop, done):
        i = t
        with torch.no_grad():
            while time.monotonic() < stop and not failures:
                torch.set_num_threads(counts[(i + t) % len(counts)])  # process-wide; 5 and 24 cases: coprime
                name, w, b, x = cases[i % len(cases)]
                y = F.linear(x, w, b)
                if not torch.equal(y, expected[i % len(cases)]):
                    failures.append(f"{name} at {torch.get_num_threads()} torch threads, {len(done)} Python threads: "
                                    f"max |diff| {(y - expected[i % len(cases)]).abs().max().item()}")
                done[t] += 1
                i += 1

    for py_threads, seconds in phases:
        done, stop = [0] * int(py_threads), time.monotonic() + seconds
        threads = [threading.Thread(target=work, args=(t, stop, done), daemon=True) for t in range(int(py_threads))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            print("mismatch: " + "; ".join(failures[:3]), flush=True)
            sys.exit(1)
        summary.append(done)
    print(json.dumps(summary), flush=True)
    """
)


def run_stress(phases: str, limit: float, pool: str = "") -> list[list[int]]:
    """Runs the child with `phases` ("python_threads:seconds,..."); its calls per Python thread.
    ``pool``: TORCHQ_NATIVE_POOL for the child ("own": torchq's pool; "": the default)."""
    try:
        # every call split over the torch threads: the default least work per thread would keep these small layers on one
        env = dict(os.environ, TORCHQ_NATIVE_MIN_PARALLEL_WORK="0", TORCHQ_NATIVE_POOL=pool)
        proc = subprocess.run([sys.executable, "-c", STRESS_CHILD, phases], cwd=ROOT, capture_output=True, text=True,
                              timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"native linears called from Python threads ({phases}) hung: no result after {limit:.0f} s")
    assert proc.returncode == 0, f"stress {phases}: exit code {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_native
@pytest.mark.parametrize("pool", ["", "own"])
def test_concurrent_calls_equal_single_threaded(pool: str) -> None:
    """One Python thread alternating shapes, then 4 at once, under 1..8 torch threads: bit-equal
    to one thread, no hang, no crash; with the default pool (OpenMP where built with it: torch's
    own threads) and with torchq's own pool."""
    summary = run_stress("1:1.5,4:1.5", limit=90.0, pool=pool)
    assert all(sum(done) > 20 for done in summary), summary


@needs_native
def test_thread_pool_is_read_set_and_checked() -> None:
    import torch

    import torchq
    from torchq.backends.native_cpu import library as native_library

    before = native_library.thread_pool()
    assert before in native_library.THREAD_POOLS
    with pytest.raises(ValueError, match="kind: expected one of"):
        native_library.thread_pool("tbb")
    lin = torch.nn.Linear(256, 96)
    torchq.quantize_(lin, torchq.int4_weight_only(group_size=32))
    x = torch.randn(80, 256)
    outs = {}
    try:
        for kind in native_library.THREAD_POOLS:
            try:
                native_library.thread_pool(kind)
            except RuntimeError as e:  # a build without OpenMP
                assert "without OpenMP" in str(e) and kind == "openmp"
                continue
            assert native_library.thread_pool() == kind
            with torch.no_grad():
                outs[kind] = lin(x)
    finally:
        native_library.thread_pool(before)
    assert all(torch.equal(o, outs["own"]) for o in outs.values())


@needs_native
def test_openmp_pool_shares_the_openmp_runtime_torch_loaded() -> None:
    """Built with OpenMP, the library binds to the libgomp PyTorch loaded (one runtime in the
    process, so the native ranges run on torch's own intra-op threads)."""
    import ast

    code = textwrap.dedent(
        """
        import torch, torchq
        from torchq.backends.native_cpu import library as L
        lin = torch.nn.Linear(256, 96)
        torchq.quantize_(lin, torchq.int4_weight_only(group_size=32))
        with torch.no_grad():
            lin(torch.randn(80, 256))
        print(L.thread_pool())
        print(sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TORCHQ_NATIVE_POOL=""))
    assert proc.returncode == 0, proc.stderr[-2000:]
    pool, runtimes = proc.stdout.strip().splitlines()[-2:]
    if pool != "openmp":
        pytest.skip(f"the library was built without OpenMP (pool {pool})")
    runtimes = ast.literal_eval(runtimes)
    assert len(runtimes) == 1, f"more than one OpenMP runtime loaded: {runtimes}"


@needs_native
def test_min_parallel_work_is_read_set_and_checked() -> None:
    from torchq.backends.native_cpu import library as native_library

    default = native_library.min_parallel_work()
    assert default == int(os.environ.get("TORCHQ_NATIVE_MIN_PARALLEL_WORK", 1 << 16))
    try:
        assert native_library.min_parallel_work(123) == default and native_library.min_parallel_work() == 123
    finally:
        native_library.min_parallel_work(default)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="work: expected a non-negative int"):
            native_library.min_parallel_work(bad)


@needs_native
@pytest.mark.parametrize("config", ["int4", "nf4", "int8_wo", "int8_dyn"])
def test_one_thread_below_the_work_threshold_and_split_calls_agree(config: str) -> None:
    """The same call split over 2 threads (least work 0), kept on the caller's thread (least work
    above the call's), and at the default: bit-equal, for decode (M = 1) and small-batch shapes."""
    import torch
    import torch.nn.functional as F

    import torchq
    from torchq.backends.native_cpu import library as native_library

    configs = {"int4": torchq.int4_weight_only(group_size=64), "nf4": torchq.nf4_weight_only(block_size=64),
               "int8_wo": torchq.int8_weight_only(), "int8_dyn": torchq.int8_dynamic_activation_int8_weight()}
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(576, 200)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 576, generator=gen))
    model = torch.nn.Sequential(lin)
    torchq.quantize_(model, configs[config])
    default, torch_threads = native_library.min_parallel_work(), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for m in (1, 3):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, 576, generator=gen).to(dtype)
                outs = []
                for least in (0, 1 << 40, default):
                    native_library.min_parallel_work(least)
                    with torch.no_grad():
                        outs.append(F.linear(x, model[0].weight, model[0].bias.to(dtype)))
                assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (config, m, dtype)
    finally:
        native_library.min_parallel_work(default)
        torch.set_num_threads(torch_threads)


# -- the pool alone, from C++ ---------------------------------------------------------------------

def build_driver(tmp_path: Path, flags: list[str], driver: Path = DRIVER, sources: tuple[str, ...] = ("threadpool.cpp",)) -> Path:
    """Compiles ``sources`` (of csrc/) with the driver; skips (fails under TORCHQ_REQUIRE_NATIVE=1)
    without g++ or, for -fsanitize=thread, without libtsan."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        message = f"no C++ compiler {cxx!r} on PATH (set CXX)"
        pytest.fail(message + " while TORCHQ_REQUIRE_NATIVE=1") if REQUIRE_NATIVE else pytest.skip(message)
    exe = tmp_path / driver.stem
    cmd = [cxx, "-std=c++17", *flags, "-pthread", f"-I{ROOT / 'csrc'}", *(str(ROOT / "csrc" / s) for s in sources), str(driver),
           "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        if "-fsanitize=thread" in flags and "tsan" in proc.stderr:
            message = f"{cxx} cannot link ThreadSanitizer (libtsan missing?): {proc.stderr.strip()[-300:]}"
            pytest.fail(message + " while TORCHQ_REQUIRE_NATIVE=1") if REQUIRE_NATIVE else pytest.skip(message)
        pytest.fail(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return exe


def run_driver(exe: Path, args: list[str], limit: float, env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{exe.name} {' '.join(args)}: parallel_for hung (no result after {limit:.0f} s)")


def worker_ranges(stdout: str) -> int:
    match = re.search(r"(\d+) ranges run by pool workers", stdout)
    return int(match.group(1)) if match else 0


def test_pool_stress_driver(tmp_path: Path) -> None:
    """4 threads x 20000 parallel_for calls of varying sizes, part counts (1..8) and spins
    (-O2): every element visited exactly once, no hang."""
    exe = build_driver(tmp_path, ["-O2"])
    proc = run_driver(exe, ["4", "20000"], limit=30.0)
    assert proc.returncode == 0 and "ok:" in proc.stdout, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert worker_ranges(proc.stdout) > 0, proc.stdout  # the workers ran ranges, not only the callers


def run_under_tsan(exe: Path, args: list[str], limit: float = 60.0) -> subprocess.CompletedProcess:
    """Runs a -fsanitize=thread driver; asserts ThreadSanitizer reported nothing and it exited 0."""
    env = dict(os.environ, TSAN_OPTIONS="exitcode=66 second_deadlock_stack=1")
    proc = run_driver(exe, args, limit=limit, env=env)
    if "unexpected memory mapping" in proc.stderr and shutil.which("setarch"):  # kernels with high mmap ASLR entropy
        proc = run_driver(Path(shutil.which("setarch")), [os.uname().machine, "-R", str(exe), *args], limit=limit, env=env)
    if "unexpected memory mapping" in proc.stderr:
        pytest.skip(f"ThreadSanitizer cannot run on this kernel: {proc.stderr.strip()[:300]}")
    assert "WARNING: ThreadSanitizer" not in proc.stderr and proc.returncode == 0, (
        f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}")
    return proc


def test_pool_thread_sanitizer(tmp_path: Path) -> None:
    """The same driver built with -fsanitize=thread: ThreadSanitizer reports no data race."""
    exe = build_driver(tmp_path, ["-fsanitize=thread", "-O1", "-g"])
    proc = run_under_tsan(exe, ["4", "2000"])
    assert "ok:" in proc.stdout and worker_ranges(proc.stdout) > 0, proc.stdout


# -- the fused quantized-state AdamW step (csrc/optim_adamw.cpp), from C++ ------------------------

ADAMW_DRIVER = ROOT / "tests" / "native" / "tsan_adamw_driver.cpp"
ADAMW_SOURCES = ("threadpool.cpp", "optim_adamw.cpp")


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_adamw_step_concurrent_callers_equal_one_thread(tmp_path: Path, isa: str) -> None:
    """tests/native/tsan_adamw_driver.cpp at -O2: 4 threads step their own 8- and 4-bit states
    (fp32 and bf16 parameters, a distinct map each), every call split into 2..8 parts; the results
    equal one thread's bit for bit (the AVX2 path where the CPU has AVX2, and the scalar path)."""
    exe = build_driver(tmp_path, ["-O2"], ADAMW_DRIVER, ADAMW_SOURCES)
    proc = run_driver(exe, ["4", "5", isa], limit=60.0)
    assert proc.returncode == 0 and "ok:" in proc.stdout, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_adamw_step_thread_sanitizer(tmp_path: Path, isa: str) -> None:
    """The AdamW driver built with -fsanitize=thread: no data race in the split update or in the
    lazily built, shared bin tables (removing table_for's lock makes this test report one)."""
    exe = build_driver(tmp_path, ["-fsanitize=thread", "-O1", "-g"], ADAMW_DRIVER, ADAMW_SOURCES)
    proc = run_under_tsan(exe, ["4", "3", isa])
    assert "ok:" in proc.stdout, proc.stdout


# -- benchmarks/bench_threads.py ------------------------------------------------------------------

@pytest.mark.slow
@needs_native
def test_bench_threads_quick_runs_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_threads", ROOT / "benchmarks" / "bench_threads.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "out.json"
    assert mod.main(["--quick", "--modes", "pool,native1", "--json", str(path)]) == 0
    rows = {r["mode"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"pool", "native1"}
    assert rows["native1"]["native_threads"] == 1 and rows["pool"]["native_threads"] == rows["pool"]["torch_threads"] == 2
    assert all(r["median"] > 0 and r["native_calls_per_token"] == 14 for r in rows.values())  # 2 layers x 7 linears
    out = capsys.readouterr().out
    assert "tok/s" in out and "native1" in out
