"""`nopad bench --model --compile` (issue 39) at a tiny size: its rows, their keys, dynamo's counts,
and compiled packed equal to eager packed (dynamo's own "eager" backend: the graphs are counted, no
compiler runs, so it takes seconds)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from nopad._apps.cli import main  # noqa: E402

KEYS = {
    "shape",
    "contender",
    "tokens",
    "padding",
    "first_pass_s",
    "graphs",
    "recompiles",
    "graph_breaks",
    "fwd_ms",
    "fwd_bwd_ms",
    "x_eager_packed_fwd_bwd",
    "x_compiled_padded_fwd_bwd",
    "peak_gib",
    "max_abs_logprob_diff",
}


@pytest.fixture
def tiny(monkeypatch):
    import nopad._apps.bench_compile as bc
    from nopad._apps.bench_model import ModelShape

    model = ModelShape(0, 0, 0, hidden=32, layers=1, heads=4, kv_heads=2, vocab=200)
    monkeypatch.setattr(bc, "CPU_COMPILE", bc.CompileShape(3, 4, 12, 16, model))


def test_bench_model_compile_prints_each_contenders_compiles_and_steady_state(tiny, capsys):
    argv = ["bench", "--model", "--compile", "--backend", "eager", "--bucket", "32", "--repeats", "1", "--json"]
    assert main([*argv, "--quiet"]) == 0
    rows = {r["contender"]: r for r in json.loads(capsys.readouterr().out)["compile"]}
    bucketed = "compiled packed, bucket 32"
    assert list(rows) == ["eager packed", "compiled packed", bucketed, "compiled padded"]
    for name, row in rows.items():
        assert set(row) == KEYS, name
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["first_pass_s"] > 0 and row["peak_gib"] is None
        assert row["max_abs_logprob_diff"] <= 1e-5, name  # fp32 on a CPU: every contender exact
        assert row["shape"] == "llama h=32 x1, 3 batches of B<=4 P=12 R=16"
    assert rows["eager packed"]["graphs"] is None and rows["eager packed"]["x_eager_packed_fwd_bwd"] == 1
    for name in ("compiled packed", bucketed, "compiled padded"):
        assert 1 <= rows[name]["graphs"] <= 4 and rows[name]["graph_breaks"] == 0, rows[name]
        assert rows[name]["recompiles"] == 0, rows[name]  # dynamic=True: the first batch's graphs serve all
    real = rows["eager packed"]["tokens"]
    assert rows["compiled packed"]["tokens"] == real and rows["compiled packed"]["padding"] == 0
    assert real < rows[bucketed]["tokens"] < real + 3 * 32 and rows[bucketed]["padding"] > 0  # under a bucket a batch
    assert rows["compiled padded"]["tokens"] > real
