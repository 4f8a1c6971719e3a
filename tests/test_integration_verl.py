"""nopad under verl: install() rebinds verl's conversions, gives verl's results, and uninstall() undoes it.

These tests need verl itself and run in CI's verl leg (``.ci/run``: a venv with verl 0.9.1 and its
own dependencies); without verl they are skipped with the reason.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import types

import pytest
import torch
from tensordict import NonTensorData, TensorDict

from tests.batches import make_batch

try:
    import verl  # noqa: F401
    import verl.workers.utils.padding as vpad
except Exception as exc:  # noqa: BLE001 - any failure to import verl means this leg cannot run
    if os.environ.get("NOPAD_REQUIRE_VERL") == "1":  # CI's verl leg: these tests must run, not skip
        raise
    pytest.skip(f"verl is not importable here ({exc!r}); these tests run in CI's verl leg", allow_module_level=True)

from nopad import batches as nopad_padding  # noqa: E402

# private: the installer's routes and bindings are what is tested
from nopad.integrations.verl import _install as nv  # noqa: E402

# verl modules that bind the routed names by ``from ... import``; each is imported if it can be
CALLERS = (
    "verl.workers.utils.losses",
    "verl.trainer.ppo.ray_trainer",
    "verl.trainer.distillation.losses",
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.models.mcore.util",
    "verl.models.mcore.model_forward",
    "verl.models.mcore.model_forward_fused",
    "verl.utils.megatron.router_replay_utils",
    "verl.trainer.distillation.megatron.losses",
)


def _import_callers():
    loaded = {}
    for name in CALLERS:
        try:
            loaded[name] = __import__(name, fromlist=["_"])
        except ImportError:
            pass
    return loaded


def _verl_bindings():
    """Every (module, name) -> object in verl's modules that is one of the routed functions' originals."""
    originals = {}
    for module_name, names in nv.ROUTED.items():
        module = sys.modules.get(module_name)
        for name in names if module is not None else ():
            originals[id(vars(module)[name])] = vars(module)[name]
    found = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "verl" or module_name.startswith("verl.")):
            continue
        for name, value in list(vars(module).items()):
            if id(value) in originals:
                found[module_name, name] = value
    return found


@pytest.fixture
def clean():
    """No handle active before or after a test."""
    if nv.active() is not None:
        nv.active().uninstall()
    yield
    if nv.active() is not None:
        nv.active().uninstall()


# ---- install / uninstall ---------------------------------------------------------------------------
def test_install_rebinds_every_verl_importer_and_uninstall_restores_them_exactly(clean):
    loaded = _import_callers()
    assert {"verl.workers.utils.losses", "verl.trainer.distillation.losses"} <= set(loaded)
    before = _verl_bindings()
    importers = {m for m, _ in before} - set(nv.ROUTED)
    assert len(importers) >= 3, before.keys()  # names bound by `from ... import` in other verl modules
    handle = nv.install()
    for (module_name, name), original in before.items():
        now = vars(sys.modules[module_name])[name]
        assert now is _replacement_of(original), (module_name, name)
    assert set(before) <= set(handle.bindings)
    assert loaded["verl.workers.utils.losses"].no_padding_2_padding is nopad_padding.no_padding_2_padding
    assert vpad.left_right_2_no_padding is nv.left_right_2_no_padding
    handle.uninstall()
    after = _verl_bindings()
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert nv.active() is None


def _replacement_of(original):
    """nopad's replacement of a verl original, by the (module, name) that defines it (not its
    ``__name__``: verl's ``linear_cross_entropy`` is ``LinearCrossEntropy.apply``)."""
    ((module_name, name),) = [key for key, value in nv.active().originals.items() if value is original]
    return nv.REPLACEMENTS[module_name][name]


def test_install_is_idempotent_and_a_context_manager(clean):
    with nv.install() as handle:
        assert nv.install() is handle and handle.active
        assert vpad.no_padding_2_padding is nopad_padding.no_padding_2_padding
    assert not handle.active and vpad.no_padding_2_padding is not nopad_padding.no_padding_2_padding
    handle.uninstall()  # a second uninstall changes nothing
    assert vpad.no_padding_2_padding.__module__ == "verl.workers.utils.padding"


