"""Digests of quantized-linear outputs for every config x layout x activation dtype on the CPU.

Issue 15 reshaped the kernel layer under the rule "outputs must not change by a single bit".
``record()`` computes the SHA-256 of every output (and of the quantized bytes' dequantization)
for a fixed grid of cases; ``tests/test_output_digests.py`` recomputes them and compares with
the digests stored in ``output_digests.json.gz`` for the same machine fingerprint (the native ISA,
the tile dtype, torch's CPU capability and thread count, the CPU model and the CPU flags that select
kernels inside torch's libraries: float sums are ordered differently elsewhere, so digests are only
comparable on a matching machine; digests stored before the flags were part of the fingerprint
are found under the fingerprint without them).

    python tests/golden/output_digests.py            # print the digests of this machine
    python tests/golden/output_digests.py --update   # store them under this machine's fingerprint
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import platform
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

import torchq
from torchq import native
from torchq.layouts import registered_layouts

STORE = Path(__file__).with_name("output_digests.json.gz")
SHAPES = ((48, 256), (40, 160))
M_VALUES = (1, 3, 16, 33)
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def configs() -> dict[str, torchq.QuantConfig]:
    """Every built-in config family, at the options that select different numerics."""
    Z = torchq.ZeroPointDomain
    return {
        "int4_g32": torchq.int4_weight_only(32),
        "int4_g128": torchq.int4_weight_only(128),
        "int4_g32_int_zero": torchq.int4_weight_only(32, zero_point_domain=Z.INT),
        "int4_g32_sym": torchq.int4_weight_only(32, zero_point_domain=Z.NONE),
        "int4_g32_fp32_scales": torchq.int4_weight_only(32, scale_dtype=torch.float32),
        "int8_weight_only": torchq.int8_weight_only(),
        "int8_dynamic": torchq.int8_dynamic_activation_int8_weight(),
        "intx2_g32": torchq.intx_weight_only(2, 32),
        "intx3_g32": torchq.intx_weight_only(3, 32),
        "intx5_channel": torchq.intx_weight_only(5, None),
        "intx8_g32_sym": torchq.intx_weight_only(8, 32, mapping_type=torchq.MappingType.SYMMETRIC),
        "nf4": torchq.nf4_weight_only(64, double_quant=False),
        "nf4_dq": torchq.nf4_weight_only(64),
        "fp4_dq": torchq.fp4_weight_only(32),
        "llm_int8": torchq.llm_int8(),
    }


def fingerprint() -> str:
    st = native.status()
    from torchq.prefill import FAST_BF16_MATMUL

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"torch {torch.__version__}; aten {torch.backends.cpu.get_cpu_capability()}; threads {torch.get_num_threads()}; "
            f"native {st.isa if st.available else 'off'}; bf16 tiles {FAST_BF16_MATMUL}; cpu {cpu}")


# CPU features that select kernels inside torch's own libraries (oneDNN's int8 and bf16 GEMMs, FBGEMM)
# whatever torch's capability says: two "AMD EPYC" machines with AVX2 ATen gave different int8
# dynamic / LLM.int8 outputs for bf16 weights (one without any VNNI or AVX-512)
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                "amx_bf16", "amx_int8")


def cpu_flags() -> str:
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    present = set(line.split(":", 1)[1].split())
    return " ".join(f for f in KERNEL_FLAGS if f in present)


def fingerprints() -> tuple[str, str]:
    """(this machine's fingerprint with its kernel-selecting CPU flags, the fingerprint without them,
    under which digests recorded before the flags were part of it are stored)."""
    legacy = fingerprint()
    return f"{legacy}; flags {cpu_flags()}", legacy


def record_as_recorded() -> dict[str, dict[str, str]]:
    """The digests ``--update`` stores: as tests/test_output_digests.py compares them (the native lut4
    decode / GEMM paths off; the cases of kernels that computed in bf16 before issue 15 computed with
    ``compute_dtype=torch.bfloat16``), for the native and the reference mode."""
    from torchq.backends.native_cpu.library import lut4_paths

    out = {}
    for mode in ("native", "reference"):
        kernels: dict[str, str] = {}
        with lut4_paths(decode=False, gemm=False):
            now = record(native_enabled=mode == "native", kernels=kernels)
            in_bf16 = record(native_enabled=mode == "native", compute_dtype=torch.bfloat16)
        out[mode] = {k: in_bf16[k] if computed_in_bf16_before(k, kernels.get(k, "")) else v for k, v in now.items()}
    return out


def _weight(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = torch.randn(shape, generator=g) * 0.05
    w[3, 5] = 0.9  # an outlier column for LLM.int8 / a wide group
    return w.to(dtype)


def _input(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=g)
    x[0, 5] = 8.0  # an activation outlier (LLM.int8 threshold 6)
    return x.to(dtype)


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    return hashlib.sha256(str((t.dtype, tuple(t.shape))).encode() + t.view(torch.uint8).numpy().tobytes()).hexdigest()[:8]


def _layouts() -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [("auto", None)]
    for name, cls in sorted(registered_layouts().items()):
        with contextlib.suppress(TypeError):
            out.append((name, cls()))
    return out


def cases(compute_dtype: torch.dtype | None = None, kernels: dict[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """``(case id, digest or 'rejected: reason')`` for every case, in a fixed order, with every
    config's ``compute_dtype`` set to ``compute_dtype``. ``kernels``, when given, receives the name
    of the kernel each linear case runs (``FALLBACK`` for dequantize + F.linear)."""
    for cname, base in configs().items():
        for lname, layout in _layouts():
            try:
                changes = {} if layout is None else {"layout": layout}
                if compute_dtype is not None:
                    changes["compute_dtype"] = compute_dtype
                cfg = type(base)(**{**base.__dict__, **changes}) if changes else base
            except (ValueError, TypeError) as e:
                yield f"{cname}/{lname}", f"rejected: {type(e).__name__}"
                continue
            for shape in SHAPES:
                for wdtype in ACT_DTYPES:
                    w = _weight(shape, wdtype)
                    key = f"{cname}/{lname}/{shape[0]}x{shape[1]}/w{str(wdtype)[6:]}"
                    try:
                        q = cfg.quantize_weight(w)
                    except Exception as e:  # noqa: BLE001 - the kind of rejection is part of the record
                        yield key, f"rejected: {type(e).__name__}"
                        continue
                    yield key + "/dequantize", _digest(q.dequantize())
                    for xdtype in ACT_DTYPES:
                        for m in M_VALUES:
                            x = _input(m, shape[1], xdtype)
                            bias = None if m % 2 else torch.linspace(-1, 1, shape[0]).to(xdtype)
                            if kernels is not None:
                                chosen, _ = torchq.dispatch.select_linear_kernel(x, q, bias)
                                kernels[f"{key}/x{str(xdtype)[6:]}/m{m}"] = "FALLBACK" if chosen is None else chosen.name
                            try:
                                y = torch.nn.functional.linear(x, q, bias)
                            except Exception as e:  # noqa: BLE001
                                yield f"{key}/x{str(xdtype)[6:]}/m{m}", f"raises: {type(e).__name__}"
                                continue
                            yield f"{key}/x{str(xdtype)[6:]}/m{m}", _digest(y)


def record(native_enabled: bool = True, compute_dtype: torch.dtype | None = None,
           kernels: dict[str, str] | None = None) -> dict[str, str]:
    ctx = contextlib.nullcontext() if native_enabled else native.disabled()
    with ctx, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dict(cases(compute_dtype, kernels))


# Kernels that, before issue 15, were reached for fp32/fp16 inputs only through a "*_bf16_compute"
# twin that computed in bf16: those cases now compute in the input's dtype (intended), and with
# compute_dtype=torch.bfloat16 in the config must reproduce the recorded digest.
BF16_TWINNED = ("int4_cpu", "int8_weight_only_cpu", "tensor_core_tiled")


# The kernels whose native paths sum in another order since issue 16: the lut4 kernel's decode and
# GEMM paths (int4, NF4 / FP4), and int8 weight-only's GEMM form (from 16 rows on AVX2, 64 on
# AVX-512, where tiles + torch.mm ran before). All switched off by lut4_paths(decode=False, gemm=False),
# as is the bf16 AMX GEMM of both (a GEMM form, on AMX-BF16 CPUs). The int8_vnni layout's weight-only
# calls run the same int8 kernels on unpacked panels (the same bits as plain's, checked by
# tests/test_native_int8_vnni.py), so they move with them (seen at 33 rows on a Zen 4).
REORDERED_KERNELS = ("int4_native", "blockwise_4bit_linear", "int8_weight_only_native", "int8_vnni_weight_only_native")


def computed_in_bf16_before(case: str, kernel: str) -> bool:
    return kernel in BF16_TWINNED and not case.split("/")[4] == "xbfloat16"


def load_store() -> dict:
    return json.loads(gzip.decompress(STORE.read_bytes())) if STORE.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--update", action="store_true", help="store this machine's digests under its fingerprint")
    args = p.parse_args(argv)
    fp = fingerprints()[0]
    result = record_as_recorded()
    print(fp)
    for mode, digests in result.items():
        print(f"{mode}: {len(digests)} cases, {sum(v.startswith(('rejected', 'raises')) for v in digests.values())} rejected/raising")
    if args.update:
        store = load_store()
        store[fp] = result
        STORE.write_bytes(gzip.compress(json.dumps(store, sort_keys=True).encode(), mtime=0))
        print(f"stored under {fp!r} in {STORE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
