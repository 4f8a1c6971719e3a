"""``nopad bench --head`` measures the response fractions and the vocabulary-parallel head, and says
on stderr what it is measuring while it runs (a line per configuration, off a terminal too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_head_prints_a_line_per_configuration_and_its_table():
    command = [sys.executable, "-m", "nopad", "bench", "--head", "--head-tokens", "256"]
    command += ["--head-hidden", "16", "--head-vocab", "1024", "--head-contenders", "chunked", "resp25", "tp2"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("nopad bench --head [")]
    assert len(lines) == 2 * 3, done.stderr  # announced and done, for each of the 3 contenders
    assert lines[0] == "nopad bench --head [1/3] chunked T=256 ..."
    assert lines[-1].startswith("nopad bench --head [3/3] tp2 T=256: ") and "GiB above the inputs" in lines[-1]
    table = done.stdout.strip().splitlines()
    header = next(line for line in table if line.lstrip().startswith("T "))
    for column in ("chunked_ms", "resp25_ms", "tp2_ms", "tp2_gib", "resp25/(0.25 chunked) time", "tp2/chunked time"):
        assert column in header, header
    assert "contenders: chunked resp25 tp2" in done.stdout
