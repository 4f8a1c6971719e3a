"""Packed forwards under torch.compile (issue 39): a routed model compiles whole, and exact.

A caller that hands the packed row's boundaries as kwargs (``cu_seq_lens_q/k`` tensors,
``max_length_q/k`` host ints, transformers' packed convention, as nopad's packed log-probs pass
them) compiles with ``fullgraph=True``: no graph break in nopad's code (under compile the routing
keeps its per-forward state on lists dynamo traces, not in context variables; no boundary value is
read; the kernel is chosen before tracing), the compiled forward and backward equal to the eager packed ones,
and a bounded number of graphs over batches of random lengths with ``dynamic=True``. So do the
hybrids (Qwen3.5's gated delta nets, Bamba's Mamba2 scans): under compile their state layers run on
the boundaries, the token count and ``max_length_q``, a graph per chunk count of the longest sequence. A decoder that
calls its layers without the model's kwargs (Moshi on transformers 5.20) finds the row there:
compiled, it is exact too, never the whole row attended as one sequence.

Graphs and breaks are counted with the ``aot_eager`` backend (dynamo's graphs are the backend's
choice-free part; inductor's cold compile costs ~1 minute here); one inductor run checks equality.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from torch._dynamo.utils import counters  # noqa: E402

from nopad.core._memo import remember  # noqa: E402
from nopad.modeling import _routing, use_packed_attention  # noqa: E402
from nopad.modeling._layers import BoundedRow, SharedPrefixRow  # noqa: E402
from nopad.synthetic import tiny_causal_lm  # noqa: E402

BATCHES = 50
# measured on torch 2.13 CPU: 1 graph over these 50 batches (aot_eager; 2 where torch.compile(model)
# compiles the root pre-hook as a frame of its own), no recompile: the token count and the number of
# sequences are symbolic; a bound with room, not the count (the issue asks at most 4)
MOST_GRAPHS = 4
TOL = dict(atol=1e-5, rtol=1e-5)


def _packed_batches(count: int, seed: int) -> list[dict]:
    """``count`` packed rows of 2-8 sequences of 1-40 tokens: ids, restarting positions, boundaries."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        rows = int(torch.randint(2, 9, (1,), generator=g))
        lengths = torch.randint(1, 41, (rows,), generator=g)
        total = int(lengths.sum())
        cu = torch.zeros(rows + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        longest = int(lengths.max())
        batches.append(
            dict(
                input_ids=torch.randint(0, 1000, (1, total), generator=g),
                position_ids=torch.cat([torch.arange(int(n)) for n in lengths]).unsqueeze(0),
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu,
                max_length_q=longest,
                max_length_k=longest,
            )
        )
    return batches


def _step(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and the parameters' gradients of one packed forward and backward."""
    model.zero_grad(set_to_none=True)
    logits = model(**batch).logits
    (logits.float().square().mean()).backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_alone(model: torch.nn.Module, batch: dict, logits: torch.Tensor) -> None:
    """Each sequence of the row gets what it gets alone: no leak across the boundaries."""
    cu = batch["cu_seq_lens_q"].tolist()
    with torch.no_grad():
        for start, end in zip(cu[:-1], cu[1:], strict=True):
            alone = model(input_ids=batch["input_ids"][:, start:end]).logits[0]
            torch.testing.assert_close(logits[0, start:end], alone, **TOL)


def _compiled_equals_eager(model: torch.nn.Module, compiled: torch.nn.Module, batches: list[dict]) -> None:
    for index, batch in enumerate(batches):
        eager_logits, eager_grads = _step(model, batch)
        logits, grads = _step(compiled, batch)
        if index == 0:
            _assert_alone(model, batch, logits)
        torch.testing.assert_close(logits, eager_logits, **TOL)
        for grad, eager_grad in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(grad, eager_grad, **TOL)


@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()
    # the per-forward lists are empty between forwards
    assert not _routing._PACKED_FORWARD._compiled and not _routing._LAYER_ROW._compiled


def test_50_batches_of_random_lengths_compile_to_a_few_graphs_without_a_break(dynamo) -> None:
    model = use_packed_attention(tiny_causal_lm("llama", layers=2))
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)  # no fullgraph: a break is counted
    _compiled_equals_eager(model, compiled, _packed_batches(BATCHES, seed=0))
    assert sum(dynamo["graph_break"].values()) == 0, dict(dynamo["graph_break"])
    graphs = dynamo["stats"]["unique_graphs"]
    assert 1 <= graphs <= MOST_GRAPHS, graphs


def test_fullgraph_inductor_compile_of_a_routed_llama_is_exact(dynamo) -> None:
    model = use_packed_attention(tiny_causal_lm("llama", layers=2))
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    _compiled_equals_eager(model, compiled, _packed_batches(4, seed=1))
    assert sum(dynamo["graph_break"].values()) == 0, dict(dynamo["graph_break"])


def test_a_model_in_training_mode_compiles_whole_too(dynamo) -> None:
    # training mode hands the attention the module's dropout, a symbolic float under dynamic=True:
    # read as a constant before the kernel choice, else one graph break per attention layer
    model = use_packed_attention(tiny_causal_lm("llama", layers=2)).train()
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)
    _compiled_equals_eager(model, compiled, _packed_batches(2, seed=5))
    assert sum(dynamo["graph_break"].values()) == 0, dict(dynamo["graph_break"])


