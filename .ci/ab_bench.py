"""Two checkouts of nopad against each other, in alternating processes: is a change slower?

    python .ci/ab_bench.py BEFORE_DIR AFTER_DIR [--rounds 17] [--calls 15]

Each round runs one process per checkout (``PYTHONPATH`` picks which nopad is imported) and the
AFTER checkout a second time, as the noise floor: the same build against itself. Every process
times the conversions and the row operations through the public API only, so one script serves
checkouts of any age; each op's time is the best of ``--calls`` calls in a process, and the table
gives the best over the rounds (noise on a shared machine only ever adds time). One intra-op thread.
A checkout is a directory holding ``nopad/`` (``git worktree add DIR COMMIT`` makes one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from tensordict import TensorDict
import nopad
from nopad.batches import micro_batches, select_rows
from nopad.synthetic import synthetic_batch

CALLS = int(sys.argv[1])


def nested_like(values, nested):
    return torch.nested.nested_tensor_from_jagged(values, nested.offsets())

def best(fn, n=CALLS):
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3

out = {}
for B in (8, 256, 1024):
    td = synthetic_batch(B, 256, 512, vocab=1000)
    micro = nopad.left_right_2_no_padding(td)
    ids = micro["input_ids"]
    lp = nested_like(ids.values().float(), ids)
    out[f"padded->nested B={B}"] = best(lambda: nopad.left_right_2_no_padding(td))
    out[f"nested->padded B={B}"] = best(lambda: nopad.no_padding_2_padding(lp, micro))
g = torch.Generator().manual_seed(0)
for B in (256, 1024):
    lengths = torch.randint(64, 4096, (B,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    T = int(offsets[-1])
    nt = lambda v: torch.nested.nested_tensor_from_jagged(v, offsets)
    batch = TensorDict(
        {
            "input_ids": nt(torch.randint(0, 1000, (T,), generator=g)),
            "position_ids": nt(torch.arange(T) - torch.repeat_interleave(offsets[:-1], lengths)),
            "loss_mask": nt(torch.ones(T, dtype=torch.int64)),
        },
        batch_size=[B],
    )
    mini = torch.randperm(B, generator=g)[: B // 4].tolist()
    out[f"select B={B}"] = best(lambda: select_rows(batch, mini))
    parts, restore = micro_batches(batch, 16384)
    out[f"split B={B}"] = best(lambda: micro_batches(batch, 16384), max(3, CALLS // 3))
    outs = [nested_like(m["input_ids"].values().float(), m["input_ids"]) for m in parts]
    out[f"join+restore B={B}"] = best(lambda: restore(outs))
print(json.dumps(out))
"""


def run(checkout: str, calls: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(calls)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the checkout to compare against (a directory holding nopad/)")
    parser.add_argument("after", help="the checkout measured")
    parser.add_argument("--rounds", type=int, default=17, help="processes per checkout (default: 17)")
    parser.add_argument("--calls", type=int, default=15, help="timed calls per op in a process (default: 15)")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": [], "again": []}
    for r in range(args.rounds):
        for name, checkout in (("before", args.before), ("after", args.after), ("again", args.after)):
            runs[name].append(run(checkout, args.calls))
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    print(f"best of {args.rounds} alternating processes each, ms; 'same build' = after run again / after")
    print(f"{'op':24s} {'before':>9s} {'after':>9s} {'after/before':>12s} {'same build':>10s}")
    for op in runs["before"][0]:
        before, after, again = (min(run[op] for run in runs[name]) for name in ("before", "after", "again"))
        print(f"{op:24s} {before:9.3f} {after:9.3f} {after / before:12.3f} {again / after:10.3f}")


if __name__ == "__main__":
    main()
