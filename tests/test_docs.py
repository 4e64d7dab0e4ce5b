"""Every fenced Python block of README.md and docs/*.md runs: the blocks of one page in order, in
one namespace, in a scratch folder (the README's later examples use its first one's ``model``).
A page's block that needs CUDA (vLLM) says so in a ``# needs: cuda`` (``# needs: vllm``) comment
and is skipped without it."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

pytestmark = pytest.mark.slow


def python_blocks(page: pathlib.Path) -> list[str]:
    return FENCE.findall(page.read_text())


def test_the_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_block_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(python_blocks(page)):
        if "# needs: cuda" in block and not torch.cuda.is_available():
            continue
        if "# needs: vllm" in block and importlib.util.find_spec("vllm") is None:
            continue  # runs in vLLM's environment (.ci/vllm_env)
        code = compile(block, f"{page.name}, python block {i + 1}", "exec")
        exec(code, namespace)  # noqa: S102  (the repository's own documentation)