def test_modules_imported_after_install_are_rebound_and_restored():
    # a fresh interpreter: install() first, then verl's callers are imported for the first time
    code = """
import sys
from nopad import batches as nopad_padding
from nopad.integrations.verl import _install as nv
handle = nv.install()
assert "verl.workers.utils.losses" not in sys.modules
import verl.workers.utils.losses as losses
import verl.models.mcore.model_forward as mf
import verl.models.mcore.util as util
assert losses.no_padding_2_padding is nopad_padding.no_padding_2_padding
assert mf.preprocess_thd_engine is nv.preprocess_thd_engine and util.postprocess_thd_engine is nv.postprocess_thd_engine
assert mf.__loader__.__class__.__name__ != "_PatchingLoader" and mf.__spec__.loader is mf.__loader__
handle.uninstall()
assert losses.no_padding_2_padding.__module__ == "verl.workers.utils.padding"
assert mf.preprocess_thd_engine is util.preprocess_thd_engine
assert mf.preprocess_thd_engine.__module__ == "verl.models.mcore.util"
assert not any(type(f).__name__ == "_VerlFinder" for f in sys.meta_path)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_install_touches_no_module_outside_verl(clean):
    class Lazy(types.ModuleType):
        def __getattr__(self, name):  # like transformers' lazy modules: any probe would import things
            raise AssertionError(f"install() probed {name!r} outside verl")

    lazy = Lazy("not_verl_lazy")
    holder = types.ModuleType("not_verl_holder")
    holder.no_padding_2_padding = vpad.no_padding_2_padding
    sys.modules.update(not_verl_lazy=lazy, not_verl_holder=holder)
    try:
        with nv.install():
            assert holder.no_padding_2_padding is not nopad_padding.no_padding_2_padding
    finally:
        del sys.modules["not_verl_lazy"], sys.modules["not_verl_holder"]


def test_a_wrong_verl_version_is_refused_naming_it(clean, monkeypatch):
    monkeypatch.setattr(nv, "verl_version", lambda: "0.7.0")
    with pytest.raises(RuntimeError, match=r"found verl 0\.7\.0.*0\.9\.1"):
        nv.install()
    assert nv.active() is None and vpad.no_padding_2_padding is not nopad_padding.no_padding_2_padding


# ---- the padding functions equal verl's ----------------------------------------------------------
def _verl_batch(prompt_lens, resp_lens, prompt_width, resp_width, *, extras=True, mrope=0, seed=0):
    data = make_batch(prompt_lens, resp_lens, prompt_width, resp_width, extras=extras, mrope=mrope, seed=seed)
    S = prompt_width + resp_width
    data["prompts"], data["responses"] = data["input_ids"][:, :prompt_width], data["input_ids"][:, prompt_width:]
    data["old_log_probs"] = torch.randn(len(prompt_lens), resp_width)
    assert data["input_ids"].shape[1] == S
    return data


def _same(a, b):
    if isinstance(a, torch.Tensor) and a.is_nested:
        return b.is_nested and torch.equal(a.offsets(), b.offsets()) and torch.equal(a.values(), b.values())
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("mrope", [0, 4])
def test_left_right_2_no_padding_updates_data_in_place_as_verl_does(clean, mrope):
    original = vpad.left_right_2_no_padding
    theirs_in = _verl_batch([2, 3, 1, 4], [2, 1, 3, 0], 4, 3, mrope=mrope)
    theirs_in["attention_mask"] = theirs_in["attention_mask"].float()  # verl's tests use float masks
    ours_in = theirs_in.clone()
    theirs = original(theirs_in)
    with nv.install():
        ours = vpad.left_right_2_no_padding(ours_in)
    assert theirs is theirs_in and ours is ours_in  # in place, the same object returned
    assert list(ours.keys()) == list(theirs.keys())
    for key in theirs.keys():
        a, b = theirs.get(key), ours.get(key)
        if isinstance(a, NonTensorData):
            assert isinstance(b, NonTensorData) and _same(a.data, b.data), key
        elif key == "position_ids" and mrope:  # verl's own as_nested_tensor puts the ragged dim last too
            assert all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind()))
        else:
            assert _same(a, b), key


def test_no_padding_2_padding_and_response_functions_equal_verls(clean):
    data = vpad.left_right_2_no_padding(_verl_batch([2, 3, 1, 4], [2, 1, 3, 1], 4, 3, extras=False))
    offsets = data["input_ids"].offsets()
    out = torch.nested.nested_tensor_from_jagged(torch.randn(int(offsets[-1]), 5), offsets)
    resp_mask = torch.nested.as_nested_tensor([torch.ones(n) for n in (2, 1, 3, 1)], layout=torch.jagged)
    padded = torch.randn(4, 3)
    theirs = (
        vpad.no_padding_2_padding(out, data),
        vpad.no_padding_2_padding(out.values(), data),
        vpad.response_from_nested(out, resp_mask),
        vpad.response_to_nested(padded, resp_mask),
        vpad.build_attention_mask_from_nested(data["input_ids"]),
        vpad.build_attention_mask_from_nested(data["input_ids"], 9),
    )
    with nv.install():
        ours = (
            vpad.no_padding_2_padding(out, data),
            vpad.no_padding_2_padding(out.values(), data),
            vpad.response_from_nested(out, resp_mask),
            vpad.response_to_nested(padded, resp_mask),
            vpad.build_attention_mask_from_nested(data["input_ids"]),
            vpad.build_attention_mask_from_nested(data["input_ids"], 9),
        )
    for a, b in zip(theirs, ours, strict=True):
        assert _same(a, b)


def test_embeds_padding_2_no_padding_equals_verls(clean):
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    data = TensorDict(
        {
            "prompt_embeds": torch.randn(3, 4, 2),
            "prompt_embeds_mask": mask,
            "negative_prompt_embeds": torch.randn(3, 4, 2),
            "negative_prompt_embeds_mask": mask.flip(-1),
        },
        batch_size=[3],
    )
    theirs = vpad.embeds_padding_2_no_padding(data.clone())
    with nv.install():
        target = data.clone()
        ours = vpad.embeds_padding_2_no_padding(target)
    assert ours is target
    for key in theirs.keys():
        assert _same(theirs[key], ours[key]), key


# ---- verl's own ppo_loss is unchanged by install() -----------------------------------------------
def _actor_config(**overrides):
    from verl.workers.config import FSDPActorConfig

    fields = dict(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
        clip_ratio=0.2,
        clip_ratio_c=3.0,
        loss_agg_mode="token-mean",
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        kl_loss_coef=0.05,
    )
    fields.update(overrides)
    return FSDPActorConfig(**fields)


def _ppo_micro_batch(seed=0, nested_fields=False):
    from verl.utils import tensordict_utils as tu

    prompt_lens, resp_lens, P, R = [3, 2, 4, 1], [3, 1, 2, 3], 4, 3
    data = _verl_batch(prompt_lens, resp_lens, P, R, extras=False, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for key in ("old_log_probs", "ref_log_prob"):
        data[key] = -torch.rand(4, R, generator=g)
    data["advantages"] = torch.randn(4, R, generator=g)
    data["rollout_is_weights"] = torch.rand(4, R, generator=g) + 0.5
    data = vpad.left_right_2_no_padding(data)
    if nested_fields:  # verl may keep rollout fields nested; its ppo_loss pads them back
        mask = data["response_mask"]
        lens = mask.sum(-1)
        for key in ("response_mask", "old_log_probs", "advantages", "rollout_is_weights", "ref_log_prob"):
            data[key] = torch.nested.as_nested_tensor([data[key][b, : lens[b]] for b in range(4)], layout=torch.jagged)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(sum(resp_lens)), global_batch_size=None)
    offsets = data["input_ids"].offsets()
    total = int(offsets[-1])
    model_output = {
        "log_probs": torch.nested.nested_tensor_from_jagged(-torch.rand(total, generator=g), offsets),
        "entropy": torch.nested.nested_tensor_from_jagged(torch.rand(total, generator=g), offsets),
    }
    return model_output, data


def _metric_values(metrics):
    out = {}
    for key, value in metrics.items():
        if not isinstance(value, torch.Tensor):
            value = getattr(value, "values", value)  # verl's Metric keeps a list of values
        value = value[0] if isinstance(value, list) and len(value) == 1 else value
        out[key] = float(value)
    return out


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_verls_ppo_loss_gives_the_same_loss_and_metrics_with_install(clean, loss_agg_mode):
    from verl.workers.utils import losses as vl

    model_output, data = _ppo_micro_batch()
    loss_before, metrics_before = vl.ppo_loss(_actor_config(loss_agg_mode=loss_agg_mode), model_output, data.clone())
    with nv.install():
        assert vl.no_padding_2_padding is nopad_padding.no_padding_2_padding
        loss_after, metrics_after = vl.ppo_loss(_actor_config(loss_agg_mode=loss_agg_mode), model_output, data.clone())
    torch.testing.assert_close(loss_after, loss_before, rtol=0, atol=0)
    assert metrics_after.keys() == metrics_before.keys()
    assert _metric_values(metrics_after) == _metric_values(metrics_before)


@pytest.mark.parametrize("nested_fields", [False, True])
def test_nopads_ppo_loss_takes_verls_config_fields_and_metric_names(clean, nested_fields):
    from verl.workers.utils import losses as vl

    import nopad.losses as L

    model_output, data = _ppo_micro_batch(seed=1, nested_fields=nested_fields)
    theirs_loss, theirs_metrics = vl.ppo_loss(_actor_config(), model_output, data.clone())
    ours_loss, ours_metrics = L.ppo_loss(_actor_config(), model_output, data.clone())
    torch.testing.assert_close(ours_loss, theirs_loss, rtol=1e-6, atol=1e-7)
    assert set(ours_metrics) == set(theirs_metrics)
    theirs_values = _metric_values(theirs_metrics)
    for key, value in _metric_values(ours_metrics).items():
        assert value == pytest.approx(theirs_values[key], rel=1e-5, abs=1e-7), key


def test_kl_penalty_takes_verls_keyword_and_matches_verl():
    from verl.trainer.ppo.core_algos import kl_penalty as verl_kl

    import nopad.losses as L

    logp, ref = -torch.rand(3, 5), -torch.rand(3, 5)
    for kind in ("k1", "abs", "k2", "k3", "low_var_kl", "k3+"):
        torch.testing.assert_close(
            L.kl_penalty(logprob=logp, ref_logprob=ref, kl_penalty=kind),
            verl_kl(logprob=logp, ref_logprob=ref, kl_penalty=kind),
        )
        assert torch.equal(L.kl_penalty(logp, ref, kind=kind), L.kl_penalty(logp, ref, kind))
    with pytest.raises(ValueError, match="both"):
        L.kl_penalty(logp, ref, "k1", kind="k3")


# ---- verl's THD pre/post-processing ---------------------------------------------------------------
class _ParallelState:
    """megatron-core's parallel_state as verl reads it, for one rank of a TP x CP grid."""

    def __init__(self, tp, cp, rank):
        self.tp, self.cp, self.rank = tp, cp, rank

    def get_tensor_model_parallel_world_size(self):
        return self.tp

    def get_context_parallel_world_size(self):
        return self.cp

    def get_context_parallel_rank(self):
        return self.rank

    def get_context_parallel_group(self):
        return None


