"""verl's trainer step on 2 and 4 data-parallel ranks, verl alone and under install(): the same
log-probs, entropy, metrics and weights after one PPO step, with and without use_dynamic_bsz.

Each rank is a gloo process running verl's own TrainingWorker on its FSDP engine (FSDP2, CPU) with
a tiny random-weight Qwen2, and verl's worker-group dispatch and collect around it
(tests/verl_engine.py). Multi-process, so marked slow; CI's verl leg runs it.
"""

from __future__ import annotations

import os

import pytest
import torch

try:
    import verl.utils.tensordict_utils as tu
    from safetensors.torch import load_file
    from verl.single_controller.base.decorator import _concat_data_proto_or_future
except Exception as exc:  # noqa: BLE001 - any failure to import verl means this leg cannot run
    if os.environ.get("NOPAD_REQUIRE_VERL") == "1":
        raise
    pytest.skip(f"verl is not importable here ({exc!r}); these tests run in CI's verl leg", allow_module_level=True)

from nopad.integrations import verl as nopad_verl  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.verl_differential import assert_same  # noqa: E402
from tests.verl_engine import MEASURED, alone_then_installed, save_tiny_model  # noqa: E402

ROWS_PER_RANK = 4
# nopad's routes that verl's step must have gone through under install(), per use_dynamic_bsz
ROUTES = {
    False: {"left_right_2_no_padding", "chunk_tensordict", "concat_tensordict", "index_select_tensor_dict",
            "postprocess_batch_func"},
    True: {"left_right_2_no_padding", "chunk_tensordict", "concat_tensordict", "index_select_tensor_dict",
           "rearrange_micro_batches", "postprocess_batch_func"},  # the join restores the rows' order itself
}  # fmt: skip


def _same_metrics(theirs: dict, ours: dict, where: str) -> None:
    """Equal, key for key; the measurements (mfu from wall-clock time, host memory) are present in both
    and of the same type, since no two runs share them."""
    assert list(ours) == list(theirs), where
    for key in theirs:
        if key in MEASURED:
            assert type(ours[key]) is type(theirs[key]), f"{where}[{key!r}]"
        else:
            assert_same(theirs[key], ours[key], f"{where}[{key!r}]")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_verls_trainer_step_on_dp_ranks_is_unchanged_by_install(world, tmp_path):
    model_dir = str(tmp_path / "tiny-qwen2")
    save_tiny_model(model_dir)
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    ranks = run_distributed(alone_then_installed, world, model_dir, ROWS_PER_RANK)

    for dynamic in (False, True):
        where = f"{world} ranks, use_dynamic_bsz={dynamic}"
        alone = [r["alone", dynamic] for r in ranks]
        installed = [r["installed", dynamic] for r in ranks]
        # the driver's collect of the log-prob pass, here as on every rank: verl's alone, nopad's under install()
        theirs = _concat_data_proto_or_future([r["infer_output"] for r in alone])
        with nopad_verl.install():
            ours = _concat_data_proto_or_future([r["infer_output"] for r in installed])
        assert len(ours) == world * ROWS_PER_RANK and sorted(ours.keys()) == ["entropy", "log_probs", "metrics"]
        for key in ("log_probs", "entropy"):
            assert_same(theirs[key], ours[key], f"{where}: {key}")
        _same_metrics(tu.get(theirs, "metrics"), tu.get(ours, "metrics"), f"{where}: infer metrics")
        assert isinstance(tu.get(ours, "metrics")["mfu"], float)  # one dict (rank 0's), as verl keeps it
        for rank, (a, b) in enumerate(zip(alone, installed)):
            assert isinstance(b["old_log_prob_mfu"], float), f"{where}: rank {rank}"
            for key in ("old_log_probs", "entropys"):
                assert_same(a[key], b[key], f"{where}: rank {rank} {key}")
            _same_metrics(a["train_metrics"], b["train_metrics"], f"{where}: rank {rank} train metrics")
            for key in ("log_probs", "entropy"):
                assert_same(a["collected"][key], b["collected"][key], f"{where}: rank {rank} collected {key}")
        # one PPO step moved every weight, the same way
        weights_alone, weights_installed = alone[0]["weights"], installed[0]["weights"]
        assert weights_alone.keys() == weights_installed.keys() == initial.keys()
        for key in weights_alone:
            assert_same(weights_alone[key], weights_installed[key], f"{where}: weight {key}")
            assert not torch.equal(weights_alone[key], initial[key]), f"{where}: {key} did not move"
        # and it went through nopad: every route this step uses was called on every rank
        for rank, r in enumerate(ranks):
            called = set(r["routes_called", dynamic])
            assert ROUTES[dynamic] <= called, f"{where}: rank {rank} never called {ROUTES[dynamic] - called}"
