"""Architecture sweep: every causal-LM type of the installed transformers, packed against each sequence alone.

nopad's promise is that one packed row (several sequences, position ids restarting at 0, no
attention mask) gives the same per-token log-probs as each sequence run by itself. That holds for
softmax attention that keeps the sequences apart; it is silently false for layers that carry a state
along the row (linear attention, Mamba / SSD scans, short convs, recurrences) and for attention
implementations that run the row as one sequence. This module takes a tiny random-weight model of
every type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, built from its default config shrunk to tiny
sizes (hidden 64, 2-4 layers keeping one layer of every kind a hybrid has) by the library's
``nopad/_apps/families.py`` (which ``nopad env`` surveys too), runs a micro-batch of mixed lengths
both ways and classifies the outcome:

    exact      max abs diff of log-probs <= 1e-4
    different  silently different (the dangerous case)
    refused    the packed run raised ValueError (its message recorded)
    error      the packed run raised anything else
    skipped    the model could not be built, or could not run a sequence alone (why recorded)

Two choices make a leak show: weights drawn with std 0.1 (``INIT_RANGE``; at the usual 0.02 a short
conv's leak stays under 1e-4 in some models), and windows (sliding, chunked, sparse top-k) of 16
tokens, so that they bite inside the 64- and 70-token sequences.

Helpers only (no tests here). ``python -m tests.archs [--attention KERNEL] [types...]`` runs the
sweep and prints a table. Nothing is downloaded: configs come from their classes' defaults, weights
from a fixed seed, and nothing calls ``from_pretrained``.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from nopad._apps import families
from nopad._apps.families import TOKENS, causal_lm_types, quiet, reason
from nopad.core import IndexPlan

# read by huggingface_hub when transformers is first imported (lazily, below): never reach the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EXACT_ATOL = 1e-4
# every config's initializer_range (the library's tiny models: 0.1)
INIT_RANGE = float(os.environ.get("ARCHS_INIT", str(families.INIT_RANGE)))
LENGTHS = (70, 1, 3, 64, 9)  # > a 64-token chunk, length 1, < a conv kernel, exactly a chunk, short


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module | str:
    """A tiny random-weight ``model_type`` causal LM (fp32, eval, CPU) or a short reason it cannot be built:
    the library's (:func:`nopad._apps.families.tiny_model`), with the sweep's ``INIT_RANGE``."""
    return families.tiny_model(model_type, seed, init_range=INIT_RANGE)


# --------------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------------


def _text_config(config):
    try:
        return config.get_text_config()
    except (AttributeError, ValueError):  # several text configs (musicgen): the model's own config is the one
        return config


def is_mrope(config) -> bool:
    """Qwen2-VL-style multimodal rope: 4-row position ids (row 0 the text positions, where boundaries are read)."""
    for c in (config, _text_config(config)):
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        if isinstance(rope, dict) and "mrope_section" in rope:
            return True
    return False


def sweep_batch(vocab: int = TOKENS, lengths=LENGTHS, seed: int = 0, position_rows: int = 1) -> dict[str, torch.Tensor]:
    """A nested micro-batch (input_ids, position_ids) of random ids in [0, vocab), one sequence per length.

    The default lengths cover a sequence longer than a 64-token chunk, one exactly a chunk long,
    one of length 1 and ones shorter than a conv kernel. ``position_rows=4``: mrope ids (B, 4, j).
    """
    plan = IndexPlan.from_lengths(torch.tensor(list(lengths)))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (plan.total,), generator=gen)
    positions = plan.position_ids
    if position_rows == 1:
        return {"input_ids": plan.to_nested(ids), "position_ids": plan.to_nested(positions)}
    rows = positions.unsqueeze(0).expand(position_rows, -1).contiguous()
    return {"input_ids": plan.to_nested(ids), "position_ids": plan.to_nested(rows, ragged_dim=2)}


def _accepts(model: torch.nn.Module, name: str) -> bool:
    params = inspect.signature(model.forward).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _logits(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


@torch.no_grad()
def per_sequence_logprobs(model: torch.nn.Module, micro: dict) -> torch.Tensor:
    """Each sequence alone (B=1, no mask, positions 0..L-1, use_cache=False) -> (T,) next-token log-probs.

    In the packed order; the last token of each sequence (no next token of its own) is 0.
    """
    ids = micro["input_ids"]
    offsets = ids.offsets().tolist()
    values, positions = ids.values(), micro["position_ids"].values()  # (T,), (T,) or (C, T)
    out = torch.zeros(values.shape[0])
    for start, end in zip(offsets[:-1], offsets[1:]):
        kwargs: dict[str, Any] = {"input_ids": values[start:end].unsqueeze(0)}
        if _accepts(model, "position_ids"):
            kwargs["position_ids"] = positions[..., start:end].unsqueeze(-2)  # (1, L) or (C, 1, L)
        if _accepts(model, "use_cache"):
            kwargs["use_cache"] = False
        logits = _logits(model(**kwargs))[0].float()  # (L, V)
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, values[start + 1 : end, None]).squeeze(-1)
        out[start : end - 1] = logp
    return out


@torch.no_grad()
def packed_logprobs_of(model: torch.nn.Module, micro: dict, **kw) -> torch.Tensor:
    """nopad's packed forward (``packed_logprobs(head="logits")``) -> the same flat (T,) log-probs."""
    from nopad.engines import packed_logprobs

    return packed_logprobs(model, micro, head="logits", **kw).values().float()


