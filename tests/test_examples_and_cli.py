"""The newcomer's path: examples and the CLI run as a person would run them, so they cannot rot."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nopad._apps.cli import main

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _run(*cmd: str, timeout: int = 240) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


# examples/fsdp_logprobs.py under torchrun: tests/test_docs.py runs it as docs/integrations/fsdp.md
# shows it and compares every line each rank prints.


@pytest.mark.slow
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
        "packed attention",
        "max |logp packed - padded forward|",
        "leak probe, use_cache default",
        "packed forward",
    ):
        assert row in out
    assert "(OK: <= 1e-05)" in out
    assert re.search(r"leak probe, use_cache default +LEAK", out)
    assert re.search(r"leak probe, nopad inputs +isolated", out)
    # the deliberate failing case is introduced as such before its LEAK line
    trap = out.index("the trap nopad closes, on purpose")
    assert "use_cache left at its default: expected to LEAK" in out[trap:] and trap < out.index("LEAK:")
    # speed in words that cannot be misread, from the median of several warm calls
    assert re.search(r"^speed +packed is \d+\.\dx (faster|slower) than padded", out, re.M)
    assert out.count("(median of 7 warm calls)") == 4


@pytest.mark.slow
def test_bench_json_and_plot(tmp_path, capsys):
    png = tmp_path / "bench.png"
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    plot = ["--plot", str(png)] if has_matplotlib else []
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
                *plot,
            ]
        )
        == 0
    )
    results = json.loads(capsys.readouterr().out)
    rows = results["conversions"]
    assert {r["conversion"] for r in rows} == {"padded -> nested", "padded -> nested, host plan", "nested -> padded"}
    assert [r["syncs"] for r in rows[:3]] == [1, 0, 0]  # a host plan makes the conversion sync-free
    assert all(r["nopad_ms"] > 0 and r["loop/nopad"] > 0 for r in rows)
    assert [r["B"] for r in results["megatron preprocess_thd (need_roll, cp=2)"]] == [4, 16]
    steps = results["padded -> nested in steps (B=16)"]
    assert steps[0]["/gather"] == 1.0 and len(steps) == 7 and all(r["ms"] > 0 for r in steps)
    if not has_matplotlib:
        pytest.skip("matplotlib is not installed: the JSON results passed, the plot is not tested")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_contenders_compute_what_nopad_computes():
    """A ratio against a floor or a loop means something only if both make the same output."""
    import torch

    from nopad._apps.bench import bare_gather, bare_nested, reference_left_right, reference_no_padding
    from nopad.batches import left_right_2_no_padding, no_padding_2_padding
    from nopad.synthetic import synthetic_batch

    data = synthetic_batch(5, 12, 9)
    ours = left_right_2_no_padding(data)
    ids, pos = bare_gather(data)
    assert torch.equal(ids, ours["input_ids"].values()) and torch.equal(pos, ours["position_ids"].values())
    for other in (bare_nested(data), reference_left_right(data)):
        for key in ("input_ids", "position_ids"):
            assert torch.equal(other[key].values(), ours[key].values())
            assert torch.equal(other[key].offsets(), ours[key].offsets())
        assert torch.equal(other.get_non_tensor("indices"), ours.get_non_tensor("indices"))
    logp = torch.nested.nested_tensor_from_jagged(torch.randn(ids.shape[0]), ours["input_ids"].offsets())
    assert torch.equal(reference_no_padding(logp, data), no_padding_2_padding(logp, ours))


def test_bench_model_json_times_padded_against_every_packed_kernel_and_agrees_with_fp32(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "model.png"
    assert main(["bench", "--model", "--repeats", "1", "--json", "--plot", str(png)]) == 0
    rows = json.loads(capsys.readouterr().out)["model"]
    shapes = {r["shape"] for r in rows}
    assert len(shapes) == 2
    for shape in shapes:
        contenders = [r["contender"] for r in rows if r["shape"] == shape]
        assert contenders == ["padded sdpa", "packed, HF sdpa", "packed, sdpa"]  # the CPU's one kernel
    for r in rows:
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["peak_gib"] is None  # peak memory on CUDA only
        assert r["max_abs_logprob_diff"] <= 1e-5  # fp32 on a CPU: packed equals padded
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_model_of_a_state_family_times_per_sequence_and_shows_transformers_own_packed_row_wrong():
    from nopad._apps.bench_model import ModelShape, bench_model

    shape = ModelShape(4, 8, 40, hidden=32, layers=4, heads=4, kv_heads=2, vocab=200, arch="bamba")
    rows = {r["contender"]: r for r in bench_model(shapes=(shape,), repeats=1)}
    assert list(rows) == ["padded sdpa", "per sequence", "packed, HF sdpa", "packed, sdpa"]
    assert rows["packed, sdpa"]["max_abs_logprob_diff"] <= 1e-5  # nopad's packed forms: exact
    assert rows["per sequence"]["max_abs_logprob_diff"] <= 1e-5
    assert rows["packed, HF sdpa"]["max_abs_logprob_diff"] > 1e-3  # its Mamba2 scans run the row as one sequence
    assert rows["padded sdpa"]["shape"].startswith("bamba B=4")


def test_bench_of_shared_prefixes_times_four_contenders_that_all_agree_with_fp32(capsys):
    from nopad._apps.bench_model import ModelShape
    from nopad._apps.bench_prefixes import SHARED, UNSHARED, GroupShape, bench_groups

    model = ModelShape(0, 0, 0, hidden=32, layers=2, heads=4, kv_heads=2, vocab=200)
    shapes = (GroupShape(2, 4, 24, 16, model), GroupShape(3, 1, 24, 16, model))
    grouped, alone = ({r["contender"]: r for r in bench_groups(shapes=(shape,), repeats=1)} for shape in shapes)
    assert list(grouped) == ["padded", "packed", UNSHARED, SHARED]
    for rows in (grouped, alone):
        for name, row in rows.items():
            assert row["max_abs_logprob_diff"] <= 1e-5, name
            assert row["fwd_bwd_ms"] > 0 and row["peak_gib"] is None
        assert rows["packed"]["tokens"] == rows[UNSHARED]["tokens"] < rows["padded"]["tokens"]
    assert grouped[SHARED]["tokens"] < grouped["packed"]["tokens"] and grouped[SHARED]["token_ratio"] > 1
    assert alone[SHARED]["tokens"] == alone["packed"]["tokens"]  # one sample per prompt: nothing to share


def test_bench_model_share_prefixes_on_the_command_line_prints_its_rows(monkeypatch, capsys):
    import nopad._apps.bench_prefixes as bp
    from nopad._apps.bench_model import ModelShape

    tiny = ModelShape(0, 0, 0, hidden=32, layers=2, heads=4, kv_heads=2, vocab=200)
    monkeypatch.setattr(bp, "CPU_GROUPS", (bp.GroupShape(2, 4, 24, 16, tiny),))
    assert main(["bench", "--model", "--share-prefixes", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["share_prefixes"]
    assert [r["contender"] for r in rows] == ["padded", "packed", bp.UNSHARED, bp.SHARED]
    assert all(r["shape"] == "n=4 x 2 prompts, P=24 R=16" for r in rows)


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"]])
def test_cli_help(argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0


def test_bench_model_reports_an_out_of_memory_run_as_missing_not_infinite(monkeypatch):
    import nopad._apps.bench_model as bm

    measure = bm.measure_call
    calls = {"n": 0}

    def padded_backward_runs_out(run, device, backward):
        calls["n"] += 1
        if backward and calls["n"] % 6 == 2:  # the padded contender's fwd+bwd, each round
            return float("inf"), None, None
        return measure(run, device, backward)

    monkeypatch.setattr(bm, "measure_call", padded_backward_runs_out)
    rows = bm.bench_model_shape(bm.CPU_SHAPES[0], "cpu", repeats=1)
    padded = rows[0]
    assert padded["contender"] == "padded sdpa" and padded["fwd_bwd_ms"] is None
    assert all(r["x_padded_fwd_bwd"] is None for r in rows) and all(r["fwd_ms"] > 0 for r in rows)
    json.dumps(rows, allow_nan=False)  # valid JSON: no Infinity, no NaN


def test_bench_batches_times_nopad_against_a_contender_that_gives_the_same_rows(capsys):
    """`nopad bench --batches`: every row's contender (verl's utilities, or the per-row loop) made the
    same micro-batches, outputs and partitions as nopad; nopad's side is sync-free on its own offsets."""
    argv = ["bench", "--batches", "--batch-rows", "12", "40", "--batch-sizes", "4", "--repeats", "1", "--json"]
    assert main(argv) == 0
    results = json.loads(capsys.readouterr().out)
    (rows,) = [v for k, v in results.items() if k.startswith("rows of nested batches")]
    per_size = 6 if importlib.util.find_spec("verl") else 5  # with verl: its engine's path too
    assert [r["B"] for r in rows] == [12] * per_size + [40] * per_size
    assert all(r["identical"] and r["nopad_ms"] > 0 for r in rows)
    assert all(r["syncs"] in (0, None) for r in rows)


def test_the_per_row_loop_of_the_batches_bench_cuts_what_nopad_cuts():
    import torch

    from nopad._apps.bench_rows import loop_join_restore, loop_micro_batches, loop_partitions, nested_rows_batch
    from nopad.batches import balanced_partitions, micro_batches

    td = nested_rows_batch(40, seed=3)
    micro, restore = micro_batches(td, 16_384)
    loop_micro, loop_parts = loop_micro_batches(td, 16_384)
    assert loop_parts == restore.partitions
    for ours, theirs in zip(micro, loop_micro):
        assert torch.equal(ours["input_ids"].values(), theirs["input_ids"].values())
    outputs = [m["input_ids"] for m in micro]
    assert torch.equal(loop_join_restore(outputs, loop_parts).values(), restore(outputs).values())
    for values in ([5, 5, 1, 9], [3, 3, 3, 3, 0, 7], list(range(20))):
        assert loop_partitions(values, 3) == balanced_partitions(values, 3, False)
