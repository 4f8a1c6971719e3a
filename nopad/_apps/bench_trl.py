"""`nopad bench --trl`: the per-token log-prob call of one GRPO step, TRL alone against ``install()``.

TRL 1.16's ``GRPOTrainer._get_per_token_logps_and_entropies`` scores the completions of a padded
GRPO batch: prompts left-padded, completions right-padded, ``num_generations`` completions per prompt
with long-tailed lengths (most short, one per batch of the full width). This bench calls that method
twice on the same batch and the same model, TRL's own and the one :func:`nopad.integrations.trl.install`
puts in its place, on a tiny random-weight Llama built here (no download) with a real vocabulary
(151,936 by default, Qwen's) and TRL's fused head added as ``GRPOTrainer.__init__`` adds it. The
trainer ``self`` is a stand-in holding what the method reads (``accelerator``, ``temperature``,
``args.cast_lm_head_to_fp32``), as ``tests/test_integration_trl.py`` builds it.

Two calls per contender, as a GRPO step makes them:

- ``no_grad``: ``compute_entropy=False`` under ``torch.no_grad()`` (the old policy's and the
  reference model's calls);
- ``fwd+bwd``: ``compute_entropy=True`` and the backward of the completion tokens' summed log-probs
  (the policy's call inside the loss).

Timings are the median over ``rounds`` rounds after one warm-up round, the contenders in turn
(their order swapped every round), all in one process. Peak memory above the model and the batch:
on CUDA ``torch.cuda.max_memory_allocated`` over the timed calls; on a CPU torch keeps no allocator
statistics, so the untimed warm-up calls run under a dispatch mode that counts the bytes of every
tensor storage an op creates while it lives (gradients included, the kernels' own scratch buffers
not). The ``max |nopad - TRL|`` table compares nopad's log-probs, entropies and parameter gradients
with TRL's from the warm-up round; the bench stops with an ``AssertionError`` where they disagree.

On a CPU TRL's fused head scores every position of the padded batch (it keeps only the positions
with a label where Triton runs, on CUDA), nopad's only the completion tokens.

``--trl-share-prefixes`` adds two contenders: the method ``install(share_prefixes=True)`` puts in
place, each group's prompt computed once (the ``num_generations`` rows of a prompt share it), and
the same method with every row its own group (the shared-prefix attention and head over the plain
packed layout, every prompt computed per row: what sharing alone saves, apart from the attention
kernel, which differs from ``install()``'s on a CPU). Their rows, the ratios (time, memory, and the
tokens each computes: the rows' real tokens against the shared layout's, chunk by chunk as the
method cuts them) and the shared contender's own ``max |shared - TRL|`` table come with the others,
from the same rounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import types
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nopad._apps.progress import QUIET, Progress, sync

GIB = 1024**3
CONTENDERS = ("trl", "nopad")
SHARED = "shared"  # --trl-share-prefixes: install(share_prefixes=True)'s method
UNSHARED = "unshared"  # --trl-share-prefixes: the same method, every row its own group
NAMES = {
    "trl": "TRL alone",
    "nopad": "nopad install()",
    SHARED: "nopad install(share_prefixes=True)",
    UNSHARED: "the same, every row its own group",
}
METHOD = "_get_per_token_logps_and_entropies"
# the largest |difference| between TRL's and nopad's results before the bench refuses its timings
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25}
CUDA_MEMORY = "torch.cuda.max_memory_allocated above the model and batch"
CPU_MEMORY = "peak live tensor storage above the model and batch (a dispatch mode: torch keeps no CPU allocator stats)"


@dataclass(frozen=True)
class TrlShape:
    """A GRPO batch (``prompts`` x ``generations`` rows, prompts up to ``prompt_len`` tokens, completions
    up to ``completion_len``) on a Llama of ``hidden`` x ``layers`` with a ``vocab``-token head."""

    prompts: int = 2
    generations: int = 8
    prompt_len: int = 32
    completion_len: int = 64
    vocab: int = 151_936
    hidden: int = 64
    layers: int = 2
    temperature: float = 0.9
    batch_size: int | None = None  # TRL's row chunks; None: every row in one forward
    seed: int = 0
    full: bool = False  # every completion of the full width C (else long-tailed)
    share_prefixes: bool = False  # a third contender: install(share_prefixes=True)


def grpo_batch(shape: TrlShape, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(input_ids, attention_mask, C)`` as TRL pads them: each prompt (length in [P/4, P]) repeated
    ``generations`` times and left-padded to P, completions right-padded to C with long-tailed lengths
    (exponential, mean C/4, at least 1; the first row's of the full width C), or all of the full width
    C with ``shape.full``."""
    gen = torch.Generator().manual_seed(shape.seed)
    P, C = shape.prompt_len, shape.completion_len
    rows = shape.prompts * shape.generations
    prompt_lens = torch.randint(max(1, P // 4), P + 1, (shape.prompts,), generator=gen)
    uniform = torch.rand(rows, generator=gen).clamp_min(1e-12)
    lengths = (-uniform.log() * C / 4).ceil().long().clamp(1, C)
    lengths[0] = C
    if shape.full:
        lengths[:] = C
    input_ids = torch.randint(1, shape.vocab, (rows, P + C), generator=gen)
    mask = torch.zeros(rows, P + C, dtype=torch.long)
    for i in range(rows):
        prompt = i // shape.generations
        p = int(prompt_lens[prompt])
        input_ids[i, P - p : P] = input_ids[prompt * shape.generations, P - p : P]  # one prompt, G completions
        mask[i, P - p : P + int(lengths[i])] = 1
    return input_ids.masked_fill(mask == 0, 0).to(device), mask.to(device), C


def build_model(shape: TrlShape, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The tiny random-weight Llama with TRL's fused head, in training mode, as GRPOTrainer holds it."""
    from trl.trainer.utils import add_fused_lm_head

    from nopad.synthetic import tiny_causal_lm

    model = tiny_causal_lm("llama", vocab=shape.vocab, hidden=shape.hidden, layers=shape.layers, seed=shape.seed)
    model = model.to(device=device, dtype=dtype).train()
    add_fused_lm_head(model, temperature=shape.temperature, outputs=("log_probs", "entropy"))
    return model


def fake_trainer(temperature: float, device: str) -> Any:
    """What the method reads of its trainer: the accelerator (autocast, unwrap), temperature, args."""
    from accelerate import Accelerator

    return types.SimpleNamespace(
        accelerator=Accelerator(cpu=torch.device(device).type == "cpu"),
        temperature=temperature,
        args=types.SimpleNamespace(cast_lm_head_to_fp32=False),
    )


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages ops create while the mode is on, each counted until it dies
    (a view shares its base's storage; storages made before, ``ignore``d, never count)."""

    def __init__(self, *before: torch.Tensor) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()
        self._before = {t.untyped_storage()._cdata for t in before}

    def _freed(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._seen or key in self._before:
                continue
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


def _timed(call: Callable[[], Any], device: torch.device) -> tuple[float, float, Any]:
    """ms of one call, its peak GiB above what was allocated before (CUDA; 0.0 elsewhere), its output."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    sync(device)
    start = time.perf_counter()
    out = call()
    sync(device)
    elapsed = (time.perf_counter() - start) * 1e3
    gib = (torch.cuda.max_memory_allocated(device) - base) / GIB if cuda else 0.0
    return elapsed, gib, out


def bench_trl(
    shape: TrlShape = TrlShape(),
    device: str = "cpu",
    rounds: int = 3,
    progress: Progress = QUIET,
) -> dict[str, Any]:
    """{"shape", "device", "dtype", "memory", "rows": [one per contender], "ratios", "diff"}.

    Each row: median ms of the no_grad and of the fwd+bwd call, and their peak GiB above the inputs.
    Ratios are TRL's over nopad's (above 1: nopad is faster or smaller)."""
    from trl.extras.profiling import profiling_decorator
    from trl.trainer.grpo_trainer import GRPOTrainer

    from nopad.integrations import trl as nopad_trl
    from nopad.integrations.trl import _install

    contenders = (*CONTENDERS, SHARED, UNSHARED) if shape.share_prefixes else CONTENDERS
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    input_ids, mask, C = grpo_batch(shape, device)
    model = build_model(shape, device, dtype)
    trainer = fake_trainer(shape.temperature, device)
    completion_mask = mask[:, -C:]
    params = [p for p in model.parameters() if p.requires_grad]
    already = GRPOTrainer.__dict__[METHOD]
    patch = nopad_trl.install()
    installed_here = GRPOTrainer.__dict__[METHOD] is not already  # a patch the caller holds stays
    try:
        methods = {"trl": patch.originals[GRPOTrainer], "nopad": GRPOTrainer.__dict__[METHOD]}
        # what install(share_prefixes=True) puts in place (the same function, the flag bound)
        bound = _install._named(_install._packed_per_token_logps_and_entropies, share_prefixes=True)
        methods[SHARED] = profiling_decorator(bound)
        methods[UNSHARED] = _every_row_its_own_group(methods[SHARED])

        def no_grad(name: str) -> tuple[torch.Tensor, None, None]:
            with torch.no_grad():
                logps, _, _ = methods[name](trainer, model, input_ids, mask, C, shape.batch_size)
            return logps, None, None

        def fwd_bwd(name: str) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
            model.zero_grad(set_to_none=True)
            logps, entropy, _ = methods[name](trainer, model, input_ids, mask, C, shape.batch_size, True)
            (logps * completion_mask).sum().backward()
            grads = [p.grad for p in params]
            model.zero_grad(set_to_none=True)
            return logps.detach(), entropy.detach(), grads

        calls: dict[str, Callable[[str], tuple[Any, Any, Any]]] = {"no_grad": no_grad, "fwd+bwd": fwd_bwd}
        times: dict[tuple[str, str], list[float]] = {(c, k): [] for c in contenders for k in calls}
        peak: dict[tuple[str, str], float] = {(c, k): 0.0 for c in contenders for k in calls}
        warm: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        progress.add(len(contenders) * len(calls) * (rounds + 1) + len(calls))  # + the model body's
        before = (input_ids, mask, *params, *model.buffers())
        for round_ in range(rounds + 1):
            order = contenders if round_ % 2 == 0 else contenders[::-1]
            for name in order:
                for kind, call in calls.items():
                    with progress.step(f"{name} {kind}, {'warm-up' if round_ == 0 else f'round {round_}'}"):
                        if round_ == 0:  # warms up, gives the results compared and (on a CPU) the memory
                            with nullcontext() if cuda else LiveBytes(*before) as live:
                                warm[name, kind] = call(name)
                            peak[name, kind] = 0.0 if live is None else live.peak / GIB
                            continue
                        elapsed, gib, out = _timed(functools.partial(call, name), dev)
                        del out
                        times[name, kind].append(elapsed)
                        if cuda:
                            peak[name, kind] = max(peak[name, kind], gib)
        diff = _differences(warm, completion_mask)
        shared_diff = _differences(warm, completion_mask, SHARED) if shape.share_prefixes else {}
        body = _body_peaks(model, input_ids, mask, dev, before, progress)
    finally:
        if installed_here:
            patch.uninstall()
    tolerance = TOLERANCE[dtype]
    worst = max([*diff.values(), *shared_diff.values()])
    if not worst <= tolerance:
        raise AssertionError(f"nopad bench --trl: nopad's results differ from TRL's by {worst:.3g} (> {tolerance:g})")
    measures = ("no_grad_ms", "fwd_bwd_ms", "no_grad_gib", "fwd_bwd_gib")
    value: dict[tuple[str, str], float] = {}
    for name in contenders:
        for key in measures:
            kind = "no_grad" if key.startswith("no_grad") else "fwd+bwd"
            value[name, key] = statistics.median(times[name, kind]) if key.endswith("_ms") else peak[name, kind]
    rows: list[dict[str, Any]] = [
        {"contender": NAMES[name], **{k: value[name, k] for k in measures}} for name in contenders
    ]

    def ratio(a: str, b: str, key: str) -> tuple[str, float | None]:
        """("a/b no_grad time", the ratio of the two contenders' measure ``key``; None over a zero)."""
        what = f"{key.rsplit('_', 1)[0]} {'time' if key.endswith('_ms') else 'memory'}"
        return f"{a}/{b} {what}", value[a, key] / value[b, key] if value[b, key] else None

    ratios = dict(ratio("trl", "nopad", key) for key in measures)
    real = int(mask.sum())
    shared: dict[str, Any] = {}
    if shape.share_prefixes:
        computed = _shared_tokens(input_ids, mask, C, shape.batch_size)
        ratios.update(ratio(a, SHARED, key) for key in measures for a in ("nopad", UNSHARED))
        ratios["nopad/shared tokens computed"] = real / computed
        shared = {
            "tokens_computed": {"nopad": real, SHARED: computed, UNSHARED: real},
            "max_abs_diff_shared": shared_diff,
        }
    above_body = {
        f"{NAMES[name]} {kind}": value[name, key] - body[key]
        for name in contenders
        for kind, key in (("no_grad", "no_grad_gib"), ("fwd+bwd", "fwd_bwd_gib"))
    }
    return {
        "shape": asdict(shape),
        "rows_real_padded": f"{mask.shape[0]} rows, {real}/{mask.numel()} real tokens, "
        f"{int(completion_mask.sum())} completion tokens",
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "memory": CUDA_MEMORY if cuda else CPU_MEMORY,
        "rows": rows,
        "ratios": ratios,
        "body": body,
        "above_body_gib": above_body,
        "max_abs_diff": diff,
        **shared,
    }


def _every_row_its_own_group(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (the shared contender's) with the shared-prefix plan made with ``share=False``."""
    from nopad.engines import _prefixes as engine

    def unshared(*args: Any, **kwargs: Any) -> Any:
        plan = engine.plan_shared_prefixes
        engine.plan_shared_prefixes = lambda *a, **k: plan(*a, **{**k, "share": False})
        try:
            return method(*args, **kwargs)
        finally:
            engine.plan_shared_prefixes = plan

    return unshared


def _shared_tokens(input_ids: torch.Tensor, mask: torch.Tensor, C: int, batch_size: int | None) -> int:
    """The tokens the shared contender computes: each chunk's (as the method cuts the rows) shared
    layout, every distinct prompt of the chunk once and every completion."""
    from nopad.batches._prefixes import plan_shared_prefixes
    from nopad.integrations.trl._install import token_budget_chunks

    total = 0
    for start, end in token_budget_chunks(mask, batch_size or mask.shape[0], keep_rows=False):
        keep = mask[start:end].bool()
        rows = [ids[row] for ids, row in zip(input_ids[start:end], keep)]
        nested = torch.nested.nested_tensor(rows, layout=torch.jagged)
        total += plan_shared_prefixes(nested, keep[:, :-C].sum(-1)).total
    return total


def _body_peaks(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    device: torch.device,
    before: tuple[torch.Tensor, ...],
    progress: Progress,
) -> dict[str, float]:
    """The model's own activations: peak GiB of its decoder stack alone (no head) on the batch's real
    tokens as one packed row (nopad's packed attention keeps the sequences apart), under
    ``torch.no_grad()`` and with the backward of the hidden states' sum; measured as the contenders are."""
    from nopad.modeling._attention import packed_attention

    keep = mask.bool()
    ids = input_ids[keep][None]
    positions = (mask.long().cumsum(-1) - 1)[keep][None]
    lengths = mask.sum(-1)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max())
    boundaries = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    decoder: Any = model.get_decoder()  # type: ignore[operator]
    cuda = device.type == "cuda"

    def call(grad: bool) -> None:
        with torch.set_grad_enabled(grad):
            hidden = decoder(input_ids=ids, position_ids=positions, use_cache=False, **boundaries).last_hidden_state
            if grad:
                hidden.sum().backward()
        model.zero_grad(set_to_none=True)

    peaks: dict[str, float] = {}
    with packed_attention(model):
        for key, grad in (("no_grad_gib", False), ("fwd_bwd_gib", True)):
            with progress.step(f"model body {'fwd+bwd' if grad else 'no_grad'}"):
                if cuda:
                    peaks[key] = _timed(functools.partial(call, grad), device)[1]
                else:
                    with LiveBytes(*before, ids, positions, cu) as live:
                        call(grad)
                    peaks[key] = live.peak / GIB
    return peaks


def _differences(
    warm: dict[tuple[str, str], tuple[Any, Any, Any]], completion_mask: torch.Tensor, ours: str = "nopad"
) -> dict[str, float]:
    """The largest |ours - TRL| of the log-probs (both calls), entropies and gradients."""
    keep = completion_mask.bool()

    def most(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0

    logps = max(most(warm[ours, k][0][keep], warm["trl", k][0][keep]) for k in ("no_grad", "fwd+bwd"))
    entropy = most(warm[ours, "fwd+bwd"][1][keep], warm["trl", "fwd+bwd"][1][keep])
    grads = [
        most(a, b)
        for a, b in zip(warm[ours, "fwd+bwd"][2], warm["trl", "fwd+bwd"][2])
        if a is not None and b is not None
    ]
    return {"log_probs": logps, "entropy": entropy, "grads": max(grads, default=0.0)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``nopad bench --trl`` adds (each prefixed ``--trl-``)."""
    default = TrlShape()
    parser.add_argument("--trl-prompts", type=int, default=default.prompts, help="prompts of the GRPO batch")
    parser.add_argument(
        "--trl-generations", type=int, default=default.generations, help="completions per prompt (num_generations)"
    )
    parser.add_argument("--trl-prompt-len", type=int, default=default.prompt_len, help="padded prompt width P")
    parser.add_argument(
        "--trl-completion-len",
        type=int,
        default=default.completion_len,
        help="padded completion width C (one completion of it, the others long-tailed, mean C/4)",
    )
    parser.add_argument(
        "--trl-full-completions",
        action="store_true",
        help="every completion of the full width C (rows x C completion tokens) instead of long-tailed lengths",
    )
    parser.add_argument("--trl-vocab", type=int, default=default.vocab, help="the model's vocabulary")
    parser.add_argument("--trl-hidden", type=int, default=default.hidden, help="the model's hidden size")
    parser.add_argument("--trl-layers", type=int, default=default.layers, help="the model's decoder layers")
    parser.add_argument(
        "--trl-batch-size", type=int, default=None, help="TRL's row chunks (batch_size; default: every row at once)"
    )
    parser.add_argument("--trl-rounds", type=int, default=3, help="timed rounds, the median kept (after a warm-up)")
    parser.add_argument(
        "--trl-share-prefixes",
        action="store_true",
        help="a third contender: install(share_prefixes=True), each group's prompt computed once",
    )


def shape_of(args: argparse.Namespace) -> TrlShape:
    return TrlShape(
        prompts=args.trl_prompts,
        generations=args.trl_generations,
        prompt_len=args.trl_prompt_len,
        completion_len=args.trl_completion_len,
        vocab=args.trl_vocab,
        hidden=args.trl_hidden,
        layers=args.trl_layers,
        batch_size=args.trl_batch_size,
        full=args.trl_full_completions,
        share_prefixes=args.trl_share_prefixes,
    )


def format_result(result: dict[str, Any], format_table: Callable[[list[dict[str, Any]]], str]) -> str:
    shape = result["shape"]
    head = (
        f"device={result['device']}  dtype={result['dtype']}  threads={result['threads']}  "
        f"Llama h={shape['hidden']} layers={shape['layers']} V={shape['vocab']}  "
        f"{shape['prompts']} prompts x num_generations={shape['generations']}, P={shape['prompt_len']} "
        f"C={shape['completion_len']}: {result['rows_real_padded']}\n"
        f"GRPOTrainer._get_per_token_logps_and_entropies, TRL 1.16 alone against nopad.integrations.trl.install(); "
        f"median of {result['rounds']} rounds, contenders in turn; memory: {result['memory']}"
    )
    ratios = [{"ratio": name, "value": value} for name, value in result["ratios"].items()]
    diff = [{"max |nopad - TRL|": name, "value": value} for name, value in result["max_abs_diff"].items()]
    body = result["body"]
    above = [
        {"GiB above the model's own activations": name, "value": value}
        for name, value in result["above_body_gib"].items()
    ]
    own = (
        f"the model's own activations (its decoder alone, no head, on the packed row): "
        f"no_grad {body['no_grad_gib']:.4f} GiB, fwd+bwd {body['fwd_bwd_gib']:.4f} GiB"
    )
    tables = [head, format_table(result["rows"]), format_table(ratios), own, format_table(above), format_table(diff)]
    if "max_abs_diff_shared" in result:
        computed = result["tokens_computed"]
        tables.append(
            f"tokens computed: nopad install() {computed['nopad']}, install(share_prefixes=True) {computed[SHARED]}"
        )
        tables.append(
            format_table([{"max |shared - TRL|": k, "value": v} for k, v in result["max_abs_diff_shared"].items()])
        )
    return "\n\n".join(tables)


def run(args: argparse.Namespace, format_table: Callable[[list[dict[str, Any]]], str]) -> int:
    """``nopad bench --trl`` (``format_table`` is the bench's table printer)."""
    try:
        import trl  # noqa: F401
    except ImportError as e:
        raise ImportError(f"--trl: expected TRL 1.16.0 to be importable ({e})") from e
    with Progress("nopad bench --trl", 0, quiet=args.quiet) as progress:
        result = bench_trl(shape_of(args), args.device, args.trl_rounds, progress)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_result(result, format_table))
    sys.stdout.flush()
    return 0
