"""Every python code block in README.md and docs/**/*.md runs, so the docs cannot rot.

A block runs on its own (its own namespace, in a scratch directory). A block whose first line is
``# doc-test: processes=N ...`` runs on N gloo processes (it must not assume a process group
exists: it calls ``init_process_group`` only when none is initialised, as under torchrun). A block
that uses ``nopad.integrations.verl`` needs verl: it is skipped where verl is absent and runs in
CI's verl leg.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PROCESSES = re.compile(r"#\s*doc-test:\s*processes=(\d+)")
NEEDS_VERL = re.compile(r"nopad\.integrations(\.verl| import verl)")
HAS_VERL = importlib.util.find_spec("verl") is not None


def _blocks():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 2
            name = f"{path.relative_to(ROOT)}:{line}"
            code = match.group(1)
            processes = PROCESSES.match(code)
            marks = [pytest.mark.slow] if processes else []
            if NEEDS_VERL.search(code):
                marks.append(pytest.mark.skipif(not HAS_VERL, reason="needs verl (CI's verl leg runs it)"))
            yield pytest.param(name, code, int(processes.group(1)) if processes else 1, id=name, marks=marks)


def _exec_block(rank: int, world_size: int, name: str, code: str, cwd: str) -> bool:
    import os

    os.chdir(cwd)
    exec(compile(code, name, "exec"), {"__name__": "__doc_block__"})
    return True


BLOCKS = list(_blocks())


def test_the_docs_have_code_blocks():
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize(("name", "code", "processes"), BLOCKS)
def test_code_block_runs(name, code, processes, tmp_path, monkeypatch):
    if processes > 1:
        assert run_distributed(_exec_block, processes, name, code, str(tmp_path)) == [True] * processes
        return
    monkeypatch.chdir(tmp_path)
    exec(compile(code, name, "exec"), {"__name__": "__doc_block__"})
