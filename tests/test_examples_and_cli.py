"""The newcomer's path: examples and the CLI run as a person would run them, so they cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nopad.cli import main

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _run(*cmd: str, timeout: int = 240) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_fsdp_example_under_torchrun():
    out = _run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/fsdp_logprobs.py",
        "--batch-size",
        "4",
    )
    assert "Ulysses SP 2" in out and "equal one process: True" in out
    assert out.count("[rank") >= 4


def test_pack_offline_example():
    out = _run(sys.executable, "examples/pack_offline.py")
    assert "cp rank 0: tokens" in out and "cp rank 1: tokens" in out


def test_demo_prints_the_table_and_agrees_per_token(capsys):
    assert main(["demo", "--batch-size", "6", "--prompt-len", "16", "--response-len", "24"]) == 0
    out = capsys.readouterr().out
    for row in (
        "tokens computed, padded",
        "tokens computed, packed",
        "padding never computed",
        "max |logp padded - packed|",
        "leak probe, use_cache default",
        "packed forward",
    ):
        assert row in out
    assert "(OK: < 1e-05)" in out
    assert "leak probe, use_cache default  LEAK" in out and "leak probe, nopad inputs       isolated" in out


def test_bench_json_and_plot(tmp_path, capsys):
    png = tmp_path / "bench.png"
    assert (
        main(
            [
                "bench",
                "--batch-sizes",
                "4",
                "16",
                "--prompt-len",
                "16",
                "--response-len",
                "16",
                "--repeats",
                "2",
                "--engines",
                "--steps",
                "--json",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    results = json.loads(capsys.readouterr().out)
    rows = results["conversions"]
    assert {r["conversion"] for r in rows} == {"padded -> nested", "nested -> padded"}
    assert all(r["nopad_ms"] > 0 and r["loop/nopad"] > 0 for r in rows)
    assert [r["B"] for r in results["megatron preprocess_thd (need_roll, cp=2)"]] == [4, 16]
    steps = results["padded -> nested in steps (B=16)"]
    assert steps[0]["/gather"] == 1.0 and len(steps) == 6 and all(r["ms"] > 0 for r in steps)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"]])
def test_cli_help(argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
