"""The weak-message sweep (issue 36): every callable a public module lists in ``__all__``, called from
one valid call with a grid of typical bad inputs put into one argument at a time.

A bad input may be accepted (not this sweep's business: the catalogues test what is served) or
refused; a refusal is nopad's when it is a ValueError worded by the one error helper (the field,
what was expected, what came). Anything else a user gets for bad input is a weak message: a raw
torch RuntimeError / IndexError / TypeError from deep inside, or a ValueError that names no field.
A missing packed file is the exception: the FileNotFoundError its readers document.

The weak messages left are listed below by the public callable that gives them (at most ten) and
the arguments whose bad inputs do; a weak message anywhere else fails the test, naming the call and
the message. Each one the sweep found and nopad now refuses has its case and words in ``FIXED``.
Run ``python -m tests.test_bad_input_sweep`` to print every weak message left, one a line.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import nopad.batches as batches
import nopad.core as core
import nopad.engines as engines
import nopad.losses as losses
import nopad.modeling as modeling
import nopad.packing as packing
import nopad.parallel as parallel
import nopad.synthetic as synthetic

# private: the leak probe's small nested micro-batch, a valid input of the engines
from nopad.engines._leak import probe_batch
from tests.models import VOCAB, make_padded_batch
from tests.test_losses import SHAPES, rollout

# what the one error helper writes (nopad.core._errors.input_error), and in_file's prefix of it
NOPAD_WORDS = re.compile(r"^[^\n]+?: expected .+, got ", re.S)

# The weak messages left, by the callable that gives them (its module, the arguments whose bad inputs
# it does not refuse in nopad's words). All live in modules being edited elsewhere (issue 36's list).
WEAK_LEFT: dict[str, tuple[str, set[str]]] = {}
MOST_LEFT = 10


@dataclass
class Call:
    """One valid call: ``fn(**make())``; the sweep puts one bad input into one argument of it."""

    name: str
    fn: Callable[..., Any]
    make: Callable[[], dict[str, Any]]


# ---- the weak messages the sweep found, each now refused at the edge with its words ----------------
def _zero_d() -> torch.Tensor:
    return torch.tensor(5)


def _row(lengths=(3, 2)) -> modeling.PackedRow:
    return modeling.PackedRow.from_lengths(list(lengths))


def _gdn(**changed: Any) -> torch.Tensor:
    """gated_delta_rule of 5 tokens, 2 heads, with ``changed`` arguments."""
    args = {"q": torch.rand(5, 2, 4), "k": torch.rand(5, 2, 4), "v": torch.rand(5, 2, 4)}
    args.update(g=-torch.rand(5, 2), beta=torch.rand(5, 2), row=_row(), chunk_size=4)
    return modeling.gated_delta_rule(**{**args, **changed})


def _ssd(**changed: Any) -> torch.Tensor:
    """ssd_scan of 5 tokens, 4 heads, with ``changed`` arguments."""
    args = {"x": torch.rand(5, 4, 8), "dt": torch.rand(5, 4), "A": -torch.rand(4), "B": torch.rand(5, 1, 8)}
    args.update(C=torch.rand(5, 1, 8), row=_row(), chunk_size=4)
    return modeling.ssd_scan(**{**args, **changed})


def _conv(**changed: Any) -> torch.Tensor:
    """causal_conv1d of 8 channels by 5 tokens, kernel 4, with ``changed`` arguments."""
    args = {"x": torch.rand(8, 5), "weight": torch.rand(8, 4), "bias": torch.rand(8), "row": _row()}
    return modeling.causal_conv1d(**{**args, **changed})


def _float_boundaries() -> TensorDict:
    batch = packing.collate_packed(_packed_rows())
    batch["packed_cu_seqlens_lengths"] = batch["packed_cu_seqlens_lengths"].float()
    return batch


FIXED = [
    (
        "weak message",
        "available_kernels of an unknown device",
        lambda: modeling.available_kernels("bogus"),
        r"device: expected a torch.device or a device string \('cpu', 'cuda', ...\), got 'bogus'",
    ),
    (
        "weak message",
        "padded_logprobs of a module that is no transformers model",
        lambda: engines.padded_logprobs(torch.nn.Linear(2, 2), make_padded_batch(2, 3, 3)),
        r"model: expected a transformers model \(a module with a config naming its attention\), got Linear",
    ),
    (
        "weak message",
        "RowRestore of no partitions",
        lambda: batches.RowRestore(None),
        r"partitions: expected a list of row-index lists, one per micro-batch \(verl's batch_idx_list\), got NoneType",
    ),
    (
        "weak message",
        "cat_rows of no batches",
        lambda: batches.cat_rows(None),
        r"batches: expected a non-empty list of TensorDicts, got NoneType",
    ),
    (
        "weak message",
        "prepare_offsets of 0-d lengths",
        lambda: core.prepare_offsets(_zero_d()),
        r"lengths: expected a 1-D tensor, got shape \(\)",
    ),
    (
        "weak message",
        "prepare_row_ids of 0-d lengths",
        lambda: core.prepare_row_ids(_zero_d(), 5),
        r"lengths: expected a 1-D tensor, got shape \(\)",
    ),
    (
        "weak message",
        "prepare_position_ids of no offsets",
        lambda: core.prepare_position_ids(None, 5),
        r"offsets: expected a 1-D tensor or sequence of integers \(nothing is rounded\), got NoneType",
    ),
    (
        "weak message",
        "prepare_position_ids of float offsets",
        lambda: core.prepare_position_ids(torch.tensor([0.0, 3.0, 5.0]), 5),
        r"offsets: expected a 1-D tensor or sequence of integers, got dtype torch.float32",
    ),
    (
        "weak message",
        "prepare_position_ids of 0-d offsets",
        lambda: core.prepare_position_ids(_zero_d(), 5),
        r"offsets: expected a non-empty 1-D tensor, got shape \(\)",
    ),
    (
        "weak message",
        "position ids as a list",
        lambda: core.IndexPlan.from_position_ids([0, 1, 2]),
        r"position_ids: expected a dense \(seqlen,\) or \(batch, seqlen\) tensor, got list",
    ),
    (
        "weak message",
        "position ids of no rows",
        lambda: core.IndexPlan.from_position_ids(torch.zeros(0, 5, dtype=torch.long)),
        r"position_ids: expected a non-empty \(seqlen,\) or \(batch, seqlen\) tensor, got shape \(0, 5\)",
    ),
    (
        "weak message",
        "index_put_first_axis of no values",
        lambda: core.index_put_first_axis(None, torch.tensor([0, 2]), 5),
        r"values: expected a tensor with a first axis, got NoneType",
    ),
    (
        "weak message",
        "pad_input of a list",
        lambda: core.pad_input([[1.0], [2.0]], torch.tensor([0, 1]), 1, 2),
        r"hidden: expected a tensor with a first axis, got list",
    ),
    (
        "weak message",
        "no_padding_2_padding of no data",
        lambda: batches.no_padding_2_padding(torch.zeros(3), None),
        r"data: expected a TensorDict or a mapping of its fields, got NoneType",
    ),
    (
        "weak message",
        "embeds of no data",
        lambda: batches.embeds_padding_2_no_padding(None),
        r"data: expected a TensorDict, got NoneType",
    ),
    (
        "weak message",
        "shard_index of 0-d boundaries",
        lambda: parallel.shard_index(_zero_d(), 4, 2, 0, "zigzag"),
        r"cu_seqlens_padded: expected a non-empty 1-D tensor, got shape \(\)",
    ),
    (
        "weak message",
        "shard_index without a size",
        lambda: parallel.shard_index(torch.tensor([0, 4, 8]), 4, None, 0, "zigzag"),
        r"cp_size: expected an int >= 1, got None",
    ),
    (
        "weak message",
        "shard_index of an unknown layout",
        lambda: parallel.shard_index(torch.tensor([0, 4, 8]), 4, 2, 0, "round-robin"),
        r"cp_layout: expected one of \('zigzag', 'contiguous'\), got 'round-robin'",
    ),
    (
        "weak message",
        "unshard_index without lengths",
        lambda: parallel.unshard_index(torch.tensor([0, 4, 8]), None, 7, 4, 2, "zigzag"),
        r"lengths: expected a 1-D tensor or sequence of integers \(nothing is rounded\), got NoneType",
    ),
    (
        "weak message",
        "unshard_index without a local length",
        lambda: parallel.unshard_index(torch.tensor([0, 4, 8]), torch.tensor([3, 4]), 7, None, 2, "zigzag"),
        r"local_len: expected an int >= 0, got None",
    ),
    (
        "weak message",
        "gather_cp_shards of a list",
        lambda: parallel.gather_cp_shards([1.0, 2.0], 1, 0),
        r"local: expected a dense \(local_len, ...\) tensor, got list",
    ),
    (
        "weak message",
        "slice_for_rank over 0 ranks",
        lambda: parallel.slice_for_rank(torch.zeros(2, 8), 0, 0),
        r"sp_size: expected an int >= 1, got 0",
    ),
    (
        "weak message",
        "slice_for_rank of a float rank",
        lambda: parallel.slice_for_rank(torch.zeros(2, 8), 2, 0.5),
        r"sp_rank: expected an int >= 0, got 0.5",
    ),
    (
        "weak message",
        "slice_for_rank of no tensor",
        lambda: parallel.slice_for_rank(None, 2, 0),
        r"x: expected a dense tensor with the dim to slice, got NoneType",
    ),
    (
        "weak message",
        "ulysses on a plain module",
        lambda: parallel.enable_ulysses(torch.nn.Linear(2, 2)),
        r"model: expected a transformers model \(a module with a config naming its attention\), got Linear",
    ),
    (
        "weak message",
        "the leak probe on no model",
        lambda: engines.check_isolation(None),
        r"model: expected a transformers model .*, got NoneType \(not a torch module\)",
    ),
    (
        "weak message",
        "a policy loss without log-probs",
        lambda: losses.compute_policy_loss(torch.zeros(2, 3), None, torch.zeros(2, 3), torch.ones(2, 3)),
        r"log_prob: expected shape \(2, 3\) like response_mask, got NoneType",
    ),
    (
        "weak message",
        "a packed file at no path",
        lambda: packing.read_packed(None),
        r"path: expected a file path \(a str or an os.PathLike such as pathlib.Path\), got NoneType",
    ),
    (
        "weak message",
        "packed rows written to an int",
        lambda: packing.write_packed(3, _packed_rows(), pack_length=8, tokenizer=BYTES.identity, pad_token_id=0),
        r"path: expected a file path .*, got int",
    ),
    (
        "weak message",
        "no conversations",
        lambda: packing.pack_conversations(None, 8),
        r"conversations: expected an iterable of \(input_ids, loss_mask\) pairs, got NoneType",
    ),
    (
        "weak message",
        "a record without a tokenizer",
        lambda: packing.encode_record({"input_ids": [1, 2]}, None),
        r"tokenizer: expected a tokenizer with an identity .*, got NoneType",
    ),
    (
        "weak message",
        "float segment counts",
        lambda: packing.packed_to_nested(_float_boundaries()),
        r"packed_cu_seqlens_lengths: expected an integer tensor, got dtype torch.float32",
    ),
    (
        "weak message",
        "a packed row of no lengths",
        lambda: modeling.PackedRow.from_lengths(None),
        r"lengths: expected a 1-D tensor or sequence of integers \(nothing is rounded\), got NoneType",
    ),
    (
        "weak message",
        "a packed row of a negative length",
        lambda: modeling.PackedRow.from_lengths([-1, 2]),
        r"lengths row 0: expected a value >= 0, got -1",
    ),
    (
        "coercion",
        "a packed row of float lengths",
        lambda: modeling.PackedRow.from_lengths([3.5, 2.5]),
        r"lengths: expected a 1-D tensor or sequence of integers \(nothing is rounded\), got list of dtype float64",
    ),
    (
        "weak message",
        "a conv of (tokens,) input",
        lambda: _conv(x=torch.rand(5)),
        r"x: expected a \(channels, tokens\) tensor, got shape \(5,\)",
    ),
    (
        "weak message",
        "a conv of no weight",
        lambda: _conv(weight=None),
        r"weight: expected a dense floating-point \(channels, kernel\) tensor, got NoneType",
    ),
    (
        "weak message",
        "a conv whose weight has other channels",
        lambda: _conv(weight=torch.rand(7, 4)),
        r"weight: expected shape \(8, kernel >= 1\) for x's 8 channels, got shape \(7, 4\)",
    ),
    (
        "weak message",
        "a conv bias of other channels",
        lambda: _conv(bias=torch.rand(7)),
        r"bias: expected shape \(8,\) for x's 8 channels, got shape \(7,\)",
    ),
    (
        "weak message",
        "a conv without a packed row",
        lambda: _conv(row=None),
        r"row: expected a nopad.modeling.PackedRow \(PackedRow.from_lengths\), got NoneType",
    ),
    (
        "shape",
        "a conv over a row of other tokens",
        lambda: _conv(row=_row((3, 3))),
        r"x: expected 6 tokens \(the row's total\) on its token axis, got 5",
    ),
    (
        "weak message",
        "a conv of an unknown activation",
        lambda: _conv(activation="bogus"),
        r"activation: expected None, a callable or an activation's name .*, got 'bogus'",
    ),
    (
        "weak message",
        "a delta rule of one token fewer in v",
        lambda: _gdn(v=torch.rand(4, 2, 4)),
        r"q: expected shape \(4, key heads dividing 2, d_k\) for v of shape \(4, 2, 4\), got shape \(5, 2, 4\)",
    ),
    (
        "weak message",
        "a delta rule of 3-D gates",
        lambda: _gdn(g=-torch.rand(1, 5, 2)),
        r"g: expected a \(tokens, heads\) tensor, got shape \(1, 5, 2\)",
    ),
    (
        "weak message",
        "a delta rule of one token fewer in beta",
        lambda: _gdn(beta=torch.rand(4, 2)),
        r"beta: expected shape \(5, 2\) for v of shape \(5, 2, 4\), got shape \(4, 2\)",
    ),
    (
        "weak message",
        "a delta rule of keys unlike the queries",
        lambda: _gdn(k=torch.rand(5, 1, 4)),
        r"k: expected shape \(5, 2, 4\) like q, got shape \(5, 1, 4\)",
    ),
    (
        "coercion",
        "a delta rule of integer queries",
        lambda: _gdn(q=torch.ones(5, 2, 4, dtype=torch.long)),
        r"q: expected a floating-point \(tokens, key heads, d_k\) tensor, got dtype torch.int64",
    ),
    (
        "weak message",
        "a delta rule of chunks of 0",
        lambda: _gdn(chunk_size=0),
        r"chunk_size: expected an int >= 1, got 0",
    ),
    (
        "weak message",
        "a scan of one token fewer in x",
        lambda: _ssd(x=torch.rand(4, 4, 8)),
        r"dt: expected shape \(4, 4\) for x of shape \(4, 4, 8\), got shape \(5, 4\)",
    ),
    (
        "weak message",
        "a scan of A of other heads",
        lambda: _ssd(A=-torch.rand(3)),
        r"A: expected shape \(4,\) for x of shape \(5, 4, 8\), got shape \(3,\)",
    ),
    (
        "weak message",
        "a scan of groups not dividing the heads",
        lambda: _ssd(B=torch.rand(5, 3, 8), C=torch.rand(5, 3, 8)),
        r"B: expected shape \(5, groups dividing 4, state\) for x of shape \(5, 4, 8\), got shape \(5, 3, 8\)",
    ),
    (
        "weak message",
        "a scan of C unlike B",
        lambda: _ssd(C=torch.rand(4, 1, 8)),
        r"C: expected shape \(5, 1, 8\) like B, got shape \(4, 1, 8\)",
    ),
    (
        "weak message",
        "a scan without a packed row",
        lambda: _ssd(row=3),
        r"row: expected a nopad.modeling.PackedRow \(PackedRow.from_lengths\), got int",
    ),
    (
        "weak message",
        "a scan of float chunks",
        lambda: _ssd(chunk_size=4.5),
        r"chunk_size: expected an int >= 1, got 4.5",
    ),
    (
        "weak message",
        "a scan of a skip of other heads",
        lambda: _ssd(D=torch.rand(3)),
        r"D: expected shape \(4,\) or \(4, 8\) for x of shape \(5, 4, 8\), got shape \(3,\)",
    ),
    (
        "weak message",
        "a scan of a gate unlike x",
        lambda: _ssd(z=torch.rand(5, 4, 7)),
        r"z: expected shape \(5, 4, 8\) like x, got shape \(5, 4, 7\)",
    ),
    (
        "weak message",
        "a batch of -1 rows",
        lambda: synthetic.synthetic_batch(-1, 3, 2),
        r"B: expected an int >= 0, got -1",
    ),
    (
        "weak message",
        "a vocabulary of 1",
        lambda: synthetic.synthetic_batch(2, 3, 2, vocab=1),
        r"vocab: expected an int >= 2, got 1",
    ),
    (
        "weak message",
        "a tiny model of 0 heads",
        lambda: synthetic.tiny_causal_lm(heads=0),
        r"heads: expected an int >= 1, got 0",
    ),
    (
        "weak message",
        "a tiny model of a hidden size heads do not divide",
        lambda: synthetic.tiny_causal_lm(hidden=10, heads=4),
        r"hidden: expected a multiple of heads=4, got 10",
    ),
]


@pytest.mark.parametrize(("call", "match"), [pytest.param(c, m, id=f"{k}: {n}") for k, n, c, m in FIXED])
def test_what_the_sweep_found_is_refused_saying_what_to_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- valid inputs ---------------------------------------------------------------------------------
def _nested(lengths=(3, 2, 4), vocab=VOCAB) -> torch.Tensor:
    return probe_batch(vocab, lengths)["input_ids"]


def _rows_batch() -> TensorDict:
    plan = core.IndexPlan.from_lengths(torch.tensor([3, 5, 2, 4]))
    ids = torch.arange(plan.total)
    return TensorDict(
        {"input_ids": plan.to_nested(ids), "position_ids": plan.to_nested(plan.position_ids)}, batch_size=[4]
    )


def _converted() -> tuple[TensorDict, torch.Tensor]:
    data, full, nested_of = rollout(*SHAPES[0][:4], masked_rows=SHAPES[0][4])
    return data, nested_of(full.detach())


def _response_mask() -> torch.Tensor:
    return core.IndexPlan.from_lengths(torch.tensor([3, 1])).to_nested(torch.ones(4, dtype=torch.long))


def _embeds() -> TensorDict:
    return TensorDict(
        {"prompt_embeds": torch.randn(2, 3, 4), "prompt_embeds_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])},
        batch_size=[2],
    )


BYTES = packing.ByteTokenizer()
_MODEL: dict[str, torch.nn.Module] = {}


def _model() -> torch.nn.Module:
    if "llama" not in _MODEL:
        _MODEL["llama"] = synthetic.tiny_causal_lm(vocab=VOCAB, hidden=16, layers=1, heads=2, kv_heads=1)
    return _MODEL["llama"]


def _fresh_model() -> torch.nn.Module:
    return synthetic.tiny_causal_lm(vocab=VOCAB, hidden=16, layers=1, heads=2, kv_heads=1)


def _output_args():
    _, args = engines.prepare_model_inputs(probe_batch(VOCAB, (3, 2, 4)))
    return args


def _thd():
    ids = _nested((5, 3))
    plan = engines.ThdPlan.from_nested(ids)
    _, params, _ = engines.preprocess_thd(ids)
    return ids, plan, params


def _packed_rows():
    rows, _ = packing.pack_conversations([([1, 2, 3], [0, 1, 1]), ([4, 5], [1, 1]), ([6], [1])], 8, pad_token_id=0)
    return rows


def _packed_file(tmp: Any) -> str:
    path = str(tmp / "sweep.parquet")
    tokenizer = packing.ByteTokenizer()
    packing.write_packed(path, _packed_rows(), pack_length=8, tokenizer=tokenizer.identity, pad_token_id=0)
    return path


def _enter(make_context: Callable[..., Any]) -> Callable[..., Any]:
    """A context manager's call as one call: entered and left at once (its refusals come at entry)."""

    def call(**kwargs: Any) -> None:
        with make_context(**kwargs):
            pass

    call.__name__ = make_context.__name__
    return call


