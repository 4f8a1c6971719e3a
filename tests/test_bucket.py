"""Opt-in length buckets (issue 39): ``prepare_model_inputs(..., bucket=N)`` pads the packed row to
the next multiple of ``max(N, 2**(floor(log2 T) - 5))`` with one dummy sequence that no real token
attends to, whose outputs are dropped: the results are those of the unbucketed row, the padding is
under a step, and a compiled forward sees few row lengths."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from torch._dynamo.utils import counters  # noqa: E402

from nopad import left_right_2_no_padding  # noqa: E402
from nopad.core._layout import bucket_length  # noqa: E402
from nopad.diagnostics import OpCounter  # noqa: E402
from nopad.engines import packed_logprobs, prepare_model_inputs, prepare_model_outputs  # noqa: E402
from nopad.modeling import use_packed_attention  # noqa: E402
from nopad.synthetic import synthetic_batch, tiny_causal_lm  # noqa: E402


def test_the_bucket_rule_pads_under_a_step_and_under_a_32nd_of_a_long_row() -> None:
    assert [bucket_length(t, 1024) for t in (1, 1024, 1025, 5000)] == [1024, 1024, 2048, 5120]
    assert bucket_length(70_000, 1024) == 71_680  # past 64 buckets the step is 2**16 / 32 = 2,048
    g = torch.Generator().manual_seed(0)
    for total in torch.randint(1, 500_000, (2000,), generator=g).tolist():
        padded = bucket_length(total, 256)
        step = max(256, 2 ** (total.bit_length() - 1) // 32)
        assert padded % step == 0 and 0 <= padded - total < step
        assert total < 64 * 256 or padded - total < total / 32
    # a row of 3,000 to 60,000 tokens lands on one of few lengths, at most 32 per power of 2
    lengths = {bucket_length(t, 1024) for t in range(3000, 60_001)}
    assert len(lengths) == 57  # 3,072 ... 60,416 in steps of 1,024


def test_padding_at_the_issues_settings_is_under_3_percent() -> None:
    # verl#7272's setting: buckets of 1,024 tokens on micro-batches of ~16k-64k tokens (+1.7% there)
    g = torch.Generator().manual_seed(0)
    totals = torch.randint(16_000, 64_001, (50,), generator=g).tolist()
    padding = sum(bucket_length(t, 1024) - t for t in totals) / sum(totals)
    assert padding < 0.03, padding  # 1.3% here
    # rows of several thousand tokens take buckets of 128 for the same
    totals = torch.randint(3000, 8001, (50,), generator=g).tolist()
    assert sum(bucket_length(t, 128) - t for t in totals) / sum(totals) < 0.03


def _micro(rows: int, seed: int, vocab: int = 1000):
    return left_right_2_no_padding(synthetic_batch(rows, 12, 20, seed=seed, vocab=vocab))


def _log_probs_and_grads(model: torch.nn.Module, micro, **kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = packed_logprobs(model, micro, attention="sdpa", head="logits", **kw)
    values = out.values()
    (values * torch.linspace(0.5, 1.5, values.shape[0])).sum().backward()
    return values.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_bucketed_log_probs_and_gradients_equal_the_unbucketed_row(arch) -> None:
    model = tiny_causal_lm(arch, layers=2 if arch == "llama" else 4)
    micro = _micro(5, seed=1)
    inputs, _ = prepare_model_inputs(micro, bucket=64)
    assert inputs["input_ids"].shape[1] % 64 == 0 and inputs["input_ids"].shape[1] > micro["input_ids"].values().numel()
    plain, plain_grads = _log_probs_and_grads(model, micro)
    bucketed, grads = _log_probs_and_grads(model, micro, bucket=64)
    torch.testing.assert_close(bucketed, plain, atol=1e-6, rtol=0)
    assert len(grads) == len(plain_grads)
    for grad, plain_grad in zip(grads, plain_grads, strict=True):
        # a weight's gradient sums over the row's tokens: the dummy's zeros change the order (1.4e-6 on 0.7)
        torch.testing.assert_close(grad, plain_grad, atol=1e-6, rtol=1e-5)


def test_the_bucket_is_its_own_last_sequence_for_a_kernel_that_reads_boundaries() -> None:
    micro = _micro(3, seed=2)
    total = micro["input_ids"].values().numel()
    inputs, args = prepare_model_inputs(micro, attn_implementation="nopad_varlen", bucket=16)
    padded = bucket_length(total, 16)
    assert inputs["cu_seq_lens_q"].tolist()[-2:] == [total, padded]  # the dummy: its own boundaries
    assert inputs["position_ids"][0, total:].tolist() == list(range(padded - total))  # restarting at 0
    assert not args.label_mask[total:].any()  # no output of it is read


def test_bucketing_adds_no_op_that_grows_with_the_batch() -> None:
    def count(rows: int) -> dict:
        micro = _micro(rows, seed=3)
        prepare_model_inputs(micro, bucket=32)  # warm-up: nested-tensor metadata cached on first use
        with OpCounter() as counter:
            prepare_model_inputs(micro, bucket=32)
        return counter.by_op

    assert count(4) == count(64)


def test_a_bucketed_row_compiles_to_a_few_graphs_with_torchs_default_dynamic() -> None:
    # torch.compile(model) as a trainer writes it (dynamic=None: static shapes first, then what changed
    # made symbolic); 50 batches of 2-12 rows, ~70 tokens a batch, in buckets of 16: 10 row lengths,
    # ~10% padding (the rows are short beside the bucket)
    model = use_packed_attention(tiny_causal_lm("llama", layers=2))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    g = torch.Generator().manual_seed(4)
    real = padded = 0
    try:
        with torch.no_grad():
            for seed, rows in enumerate(torch.randint(2, 13, (50,), generator=g).tolist()):
                micro = _micro(rows, seed=seed)
                inputs, args = prepare_model_inputs(micro, attn_implementation="nopad_varlen", bucket=16)
                out = prepare_model_outputs(compiled(**inputs), args)["log_probs"]
                if seed == 0:
                    torch.testing.assert_close(out.values(), packed_logprobs(model, micro).values(), atol=1e-5, rtol=0)
                real, padded = real + args.plan.total, padded + inputs["input_ids"].shape[1]
        graphs = counters["stats"]["unique_graphs"]
        assert sum(counters["graph_break"].values()) == 0
    finally:
        torch._dynamo.reset()
    assert 1 <= graphs <= 4, graphs
    assert 0 < padded / real - 1 < 0.2, padded / real - 1


@pytest.mark.parametrize("bucket", [0, 2.5, "64"])
def test_a_bucket_that_is_not_a_positive_int_is_refused_naming_it(bucket) -> None:
    with pytest.raises(ValueError, match=r"bucket: expected an int >= 1"):
        prepare_model_inputs(_micro(2, seed=0), bucket=bucket)
