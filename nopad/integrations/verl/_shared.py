"""``install(share_prefixes=True)``: verl's FSDP engine computes each group's shared prompt once.

GRPO samples each prompt ``rollout.n`` times, so the rows of a micro-batch repeat their prompts.
Under the flag, ``FSDPEngineWithLMHead.forward_step`` (verl's forward for the actor's and the
reference's log-probs and for the actor's PPO loss) runs the model once over the shared-prefix
layout (:func:`nopad.engines.packed_logprobs` with ``share_prefixes=True``): each distinct prompt
once, then each of its rows' responses, the chunked head standing in for the output layer inside
the model's forward (so FSDP's sharded weights are whole while used). It hands verl's loss the
``model_output`` verl's own step gives it: ``log_probs`` (and ``entropy``) nested (B, j) on the
micro-batch's rows, float32, each response token's value at the position before it, the positions
``no_padding_2_padding`` reads; 0 at the positions it never reads (verl puts the prompt tokens'
log-probs there, and a wrapped label at each row's last position).

Groups are found from the tokens themselves (rows whose prompt tokens are equal, verified token by
token), not from verl's ``uid``: the plan verifies either way, a uid group whose prompts differ
would be refused where the tokens' own groups never are, and rows of equal prompts under two uids
share too.

Everything the shared layout does not serve exactly runs verl's own ``forward_step`` unchanged
(:func:`fallback_reason` names each case): FSDP1 / LoRA / a subclass's own outputs (the value head),
``use_remove_padding=False``, ``use_fused_kernels``, Ulysses SP, ``pad_to_length``, packed
``cu_seqlens`` passed to the model, multimodal inputs or mrope position ids, distillation,
``calculate_sum_pi_squared``, a micro-batch without prompts and responses (SFT), a missing
temperature or one verl would clamp, and a loss other than verl's ``ppo_loss`` (which reads the
responses only). A model whose layers the shared layout does not serve is a ValueError naming the
layer, before any forward.

After a shared forward the model's attention stays ``nopad_shared`` (kept on the model, see ``_BEFORE``) until verl's
own forward runs on it or the flag goes off: a model called outside the engine in between raises
(no plan in its kwargs) rather than computing something else.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import Counter
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from nopad.core._layout import is_nested
from nopad.core._memo import recall, remember
from nopad.engines._fsdp import packed_logprobs
from nopad.modeling._attention import current_implementation
from nopad.modeling._prefixes import IMPLEMENTATION, use_shared_prefix_attention
from nopad.parallel._ulysses import set_attn_implementation

ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
ENGINE_CLASS = "FSDPEngineWithLMHead"
LOSSES_MODULE = "verl.workers.utils.losses"


class _Flag:
    """The flag's state: whether it is on, the engine class patched (with verl's ``forward_step``),
    and the models a shared forward left on the shared attention (an undo record: uninstalling puts
    each one's own attention back; weakly held, so a freed model leaves it)."""

    def __init__(self) -> None:
        self.enabled = False
        self.patched: tuple[Any, Any] | None = None
        self.switched: weakref.WeakSet = weakref.WeakSet()


_state = _Flag()
# how many micro-batches each way took: "shared", or the reason verl's own forward ran
COUNTS: Counter = Counter()
# the attention implementation each model had before its first shared forward, kept on the model (the
# memo). The shared one stays set after that forward, through its backward: verl runs the backward after
# forward_step returns, and a checkpointed layer's recompute reads the implementation then (the plan
# travels in its kwargs). verl's own forward gets the model's implementation back first (:func:`_own_attention`).
_BEFORE = "attention before shared prefixes"


def enabled() -> bool:
    """Whether ``install(share_prefixes=True)`` is in force."""
    return bool(_state.enabled)


def set_enabled(on: bool) -> None:
    """Turn the flag on (patching verl's engine class now if its module is loaded, else when it is
    imported: :func:`patch_engine` from the import hook) or off (verl's ``forward_step`` back)."""
    _state.enabled = on
    if not on:
        unpatch_engine()
        return
    module = sys.modules.get(ENGINE_MODULE)
    if module is not None:
        patch_engine(module)


def patch_engine(module: Any) -> None:
    """``FSDPEngineWithLMHead.forward_step`` -> :func:`forward_step` (idempotent)."""
    cls = getattr(module, ENGINE_CLASS, None)
    if cls is None or _state.patched is not None or not enabled():
        return
    original = cls.__dict__["forward_step"]
    _state.patched = (cls, original)
    cls.forward_step = forward_step


def unpatch_engine() -> None:
    """verl's own ``forward_step`` back on its class (where it still holds nopad's)."""
    patched = _state.patched
    _state.patched = None
    for model in list(_state.switched):
        _own_attention(model)
    if patched is not None:
        cls, original = patched
        if cls.__dict__.get("forward_step") is forward_step:
            cls.forward_step = original


def _is_ppo_loss(loss_function: Any) -> bool:
    """verl's ``ppo_loss`` (bound by ``functools.partial``, as its workers bind it): it reads the
    log-probs and entropy at the response positions only."""
    while isinstance(loss_function, functools.partial):
        loss_function = loss_function.func
    losses = sys.modules.get(LOSSES_MODULE)
    return losses is not None and loss_function is getattr(losses, "ppo_loss", None)


def fallback_reason(engine: Any, micro_batch: Any, loss_function: Any) -> str | None:
    """None when the shared layout serves this forward exactly; else why verl's own runs."""
    module = sys.modules[ENGINE_MODULE]
    cls, tu = getattr(module, ENGINE_CLASS), module.tu

    def flag(key: str, default: Any) -> Any:
        return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)

    keys = set(micro_batch.keys())
    model = getattr(engine, "module", None)
    if (
        type(engine).prepare_model_inputs is not cls.prepare_model_inputs
        or type(engine).prepare_model_outputs is not cls.prepare_model_outputs
    ):
        return "an engine with its own inputs or outputs (a value head)"
    if isinstance(model, module.FSDP) or getattr(engine, "_is_lora", False):
        return "FSDP1 or LoRA"
    if not isinstance(model, torch.nn.Module) or not hasattr(getattr(model, "config", None), "_attn_implementation"):
        return "not a transformers model"
    if not flag("use_remove_padding", True):
        return "use_remove_padding=False"
    if flag("pad_mode", module.DatasetPadMode.NO_PADDING) != module.DatasetPadMode.NO_PADDING:
        return "a pad_mode other than no-padding"
    if flag("use_fused_kernels", False):
        return "use_fused_kernels"
    if getattr(engine, "use_ulysses_sp", False):
        return "Ulysses sequence parallel"
    if getattr(engine, "pad_to_length", False) or getattr(engine, "pass_packed_cu_seqlens", False):
        return "pad_to_length or packed cu_seqlens"
    if flag("calculate_sum_pi_squared", False):
        return "calculate_sum_pi_squared"
    if flag("distillation_use_topk", False) or flag("distillation_only", False):
        return "distillation"
    if "multi_modal_inputs" in keys:
        return "multimodal inputs"
    # the responses' positions, read as verl's no_padding_2_padding reads them
    if not {"input_ids", "prompts", "responses"} <= keys or not is_nested(micro_batch["input_ids"]):
        return "no prompts and responses (not a rollout batch)"
    if not is_nested(micro_batch["prompts"]) and "attention_mask" not in keys:
        return "padded prompts without their attention_mask"
    input_ids, position_ids = micro_batch["input_ids"], micro_batch.get("position_ids")
    if not is_nested(position_ids) or position_ids.dim() != 2:
        return "multi-row (mrope) position ids"
    if "temperature" not in keys:  # verl's own forward raises its KeyError
        return "no temperature"
    temperature = micro_batch["temperature"]
    if isinstance(temperature, Tensor):
        if temperature.dim() > 1 or (temperature.dim() == 1 and temperature.shape[0] != input_ids.shape[0]):
            return "a temperature tensor not one per row"
        if not bool((torch.isfinite(temperature) & (temperature > 0)).all()):  # one read of a per-row tensor
            return "a temperature that is not a finite number > 0"
    elif isinstance(temperature, bool) or not (
        isinstance(temperature, (int, float)) and 0 < float(temperature) < float("inf")
    ):
        return "a temperature that is not a finite number > 0"
    if loss_function is not None and not _is_ppo_loss(loss_function):
        return "a loss other than verl's ppo_loss"
    return None


