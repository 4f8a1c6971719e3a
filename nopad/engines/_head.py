"""A HF model's forward through the chunked head: its output layer replaced for one forward.

:func:`head_forward` runs the model's own forward (inside any FSDP hooks, so a sharded weight is
whole while the head uses it) with its output layer swapped for a stand-in that computes per-token
log-probs and entropy by :func:`nopad.modeling._logprobs.run_head` from the hidden states the layer receives;
:func:`head_spec` reads what the model does to its logits (soft-capping, a scale) from its config,
and the first forward checks that the model does nothing else to them. The maths of the head, and
the choice of its kernel, live in :mod:`nopad.modeling._logprobs`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nopad.core._errors import free_to_read, input_error
from nopad.core._memo import recall, remember
from nopad.modeling._logprobs import ScoredTokens, check_label_range, run_head

# ---- a model's output layer ------------------------------------------------------------------


@dataclass(frozen=True)
class HeadSpec:
    """A causal LM's output layer and what its forward does to that layer's output.

    ``layer`` is the ``torch.nn.Linear`` whose forward the chunked head stands in for; the logits
    the model returns are ``softcap * tanh(scale * x / softcap)`` (or ``scale * x`` without
    soft-capping) of that layer's output ``x``.
    """

    layer: torch.nn.Linear
    scale: float = 1.0
    softcap: float | None = None

    def expected(self, x: Tensor) -> Tensor:
        """What the model's forward should make of a stand-in output ``x`` of the layer."""
        x = x * self.scale
        return x if self.softcap is None else torch.tanh(x / self.softcap) * self.softcap

    @property
    def plain(self) -> bool:
        return self.scale == 1.0 and self.softcap is None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _configs(model: torch.nn.Module) -> list[Any]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    return [config] if text is config else [config, text]


def _config_value(configs: list[Any], name: str) -> float | None:
    for config in configs:
        value = _number(getattr(config, name, None))
        if value is not None:
            return value
    return None


def head_spec(model: torch.nn.Module) -> HeadSpec | str:
    """The model's :class:`HeadSpec`, or why the chunked head cannot stand in for its output layer.

    The output layer is ``model.get_output_embeddings()`` (a HF model) or ``model.lm_head``; it must be
    a plain ``torch.nn.Linear`` (a bias is fine; a subclass with its own forward, e.g. a LoRA or a
    quantised layer, is not). What the forward does after the layer is read from where
    transformers' models keep it: ``final_logit_softcapping`` (Gemma 2 and 3) in the config, a
    ``logit_scale`` attribute of the model (Cohere), ``logits_scaling`` (Granite, a divisor) and
    ``lm_head_multiplier`` (Falcon-H1) in the config. The first forward checks that reading (see
    :func:`check_post_processing`); anything else a forward does to the logits is refused there.
    """
    get = getattr(model, "get_output_embeddings", None)
    try:
        layer = get() if callable(get) else getattr(model, "lm_head", None)
    except (AttributeError, NotImplementedError):
        layer = getattr(model, "lm_head", None)
    if layer is None:
        return f"{type(model).__name__} has no output layer (no get_output_embeddings(), no lm_head)"
    if not isinstance(layer, torch.nn.Linear) or type(layer).forward is not torch.nn.Linear.forward:
        return f"its output layer is a {type(layer).__name__}, not a plain torch.nn.Linear"
    configs = _configs(model)
    softcap = _config_value(configs, "final_logit_softcapping")
    scale = 1.0
    model_scale = _number(getattr(model, "logit_scale", None))
    if model_scale is not None:
        scale *= model_scale
    divisor = _config_value(configs, "logits_scaling")
    if divisor is not None:
        scale /= divisor
    multiplier = _config_value(configs, "lm_head_multiplier")
    if multiplier is not None:
        scale *= multiplier
    if not math.isfinite(scale) or scale <= 0 or (softcap is not None and not (math.isfinite(softcap) and softcap > 0)):
        return f"its logits are scaled by {scale} and soft-capped at {softcap}: expected a finite scale > 0"
    return HeadSpec(layer, scale, softcap or None)


# ---- running a model's forward through the head ---------------------------------------------


@dataclass
class HeadOutput:
    """A forward's per-token results instead of logits: log-probs (1, L) and entropy (1, L) or None,
    exact at the positions ``scored`` (None: every real one) and 0 elsewhere."""

    log_probs: Tensor
    entropy: Tensor | None = None
    scored: ScoredTokens | None = None


def refusal(model: torch.nn.Module) -> tuple[HeadSpec | None, str | None]:
    """(the model's spec, None) when the chunked head may serve it, else (None, why not)."""
    spec = head_spec(model)
    if isinstance(spec, str):
        return None, spec
    reason = recall(model, "head refused")  # learnt on a forward, kept on the model
    return (None, reason) if reason is not None else (spec, None)


