"""SFT's two mask conventions cannot be mixed up: a per-token ``loss_mask`` (shifted by one inside
``sft_loss``) and a label-aligned ``token_mask`` (a packed file's, used as it is) each have a name,
and a mask given in the other convention is refused where that can be told, never shifted twice.

The reference is written here: each conversation run alone through the model, the log-prob of
token t + 1 read at position t, summed over the tokens the per-token mask learns.
"""

from __future__ import annotations

import pytest
import torch

from nopad.engines import prepare_model_inputs, prepare_model_outputs
from nopad.losses import sft_loss
from nopad.packing import collate_packed, pack_conversations, packed_to_nested
from nopad.synthetic import tiny_causal_lm

VOCAB = 50
CONVERSATIONS = [  # (ids, per-token loss mask): prompts not learned, answers learned, the last token included
    ([3, 4, 5, 6, 7], [0, 0, 1, 1, 1]),
    ([8, 9, 10], [0, 1, 1]),
    ([11, 12, 13, 14, 15, 16, 17], [0, 0, 0, 1, 1, 0, 1]),
    ([18, 19, 20, 21], [1, 1, 1, 1]),
]


def _reference(model, conversations) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in conversations:
            ids, mask = torch.tensor(ids), torch.tensor(mask)
            positions = torch.arange(len(ids))[None]
            logits = model(input_ids=ids[None], position_ids=positions, use_cache=False).logits[0]
            log_probs = logits[:-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
            total += float(log_probs[mask[1:].bool()].sum())
            count += int(mask[1:].sum())
    return -total / count


@pytest.fixture(scope="module")
def packed():
    """The conversations packed (alignment 4: each segment ends in padding) and read back nested."""
    rows, _ = pack_conversations(CONVERSATIONS, 16, alignment=4, algorithm="best_fit_decreasing")
    micro = packed_to_nested(collate_packed(rows, alignment=4))
    model = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, layers=2)
    inputs, args = prepare_model_inputs(micro)
    with torch.no_grad():
        log_probs = prepare_model_outputs(model(**inputs), args)["log_probs"]
    return model, micro, log_probs


def test_the_packed_files_label_aligned_mask_gives_each_conversations_loss(packed):
    model, micro, log_probs = packed
    loss, metrics = sft_loss({}, {"log_probs": log_probs}, micro)
    assert metrics == {}
    assert loss.item() == pytest.approx(_reference(model, CONVERSATIONS), rel=1e-5)


def test_the_per_token_mask_under_its_own_name_gives_the_same_loss():
    """The same conversations unpacked: nested (B, j) with the per-token loss_mask, shifted inside."""
    from nopad.core import IndexPlan

    model = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, layers=2)
    plan = IndexPlan.from_lengths(torch.tensor([len(ids) for ids, _ in CONVERSATIONS]))
    micro = {
        "input_ids": plan.to_nested(torch.tensor([t for ids, _ in CONVERSATIONS for t in ids])),
        "position_ids": plan.to_nested(plan.position_ids),
        "loss_mask": plan.to_nested(torch.tensor([m for _, mask in CONVERSATIONS for m in mask])),
    }
    inputs, args = prepare_model_inputs(micro)
    with torch.no_grad():
        log_probs = prepare_model_outputs(model(**inputs), args)["log_probs"]
    loss, _ = sft_loss({}, {"log_probs": log_probs}, micro)
    assert loss.item() == pytest.approx(_reference(model, CONVERSATIONS), rel=1e-5)


def test_the_label_aligned_mask_given_as_a_per_token_one_is_refused_not_shifted_twice(packed):
    _, micro, log_probs = packed
    with pytest.raises(ValueError) as error:
        sft_loss({}, {"log_probs": log_probs}, {"loss_mask": micro["token_mask"]})
    message = str(error.value)
    assert message.startswith("data['loss_mask']: expected a per-token mask")
    assert "label-aligned" in message and "data['token_mask']" in message and "shifted twice" in message


def test_a_per_token_mask_given_as_the_label_aligned_one_is_refused_naming_both_conventions(packed):
    _, micro, log_probs = packed
    # each segment's per-token mask: the label-aligned one moved back by one (loss_mask[t + 1] = token_mask[t])
    segments = micro["token_mask"].unbind()
    per_token = torch.cat([torch.cat([seg.new_zeros(1), seg[:-1]]) for seg in segments])
    wrong = torch.nested.nested_tensor_from_jagged(per_token, micro["token_mask"].offsets())
    # the 4-token conversation fills its 4-token segment: its last token is learned, which a
    # label-aligned mask can never say (the other segments end in alignment padding: no telling there)
    row = [int(seg[0]) for seg in micro["input_ids"].unbind()].index(18)
    with pytest.raises(ValueError) as error:
        sft_loss({}, {"log_probs": log_probs}, {**micro, "token_mask": wrong})
    message = str(error.value)
    assert message.startswith(f"data['token_mask'] row {row}: expected a label-aligned mask")
    assert "1 at its last token" in message and "data['loss_mask'], a per-token mask" in message


def test_both_masks_or_a_dense_token_mask_are_refused(packed):
    _, micro, log_probs = packed
    both = {**micro, "loss_mask": micro["input_ids"].clone()}
    with pytest.raises(ValueError, match=r"^data: expected one mask: data\['loss_mask'\].* got both$"):
        sft_loss({}, {"log_probs": log_probs}, both)
    rows = collate_packed(pack_conversations(CONVERSATIONS, 16, alignment=4)[0], alignment=4)
    with pytest.raises(ValueError, match=r"data\['token_mask'\]: expected a nested \(B, j\) mask .*packed_to_nested"):
        sft_loss({}, {"log_probs": log_probs}, {"token_mask": rows["token_mask"]})


def test_on_a_device_a_per_token_mask_as_token_mask_turns_the_loss_nan_without_a_read(packed, device_path):
    from nopad.diagnostics import OpCounter

    _, micro, log_probs = packed
    ones = torch.nested.nested_tensor_from_jagged(
        torch.ones_like(micro["input_ids"].values()), micro["input_ids"].offsets()
    )  # 1 at every segment's last token
    with OpCounter() as counter:
        loss, _ = sft_loss({}, {"log_probs": log_probs}, {**micro, "token_mask": ones})
    assert counter.syncs == 0 and torch.isnan(loss)
    assert torch.isfinite(sft_loss({}, {"log_probs": log_probs}, micro)[0])
