"""verl alone against verl under install(): every routed row function, on randomized TensorDicts of
every field and metadata kind verl's batches hold, the results compared bit for bit and refusals too.

Each example builds its inputs twice from one description (tests/verl_differential.py), calls verl's
function through verl's own module once under ``install()`` and once without, and requires the same
outcome: both results equal as a verl user sees them (types, keys in order, batch sizes, devices,
dtypes, shapes, bytes, nested offsets and ragged dims, NonTensorData / NonTensorStack values), or
both calls refused. The one place nopad answers where verl raises is listed in ``VERL_CANNOT`` (with
the reference nopad's answer is checked against). Runs in CI's verl leg; the last test writes the
number of cases and the kinds they covered to the log.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:
    import verl.single_controller.base.decorator as decorator
    import verl.utils.seqlen_balancing as sb
    import verl.utils.tensordict_utils as tu
    import verl.workers.engine.utils as engine_utils
    import verl.workers.utils.padding as vpad
except Exception as exc:  # noqa: BLE001 - any failure to import verl means this leg cannot run
    if os.environ.get("NOPAD_REQUIRE_VERL") == "1":
        raise
    pytest.skip(f"verl is not importable here ({exc!r}); these tests run in CI's verl leg", allow_module_level=True)

from tensordict import NonTensorData, TensorDict  # noqa: E402

# private: the installer's routes are compared with verl's own functions
from nopad.integrations.verl import _install as nv  # noqa: E402
from tests.batches import batch_shapes, make_batch  # noqa: E402
from tests.verl_differential import (  # noqa: E402
    Kinds,
    Part,
    assert_same,
    build,
    concat_parts,
    outcome,
    parts,
    raised_here,
)

CASES: Counter = Counter()  # (function, outcome) -> count
KINDS = Kinds()
EXAMPLES = settings(
    max_examples=int(os.environ.get("NOPAD_VERL_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture(autouse=True, scope="module")
def no_handle():
    if nv.active() is not None:
        nv.active().uninstall()
    yield
    if nv.active() is not None:
        nv.active().uninstall()


# verl raises where nopad answers, for these reasons only: tensordict 0.10 cannot slice a TensorDict
# with nested fields (``data[:k]``, which verl's pad_to_divisor and unpad use). nopad gives the rows
# verl means, checked against verl's own index_select_tensor_dict of those rows.
VERL_CANNOT = (
    "slice(): not supported for NestedTensor on dim=0",
    "NestedTensor slice_tensor(self: jt, dim: any?, start: any?, end: any?, step: any?)",
)


# Routes that give verl's own function every input nopad does not serve (a divisor < 1, a pad size
# outside [0, rows], partitions nopad's arrays do not take): their refusals are verl's, exception type
# included (issue 36: nopad's routes had answered a negative pad size and more parts than items).
VERLS_REFUSALS = ("pad_to_divisor", "unpad", "karmarkar_karp", "get_seqlen_balanced_partitions")


def differential(name: str, call, reference=None):
    """``call()`` under install() and alone (each builds its own inputs): the same outcome, compared.
    ``reference()``: what verl means where it cannot (``VERL_CANNOT``), computed with verl alone."""
    with nv.install():
        ours = outcome(call)
    theirs = outcome(call)
    if theirs[0] == "ok":
        assert ours[0] == "ok", f"{name}: verl answers, nopad raised {ours[1]!r}"
        assert_same(theirs[1], ours[1], name, KINDS)
        CASES[name, "equal"] += 1
    elif ours[0] == "error":
        for who, exc in (("verl", theirs[1]), ("nopad", ours[1])):  # a refusal, not this test's own error
            assert not raised_here(exc), f"{name}: {who}'s call failed in the test itself: {exc!r}"
        if name in VERLS_REFUSALS:
            assert type(ours[1]) is type(theirs[1]), f"{name}: verl raised {theirs[1]!r}, nopad {ours[1]!r}"
        CASES[name, f"both refuse ({type(theirs[1]).__name__})"] += 1
    else:
        message = str(theirs[1])
        assert reference is not None and any(m in message for m in VERL_CANNOT), (
            f"{name}: verl raised {theirs[1]!r}, nopad answered"
        )
        assert_same(reference(), ours[1], name, KINDS)
        CASES[name, "verl cannot slice nested, nopad = verl's index_select"] += 1
    return theirs, ours


# ---- tensordict_utils ------------------------------------------------------------------------------
@EXAMPLES
@given(part=parts(rows=st.integers(0, 6)), data=st.data())
def test_index_select_tensor_dict(part, data):
    B = part.rows
    rows = data.draw(
        st.lists(st.integers(-B, B - 1), min_size=data.draw(st.sampled_from([1] * 5 + [0])), max_size=2 * B + 1)
        if B
        else st.just([])
    )
    form = data.draw(st.sampled_from(["list", "list", "int64", "int32", "2-D"]))

    def indices():
        if form == "list":
            return list(rows)
        if form == "2-D":
            return torch.tensor(rows, dtype=torch.int64).view(1, -1)
        return torch.tensor(rows, dtype=getattr(torch, form))

    differential("index_select_tensor_dict", lambda: tu.index_select_tensor_dict(build(part), indices()))


def test_index_select_of_none_is_none():
    differential("index_select_tensor_dict", lambda: tu.index_select_tensor_dict(None, [0, 1]))


def divisor_or_not(data, B, most=7):
    """Mostly a divisor of B (verl's callers pass one), sometimes any count."""
    divisors = [d for d in range(1, B + 1) if B % d == 0] or [1]
    return data.draw(st.sampled_from(divisors) if data.draw(st.integers(0, 3)) else st.integers(1, most))


@EXAMPLES
@given(part=parts(rows=st.integers(0, 6)), data=st.data())
def test_chunk_tensordict(part, data):
    chunks = divisor_or_not(data, part.rows)
    differential("chunk_tensordict", lambda: tu.chunk_tensordict(build(part), chunks))


@EXAMPLES
@given(ps=concat_parts())
def test_concat_tensordict(ps):
    differential("concat_tensordict", lambda: tu.concat_tensordict([build(p) for p in ps]))


@EXAMPLES
@given(ps=concat_parts())
def test_concat_nested_tensors(ps):
    keys = [f.key for f in ps[0].fields if f.kind in ("nested", "mrope")]
    for key in keys:
        differential(
            "concat_nested_tensors",
            lambda key=key: tu.concat_nested_tensors([build(p).get(key, torch.zeros(1)) for p in ps]),
        )
    if not keys and ps[0].seed % 8 == 0:  # dense tensors: verl asserts
        differential("concat_nested_tensors", lambda: tu.concat_nested_tensors([torch.zeros(2, 3)]))


def test_concat_of_metadata_only_tensordicts_and_of_nothing():
    meta = [Part(((),), (), seed=s, batch_dims=0) for s in range(3)]
    differential("concat_tensordict", lambda: tu.concat_tensordict([build(p) for p in meta]))
    differential("concat_tensordict", lambda: tu.concat_tensordict([]))


def _nested_keys(td):
    return [k for k, v in td.items() if isinstance(v, torch.Tensor) and v.is_nested]


def _verl_with_nested_rows(td, verl_result, rows):
    """What verl means where it cannot slice nested fields: its own function's result for every other
    field, and the nested fields' ``rows`` as verl's own index_select_tensor_dict selects them."""
    nested = tu.index_select_tensor_dict(td.select(*_nested_keys(td)), rows)
    out = TensorDict({}, batch_size=verl_result.batch_size, device=verl_result.device)
    for key in td.keys():
        out.set(key, nested.get(key) if key in nested.keys() else verl_result.get(key))
    return out


def _verl_with_no_rows(td, verl_result):
    """What verl means by ``data[:0]`` where it cannot slice nested fields (its index_select cannot
    build none): its own result for every other field, each nested field's first 0 rows."""
    out = TensorDict({}, batch_size=verl_result.batch_size, device=verl_result.device)
    for key in td.keys():
        value = td.get(key)
        if isinstance(value, torch.Tensor) and value.is_nested:
            ragged = value._ragged_idx
            none = value.values().narrow(ragged - 1, 0, 0)
            value = torch.nested.nested_tensor_from_jagged(none, value.offsets()[:1], jagged_dim=ragged)
        else:
            value = verl_result.get(key)
        out.set(key, value)
    return out


@EXAMPLES
@given(part=parts(rows=st.integers(0, 6)), divisor=st.integers(-3, 13), cut=st.integers(-2, 7))
def test_pad_to_divisor_and_unpad(part, divisor, cut):
    """Every row unpadded is served as verl's slice means it (issue 36: refused before); a divisor
    below 1 and a pad size outside [0, rows] are refused as verl refuses them."""

    def reference_pad():
        td = build(part)
        rest, pad = tu.pad_to_divisor(td.exclude(*_nested_keys(td)), divisor)
        rows = list(range(len(td))) + [i % len(td) for i in range(pad)]
        return _verl_with_nested_rows(td, rest, rows), pad

    def reference_unpad():
        td = build(part)
        rest = tu.unpad(td.exclude(*_nested_keys(td)), cut)
        if cut == len(td):
            return _verl_with_no_rows(td, rest)
        return _verl_with_nested_rows(td, rest, list(range(len(td)))[:-cut])

    differential("pad_to_divisor", lambda: tu.pad_to_divisor(build(part), divisor), reference=reference_pad)
    differential("unpad", lambda: tu.unpad(build(part), cut), reference=reference_unpad)


def test_unpad_of_every_row_is_a_batch_of_none_as_verls_slice_means():
    def batch():
        ids = torch.nested.nested_tensor_from_jagged(torch.arange(6), torch.tensor([0, 2, 5, 6]))
        return TensorDict({"input_ids": ids, "x": torch.ones(3, 2)}, [3])

    def reference():
        return _verl_with_no_rows(batch(), tu.unpad(batch().exclude("input_ids"), 3))

    _, ours = differential("unpad", lambda: tu.unpad(batch(), 3), reference=reference)
    assert ours[0] == "ok" and len(ours[1]) == 0 and ours[1]["input_ids"].offsets().tolist() == [0]


@EXAMPLES
@given(part=parts(rows=st.integers(1, 8)), data=st.data())
def test_make_iterator(part, data):
    B = part.rows
    mini = data.draw(st.sampled_from([d for d in range(1, B + 1) if B % d == 0]))
    shuffle, seed = data.draw(st.booleans()), data.draw(st.integers(0, 3))
    differential(
        "make_iterator",
        lambda: list(tu.make_iterator(build(part), mini, epochs=2, seed=seed, dataloader_kwargs={"shuffle": shuffle})),
    )


# ---- the worker group's dispatch and collect (BatchData chunk / concat) ---------------------------
@EXAMPLES
@given(part=parts(rows=st.integers(1, 8), sub=False), data=st.data())
def test_dp_dispatch_and_collect(part, data):
    """verl's worker group splits a TensorDict for its DP ranks and concatenates what they return."""
    dp = data.draw(
        st.sampled_from([d for d in (1, 2, 4) if part.rows % d == 0])
        if data.draw(st.integers(0, 3))
        else st.sampled_from([2, 4])
    )

    def split():
        args, kwargs = decorator._split_args_kwargs_data_proto(dp, build(part), data=build(part))
        return args, kwargs

    def round_trip():
        (chunks,), _ = decorator._split_args_kwargs_data_proto(dp, build(part))
        return decorator._concat_data_proto_or_future(list(chunks))

    differential("_split_args_kwargs_data_proto", split)
    differential("_concat_data_proto_or_future", round_trip)


# ---- seqlen_balancing and the engines' micro-batches -----------------------------------------------
@EXAMPLES
@given(part=parts(rows=st.integers(1, 10), nested=True, sub=False), data=st.data())
def test_rearrange_micro_batches_and_restore(part, data):
    lengths = part.lengths[0]
    budget = max(max(lengths), 1) + data.draw(st.integers(-1, 12))
    kwargs = data.draw(
        st.fixed_dictionaries(
            {},
            optional={
                "num_batches_divided_by": st.integers(1, 3),
                "min_num_micro_batch": st.integers(1, 4),
                "use_dynamic_bsz_balance": st.booleans(),
                "force_group_size": st.sampled_from([1, 2]),
            },
        )
    )
    theirs, ours = differential(
        "rearrange_micro_batches", lambda: sb.rearrange_micro_batches(build(part), budget, **kwargs)
    )
    if theirs[0] == "ok":
        partitions = theirs[1][1]
        joined = lambda: tu.concat_nested_tensors(
            [
                m["input_ids"]
                for m in tu.chunk_tensordict(  # noqa: E731
                    tu.index_select_tensor_dict(build(part), [i for p in partitions for i in p]), 1
                )
            ]
        )
        differential("restore_dynamic_batch", lambda: sb.restore_dynamic_batch(joined(), partitions))
        dense = lambda: torch.arange(len(lengths))[[i for p in partitions for i in p]]  # noqa: E731
        differential("restore_dynamic_batch", lambda: sb.restore_dynamic_batch(dense(), partitions))


@EXAMPLES
@given(
    part=parts(rows=st.integers(1, 8), nested=True, sub=False, mrope=True),
    dynamic=st.booleans(),
    extra=st.integers(0, 9),
    outputs=st.sampled_from(["2-D", "2-D", "3-D", "3-D", "dense", "none"]),
    data=st.data(),
)
def test_prepare_micro_batches_and_postprocess_batch_func(part, dynamic, extra, outputs, data):
    """The engine's micro-batch path: prepare_micro_batches -> a step per micro-batch ->
    postprocess_batch_func, with verl's metrics and losses."""
    B = part.rows
    micro = data.draw(st.sampled_from([d for d in range(1, B + 1) if B % d == 0]))

    def batch():
        td = build(part)
        td["use_dynamic_bsz"] = NonTensorData(dynamic)
        td["max_token_len_per_gpu"] = NonTensorData(max(part.lengths[0]) + extra)
        td["micro_batch_size_per_gpu"] = NonTensorData(micro)
        return td

    def step(m, i):
        ids = m["input_ids"]
        out = {"loss": torch.tensor(float(i)), "metrics": {"n": len(m), "mfu": [0.1 * i]}}
        if outputs == "none":
            return out
        values = ids.values().float() * 0.5
        if outputs == "3-D":
            values = values.unsqueeze(-1).repeat(1, 2)
        lp = torch.nested.nested_tensor_from_jagged(values, ids.offsets())
        if outputs == "dense":
            lp = torch.randn(len(m), generator=torch.Generator().manual_seed(i))
        out["model_output"] = {"log_probs": lp, "entropy": lp + 1}
        return out

    def run():
        td = batch()
        micro_batches, indices = engine_utils.prepare_micro_batches(td, use_dynamic_bsz_balance=True)
        outs = [step(m, i) for i, m in enumerate(micro_batches)]
        return micro_batches, indices, engine_utils.postprocess_batch_func(outs, indices, td)

    differential("prepare_micro_batches + postprocess_batch_func", run)


# ---- the padding conversions, metadata carried along ------------------------------------------------
@EXAMPLES
@given(shape=batch_shapes(), meta=parts(rows=st.just(1), nested=False, sub=False), chunks=st.sampled_from([1, 2]))
def test_left_right_2_no_padding_then_rows(shape, meta, chunks):
    """A padded batch with metadata, converted, then cut and joined as verl's trainer does."""
    prompt_lens, resp_lens, P, R = shape

    def padded():
        td = make_batch(prompt_lens, resp_lens, P, R, extras=False)
        for f in meta.fields:
            if f.kind == "data":
                td[f.key] = build(Part(((0,) * len(prompt_lens),), (f,), seed=meta.seed)).get(f.key)
        return td

    B = len(prompt_lens)
    n = chunks if B % chunks == 0 else 1
    differential("left_right_2_no_padding", lambda: vpad.left_right_2_no_padding(padded()))
    differential(
        "left_right_2_no_padding -> chunk -> concat",
        lambda: tu.concat_tensordict(list(tu.chunk_tensordict(vpad.left_right_2_no_padding(padded()), n))),
    )


@EXAMPLES
@given(shape=batch_shapes(), trailing=st.sampled_from([(), (3,)]), width=st.booleans())
def test_the_padding_conversions_after_left_right_2_no_padding(shape, trailing, width):
    """The model-output side of verl's padding module, on the batch its own conversion made: a nested
    output (and its flat values) back to padded responses, responses to and from nested, the mask."""
    prompt_lens, resp_lens, P, R = shape
    B = len(prompt_lens)

    def padded():
        td = make_batch(prompt_lens, resp_lens, P, R, extras=False)
        td["prompts"], td["responses"] = td["input_ids"][:, :P], td["input_ids"][:, P:]
        return td

    if min(prompt_lens) == 0:  # a row of pure padding: the conversions, compared as they are
        differential("left_right_2_no_padding", lambda: vpad.left_right_2_no_padding(padded()))
        return

    def converted():
        data = vpad.left_right_2_no_padding(padded())
        offsets = data["input_ids"].offsets()
        g = torch.Generator().manual_seed(B)
        values = torch.randn(int(offsets[-1]), *trailing, generator=g)
        out = torch.nested.nested_tensor_from_jagged(values, offsets.to(torch.int64))
        resp = torch.nested.as_nested_tensor([torch.ones(n) for n in resp_lens], layout=torch.jagged)
        return data, out, resp

    def padded_response():
        return torch.randn(B, R, *trailing, generator=torch.Generator().manual_seed(B + 1))

    def on_converted(f):
        return lambda: f(*converted())

    differential("no_padding_2_padding", on_converted(lambda data, out, resp: vpad.no_padding_2_padding(out, data)))
    differential(
        "no_padding_2_padding", on_converted(lambda data, out, resp: vpad.no_padding_2_padding(out.values(), data))
    )
    differential("response_from_nested", on_converted(lambda data, out, resp: vpad.response_from_nested(out, resp)))
    differential(
        "response_to_nested", on_converted(lambda data, out, resp: vpad.response_to_nested(padded_response(), resp))
    )
    size = (P + R) if width else None
    differential(
        "build_attention_mask_from_nested",
        on_converted(lambda data, out, resp: vpad.build_attention_mask_from_nested(data["input_ids"], size)),
    )


@EXAMPLES
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    negative=st.booleans(),
    holes=st.integers(0, 5),
    data=st.data(),
)
def test_embeds_padding_2_no_padding(lengths, negative, holes, data):
    S = max(lengths) + data.draw(st.integers(0, 2))
    B = len(lengths)

    def batch():
        g = torch.Generator().manual_seed(B)
        mask = (torch.arange(S) < torch.tensor(lengths).unsqueeze(1)).long()  # [1 1 1 0 0]: verl's form
        if holes == 0 and S:  # sometimes a hole inside a row
            mask[0, 0] = 0 if mask[0].sum() > 1 else mask[0, 0]
        td = TensorDict({"prompt_embeds": torch.randn(B, S, 2, generator=g), "prompt_embeds_mask": mask}, [B])
        if negative:
            td["negative_prompt_embeds"] = torch.randn(B, S, 2, generator=g)
            td["negative_prompt_embeds_mask"] = mask.flip(0)
        return td

    differential("embeds_padding_2_no_padding", lambda: vpad.embeds_padding_2_no_padding(batch()))