@dataclass(eq=False)
class _Call:
    """One forward through the head: what the stand-in needs and what it leaves behind."""

    spec: HeadSpec
    labels: Tensor
    temperature: Tensor | float
    real: int
    with_entropy: bool
    tile: tuple[int, int] | None
    scored: ScoredTokens | None
    same: Tensor | None
    calls: int = 0
    stand_in: Tensor | None = None
    declined: str | None = None
    transient: bool = False

    def forward(self, hidden: Tensor) -> Tensor:
        """The output layer's forward, standing in: the head on this row, a (1, L, 3) stand-in returned."""
        layer = self.spec.layer
        self.calls += 1
        length = self.labels.shape[0]
        weight, bias = layer.weight, layer.bias
        if self.calls > 1:
            self.declined = "its forward calls the output layer more than once"
        elif type(weight).__name__ == "DTensor" or type(bias).__name__ == "DTensor":
            self.declined = "its output layer's weight is a DTensor inside the forward (tensor parallel)"
        elif hidden.dim() != 3 or hidden.shape[:2] != (1, length):
            self.declined = f"its output layer got hidden states {tuple(hidden.shape)}, not (1, {length}, hidden)"
        elif hidden.dtype != weight.dtype or torch.is_autocast_enabled(hidden.device.type):
            self.transient = True  # a condition of this call (autocast), not of the model: not remembered
            self.declined = f"its output layer mixes dtypes ({hidden.dtype} hidden, {weight.dtype} weight, or autocast)"
        if self.declined is not None:  # the real layer; a probe returned by an earlier call forces a rerun
            return torch.nn.Linear.forward(layer, hidden)
        log_probs, entropy = self._head(hidden[0], weight, bias, length)
        # What the model's forward receives instead of (1, L, V) logits: (1, L, 3) = log-prob, entropy
        # and a probe. The results are read back from this tensor, so the gradient reaches it: hooks
        # on the layer's output (FSDP's, when the layer is sharded on its own) fire in the backward.
        # What the forward makes of the probe (values across the range logits take) shows what it does
        # to its output layer's result.
        probe = torch.linspace(-24.0, 24.0, length, device=hidden.device, dtype=log_probs.dtype)
        entropy = log_probs.new_zeros(()).expand(length) if entropy is None else entropy
        self.stand_in = torch.stack([log_probs, entropy, probe], -1).unsqueeze(0)
        return self.stand_in

    def _head(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, length: int) -> tuple[Tensor, Tensor | None]:
        """(L,) log-probs and entropy of the row: the head on the scored rows only (one gather, one
        scatter back, 0 elsewhere) when they are fewer than the real ones, else on the real rows."""
        real, scored, temperature = self.real, self.scored, self.temperature
        run = functools.partial(
            run_head, with_entropy=self.with_entropy, scale=self.spec.scale, softcap=self.spec.softcap, tile=self.tile
        )
        if scored is not None and (scored.count < real or scored.read is not None):
            if isinstance(temperature, Tensor):
                temperature = scored.rows(temperature)
            log_probs, entropy = run(scored.hidden_rows(hidden), weight, bias, scored.rows(self.labels), temperature)
            return scored.place(log_probs, length), None if entropy is None else scored.place(entropy, length)
        if isinstance(temperature, Tensor):
            temperature = temperature[:real]
        log_probs, entropy = run(hidden[:real], weight, bias, self.labels[:real], temperature)
        pad = length - real
        if pad:
            log_probs = torch.nn.functional.pad(log_probs, (0, pad))
            entropy = None if entropy is None else torch.nn.functional.pad(entropy, (0, pad))
        if scored is not None:  # every real row ran: the fill where no one reads
            read = scored.mask(length).to(log_probs.device)
            log_probs = torch.where(read, log_probs, 0.0)
            entropy = None if entropy is None else torch.where(read, entropy, 0.0)
        return log_probs, entropy

    def result(self) -> HeadOutput:
        """The per-token results, as new tensors (not views) read from the stand-in output (NaN where
        the forward's input ids were not the ones its output args were made for: see :func:`head_forward`)."""
        assert self.stand_in is not None
        log_probs = self.stand_in[..., 0].clone()
        entropy = self.stand_in[..., 1].clone() if self.with_entropy else None
        if self.same is not None:
            log_probs = torch.where(self.same, log_probs, float("nan"))
            entropy = None if entropy is None else torch.where(self.same, entropy, float("nan"))
        return HeadOutput(log_probs, entropy, self.scored)

    def verdict(self, model: torch.nn.Module, output: Any) -> str | None:
        """None when the forward made of the probe exactly what the spec says; else why not."""
        if self.declined is not None:
            return self.declined
        if self.calls == 0 or self.stand_in is None:
            return "its forward did not call its output layer"
        logits = getattr(output, "logits", output)
        spec = self.spec
        if logits is self.stand_in and spec.plain:
            return None
        if not isinstance(logits, Tensor) or logits.shape != self.stand_in.shape:
            return "its forward returns something other than its output layer's result as logits"
        if recall(model, "head checked"):  # kept on the model: its post-processing matched its spec
            return None
        probe = self.stand_in[..., 2].detach()  # one host sync, on a model's first forward only
        if not torch.allclose(logits[..., 2].detach().to(probe.dtype), spec.expected(probe), rtol=1e-3, atol=1e-3):
            said = "unchanged" if spec.plain else f"scaled by {spec.scale:g}, soft-capped at {spec.softcap}"
            return (
                f"its forward changes its output layer's result in a way nopad does not know "
                f"(expected {said} from its config; use head='logits')"
            )
        remember(model, "head checked", True)
        return None