@dataclass
class Result:
    model_type: str
    status: str  # exact | different | refused | error | skipped
    max_abs_diff: float | None
    detail: str
    seconds: float = 0.0


_MIXER = re.compile(
    r"Attention|Attn|Mamba|Mixer|DeltaNet|ShortConv|Conv1d|CausalConv|Recurrent|Rglru|RGLRU|Lightning|Rwkv|LSTM|"
    r"Lstm|KimiDelta|Kda|SSM|Ssm|MLA"
)
_NOT_MIXER = re.compile(r"Rotary|Norm|Embedding|Output|Gate$|Scaling|Indexer|Model$|ForCausalLM$|Block$|DecoderLayer$")


def layer_kinds(model: torch.nn.Module) -> list[str]:
    """Class names of the sequence-mixing modules of ``model`` (attention, SSM, conv, recurrence), sorted."""
    names = {
        type(m).__name__
        for m in model.modules()
        if type(m).__module__.startswith("transformers.")
        and _MIXER.search(type(m).__name__)
        and not _NOT_MIXER.search(type(m).__name__)
    }
    return sorted(names)


def _attn(model: torch.nn.Module) -> str:
    return str(getattr(model.config, "_attn_implementation", None))


def run_one(model_type: str, **packed_kwargs) -> Result:
    """Build, run each sequence alone and packed, classify."""
    start = time.perf_counter()

    def result(status: str, diff: float | None, detail: str) -> Result:
        return Result(model_type, status, diff, detail, time.perf_counter() - start)

    try:
        model = tiny_model(model_type)
    except Exception as exc:
        return result("skipped", None, f"build: {reason(exc)}")
    if isinstance(model, str):
        return result("skipped", None, model)
    vocab = min(TOKENS, getattr(_text_config(model.config), "vocab_size", None) or TOKENS)
    micro = sweep_batch(vocab, position_rows=4 if is_mrope(model.config) else 1)
    with quiet():
        try:
            alone = per_sequence_logprobs(model, micro)
        except Exception as exc:
            return result("skipped", None, f"alone: {reason(exc)}")
        if not torch.isfinite(alone).all():
            return result("skipped", None, "alone: non-finite log-probs")
        try:
            packed = packed_logprobs_of(model, micro, **packed_kwargs)
        except ValueError as exc:  # the whole message: what a refusal says is part of the result
            return result("refused", None, reason(exc, None))
        except Exception as exc:
            return result("error", None, reason(exc))
    kinds = ", ".join(layer_kinds(model))
    detail = f"attn={_attn(model)}; {kinds}"
    if packed.shape != alone.shape:
        return result("error", None, f"packed log-probs of shape {tuple(packed.shape)}, expected {tuple(alone.shape)}")
    diff = (packed - alone).abs().max().item()
    if math.isnan(diff):
        diff = math.inf
    return result("exact" if diff <= EXACT_ATOL else "different", diff, detail)


def sweep(types=None, **packed_kwargs) -> list[Result]:
    """``run_one`` over ``types`` (default: every causal-LM type); one progress line per type on stderr."""
    types = causal_lm_types() if types is None else list(types)
    results = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is ~10x faster than several on a shared 2-core runner
    try:
        for i, model_type in enumerate(types):
            r = run_one(model_type, **packed_kwargs)
            diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.2e}"
            print(
                f"[{i + 1}/{len(types)}] {model_type:28s} {r.status:9s} {diff:>9s} {r.seconds:6.2f}s", file=sys.stderr
            )
            results.append(r)
    finally:
        torch.set_num_threads(threads)
    return results


def format_table(results: list[Result]) -> str:
    lines = [f"{'type':28s} {'status':9s} {'diff':>9s} {'s':>6s}  detail"]
    for r in results:
        diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.2e}"
        lines.append(f"{r.model_type:28s} {r.status:9s} {diff:>9s} {r.seconds:6.2f}  {r.detail}")
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines.append("counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f" (of {len(results)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.archs", description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument(
        "--attention", help="packed_logprobs(attention=...): 'auto', 'none', or a kernel name (forces nopad_varlen)"
    )
    args = parser.parse_args(argv)
    kwargs = {} if args.attention is None else {"attention": None if args.attention == "none" else args.attention}
    start = time.perf_counter()
    results = sweep(args.types or None, **kwargs)
    print(format_table(results))
    print(f"total {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