class _ParallelState:
    """megatron-core's parallel_state as verl reads it, for one rank of a TP x CP grid (no group)."""

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


@EXAMPLES
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    trailing=st.sampled_from([(), (3,)]),
    grid=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]),
    need_roll=st.booleans(),
    fp8=st.booleans(),
    bucket=st.sampled_from([None, 8, 16]),
    data=st.data(),
)
def test_preprocess_and_postprocess_thd_engine(lengths, trailing, grid, need_roll, fp8, bucket, data):
    """verl's THD conversion for Megatron on one rank of a TP x CP grid (megatron's parallel_state
    stubbed as verl reads it); back from THD where no CP gather is needed."""
    util = pytest.importorskip("verl.models.mcore.util")
    tp, cp = grid
    rank = data.draw(st.integers(0, cp - 1))
    saved = getattr(util, "mpu", None)
    util.mpu = _ParallelState(tp, cp, rank)
    try:

        def input_ids():
            values = torch.randint(1, 1000, (sum(lengths), *trailing), generator=torch.Generator().manual_seed(3))
            offsets = torch.tensor([0, *np.cumsum(lengths)])
            return torch.nested.nested_tensor_from_jagged(values, offsets)

        kwargs = dict(need_roll=need_roll, use_fp8_padding=fp8, pad_to_length_bucket=bucket)
        theirs, _ = differential("preprocess_thd_engine", lambda: util.preprocess_thd_engine(input_ids(), **kwargs))
        if cp == 1 and theirs[0] == "ok":

            def round_trip():
                ids = input_ids()
                tokens, params, _ = util.preprocess_thd_engine(ids, **kwargs)
                output = tokens.float() * 0.5
                return util.postprocess_thd_engine(output, params, ids, len(lengths))

            differential("postprocess_thd_engine", round_trip)
    finally:
        util.mpu = saved


