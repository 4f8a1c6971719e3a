"""The way back is capturable in a CUDA graph: no sync, no host read, static shapes given the batch.

``no_padding_2_padding`` and ``postprocess_thd`` (given the plan) are captured once and replayed on
new values; each replay equals an eager call. On a CPU the same contract is checked with the op
counter: no host read at all.
"""

from __future__ import annotations

import pytest
import torch

from nopad import OpCounter, left_right_2_no_padding, no_padding_2_padding

# private: the jagged wrapper every conversion ends in is captured on its own
from nopad.core._layout import wrap_jagged
from nopad.engines import ThdPlan, postprocess_thd, preprocess_thd
from nopad.synthetic import synthetic_batch


def _way_back(device: str):
    data = synthetic_batch(8, 64, 128, vocab=1000, device=device)
    micro = left_right_2_no_padding(data)
    ids = micro["input_ids"]
    values = torch.randn(ids.values().shape[0], device=device)
    log_probs = wrap_jagged(values, ids.offsets())
    plan = ThdPlan.from_nested(ids)
    _, params, _ = preprocess_thd(ids)
    hidden = torch.randn(1, plan.local_len, 16, device=device)

    def back():
        return no_padding_2_padding(log_probs, micro), postprocess_thd(hidden, params, ids, plan=plan).values()

    return back, (values, hidden)


def test_the_way_back_reads_nothing_on_the_host(device_path):
    back, _ = _way_back("cpu")
    back()
    with OpCounter() as counter:
        back()
    assert counter.syncs == 0 and not counter.host_reads


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to capture a graph")
def test_the_way_back_replays_in_a_cuda_graph_equal_to_eager_calls():
    back, inputs = _way_back("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, as CUDA graphs require
        for _ in range(2):
            back()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = back()
    for seed in range(3):
        torch.manual_seed(seed)
        for x in inputs:
            x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        for replayed, eager in zip(captured, back()):
            assert torch.equal(replayed, eager)
