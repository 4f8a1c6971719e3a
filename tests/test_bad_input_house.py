"""The bad-input kinds issue 28's catalogue still found: each refused with a message naming what was
expected (or, for the valid input, accepted), never a silent wrong result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from nopad.batches import embeds_padding_2_no_padding, micro_batches
from nopad.core import IndexPlan, pad_input


def _nested_batch(lengths=(3, 5, 2, 4)) -> TensorDict:
    plan = IndexPlan.from_lengths(torch.tensor(lengths))
    ids = torch.arange(plan.total)
    return TensorDict(
        {"input_ids": plan.to_nested(ids), "position_ids": plan.to_nested(plan.position_ids)}, batch_size=[len(lengths)]
    )


@pytest.mark.parametrize("flag", ["false", 0, 1, None])
def test_a_flag_that_is_not_a_bool_is_refused_not_read_as_truthy(flag):
    with pytest.raises(ValueError, match=rf"balance: expected True or False \(a bool\), got {flag!r}"):
        micro_batches(_nested_batch(), 8, balance=flag)


def test_a_float_mask_of_halves_is_no_mask_and_is_refused_where_it_counts_tokens():
    data = TensorDict(
        {"input_ids": torch.ones(4, 6, dtype=torch.long), "attention_mask": torch.full((4, 6), 0.5)}, batch_size=[4]
    )
    with pytest.raises(ValueError, match=r"data\['attention_mask'\] row 0: expected a 0/1 mask .* got 0.5"):
        micro_batches(data, 12)


def test_restore_partitions_with_a_repeated_or_missing_row_are_refused():
    from nopad.batches import RowRestore

    with pytest.raises(
        ValueError, match=r"partitions: expected each of the rows 0..3 in exactly one partition, got row 1"
    ):
        RowRestore([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"partitions: expected rows 0..2 \(one per row of the batch\), got row 5"):
        RowRestore([[0, 5], [1]])


def test_outputs_of_other_rows_are_refused_even_with_the_same_row_counts():
    data = _nested_batch((3, 5, 2, 4, 6, 1))
    micro, restore = micro_batches(data, 9, balance=False)
    assert len(micro) >= 2 and len({len(p) for p in restore.partitions}) == 1  # parts of as many rows
    other = [
        IndexPlan.from_lengths(torch.full((len(p),), 7)).to_nested(torch.zeros(7 * len(p))) for p in restore.partitions
    ]
    with pytest.raises(
        ValueError, match=r"outputs\[0\]: expected the rows of micro-batch 0, of lengths .* got rows of lengths \[7"
    ):
        restore(other)
    swapped = [IndexPlan.from_nested(m["input_ids"]).to_nested(m["input_ids"].values().float()) for m in micro][::-1]
    with pytest.raises(ValueError, match=r"outputs\[0\]: expected the rows of micro-batch 0"):
        restore(swapped)  # fresh offsets (a model's output), out of order: told apart by the lengths


def test_outputs_that_do_not_join_into_one_tensor_are_refused_by_the_part_that_differs():
    micro, restore = micro_batches(_nested_batch((3, 5, 2, 4, 6, 1)), 9, balance=False)
    outputs = [IndexPlan.from_nested(m["input_ids"]).to_nested(m["input_ids"].values().float()) for m in micro]
    mixed = [outputs[0], outputs[1].double(), *outputs[2:]]
    with pytest.raises(
        ValueError, match=r"outputs\[1\]: expected rows of shape \(\), torch.float32 on cpu as in outputs\[0\]"
    ):
        restore(mixed)
    wide = [
        IndexPlan.from_nested(m["input_ids"]).to_nested(torch.zeros(len(m["input_ids"].values()), 2)) for m in micro
    ]
    with pytest.raises(ValueError, match=r"outputs\[2\]: expected rows of shape \(2,\)"):
        restore([*wide[:2], outputs[2], *wide[3:]])
    assert torch.equal(restore(outputs).values(), restore([o.clone() for o in outputs]).values())


def test_pad_input_refuses_two_values_for_one_row():
    with pytest.raises(ValueError, match=r"indices: expected distinct rows \(one value per row\), got row 0 twice"):
        pad_input(torch.randn(3, 2), torch.tensor([0, 0, 1]), 2, 2)


def test_use_packed_attention_refuses_what_is_not_a_transformers_model():
    from nopad.modeling import packed_attention, use_packed_attention

    with pytest.raises(ValueError, match=r"model: expected a transformers model \(a module with a config"):
        use_packed_attention(torch.nn.Linear(2, 2))
    with (
        pytest.raises(ValueError, match=r"model: expected a transformers model"),
        packed_attention(torch.nn.Linear(2, 2)),
    ):
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_available_kernels_on_a_machine_without_cuda_says_so():
    """Issue 36: it answered ["sdpa"], a kernel that cannot run on a device this machine lacks."""
    from nopad.modeling import available_kernels

    # private: the memo's host lengths and the kernel refusals behind the public checks
    from nopad.modeling._attention import unavailable_kernels

    words = r"device: expected a device this machine has, got 'cuda': this machine has no CUDA device"
    for call in (available_kernels, unavailable_kernels):
        with pytest.raises(ValueError, match=words):
            call("cuda")
    assert available_kernels("cpu") == ["sdpa"]  # the devices it has are answered


def test_an_embeds_mask_of_twos_selects_as_verl_reads_it():
    embeds = torch.randn(2, 3, 4)
    twos = TensorDict(
        {"prompt_embeds": embeds, "prompt_embeds_mask": torch.tensor([[2, 2, 0], [2, 0, 0]])}, batch_size=[2]
    )
    ones = TensorDict(
        {"prompt_embeds": embeds, "prompt_embeds_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}, batch_size=[2]
    )
    a, b = embeds_padding_2_no_padding(twos), embeds_padding_2_no_padding(ones)
    assert torch.equal(a["prompt_embeds"].values(), b["prompt_embeds"].values())
    assert torch.equal(a["prompt_embeds"].offsets(), b["prompt_embeds"].offsets())


def test_offsets_edited_in_place_forget_what_was_known_of_them():
    from nopad.core._layout import known_host_lengths, remember_host_lengths

    offsets = torch.tensor([0, 3, 5])
    remember_host_lengths(offsets, np.array([3, 2]))
    assert known_host_lengths(offsets).tolist() == [3, 2]
    offsets[1] += 1  # the rows are now 4 and 1: the record would lie
    assert known_host_lengths(offsets) is None
    data = TensorDict({"input_ids": torch.nested.nested_tensor_from_jagged(torch.arange(5), offsets)}, batch_size=[2])
    micro, restore = micro_batches(data, 4, balance=False)  # the stale 3 + 2 would fit 4 neither way
    assert sorted(len(m["input_ids"].values()) for m in micro) == [1, 4]  # read again, not trusted


def test_split_rows_without_sizes_says_what_it_takes():
    from nopad.batches import split_rows

    with pytest.raises(
        ValueError, match=r"sizes: expected a list of part sizes summing to the batch's 4 rows, got None"
    ):
        split_rows(_nested_batch(), None)


def test_a_strided_nested_tensor_is_named_not_an_attribute_error():
    from nopad.batches import select_rows

    strided = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError, match=r"expected a jagged nested tensor \(layout=torch.jagged\), got a strided one"):
        select_rows(TensorDict({"x": strided}, batch_size=[2]), [0])


def test_a_width_no_buffer_could_hold_is_refused_before_allocating():
    with pytest.raises(ValueError, match=r"width: expected an int in \[0, 2147483647\], got 1000000000000"):
        IndexPlan.from_lengths(torch.tensor([3, 2]), width=10**12)


def test_a_pad_value_an_integer_tensor_cannot_hold_is_refused():
    from nopad.engines import ThdPlan

    plan = ThdPlan.from_lengths(torch.tensor([3, 2]), cp_size=1)
    ids = IndexPlan.from_lengths(torch.tensor([3, 2])).to_nested(torch.arange(5))
    with pytest.raises(ValueError, match=r"pad_value: expected a whole number for a torch.int64 tensor, got 2.5"):
        plan.shard(ids, pad_value=2.5)


def test_float_input_ids_are_refused_before_the_model_sees_them():
    from nopad.engines import prepare_model_inputs

    plan = IndexPlan.from_lengths(torch.tensor([3, 2]))
    micro = {"input_ids": plan.to_nested(torch.arange(5).float()), "position_ids": plan.to_nested(plan.position_ids)}
    with pytest.raises(ValueError, match=r"input_ids: expected an integer tensor, got dtype torch.float32"):
        prepare_model_inputs(micro)


@pytest.mark.parametrize("bad", [8, -1])
def test_routed_expert_ids_outside_the_experts_are_refused_not_replayed(bad):
    from nopad.engines import ThdPlan

    plan = ThdPlan.from_nested(_nested_batch()["input_ids"])
    experts = torch.zeros(plan.total, 2, dtype=torch.long)
    experts[5, 1] = bad
    with pytest.raises(ValueError, match=rf"routed_experts: expected expert ids in \[0, num_experts=8\), got {bad}"):
        plan.shard_routed_experts(experts, num_experts=8)
    with pytest.raises(ValueError, match=r"routed_experts: expected an integer tensor, got dtype torch.float32"):
        plan.shard_routed_experts(experts.float(), num_experts=8)
    experts[5, 1] = 7
    assert plan.shard_routed_experts(experts, num_experts=8).shape == (1, plan.local_len, 2)


def _set(field, index, value):
    def edit(batch):
        batch[field][index] = value

    return edit


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(_set("packed_cu_seqlens", (1, 1), 5), id="last boundary moved into the row's padding"),
        pytest.param(_set("packed_cu_seqlens_lengths", 0, 2), id="count shrank: real tokens past the last boundary"),
        pytest.param(_set("packed_cu_seqlens", (0, 1), 2), id="boundary moved between two conversations"),
        pytest.param(_set("packed_cu_seqlens", (1, 1), 9), id="boundary past the row's width"),
        pytest.param(_set("packed_cu_seqlens_lengths", 1, 7), id="count past the boundaries held"),
    ],
)
def test_packed_rows_whose_boundaries_no_longer_match_their_tokens_are_refused(edit):
    from nopad.packing import collate_packed, pack_conversations, packed_to_nested, packed_to_thd

    convs = [([1, 2, 3], [0, 1, 1]), ([4, 5], [1, 1]), ([6, 7, 8, 9], [1, 1, 1, 1])]
    batch = collate_packed(pack_conversations(convs, 8, pad_token_id=0)[0])
    assert packed_to_nested(batch)["input_ids"].offsets().tolist() == [0, 3, 5, 9]
    edit(batch)
    for convert in (packed_to_nested, packed_to_thd):
        with pytest.raises(ValueError, match=r"packed_cu_seqlens row \d: expected boundaries that match the row's"):
            convert(batch)


@pytest.mark.parametrize("label", [97, -1])
def test_a_label_outside_the_vocabulary_is_named_not_an_index_error(label):
    from nopad.modeling import head_log_probs, token_log_probs

    labels = torch.tensor([1, 2, label, 0])
    match = rf"labels: expected token ids in \[0, vocab=97\) \(a pad id past it\?\), got {label}"
    with pytest.raises(ValueError, match=match):
        token_log_probs(torch.randn(4, 97), labels)
    with pytest.raises(ValueError, match=match):
        head_log_probs(torch.randn(4, 8), torch.randn(97, 8), labels)


@pytest.mark.parametrize("head", ["logits", "chunked"])
def test_a_pad_id_past_the_vocabulary_is_named_before_the_head_reads_it(head):
    from nopad import left_right_2_no_padding
    from nopad.engines import chunked_head, prepare_model_inputs, prepare_model_outputs
    from tests.models import make_padded_batch, tiny_llama

    m = tiny_llama(0)  # vocabulary 97
    micro = left_right_2_no_padding(make_padded_batch(2, 4, 3, seed=0, prompt_lens=[4, 2], resp_lens=[3, 1]))
    inputs, args = prepare_model_inputs(micro, pad_token_id=97)
    with pytest.raises(ValueError, match=r"labels: expected token ids in \[0, vocab=97\) \(a pad id past it\?\)"):
        with torch.no_grad(), chunked_head(m, args, head) as served:
            prepare_model_outputs(served(**inputs), args)
    inputs, args = prepare_model_inputs(micro, pad_token_id=0)
    with torch.no_grad(), chunked_head(m, args, head) as served:
        assert prepare_model_outputs(served(**inputs), args)["log_probs"].values().isfinite().all()
