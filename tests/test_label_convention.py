"""One convention for next-token labels: the FSDP, Megatron THD and packing paths agree token for token.

Token t's label is token t+1 of its own sequence; the label slot of a sequence's last token (which no
loss trains on) holds the pad id, 0, on every path, and every path's mask excludes it.
"""

import pytest
import torch

from nopad.core import IndexPlan, prepare_offsets
from nopad.engines import ThdPlan, prepare_model_inputs
from nopad.packing import pack_conversations, pack_online

CONVERSATIONS = [[5, 6, 7, 8], [9], [11, 12, 13], [14, 15, 16, 17, 18, 19]]


def _nested(seqs):
    lengths = torch.tensor([len(s) for s in seqs])
    values = torch.tensor([t for s in seqs for t in s])
    return torch.nested.nested_tensor_from_jagged(values, prepare_offsets(lengths))


def _reference(seqs):
    """The convention, one sequence at a time."""
    labels, mask = [], []
    for s in seqs:
        labels += s[1:] + [0]
        mask += [1] * (len(s) - 1) + [0]
    return labels, mask


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1, 0, 2]])
def test_fsdp_megatron_and_packing_give_the_same_labels_and_masks(order):
    seqs = [CONVERSATIONS[i] for i in order]
    ids = _nested(seqs)
    want_labels, want_mask = _reference(seqs)

    _, args = prepare_model_inputs(
        {
            "input_ids": ids,
            "position_ids": IndexPlan.from_nested(ids).to_nested(IndexPlan.from_nested(ids).position_ids),
        }
    )
    fsdp = (args.labels.tolist(), args.label_mask.int().tolist())

    plan = ThdPlan.from_nested(ids)  # cp=1, tp=1: no alignment padding, the packed order
    last = IndexPlan.from_nested(ids).last_token_mask
    megatron = (plan.shard(ids, need_roll=True)[0].tolist(), (~plan.shard(last)[0]).int().tolist())

    total = sum(map(len, seqs))
    rows, _ = pack_conversations([(s, [1] * len(s)) for s in seqs], total, alignment=1)
    offline = (rows[0]["target_ids"].tolist(), rows[0]["token_mask"].tolist())
    assert len(rows) == 1

    online_rows, bins = pack_online(ids, total, algorithm="concatenative")
    assert bins == [list(range(len(seqs)))]
    online = (online_rows["target_ids"][0].tolist(), online_rows["token_mask"][0].tolist())

    assert fsdp == megatron == offline == online == (want_labels, want_mask)


def test_the_label_slot_holds_the_pad_value_asked_for():
    ids = _nested(CONVERSATIONS)
    plan = IndexPlan.from_nested(ids)
    labels = plan.next_token_labels(ids.values(), pad_value=-1)
    assert labels[plan.last_token_mask].tolist() == [-1] * len(CONVERSATIONS)
    assert (
        ThdPlan.from_nested(ids).shard(ids, need_roll=True, pad_value=-1)[0][plan.last_token_mask].tolist() == [-1] * 4
    )
