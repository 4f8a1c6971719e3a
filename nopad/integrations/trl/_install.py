"""TRL's per-token log-probs on nopad's packed forward, and its padding-free SFT steps routed: the patch
behind ``nopad.integrations.trl``."""

from __future__ import annotations

import bisect
import functools
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from nopad.batches import left_right_2_no_padding, no_padding_2_padding
from nopad.core._errors import input_error
from nopad.engines import packed_logprobs
from nopad.engines._prefixes import switched_to_shared_attention
from nopad.modeling import packed_attention
from nopad.modeling._routing import checkpointed

_SUPPORTED_VERSIONS = ("1.16.0",)
_METHOD = "_get_per_token_logps_and_entropies"
_TRAINERS = (("trl.trainer.grpo_trainer", "GRPOTrainer"), ("trl.trainer.rloo_trainer", "RLOOTrainer"))
_SFT = ("trl.trainer.sft_trainer", "SFTTrainer")  # padding-free steps routed (nopad.integrations.trl._sft)
# the vision / multimodal inputs TRL may pass: refused unless None
_REFUSED_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
_PARAMETERS = (
    "self",
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
    *_REFUSED_INPUTS,
)


def _refuse(name: str, expected: str, got: str) -> ValueError:
    return input_error(f"nopad.integrations.trl: {name}", None, expected, got)


def _packed_per_token_logps_and_entropies(
    self: Any,
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
    compute_entropy: bool = False,
    compute_aux_loss: bool = False,
    pixel_values: Any = None,
    image_grid_thw: Any = None,
    num_images: Any = None,
    pixel_attention_mask: Any = None,
    spatial_shapes: Any = None,
    num_tiles: Any = None,
    image_sizes: Any = None,
    token_type_ids: Any = None,
    mm_token_type_ids: Any = None,
    image_position_ids: Any = None,
    *,
    share_prefixes: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """TRL's ``_get_per_token_logps_and_entropies`` on packed rows: (B, C) log-probs, (B, C) entropies
    or None, and the MoE load-balancing loss or None. See the module's docstring for what is served
    and refused. ``share_prefixes`` (bound by :func:`install`, never TRL's): each chunk's rows of equal
    prompt tokens computed with their prompt once (groups found from the tokens, whatever the rows'
    order: TRL shuffles the rows of its loss's call); the MoE aux loss (a loss over every row's
    tokens) runs unshared."""
    given = dict(
        pixel_values=pixel_values,
        image_grid_thw=image_grid_thw,
        num_images=num_images,
        pixel_attention_mask=pixel_attention_mask,
        spatial_shapes=spatial_shapes,
        num_tiles=num_tiles,
        image_sizes=image_sizes,
        token_type_ids=token_type_ids,
        mm_token_type_ids=mm_token_type_ids,
        image_position_ids=image_position_ids,
    )
    for name, value in given.items():
        if value is not None:
            raise _refuse(name, "None (text-only batches are served packed; call uninstall() for this one)", "a value")
    if not isinstance(compute_aux_loss, bool):
        raise _refuse("compute_aux_loss", "True or False (a bool)", repr(compute_aux_loss))
    if not isinstance(compute_entropy, bool):
        raise _refuse("compute_entropy", "True or False (a bool)", repr(compute_entropy))
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise _refuse("input_ids", "a (B, P + C) tensor", repr(getattr(input_ids, "shape", type(input_ids))))
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(getattr(attention_mask, "shape", ()))
        raise _refuse("attention_mask", f"a tensor of input_ids' shape {tuple(input_ids.shape)}", f"{shape}")
    rows, width = input_ids.shape
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or not 1 <= logits_to_keep < width:
        raise _refuse(
            "logits_to_keep", f"an int in [1, {width - 1}] (at least one prompt column)", repr(logits_to_keep)
        )
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0):
        raise _refuse("batch_size", "None or an int >= 0 (0 or None: one chunk)", repr(batch_size))
    accelerator = self.accelerator
    wrapped = _wrapping(accelerator, model)
    if wrapped is not None:
        raise _refuse("model", "the model as accelerate hands it over in a single process (unwrapped)", wrapped)
    _check_adapters(model)
    _check_head_precision(self, model)
    router = _RouterLoss(model) if compute_aux_loss else None
    global _HELD
    if _HELD is not None:  # a checkpointed forward whose backward never came: put the model back now
        _HELD.release()
    share = share_prefixes and router is None  # the aux loss counts each row's prompt: unshared
    chunks = token_budget_chunks(attention_mask, batch_size or rows, keep_rows=router is not None)
    held = _HeldUntilBackward(model, shared=share) if torch.is_grad_enabled() and checkpointed(model) else None
    temperature = float(self.temperature)
    log_probs: list[Tensor] = []
    entropies: list[Tensor] = []
    aux_losses: list[Tensor] = []
    try:
        for start, end in chunks:
            ids, mask = input_ids[start:end], attention_mask[start:end]
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            data = TensorDict(
                {
                    "input_ids": ids,
                    "attention_mask": mask,
                    "response_mask": mask[:, -logits_to_keep:],
                    "position_ids": positions,
                },
                batch_size=[ids.shape[0]],
            )
            micro = left_right_2_no_padding(data)
            with accelerator.autocast(), router.recording(mask) if router is not None else nullcontext():
                if compute_entropy:
                    out = packed_logprobs(
                        model, micro, temperature, calculate_entropy=True, tokens="response", share_prefixes=share
                    )
                    log_prob, entropy = out["log_probs"], out["entropy"]
                    entropies.append(no_padding_2_padding(entropy, micro, logits_to_keep))
                else:
                    log_prob = packed_logprobs(model, micro, temperature, tokens="response", share_prefixes=share)
            log_probs.append(no_padding_2_padding(log_prob, micro, logits_to_keep))
            if router is not None:
                aux_losses.append(router.loss())
    except BaseException:
        if held is not None:  # nothing to hold for: the model as it was
            held.release()
        raise
    if held is not None:
        held.armed()
        _HELD = held if held.holding else None
    logps = torch.cat(log_probs)
    aux_loss = torch.stack(aux_losses).mean() if router is not None else None  # TRL's: the chunks' mean
    return logps, torch.cat(entropies) if compute_entropy else None, aux_loss


