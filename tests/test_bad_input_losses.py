"""Nothing silently wrong in the losses, the engines' log-prob paths and the metadata verl writes.

A catalogue: one case per bad input, each asserting the error type and the words that say what to
fix. Then hypothesis strategies that take a valid input and put one field off (always refused),
and valid edge inputs that must keep giving exactly the plain result without touching their input.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

# private: the checks behind the losses (boundaries, figures, clip) and the leak probe's batch
import nopad.losses._losses as L
from nopad.core._batch import get_field
from nopad.diagnostics import OpCounter
from nopad.engines import packed_logprobs, padded_logprobs, postprocess_thd, prepare_model_inputs, preprocess_thd
from nopad.engines._leak import check_isolation, probe_batch
from nopad.modeling import token_log_probs
from tests.models import VOCAB, make_padded_batch
from tests.test_losses import SHAPES, rollout

NAN, INF = float("nan"), float("inf")


# ---- inputs ---------------------------------------------------------------------------------
def _batch(seed=0):
    """A micro batch (response rows of lengths 4, 1, 0, 2; row 3 masked) and its nested output."""
    data, full, nested_of = rollout(*SHAPES[0][:4], masked_rows=SHAPES[0][4], seed=seed)
    return data, nested_of(full.detach())


def _on_batch_offsets(data, values):
    return torch.nested.nested_tensor_from_jagged(values, data["input_ids"].offsets())


def _other_boundaries(data, values):
    """The same total in other sequence boundaries: one token moved from the first row to the second."""
    offsets = data["input_ids"].offsets().clone()
    offsets[1] -= 1
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def _ppo(config=None, **figures):
    data, out = _batch()
    for key, value in figures.items():
        data[key] = value if isinstance(value, (NonTensorData, NonTensorStack)) else NonTensorData(value)
    return lambda: L.ppo_loss(config, {"log_probs": out}, data)


def _ppo_output(make):
    data, out = _batch()
    return lambda: L.ppo_loss(None, {"log_probs": make(data, out.values())}, data)


def _ppo_field(key, value):
    data, out = _batch()
    data[key] = value
    return lambda: L.ppo_loss({"use_kl_loss": True}, {"log_probs": out}, data)


def _sft_other_boundaries():
    data, out = _batch()
    data["loss_mask"] = _on_batch_offsets(data, torch.ones(out.values().shape[0], dtype=torch.long))
    return lambda: L.sft_loss(None, {"log_probs": _other_boundaries(data, out.values())}, data)


def _agg(**kwargs):
    kwargs.setdefault("loss_agg_mode", "token-mean")
    return lambda: L.agg_loss(torch.ones(2, 3), torch.ones(2, 3), **kwargs)


def _policy(**kwargs):
    z = torch.zeros(2, 3)
    return lambda: L.compute_policy_loss(z, z, z, torch.ones(2, 3), **kwargs)


def _micro():
    return probe_batch(VOCAB, (3, 2, 4))


def _inputs(**kwargs):
    micro = _micro()
    return lambda: prepare_model_inputs(micro, **kwargs)


def _from_batch_temperature(value):
    micro = dict(_micro(), temperature=value)
    return lambda: prepare_model_inputs(micro)


def _token_lp(temperature=1.0, **kwargs):
    logits, labels = torch.randn(4, 7), torch.tensor([1, 2, 3, 4])
    kwargs = {"logits": logits, "labels": labels, "temperature": temperature, **kwargs}
    return lambda: token_log_probs(**kwargs)


def _padded(temperature=1.0, **kwargs):
    td = make_padded_batch(3, 4, 3, seed=1)
    return lambda: padded_logprobs(None, td, temperature, **kwargs)


def _packed(**kwargs):
    micro = _micro()
    return lambda: packed_logprobs(None, micro, **kwargs)


def _thd_pre(**kwargs):
    ids = _micro()["input_ids"]
    return lambda: preprocess_thd(ids, **kwargs)


# (kind, id, call, words of the message). Every error is a ValueError.
CATALOGUE = [
    # -- values that poison silently: they gave NaN, a sum for a mean, or a plausible wrong number
    ("poison", "temperature-nan", _inputs(temperature=NAN), r"temperature: expected a finite number > 0, got nan"),
    ("poison", "temperature-inf", _inputs(temperature=INF), r"temperature: expected a finite number > 0, got inf"),
    ("poison", "temperature-minus-inf", _inputs(temperature=-INF), r"temperature: expected a finite number > 0"),
    ("poison", "temperature-0", _inputs(temperature=0.0), r"temperature: expected a number > 0, got 0.0"),
    ("poison", "temperature-negative", _inputs(temperature=-1.0), r"temperature: expected a number > 0, got -1.0"),
    (
        "poison",
        "temperature-row-nan",
        _inputs(temperature=torch.tensor([1.0, NAN, 1.0])),
        r"temperature row 1: expected a finite number > 0, got nan",
    ),
    (
        "poison",
        "temperature-row-inf",
        _inputs(temperature=torch.tensor([1.0, 1.0, INF])),
        r"temperature row 2: expected a finite number > 0, got inf",
    ),
    (
        "poison",
        "temperature-row-0",
        _inputs(temperature=torch.tensor([0.0, 1.0, 1.0])),
        r"temperature row 0: expected a finite number > 0, got 0.0",
    ),
    (
        "poison",
        "temperature-0d-nan",
        _inputs(temperature=torch.tensor(NAN)),
        r"temperature row 0: expected a finite number > 0, got nan",
    ),
    (
        "poison",
        "batch-temperature-nan",
        _from_batch_temperature(NAN),
        r"temperature: expected a finite number > 0, got nan",
    ),
    ("poison", "token-log-probs-nan", _token_lp(NAN), r"temperature: expected a finite number > 0, got nan"),
    (
        "poison",
        "token-log-probs-row-negative",
        _token_lp(torch.tensor([1.0, 1.0, -2.0, 1.0])),
        r"temperature row 2: expected a finite number > 0, got -2.0",
    ),
    ("poison", "padded-temperature-inf", _padded(INF), r"temperature: expected a finite number > 0, got inf"),
    (
        "poison",
        "padded-temperature-row-nan",
        _padded(torch.tensor([1.0, 1.0, NAN])),
        r"temperature row 2: expected a finite number > 0, got nan",
    ),
    ("poison", "batch-num-tokens-0", _ppo(batch_num_tokens=0), r"batch_num_tokens: expected an int >= 1, got 0"),
    ("poison", "batch-num-tokens-negative", _ppo(batch_num_tokens=-5), r"batch_num_tokens: expected an int >= 1"),
    ("poison", "batch-num-tokens-nan", _ppo(batch_num_tokens=NAN), r"batch_num_tokens: expected an int >= 1, got nan"),
    (
        "poison",
        "batch-num-tokens-float",
        _ppo(batch_num_tokens=7.5),
        r"batch_num_tokens: expected an int >= 1, got 7.5",
    ),
    (
        "poison",
        "batch-num-tokens-bool",
        _ppo(batch_num_tokens=True),
        r"batch_num_tokens: expected an int >= 1, got True",
    ),
    ("poison", "batch-num-tokens-str", _ppo(batch_num_tokens="7"), r"batch_num_tokens: expected an int >= 1, got '7'"),
    (
        "poison",
        "global-batch-size-0",
        _ppo({"loss_agg_mode": "seq-mean-token-sum"}, global_batch_size=0),
        r"global_batch_size: expected an int >= 1, got 0",
    ),
    (
        "poison",
        "batch-num-tokens-per-row-tensor",
        _agg(batch_num_tokens=torch.tensor([7, 7])),
        r"batch_num_tokens: expected an int >= 1 or a 0-d tensor, got a tensor of shape \(2,\)",
    ),
    (
        "poison",
        "batch-num-tokens-bool-tensor",
        _agg(batch_num_tokens=torch.tensor(True)),
        r"batch_num_tokens: expected a tensor of real numbers \(float or int\), got dtype torch.bool",
    ),
    ("poison", "dp-size-0", _ppo(dp_size=0), r"dp_size: expected an int >= 1, got 0"),
    ("poison", "loss-scale-factor-0", _agg(loss_scale_factor=0), r"loss_scale_factor: expected a number > 0, got 0"),
    (
        "poison",
        "loss-scale-factor-nan",
        _agg(loss_scale_factor=NAN),
        r"loss_scale_factor: expected a finite number > 0, got nan",
    ),
    # -- flags: every boolean is a real bool ("false" is truthy)
    ("flag", "use-kl-loss-str", _ppo({"use_kl_loss": "false"}), r"config.use_kl_loss: expected True or False"),
    ("flag", "use-kl-loss-int", _ppo({"use_kl_loss": 1}), r"config.use_kl_loss: expected True or False \(a bool\)"),
    (
        "flag",
        "use-kl-loss-attribute",
        _ppo(SimpleNamespace(use_kl_loss="no")),
        r"config.use_kl_loss: expected True or False \(a bool\), got 'no' \(str\)",
    ),
    ("flag", "with-entropy-str", _token_lp(with_entropy="False"), r"with_entropy: expected True or False"),
    ("flag", "calculate-entropy-int", _packed(calculate_entropy=0), r"calculate_entropy: expected True or False"),
    ("flag", "need-roll-str", _thd_pre(need_roll="false"), r"need_roll: expected True or False"),
    ("flag", "use-fp8-padding-none", _thd_pre(use_fp8_padding=None), r"use_fp8_padding: expected True or False"),
    # -- string options: one of the documented values
    (
        "option",
        "loss-agg-mode",
        _ppo({"loss_agg_mode": "mean"}),
        r"config.loss_agg_mode: expected one of \['token-mean'",
    ),
    ("option", "loss-agg-mode-none", _agg(loss_agg_mode=None), r"loss_agg_mode: expected one of .*, got None"),
    ("option", "kl-loss-type", _ppo({"kl_loss_type": "k4"}), r"config.kl_loss_type: expected one of \['k1'"),
    ("option", "kl-loss-type-int", _ppo({"kl_loss_type": 3}), r"config.kl_loss_type: expected one of .*, got 3"),
    ("option", "attention", _packed(attention="flash"), r"attention: expected one of \['auto', 'flash_attn'"),
    ("option", "attention-empty", _packed(attention=""), r"attention: expected one of .*, got ''"),
    ("option", "attn-implementation", _inputs(attn_implementation=2), r"attn_implementation: expected None or a name"),
    # -- ratios and coefficients: finite and in range
    ("range", "clip-ratio-nan", _ppo({"clip_ratio": NAN}), r"config.clip_ratio: expected a finite number in \[0, 1\]"),
    ("range", "clip-ratio-negative", _policy(clip_ratio=-0.1), r"clip_ratio: expected a number in \[0, 1\], got -0.1"),
    ("range", "clip-ratio-low-above-1", _policy(clip_ratio_low=1.5), r"clip_ratio_low: expected a number in \[0, 1\]"),
    ("range", "clip-ratio-high-inf", _policy(clip_ratio_high=INF), r"clip_ratio_high: expected a finite number >= 0"),
    ("range", "clip-ratio-str", _policy(clip_ratio="0.2"), r"clip_ratio: expected a finite number in \[0, 1\]"),
    ("range", "clip-ratio-c-1", _policy(clip_ratio_c=1.0), r"clip_ratio_c: expected a finite dual-clip bound > 1"),
    ("range", "clip-ratio-c-inf", _policy(clip_ratio_c=INF), r"clip_ratio_c: expected a finite dual-clip bound > 1"),
    ("range", "clip-ratio-c-nan", _ppo({"clip_ratio_c": NAN}), r"config.clip_ratio_c: expected a finite dual-clip"),
    (
        "range",
        "entropy-coeff-nan",
        _ppo({"entropy_coeff": NAN}),
        r"config.entropy_coeff: expected a finite number >= 0",
    ),
    ("range", "entropy-coeff-negative", _ppo({"entropy_coeff": -0.1}), r"config.entropy_coeff: expected a number >= 0"),
    ("range", "kl-loss-coef-inf", _ppo({"kl_loss_coef": INF}), r"config.kl_loss_coef: expected a finite number >= 0"),
    ("range", "kl-loss-coef-str", _ppo({"kl_loss_coef": "0.1"}), r"config.kl_loss_coef: expected a finite number"),
    ("range", "cliprange-value-nan", _ppo({"cliprange_value": NAN}), r"config.cliprange_value: expected a finite"),
    (
        "range",
        "value-loss-cliprange-negative",
        lambda: L.compute_value_loss(*(torch.zeros(2, 3),) * 3, torch.ones(2, 3), -0.5),
        r"cliprange_value: expected a number >= 0, got -0.5",
    ),
    (
        "range",
        "config-loss-scale-factor-negative",
        _ppo({"loss_scale_factor": -2.0}),
        r"config.loss_scale_factor: expected a number > 0",
    ),
    ("range", "leak-atol-nan", lambda: check_isolation(None, atol=NAN), r"atol: expected a finite number >= 0"),
    (
        "range",
        "leak-alone-atol-negative",
        lambda: check_isolation(None, alone_atol=-1.0),
        r"alone_atol: expected a number >= 0, got -1.0",
    ),
    ("args", "leak-alone-not-bool", lambda: check_isolation(None, alone="yes"), r"alone: expected True or False"),
    # -- shapes and dtypes
    (
        "shape",
        "temperature-2d",
        _inputs(temperature=torch.ones(3, 1)),
        r"temperature: expected a float, a 0-d tensor or a \(3,\) per-sample tensor, got shape \(3, 1\)",
    ),
    ("shape", "temperature-short", _inputs(temperature=torch.ones(2)), r"expected .* a \(3,\) per-sample tensor"),
    (
        "shape",
        "temperature-bool",
        _inputs(temperature=torch.ones(3, dtype=torch.bool)),
        r"temperature: expected a tensor of real numbers \(float or int\), got dtype torch.bool",
    ),
    (
        "shape",
        "temperature-complex",
        _inputs(temperature=torch.ones(3, dtype=torch.complex64)),
        r"temperature: expected a tensor of real numbers",
    ),
    (
        "shape",
        "temperature-bool-float",
        _inputs(temperature=True),
        r"temperature: expected a finite number > 0, got True",
    ),
    ("shape", "temperature-str", _inputs(temperature="0.7"), r"temperature: expected a finite number > 0, got '0.7'"),
    (
        "shape",
        "token-log-probs-temperature-shape",
        _token_lp(torch.ones(3)),
        r"temperature: expected a float, a 0-d tensor or a \(4,\) per-sample tensor",
    ),
    (
        "shape",
        "token-log-probs-int-logits",
        _token_lp(logits=torch.ones(4, 7, dtype=torch.long)),
        r"logits: expected a floating-point tensor, got dtype torch.int64",
    ),
    (
        "shape",
        "token-log-probs-float-labels",
        _token_lp(labels=torch.ones(4)),
        r"labels: expected token ids \(an integer tensor\), got dtype torch.float32",
    ),
    (
        "shape",
        "padded-temperature-shape",
        _padded(torch.ones(2)),
        r"temperature: expected a float, a 0-d tensor or a \(3,\) per-sample tensor",
    ),
    (
        "shape",
        "log-probs-int",
        _ppo_output(lambda data, v: _on_batch_offsets(data, v.long())),
        r"model_output\['log_probs'\]: expected a floating-point tensor, got dtype torch.int64",
    ),
    (
        "shape",
        "advantages-bool",
        _ppo_field("advantages", torch.ones(4, 4, dtype=torch.bool)),
        r"data\['advantages'\]: expected a floating-point tensor, got dtype torch.bool",
    ),
    (
        "shape",
        "kl-penalty-int",
        lambda: L.kl_penalty(torch.zeros(3, dtype=torch.long), torch.zeros(3), "k1"),
        r"logprob: expected a floating-point tensor",
    ),
    (
        "shape",
        "response-mask-list",
        lambda: L.compute_policy_loss(*(torch.zeros(2, 3),) * 3, [[1, 1, 1]] * 2),
        r"response_mask: expected a padded \(dense\) tensor of 0/1 per token, got list",
    ),
    ("shape", "model-output-list", lambda: L.ppo_loss(None, [1.0], _batch()[0]), r"model_output: expected a dict"),
    ("shape", "data-list", lambda: L.ppo_loss(None, {}, [1.0]), r"data: expected the micro batch as a TensorDict"),
    # -- outputs that do not belong to the batch: same total, other boundaries
    (
        "foreign",
        "ppo-other-boundaries",
        _ppo_output(_other_boundaries),
        r"model_output\['log_probs'\]: expected the sequence boundaries of data\['input_ids'\] .*"
        r"offsets \[0, 7, 9, 11, 16\], got offsets \[0, 6, 9, 11, 16\]",
    ),
    (
        "foreign",
        "sft-other-boundaries",
        _sft_other_boundaries(),
        r"model_output\['log_probs'\]: expected the sequence boundaries of data\['loss_mask'\]",
    ),
    # -- metadata the way verl writes it
    (
        "metadata",
        "figure-rows-differ",
        _ppo(batch_num_tokens=NonTensorStack(*(NonTensorData(n) for n in (7, 7, 8, 7)))),
        r"data\['batch_num_tokens'\]: expected one value for the whole micro batch .*"
        r"got 4 rows that differ: \[7, 7, 8, 7\]",
    ),
    (
        "metadata",
        "dp-size-rows-differ",
        _ppo(dp_size=NonTensorStack(*(NonTensorData(n) for n in (1, 2, 1, 1)))),
        r"data\['dp_size'\]: expected one value",
    ),
    (
        "metadata",
        "temperature-rows-differ",
        _from_batch_temperature([0.5, 1.0, 0.5]),
        r"data\['temperature'\]: expected one value .*store per-row values as a \(batch,\) tensor",
    ),
    # -- other arguments
    ("args", "rows-per-forward-0", _padded(rows_per_forward=0), r"rows_per_forward: expected an int >= 1, got 0"),
    ("args", "rows-per-forward-float", _padded(rows_per_forward=1.5), r"rows_per_forward: expected an int >= 1"),
    (
        "args",
        "padded-missing-key",
        lambda: padded_logprobs(None, make_padded_batch(2, 3, 3).exclude("position_ids")),
        r"padded\['position_ids'\]: expected a padded \(batch, ...\) tensor, got missing",
    ),
    ("args", "pad-to-multiple-float", _inputs(pad_to_multiple=2.5), r"pad_to_multiple: expected an int >= 1, got 2.5"),
    ("args", "pad-token-id-negative", _inputs(pad_token_id=-100), r"pad_token_id: expected an int >= 0, got -100"),
    ("args", "sp-size-0", _inputs(sp_size=0), r"sp_size: expected an int >= 1, got 0"),
    ("args", "sp-rank-out-of-range", _inputs(sp_size=1, sp_rank=1), r"sp_rank: expected an int in \[0, 0\], got 1"),
    ("args", "probe-vocab-0", lambda: probe_batch(0), r"vocab_size: expected an int >= 1, got 0"),
    ("args", "probe-length-0", lambda: probe_batch(VOCAB, (3, 0)), r"lengths: expected an int >= 1, got 0"),
    ("args", "probe-position-rows", lambda: probe_batch(VOCAB, position_rows=2), r"position_rows: expected 1, 3 or 4"),
    (
        "args",
        "leak-changed-sequence-bool",
        lambda: check_isolation(None, changed_sequence=True),
        r"changed_sequence: expected an int >= 0, got True",
    ),
    (
        "args",
        "postprocess-nested-output",
        lambda: postprocess_thd(_micro()["input_ids"], None, _micro()["input_ids"]),
        r"output: expected the model's dense \(1, T/cp, ...\) output, got a nested tensor",
    ),
    (
        "args",
        "postprocess-plan-type",
        lambda: postprocess_thd(torch.zeros(1, 9), None, _micro()["input_ids"], plan="zigzag"),
        r"plan: expected the ThdPlan that sharded the batch, or None, got str",
    ),
]


def _agg_mask(mask):
    return lambda: L.agg_loss(torch.ones(1, 3), torch.tensor(mask), "token-sum")


def _ppo_mask(times):
    data, out = _batch()
    data["response_mask"] = data["response_mask"] * times
    return lambda: L.ppo_loss(None, {"log_probs": out}, data)


def _mask_on_padding(loss):
    """Every response slot marked, padding included (row 1 holds one response token of 4)."""
    data, out = _batch()
    data["response_mask"] = torch.ones_like(data["response_mask"])
    data["values"] = data["returns"] = torch.zeros(data["response_mask"].shape)
    return lambda: loss(None, {"log_probs": out, "values": out}, data)


PADDING_MARKED = (
    r"data\['response_mask'\] row 1: expected 1s on response tokens only \(not on padding\), got a 1 at "
    r"response position 1, where attention_mask has padding"
)


def _sft_mask_of_twos():
    data, out = _batch()
    data["loss_mask"] = _on_batch_offsets(data, torch.full((out.values().shape[0],), 2))
    return lambda: L.sft_loss(None, {"log_probs": out}, data)


# issue 22: configs that lose a key, masks that are not 0/1, widths of the wrong type
CATALOGUE += [
    (
        "config",
        "from-any-misspelt-key",
        _ppo({"clip_ratio_hgih": 0.3}),
        r"config key 'clip_ratio_hgih': expected 'clip_ratio_high' \(a near-miss would be ignored\)",
    ),
    (
        "config",
        "from-any-key-in-capitals",
        _ppo({"Loss_Agg_Mode": "seq-mean-token-sum"}),
        r"config key 'Loss_Agg_Mode': expected 'loss_agg_mode'",
    ),
    (
        "config",
        "from-any-misspelt-attribute",
        _ppo(SimpleNamespace(entropy_coef=0.1)),
        r"config key 'entropy_coef': expected 'entropy_coeff'",
    ),
    (
        "config",
        "from-any-list",
        lambda: L.LossConfig.from_any([0.2, 0.3]),
        r"config: expected a LossConfig, a dict or a config object with its fields \(verl's ActorConfig\), "
        r"got list \[0.2, 0.3\]",
    ),
    (
        "config",
        "from-any-string",
        lambda: L.LossConfig.from_any("token-mean"),
        r"config: expected a LossConfig, a dict .*got str 'token-mean'",
    ),
    (
        "config",
        "from-any-policy-loss-string",
        lambda: L.LossConfig.from_any({"policy_loss": "gspo"}),
        r"config.policy_loss: expected a config with loss_mode \('vanilla'\), got 'gspo'",
    ),
    ("mask", "agg-mask-2", _agg_mask([[2, 1, 0]]), r"loss_mask row 0: expected a 0/1 mask .*got 2"),
    ("mask", "agg-mask-half", _agg_mask([[0.5, 1.0, 0.0]]), r"loss_mask row 0: expected a 0/1 mask .*got 0.5"),
    ("mask", "agg-mask-minus-1", _agg_mask([[-1, 1, 0]]), r"loss_mask row 0: expected a 0/1 mask .*got -1"),
    ("mask", "agg-mask-nan", _agg_mask([[NAN, 1.0, 0.0]]), r"loss_mask row 0: expected a 0/1 mask .*got nan"),
    (
        "mask",
        "policy-mask-2",
        lambda: L.compute_policy_loss(*(torch.zeros(1, 3),) * 3, torch.tensor([[2, 1, 0]])),
        r"response_mask row 0: expected a 0/1 mask \(bool, or numbers that are only 0 and 1: a weight is not a "
        r"mask\), got 2",
    ),
    (
        "mask",
        "value-mask-minus-1",
        lambda: L.compute_value_loss(*(torch.zeros(1, 3),) * 3, torch.tensor([[-1, 1, 0]]), 0.5),
        r"response_mask row 0: expected a 0/1 mask .*got -1",
    ),
    (
        "mask",
        "global-batch-info-half",
        lambda: L.global_batch_info(torch.full((2, 3), 0.5)),
        r"response_mask row 0: expected a 0/1 mask .*got 0.5",
    ),
    ("mask", "ppo-response-mask-2", _ppo_mask(2), r"data\['response_mask'\] row 0: expected a 0/1 mask .*got 2"),
    ("mask", "ppo-response-mask-minus", _ppo_mask(-1), r"data\['response_mask'\] row 0: expected a 0/1 mask"),
    ("mask", "sft-loss-mask-2", _sft_mask_of_twos(), r"data\['loss_mask'\]: expected a 0/1 mask .*got 2"),
    # issue 36: a response mask marking padding counted the padded slots' 0 log-probs as tokens
    ("mask", "ppo-response-mask-on-padding", _mask_on_padding(L.ppo_loss), PADDING_MARKED),
    ("mask", "value-response-mask-on-padding", _mask_on_padding(L.value_loss), PADDING_MARKED),
    ("mask", "sft-response-mask-on-padding", _mask_on_padding(L.sft_loss), PADDING_MARKED),
]


def test_the_catalogue_has_one_case_per_id():
    ids = [case[1] for case in CATALOGUE]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(("kind", "call", "words"), [c[0:1] + c[2:] for c in CATALOGUE], ids=[c[1] for c in CATALOGUE])
def test_bad_input_is_refused_saying_what_to_fix(kind, call, words):
    with pytest.raises(ValueError, match=words):
        call()


# ---- metadata: every form verl writes reads alike ---------------------------------------------
def _all_forms(value, rows=4):
    """``value`` as verl may leave it in a micro batch of ``rows`` rows."""
    return {
        "plain": value,
        "NonTensorData": NonTensorData(value),
        "NonTensorStack": NonTensorStack(*(NonTensorData(value) for _ in range(rows))),
        "list": [value] * rows,
    }


@pytest.mark.parametrize("form", ["NonTensorData", "NonTensorStack", "list", "absent"])
@pytest.mark.parametrize("figure", ["batch_num_tokens", "global_batch_size", "dp_size"])
def test_a_figure_given_as_none_reads_as_missing_in_every_form(figure, form):
    """tensordict 0.10 and 0.15 read ``NonTensorData(None)`` as a LinkedList of Nones: still missing."""
    data, out = _batch()
    expected = L.ppo_loss({"loss_agg_mode": "seq-mean-token-mean"}, {"log_probs": out}, data)[0]
    if form == "absent":
        assert get_field(data, figure, "default") == "default"
        return
    value = _all_forms(None)[form]
    data[figure] = NonTensorData(value) if form == "list" else value
    assert get_field(data, figure, "default") == "default"
    loss = L.ppo_loss({"loss_agg_mode": "seq-mean-token-mean"}, {"log_probs": out}, data)[0]
    assert torch.equal(loss, expected)


@pytest.mark.parametrize("form", ["NonTensorData", "NonTensorStack", "dict-plain", "dict-list"])
def test_a_figure_with_equal_rows_reads_as_its_value(form):
    data, out = _batch()
    reference = data.clone()
    reference.set_non_tensor("batch_num_tokens", 11)
    expected = L.ppo_loss(None, {"log_probs": out}, reference)[0]
    if form.startswith("dict"):
        batch = dict(data.items())
        batch["batch_num_tokens"] = 11 if form == "dict-plain" else [11] * 4
        assert get_field(batch, "batch_num_tokens") == 11
        return
    data["batch_num_tokens"] = _all_forms(11)[form]
    assert get_field(data, "batch_num_tokens") == 11
    assert torch.equal(L.ppo_loss(None, {"log_probs": out}, data)[0], expected)


def test_a_stack_of_differing_rows_names_the_key_under_get_field():
    with pytest.raises(ValueError, match=r"data\['x'\]: expected one value .*got 3 rows that differ: \[1, 2, 1\]"):
        get_field({"x": [1, 2, 1]}, "x")
    with pytest.raises(ValueError, match=r"got 2 rows that differ: \[1, True\]"):
        get_field({"x": [1, True]}, "x")  # True is not the figure 1
    assert math.isnan(get_field({"x": [NAN, NAN]}, "x"))
    assert get_field({"x": [np.int64(3), 3]}, "x") == 3


# ---- hypothesis: one field off --------------------------------------------------------------
VALID_CONFIG = dict(
    clip_ratio=0.2,
    clip_ratio_low=0.2,
    clip_ratio_high=0.28,
    clip_ratio_c=3.0,
    loss_agg_mode="token-mean",
    entropy_coeff=0.01,
    use_kl_loss=True,
    kl_loss_type="low_var_kl",
    kl_loss_coef=0.001,
    cliprange_value=0.5,
    loss_scale_factor=4.0,
)
NOT_FINITE = st.sampled_from([NAN, INF, -INF])
NOT_NUMBERS = st.sampled_from(["0.2", None, True, False, [0.2], torch.tensor(0.2)])
BAD_VALUES = {
    "clip_ratio": NOT_FINITE | st.floats(max_value=-1e-9) | st.floats(min_value=1.0001, max_value=1e9),
    "clip_ratio_low": NOT_FINITE | NOT_NUMBERS.filter(lambda v: v is not None) | st.floats(1.0001, 1e9),
    "clip_ratio_high": NOT_FINITE | NOT_NUMBERS.filter(lambda v: v is not None) | st.floats(-1e9, -1e-9),
    "clip_ratio_c": NOT_FINITE | NOT_NUMBERS | st.floats(-1e9, 1.0),
    "loss_agg_mode": st.sampled_from(["token_mean", "mean", "", "TOKEN-MEAN", 1, None, ("token-mean",)]),
    "entropy_coeff": NOT_FINITE | NOT_NUMBERS.filter(lambda v: v is not None) | st.floats(-1e9, -1e-9),
    "use_kl_loss": st.sampled_from(["false", "true", "False", 0, 1, 0.0, "", [], np.int64(1)]),
    "kl_loss_type": st.sampled_from(["k4", "kl+-", "K1", "", 3, "low-var-kl"]),
    "kl_loss_coef": NOT_FINITE | NOT_NUMBERS.filter(lambda v: v is not None) | st.floats(-1e9, -1e-9),
    "cliprange_value": NOT_FINITE | NOT_NUMBERS.filter(lambda v: v is not None) | st.floats(-1e9, -1e-9),
    "loss_scale_factor": NOT_FINITE | NOT_NUMBERS.filter(lambda v: v is not None) | st.floats(-1e9, 0.0),
}
BAD_FIGURES = st.sampled_from([0, -1, -(2**40), NAN, INF, 2.5, 7.0, True, "7", torch.tensor([7, 7])])
CONFIG_FORMS = st.sampled_from(["dict", "namespace", "dataclass-set-after"])


@given(field=st.sampled_from(sorted(BAD_VALUES)), data=st.data(), form=CONFIG_FORMS)
@settings(max_examples=150, deadline=None)
def test_a_config_with_one_field_off_is_refused_naming_it(field, data, form):
    bad = data.draw(BAD_VALUES[field], label=field)
    batch, out = _batch()
    valid = dict(VALID_CONFIG)
    if field == "clip_ratio":  # make it the value in use: clip_ratio counts where low/high are not given
        valid.pop("clip_ratio_low")
    fields = {**valid, field: bad}
    if form == "dataclass-set-after":
        config = L.LossConfig(**valid)
        setattr(config, field, bad)
    elif form == "namespace":
        config = SimpleNamespace(**fields)
    else:
        config = fields
    if bad is None and form != "dataclass-set-after":
        return  # None means "not given" in a dict or an object: the default applies
    with pytest.raises(ValueError, match=rf"config.{field}"):
        L.ppo_loss(config, {"log_probs": out}, batch)


@given(figure=st.sampled_from(["batch_num_tokens", "global_batch_size", "dp_size"]), bad=BAD_FIGURES)
@settings(max_examples=60, deadline=None)
def test_a_figure_off_is_refused_naming_it(figure, bad):
    data, out = _batch()
    data[figure] = NonTensorData(bad)
    mode = "token-mean" if figure != "global_batch_size" else "seq-mean-token-mean"
    with pytest.raises(ValueError, match=rf"{figure}: expected an int >= 1"):
        L.ppo_loss({"loss_agg_mode": mode}, {"log_probs": out}, data)


@given(
    temps=st.lists(st.floats(0.05, 20.0), min_size=3, max_size=3),
    row=st.integers(0, 2),
    bad=st.sampled_from([NAN, INF, -INF, 0.0, -0.0, -1.0, -1e-30]),
)
@settings(max_examples=60, deadline=None)
def test_a_temperature_tensor_with_one_row_off_is_refused_naming_the_row(temps, row, bad):
    temperature = torch.tensor(temps)
    temperature[row] = bad
    before = temperature.clone()
    with pytest.raises(ValueError, match=rf"temperature row {row}: expected a finite number > 0"):
        prepare_model_inputs(_micro(), temperature=temperature)
    torch.testing.assert_close(temperature, before, rtol=0, atol=0, equal_nan=True)  # untouched


BATCH_OFFSETS = [0, 7, 9, 11, 16]  # the four sequences of _batch(): 7, 2, 2 and 5 tokens


@st.composite
def other_boundaries(draw):
    """Offsets of four sequences with the batch's total of 16 tokens (sometimes the batch's own)."""
    if draw(st.booleans()):
        return list(BATCH_OFFSETS)
    cuts = sorted(draw(st.lists(st.integers(0, 16), min_size=3, max_size=3)))
    return [0, *cuts, 16]


@given(offsets=other_boundaries())
@settings(max_examples=60, deadline=None)
def test_an_output_in_other_boundaries_is_refused_and_in_equal_ones_gives_the_same_loss(offsets):
    data, out = _batch()
    assert data["input_ids"].offsets().tolist() == BATCH_OFFSETS
    moved = torch.nested.nested_tensor_from_jagged(out.values(), torch.tensor(offsets))
    if offsets == BATCH_OFFSETS:
        expected = L.ppo_loss(None, {"log_probs": _on_batch_offsets(data, out.values())}, data)[0]
        assert torch.equal(L.ppo_loss(None, {"log_probs": moved}, data)[0], expected)
        return
    with pytest.raises(ValueError, match=r"expected the sequence boundaries of data\['input_ids'\]"):
        L.ppo_loss(None, {"log_probs": moved}, data)


# ---- valid edges: exact results, inputs untouched ---------------------------------------------
def _snapshot(x):
    if isinstance(x, torch.Tensor):
        if x.is_nested:
            return ("nested", x.values().clone(), x.offsets().clone())
        return x.clone()
    if isinstance(x, TensorDict):
        tensors = {k: _snapshot(v) for k, v in x.items() if isinstance(v, torch.Tensor)}
        metadata = {
            k: list(x.get_non_tensor(k)) if k not in tensors and _is_list(x.get_non_tensor(k)) else None
            for k in x.keys()
        }
        metadata = {
            k: copy.deepcopy(x.get_non_tensor(k)) if v is None and k not in tensors else v for k, v in metadata.items()
        }
        return tensors, metadata
    if isinstance(x, dict):
        return {k: _snapshot(v) for k, v in x.items()}
    return copy.deepcopy(x)


def _is_list(x):
    return type(x).__name__ == "LinkedList"


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and a and a[0] == "nested":
        return all(_same(x, y) for x, y in zip(a[1:], b[1:], strict=True))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)


@pytest.mark.parametrize("loss_fn", [L.ppo_loss, L.value_loss, L.sft_loss], ids=["ppo", "value", "sft"])
def test_the_losses_never_mutate_their_input(loss_fn):
    data, out = _batch()
    data.set_non_tensor("batch_num_tokens", 9)
    data.set_non_tensor("global_batch_size", None)
    model_output = {"log_probs": out, "entropy": out.exp(), "values": out}
    before = _snapshot(data), _snapshot(model_output)
    config = L.LossConfig(use_kl_loss=True, entropy_coeff=0.1, loss_agg_mode="seq-mean-token-sum-norm")
    loss_fn(config, model_output, data)
    assert _same(before, (_snapshot(data), _snapshot(model_output)))


def test_temperature_checks_never_mutate_and_valid_forms_give_the_float_result_exactly():
    micro = _micro()
    expected = prepare_model_inputs(micro, temperature=0.5)[1]
    logits = torch.randn(1, expected.labels.shape[0], VOCAB)
    from nopad.engines import prepare_model_outputs

    reference = prepare_model_outputs(logits, expected)["log_probs"].values()
    for temperature in (np.float32(0.5), np.float64(0.5), torch.tensor(0.5), torch.full((3,), 0.5)):
        kept = copy.deepcopy(temperature)
        args = prepare_model_inputs(micro, temperature=temperature)[1]
        got = prepare_model_outputs(logits, args)["log_probs"].values()
        assert torch.equal(got, reference), repr(temperature)
        assert _same(_snapshot(kept), _snapshot(temperature))
    integer = prepare_model_inputs(micro, temperature=torch.tensor([1, 2, 1]))[1].temperature
    assert integer.dtype == torch.float32 and integer.unique().tolist() == [1.0, 2.0]
    assert prepare_model_inputs(micro, temperature=1)[1].temperature == 1.0


def test_valid_edge_configs_and_figures_give_exact_results():
    data, out = _batch()
    plain = L.ppo_loss({"use_kl_loss": True, "clip_ratio_c": 1.0001}, {"log_probs": out}, data)[0]
    numpy_forms = {"use_kl_loss": np.bool_(True), "clip_ratio_c": np.float64(1.0001)}
    assert torch.equal(L.ppo_loss(numpy_forms, {"log_probs": out}, data)[0], plain)
    for low, high in ((0.0, 0.0), (1.0, 10.0)):  # the ends of the clip ranges are valid
        L.ppo_loss({"clip_ratio_low": low, "clip_ratio_high": high}, {"log_probs": out}, data)
    data.set_non_tensor("batch_num_tokens", np.int64(3))
    by_numpy = L.ppo_loss(None, {"log_probs": out}, data)[0]
    data.set_non_tensor("batch_num_tokens", 3)
    assert torch.equal(by_numpy, L.ppo_loss(None, {"log_probs": out}, data)[0])
    data.set_non_tensor("batch_num_tokens", 1)  # the smallest figure is valid
    L.ppo_loss(None, {"log_probs": out}, data)


def test_a_tensor_figure_is_not_read_and_one_below_one_makes_the_loss_nan_not_a_sum(device_path):
    mat, mask = torch.ones(2, 3), torch.ones(2, 3)
    with OpCounter() as counter:
        good = L.agg_loss(mat, mask, "token-mean", batch_num_tokens=torch.tensor(3))
        bad = L.agg_loss(mat, mask, "token-mean", batch_num_tokens=torch.tensor(0))
    assert counter.syncs == 0
    assert good.item() == 2.0 and math.isnan(bad.item())


def test_device_values_are_not_read_and_a_bad_one_turns_the_result_nan():
    """On a device neither a temperature tensor nor another offsets tensor is read (the meta device
    stands in: any read there would raise); on the CPU the same check is a refusal."""
    logits, labels = torch.randn(4, 7, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")
    with OpCounter() as counter:
        token_log_probs(logits, labels, torch.ones(4, device="meta"), with_entropy=True)
    assert counter.syncs == 0
    # the same guard on real values: a NaN temperature row gives NaN for that row only, never a number
    from nopad.modeling._logprobs import logits_log_probs as _log_probs

    temps = torch.where(torch.tensor([True, False, True, True]), torch.ones(4), NAN)
    lp, ent = _log_probs(torch.randn(4, 7), torch.tensor([1, 2, 3, 4]), temps, True)
    assert lp.isnan().tolist() == [False, True, False, False] and ent.isnan().tolist() == lp.isnan().tolist()
    data, out = _batch()
    assert L._same_boundaries(out, "x", data["input_ids"], "y") is None  # equal on the CPU: nothing left to do

    def on_meta():
        offsets = torch.tensor(BATCH_OFFSETS, device="meta")
        return torch.nested.nested_tensor_from_jagged(torch.zeros(16, device="meta"), offsets)

    output, batch_ids = on_meta(), on_meta()
    with OpCounter() as counter:
        flag = L._same_boundaries(output, "x", batch_ids, "y")
    assert counter.syncs == 0 and flag.device.type == "meta"  # a device flag the loss folds in
    assert L._poison_unless(torch.tensor(False), torch.ones(2)).isnan().all()
    assert torch.equal(L._poison_unless(torch.tensor(True), torch.ones(2)), torch.ones(2))


# ---- issue 22: masks, configs and checks made once -------------------------------------------------
def test_a_0_1_mask_of_any_dtype_gives_the_same_loss():
    data, out = _batch()
    want = L.ppo_loss({"use_kl_loss": True}, {"log_probs": out}, data)[0]
    mask = data["response_mask"]
    for dtype in (torch.bool, torch.uint8, torch.int32, torch.float16, torch.float32):
        data["response_mask"] = mask.to(dtype)
        assert torch.equal(L.ppo_loss({"use_kl_loss": True}, {"log_probs": out}, data)[0], want), dtype
    mat = torch.randn(3, 4)
    ones = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    for mode in L.AGG_MODES:
        want = L.agg_loss(mat, ones.bool(), mode)
        for dtype in (torch.int64, torch.float64):
            assert torch.equal(L.agg_loss(mat, ones.to(dtype), mode), want), (mode, dtype)


def test_on_a_device_a_mask_that_is_not_0_1_turns_the_loss_nan_and_is_never_read(device_path):
    """The CPU takes the device's path (device_path): nothing is read, and the loss is NaN, not a sum."""
    data, out = _batch()
    good = L.ppo_loss(None, {"log_probs": out}, data)
    data["response_mask"] = data["response_mask"] * 2
    with OpCounter() as counter:
        bad_loss, bad_metrics = L.ppo_loss(None, {"log_probs": out}, data)
        agg = L.agg_loss(torch.ones(1, 3), torch.tensor([[0.5, 1.0, 0.0]]), "token-mean")
    assert counter.syncs == 0
    assert math.isnan(bad_loss.item()) and math.isnan(agg.item())
    assert all(v.isnan().all() for v in bad_metrics.values()) and not good[0].isnan()


