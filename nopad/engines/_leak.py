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
    (0.0 when nothing moved at all). leaking_module: where it leaked, ``"name (Class)"``: the first
    module, innermost, whose output moved on the other sequences' tokens while its inputs there did
    not (None when nothing leaked, or no module's tensors tell).
    """

    leaked: bool
    changed_sequence: int
    moved_sequences: list[int]
    max_change: float
    atol: float
    leaking_module: str | None = None

    def __bool__(self) -> bool:
        """Truthy when it leaked: ``if check_isolation(model): ...``."""
        return self.leaked

    def __str__(self) -> str:
        if not self.leaked:
            return (
                f"isolated: changing sequence {self.changed_sequence} moved no other logit by > {self.atol:g} "
                f"(max change {self.max_change:.3g})"
            )
        where = f", first in {self.leaking_module}" if self.leaking_module else ""
        return (
            f"LEAK: changing sequence {self.changed_sequence} moved the logits of sequences "
            f"{self.moved_sequences} by up to {self.max_change:.3g}{where}"
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

    kept = (plan.row_ids != changed_sequence).nonzero().flatten().to(ids.device)  # the other sequences' tokens
    with _Recorder(model, ids.shape[1], kept) as first:
        before = model(**inputs).logits[0, : plan.total].float()
    with _Recorder(model, ids.shape[1], kept) as second:
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
        leaking_module=first.first_leak(second, atol) if moved else None,
    )


class _Recorder:
    """Forward hooks on every module of ``model``: in call order, each call's inputs and outputs on the
    tokens ``kept`` (tensors with the row's ``length`` tokens on dim 1, batch 1)."""

    def __init__(self, model: torch.nn.Module, length: int, kept: Tensor) -> None:
        self.model, self.length, self.kept = model, length, kept
        self.calls: list[tuple[str, str, list[Tensor], list[Tensor]]] = []
        self._open: dict[int, int] = {}
        self._handles: list[Any] = []

    def _tokens(self, values: Any) -> list[Tensor]:
        found = values if isinstance(values, (tuple, list)) else [values]
        if hasattr(values, "values") and not isinstance(values, Tensor):  # a model output / dict
            found = list(values.values())
        return [
            t.detach()[0].index_select(0, self.kept).float()
            for t in found
            if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == self.length
        ]

    def __enter__(self) -> _Recorder:
        for name, module in self.model.named_modules():

            def before(module, args, kwargs, name=name):
                self._open[id(module)] = len(self.calls)
                inputs = self._tokens(list(args) + list(kwargs.values()))
                self.calls.append((name, type(module).__name__, inputs, []))

            def after(module, args, kwargs, output):
                index = self._open.pop(id(module), None)
                if index is not None:
                    self.calls[index][3].extend(self._tokens(output))

            self._handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            self._handles.append(module.register_forward_hook(after, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    def first_leak(self, other: _Recorder, atol: float) -> str | None:
        """The first module (innermost) whose inputs on the kept tokens agree between the two runs and
        whose outputs there do not."""

        def same(a: list[Tensor], b: list[Tensor]) -> bool:
            return len(a) == len(b) and all(x.shape == y.shape and (x - y).abs().max() <= atol for x, y in zip(a, b))

        leaks = [
            (name, cls)
            for (name, cls, ins, outs), (_, _, ins2, outs2) in zip(self.calls, other.calls)
            if outs and same(ins, ins2) and not same(outs, outs2)
        ]
        if not leaks:
            return None
        name, cls = leaks[0]
        for inner, inner_cls in leaks[1:]:  # the innermost: a leaking module inside the first one
            if inner.startswith(f"{name}.") if name else True:
                name, cls = inner, inner_cls
        return f"{name or 'the model'} ({cls})"
