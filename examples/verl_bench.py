"""Time verl's own conversion calls before and after ``nopad.integrations.verl.install()``.

Run in an environment with verl 0.9.1 (and megatron-core for the THD rows)::

    python examples/verl_bench.py --batch-sizes 8 64 256 --repeats 5

Every call is verl's public function, looked up where verl's callers find it
(``verl.workers.utils.padding`` / ``verl.models.mcore.util``): first verl's own, then the same
call with nopad installed. Rows are B sequences of a left-padded prompt (width 256) and a
right-padded response (width 512), lengths drawn at random. ``preprocess_thd_engine`` runs with
``need_roll=True`` as CP rank 0 of 2 (megatron's parallel state as verl reads it, stubbed for one
process). Prints a markdown table of median milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tensordict import TensorDict

PROMPT, RESPONSE = 256, 512


def make_batch(batch: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, PROMPT + 1, (batch,), generator=g)
    resp_lens = torch.randint(1, RESPONSE + 1, (batch,), generator=g)
    cols = torch.arange(PROMPT + RESPONSE)
    attention_mask = ((cols >= PROMPT - prompt_lens[:, None]) & (cols < PROMPT + resp_lens[:, None])).long()
    response_mask = attention_mask[:, PROMPT:].clone()
    input_ids = torch.randint(1, 50_000, (batch, PROMPT + RESPONSE), generator=g) * attention_mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "position_ids": position_ids,
            "prompts": input_ids[:, :PROMPT],
            "responses": input_ids[:, PROMPT:],
        },
        batch_size=[batch],
    )


def median_ms(fn, repeats: int, setup=None) -> float:
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        arg = setup() if setup is not None else None
        start = time.perf_counter()
        fn(arg)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


class _RankZeroOfTwo:
    def get_tensor_model_parallel_world_size(self):
        return 1

    def get_context_parallel_world_size(self):
        return 2

    def get_context_parallel_rank(self):
        return 0

    def get_context_parallel_group(self):
        return None


def measure(batch: int, repeats: int, thd: bool) -> dict[str, float]:
    import verl.workers.utils.padding as vpad

    data = make_batch(batch)
    nested = vpad.left_right_2_no_padding(data.clone())
    offsets = nested["input_ids"].offsets()
    log_probs = torch.nested.nested_tensor_from_jagged(torch.randn(int(offsets[-1])), offsets)
    out = {
        "left_right_2_no_padding": median_ms(vpad.left_right_2_no_padding, repeats, setup=data.clone),
        "no_padding_2_padding": median_ms(lambda _: vpad.no_padding_2_padding(log_probs, nested), repeats),
    }
    if thd:
        import verl.models.mcore.util as util

        real_mpu, util.mpu = util.mpu, _RankZeroOfTwo()
        try:
            out["preprocess_thd_engine"] = median_ms(
                lambda _: util.preprocess_thd_engine(nested["input_ids"], need_roll=True), repeats
            )
        finally:
            util.mpu = real_mpu
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--thd-max-batch", type=int, default=256, help="largest B for verl's (quadratic) THD call")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from nopad.integrations import verl as nopad_verl

    try:
        import verl.models.mcore.util  # noqa: F401

        have_thd = True
    except ImportError:
        have_thd = False
    rows = []
    for batch in args.batch_sizes:
        thd = have_thd and batch <= args.thd_max_batch
        before = measure(batch, args.repeats, thd)
        with nopad_verl.install():
            after = measure(batch, args.repeats, thd)
        for name in before:
            rows.append((name, batch, before[name], after[name]))
    print(f"torch {torch.__version__}, 1 thread, median of {args.repeats} (ms)\n")
    print("| call | B | verl | with install() | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    for name, batch, t0, t1 in sorted(rows, key=lambda r: (r[0], r[1])):
        print(f"| {name} | {batch} | {t0:.2f} | {t1:.2f} | {t0 / t1:.1f}x |")


if __name__ == "__main__":
    main()