def _nested(lengths, *trailing, seed=0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(1, 1000, (sum(lengths), *trailing), generator=g)
    offsets = torch.tensor([0, *itertools.accumulate(lengths)])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def _params_equal(a, b):
    for field in (
        "qkv_format",
        "cu_seqlens_q",
        "cu_seqlens_kv",
        "cu_seqlens_q_padded",
        "cu_seqlens_kv_padded",
        "max_seqlen_q",
        "max_seqlen_kv",
    ):
        x, y = getattr(a, field), getattr(b, field)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), field
        else:
            assert x == y and type(x) is type(y), field


@pytest.mark.parametrize("lengths", [[5, 3, 8, 1], [4], [7, 7, 7], [16, 2, 9, 1, 1]])
def test_preprocess_thd_engine_equals_verls_on_every_rank(clean, monkeypatch, lengths):
    util = pytest.importorskip("verl.models.mcore.util")
    original = util.preprocess_thd_engine
    for trailing in ((), (3,)):
        input_ids = _nested(lengths, *trailing)
        for tp, cp, need_roll, fp8, bucket in itertools.product(
            (1, 2), (1, 2, 4), (False, True), (False, True), (None, 8)
        ):
            for rank in range(cp):
                monkeypatch.setattr(util, "mpu", _ParallelState(tp, cp, rank))
                kwargs = dict(need_roll=need_roll, use_fp8_padding=fp8, pad_to_length_bucket=bucket)
                theirs = original(input_ids, **kwargs)
                with nv.install():
                    ours = util.preprocess_thd_engine(input_ids, **kwargs)
                case = (lengths, trailing, tp, cp, rank, need_roll, fp8, bucket)
                assert torch.equal(ours[0], theirs[0]) and ours[0].dtype == theirs[0].dtype, case
                assert torch.equal(ours[2], theirs[2]) and ours[2].dtype == theirs[2].dtype, case
                _params_equal(ours[1], theirs[1])


