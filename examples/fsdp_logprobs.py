"""Log-probs of a FSDP2-sharded causal LM on packed rows, against the padded forward; then Ulysses SP.

Run on CPU (gloo), no download (a tiny random-weight Llama):

    torchrun --nproc-per-node 2 examples/fsdp_logprobs.py

Each rank holds a different padded RL batch (data parallel). The model is sharded with FSDP2's
``fully_shard``; every rank computes its response log-probs twice: the padded way (the model
runs over all B * S slots) and nopad's way (one packed row of the real tokens, no attention
mask, ``use_cache=False``), and prints how many tokens each computed and how far apart they are.
Then both ranks split ONE packed row with Ulysses sequence parallelism (each rank runs half the
tokens, attention sees the whole row) and check it equals the single-process result.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from nopad import left_right_2_no_padding, no_padding_2_padding
from nopad.engines import check_isolation, packed_logprobs, padded_logprobs
from nopad.parallel import enable_ulysses
from nopad.synthetic import synthetic_batch, tiny_causal_lm

VOCAB = 1000


def say(rank: int, world: int, text: str) -> None:
    """Print rank by rank, in order."""
    for r in range(world):
        if r == rank:
            print(f"[rank {rank}] {text}", flush=True)
        dist.barrier()


def fsdp_part(rank: int, world: int, args: argparse.Namespace) -> None:
    model = tiny_causal_lm("llama", vocab=VOCAB, seed=0)
    mesh = init_device_mesh("cpu", (world,))
    decoder: Any = model.model
    for layer in decoder.layers:  # shard each decoder layer, then the rest
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    data = synthetic_batch(args.batch_size, args.prompt_len, args.response_len, seed=rank, vocab=VOCAB)
    micro = left_right_2_no_padding(data)
    with torch.no_grad():
        padded = padded_logprobs(model, data)
    packed = no_padding_2_padding(packed_logprobs(model, micro), micro)
    packed.sum().backward()  # FSDP2 reduce-scatters the gradients of the packed forward

    mask = data["response_mask"].bool()
    diff = (packed.detach() - padded).abs()[mask].max().item()
    slots, real = data["attention_mask"].numel(), int(data["attention_mask"].sum())
    say(
        rank,
        world,
        f"FSDP2: tokens computed padded {slots:,}, packed {real:,} "
        f"({1 - real / slots:.0%} padding skipped); max |logp padded - packed| = {diff:.2e} "
        f"over {int(mask.sum()):,} response tokens",
    )
    leak_default, leak_nopad = check_isolation(model, use_cache=None), check_isolation(model)
    say(rank, world, f"leak probe: use_cache default -> {leak_default}; nopad inputs -> {leak_nopad}")


def ulysses_part(rank: int, world: int, args: argparse.Namespace) -> None:
    data = synthetic_batch(args.batch_size, args.prompt_len, args.response_len, seed=100, vocab=VOCAB)
    micro = left_right_2_no_padding(data)
    with torch.no_grad():
        single = packed_logprobs(tiny_causal_lm("llama", vocab=VOCAB, seed=0), micro).values()
        model = enable_ulysses(tiny_causal_lm("llama", vocab=VOCAB, seed=0))
        sp = packed_logprobs(model, micro, sp_group=dist.group.WORLD).values()
    total = single.shape[0]
    say(
        rank,
        world,
        f"Ulysses SP {world}: this rank ran {-(-total // world)} of the row's {total} tokens; "
        f"gathered log-probs equal one process: {torch.equal(sp, single)} "
        f"(max diff {(sp - single).abs().max().item():.1e})",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=64)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    try:
        fsdp_part(rank, world, args)
        ulysses_part(rank, world, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
