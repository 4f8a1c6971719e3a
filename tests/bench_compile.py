"""CPU benchmark of issue 39: a routed Llama's training step (forward + backward), compiled packed
against eager packed and against compiled padded, on the same batches of random lengths, in one run.

    OMP_NUM_THREADS=1 python -m tests.bench_compile [--batches 8] [--repeats 3] [--backend inductor]

Packed: one row, the boundaries handed as kwargs (``cu_seq_lens_q/k``, host ``max_length_q/k``),
nopad_varlen attention. Padded: the same sequences right-padded to the batch's longest, sdpa with an
attention mask, a plain model of the same weights. Both compiled with ``dynamic=True``. Prints the
first pass over the batches (compiles included), the graphs and breaks dynamo counted, the
steady-state time (best of the repeats, taken in turn, summed over the batches), the ratios, the padding the padded
form computes, and how far compiled packed is from eager packed. Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._dynamo.utils import counters

from nopad.modeling import use_packed_attention
from nopad.synthetic import tiny_causal_lm


def batches(
    count: int, rows: tuple[int, int], lengths: tuple[int, int], vocab: int, seed: int
) -> list[list[torch.Tensor]]:
    """``count`` batches of ``rows`` sequences of ``lengths`` tokens (uniform, inclusive)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(rows[0], rows[1] + 1, (1,), generator=g))
        sizes = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g).tolist()
        out.append([torch.randint(0, vocab, (size,), generator=g) for size in sizes])
    return out


def packed_inputs(sequences: list[torch.Tensor]) -> dict:
    lengths = torch.tensor([len(s) for s in sequences])
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    longest = int(lengths.max())
    return dict(
        input_ids=torch.cat(sequences)[None],
        position_ids=torch.cat([torch.arange(len(s)) for s in sequences])[None],
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=longest,
        max_length_k=longest,
        use_cache=False,
    )


def padded_inputs(sequences: list[torch.Tensor]) -> dict:
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return dict(input_ids=ids, attention_mask=mask, use_cache=False)


def step(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach()


def timed_pass(model: torch.nn.Module, inputs: list[dict]) -> float:
    start = time.perf_counter()
    for one in inputs:
        step(model, one)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs=2, default=(4, 16))
    parser.add_argument("--lengths", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    torch.set_num_threads(1)
    vocab = 4000

    def llama() -> torch.nn.Module:
        model = tiny_causal_lm("llama", vocab=vocab, hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4)
        return model.train()

    data = batches(args.batches, tuple(args.rows), tuple(args.lengths), vocab, seed=0)
    packed, padded = [packed_inputs(s) for s in data], [padded_inputs(s) for s in data]
    real = sum(len(s) for b in data for s in b)
    computed = sum(one["input_ids"].numel() for one in padded)
    eager = use_packed_attention(llama())
    contenders = {
        "eager packed": (eager, packed),
        "compiled packed": (torch.compile(use_packed_attention(llama()), backend=args.backend, dynamic=True), packed),
        "compiled padded": (torch.compile(llama(), backend=args.backend, dynamic=True), padded),
    }
    print(
        f"torch {torch.__version__}, {args.backend}, {torch.get_num_threads()} thread(s); {args.batches} batches, "
        f"{real} tokens, padded form computes {computed} ({computed / real - 1:.1%} padding)"
    )
    for name, (model, inputs) in contenders.items():  # the first pass: compiles, graphs and breaks
        counters.clear()
        first = timed_pass(model, inputs)
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        shown = "" if name.startswith("eager") else f", {graphs} graphs, {breaks} breaks"
        print(f"{name:16s} first pass {first:7.2f} s{shown}")
    best = dict.fromkeys(contenders, float("inf"))
    for _ in range(args.repeats):  # the contenders in turn, so a machine's load shifts weigh on each
        for name, (model, inputs) in contenders.items():
            best[name] = min(best[name], timed_pass(model, inputs))
    for name in contenders:
        print(f"{name:16s} steady {best[name] * 1e3:8.1f} ms (best of {args.repeats})")
    compiled = contenders["compiled packed"][0]
    diff = max((step(compiled, one) - step(eager, one)).abs().max().item() for one in packed)
    print(f"compiled packed / eager packed    {best['compiled packed'] / best['eager packed']:.2f}x time")
    print(f"compiled packed / compiled padded {best['compiled packed'] / best['compiled padded']:.2f}x time")
    print(f"eager packed / compiled padded    {best['eager packed'] / best['compiled padded']:.2f}x time")
    print(f"max |compiled packed - eager packed| logits: {diff:.2e}")


if __name__ == "__main__":
    main()