def test_thd_round_trip_through_verls_functions_gives_the_same_tokens(clean, monkeypatch):
    util = pytest.importorskip("verl.models.mcore.util")
    pre, post = util.preprocess_thd_engine, util.postprocess_thd_engine
    input_ids = _nested([5, 3, 8, 1, 12])
    for tp in (1, 2):
        monkeypatch.setattr(util, "mpu", _ParallelState(tp, 1, 0))
        tokens, params, _ = pre(input_ids)
        theirs = post(tokens.float(), params, input_ids, 5)
        with nv.install():
            tokens2, params2, _ = util.preprocess_thd_engine(input_ids)
            ours = util.postprocess_thd_engine(tokens2.float(), params2, input_ids, 5)
            assert util.postprocess_thd_engine(tokens2, params2, input_ids, 5, post_process=False) is tokens2
        assert torch.equal(ours.offsets(), input_ids.offsets())
        assert torch.equal(ours.values(), theirs.values()) and torch.equal(ours.values().long(), input_ids.values())


def test_options_nopad_leaves_to_verl_fall_through_to_verls_function(clean, monkeypatch):
    util = pytest.importorskip("verl.models.mcore.util")
    monkeypatch.setattr(util, "mpu", _ParallelState(1, 2, 1))
    input_ids = _nested([5, 3, 8])
    theirs = util.preprocess_thd_engine(input_ids, min_local_rows=64)
    with nv.install():
        ours = util.preprocess_thd_engine(input_ids, min_local_rows=64)
        assert torch.equal(ours[0], theirs[0]) and ours[0].shape[1] == 64
        _params_equal(ours[1], theirs[1])
        with pytest.raises(ValueError, match="Unsupported context parallel layout"):  # verl's own function
            util.preprocess_thd_engine(input_ids, cp_layout="ring")