def _own_attention(model: Any) -> None:
    """``model``'s attention implementation back to what it was before its first shared forward."""
    before = recall(model, _BEFORE)
    _state.switched.discard(model)
    remember(model, _BEFORE, None)
    if before is not None and current_implementation(model) == IMPLEMENTATION:
        set_attn_implementation(model, before)


def shared_model_output(engine: Any, micro_batch: Any) -> dict[str, Tensor]:
    """The ``model_output`` of verl's step, from one forward over the shared-prefix layout; the
    model's attention left on the shared layout's for the backward (a refused layer: a ValueError
    naming it, nothing changed)."""
    model = engine.module
    before = current_implementation(model)
    use_shared_prefix_attention(model)
    if before != IMPLEMENTATION:
        remember(model, _BEFORE, before)
        _state.switched.add(model)
    tu = sys.modules[ENGINE_MODULE].tu
    entropy = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
    temperature = micro_batch["temperature"]
    if isinstance(temperature, Tensor):
        temperature = temperature.to(torch.float32)
    args = (engine.module, micro_batch, temperature)
    kwargs: dict[str, Any] = {"tokens": "response", "share_prefixes": True, "head": "chunked"}
    if entropy:
        return packed_logprobs(*args, calculate_entropy=True, **kwargs)
    return {"log_probs": packed_logprobs(*args, **kwargs)}


def forward_step(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> tuple[Tensor, dict]:
    """verl's ``FSDPEngineWithLMHead.forward_step`` with the model run over the shared-prefix layout
    where :func:`fallback_reason` finds nothing against it; verl's own otherwise. Same signature,
    same returns (the loss, and the dict of the detached ``model_output``, the loss as a float and
    the loss's metrics), under verl's autocast."""
    patched = _state.patched
    original = patched[1] if patched is not None else getattr(sys.modules[ENGINE_MODULE], ENGINE_CLASS).forward_step
    module = sys.modules[ENGINE_MODULE]
    reason = fallback_reason(self, micro_batch, loss_function) if enabled() else "off"
    COUNTS[reason or "shared"] += 1
    if reason is not None:
        model = getattr(self, "module", None)
        if isinstance(model, torch.nn.Module):
            _own_attention(model)
        return original(self, micro_batch, loss_function, forward_only)
    device_name = module.get_device_name()
    micro_batch = micro_batch.to(module.get_device_id())
    autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
    autocast_ctx: Any = (
        nullcontext()
        if autocast_dtype == torch.float32
        else torch.autocast(device_type=device_name, dtype=autocast_dtype)
    )
    with autocast_ctx:
        model_output = shared_model_output(self, micro_batch)
        if loss_function is not None:
            loss, metrics = loss_function(
                model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
            )
        else:
            assert forward_only, "forward_only must be True when loss_function is None"  # verl's own assert
            loss = torch.tensor(1.0, device=device_name)
            metrics = {}
        output = {"model_output": module.detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}
        return loss, output
