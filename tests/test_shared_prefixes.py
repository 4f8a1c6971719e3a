"""A GRPO group's shared prompt computed once (issue 38, first slice): the layout, its attention, exactness.

The pieces are private until the issue is complete (tests/test_api.py caps the public API), so this
file imports them from their private modules.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nopad.batches import _prefixes
from nopad.batches._prefixes import join_prompts, plan_shared_prefixes
from nopad.core._torch_internals import wrap_jagged
from nopad.diagnostics import OpCounter
from nopad.modeling._prefixes import use_shared_prefix_attention
from tests.models import tiny_llama

VOCAB = 97


def nested(rows: list[list[int]]) -> torch.Tensor:
    values = torch.tensor([t for row in rows for t in row], dtype=torch.int64)
    offsets = torch.tensor([0] + [len(row) for row in rows]).cumsum(0)
    return wrap_jagged(values, offsets)


def grpo_rows(seed: int, prompt_lens: list[int], group_sizes: list[int], max_completion: int, vocab: int = VOCAB):
    """Rows of several groups (a prompt each, sampled ``group_sizes[g]`` times), shuffled. Returns
    (prompts, completions) as lists of token lists."""
    rng = random.Random(seed)
    rows = []
    for p_len, n in zip(prompt_lens, group_sizes):
        prompt = [rng.randrange(1, vocab) for _ in range(p_len)]
        rows += [(prompt, [rng.randrange(1, vocab) for _ in range(rng.randint(0, max_completion))]) for _ in range(n)]
    rng.shuffle(rows)
    return [p for p, _ in rows], [c for _, c in rows]


# ---- the layout ------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    vocab = draw(st.integers(2, 4))  # a small vocabulary: unequal prompts that share tokens and lengths
    distinct = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4), min_size=1, max_size=4))
    rows = draw(
        st.lists(
            st.tuples(st.sampled_from(distinct), st.lists(st.integers(0, vocab - 1), max_size=4)),
            min_size=1,
            max_size=12,
        )
    )
    return [p for p, _ in rows], [c for _, c in rows]


def check_layout(plan, prompts, completions, values):
    packed = plan.pack(values)
    assert torch.equal(plan.unpack(packed), values)  # rows -> shared layout -> rows
    distinct = {tuple(p) for p in prompts}
    assert plan.groups == len(distinct)
    assert plan.total == sum(len(p) for p in distinct) + sum(len(c) for c in completions)
    by_prompt = {}
    for row, prompt in enumerate(prompts):  # equal prompts share a group, unequal ones never do
        assert by_prompt.setdefault(tuple(prompt), int(plan.group[row])) == int(plan.group[row])
    assert len(set(by_prompt.values())) == len(distinct)
    positions = plan.unpack(plan.position_ids)
    expected = torch.cat([torch.arange(len(p) + len(c)) for p, c in zip(prompts, completions)])
    assert torch.equal(positions, expected)  # a completion continues from its prompt's length
    keys = packed.index_select(0, plan.kv_index)  # each row's keys: its prompt, then its completion
    order = plan.block_order.tolist()
    assert keys.tolist() == [t for r in order for t in prompts[r] + completions[r]]
    assert plan.cu_seqlens_k.diff().tolist() == [len(prompts[r]) + len(completions[r]) for r in order]
    # a completion token's label, and the packed token read for its log-prob: the one before it in its row
    assert values.index_select(0, plan.label_index).tolist() == [t for c in completions for t in c]
    before = [len(p) - 1 + t for p, c in zip(prompts, completions) for t in range(len(c))]
    assert plan.position_ids.index_select(0, plan.logprob_index).tolist() == before
    rows_of = plan.unpack(torch.arange(plan.total))  # the packed token each row token reads
    read = [
        int(rows_of[int(plan.row_offsets[r]) + t])
        for r, c in enumerate(completions)
        for t in range(len(prompts[r]) - 1, len(prompts[r]) - 1 + len(c))
    ]
    assert plan.logprob_index.tolist() == read


@settings(max_examples=60, deadline=None)
@given(batches())
def test_rows_to_shared_layout_and_back_give_the_inputs(batch):
    prompts, completions = batch
    input_ids, prompt_lengths = join_prompts(nested(prompts), nested(completions))
    values = input_ids.values()
    assert values.tolist() == [t for p, c in zip(prompts, completions) for t in p + c]
    assert prompt_lengths.tolist() == [len(p) for p in prompts]
    plan = plan_shared_prefixes(input_ids, prompt_lengths)
    check_layout(plan, prompts, completions, values)
    narrow = plan_shared_prefixes(wrap_jagged(values.int(), input_ids.offsets()), prompt_lengths)  # int32 ids
    assert torch.equal(narrow.pack_index, plan.pack_index)
    ids = {}
    group_ids = torch.tensor([ids.setdefault(tuple(p), 10 * len(ids) - 7) for p in prompts])
    given_plan = plan_shared_prefixes(input_ids, prompt_lengths, group_ids=group_ids)
    assert torch.equal(given_plan.pack_index, plan.pack_index)
    check_layout(given_plan, prompts, completions, values)


def test_a_hash_collision_costs_sharing_never_exactness(monkeypatch):
    prompts = [[1, 2], [2, 1], [1, 2], [3, 3], [2, 1]]
    completions = [[5], [6], [7, 8], [], [9]]
    # every prompt hashes alike: rows of equal length all collide, and the token check sorts them out
    monkeypatch.setattr(_prefixes, "prompt_keys", lambda *args: torch.zeros(args[-1], dtype=torch.int64))
    input_ids, prompt_lengths = join_prompts(nested(prompts), nested(completions))
    plan = plan_shared_prefixes(input_ids, prompt_lengths)
    assert plan.unpack(plan.pack(input_ids.values())).tolist() == input_ids.values().tolist()
    assert len(set(plan.group.tolist())) == 4 and plan.group[0] == plan.group[2]
    assert plan.group[1] != plan.group[0] and plan.group[3] != plan.group[0]  # never merged by the collision


def test_a_batch_without_shared_prompts_is_the_plain_packed_layout():
    prompts, completions = grpo_rows(0, [3, 1, 5, 2], [1, 1, 1, 1], 4)
    input_ids, prompt_lengths = join_prompts(nested(prompts), nested(completions))
    for plan in (
        plan_shared_prefixes(input_ids, prompt_lengths),
        plan_shared_prefixes(input_ids, prompt_lengths, share=False),
    ):
        assert not plan.shared and plan.groups == 4
        assert torch.equal(plan.pack_index, torch.arange(plan.rows_total))
        assert torch.equal(plan.cu_seqlens_q.long(), input_ids.offsets())
        assert torch.equal(plan.cu_seqlens_k, plan.cu_seqlens_q)


def test_wrong_group_ids_and_prompt_lengths_are_refused_by_name():
    prompts = [[1, 2], [1, 2], [1, 3], [4]]
    input_ids, prompt_lengths = join_prompts(nested(prompts), nested([[5], [6], [7], [8]]))
    with pytest.raises(ValueError, match=r"group_ids row 2: expected the prompt of row 0, whose group id 0"):
        plan_shared_prefixes(input_ids, prompt_lengths, group_ids=[0, 0, 0, 1])
    with pytest.raises(ValueError, match=r"group_ids row 3: expected the prompt of row 2"):
        plan_shared_prefixes(input_ids, prompt_lengths, group_ids=[0, 0, 1, 1])  # lengths differ
    with pytest.raises(ValueError, match=r"group_ids: expected \(4,\) one per row"):
        plan_shared_prefixes(input_ids, prompt_lengths, group_ids=[0, 0, 1])
    with pytest.raises(ValueError, match=r"prompt_lengths row 1: expected a prompt of at least 1 token"):
        plan_shared_prefixes(input_ids, [2, 0, 2, 1])
    with pytest.raises(ValueError, match=r"prompt_lengths row 3: expected a prompt of at least 1 token"):
        plan_shared_prefixes(input_ids, [2, 2, 2, 3])
    with pytest.raises(
        ValueError,
        match=r"prompt_lengths row 0: expected .*, got 9 of the row's 3 tokens",
    ):
        plan_shared_prefixes(input_ids, [9, 2, 2, 1])
    with pytest.raises(ValueError, match=r"prompt_lengths row 2: expected a prompt of at least 1 token"):
        plan_shared_prefixes(input_ids, [2, 2, -1, 1])
    with pytest.raises(ValueError, match=r"input_ids: expected a jagged nested tensor"):
        plan_shared_prefixes(torch.ones(4, 3, dtype=torch.int64), [1, 1, 1, 1])


def test_the_plan_is_a_fixed_number_of_ops_and_one_sync_whatever_the_rows():
    counts = []
    for rows in (8, 512):
        groups = rows // 8  # groups of 1 to 8 rows, prompts of 1 to 9 tokens
        prompts, completions = grpo_rows(
            rows, [1 + g % 9 for g in range(groups)], [1 + g % 8 for g in range(groups)], 6
        )
        prompts, completions = (prompts * 8)[:rows], (completions * 8)[:rows]
        prompts, completions = nested(prompts), nested(completions)
        with OpCounter() as counter:
            plan_shared_prefixes(*join_prompts(prompts, completions))
        counts.append((counter.ops, counter.syncs))
    assert counts[0] == counts[1], counts
    assert counts[0][1] == 1, counts


# ---- a model over it ----------------------------------------------------------------------------


def completion_logprobs(logits_rows: torch.Tensor, plan, values: torch.Tensor) -> list[torch.Tensor]:
    """Per row, the log-prob of each completion token, read at the position before it (rows layout)."""
    logp = logits_rows.log_softmax(-1)
    out = []
    for r in range(plan.rows):
        start, p, c = int(plan.row_offsets[r]), int(plan.prompt_lengths[r]), int(plan.completion_lengths[r])
        at = torch.arange(start + p - 1, start + p + c - 1)
        out.append(logp[at].gather(1, values[at + 1].unsqueeze(1)).squeeze(1))
    return out


def plan_logprobs(logits: torch.Tensor, plan, values: torch.Tensor) -> list[torch.Tensor]:
    """The same from the packed logits by the plan's indices (no loop): each completion token's
    log-prob read at the packed token before it in its row, split per row."""
    read = logits.log_softmax(-1).index_select(0, plan.logprob_index)
    logps = read.gather(1, values.index_select(0, plan.label_index).unsqueeze(1)).squeeze(1)
    assert torch.equal(plan.completion_offsets.diff(), plan.completion_lengths)
    return list(logps.split(plan.completion_lengths.tolist()))


@pytest.mark.parametrize("tile", [128, 3])
def test_a_llama_on_the_shared_layout_equals_each_row_alone(tile):
    prompts, completions = grpo_rows(1, [1, 6, 4, 9, 2], [8, 1, 3, 2, 5], 7)
    input_ids, prompt_lengths = join_prompts(nested(prompts), nested(completions))
    values = input_ids.values()
    plan = plan_shared_prefixes(input_ids, prompt_lengths, tile=tile)
    assert plan.groups == 5 and plan.shared
    reference, model = tiny_llama(), use_shared_prefix_attention(tiny_llama())
    weights = torch.randn(plan.rows, 16, generator=torch.Generator().manual_seed(0))

    def loss_of(logps):
        return sum((lp * weights[r, : lp.shape[0]]).sum() for r, lp in enumerate(logps))

    out = model(
        input_ids=plan.pack(values)[None],
        position_ids=plan.position_ids[None],
        shared_prefixes=plan,
        use_cache=False,
        output_hidden_states=True,
    )
    hidden_rows = plan.unpack(out.hidden_states[-1][0])
    shared = completion_logprobs(plan.unpack(out.logits[0]), plan, values)
    for got, want in zip(plan_logprobs(out.logits[0], plan, values), shared):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    loss_of(shared).backward()
    alone_logps = []
    for r, (p, c) in enumerate(zip(prompts, completions)):
        alone = reference(input_ids=torch.tensor([p + c]), use_cache=False, output_hidden_states=True)
        start = int(plan.row_offsets[r])
        torch.testing.assert_close(
            hidden_rows[start : start + len(p) + len(c)], alone.hidden_states[-1][0], atol=1e-5, rtol=1e-5
        )
        row_plan = plan_shared_prefixes(nested([p + c]), [len(p)])
        alone_logps.append(completion_logprobs(alone.logits[0], row_plan, torch.tensor(p + c))[0])
    for got, want in zip(shared, alone_logps):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the n separate rows, packed without sharing: the same gradients of every parameter
    separate = use_shared_prefix_attention(tiny_llama())
    plain = plan_shared_prefixes(input_ids, prompt_lengths, share=False, tile=tile)
    logits = separate(
        input_ids=plain.pack(values)[None],
        position_ids=plain.position_ids[None],
        shared_prefixes=plain,
        use_cache=False,
    ).logits[0]
    loss_of(plan_logprobs(logits, plain, values)).backward()
    for (name, got), want in zip(model.named_parameters(), separate.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize(("family", "layer"), [("mamba", "MambaMixer"), ("jamba", "JambaMambaMixer")])
def test_a_state_layer_without_a_shared_prefix_form_is_refused_by_name(family, layer):
    """Mamba's selective scan (alone, or in Jamba's hybrid) has no form that takes a prompt's final
    state: refused by the layer's name, in transformers 5.10's layer shapes as in later ones."""
    from nopad._apps.families import tiny_model
    from nopad.modeling._routing import route_of

    model = tiny_model(family)
    if isinstance(model, str):
        pytest.skip(model)
    with pytest.raises(ValueError, match=rf"model: expected a model whose position-mixing layers are .*{layer} "):
        use_shared_prefix_attention(model)
    assert model.config._attn_implementation != "nopad_shared" and route_of(model) is None  # nothing changed


def test_the_attention_refuses_a_model_it_has_not_checked_and_a_missing_plan():
    from nopad.modeling._prefixes import register

    register()
    model = tiny_llama()
    model.config._attn_implementation = "nopad_shared"
    with pytest.raises(ValueError, match=r"LlamaAttention attention: expected a model given to use_shared_prefix"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    use_shared_prefix_attention(model)
    with pytest.raises(ValueError, match=r"shared_prefixes: expected the shared-prefix plan"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_a_sliding_window_applies_inside_each_row_as_alone():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=3,
    )
    reference = MistralForCausalLM(config).eval()
    model = MistralForCausalLM(MistralConfig(**config.to_dict())).eval()  # its own config: the switch is per config
    model.load_state_dict(reference.state_dict())
    use_shared_prefix_attention(model)
    prompts, completions = grpo_rows(2, [5, 1], [3, 2], 6)
    input_ids, prompt_lengths = join_prompts(nested(prompts), nested(completions))
    plan = plan_shared_prefixes(input_ids, prompt_lengths, tile=2)
    packed, positions = plan.pack(input_ids.values())[None], plan.position_ids[None]
    out = model(input_ids=packed, position_ids=positions, shared_prefixes=plan)
    rows = plan.unpack_nested(out.logits[0])
    for row, p, c in zip(rows.unbind(), prompts, completions):
        torch.testing.assert_close(row, reference(input_ids=torch.tensor([p + c])).logits[0], atol=1e-5, rtol=1e-5)


def test_the_attention_is_a_fixed_number_of_ops_whatever_the_rows():
    from nopad.modeling._prefixes import tiled_attention

    counts = []
    for rows in (8, 512):
        groups = range(rows // 8)
        prompts, completions = grpo_rows(rows, [1 + g % 9 for g in groups], [8] * len(groups), 6)
        plan = plan_shared_prefixes(*join_prompts(nested(prompts), nested(completions)), tile=4)
        q, k = torch.randn(plan.total, 4, 8), torch.randn(plan.total, 2, 8)
        with OpCounter() as counter:
            tiled_attention(q, k, k, plan, scale=0.3, window=5)
        counts.append((counter.ops, counter.syncs))
    assert counts[0] == counts[1] and counts[0][1] == 0, counts


def test_a_layer_type_it_does_not_serve_is_refused_by_name():
    model = tiny_llama()
    model.config.layer_types = ["chunked_attention", "full_attention"]  # as Llama 4's local layers say it
    with pytest.raises(ValueError, match=r"got LlamaForCausalLM's \['chunked_attention'\]"):
        use_shared_prefix_attention(model)


@settings(max_examples=40, deadline=None)
@given(batches(), st.integers(1, 5), st.one_of(st.none(), st.integers(1, 4)))
def test_the_tiled_attention_equals_causal_attention_over_each_row(batch, tile, window):
    from nopad.modeling._prefixes import tiled_attention

    prompts, completions = batch
    plan = plan_shared_prefixes(*join_prompts(nested(prompts), nested(completions)), tile=tile)
    gen = torch.Generator().manual_seed(plan.total)
    q, k, v = (torch.randn(plan.total, heads, 4, generator=gen, dtype=torch.float64) for heads in (4, 2, 2))
    got = plan.unpack(tiled_attention(q, k, v, plan, scale=0.7, window=window))
    rows_q, rows_k, rows_v = (plan.unpack(t) for t in (q, k, v))
    for r in range(plan.rows):
        span = slice(int(plan.row_offsets[r]), int(plan.row_offsets[r + 1]))
        n = span.stop - span.start
        at = torch.arange(n)
        allowed = (at[None] <= at[:, None]) & (at[None] > at[:, None] - (window or n))
        want = torch.nn.functional.scaled_dot_product_attention(
            *(t[span].transpose(0, 1) for t in (rows_q, rows_k, rows_v)), attn_mask=allowed, scale=0.7, enable_gqa=True
        )
        torch.testing.assert_close(got[span], want.transpose(0, 1))


# ---- the state-carrying layers: each completion continues from its prompt's final state ----------------


def shared_row(plan):
    from nopad.modeling._prefixes import shared_prefix_row

    return shared_prefix_row(plan)


def state_inputs(total: int, seed: int):
    """Random inputs of the three forms over ``total`` tokens (conv: 6 channels; GDN: 2 value heads over
    1 key head; SSD: 2 heads, 1 group), float32, leaves that require grad."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, low=-1.0, high=1.0):
        return (torch.rand(*shape, generator=gen) * (high - low) + low).requires_grad_()

    return {
        "conv": (rand(6, total), rand(6, 4), rand(6)),
        "gdn": (
            rand(total, 1, 4),
            rand(total, 1, 4),
            rand(total, 2, 3),
            rand(total, 2, low=-1, high=0),
            rand(total, 2, low=0),
        ),
        "ssd": (
            rand(total, 2, 3),
            rand(total, 2),
            rand(2, low=-2, high=-0.5),
            rand(total, 1, 4),
            rand(total, 1, 4),
            rand(total, 2, 3),
        ),
    }