def token_budget_chunks(mask: Tensor, batch_size: int, *, keep_rows: bool) -> list[tuple[int, int]]:
    """TRL's ``batch_size`` row chunks as a token budget: the rows, in order, cut into at most as many
    packed forwards as TRL's chunks, the largest holding as few real tokens as such a cut allows
    (never more than TRL's largest chunk holds). A forward's activations grow with its tokens, not
    its rows: a long-tailed batch whose long completions fall into one of TRL's chunks no longer
    peaks there. Log-probs and entropies are per token, so the cut changes none of them. One host
    read of the rows' token counts where TRL asks for more than one chunk. ``keep_rows`` keeps
    TRL's own chunks (the MoE aux loss is the mean of one loss per chunk)."""
    rows = mask.shape[0]
    bounds = [(start, min(start + batch_size, rows)) for start in range(0, rows, batch_size)]
    if len(bounds) <= 1 or keep_rows:
        return bounds
    # one host read: the longest row's real tokens, then the cumulative counts (a forward from row a
    # to row b holds held[b] - held[a])
    counts = (mask != 0).sum(-1)
    longest, *held = torch.cat([counts.max().view(1), counts.new_zeros(1), counts.cumsum(0)]).tolist()

    def cut(budget: int) -> list[tuple[int, int]]:
        """The fewest forwards of at most ``budget`` tokens (at least one row each), greedy: each forward
        ends at the last row that fits, found by bisection on the cumulative counts. Stops once it
        needs more forwards than TRL's chunks: at most len(bounds) + 1 steps, whatever the rows."""
        out: list[tuple[int, int]] = []
        start = 0
        while start < rows and len(out) <= len(bounds):
            end = max(start + 1, bisect.bisect_right(held, held[start] + budget) - 1)
            out.append((start, end))
            start = end
        return out

    low, high = longest, max(held[b] - held[a] for a, b in bounds)  # TRL's chunks fit in high
    while low < high:  # bisection on the budget: the least that needs no more forwards than TRL's
        middle = (low + high) // 2
        if len(cut(middle)) <= len(bounds):
            high = middle
        else:
            low = middle + 1
    return cut(low)


