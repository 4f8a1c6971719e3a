"""Packed forwards under torch.compile (issue 39, first slice): a routed model compiles whole.

A caller that hands the packed row's boundaries as kwargs (``cu_seq_lens_q/k`` tensors,
``max_length_q/k`` host ints, transformers' packed convention, as nopad's packed log-probs pass
them) compiles with ``fullgraph=True``: no graph break in nopad's code (the routing
keeps no context variable under compile, no boundary value is read, the kernel is chosen before
tracing), the compiled forward and backward equal to the eager packed ones, and a bounded number
of graphs over batches of random lengths with ``dynamic=True``. CPU inductor.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from torch._dynamo.utils import counters  # noqa: E402

from nopad.modeling import use_packed_attention  # noqa: E402
from nopad.synthetic import tiny_causal_lm  # noqa: E402

BATCHES = 10
# measured on torch 2.13 CPU: 2 graphs over these 10 batches, no recompile (torch.compile(model)
# compiles the root pre-hook as a frame of its own, an empty graph, and the forward once, its token
# count and number of sequences symbolic); a bound with room, not the count
MOST_GRAPHS = 4


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


def test_fullgraph_compile_of_a_routed_llama_is_exact_and_bounded() -> None:
    torch._dynamo.reset()
    model = use_packed_attention(tiny_causal_lm("llama", layers=2))
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    counters.clear()
    for index, batch in enumerate(_packed_batches(BATCHES, seed=0)):
        eager_logits, eager_grads = _step(model, batch)
        logits, grads = _step(compiled, batch)
        if index == 0:  # each sequence gets what it gets alone: no leak across the boundaries the kwargs name
            cu = batch["cu_seq_lens_q"].tolist()
            with torch.no_grad():
                for start, end in zip(cu[:-1], cu[1:], strict=True):
                    alone = model(input_ids=batch["input_ids"][:, start:end]).logits[0]
                    torch.testing.assert_close(logits[0, start:end], alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=1e-5)
        for grad, eager_grad in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(grad, eager_grad, atol=1e-5, rtol=1e-5)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= MOST_GRAPHS, graphs
    torch._dynamo.reset()
