"""``nopad bench --trl``: TRL 1.16's per-token log-prob call of a GRPO step, alone and under
``nopad.integrations.trl.install()``, timed on the same batch; both contenders named in its table and
its JSON, the ratios given, and the two results equal (the bench's own max |difference| columns).
Skipped without TRL unless NOPAD_REQUIRE_TRL=1."""

from __future__ import annotations

import json
import os

import pytest

try:
    import trl  # noqa: F401
    from accelerate import Accelerator  # noqa: F401
except Exception as exc:  # noqa: BLE001 - any failure to import TRL means the bench cannot run
    if os.environ.get("NOPAD_REQUIRE_TRL") == "1":
        raise
    pytest.skip(f"trl is not importable here ({exc!r})", allow_module_level=True)

from nopad._apps.cli import main  # noqa: E402

TINY = ["bench", "--trl", "--trl-vocab", "512", "--trl-hidden", "16", "--trl-prompt-len", "6"]
TINY += ["--trl-completion-len", "24", "--trl-generations", "4", "--trl-rounds", "1", "-q"]


def test_bench_trl_table_names_both_contenders_the_ratios_and_equal_results(capsys):
    assert main(TINY) == 0
    out = capsys.readouterr().out
    for text in ("TRL alone", "nopad install()", "no_grad_ms", "fwd_bwd_ms", "no_grad_gib", "fwd_bwd_gib"):
        assert text in out, out
    for text in ("trl/nopad no_grad time", "trl/nopad fwd_bwd time", "trl/nopad fwd_bwd memory", "num_generations=4"):
        assert text in out, out
    assert "max |nopad - TRL|" in out and "log_probs" in out and "grads" in out, out
    assert "the model's own activations" in out and "GiB above the model's own activations" in out, out


def test_bench_trl_json_results_equal_to_1e_5_and_every_measure_present(capsys):
    assert main([*TINY, "--trl-batch-size", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [row["contender"] for row in result["rows"]] == ["TRL alone", "nopad install()"]
    for row in result["rows"]:
        for key in ("no_grad_ms", "fwd_bwd_ms", "no_grad_gib", "fwd_bwd_gib"):
            assert row[key] > 0, (key, row)
    assert set(result["ratios"]) == {
        "trl/nopad no_grad time",
        "trl/nopad fwd_bwd time",
        "trl/nopad no_grad memory",
        "trl/nopad fwd_bwd memory",
    }
    assert all(value > 0 for value in result["ratios"].values()), result["ratios"]
    assert result["shape"]["generations"] == 4 and result["shape"]["batch_size"] == 3
    assert result["max_abs_diff"].keys() == {"log_probs", "entropy", "grads"}
    assert max(result["max_abs_diff"].values()) <= 1e-5, result["max_abs_diff"]
    assert "dispatch mode" in result["memory"]  # on a CPU: which memory is measured, said


def test_bench_trl_refuses_its_timings_when_nopad_and_trl_disagree(monkeypatch):
    import torch

    from nopad._apps import bench_trl

    monkeypatch.setitem(bench_trl.TOLERANCE, torch.float32, -1.0)  # any difference, even 0, is too much
    with pytest.raises(AssertionError, match="differ from TRL's"):
        main(TINY)


def test_bench_trl_leaves_an_install_made_before_it_in_place_and_removes_its_own(capsys):
    from trl.trainer.grpo_trainer import GRPOTrainer

    from nopad.integrations import trl as nopad_trl

    original = GRPOTrainer.__dict__["_get_per_token_logps_and_entropies"]
    assert main(TINY) == 0
    assert GRPOTrainer.__dict__["_get_per_token_logps_and_entropies"] is original
    with nopad_trl.install() as patch:
        assert main(TINY) == 0
        assert patch.active
    capsys.readouterr()


def test_bench_trl_full_completions_and_the_model_s_own_activations(capsys):
    """``--trl-full-completions``: every completion of the full width (rows x C completion tokens);
    the JSON gives the decoder's own peak (no head) and each contender's peak above it."""
    assert main([*TINY, "--trl-full-completions", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["shape"]["full"] is True
    assert result["rows_real_padded"].endswith(f"{2 * 4 * 24} completion tokens"), result["rows_real_padded"]
    assert set(result["body"]) == {"no_grad_gib", "fwd_bwd_gib"}
    assert all(value > 0 for value in result["body"].values()), result["body"]
    assert set(result["above_body_gib"]) == {
        f"{contender} {kind}" for contender in ("TRL alone", "nopad install()") for kind in ("no_grad", "fwd+bwd")
    }
    rows = {row["contender"]: row for row in result["rows"]}
    assert result["above_body_gib"]["nopad install() fwd+bwd"] == pytest.approx(
        rows["nopad install()"]["fwd_bwd_gib"] - result["body"]["fwd_bwd_gib"]
    )


def test_bench_trl_share_prefixes_adds_the_shared_contender_its_ratios_and_equal_results(capsys):
    """``--trl-share-prefixes``: install(share_prefixes=True)'s method timed in the same rounds (and
    the same with every row its own group), its tokens computed (each of the 3 prompts once, not 4
    times) against the rows' real tokens, and its results equal to TRL's to 1e-5."""
    assert main([*TINY, "--trl-prompts", "3", "--trl-share-prefixes", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    names = [row["contender"] for row in result["rows"]]
    assert names == [
        "TRL alone",
        "nopad install()",
        "nopad install(share_prefixes=True)",
        "the same, every row its own group",
    ]
    assert all(row[key] > 0 for row in result["rows"] for key in ("no_grad_ms", "fwd_bwd_ms", "fwd_bwd_gib"))
    for what in ("no_grad time", "fwd_bwd time", "no_grad memory", "fwd_bwd memory", "tokens computed"):
        assert result["ratios"][f"nopad/shared {what}"] > 0, result["ratios"]
    for what in ("no_grad time", "fwd_bwd time", "no_grad memory", "fwd_bwd memory"):
        assert result["ratios"][f"unshared/shared {what}"] > 0, result["ratios"]
    computed = result["tokens_computed"]
    assert computed["shared"] < computed["nopad"] == computed["unshared"]
    assert result["ratios"]["nopad/shared tokens computed"] == pytest.approx(computed["nopad"] / computed["shared"])
    assert max(result["max_abs_diff_shared"].values()) <= 1e-5, result["max_abs_diff_shared"]
    assert main([*TINY, "--trl-share-prefixes"]) == 0
    out = capsys.readouterr().out
    assert "max |shared - TRL|" in out and "install(share_prefixes=True)" in out and "nopad/shared" in out, out
