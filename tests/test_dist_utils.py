import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _all_reduce(rank, world_size):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.slow
def test_run_distributed_all_reduce():
    assert run_distributed(_all_reduce, 2) == [3.0, 3.0]
