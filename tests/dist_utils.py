"""Run a function on N gloo processes on the CPU, for tests that cross ranks."""

from __future__ import annotations

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - shipped back to the parent and re-raised there
        results[rank] = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    ``fn`` must be a module-level function (it is pickled). A failure on any rank is re-raised
    here with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _worker,
            args=(world_size, _free_port(), fn, args, results),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        out = dict(results)
    errors = [f"rank {r}:\n{msg}" for r, (status, msg) in sorted(out.items()) if status == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r][1] for r in range(world_size)]