# ---- bad input: refused where verl would misread it ------------------------------------------------
@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda ids: nv.preprocess_thd_engine(ids, need_roll="false"), r"need_roll: expected True or False"),
        (lambda ids: nv.preprocess_thd_engine(ids, use_fp8_padding=1), r"use_fp8_padding: expected True or False"),
        (lambda ids: nv.preprocess_thd_engine(ids, pre_process="no"), r"pre_process: expected True or False"),
        (
            lambda ids: nv.postprocess_thd_engine(torch.zeros(1, 16), None, ids, 2),
            r"batch_size: expected 3, the number of sequences in input_ids, got 2",
        ),
        (
            lambda ids: nv.postprocess_thd_engine(torch.zeros(1, 16), None, ids, 3, post_process="False"),
            r"post_process: expected True or False",
        ),
    ],
    ids=["need_roll-str", "use_fp8_padding-int", "pre_process-str", "batch_size-other", "post_process-str"],
)
def test_thd_engine_arguments_verl_would_misread_are_refused(clean, monkeypatch, call, words):
    util = pytest.importorskip("verl.models.mcore.util")
    monkeypatch.setattr(util, "mpu", _ParallelState(1, 1, 0))
    with pytest.raises(ValueError, match=words):
        call(_nested([5, 3, 8]))