def test_on_a_device_a_response_mask_marking_padding_turns_the_loss_nan_unread(device_path):
    """The padding check costs no sync on a device: folded into the loss (NaN), as the 0/1 check is."""
    data, out = _batch()
    good = L.ppo_loss(None, {"log_probs": out}, data)[0]
    data["response_mask"] = torch.ones_like(data["response_mask"])
    with OpCounter() as counter:
        bad_loss, bad_metrics = L.ppo_loss(None, {"log_probs": out}, data)
    assert counter.syncs == 0 and not good.isnan()
    assert bad_loss.isnan() and all(v.isnan().all() for v in bad_metrics.values())


def test_verl_like_configs_with_other_keys_are_accepted_and_exact():
    data, out = _batch()
    want = L.ppo_loss({"clip_ratio_high": 0.3}, {"log_probs": out}, data)[0]
    verl_like = {"clip_ratio_high": 0.3, "ppo_mini_batch_size": 4, "strategy": "fsdp", "policy_loss": {}}
    assert torch.equal(L.ppo_loss(verl_like, {"log_probs": out}, data)[0], want)
    namespace = SimpleNamespace(clip_ratio_high=0.3, ppo_epochs=1, policy_loss=SimpleNamespace(loss_mode="vanilla"))
    assert torch.equal(L.ppo_loss(namespace, {"log_probs": out}, data)[0], want)


