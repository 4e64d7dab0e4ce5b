"""Quantized-linear outputs are bit-identical to the digests recorded before issue 15's kernel
reshaping, on a machine whose fingerprint was recorded (see tests/golden/output_digests.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import output_digests  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stored():
    store = output_digests.load_store()
    fp = output_digests.fingerprint()
    if fp not in store:
        pytest.skip(f"no digests recorded for this machine ({fp}); recorded: {sorted(store)}")
    return store[fp]


@pytest.mark.parametrize("mode", ["native", "reference"])
def test_outputs_match_recorded_digests(stored, mode):
    now = output_digests.record(native_enabled=mode == "native")
    before = stored[mode]
    assert sorted(now) == sorted(before), "the case grid changed"
    changed = {k: (before[k], now[k]) for k in before if before[k] != now[k]}
    assert not changed, f"{len(changed)} of {len(before)} outputs changed, e.g. {dict(list(changed.items())[:8])}"