def run_form(form: str, inputs, row, chunk: int, kernel_size: int):
    """(T, *) the form's output over ``row`` (tokens first), from per-token inputs and parameters."""
    from nopad.modeling._layers import causal_conv1d, gated_delta_rule, ssd_scan

    if form == "conv":
        x, weight, bias = inputs
        return causal_conv1d(x, weight[:, :kernel_size], bias, row, activation="silu").t()
    if form == "gdn":
        return gated_delta_rule(*inputs, row, chunk_size=chunk, use_qk_l2norm=True)
    x, dt, A, B, C, z = inputs
    D, dt_bias = torch.linspace(-1, 1, 2), torch.linspace(0.5, -0.5, 2)
    return ssd_scan(x, dt, A, B, C, row, chunk_size=chunk, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)


def per_token(form: str, inputs, index: torch.Tensor):
    """The inputs with their token axis gathered by ``index`` (parameters as they are)."""
    if form == "conv":
        x, weight, bias = inputs
        return (x.index_select(1, index), weight, bias)
    token_axis = {"gdn": (0, 1, 2, 3, 4), "ssd": (0, 1, 3, 4, 5)}[form]
    return tuple(t.index_select(0, index) if i in token_axis else t for i, t in enumerate(inputs))


@settings(max_examples=15, deadline=None)
@given(batches(), st.sampled_from(["conv", "gdn", "ssd"]), st.integers(1, 4), st.integers(1, 4))
def test_the_state_forms_on_the_shared_layout_equal_each_row_alone_forward_and_backward(
    batch, form, chunk, kernel_size
):
    from nopad.modeling._layers import PackedRow

    prompts, completions = batch
    plan = plan_shared_prefixes(*join_prompts(nested(prompts), nested(completions)))
    inputs = state_inputs(plan.total, seed=plan.total)[form]
    weights = torch.randn(plan.rows_total, generator=torch.Generator().manual_seed(1))
    got = plan.unpack(run_form(form, inputs, shared_row(plan), chunk, kernel_size))  # every row's tokens
    alone_row = PackedRow.from_cu_seqlens(plan.row_offsets)  # each row alone, its prompt its own
    want = run_form(form, per_token(form, inputs, plan.unpack_index), alone_row, chunk, kernel_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    loss = lambda out: (out.flatten(1).sum(1) * weights).sum()  # noqa: E731
    got_grads = torch.autograd.grad(loss(got), inputs, allow_unused=True)
    want_grads = torch.autograd.grad(loss(want), inputs, allow_unused=True)
    for name, a, b in zip("abcdef", got_grads, want_grads):  # a prompt's gradient: its rows' summed, as theirs
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{form} grad {name}")


def test_the_recurrent_forms_take_and_return_a_state_per_sequence():
    from nopad.modeling._layers import PackedRow, torch_gated_delta_rule, torch_ssd_scan

    # sequences of 3, 0 and 5 tokens, each run whole, then split after 1 / 0 / 2 tokens: the second
    # parts from the first parts' final states give the same outputs and final states
    row = PackedRow.from_lengths([3, 0, 5])
    head, tail = torch.tensor([0, 3, 4]), torch.tensor([1, 2, 5, 6, 7])
    halves = PackedRow.from_lengths([1, 0, 2]), PackedRow.from_lengths([2, 0, 3])
    gdn, ssd = state_inputs(8, seed=3)["gdn"], state_inputs(8, seed=4)["ssd"]
    runs = (
        (lambda *a, **o: torch_gated_delta_rule(*a, chunk_size=2, use_qk_l2norm=True, **o), gdn),
        (lambda *a, **o: torch_ssd_scan(*a, chunk_size=2, dt_softplus=True, **o), ssd[:5]),
    )
    for run, inputs in runs:

        def part(index, inputs=inputs):
            return tuple(t.index_select(0, index) if t.dim() > 1 else t for t in inputs)

        out, final = run(*inputs, row, final_state=True)
        first, state = run(*part(head), halves[0], final_state=True)
        assert torch.equal(state[1], torch.zeros_like(state[1]))  # an empty sequence: its initial (zero) state
        second, final_2 = run(*part(tail), halves[1], final_state=True, initial_state=state)
        joined = torch.cat([first, second]).index_select(0, torch.argsort(torch.cat([head, tail])))
        torch.testing.assert_close(joined, out)
        torch.testing.assert_close(final_2, final)
        assert torch.equal(final_2[1], state[1])  # empty again: the state it was given


def test_the_state_forms_are_a_fixed_number_of_ops_whatever_the_groups():
    counts = {}
    for rows in (8, 512):
        prompts, completions = equal_length_batches(rows)
        plan = plan_shared_prefixes(*join_prompts(nested(prompts), nested(completions)))
        with OpCounter() as counter:
            row = shared_row(plan)
        counts.setdefault("row", []).append((counter.ops, counter.syncs))
        for form in ("conv", "gdn", "ssd"):
            inputs = state_inputs(plan.total, seed=0)[form]
            with OpCounter() as counter:
                run_form(form, inputs, row, 4, 4)
            counts.setdefault(form, []).append((counter.ops, counter.syncs))
    for what, (small, large) in counts.items():
        assert small == large, (what, counts)
        assert small[1] == (1 if what == "row" else 0), (what, counts)


def hybrid(family: str, seed: int = 0):
    """A tiny random-weight model of ``family`` (fp32, eval): its state layers' chunks shrunk (Bamba's
    scan to 4 tokens) and Gemma 3's window to 4, so that sequences cross them."""
    from nopad._apps.families import tiny_config, tiny_model

    if family == "gemma3_text":
        from transformers import Gemma3ForCausalLM

        config = tiny_config(family)
        config.sliding_window = 4
        torch.manual_seed(seed)
        return Gemma3ForCausalLM(config).float().eval()
    model = tiny_model(family, seed)
    if isinstance(model, str):
        pytest.skip(model)
    for module in model.modules():
        if hasattr(module, "A_log") and isinstance(getattr(module, "chunk_size", None), int):
            module.chunk_size = 4
    return model


def max_grad_error(model, reference) -> tuple[float, str]:
    """The worst gradient difference over every parameter, relative to max(1, the parameter's largest
    gradient) as tests/test_packed_models.py measures it, and that parameter's name."""
    worst = (0.0, "")
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert (got.grad is None) == (want.grad is None), name
        if want.grad is not None:
            diff = (got.grad.double() - want.grad.double()).abs().max().item()
            worst = max(worst, (diff / max(1.0, want.grad.abs().max().item()), name))
    return worst


@pytest.mark.parametrize(
    "family",
    ["lfm2", "qwen3_5_text", "bamba", "gemma3_text", *(f"{f}-checkpointed" for f in ("qwen3_5_text", "bamba", "lfm2"))],
)
def test_a_hybrid_on_the_shared_layout_equals_each_row_alone_with_every_gradient(family):
    family, _, checkpointed = family.partition("-")
    reference, model = hybrid(family), hybrid(family)
    use_shared_prefix_attention(model)
    if family == "bamba":  # training mode: the fused Mamba2 kernel's path, sent down the unfused conv and scan
        reference.train(), model.train()
    if checkpointed:  # each layer recomputed in backward: the plan's row reaches it again through the kwargs
        model.train().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = model.config.vocab_size
    # groups of 16, 1, 3, 2 and 2 rows; prompts of 5, 1, 9, 4 and 70 tokens (past the gated delta rule's
    # 64-token chunk); completions of 0 to 7
    prompts, completions = grpo_rows(1, [5, 1, 9, 4, 70], [16, 1, 3, 2, 2], 7, vocab=vocab)
    input_ids, prompt_lengths = join_prompts(nested(prompts), nested(completions))
    values = input_ids.values()
    plan = plan_shared_prefixes(input_ids, prompt_lengths)
    assert plan.groups == 5 and plan.shared
    weights = torch.randn(plan.rows, 16, generator=torch.Generator().manual_seed(0))
    try:
        logits = model(input_ids=plan.pack(values)[None], shared_prefixes=plan, use_cache=False).logits[0]
    except ValueError as refusal:  # a release whose decoder does not hand its layers the boundaries
        import transformers

        assert checkpointed, refusal  # (LFM2 on 5.20): refused by name, never recomputed as one sequence
        assert f"of transformers {transformers.__version__} does not hand them to" in str(refusal)
        return
    shared = plan_logprobs(logits, plan, values)
    sum((lp * weights[r, : lp.shape[0]]).sum() for r, lp in enumerate(shared)).backward()
    for r, (p, c) in enumerate(zip(prompts, completions)):  # each (prompt + completion) alone
        alone = reference(input_ids=torch.tensor([p + c]), use_cache=False).logits[0]
        lp = completion_logprobs(alone, plan_shared_prefixes(nested([p + c]), [len(p)]), torch.tensor(p + c))[0]
        torch.testing.assert_close(shared[r], lp, atol=1e-5, rtol=1e-5)
        (lp * weights[r, : lp.shape[0]]).sum().backward()
    error, name = max_grad_error(model, reference)
    assert error <= 1e-5, (family, name, error)


def test_boundaries_given_beside_the_plan_are_refused_by_name():
    model = use_shared_prefix_attention(hybrid("lfm2"))
    plan = plan_shared_prefixes(*join_prompts(nested([[1, 2], [1, 2]]), nested([[3], [4, 5]])))
    ids = plan.pack(torch.tensor([1, 2, 3, 1, 2, 4, 5]))[None]
    with pytest.raises(ValueError, match=r"cu_seq_lens_q: expected None with shared_prefixes"):
        model(input_ids=ids, shared_prefixes=plan, cu_seq_lens_q=plan.cu_seqlens_q, use_cache=False)
    with pytest.raises(ValueError, match=r"kernel: expected 'auto' or 'torch' for a shared-prefix row"):
        run_form_kernel = __import__("nopad.modeling._layers", fromlist=["causal_conv1d"]).causal_conv1d
        run_form_kernel(torch.ones(2, plan.total), torch.ones(2, 3), None, shared_row(plan), kernel="causal-conv1d")
    from nopad.modeling._layers import SharedPrefixRow

    with pytest.raises(ValueError, match=r"row: expected blocks of a prompt .*, got prompt parts \[0, 2\]"):
        SharedPrefixRow([0, 2], [1, 1])  # the first block holds no prompt: its completion continues nothing


def equal_length_batches(rows: int):
    """Groups of 4 rows; the longest prompt (9) and completion (6) twice whatever ``rows`` (the state
    forms' loops run as many steps as the longest has chunks; a step of one sequence lets torch's
    matmul take views where it copies for several: other op names). Returns (prompts, completions)."""
    prompts, completions = [], []
    for g in range(rows // 4):
        prompt = [1 + (g + t) % 50 for t in range(9 if g < 2 else 1 + g % 9)]
        prompts += [prompt] * 4
        completions += [[2 + t for t in range(6 if g < 2 and r == 0 else (r + g) % 7)] for r in range(4)]
    return prompts, completions


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5_text", "bamba", "gemma3_text"])
def test_a_hybrid_forward_and_backward_is_a_fixed_number_of_ops_whatever_the_groups(family):
    model = use_shared_prefix_attention(hybrid(family))
    counts = []
    for rows in (8, 512):
        input_ids, prompt_lengths = join_prompts(*(nested(t) for t in equal_length_batches(rows)))
        plan = plan_shared_prefixes(input_ids, prompt_lengths)
        model.zero_grad(set_to_none=True)
        with OpCounter() as counter:
            out = model(input_ids=plan.pack(input_ids.values())[None], shared_prefixes=plan, use_cache=False)
            out.logits.sum().backward()
        counts.append((counter.by_op, counter.syncs))
    # syncs: the row's lengths (one per plan) and transformers' own mask preparation reading the position ids
    assert counts[0] == counts[1] and counts[0][1] <= 2, counts
