"""Benchmarks under an ISA cap (shared by ``bench_cpu_kernels.py`` and ``bench_e2e.py``).

Users run AVX2-only CPUs; a benchmark machine often has AVX-512 (and AMX, VNNI, AVX512_BF16). A
run capped at AVX2 needs torchq's native kernels capped (``TORCHQ_NATIVE_ISA``, and its AVX-512
only fast paths off: ``TORCHQ_FAST_BF16_MATMUL=0``, ``TORCHQ_NATIVE_VNNI=0``, ``TORCHQ_NATIVE_AVX512BF16=0``) *and* PyTorch's own
kernels (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``, and
``FBGEMM_ENABLE_INSTRUCTIONS`` for the quantized ops: FBGEMM detects the CPU on its own and, left
uncapped, runs its AVX-512 VNNI kernels under every other cap), which PyTorch reads when it is
imported. So a capped run is the same script again, in a subprocess with
the caps in its environment; its output streams through and its JSON comes back to the caller.

``--isa native`` runs in the calling process, as it is (with whatever caps its environment has).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import torchq

ISA_CHOICES = ("native", "avx2", "avx512", "scalar")
CAPS: dict[str, dict[str, str]] = {
    "avx2": {"TORCHQ_NATIVE_ISA": "avx2", "TORCHQ_FAST_BF16_MATMUL": "0", "TORCHQ_NATIVE_VNNI": "0",
             "TORCHQ_NATIVE_AVX512BF16": "0", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"},
    # AVX-512 without capping oneDNN / MKL: they keep the machine's extensions (VNNI, AMX) above AVX-512
    "avx512": {"TORCHQ_NATIVE_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx512"},
    "scalar": {"TORCHQ_NATIVE_ISA": "scalar", "TORCHQ_FAST_BF16_MATMUL": "0", "TORCHQ_NATIVE_VNNI": "0",
               "TORCHQ_NATIVE_AVX512BF16": "0", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
               "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"},  # FBGEMM's lowest
}
MARKER = "TORCHQ_BENCH_ISA"  # set in a capped child: the cap it runs under (so it does not re-launch itself)
CAP_VARIABLES = sorted({k for caps in CAPS.values() for k in caps})


def machine_isa() -> str:
    """The widest ISA the CPU has, as torchq's native library names it (``avx512``, ``avx2``,
    ``scalar``); from PyTorch's CPU capability when the library is not loaded."""
    status = torchq.native.status()
    if status.supported_isa:
        return status.supported_isa
    cap = torch.backends.cpu.get_cpu_capability().lower()
    return "avx512" if cap.startswith("avx512") else ("avx2" if cap == "avx2" else "scalar")


def default_isas() -> list[str]:
    """``native``, and ``avx2`` too when the machine has more than AVX2 (so such a machine also
    reports what an AVX2-only CPU gets)."""
    return ["native", "avx2"] if machine_isa() == "avx512" else ["native"]


def runs_here(isa: str) -> bool:
    """Whether this process runs ``isa`` itself: ``native``, or the cap it was launched under."""
    if isa not in ISA_CHOICES:
        raise ValueError(f"isa: expected one of {ISA_CHOICES}, got {isa!r}")
    return isa == "native" or os.environ.get(MARKER) == isa


def runs_capped() -> bool:
    """Whether this process is a capped child of :func:`run_capped`."""
    return bool(os.environ.get(MARKER))


def isa_info(requested: str) -> dict:
    """What this process runs under: torchq's native ISA, PyTorch's CPU capability and the cap
    variables set in its environment."""
    status = torchq.native.status()
    return {"isa": requested, "native_isa": status.isa if status.available else "off",
            "native_supported_isa": status.supported_isa, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "caps": {k: os.environ[k] for k in CAP_VARIABLES if k in os.environ}}


def isa_label(info: dict) -> str:
    """One line naming the ISA a table ran under."""
    supported = f" of {info['native_supported_isa']}" if info["native_supported_isa"] else ""
    return (f"ISA {info['isa']}: torchq native {info['native_isa']}{supported}, "
            f"torch CPU capability {info['torch_cpu_capability']}")


def without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` less the options ``names`` (each with its value, as ``--x v`` or ``--x=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not any(a.startswith(n + "=") for n in names):
            out.append(a)
    return out


def run_capped(script: str | Path, argv: list[str], isa: str) -> dict:
    """Run ``script`` with ``argv`` (less its ``--isa``/``--json``) under the ``isa`` caps in a
    subprocess, its stdout printed here as it comes; returns the JSON it wrote."""
    if isa not in CAPS:
        raise ValueError(f"isa: expected one of {sorted(CAPS)} for a capped run, got {isa!r}")
    env = dict(os.environ) | CAPS[isa] | {MARKER: isa}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "capped.json"
        cmd = [sys.executable, str(script), *without_options(argv, ("--isa", "--json")), "--isa", isa, "--json", str(path)]
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the run under --isa {isa} failed (exit code {proc.returncode}): {' '.join(cmd)}")
        return json.loads(path.read_text())