# ---- karmarkar_karp and the balanced partitions ------------------------------------------------------
@EXAMPLES
@given(
    values=st.lists(st.integers(0, 50), min_size=1, max_size=24)
    | st.lists(st.integers(-5, 50) | st.floats(0, 50, allow_nan=False), min_size=1, max_size=8),
    data=st.data(),
)
def test_partitions(values, data):
    """Lists, tensors and arrays; k up to one more than the items (issue 36: a tensor's k > n was
    refused by nopad where verl answers), sometimes a bool k or flag, as verl takes them."""
    k = data.draw(st.integers(1, len(values) + 1) | st.just(True))
    equal = data.draw(st.booleans() | st.sampled_from([0, 1]))
    form = data.draw(st.sampled_from([list, list, torch.tensor, np.array]))
    differential("karmarkar_karp", lambda: sb.karmarkar_karp(form(values), k, equal))
    differential("get_seqlen_balanced_partitions", lambda: sb.get_seqlen_balanced_partitions(form(values), k, equal))


# ---- what the cases covered --------------------------------------------------------------------------
def test_report_cases_and_kinds(capsys):
    """The count of compared cases per function and outcome, and the kinds of values compared: every
    function ran, and every kind of field came through somewhere."""
    if not CASES:
        pytest.skip("run with the rest of this module")
    total = sum(CASES.values())
    lines = [f"verl differential: {total} cases (verl alone vs install())"]
    lines += [f"  {name}: {result}: {count}" for (name, result), count in sorted(CASES.items())]
    lines.append("  values compared: " + ", ".join(f"{k} {v}" for k, v in sorted(KINDS.items())))
    with capsys.disabled():  # into CI's log
        print("\n" + "\n".join(lines))
    functions = {name for name, _ in CASES}
    assert len(functions) >= 14, functions
    for kind in ("NonTensorData", "NonTensorStack", "nested (B, C, j)", "nested 2-D (B, j, ...)", "dense tensor"):
        assert KINDS[kind] > 0, kind
