"""Context-parallel THD round trip on CPU: nested batch -> each rank's zigzag shard -> back.

Run with::

    torchrun --nproc-per-node 2 examples/megatron_thd.py

Every rank packs the same nested batch, keeps its load-balanced share (chunks r and 2*cp-1-r of
each sequence), runs an identity "model", and all-gathers the outputs back into a nested batch.
Uses megatron-core's ``parallel_state`` when it is installed, a plain gloo group otherwise.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from nopad.engines import ParallelDims, from_parallel_state, postprocess_thd, preprocess_thd


def parallel_dims() -> tuple[ParallelDims, bool]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron-core warns that TransformerEngine/Apex are absent
            from megatron.core import parallel_state as mpu
    except ImportError:
        world = dist.get_world_size()
        return ParallelDims(cp_size=world, cp_rank=dist.get_rank(), cp_group=dist.group.WORLD), False
    mpu.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    return from_parallel_state(), True


def main() -> None:
    dist.init_process_group("gloo")
    dims, with_megatron = parallel_dims()
    rank = dims.cp_rank
    # three conversations of 5, 3 and 9 tokens; ids 1xx, 2xx, 3xx say which one a token is from
    lengths = torch.tensor([5, 3, 9])
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    row = torch.repeat_interleave(torch.arange(3), lengths)
    values = (row + 1) * 100 + torch.arange(int(offsets[-1])) - offsets[row]
    input_ids = torch.nested.nested_tensor_from_jagged(values, offsets)

    tokens, params, position_ids = preprocess_thd(input_ids, **dims.preprocess_kwargs())
    labels, _, _ = preprocess_thd(input_ids, **dims.preprocess_kwargs(), need_roll=True)
    if rank == 0:
        print(f"cp_size={dims.cp_size} via {'megatron-core parallel_state' if with_megatron else 'torch.distributed'}")
        print(f"cu_seqlens (global, padded) {params.cu_seqlens_q.tolist()}  max_seqlen {params.max_seqlen_q}")
    for r in range(dims.cp_size):  # print in rank order
        if r == rank:
            print(f"[rank {rank}] tokens       {tokens[0].tolist()}")
            print(f"[rank {rank}] position_ids {position_ids[0].tolist()}")
            print(f"[rank {rank}] labels       {labels[0].tolist()}", flush=True)
        dist.barrier()

    output = tokens.clone()  # the identity "model"
    recovered = postprocess_thd(output, params, input_ids, **dims.postprocess_kwargs())
    if rank == 0:
        print("recovered batch:", [seq.tolist() for seq in recovered.unbind()])
        print("recovered batch equals the input:", torch.equal(recovered.values(), input_ids.values()))
    if with_megatron:
        from megatron.core import parallel_state as mpu

        mpu.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