def test_ppo_loss_checks_its_config_and_figures_once(monkeypatch):
    """One check of the config (from_any) and one of the figures for all three aggregations."""
    calls = {"clip": 0, "figures": 0}
    check_clip, checked_figures = L._check_clip, L._checked_figures

    def counting_clip(*args, **kwargs):
        calls["clip"] += 1
        return check_clip(*args, **kwargs)

    def counting_figures(*args, **kwargs):
        calls["figures"] += 1
        return checked_figures(*args, **kwargs)

    config = L.LossConfig(use_kl_loss=True, entropy_coeff=0.1)
    data, out = _batch()
    monkeypatch.setattr(L, "_check_clip", counting_clip)
    monkeypatch.setattr(L, "_checked_figures", counting_figures)
    L.ppo_loss(config, {"log_probs": out, "entropy": out.exp()}, data)
    assert calls == {"clip": 1, "figures": 1}


def test_packed_logprobs_reads_the_micro_batch_temperature_as_prepare_model_inputs_does():
    """It ignored micro["temperature"] (its own default 1.0 won); the padded reference now reads the
    padded batch's the same way, so the two agree on one TensorDict."""
    from nopad.batches import left_right_2_no_padding, no_padding_2_padding
    from tests.models import tiny_llama

    model = tiny_llama()
    padded = make_padded_batch(3, 4, 3, seed=2)
    micro = left_right_2_no_padding(padded)
    with torch.no_grad():
        explicit = packed_logprobs(model, micro, 0.5)
        micro.set_non_tensor("temperature", 0.5)
        from_batch = packed_logprobs(model, micro)
        padded.set_non_tensor("temperature", 0.5)
        reference = padded_logprobs(model, padded)
        plain = packed_logprobs(model, micro, 1.0)
    assert torch.equal(from_batch.values(), explicit.values())
    assert not torch.equal(plain.values(), explicit.values())
    assert (no_padding_2_padding(from_batch, micro) - reference).abs().max() < 1e-5


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_logprobs_with_attention_none_refuses_an_attention_that_builds_masks(implementation):
    """attention=None keeps the model's own attention, which must read packed boundaries: a mask-building
    one keeps sequences apart only where the model builds its masks from the restarting positions, which
    nopad cannot vouch for (Moshi on transformers 5.20 did not), so it is named before any forward."""
    from nopad.batches import left_right_2_no_padding
    from tests.models import tiny_llama

    model = tiny_llama()
    model.config._attn_implementation = implementation
    micro = left_right_2_no_padding(make_padded_batch(3, 4, 3, seed=2))
    with pytest.raises(
        ValueError,
        match=rf"attention: expected an attention implementation that reads packed "
        rf"boundaries for attention=None .*got '{implementation}'",
    ):
        packed_logprobs(model, micro, attention=None)
    assert model.config._attn_implementation == implementation


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (
            lambda: prepare_model_inputs([1, 2]),
            r"data: expected a micro batch: a TensorDict or a dict of fields, got list",
        ),
        (
            lambda: __import__("nopad._apps.bench")._apps.bench.bench_conversions(batch_sizes=(2,), repeats=0),
            r"repeats: expected an int >= 1, got 0",
        ),
    ],
    ids=["micro-batch-a-list", "bench-repeats-0"],
)
def test_weak_messages_of_the_engines_and_the_bench_are_replaced(call, words):
    with pytest.raises(ValueError, match=words):
        call()
