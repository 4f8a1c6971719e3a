"""Bad input to the parallel layouts and the attention back end: THD plans and their way back, CP
sizes, Ulysses sizes, and the boundaries nopad_varlen is handed. One case per bad input (the words
of the message asserted), then valid edges that must be accepted and exact, and the checks made once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nopad.engines import postprocess_thd, preprocess_thd

# private: the CP and THD helpers behind the public shard math get bad input directly
from nopad.modeling._attention import nopad_varlen_attention
from nopad.parallel import _cp as cp_module
from nopad.parallel import _thd as thd_module
from nopad.parallel import padded_length, shard_index, unshard_index
from nopad.parallel._cp import check_cp_args, cp_alignment
from nopad.parallel._thd import ThdPlan


def _ids(*lengths: int) -> torch.Tensor:
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()])
    return torch.nested.nested_tensor_from_jagged(torch.arange(1, int(offsets[-1]) + 1), offsets)


def _postprocess_with_params_of(other: tuple[int, ...], **kwargs):
    """The output and params of one batch, given with another batch of the same totals."""
    ids = _ids(5, 3, 8)
    tokens, _, _ = preprocess_thd(ids, **kwargs)
    _, params, _ = preprocess_thd(_ids(*other), **kwargs)
    return lambda: postprocess_thd(tokens.float(), params, ids)


def _postprocess_with_plan_of(other: tuple[int, ...]):
    ids = _ids(5, 3, 8)
    tokens, params, _ = preprocess_thd(ids)
    return lambda: postprocess_thd(tokens.float(), params, ids, plan=ThdPlan.from_nested(_ids(*other)))


def _attention(cu, max_length=None, length=7):
    class Layer(torch.nn.Module):
        is_causal = True

    q = torch.randn(1, 2, length, 4)
    kwargs = {"cu_seq_lens_q": torch.tensor(cu), "max_length_q": max_length}
    return lambda: nopad_varlen_attention(Layer(), q, q, q, None, **kwargs)


# (kind, id, call, words). Every error is a ValueError.
CATALOGUE = [
    # -- a plan or boundaries that belong to another batch
    (
        "not the batch's",
        "postprocess-params-of-another-batch",
        _postprocess_with_params_of((6, 2, 8), tp_size=2),
        r"packed_seq_params.cu_seqlens_q_padded: expected boundaries from 0 to 18 \(cp_size 1 x the output's "
        r"slots\), got 0..16 \(the params of another batch\?\)",
    ),
    (
        "not the batch's",
        "postprocess-params-same-total-other-segments",
        _postprocess_with_params_of((6, 2, 8)),
        r"packed_seq_params.cu_seqlens_q_padded row 1: expected a padded segment holding the sequence's 3 "
        r"tokens, a multiple of 1, got 2 \(the params of another batch\?\)",
    ),
    (
        "not the batch's",
        "postprocess-plan-of-another-batch",
        _postprocess_with_plan_of((6, 2, 8)),
        r"input_ids: expected this plan's sequence lengths \[6, 2, 8\], got lengths \[5, 3, 8\] \(another batch\?\)",
    ),
    (
        "not the batch's",
        "postprocess-plan-of-another-size",
        _postprocess_with_plan_of((5, 3, 8, 1)),
        r"plan: expected the ThdPlan of this batch and output: 3 sequences, 16 tokens, 16 slots, got 4 sequences",
    ),
    (
        "not the batch's",
        "shard-a-batch-of-other-boundaries",
        lambda: ThdPlan.from_nested(_ids(5, 3, 8)).shard(_ids(6, 2, 8)),
        r"tensor: expected this plan's sequence lengths \[5, 3, 8\], got lengths \[6, 2, 8\] \(another batch\?\)",
    ),
    (
        "not the batch's",
        "varlen-boundaries-short-of-the-row",
        _attention([0, 3, 5]),
        r"cu_seq_lens_q: expected boundaries rising from 0 to the row's 7 tokens, got \[0, 3, 5\]",
    ),
    (
        "not the batch's",
        "varlen-boundaries-past-the-row",
        _attention([0, 3, 9], 6),
        r"cu_seq_lens_q: expected boundaries rising from 0 to the row's 7 tokens, got \[0, 3, 9\]",
    ),
    # issue 36: the public shard math took boundaries it cannot split and local lengths of another batch
    (
        "not the batch's",
        "zigzag-shard-segments-not-multiples-of-2-cp",
        lambda: shard_index(torch.tensor([0, 6, 10]), 5, 2, 0, "zigzag"),
        r"cu_seqlens_padded row 0: expected a padded segment of >= 0 slots, a multiple of 4, got 6",
    ),
    (
        "not the batch's",
        "zigzag-shard-local-length-of-another-batch",
        lambda: shard_index(torch.tensor([0, 8, 12]), 5, 2, 0, "zigzag"),
        r"cu_seqlens_padded: expected boundaries from 0 to 10 \(cp_size 2 x local_len\), got 0..12",
    ),
    (
        "not the batch's",
        "unshard-local-length-of-another-batch",
        lambda: unshard_index(torch.tensor([0, 8, 12]), torch.tensor([7, 3]), 10, 5, 2, "zigzag"),
        r"cu_seqlens_padded: expected boundaries from 0 to 10 \(cp_size 2 x local_len\), got 0..12",
    ),
    (
        "not the batch's",
        "unshard-a-segment-short-of-its-sequence",
        lambda: unshard_index(torch.tensor([0, 8, 12]), torch.tensor([9, 1]), 10, 6, 2, "zigzag"),
        r"cu_seqlens_padded row 0: expected a padded segment holding the sequence's 9 tokens, a multiple of 4, got 8",
    ),
    (
        "not the batch's",
        "unshard-total-not-the-lengths-sum",
        lambda: unshard_index(torch.tensor([0, 8, 12]), torch.tensor([7, 3]), 11, 6, 2, "zigzag"),
        r"total: expected the sum of the lengths, 10, got 11",
    ),
    ("not the batch's", "varlen-boundaries-down", _attention([0, 5, 3, 7]), r"got \[0, 5, 3, 7\]"),
    ("not the batch's", "varlen-boundaries-not-from-0", _attention([1, 3, 7], 4), r"got \[1, 3, 7\]"),
    (
        "reading past a row",
        "varlen-max-length-short",
        _attention([0, 3, 7], 2),
        r"max_length_q: expected the longest sequence, 4 tokens \(a shorter max length cuts it\), got 2",
    ),
    # -- coercions
    (
        "type or coercion",
        "thd-bool-lengths",
        lambda: ThdPlan.from_lengths(torch.tensor([True, True])),
        r"lengths: expected a 1-D tensor or sequence of integers, got dtype torch.bool",
    ),
    (
        "type or coercion",
        "thd-float-source-starts",
        lambda: ThdPlan.from_lengths(torch.tensor([3, 2]), source_starts=torch.tensor([0.0, 3.5]), source_len=8),
        r"source_starts: expected a 1-D tensor or sequence of integers, got dtype torch.float32",
    ),
    (
        "type or coercion",
        "thd-float-source-len",
        lambda: ThdPlan.from_lengths(torch.tensor([3, 2]), source_starts=torch.tensor([0, 3]), source_len=5.5),
        r"source_len: expected an int >= 0, got 5.5",
    ),
    (
        "type or coercion",
        "thd-string-lengths",
        lambda: ThdPlan.from_lengths("abc"),
        r"lengths: expected a 1-D tensor or sequence of integers \(nothing is rounded\), got str",
    ),
    (
        "type or coercion",
        "thd-bucket-true",
        lambda: ThdPlan.from_nested(_ids(3), pad_to_length_bucket=True),
        r"got True",
    ),
    (
        "type or coercion",
        "thd-tp-true",
        lambda: ThdPlan.from_nested(_ids(3), tp_size=True),
        r"tp_size: expected an int >= 1",
    ),
    (
        "type or coercion",
        "cp-alignment-true",
        lambda: cp_alignment(True, 2),
        r"tp_size: expected an int >= 1, got True",
    ),
    (
        "type or coercion",
        "routed-experts-float-count",
        lambda: ThdPlan.from_nested(_ids(3, 2)).shard_routed_experts(torch.zeros(5, 2, dtype=torch.long), 2.5),
        r"num_experts: expected an int >= 1, got 2.5",
    ),
    ("type or coercion", "varlen-float-max-length", _attention([0, 3, 7], 4.5), r"max_length_q: expected an int"),
    (
        "type or coercion",
        "varlen-float-boundaries",
        _attention([0.0, 3.0, 7.0], 4),
        r"cu_seq_lens_q: expected \(sequences \+ 1,\) integer boundaries, got shape \(3,\), dtype torch.float32",
    ),
    # -- flags
    (
        "flag",
        "thd-fp8-padding-string",
        lambda: ThdPlan.from_nested(_ids(3), use_fp8_padding="false"),
        r"use_fp8_padding: expected True or False \(a bool\), got 'false' \(str\)",
    ),
    (
        "flag",
        "shard-need-roll-string",
        lambda: ThdPlan.from_nested(_ids(3)).shard(_ids(3), need_roll="false"),
        r"need_roll: expected True or False \(a bool\), got 'false' \(str\)",
    ),
    # -- weak messages replaced
    (
        "weak message",
        "postprocess-params-none",
        lambda: postprocess_thd(torch.zeros(1, 16), None, _ids(5, 3, 8)),
        r"packed_seq_params: expected the PackedSeqParams of preprocess_thd \(padded cu_seqlens\), got NoneType",
    ),
    (
        "weak message",
        "postprocess-output-of-another-length",
        lambda: postprocess_thd(torch.zeros(1, 5), preprocess_thd(_ids(5, 3, 8))[1], _ids(5, 3, 8)),
        r"packed_seq_params.cu_seqlens_q_padded: expected boundaries from 0 to 5 \(cp_size 1 x the output's slots\)",
    ),
    ("weak message", "padded-length-float-sp", lambda: padded_length(5, 2.5), r"sp_size: expected an int >= 1"),
]


def test_the_catalogue_has_one_case_per_id():
    ids = [case[1] for case in CATALOGUE]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(("kind", "call", "words"), [c[0:1] + c[2:] for c in CATALOGUE], ids=[c[1] for c in CATALOGUE])
def test_bad_input_is_refused_saying_what_to_fix(kind, call, words):
    with pytest.raises(ValueError, match=words):
        call()


# ---- valid edges ---------------------------------------------------------------------------------
def test_numpy_sizes_are_sizes_and_give_the_python_int_result():
    ids = _ids(5, 3, 8)
    want = preprocess_thd(ids, cp_size=2, cp_rank=1, tp_size=2, pad_to_length_bucket=16)
    got = preprocess_thd(
        ids, cp_size=np.int64(2), cp_rank=np.int32(1), tp_size=np.int8(2), pad_to_length_bucket=np.int64(16)
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert got[1].max_seqlen_q == want[1].max_seqlen_q and type(got[1].max_seqlen_q) is int
    assert check_cp_args(np.int64(2), np.int64(4), np.int64(3), "zigzag") == (2, 4, 3, "zigzag")
    assert cp_alignment(np.int64(2), np.int64(4)) == 16
    tokens, params, _ = preprocess_thd(ids, tp_size=np.int64(2))
    out = postprocess_thd(tokens.float(), params, ids, cp_size=np.int64(1), cp_rank=np.int64(0))
    assert torch.equal(out.values().long(), ids.values())


def test_a_plan_and_params_of_this_batch_in_other_tensors_are_accepted_and_exact():
    ids = _ids(5, 3, 8)
    tokens, params, _ = preprocess_thd(ids, tp_size=2)
    want = postprocess_thd(tokens.float(), params, ids)
    same = _ids(5, 3, 8)  # equal offsets, another tensor
    params.cu_seqlens_q_padded = params.cu_seqlens_q_padded.clone()
    assert torch.equal(postprocess_thd(tokens.float(), params, same).values(), want.values())
    plan = ThdPlan.from_nested(same, tp_size=2)
    assert torch.equal(postprocess_thd(tokens.float(), params, ids, plan=plan).values(), want.values())
    assert torch.equal(plan.shard(ids), tokens)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_public_shard_math_of_a_plans_batch_is_the_plans_and_on_a_device_not_read(layout, device_path):
    """shard_index / unshard_index of boundaries the plan made: accepted, the plan's own indices; on the
    device's path bad boundaries are not read (the caller's contract), as the docstrings say."""
    ids = _ids(5, 3, 8)
    plan = ThdPlan.from_nested(ids, cp_size=2, cp_rank=1, cp_layout=layout)
    cu, local = torch.from_numpy(plan.host_cu_seqlens), plan.local_len
    padded = torch.zeros(int(cu[-1]), dtype=torch.long)  # every sequence at its padded segment's start
    for start, values in zip(cu[:-1].tolist(), ids.unbind()):
        padded[start : start + len(values)] = values
    assert torch.equal(padded[shard_index(cu, local, 2, 1, layout)], plan.shard(ids)[0])
    assert torch.equal(unshard_index(cu, torch.tensor([5, 3, 8]), 16, local, 2, layout), plan.unshard_index())
    shard_index(torch.tensor([0, 6, 10]), 5, 2, 0, layout)  # on a device's path: not read


def test_valid_varlen_boundaries_are_accepted_and_on_a_device_with_a_max_length_not_read(device_path):
    _attention([0, 3, 7], 4)()  # valid
    _attention([0, 7], None)()
    # the device path: a given max length means no read, so bad boundaries are the caller's contract ...
    _attention([0, 3, 5], 4)()
    # ... and without one, the read that finds the longest sequence checks them too
    with pytest.raises(ValueError, match=r"cu_seq_lens_q: expected boundaries rising from 0"):
        _attention([0, 3, 5])()


# ---- checked once ---------------------------------------------------------------------------------
def test_a_thd_plan_checks_its_parallel_sizes_once(monkeypatch):
    calls = []
    check = cp_module.check_cp_args

    def counting(*args):
        calls.append(args)
        return check(*args)

    monkeypatch.setattr(thd_module, "check_cp_args", counting)
    monkeypatch.setattr(cp_module, "check_cp_args", counting)
    preprocess_thd(_ids(5, 3, 8), cp_size=2, cp_rank=1)
    ThdPlan.from_lengths(torch.tensor([5, 3, 8]), cp_size=2, cp_rank=1)
    assert len(calls) == 2  # one per plan (before: three, in the constructor, _sizes and cp_alignment)


def test_a_sliding_window_of_0_is_refused_not_turned_into_nan_attention():
    class Layer(torch.nn.Module):
        is_causal = True

    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"sliding_window: expected an int >= 1, got 0"):
        nopad_varlen_attention(Layer(), q, q, q, None, sliding_window=0)
    out, _ = nopad_varlen_attention(Layer(), q, q, q, None, sliding_window=2)
    assert not out.isnan().any()


def test_source_index_takes_need_roll_as_a_real_bool():
    plan = ThdPlan.from_nested(_ids(5, 3))
    with pytest.raises(ValueError, match=r"need_roll: expected True or False \(a bool\), got 'false' \(str\)"):
        plan.source_index("false")
    assert torch.equal(plan.source_index(np.bool_(True)), plan.source_index(True))
