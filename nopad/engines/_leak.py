"""Leak probe: does a packed forward keep its sequences apart, and give each what it gets alone?

Run the packed row twice, the second time with every token of one sequence changed; any other
sequence whose logits move has been attending across a boundary. This catches transformers'
default ``use_cache`` (packed detection silently off) and any attention that ignores boundaries.
Then run each sequence alone, through the model's own mask-building attention, and compare: a
sequence whose packed logits differ from its own run alone is not served as the model defines it
(a sliding window or a chunk the model applies only through its attention mask, which a packed
row does not have, is dropped inside each sequence, and no other sequence moves).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from nopad.core._batch import check_real, check_transformers_model, takes_keyword
from nopad.core._errors import check_flag, check_int, input_error
from nopad.core._layout import IndexPlan
from nopad.engines._fsdp import prepare_model_inputs
from nopad.modeling._attention import current_implementation, reads_boundaries
from nopad.parallel._ulysses import set_attn_implementation


@dataclass
class IsolationReport:
    """Outcome of :func:`check_isolation`.

    leaked: some sequence other than ``changed_sequence`` moved by more than ``atol``.
    moved_sequences: those sequences, in order. max_change: the largest logit change among them
    (0.0 when nothing moved at all). leaking_module: where it leaked, ``"name (Class)"``: the first
    module, innermost, whose output moved on the other sequences' tokens while its inputs there did
    not (None when nothing leaked, or no module's tensors tell).

    differs_alone: the sequences whose packed logits differ by more than ``alone_atol`` from the
    sequence run alone (empty when they all agree, or when the check was not run). max_alone_diff:
    the largest difference over every sequence (None: not checked). differing_module: where the
    first of them (the one that differs most) departs from its run alone, ``"name (Class)"``, found
    as ``leaking_module`` is.
    """

    leaked: bool
    changed_sequence: int
    moved_sequences: list[int]
    max_change: float
    atol: float
    leaking_module: str | None = None
    differs_alone: list[int] = field(default_factory=list)
    max_alone_diff: float | None = None
    alone_atol: float | None = None
    differing_module: str | None = None

    def __bool__(self) -> bool:
        """Truthy when something is wrong: it leaked, or a sequence differs from itself run alone
        (``if check_isolation(model): ...``)."""
        return self.leaked or bool(self.differs_alone)

    def __str__(self) -> str:
        if not self.leaked:
            text = (
                f"isolated: changing sequence {self.changed_sequence} moved no other logit by > {self.atol:g} "
                f"(max change {self.max_change:.3g})"
            )
        else:
            where = f", first in {self.leaking_module}" if self.leaking_module else ""
            text = (
                f"LEAK: changing sequence {self.changed_sequence} moved the logits of sequences "
                f"{self.moved_sequences} by up to {self.max_change:.3g}{where}"
            )
        # a sequence another one leaked into differs alone too: only the rest is news
        unexplained = [i for i in self.differs_alone if i not in self.moved_sequences]
        if not unexplained:
            return text
        where = f", first in {self.differing_module}" if self.differing_module else ""
        return (
            f"DIFFERS FROM ALONE: the packed logits of sequences {unexplained} differ from each sequence run "
            f"alone by up to {self.max_alone_diff:.3g} (> {self.alone_atol:g}){where}; {text}"
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
    for each in (config, _text_config(config)):  # a composite model's rope is its text config's
        rope = getattr(each, "rope_parameters", None) or getattr(each, "rope_scaling", None) or {}
        if "mrope_section" in rope:
            return True
    return False


# a config's windows, chunks and attention spans (tokens), as transformers' causal LMs spell them
_SPANS = (
    "sliding_window",
    "sliding_window_size",
    "attention_window_size",
    "attention_chunk_size",
    "window_size",
    "local_attention",
    "local_attention_window_len",
)
_POSITIONS = ("max_position_embeddings", "n_positions", "max_seq_len")
PROBE_LENGTHS = (5, 3, 6)


def _text_config(config: Any) -> Any:
    try:
        return config.get_text_config()
    except (AttributeError, ValueError):
        return config


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def probe_lengths(config: Any) -> tuple[int, ...]:
    """The default probe's sequence lengths for a model: 5, 3 and 6 tokens, and for a model whose
    config declares a window, chunk or attention span (``sliding_window``, ``attention_chunk_size``,
    ...), one sequence 3 tokens longer than the longest, so that it bites inside a sequence (left
    out where the model's positions end first)."""
    configs = {id(c): c for c in (config, _text_config(config))}.values()
    spans = [s for c in configs for name in _SPANS if (s := _int(getattr(c, name, None))) is not None]
    if not spans:
        return PROBE_LENGTHS
    longest = max(spans) + 3
    limits = [p for c in configs for name in _POSITIONS if (p := _int(getattr(c, name, None))) is not None]
    return PROBE_LENGTHS if limits and longest > min(limits) else (*PROBE_LENGTHS, longest)


@contextlib.contextmanager
def _reference_attention(model: torch.nn.Module) -> Iterator[None]:
    """The model's attention as transformers defines it, for the runs alone: an implementation that
    reads packed boundaries (nopad_varlen, flash-attn) builds no mask, so a window or a chunk the
    model applies only through its mask would be dropped alone as packed; sdpa (eager for a model
    without it) builds the mask. Restored on leaving."""
    current = current_implementation(model)
    if current is None or not reads_boundaries(current):
        yield
        return
    set_attn_implementation(model, "sdpa" if getattr(model, "_supports_sdpa", True) is not False else "eager")
    try:
        yield
    finally:
        set_attn_implementation(model, current)


def _default_alone_atol(model: torch.nn.Module, atol: float) -> float:
    """Packed and alone run different kernels: their rounding differs, by the dtype's resolution."""
    param = next(model.parameters(), None)
    half = param is not None and param.dtype in (torch.float16, torch.bfloat16)
    return max(atol, 0.25 if half else 1e-4)


@torch.no_grad()
def check_isolation(
    model: torch.nn.Module,
    micro_batch=None,
    *,
    changed_sequence: int = 0,
    atol: float = 1e-5,
    alone: bool = True,
    alone_atol: float | None = None,
    **model_kwargs,
) -> IsolationReport:
    """Packed forward twice, one sequence's tokens changed the second time; report who else moved.
    Then each sequence run alone; report those whose packed logits differ from it.

    ``micro_batch``: nested input_ids / position_ids (default :func:`probe_batch` of the model's
    vocab, with 4-row position ids for an mrope model: Qwen2-VL-style models look for boundaries
    only in row 0 of 4-row position ids, so 1-row ids leak there; sequences of 5, 3 and 6 tokens,
    and for a model whose config declares a window, chunk or attention span, one longer than it).
    The inputs come from :func:`prepare_model_inputs`; ``model_kwargs`` override them, e.g.
    ``use_cache=None`` reproduces a caller that leaves ``use_cache`` at the model's default.
    Change an early sequence (the default, 0): a causal leak only reaches later ones.

    ``alone``: also run each sequence by itself (batch 1, positions from 0, no mask, no cache,
    ``model_kwargs`` not applied) through the model's own mask-building attention (sdpa, or eager;
    an implementation that reads packed boundaries is switched for these runs and restored), and
    compare its logits with the packed ones at ``alone_atol`` (default 1e-4, or 0.25 for a model in
    fp16 / bf16: the two runs take different kernels; never below ``atol``). This finds what the
    leak test cannot: a window, chunk or attention span dropped inside each sequence. Host syncs
    (it is a probe, not a hot path).
    """
    changed_sequence = check_int(changed_sequence, "changed_sequence", low=0)
    atol = check_real(atol, "atol", low=0)
    alone = check_flag(alone, "alone")
    if alone_atol is not None:
        alone_atol = check_real(alone_atol, "alone_atol", low=0)
    config: Any = check_transformers_model(model).config
    vocab: int = getattr(config, "vocab_size", None) or _text_config(config).vocab_size  # a composite's: its text's
    if micro_batch is None:
        micro_batch = probe_batch(vocab, probe_lengths(config), position_rows=4 if _is_mrope(config) else 1)
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
    report = IsolationReport(
        leaked=bool(moved),
        changed_sequence=changed_sequence,
        moved_sequences=moved,
        max_change=float(per_row.max()),
        atol=atol,
        leaking_module=first.first_difference(second, atol) if moved else None,
    )
    if alone:
        report.alone_atol = _default_alone_atol(model, atol) if alone_atol is None else max(alone_atol, atol)
        _compare_alone(model, micro_batch, inputs, plan, before, report)
    return report


def _compare_alone(
    model: torch.nn.Module, micro_batch: Any, inputs: dict, plan: IndexPlan, packed: Tensor, report: IsolationReport
) -> None:
    """Each sequence alone against its packed logits (``packed``: (total, V)); fills the report's alone fields."""
    ids = micro_batch["input_ids"].values()
    positions = micro_batch["position_ids"].values() if "position_ids" in micro_batch else None  # (T,) or (C, T)
    offsets = plan.offsets.tolist()
    use_cache = {"use_cache": False} if takes_keyword(model.forward, "use_cache") else {}

    def alone_inputs(i: int) -> dict[str, Any]:
        start, end = offsets[i], offsets[i + 1]
        given: dict[str, Any] = {"input_ids": ids[start:end].unsqueeze(0), **use_cache}
        if positions is not None:
            given["position_ids"] = positions[..., start:end].unsqueeze(-2)  # (1, L) or (C, 1, L)
        return given

    diffs = []
    with _reference_attention(model):
        for i in range(plan.batch_size):
            logits = model(**alone_inputs(i)).logits[0].float()
            diffs.append(float((logits - packed[offsets[i] : offsets[i + 1]].to(logits.device)).abs().max()))
    atol = report.alone_atol
    assert atol is not None  # check_isolation sets it before comparing
    report.max_alone_diff = max(diffs, default=0.0)
    report.differs_alone = [i for i, d in enumerate(diffs) if d > atol]
    if not report.differs_alone:
        return
    worst = max(report.differs_alone, key=lambda i: diffs[i])
    tokens = torch.arange(offsets[worst], offsets[worst + 1], device=inputs["input_ids"].device)
    with _Recorder(model, inputs["input_ids"].shape[1], tokens) as in_row:
        model(**inputs)
    alone_run = alone_inputs(worst)
    length = alone_run["input_ids"].shape[1]
    with _reference_attention(model), _Recorder(model, length, torch.arange(length, device=tokens.device)) as by_itself:
        model(**alone_run)
    report.differing_module = in_row.first_difference(by_itself, atol)


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

    def first_difference(self, other: _Recorder, atol: float) -> str | None:
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