class _DropsKwargs(torch.nn.Module):
    """A decoder layer called without the model's kwargs (Moshi on transformers 5.20): its attention
    is handed neither the boundaries nor the position ids, only what the layer needs unpacked."""

    KEPT = ("attention_mask", "position_embeddings", "past_key_values", "use_cache")

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.layer(hidden_states, **{k: v for k, v in kwargs.items() if k in self.KEPT})


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_decoder_that_drops_the_kwargs_compiles_exact_never_as_one_sequence(dynamo, fullgraph) -> None:
    # before the routing kept its forward where a compiled forward finds it, this model compiled without
    # fullgraph attended over the whole row as one sequence (0.6 from eager in the logits), silently
    model = tiny_causal_lm("llama", layers=2)
    model.model.layers = torch.nn.ModuleList(_DropsKwargs(layer) for layer in model.model.layers)
    model = use_packed_attention(model)
    if fullgraph:  # a compiled function that calls the model: dynamo inlines the routing's hooks
        compiled = torch.compile(lambda **batch: model(**batch), backend="aot_eager", fullgraph=True, dynamic=True)
    else:  # the model compiled: its hooks are frames of their own
        compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    with torch.no_grad():
        for index, batch in enumerate(_packed_batches(2, seed=2)):
            logits = compiled(**batch).logits
            if index == 0:
                _assert_alone(model, batch, logits)
            torch.testing.assert_close(logits, model(**batch).logits, **TOL)
    assert sum(dynamo["graph_break"].values()) == 0, dict(dynamo["graph_break"])
    if fullgraph:
        assert dynamo["stats"]["unique_graphs"] == 1


