"""Leak probe: does a packed forward keep its sequences apart?

Run the packed row twice, the second time with every token of one sequence changed; any other
sequence whose logits move has been attending across a boundary. This catches transformers'
default ``use_cache`` (packed detection silently off) and any attention that ignores boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nopad._batch import check_real
from nopad._errors import check_int, input_error
from nopad._layout import IndexPlan
from nopad.engines._fsdp import prepare_model_inputs


@dataclass
class IsolationReport:
    """Outcome of :func:`check_isolation`.

    leaked: some sequence other than ``changed_sequence`` moved by more than ``atol``.
    moved_sequences: those sequences, in order. max_change: the largest logit change among them
    (0.0 when nothing moved at all).
    """

    leaked: bool
    changed_sequence: int
    moved_sequences: list[int]
    max_change: float
    atol: float

    def __bool__(self) -> bool:
        """Truthy when it leaked: ``if check_isolation(model): ...``."""
        return self.leaked

    def __str__(self) -> str:
        if not self.leaked:
            return (
                f"isolated: changing sequence {self.changed_sequence} moved no other logit by > {self.atol:g} "
                f"(max change {self.max_change:.3g})"
            )
        return (
            f"LEAK: changing sequence {self.changed_sequence} moved the logits of sequences "
            f"{self.moved_sequences} by up to {self.max_change:.3g}"
        )


def probe_batch(vocab_size: int, lengths=(5, 3, 6), seed: int = 0, position_rows: int = 1) -> dict[str, Tensor]:
    """A small nested micro-batch (input_ids, position_ids) with random tokens; sequences given by ``lengths``.

    ``position_rows=4`` gives mrope position ids (B, 4, j) (text-only: all rows equal); 1, 3 or 4.
    """
    vocab_size = check_int(vocab_size, "vocab_size", low=1)
    seed = check_int(seed, "seed", low=0)
    if position_rows not in (1, 3, 4) or isinstance(position_rows, bool):
        raise input_error("position_rows", None, "1, 3 or 4 (rows of position ids)", repr(position_rows))
    lengths = [check_int(n, "lengths", low=1) for n in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
    if not lengths:
        raise input_error("lengths", None, "at least one sequence length", "none")
    plan = IndexPlan.from_lengths(torch.tensor(lengths))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (plan.total,), generator=gen)
    positions = plan.position_ids
    if position_rows == 1:
        return {"input_ids": plan.to_nested(ids), "position_ids": plan.to_nested(positions)}
    rows = positions.unsqueeze(0).expand(position_rows, -1).contiguous()
    return {"input_ids": plan.to_nested(ids), "position_ids": plan.to_nested(rows, ragged_dim=2)}


def _is_mrope(config) -> bool:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return "mrope_section" in rope


@torch.no_grad()
def check_isolation(
    model: torch.nn.Module,
    micro_batch=None,
    *,
    changed_sequence: int = 0,
    atol: float = 1e-5,
    **model_kwargs,
) -> IsolationReport:
    """Packed forward twice, one sequence's tokens changed the second time; report who else moved.

    ``micro_batch``: nested input_ids / position_ids (default :func:`probe_batch` of the model's
    vocab, with 4-row position ids for an mrope model: Qwen2-VL-style models look for boundaries
    only in row 0 of 4-row position ids, so 1-row ids leak there). The inputs come from
    :func:`prepare_model_inputs`; ``model_kwargs`` override them, e.g.
    ``use_cache=None`` reproduces a caller that leaves ``use_cache`` at the model's default.
    Change an early sequence (the default, 0): a causal leak only reaches later ones. Host syncs
    (it is a probe, not a hot path).
    """
    changed_sequence = check_int(changed_sequence, "changed_sequence", low=0)
    atol = check_real(atol, "atol", low=0)
    config: Any = model.config
    vocab: int = config.vocab_size
    if micro_batch is None:
        micro_batch = probe_batch(vocab, position_rows=4 if _is_mrope(config) else 1)
    inputs, args = prepare_model_inputs(micro_batch, attn_implementation=config._attn_implementation)
    plan = args.plan
    if not 0 <= changed_sequence < plan.batch_size:
        raise input_error("changed_sequence", None, f"0 <= index < {plan.batch_size}", f"{changed_sequence}")
    inputs.update(model_kwargs)
    ids = inputs["input_ids"]
    in_changed = torch.zeros_like(ids, dtype=torch.bool)
    in_changed[0, : plan.total] = plan.row_ids.to(ids.device) == changed_sequence
    changed_ids = torch.where(in_changed, (ids + 1 + ids % 7) % vocab, ids)

    before = model(**inputs).logits[0, : plan.total].float()
    after = model(**{**inputs, "input_ids": changed_ids}).logits[0, : plan.total].float()
    change = (after - before).abs().amax(-1)
    per_row = torch.zeros(plan.batch_size, device=change.device).scatter_reduce(
        0, plan.row_ids.to(change.device), change, reduce="amax"
    )
    per_row[changed_sequence] = 0.0
    moved = (per_row > atol).nonzero().flatten().tolist()
    return IsolationReport(
        leaked=bool(moved),
        changed_sequence=changed_sequence,
        moved_sequences=moved,
        max_change=float(per_row.max()),
        atol=atol,
    )