def test_verl_metadata_none_and_per_row_figures_read_as_one_value_or_are_refused(clean):
    from tensordict import NonTensorStack
    from verl.utils import tensordict_utils as tu

    import nopad.losses as L

    model_output, data = _ppo_micro_batch(seed=2)  # global_batch_size=None, as verl assigns it
    expected = L.ppo_loss(_actor_config(), model_output, data.clone())[0]
    same = data.clone()
    tu.assign_non_tensor(same, batch_num_tokens=NonTensorStack(*(NonTensorData(9) for _ in range(4))))
    assert torch.equal(L.ppo_loss(_actor_config(), model_output, same)[0], expected)  # 9 is the figure given
    differ = data.clone()
    tu.assign_non_tensor(differ, batch_num_tokens=NonTensorStack(*(NonTensorData(n) for n in (9, 9, 8, 9))))
    with pytest.raises(ValueError, match=r"data\['batch_num_tokens'\]: expected one value .*\[9, 9, 8, 9\]"):
        L.ppo_loss(_actor_config(), model_output, differ)


# ---- issue 22: refused where verl would misread, accepted where verl accepts -----------------------
def _verl_varying_lengths_batch():
    """verl's test_no_padding_2_padding_varying_lengths: right-padded rows whose attention ends at column
    S - R, float masks, and the prompts and responses given nested."""
    prompt_lens, response_lens, S, R = [10, 30, 5, 40], [40, 20, 45, 10], 100, 50
    B = len(prompt_lens)
    input_ids = torch.zeros(B, S, dtype=torch.long)
    attention_mask = torch.zeros(B, S)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        input_ids[i, : p + r] = torch.arange(1, p + r + 1)
        attention_mask[i, : p + r] = 1
    response_mask = (torch.arange(R) < torch.tensor(response_lens).unsqueeze(1)).float()
    rows = [input_ids[i, : p + r] for i, (p, r) in enumerate(zip(prompt_lens, response_lens))]
    prompts = torch.nested.as_nested_tensor([x[:p] for x, p in zip(rows, prompt_lens)], layout=torch.jagged)
    responses = torch.nested.as_nested_tensor([x[p:] for x, p in zip(rows, prompt_lens)], layout=torch.jagged)
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "position_ids": torch.arange(S).expand(B, S).clone(),
            "prompts": prompts,
            "responses": responses,
        },
        batch_size=[B],
    )


