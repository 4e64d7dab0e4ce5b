"""Quantized-linear outputs are bit-identical to the digests recorded before issue 15's kernel
reshaping, on a machine whose fingerprint was recorded (see tests/golden/output_digests.py).

Intended changes:

* issue 15: fp32/fp16 inputs of kernels that used to be reached through a ``*_bf16_compute`` twin
  now compute in their own dtype; with ``compute_dtype=torch.bfloat16`` in the config those cases
  reproduce the recorded digests bit for bit;
* issue 16: calls of the native lut4 kernel (int4, NF4 / FP4) take its decode (AVX2, M <= 4;
  issue 40: on AVX512_BF16, the bf16 dot path of int4 with bf16 scales, 1-16 bf16 rows, under the
  same switch) and GEMM (M >= 64; and the native rows up to 64 rows instead of tiles + torch.mm) paths, and
  int8 weight-only its GEMM form (instead of tiles + torch.mm), which sum in another order (their
  bound and one-hot exactness are tested in test_native_int.py / test_native_blockwise.py); with
  those paths off every case reproduces the recorded digests, and with them on only those
  kernels' cases change. (int8 dynamic's GEMM forms are bit-equal: its cases never change.)
  Issue 40 also: on AMX-BF16 CPUs the bf16 AMX GEMM of the lut4 and int8 weight-only kernels
  (5-64 bf16 rows; a GEMM form, off with the others), and the ops' eager entries taking the dot
  path's rows as the layouts' do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import output_digests  # noqa: E402

from torchq import native  # noqa: E402
from torchq.backends.native_cpu.library import lut4_paths  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stored():
    store = output_digests.load_store()
    fp, legacy = output_digests.fingerprints()
    if fp not in store and legacy not in store:
        pytest.skip(f"no digests recorded for this machine ({fp}); recorded: {sorted(store)}")
    return store[fp] if fp in store else store[legacy]


def _rejected_earlier(before: dict[str, str], now: dict[str, str]) -> dict[str, str]:
    """``before`` with the cases of a config + layout that is now rejected when the config is
    built (``Layout.fit`` with unknown shape) in place of the per-weight cases that were all
    rejected with the same error when quantizing (an earlier rejection, not a changed output)."""
    out = dict(before)
    for key in set(now) - set(before):
        prefix = key + "/"
        below = [k for k in before if k.startswith(prefix)]
        if below and all(before[k] == now[key] for k in below):
            for k in below:
                del out[k]
            out[key] = now[key]
    return out


@pytest.mark.parametrize("mode", ["native", "reference"])
def test_outputs_match_recorded_digests(stored, mode):
    kernels: dict[str, str] = {}
    with lut4_paths(decode=False, gemm=False):
        now = output_digests.record(native_enabled=mode == "native", kernels=kernels)
    before = _rejected_earlier(stored[mode], now)
    assert not set(before) - set(now), f"recorded cases are gone, e.g. {sorted(set(before) - set(now))[:8]}"
    # cases may only be added by a config or layout the recorded grid did not have (a new layout's
    # rejections of every config, say); every recorded case keeps its digest below
    grid = {tuple(k.split("/")[:2]) for k in before}
    recorded_configs, recorded_layouts = {c for c, _ in grid}, {lay for _, lay in grid}
    added = [k for k in set(now) - set(before) if k.split("/")[0] in recorded_configs and k.split("/")[1] in recorded_layouts]
    assert not added, f"the case grid changed: {sorted(added)[:8]}"
    now = {k: v for k, v in now.items() if k in before}
    was_bf16 = {k for k, kernel in kernels.items() if k in before and output_digests.computed_in_bf16_before(k, kernel)}
    changed = {k: (before[k], now[k]) for k in before if before[k] != now[k] and k not in was_bf16}
    assert not changed, f"{len(changed)} of {len(before)} outputs changed, e.g. {dict(list(changed.items())[:8])}"
    with lut4_paths(decode=False, gemm=False):
        in_bf16 = output_digests.record(native_enabled=mode == "native", compute_dtype=torch.bfloat16)
    differs = {k: (before[k], in_bf16[k]) for k in sorted(was_bf16) if before[k] != in_bf16[k]}
    assert not differs, f"{len(differs)} of {len(was_bf16)} cases that computed in bf16 before differ with " \
        f"compute_dtype=torch.bfloat16, e.g. {dict(list(differs.items())[:8])}"


def test_decode_and_gemm_paths_change_only_their_cases(stored):
    kernels: dict[str, str] = {}
    with lut4_paths(decode=False, gemm=False):
        table_path = output_digests.record(native_enabled=True)
    decode = output_digests.record(native_enabled=True, kernels=kernels)
    changed = {k for k in decode if decode[k] != table_path[k]}
    outside = sorted(k for k in changed if kernels.get(k) not in output_digests.REORDERED_KERNELS)
    assert not outside, f"{len(outside)} cases outside the reordering kernels' calls changed, e.g. {outside[:8]}"
    # the decode and GEMM paths exist on the vector ISAs
    assert bool(changed) == (native.available() and native.status().isa != "scalar"), f"{len(changed)} cases changed"