@contextmanager
def head_forward(
    model: torch.nn.Module,
    labels: Tensor,
    temperature: Tensor | float,
    real: int,
    *,
    with_entropy: bool,
    required: bool,
    tile: tuple[int, int] | None = None,
    scored: ScoredTokens | None = None,
    input_ids: Tensor | None = None,
) -> Iterator[torch.nn.Module]:
    """Within the block, ``model(...)`` returns a :class:`HeadOutput` computed by the chunked head
    from the hidden states its output layer receives, never (1, L, V) logits.

    ``labels`` (L,) and ``temperature`` are the row's; the head runs on the first ``real`` tokens
    (the rest, the row's pad, get 0), or on the ``scored`` positions only (0 elsewhere).
    ``input_ids``: the (1, L) ids the row was prepared with; a forward given others is refused (see
    :func:`_same_ids`). The model's own forward runs (its body, its kwargs, inside
    any FSDP hooks, so a sharded weight is whole while the head uses it); only its output layer's
    forward is replaced. When the forward turns out not to be served (it does something to the
    logits that :func:`head_spec` did not read, calls the layer twice, has a DTensor weight, ...),
    ``required`` raises ValueError naming why; otherwise the forward is run again with the real
    layer and its logits are returned, and the model is remembered as not served.
    """
    spec, reason = refusal(model)
    if spec is None:
        if required:
            raise input_error("head", None, "a model the chunked head can serve (or head='logits')", str(reason))
        yield model
        return
    check_label_range(labels[:real], spec.layer.weight.shape[0])  # the pad past them is never scored
    served = spec
    original = model.forward
    own = model.__dict__.get("forward")

    def forward(*args: Any, **kwargs: Any) -> Any:
        same = _same_ids(kwargs.get("input_ids", args[0] if args else None), input_ids)
        call = _Call(served, labels, temperature, real, with_entropy, tile, scored, same)
        layer = served.layer
        layer_own = layer.__dict__.get("forward")
        layer.forward = call.forward  # type: ignore[method-assign,assignment]
        try:
            output = original(*args, **kwargs)
        finally:
            _restore(layer, layer_own)
        why = call.verdict(model, output)
        if why is None:
            return call.result()
        if not call.transient:
            remember(model, "head refused", why)
        if required:
            raise input_error("head", None, "a model the chunked head can serve (or head='logits')", why)
        # the probe reached the output only if the stand-in ran: then the logits must be computed again
        return output if call.stand_in is None else original(*args, **kwargs)

    model.forward = forward  # type: ignore[method-assign]
    try:
        yield model
    finally:
        _restore(model, own)


def _same_ids(given: Any, prepared: Tensor | None) -> Tensor | None:
    """Refuse a forward whose input ids are not those its output args were prepared with (the labels,
    temperatures and scored positions would belong to another micro-batch: a silent wrong result).
    The same tensor, or no ids (``inputs_embeds``), passes free; a different shape, or other values on
    the CPU (a read of host memory), is a ValueError; another tensor on a device is compared there,
    and the 0-d flag returned turns the results into NaN where it is False (no host sync)."""
    if prepared is None or not isinstance(given, Tensor) or given is prepared:
        return None
    expected = "the OutputArgs prepare_model_inputs made for this forward's input_ids"
    if given.shape != prepared.shape:
        raise input_error(
            "output_args", None, expected, f"input_ids of shape {tuple(given.shape)}, not {tuple(prepared.shape)}"
        )
    if free_to_read(given, prepared):
        if not torch.equal(given, prepared.to(given.device)):
            raise input_error("output_args", None, expected, "the output args of another micro-batch (other input_ids)")
        return None
    return (given == prepared.to(given.device)).all()


def _restore(module: torch.nn.Module, own: Any) -> None:
    """Put back the instance's own ``forward`` (or none, so the class's is used again)."""
    if own is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = own  # type: ignore[method-assign]