def test_verls_varying_lengths_test_gives_verls_values_under_install(clean):
    """It passed in verl and gave all zeros, silently, under install()."""
    results = []
    for convert, back in (
        (vpad.left_right_2_no_padding, vpad.no_padding_2_padding),
        (nv.left_right_2_no_padding, nopad_padding.no_padding_2_padding),
    ):
        data = convert(_verl_varying_lengths_batch())
        ids = data["input_ids"]
        results.append(back(torch.nested.nested_tensor_from_jagged(ids.values().float(), ids.offsets()), data))
    assert torch.equal(results[0], results[1]) and results[1].abs().sum() > 0


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (
            lambda: nv.left_right_2_no_padding(make_batch([2, 1], [1, 2], 2, 2).exclude("position_ids")),
            r"data: expected the keys of left-right padding data .*got missing \['position_ids'\]",
        ),
        (
            lambda: nv.left_right_2_no_padding(
                make_batch([2, 1], [1, 2], 2, 2).set(
                    "attention_mask", make_batch([2, 1], [1, 2], 2, 2)["attention_mask"] / 2
                )
            ),
            r"attention_mask row 0: expected a 0/1 mask .*got 0.5",
        ),
        (
            lambda: nv.postprocess_thd_engine(torch.zeros(1, 16), None, _nested([5, 3, 8]), 3.0),
            r"batch_size: expected an int, got 3.0",
        ),
        (
            lambda: nv.preprocess_thd_engine(_nested([5, 3, 8]), pad_to_length_bucket="8"),
            r"pad_to_length_bucket: expected an int, got '8'",
        ),
        (lambda: nv.install(check_version="no"), r"check_version: expected True or False \(a bool\), got 'no'"),
    ],
    ids=["missing-key-assert", "float-mask-of-halves", "batch-size-float", "bucket-string", "check-version-str"],
)
def test_issue_22_verl_arguments_are_refused_saying_what_to_fix(clean, call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_a_float_0_1_attention_mask_converts_as_verls(clean):
    data = make_batch([2, 3, 1], [3, 0, 2], 3, 3, extras=False)
    data["attention_mask"] = data["attention_mask"].float()
    theirs = vpad.left_right_2_no_padding(data.clone())
    ours = nv.left_right_2_no_padding(data.clone())
    for key in ("input_ids", "position_ids"):
        assert torch.equal(ours[key].values(), theirs[key].values()) and torch.equal(
            ours[key].offsets(), theirs[key].offsets()
        )


def test_a_routed_thd_function_called_before_its_module_was_imported_runs_on_nopad():
    """It raised RuntimeError ("verl's original is unknown") when verl.models.mcore.util had not been
    imported yet under install()."""
    code = """
import sys, torch
import megatron.core.parallel_state as ps
ps.get_tensor_model_parallel_world_size = lambda: 2
ps.get_context_parallel_world_size = lambda: 1
ps.get_context_parallel_rank = lambda: 0
from nopad.integrations.verl import _install as nv
ids = torch.nested.nested_tensor_from_jagged(torch.arange(16), torch.tensor([0, 5, 8, 16]))
with nv.install():
    assert "verl.models.mcore.util" not in sys.modules
    ours = nv.preprocess_thd_engine(ids, need_roll=True)
    import verl.models.mcore.util as util
    assert util.preprocess_thd_engine is nv.preprocess_thd_engine
theirs = util.preprocess_thd_engine(ids, need_roll=True)
assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[2], theirs[2])
assert torch.equal(ours[1].cu_seqlens_q_padded, theirs[1].cu_seqlens_q_padded)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# ---- the fused-kernel head: FusedLinearForPPO ------------------------------------------------------
def _head_case(shape, vocab=257, hidden=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, dtype=dtype) / hidden**0.5).requires_grad_()
    ids = torch.randint(0, vocab, shape, generator=g, dtype=torch.int32)  # verl casts them to int64 itself
    weights = torch.randn(2, *shape, generator=g)
    return h, w, ids, weights


def _fused(cls, h, w, ids, weights, temperature):
    lp, ent = cls()(h, w, ids, temperature)
    grads = torch.autograd.grad((lp * weights[0]).sum() + (ent.float() * weights[1]).sum(), (h, w))
    return lp, ent, grads


@pytest.mark.parametrize("shape", [(1,), (700,), (2, 300)], ids=["one-token", "2-D, not a multiple of 512", "3-D"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_linear_for_ppo_is_served_by_the_chunked_head_with_verls_results(clean, shape, temperature):
    from verl.utils.experimental import torch_functional as tf

    theirs_cls = tf.FusedLinearForPPO
    h, w, ids, weights = _head_case(shape)
    theirs = _fused(theirs_cls, h, w, ids, weights, temperature)
    with nv.install() as handle:
        assert tf.FusedLinearForPPO is nv.FusedLinearForPPO
        assert (tf.__name__, "FusedLinearForPPO") in handle.bindings
        ours = _fused(tf.FusedLinearForPPO, h, w, ids, weights, temperature)
    assert tf.FusedLinearForPPO is theirs_cls
    for a, b in zip((ours[0], ours[1], *ours[2]), (theirs[0], theirs[1], *theirs[2])):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()  # weight grads sum 700 tokens


def test_verls_fused_model_forward_gives_the_same_log_probs_and_entropy_through_nopad(clean):
    """verl's own ``forward_with_torch_backend`` (what ``use_fused_kernels`` patches in) on a tiny Qwen2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.models.transformers.dense_common import forward_with_torch_backend

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).float()
    input_ids = torch.randint(0, 1000, (1, 40))
    position_ids = torch.cat([torch.arange(25), torch.arange(15)]).unsqueeze(0)  # two packed sequences

    def run():
        model.zero_grad()
        out = forward_with_torch_backend(
            model, input_ids=input_ids, position_ids=position_ids, use_cache=False, return_dict=True, temperature=0.8
        )
        (out.log_probs.sum() + out.entropy.sum()).backward()
        return out.log_probs.detach(), out.entropy.detach(), model.lm_head.weight.grad.clone()

    theirs = run()
    with nv.install():
        ours = run()
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
    assert ours[2].abs().max() > 1e-4


def test_fused_linear_for_ppo_keeps_verls_backend_check(clean):
    with nv.install():
        with pytest.raises(ValueError, match="impl_backend: expected 'torch' or 'liger'.*got 'triton'"):
            nv.FusedLinearForPPO(impl_backend="triton")
