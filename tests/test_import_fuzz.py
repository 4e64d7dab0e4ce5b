"""Fuzz suites for the import doors, each in a child process under a memory cap (the cases and their
assertions are in tests/hostile_imports.py): every mutated file ends in a CheckpointError naming it
or in a correct load, within a bounded peak memory and no hang; a model passed in is unchanged on error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("hostile_imports.py")


@pytest.mark.slow
@pytest.mark.parametrize("door, examples, needs", [
    ("gguf", 300, ("gguf", "transformers")),
    ("compressed-tensors", 300, ("compressed_tensors",)),
    ("torchq", 200, ("transformers",)),
])
def test_fuzz(door, examples, needs):
    for module in needs:
        pytest.importorskip(module)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(WORKER), door, str(examples)], capture_output=True, text=True, timeout=1200,
                         env=env, cwd=WORKER.parent.parent)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-12000:]
    summary = next(line for line in run.stdout.splitlines() if line.startswith(f"FUZZ {door}:"))
    print(summary)
    cases, loaded, refused = (int(x) for x in re.findall(r"(\d+) (?:cases|loaded|refused)", summary))
    assert cases >= examples // 2 and loaded >= 1 and refused >= cases // 2  # both outcomes exercised, most files refused