class _RouterLoss:
    """``compute_aux_loss``: the MoE load-balancing loss TRL's fused head computes, on the packed row.

    TRL asks the model's backbone for its router logits (``output_router_logits=True``) and takes
    transformers' ``load_balancing_loss_func`` (Mixtral's, the one every MoE family shares) over them
    with the chunk's attention mask, one loss per row chunk, then their mean. The loss reads each real
    token's router logits, counted once per layer: a packed row holds exactly the chunk's real tokens
    (no padding), so the same function over it without a mask sums the same terms. The backbone is
    asked the same way here (a hook puts ``output_router_logits=True`` into its call and reads its
    output's ``router_logits``); refused by name where the model has no backbone that returns them."""

    def __init__(self, model: torch.nn.Module) -> None:
        get_base = getattr(model, "get_base_model", None)  # a PEFT model: the transformers model inside
        hf = get_base() if callable(get_base) else model
        backbone = getattr(hf, "base_model", None)
        config = getattr(getattr(hf, "config", None), "get_text_config", lambda: None)()
        experts = {name: getattr(config, name, None) for name in ("num_experts", "num_experts_per_tok")}
        if (
            not isinstance(backbone, torch.nn.Module)
            or backbone is hf
            or not hasattr(config, "output_router_logits")
            or not all(isinstance(v, int) and v > 0 for v in experts.values())
        ):
            raise _refuse(
                "compute_aux_loss",
                "a Mixture-of-Experts model whose backbone returns its router logits (a text config with "
                "output_router_logits, num_experts and num_experts_per_tok), or False",
                f"{type(hf).__name__} ({experts})",
            )
        self.backbone, self.experts, self.top_k = backbone, experts["num_experts"], experts["num_experts_per_tok"]
        self.router_logits: Any = None
        self.tokens = 0

    @contextmanager
    def recording(self, mask: Tensor) -> Iterator[None]:
        """The backbone's router logits of the forwards within the block, of the chunk ``mask`` holds."""
        self.router_logits, self.tokens = None, int(mask.sum())

        def ask(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            return args, {**kwargs, "output_router_logits": True}

        def read(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.router_logits = getattr(output, "router_logits", None)

        handles = (
            self.backbone.register_forward_pre_hook(ask, with_kwargs=True),
            self.backbone.register_forward_hook(read),
        )
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def loss(self) -> Tensor:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        logits = self.router_logits
        if not isinstance(logits, tuple) or not logits or any(x.shape[0] != self.tokens for x in logits):
            shapes = [tuple(x.shape) for x in logits] if isinstance(logits, tuple) else type(logits).__name__
            raise _refuse(
                "compute_aux_loss",
                f"router logits of the packed row's {self.tokens} tokens from the backbone, one per MoE layer",
                f"{shapes}",
            )
        return load_balancing_loss_func(logits, self.experts, self.top_k, None)  # type: ignore[return-value]


class _HeldUntilBackward:
    """A model with activation checkpointing recomputes its layers in backward, after the forward's
    :func:`nopad.modeling.packed_attention` block would have switched it back: so the switch is held
    from before the first packed forward until backward has passed the input embeddings' output of
    every chunk (after every checkpointed layer has recomputed), then released. Where that output
    takes no gradient (frozen embeddings) there is nothing to wait on: refused by name. ``shared``:
    the switch held is to the shared-prefix attention (``share_prefixes``) instead."""

    def __init__(self, model: torch.nn.Module, *, shared: bool = False) -> None:
        get_embeddings = getattr(model, "get_input_embeddings", None)
        embeddings = get_embeddings() if callable(get_embeddings) else None
        if not isinstance(embeddings, torch.nn.Module):
            raise _refuse("gradient_checkpointing", "a model with input embeddings (get_input_embeddings())", "none")
        self._context = switched_to_shared_attention(model) if shared else packed_attention(model, "auto")
        with torch.no_grad():  # switched here, so the packed forwards inside run on a switched model
            self._context.__enter__()
        self.holding, self._pending, self._untracked = True, 0, False
        self._handle = embeddings.register_forward_hook(self._arm)

    def _arm(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, Tensor) and output.requires_grad:
            self._pending += 1
            output.register_hook(self._passed)
        else:
            self._untracked = True

    def _passed(self, grad: Tensor) -> None:
        self._pending -= 1
        if self._pending == 0:
            self.release()

    def armed(self) -> None:
        """After the forwards: release now if backward has nothing to wait on (refused when it would need to)."""
        self._handle.remove()
        if self._untracked or self._pending == 0:
            self.release()
            raise _refuse(
                "gradient_checkpointing",
                "input embeddings whose output takes a gradient (their backward marks the end of the "
                "layers' recomputation), or gradient_checkpointing=False",
                "embeddings whose output takes none (frozen)",
            )

    def release(self) -> None:
        global _HELD
        if self.holding:
            self.holding = False
            self._handle.remove()
            self._context.__exit__(None, None, None)
        if _HELD is self:
            _HELD = None


_HELD: _HeldUntilBackward | None = None


def _wrapping(accelerator: Any, model: torch.nn.Module) -> str | None:
    """What wraps ``model`` where nopad has not run it, or None: a wrapper accelerate unwraps (DDP, FSDP,
    DeepSpeed's engine, ZeRO-3's among them), or FSDP2's ``fully_shard``, which swaps the classes of
    the modules it shards in place (accelerate hands that model over as it is)."""
    inner = accelerator.unwrap_model(model)
    if inner is not model:
        return f"{type(model).__name__} around {type(inner).__name__} (not served yet: call uninstall())"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed: no FSDP2 either
        return None
    sharded = next((m for m in model.modules() if isinstance(m, FSDPModule)), None)
    if sharded is None:
        return None
    return f"a model FSDP2 sharded ({type(sharded).__name__}; not served yet: call uninstall())"


def _check_adapters(model: torch.nn.Module) -> None:
    """PEFT adapters: those that wrap the model's layers in place (LoRA, DoRA, IA3, ...) run within the
    packed forward as they run padded, and TRL's reference (the adapter disabled) likewise. Refused by
    name: a prompt-learning adapter (prompt or prefix tuning: virtual tokens or keys put before each
    row, where a packed row is many sequences) and an adapter on the output layer (TRL's head reads
    its weight and would leave the adapter out; TRL refuses it too)."""
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        raise _refuse(
            "model",
            "a PEFT adapter that wraps the model's layers (LoRA, DoRA, IA3, ...), or none",
            f"a {_peft_type(config)} adapter (prompt learning: virtual tokens or keys put before each row, where "
            "a packed row holds many sequences; call uninstall())",
        )
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(getattr(head, "base_layer", None), torch.nn.Module):
        raise _refuse(
            "model",
            "an output layer without an adapter (TRL's head reads its weight, and refuses one too)",
            f"{type(head).__module__}.{type(head).__name__} around the output layer",
        )


def _peft_type(config: Any) -> str:
    kind = getattr(config, "peft_type", None)
    return str(getattr(kind, "value", kind) or type(config).__name__)


def _check_head_precision(trainer: Any, model: torch.nn.Module) -> None:
    """``cast_lm_head_to_fp32``: served where nopad's head computes in float32 anyway, else refused."""
    if not getattr(getattr(trainer, "args", None), "cast_lm_head_to_fp32", False):
        return
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    mixed = str(getattr(trainer.accelerator, "mixed_precision", "no"))
    if weight is None or weight.dtype != torch.float32 or mixed != "no":
        got = f"head weights {getattr(weight, 'dtype', None)}, mixed precision {mixed!r}"
        raise _refuse("cast_lm_head_to_fp32", "float32 head weights and no mixed precision (or False)", got)


def _trl_version() -> str | None:
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return None


class TrlPatch:
    """The handle :func:`install` returns: the trainer classes whose method it replaced, and
    :meth:`uninstall` to put TRL's back. A context manager too."""

    def __init__(self) -> None:
        self.originals: dict[type, Callable[..., Any]] = {}  # trainer class -> TRL's log-prob method
        self._replacements: dict[type, Callable[..., Any]] = {}
        # (class, method name) -> (TRL's method, nopad's): SFTTrainer's steps, routed when padding-free
        self._steps: dict[tuple[type, str], tuple[Callable[..., Any], Callable[..., Any]]] = {}
        self.active = False
        self.share_prefixes = False  # install(share_prefixes=True): each group's prompt computed once

    @property
    def trainers(self) -> list[str]:
        """Names of the trainer classes routed to nopad, sorted."""
        return sorted({cls.__name__ for cls in self._replacements} | {cls.__name__ for cls, _ in self._steps})

    def uninstall(self) -> None:
        """Put TRL's methods back on every class where nopad's are still in place. Idempotent."""
        global _ACTIVE
        for cls, original in self.originals.items():
            if cls.__dict__.get(_METHOD) is self._replacements.get(cls):
                setattr(cls, _METHOD, original)
        for (cls, name), (original, replacement) in self._steps.items():
            if cls.__dict__.get(name) is replacement:
                if original is _INHERITED:
                    delattr(cls, name)
                else:
                    setattr(cls, name, original)
        self._replacements.clear()
        self._steps.clear()
        self.active = False
        if _ACTIVE is self:
            _ACTIVE = None

    def __enter__(self) -> TrlPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        return f"TrlPatch(active={self.active}, trainers={self.trainers}, share_prefixes={self.share_prefixes})"


_ACTIVE: TrlPatch | None = None
_INHERITED: Any = object()  # a method the class did not define itself (uninstall() removes nopad's)


def install(*, check_version: bool = True, share_prefixes: bool = False) -> TrlPatch:
    """Route ``GRPOTrainer`` and ``RLOOTrainer``'s ``_get_per_token_logps_and_entropies`` to nopad's
    packed forward, and ``SFTTrainer``'s padding-free steps (``training_step``, ``prediction_step``)
    through :func:`nopad.modeling.packed_attention`; returns the handle (also a context manager).

    ``share_prefixes=True`` (off by default) computes each group's shared prompt once in those
    log-prob calls: the rows of a batch whose prompt tokens are equal (TRL's ``num_generations``
    samples of a prompt) are found from the tokens, whatever their order, and each distinct prompt
    runs once, followed by its rows' completions (:func:`nopad.engines.packed_logprobs` with
    ``share_prefixes=True``); the results equal the unshared call's. A call that asks the MoE aux
    loss (``compute_aux_loss``) runs unshared.

    Idempotent: a second call returns the active handle (a ValueError naming ``share_prefixes`` when
    it asks another setting of it: uninstall first). Raises ImportError when TRL is not
    installed, and RuntimeError for a TRL other than 1.16.0 (``check_version=False`` skips that
    check) or one whose method takes parameters this replacement does not know (never skipped:
    an argument would be ignored).
    """
    global _ACTIVE
    if not isinstance(check_version, bool):
        raise _refuse("check_version", "True or False (a bool)", repr(check_version))
    if not isinstance(share_prefixes, bool):
        raise _refuse("share_prefixes", "True or False (a bool)", repr(share_prefixes))
    if _ACTIVE is not None and _ACTIVE.active:
        if _ACTIVE.share_prefixes != share_prefixes:
            raise _refuse(
                "share_prefixes",
                f"{_ACTIVE.share_prefixes}, the active install()'s (uninstall() first to change it)",
                repr(share_prefixes),
            )
        return _ACTIVE
    version = _trl_version()
    if version is None:
        raise ImportError("nopad.integrations.trl: TRL is not installed (pip install trl==1.16.0)")
    if check_version and version not in _SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"nopad.integrations.trl: found trl {version}, but this integration was checked against trl "
            f"{', '.join(_SUPPORTED_VERSIONS)} only; install it or pass check_version=False to try anyway"
        )
    from trl.extras.profiling import profiling_decorator

    patch = TrlPatch()
    patch.share_prefixes = share_prefixes
    for module_name, class_name in _TRAINERS:
        cls = getattr(importlib.import_module(module_name), class_name)
        original = cls.__dict__.get(_METHOD)
        if original is None:
            continue
        parameters = tuple(inspect.signature(original).parameters)
        if parameters != _PARAMETERS:
            unknown = [p for p in parameters if p not in _PARAMETERS]
            missing = [p for p in _PARAMETERS if p not in parameters]
            raise RuntimeError(
                f"nopad.integrations.trl: {class_name}.{_METHOD} of trl {version} takes {list(parameters)}: "
                f"unknown to nopad {unknown}, gone {missing}; nopad would ignore or misplace them, so it does not "
                "install"
            )
        replacement = profiling_decorator(_named(_packed_per_token_logps_and_entropies, share_prefixes=share_prefixes))
        patch.originals[cls] = original
        patch._replacements[cls] = replacement
    sft = getattr(importlib.import_module(_SFT[0]), _SFT[1])
    for name, expected in _SFT_METHODS.items():
        original = getattr(sft, name)
        parameters = tuple(inspect.signature(original).parameters)
        base = next((k.__dict__[name] for k in sft.__mro__[1:] if name in k.__dict__), None)
        passed_on = tuple(inspect.signature(base).parameters)[:3] if base is not None else ()
        if parameters != expected or passed_on != ("self", "model", "inputs"):
            raise RuntimeError(
                f"nopad.integrations.trl: {_SFT[1]}.{name} of trl {version} takes {list(parameters)} (its base "
                f"class's starts {list(passed_on)}), where nopad knows {list(expected)} (and a base taking self, "
                "model, inputs first); nopad would misplace them, so it does not install"
            )
        patch._steps[sft, name] = (sft.__dict__.get(name, _INHERITED), _padding_free_step(original))
    for cls, replacement in patch._replacements.items():
        setattr(cls, _METHOD, replacement)
    for (cls, name), (_, replacement) in patch._steps.items():
        setattr(cls, name, replacement)
    patch.active = True
    _ACTIVE = patch
    return patch


def _named(function: Callable[..., Any], **bound: Any) -> Callable[..., Any]:
    """A copy of ``function`` under TRL's method name (TRL's profiling names its timings by it), its
    keyword arguments ``bound`` given (and out of its signature: TRL's own)."""

    def _get_per_token_logps_and_entropies(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs, **bound)

    signature = inspect.signature(function)
    signature = signature.replace(parameters=[p for p in signature.parameters.values() if p.name not in bound])
    _get_per_token_logps_and_entropies.__signature__ = signature  # type: ignore[attr-defined]
    _get_per_token_logps_and_entropies.__doc__ = function.__doc__
    return _get_per_token_logps_and_entropies


def uninstall() -> None:
    """Undo the active :func:`install` (nothing when none is active)."""
    if _ACTIVE is not None:
        _ACTIVE.uninstall()


# ---- padding-free SFT: each step routed ---------------------------------------------------------
# TRL's padding-free SFT on nopad's routing: each step of a ``padding_free`` ``SFTTrainer`` runs with
# its model's layers keeping the packed row's sequences apart.
#
# TRL 1.16's ``DataCollatorForLanguageModeling(padding_free=True)`` (``SFTConfig(padding_free=True)``, or
# ``packing=True`` with the ``bfd`` strategies) hands the model one row: the batch's sequences end to
# end, ``position_ids`` restarting at each, no attention mask, their boundaries as ``cu_seq_lens_q`` /
# ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` and each token's sequence as ``seq_idx``.
# transformers' attention reads those boundaries; the CPU fallbacks of its state layers (a gated delta
# net's causal conv and scan, Mamba2's scan, in transformers 5.25) do not, and refuse the row where their
# CUDA kernels are missing (handed only the position ids, they run across the sequences). Under
# :func:`nopad.modeling.packed_attention` every such layer runs its packed form (state reset where each
# sequence starts) and the attention runs through ``nopad_varlen``.
#
# ``training_step`` (forward and backward, so the layers a checkpointed forward recomputes in backward
# are still routed) and ``prediction_step`` (evaluation) are wrapped: a trainer whose ``padding_free``
# is off runs TRL's own unchanged; one whose is on runs TRL's own within the block, the model as it was
# after each step. ``seq_idx`` says again what ``cu_seq_lens_q`` says (nopad's layers read the
# boundaries from there): it is checked to agree (one host read) and left out of the model's inputs,
# since ``nopad_varlen`` refuses a per-token tensor it would ignore; one that disagrees is refused.

# the methods of SFTTrainer (or a base class) wrapped, with the parameters TRL 1.16 gives them
_SFT_METHODS = {
    "training_step": ("self", "args", "kwargs"),
    "prediction_step": ("self", "model", "inputs", "prediction_loss_only", "ignore_keys"),
}


def _refuse_sft(name: str, expected: str, got: str) -> ValueError:
    return input_error(f"nopad.integrations.trl: SFTTrainer {name}", None, expected, got)


def _packed_inputs(inputs: Any) -> Any:
    """The padding-free collator's batch for a routed forward: ``seq_idx`` checked against the
    boundaries and left out; anything else as it came."""
    if not isinstance(inputs, dict) or "seq_idx" not in inputs:
        return inputs
    seq_idx, cu = inputs["seq_idx"], inputs.get("cu_seq_lens_q")
    if isinstance(seq_idx, Tensor) and isinstance(cu, Tensor) and seq_idx.dim() == 2 and seq_idx.shape[0] == 1:
        counts = cu.diff()
        expected = torch.repeat_interleave(torch.arange(counts.numel(), device=cu.device), counts)
        if expected.numel() == seq_idx.shape[1] and torch.equal(expected.to(seq_idx.dtype), seq_idx[0]):
            return {key: value for key, value in inputs.items() if key != "seq_idx"}
    shape = tuple(getattr(seq_idx, "shape", ()))
    raise _refuse_sft(
        "seq_idx",
        "the sequence index of each token of the packed row, as cu_seq_lens_q bounds the sequences "
        "(what TRL's padding-free collator makes)",
        f"a {shape} value that disagrees with cu_seq_lens_q {tuple(getattr(cu, 'shape', ()))}",
    )


@contextmanager
def _routed(trainer: Any, model: torch.nn.Module) -> Iterator[None]:
    """``model`` routed (packed attention and packed state layers) within the block, as it was after.

    Entered outside autograd: :func:`nopad.modeling.packed_attention` refuses a checkpointed model
    whose backward would come after its block; here the block holds the backward too."""
    wrapped = _wrapping(trainer.accelerator, model)
    if wrapped is not None:
        raise _refuse_sft("model", "the model as accelerate hands it over in a single process (unwrapped)", wrapped)
    context = packed_attention(model, "auto")
    with torch.no_grad():
        context.__enter__()
    try:
        yield
    finally:
        context.__exit__(None, None, None)


def _padding_free_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """TRL's ``training_step`` or ``prediction_step`` (evaluation), routed when the trainer is padding-free."""

    @functools.wraps(original)
    def step(self: Any, model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "padding_free", False):
            return original(self, model, inputs, *args, **kwargs)
        with _routed(self, model):
            return original(self, model, _packed_inputs(inputs), *args, **kwargs)

    return step