@pytest.mark.slow  # ~25 s of CPU per graph here: dynamo traces the whole hybrid; a step then takes ~0.05 s
@pytest.mark.parametrize("arch", ["qwen3_5", "bamba"])
def test_a_routed_hybrid_compiles_whole_and_exact_over_50_batches_of_random_lengths(dynamo, arch) -> None:
    # the packed forms of the gated delta nets and Mamba2 scans trace without a break: under compile
    # each state layer runs on the boundaries, the token count and the forward's longest sequence
    # (max_length_q), every sequence over the longest's chunk count, so the graph depends on that
    # count alone: Qwen3.5's 64-token chunks take 1 for sequences of 1-40 tokens, Bamba's 32-token
    # chunks 1 or 2 (a graph each), whatever the lengths and the number of sequences
    model = use_packed_attention(tiny_causal_lm(arch, layers=2))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    batches = _packed_batches(BATCHES, seed=3)
    chunk = 64 if arch == "qwen3_5" else model.config.mamba_chunk_size
    counts = {-(-batch["max_length_q"] // chunk) for batch in batches}
    assert counts == ({1} if arch == "qwen3_5" else {1, 2}), counts  # the batches reach every count
    _compiled_equals_eager(model, compiled, batches)
    assert sum(dynamo["graph_break"].values()) == 0, dict(dynamo["graph_break"])
    # one graph per chunk count, and the root pre-hook's where torch.compile(model) makes it a frame
    graphs = dynamo["stats"]["unique_graphs"]
    assert len(counts) <= graphs <= min(len(counts) + 1, MOST_GRAPHS), graphs


@pytest.mark.slow  # 9-21 s each here: a graph or two per model
@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "gpt_oss", "lfm2"])
def test_windows_sinks_and_short_convs_compile_whole_and_exact(dynamo, model_type) -> None:
    # the other kinds of layer nopad serves, as transformers ships them (nopad env's tiny models):
    # sliding windows of 16 tokens (Gemma 2 and 3, gpt-oss; the batches' sequences reach 40), gpt-oss's
    # attention sinks, LFM2's short convolutions: fullgraph, no break, equal to eager, each sequence
    # as alone
    from nopad._apps.families import tiny_model

    model = tiny_model(model_type)
    vocab = model.config.get_text_config().vocab_size
    model = use_packed_attention(model.float())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    batches = _packed_batches(6, seed=5)
    for batch in batches:
        batch["input_ids"] = batch["input_ids"] % vocab
    _compiled_equals_eager(model, compiled, batches)
    assert sum(dynamo["graph_break"].values()) == 0, dict(dynamo["graph_break"])
    assert 1 <= dynamo["stats"]["unique_graphs"] <= MOST_GRAPHS, dynamo["stats"]["unique_graphs"]


def test_a_function_compiled_alone_reads_the_row_an_eager_forward_set(dynamo) -> None:
    # a block compiled alone under an eager root (torchtitan compiles each block): traced with no
    # row set, its read returns None in the graph, guarded on no eager set being in force; set, the
    # read is the context variable's (a graph break, the value right)
    state = _routing._PACKED_FORWARD
    compiled = torch.compile(lambda x: x + (0 if state.get() is None else 1), backend="eager")
    x = torch.zeros(2)
    assert compiled(x).tolist() == [0, 0]
    token = state.set("a row")
    try:
        assert compiled(x).tolist() == [1, 1]
    finally:
        state.reset(token)
    assert compiled(x).tolist() == [0, 0]


def test_under_compile_a_shared_prefix_row_is_read_from_its_boundaries_never_made_plain(dynamo) -> None:
    # a compiled call builds its row from the boundaries and max_length_q, except on boundaries that
    # carry a row of their own (a shared-prefix row: completions continue their prompts), whose row
    # it reads as eager code does (a graph break, the row right)
    shared = SharedPrefixRow(np.array([3, 0, 2]), np.array([2, 4, 1]))
    plain = shared.cu_seqlens.clone()
    remember(shared.cu_seqlens, "packed_row", shared)  # as nopad's shared_prefix_row keeps it

    def kind(cu: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        row = _routing._row_of(cu, {"cu_seq_lens_q": cu, "max_length_q": 4}, x.shape[0])
        return x + (2 if isinstance(row, SharedPrefixRow) else 1 if isinstance(row, BoundedRow) else 0)

    compiled = torch.compile(kind, backend="eager")
    x = torch.zeros(12)
    assert compiled(shared.cu_seqlens, x).tolist() == [2] * 12
    assert compiled(plain, x).tolist() == [1] * 12