def _calls(tmp: Any) -> list[Call]:
    row = modeling.PackedRow.from_lengths([3, 2])

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=torch.Generator().manual_seed(0))

    path = _packed_file(tmp)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    z = torch.zeros(2, 3)
    ones = torch.ones(2, 3)
    return [
        # nopad.core
        Call(
            "IndexPlan.from_lengths", core.IndexPlan.from_lengths, lambda: {"lengths": torch.tensor([3, 2]), "width": 4}
        ),
        Call(
            "IndexPlan.from_offsets",
            core.IndexPlan.from_offsets,
            lambda: {"offsets": torch.tensor([0, 3, 5]), "width": 4},
        ),
        Call("IndexPlan.from_mask", core.IndexPlan.from_mask, lambda: {"mask": mask.clone()}),
        Call("IndexPlan.from_nested", core.IndexPlan.from_nested, lambda: {"nested": _nested(), "width": 4}),
        Call(
            "IndexPlan.from_position_ids",
            core.IndexPlan.from_position_ids,
            lambda: {"position_ids": torch.tensor([[0, 1, 2, 0, 1]])},
        ),
        Call(
            "index_first_axis", core.index_first_axis, lambda: {"x": torch.randn(5, 2), "indices": torch.tensor([0, 2])}
        ),
        Call(
            "index_put_first_axis",
            core.index_put_first_axis,
            lambda: {"values": torch.randn(2, 2), "indices": torch.tensor([0, 2]), "first_axis_dim": 5},
        ),
        Call(
            "pad_input",
            core.pad_input,
            lambda: {"hidden": torch.randn(3, 2), "indices": torch.tensor([0, 1, 3]), "batch": 2, "seqlen": 2},
        ),
        Call("prepare_offsets", core.prepare_offsets, lambda: {"lengths": torch.tensor([3, 2])}),
        Call(
            "prepare_position_ids", core.prepare_position_ids, lambda: {"offsets": torch.tensor([0, 3, 5]), "total": 5}
        ),
        Call("prepare_row_ids", core.prepare_row_ids, lambda: {"lengths": torch.tensor([3, 2]), "total": 5}),
        Call("unpad_input", core.unpad_input, lambda: {"hidden": torch.randn(2, 3, 4), "attention_mask": mask.clone()}),
        # nopad.batches
        Call("RowRestore", batches.RowRestore, lambda: {"partitions": [[0, 2], [1]]}),
        Call("Workload", batches.Workload, lambda: {"linear": 2, "quadratic": 1}),
        Call(
            "Workload.from_config",
            batches.Workload.from_config,
            lambda: {"config": {"hidden_size": 8, "num_hidden_layers": 2}},
        ),
        Call(
            "balanced_partitions",
            batches.balanced_partitions,
            lambda: {"values": [3, 1, 2, 4], "k_partitions": 2, "equal_size": True},
        ),
        Call(
            "karmarkar_karp",
            batches.karmarkar_karp,
            lambda: {"values": [3, 1, 2, 4], "k_partitions": 2, "equal_size": True},
        ),
        Call(
            "build_attention_mask_from_nested",
            batches.build_attention_mask_from_nested,
            lambda: {"input_ids": _nested(), "max_seq_len": 4},
        ),
        Call("cat_rows", batches.cat_rows, lambda: {"batches": [_rows_batch(), _rows_batch()]}),
        Call("chunk_rows", batches.chunk_rows, lambda: {"data": _rows_batch(), "chunks": 2}),
        Call("embeds_padding_2_no_padding", batches.embeds_padding_2_no_padding, lambda: {"data": _embeds()}),
        Call("left_right_2_no_padding", batches.left_right_2_no_padding, lambda: {"data": make_padded_batch(3, 4, 3)}),
        Call(
            "micro_batch_partitions",
            batches.micro_batch_partitions,
            lambda: {
                "lengths": [3, 5, 2, 4],
                "max_token_len": 8,
                "num_batches_divided_by": 1,
                "min_num_micro_batch": 2,
            },
        ),
        Call("micro_batches", batches.micro_batches, lambda: {"data": _rows_batch(), "max_token_len": 8}),
        Call(
            "no_padding_2_padding",
            batches.no_padding_2_padding,
            lambda: dict(zip(("data", "tensor"), _converted(), strict=True)),
        ),
        Call("pad_rows", batches.pad_rows, lambda: {"data": _rows_batch(), "divisor": 3}),
        Call(
            "plan_left_right",
            batches.plan_left_right,
            lambda: {"attention_mask": torch.tensor([[0, 1, 1, 1, 0]]), "response_mask": torch.tensor([[1, 1, 0]])},
        ),
        Call("rank_order", batches.rank_order, lambda: {"lengths": [3, 1, 2, 4], "dp_size": 2}),
        Call(
            "response_from_nested",
            batches.response_from_nested,
            lambda: {"tensor": _nested((5, 3)).float(), "response_mask": _response_mask()},
        ),
        Call(
            "response_to_nested",
            batches.response_to_nested,
            lambda: {"tensor": torch.randn(2, 4), "response_mask": _response_mask()},
        ),
        Call("select_rows", batches.select_rows, lambda: {"data": _rows_batch(), "index": [0, 2]}),
        Call("split_rows", batches.split_rows, lambda: {"data": _rows_batch(), "sizes": [1, 3]}),
        Call("unpad_rows", batches.unpad_rows, lambda: {"data": _rows_batch(), "pad": 1}),
        # nopad.modeling
        Call("PackedRow.from_lengths", modeling.PackedRow.from_lengths, lambda: {"lengths": [3, 2]}),
        Call("available_kernels", modeling.available_kernels, lambda: {"device": "cpu", "dtype": torch.float32}),
        Call(
            "causal_conv1d",
            modeling.causal_conv1d,
            lambda: {"x": rand(8, 5), "weight": rand(8, 4), "bias": rand(8), "row": row, "activation": "silu"},
        ),
        Call(
            "gated_delta_rule",
            modeling.gated_delta_rule,
            lambda: {
                "q": rand(5, 2, 4),
                "k": rand(5, 2, 4),
                "v": rand(5, 2, 4),
                "g": -rand(5, 2),
                "beta": rand(5, 2),
                "row": row,
                "chunk_size": 4,
            },
        ),
        Call(
            "head_log_probs",
            modeling.head_log_probs,
            lambda: {
                "hidden": torch.randn(5, 8),
                "weight": torch.randn(VOCAB, 8),
                "labels": torch.tensor([1, 2, 3, 4, 5]),
            },
        ),
        Call("packed_attention", _enter(modeling.packed_attention), lambda: {"model": _model(), "kernel": "auto"}),
        Call(
            "register_packed_module",
            modeling.register_packed_module,
            lambda: {"cls": type("SweepLayer", (torch.nn.Module,), {}), "packed_forward": lambda *a, **k: None},
        ),
        Call(
            "ssd_scan",
            modeling.ssd_scan,
            lambda: {
                "x": rand(5, 4, 8),
                "dt": rand(5, 4),
                "A": -rand(4) - 0.5,
                "B": rand(5, 1, 8),
                "C": rand(5, 1, 8),
                "row": row,
                "chunk_size": 4,
            },
        ),
        Call(
            "token_log_probs",
            modeling.token_log_probs,
            lambda: {"logits": torch.randn(4, 7), "labels": torch.tensor([1, 2, 3, 4])},
        ),
        Call(
            "use_packed_attention", modeling.use_packed_attention, lambda: {"model": _fresh_model(), "kernel": "auto"}
        ),
        # nopad.engines
        Call("ParallelDims", engines.ParallelDims, lambda: {"tp_size": 1, "cp_size": 2, "cp_rank": 1}),
        Call(
            "ThdPlan.from_lengths",
            engines.ThdPlan.from_lengths,
            lambda: {"lengths": [5, 3], "cp_size": 2, "cp_rank": 0},
        ),
        Call(
            "ThdPlan.from_nested",
            engines.ThdPlan.from_nested,
            lambda: {"input_ids_nested": _nested((5, 3)), "cp_size": 2},
        ),
        Call(
            "check_isolation",
            engines.check_isolation,
            lambda: {"model": _model(), "micro_batch": probe_batch(VOCAB, (3, 2))},
        ),
        Call(
            "chunked_head",
            _enter(engines.chunked_head),
            lambda: {"model": _model(), "output_args": _output_args(), "head": "auto", "chunk_size": 4},
        ),
        Call(
            "packed_logprobs",
            engines.packed_logprobs,
            lambda: {"model": _model(), "micro_batch": probe_batch(VOCAB, (3, 2, 4))},
        ),
        Call(
            "padded_logprobs",
            engines.padded_logprobs,
            lambda: {"model": _model(), "padded": make_padded_batch(3, 4, 3, seed=1), "temperature": 1.0},
        ),
        Call(
            "postprocess_thd",
            engines.postprocess_thd,
            lambda: dict(
                zip(("input_ids_nested", "packed_seq_params"), _thd()[::2], strict=True),
                output=torch.randn(1, 8, 2),
            ),
        ),
        Call(
            "preprocess_thd",
            engines.preprocess_thd,
            lambda: {"input_ids_nested": _nested((5, 3)), "cp_size": 2, "cp_rank": 0},
        ),
        Call(
            "prepare_model_inputs", engines.prepare_model_inputs, lambda: {"micro_batch": probe_batch(VOCAB, (3, 2, 4))}
        ),
        Call(
            "prepare_model_outputs",
            engines.prepare_model_outputs,
            lambda: {"logits": torch.randn(1, 9, VOCAB), "output_args": _output_args()},
        ),
        Call(
            "prepare_value_outputs",
            engines.prepare_value_outputs,
            lambda: {"values": torch.randn(1, 9, 1), "output_args": _output_args()},
        ),
        Call(
            "thd_logprobs",
            engines.thd_logprobs,
            lambda: dict(
                zip(("input_ids_nested", "plan", "packed_seq_params"), _thd(), strict=True),
                hidden=torch.randn(8, 1, 4),
                weight=torch.randn(VOCAB, 4),
            ),
        ),
        # nopad.losses
        Call(
            "LossConfig",
            losses.LossConfig,
            lambda: {"clip_ratio": 0.2, "loss_agg_mode": "token-mean", "entropy_coeff": 0.0},
        ),
        Call(
            "agg_loss",
            losses.agg_loss,
            lambda: {"loss_mat": ones.clone(), "loss_mask": ones.clone(), "loss_agg_mode": "token-mean"},
        ),
        Call(
            "compute_policy_loss",
            losses.compute_policy_loss,
            lambda: {"old_log_prob": z, "log_prob": z, "advantages": z, "response_mask": ones, "clip_ratio": 0.2},
        ),
        Call(
            "compute_value_loss",
            losses.compute_value_loss,
            lambda: {"vpreds": z, "returns": z, "values": z, "response_mask": ones, "cliprange_value": 0.5},
        ),
        Call("global_batch_info", losses.global_batch_info, lambda: {"response_mask": ones.clone()}),
        Call("kl_penalty", losses.kl_penalty, lambda: {"logprob": z, "ref_logprob": z, "kl_penalty": "k1"}),
        Call(
            "ppo_loss",
            losses.ppo_loss,
            lambda: dict(
                zip(("data", "model_output"), (lambda d, o: (d, {"log_probs": o}))(*_converted()), strict=True),
                config=None,
            ),
        ),
        Call(
            "sft_loss",
            losses.sft_loss,
            lambda: dict(
                zip(("data", "model_output"), (lambda d, o: (d, {"log_probs": o}))(*_converted()), strict=True),
                config=None,
            ),
        ),
        Call(
            "value_loss",
            losses.value_loss,
            lambda: dict(
                zip(("data", "model_output"), (lambda d, o: (d, {"values": o}))(*_converted()), strict=True),
                config=None,
            ),
        ),
        # nopad.parallel
        Call("cp_alignment", parallel.cp_alignment, lambda: {"tp_size": 1, "cp_size": 2, "cp_layout": "zigzag"}),
        Call("enable_ulysses", parallel.enable_ulysses, lambda: {"model": _fresh_model()}),
        Call(
            "gather_cp_shards",
            parallel.gather_cp_shards,
            lambda: {"local": torch.randn(4, 2), "cp_size": 1, "cp_rank": 0},
        ),
        Call("padded_length", parallel.padded_length, lambda: {"total": 10, "sp_size": 2, "pad_to_multiple": 4}),
        Call(
            "shard_index",
            parallel.shard_index,
            lambda: {
                "cu_seqlens_padded": torch.tensor([0, 4, 8]),
                "local_len": 4,
                "cp_size": 2,
                "cp_rank": 0,
                "cp_layout": "zigzag",
            },
        ),
        Call("slice_for_rank", parallel.slice_for_rank, lambda: {"x": torch.randn(2, 8), "sp_size": 2, "sp_rank": 0}),
        Call(
            "unshard_index",
            parallel.unshard_index,
            lambda: {
                "cu_seqlens_padded": torch.tensor([0, 4, 8]),
                "lengths": torch.tensor([3, 4]),
                "total": 7,
                "local_len": 4,
                "cp_size": 2,
                "cp_layout": "zigzag",
            },
        ),
        # nopad.packing
        Call("PreTokenized", packing.PreTokenized, lambda: {"vocab_size": 100, "pad_token_id": 0}),
        Call(
            "TokenizerIdentity", packing.TokenizerIdentity, lambda: {"name": "t", "vocab_hash": "abc", "vocab_size": 10}
        ),
        Call("check_packed", packing.check_packed, lambda: {"path": path}),
        Call(
            "collate_packed",
            packing.collate_packed,
            lambda: {"rows": _packed_rows(), "pad_token_id": 0, "alignment": 1},
        ),
        Call(
            "encode_record",
            packing.encode_record,
            lambda: {"record": {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, "tokenizer": packing.ByteTokenizer()},
        ),
        Call("load_tokenizer", packing.load_tokenizer, lambda: {"path": None}),
        Call(
            "pack_conversations",
            packing.pack_conversations,
            lambda: {
                "conversations": [([1, 2, 3], [0, 1, 1]), ([4, 5], [1, 1])],
                "pack_length": 8,
                "alignment": 1,
                "pad_token_id": 0,
            },
        ),
        Call("pack_lengths", packing.pack_lengths, lambda: {"lengths": [3, 5, 2], "capacity": 8, "min_bins": 1}),
        Call(
            "pack_online",
            packing.pack_online,
            lambda: {"input_ids": _nested((3, 2, 4)), "pack_length": 8, "loss_mask": _nested((3, 2, 4), vocab=2)},
        ),
        Call("packed_to_nested", packing.packed_to_nested, lambda: {"batch": packing.collate_packed(_packed_rows())}),
        Call(
            "packed_to_thd",
            packing.packed_to_thd,
            lambda: {"batch": packing.collate_packed(_packed_rows()), "cp_size": 1},
        ),
        Call(
            "packing_metrics",
            packing.packing_metrics,
            lambda: {"bins": [[0, 1], [2]], "lengths": [6, 2, 4], "capacity": 10},
        ),
        Call("read_packed", packing.read_packed, lambda: {"path": path}),
        Call(
            "write_packed",
            packing.write_packed,
            lambda: {
                "path": str(tmp / "written.parquet"),
                "rows": _packed_rows(),
                "pack_length": 8,
                "tokenizer": packing.ByteTokenizer().identity,
                "pad_token_id": 0,
            },
        ),
        # nopad.synthetic
        Call(
            "synthetic_batch",
            synthetic.synthetic_batch,
            lambda: {"B": 2, "prompt_width": 3, "resp_width": 2, "vocab": 50},
        ),
        Call(
            "tiny_causal_lm",
            synthetic.tiny_causal_lm,
            lambda: {"arch": "llama", "vocab": 64, "hidden": 16, "layers": 1, "heads": 2, "kv_heads": 1},
        ),
    ]


# ---- the grid of bad inputs -----------------------------------------------------------------------
def _swap_dtype(x: torch.Tensor) -> torch.Tensor:
    return x.long() if x.dtype.is_floating_point else x.float()


def _bad_tensor(x: torch.Tensor) -> Iterator[tuple[str, Any]]:
    yield "None", None
    if getattr(x, "is_nested", False):
        yield "a dense tensor", x.values()
        yield "other dtype", torch.nested.nested_tensor_from_jagged(_swap_dtype(x.values()), x.offsets())
        return
    yield "other dtype", _swap_dtype(x)
    yield "a bool tensor", x.bool()
    yield "one more dim", x.unsqueeze(0)
    if x.dim() >= 1:
        yield "one dim less", x.reshape(-1)[0] if x.dim() == 1 else x[0]
        if x.shape[0] > 0:
            yield "empty", x[:0]
            yield "one row fewer", x[:-1]
    yield "a list", x.tolist()


def _bad_value(value: Any) -> Iterator[tuple[str, Any]]:
    """Typical bad inputs derived from a valid ``value``: (what it is, the value)."""
    if isinstance(value, torch.Tensor):
        yield from _bad_tensor(value)
    elif isinstance(value, TensorDict):
        yield "None", None
        yield "a dict", dict(value.items())
        try:
            yield "empty batch", value[:0]
        except Exception:  # noqa: BLE001 - a TensorDict of nested fields cannot take no rows itself
            pass
        for key in list(value.keys()):
            yield f"without {key}", value.exclude(key)
            field = value[key]
            if isinstance(field, torch.Tensor):
                changed = value.clone(False)
                try:
                    changed.set(key, next(bad for what, bad in _bad_tensor(field) if what == "other dtype"))
                except RuntimeError:  # a field TensorDict itself cannot take back (not of the batch's rows)
                    continue
                yield f"{key} of other dtype", changed
    elif isinstance(value, bool):
        yield "a string", "yes"
        yield "None", None
    elif isinstance(value, (int, np.integer)):
        yield "-1", -1
        yield "0", 0
        yield "a float", float(value) + 0.5
        yield "None", None
    elif isinstance(value, float):
        yield "-1.0", -1.0
        yield "nan", math.nan
        yield "a string", "1"
        yield "None", None
    elif isinstance(value, str):
        yield "unknown", "bogus"
        yield "an int", 3
        yield "None", None
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
        yield "floats", [v + 0.5 for v in value]
        yield "a negative item", [-1, *value[1:]]
        yield "empty", []
        yield "one item fewer", list(value[:-1])
        yield "a nested list", [list(value)]
        yield "None", None
    elif isinstance(value, (list, tuple)):
        yield "None", None
        yield "empty", []
        yield "an int", 3
    elif isinstance(value, dict):
        yield "None", None
        yield "a list", list(value.values())
        for key, item in value.items():
            yield f"without {key}", {k: v for k, v in value.items() if k != key}
            if isinstance(item, torch.Tensor):
                yield f"{key} None", {**value, key: None}
                if not getattr(item, "is_nested", False):
                    yield f"{key} of other dtype", {**value, key: _swap_dtype(item)}
    elif isinstance(value, torch.nn.Module):
        yield "None", None
        yield "a Linear", torch.nn.Linear(2, 2)
    elif value is not None:
        yield "None", None
        yield "an int", 3


def _cases(tmp: Any) -> Iterator[tuple[str, Call, str, Callable[[], dict[str, Any]]]]:
    for call in _calls(tmp):
        for arg, value in call.make().items():
            for what, _ in _bad_value(value):

                def make(call=call, arg=arg, what=what) -> dict[str, Any]:
                    kwargs = call.make()
                    bad = dict(_bad_value(kwargs[arg]))[what]
                    if arg == "path" and isinstance(bad, str):  # a path nothing is at, never written to
                        bad = str(tmp / "no such folder" / bad)
                    return {**kwargs, arg: bad}

                yield f"{call.name}({arg}={what})", call, arg, make


def _outcome(fn: Callable[..., Any], kwargs: dict[str, Any]) -> BaseException | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(**kwargs)
    except Exception as error:  # noqa: BLE001 - the sweep sorts what comes
        return error
    return None


def _is_nopads(error: BaseException) -> bool:
    """nopad's refusal; or, for a file that is not there, the FileNotFoundError the packed-file
    readers document (naming the path)."""
    if isinstance(error, FileNotFoundError):
        return "no such folder" in str(error)
    return type(error) is ValueError and NOPAD_WORDS.match(str(error)) is not None


def sweep(tmp: Any) -> tuple[dict[tuple[str, str, str], str], int]:
    """The weak messages ((callable, argument, "<bad input>: <exception type>") -> the message) and
    the number of bad calls made."""
    weak: dict[tuple[str, str, str], str] = {}
    made = 0
    for name, call, arg, make in _cases(tmp):
        error = _outcome(call.fn, make())
        made += 1
        if error is not None and not _is_nopads(error):
            what = name[len(call.name) + len(arg) + 2 : -1]
            weak[call.name, arg, f"{what}: {type(error).__name__}"] = str(error).split("\n")[0][:200]
    return weak, made


def test_every_valid_call_of_the_sweep_is_served(tmp_path):
    for call in _calls(tmp_path):
        error = _outcome(call.fn, call.make())
        assert error is None, f"{call.name}: {error!r}"


def test_every_public_callable_is_swept(tmp_path):
    swept = {c.name.split(".")[0] for c in _calls(tmp_path)}
    modules = (core, batches, modeling, engines, losses, parallel, packing, synthetic)
    public = {name for m in modules for name in m.__all__ if callable(getattr(m, name))}
    # classes swept by their constructors above; no arguments; a process group needed (gather_seq)
    unswept = {"IndexPlan", "ThdPlan", "PackedRow", "ByteTokenizer", "from_parallel_state", "OpCounter", "gather_seq"}
    assert public - swept <= unswept


def test_at_most_ten_weak_messages_are_left_each_listed_by_name(tmp_path):
    weak, made = sweep(tmp_path)
    assert made > 1000
    new = [
        f"{name}({arg}={what})  {words}"
        for (name, arg, what), words in sorted(weak.items())
        if arg not in WEAK_LEFT.get(name, ("", set()))[1]
    ]
    assert not new, "weak messages (refuse each at the edge with input_error):\n" + "\n".join(new)
    assert len(WEAK_LEFT) <= MOST_LEFT


if __name__ == "__main__":  # python -m tests.test_bad_input_sweep: the weak messages, one a line
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        weak, made = sweep(Path(tmp))
    for (name, arg, what), words in sorted(weak.items()):
        print(f"{name}({arg}={what})  |  {words}")
    print(f"{len(weak)} weak of {made} bad calls")
