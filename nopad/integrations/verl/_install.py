"""The machinery behind ``nopad.integrations.verl.install()``: verl's names routed to nopad.

``install()`` rebinds, in verl's own modules only, the names verl uses for its conversions:

    verl.workers.utils.padding   left_right_2_no_padding, no_padding_2_padding, response_from_nested,
                                 response_to_nested, build_attention_mask_from_nested,
                                 embeds_padding_2_no_padding
    verl.models.mcore.util       preprocess_thd_engine, postprocess_thd_engine
    verl.utils.tensordict_utils  index_select_tensor_dict, chunk_tensordict, concat_nested_tensors,
                                 concat_tensordict, pad_to_divisor, unpad  (make_iterator uses them)
    verl.utils.seqlen_balancing  rearrange_micro_batches, restore_dynamic_batch,
                                 get_seqlen_balanced_partitions, karmarkar_karp
    verl.workers.engine.utils    postprocess_batch_func (the join of the micro-batches' outputs)
    verl.utils.experimental.torch_functional
                                 FusedLinearForPPO (``use_fused_kernels``' torch path: nopad's
                                 chunked head, nopad.modeling._logprobs.head_log_probs)
    verl.utils.kernel.linear_cross_entropy
                                 linear_cross_entropy (``use_fused_kernels``' Triton path, HF and
                                 Megatron forwards: verl's kernel where it runs, nopad's tiles,
                                 vocabulary-parallel too, everywhere else; ``install(head_kernel=)``)

Each replacement has verl's signature and verl's observable behaviour (in-place updates of the
TensorDict, ``NonTensorData`` metadata, output dtypes, shapes and values, PackedSeqParams fields,
the tensor/context-parallel sizes read from megatron-core's ``parallel_state`` as verl reads them),
computed with one index plan instead of a Python loop over rows. Every verl module that bound one
of these functions by ``from ... import`` is rebound too: those imported already (found in
``sys.modules``, names starting with ``verl`` only) and those imported later (an import hook on
``sys.meta_path`` that rebinds a verl module right after it executes).

The handle's ``uninstall()`` puts every original binding back and removes the hook; ``install()``
is idempotent and the handle is a context manager::

    from nopad.integrations.verl._install import _install as nopad_verl
    nopad_verl.install()                       # the one line
    with nopad_verl.install(): ...             # or for a block

``install(share_prefixes=True)`` also routes ``FSDPEngineWithLMHead.forward_step`` (verl's FSDP engine's
forward for the actor's and the reference's log-probs and the PPO loss) through the shared-prefix
layout, each group's prompt computed once, where it serves the call exactly (:mod:`._shared`).

Options nopad does not implement fall through to verl's original function: dynamic context
parallel (``local_cp_size``), ``min_local_rows``, Ascend NPUs, and a ``pad_to_length_bucket``
whose total padding would break the per-sequence CP alignment.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from tensordict import NonTensorData, TensorDict
from torch import Tensor

import nopad.batches._padding as _padding
import nopad.integrations.verl._head as _head
import nopad.integrations.verl._models as _models
import nopad.integrations.verl._originals as _originals
import nopad.integrations.verl._rows as _rows
import nopad.integrations.verl._shared as _shared
from nopad.core._batch import get_field, takes_keyword
from nopad.core._errors import check_flag, check_int, check_optional_int, input_error
from nopad.core._layout import is_nested, known_host_lengths, nested_offsets, remember_host_lengths
from nopad.core._torch_internals import cached_seqlens, jagged_values, wrap_jagged
from nopad.engines._megatron import ThdPlan, postprocess_thd
from nopad.integrations.verl._head import KERNEL_MODULE, TORCH_FUNCTIONAL_MODULE, FusedLinearForPPO
from nopad.integrations.verl._originals import verl_original
from nopad.parallel._cp import alignment_of

SUPPORTED_VERSIONS = ("0.9.1",)
PADDING_MODULE = "verl.workers.utils.padding"
MCORE_UTIL_MODULE = "verl.models.mcore.util"


# ---- the replacements, with verl's signatures ----------------------------------------------------
def left_right_2_no_padding(data: TensorDict) -> TensorDict:
    """verl's ``left_right_2_no_padding`` on nopad's index plan: updates ``data`` in place and returns it.

    As verl: input_ids / position_ids become nested, loss_mask = response_mask, routed_experts (if
    padded) and teacher_logprobs + teacher_ids (if both present) become nested, and max_seq_len,
    max_response_len and indices are stored as ``NonTensorData``. A float attention_mask of 0s and
    1s is taken as verl takes it. Unlike verl, a row whose real tokens are not one run across the
    prompt/response boundary, a mask that is not 0/1 (verl's unpad_input would count a 0.5 in the
    lengths but not in the indices) and a missing key raise ValueError naming the row or key (verl
    asserts).
    """
    if not isinstance(data, TensorDict):
        raise input_error("data", None, "a TensorDict", type(data).__name__)
    missing = [key for key in _padding.REQUIRED_KEYS if key not in data.keys()]
    if missing:
        raise input_error(
            "data", None, f"the keys of left-right padding data {list(_padding.REQUIRED_KEYS)}", f"missing {missing}"
        )
    view = data.copy()
    if ("teacher_logprobs" in view.keys()) != ("teacher_ids" in view.keys()):  # verl nests them only as a pair
        view = view.exclude("teacher_logprobs", "teacher_ids")
    out = _padding.left_right_2_no_padding(view)
    data.pop("input_ids")
    for key in ("max_seq_len", "max_response_len", "indices"):
        data[key] = NonTensorData(get_field(out, key))
    # verl's input_ids (and the per-token fields nested with them) take unpad_input's int32 cu_seqlens
    # as their offsets; its position_ids get their own int64 ones (as_nested_tensor)
    cu_seqlens = _int32_offsets(nested_offsets(out["input_ids"]))
    data["input_ids"] = _with_offsets(out["input_ids"], cu_seqlens)
    data["position_ids"] = out["position_ids"]
    data["loss_mask"] = data["response_mask"]
    for key in ("routed_experts", "teacher_logprobs", "teacher_ids"):
        if key in view.keys() and is_nested(out[key]) and not is_nested(data[key]):
            data[key] = _with_offsets(out[key], cu_seqlens)
    return data


def _int32_offsets(offsets: Tensor) -> Tensor:
    """``offsets`` as int32 (one cast), its host lengths still known to nopad when they were."""
    cu_seqlens = offsets.to(torch.int32)
    lengths = known_host_lengths(offsets)
    if lengths is not None:
        remember_host_lengths(cu_seqlens, lengths)
    return cu_seqlens


def _with_offsets(x: Tensor, offsets: Tensor) -> Tensor:
    """The jagged (B, j, *) ``x`` over other offsets of the same rows (its values shared)."""
    low, high = cached_seqlens(x)
    return wrap_jagged(jagged_values(x), offsets, 1, min_seqlen=low, max_seqlen=high)


def embeds_padding_2_no_padding(data: TensorDict) -> TensorDict:
    """verl's ``embeds_padding_2_no_padding``: prompt (and negative) embeds -> nested, in place; returns ``data``."""
    data["prompt_embeds"], data["prompt_embeds_mask"]  # verl requires both: the same KeyError
    out = _padding.embeds_padding_2_no_padding(data)
    for key in ("prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds", "negative_prompt_embeds_mask"):
        if key in out.keys() and is_nested(out[key]):
            data[key] = out[key]
    return data


def preprocess_thd_engine(
    input_ids: Tensor,
    pre_process: bool = True,
    need_roll: bool = False,
    use_fp8_padding: bool = False,
    local_cp_size: int | None = None,
    min_local_rows: int | None = None,
    pad_to_length_bucket: int | None = None,
    cp_layout: str = "zigzag",
) -> tuple[Tensor, Any, Tensor | None]:
    """verl's ``preprocess_thd_engine`` on nopad's THD plan: nested (B, j, *) -> this CP rank's
    ``(tokens (1, T/cp, *), PackedSeqParams, position_ids (1, T/cp))``.

    TP/CP sizes and the CP rank come from megatron-core's ``parallel_state`` as verl reads them.
    Tokens, position ids (need_roll included) and PackedSeqParams equal verl's slot for slot.
    The flags are real bools: a string "false" is refused where verl would read it as True.
    """
    pre_process, need_roll = check_flag(pre_process, "pre_process"), check_flag(need_roll, "need_roll")
    use_fp8_padding = check_flag(use_fp8_padding, "use_fp8_padding")
    pad_to_length_bucket = check_optional_int(pad_to_length_bucket, "pad_to_length_bucket")
    util = _mcore_util()
    fallback = (
        util is None
        or cp_layout not in ("zigzag", "contiguous")
        or local_cp_size is not None
        or min_local_rows is not None
        or bool(getattr(util, "is_npu_available", False))
        or not is_nested(input_ids)
    )
    mpu = None if fallback else util.mpu  # type: ignore[union-attr]
    if mpu is not None:
        tp_size = mpu.get_tensor_model_parallel_world_size()
        cp_size = mpu.get_context_parallel_world_size()
        cp_rank = mpu.get_context_parallel_rank()
        align = alignment_of(tp_size, cp_size, cp_layout)  # type: ignore[arg-type]
        if pad_to_length_bucket is not None and pad_to_length_bucket > 0 and not use_fp8_padding:
            fallback = math.lcm(pad_to_length_bucket, cp_size) % align != 0  # verl's total would break alignment
    if fallback:
        return verl_original(MCORE_UTIL_MODULE, "preprocess_thd_engine")(
            input_ids,
            pre_process=pre_process,
            need_roll=need_roll,
            use_fp8_padding=use_fp8_padding,
            local_cp_size=local_cp_size,
            min_local_rows=min_local_rows,
            pad_to_length_bucket=pad_to_length_bucket,
            cp_layout=cp_layout,
        )
    if pad_to_length_bucket is not None and pad_to_length_bucket <= 0:
        raise input_error("pad_to_length_bucket", None, "a positive integer", f"{pad_to_length_bucket}")
    params_cls = util.PackedSeqParams  # type: ignore[union-attr]
    has_mode = takes_keyword(params_cls.__init__, "cp_partition_mode")
    if cp_layout != "zigzag" and cp_size > 1 and not has_mode:
        raise input_error(
            "cp_layout",
            None,
            "'zigzag' with this megatron-core, whose PackedSeqParams has no cp_partition_mode "
            "(upgrade megatron-core for another layout)",
            repr(cp_layout),
        )
    plan = ThdPlan.from_nested(
        input_ids,
        tp_size=tp_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_layout=cp_layout,  # type: ignore[arg-type]
        use_fp8_padding=use_fp8_padding,
        pad_to_length_bucket=pad_to_length_bucket,
    )
    params = plan.packed_seq_params(params_cls)
    if not pre_process:
        return input_ids, params, None
    tokens, positions = _verl_thd_shard(plan, input_ids.values(), need_roll)
    return tokens.unsqueeze(0), params, positions.unsqueeze(0)


def postprocess_thd_engine(
    output: Tensor,
    packed_seq_params: Any,
    input_ids: Tensor,
    batch_size: int,
    post_process: bool = True,
    local_cp_size: int | None = None,
    cp_layout: str = "zigzag",
) -> Tensor:
    """verl's ``postprocess_thd_engine``: this rank's (1, T/cp, *) output -> nested (B, j, *), CP shards gathered.

    ``batch_size`` must be ``input_ids``' number of sequences (verl's loop runs over it; nopad reads
    the boundaries), and ``post_process`` a real bool.
    """
    if cp_layout not in ("zigzag", "contiguous"):
        raise input_error("cp_layout", None, "'zigzag' or 'contiguous'", repr(cp_layout))
    if not check_flag(post_process, "post_process"):
        return output
    rows = input_ids.size(0) if is_nested(input_ids) else None
    if rows is not None and check_int(batch_size, "batch_size") != rows:  # verl loops over it: the count
        raise input_error("batch_size", None, f"{rows}, the number of sequences in input_ids", repr(batch_size))
    util = _mcore_util()
    if util is None or local_cp_size is not None:
        return verl_original(MCORE_UTIL_MODULE, "postprocess_thd_engine")(
            output,
            packed_seq_params,
            input_ids,
            batch_size,
            post_process=post_process,
            local_cp_size=local_cp_size,
            cp_layout=cp_layout,
        )
    mpu = util.mpu
    return postprocess_thd(
        output,
        packed_seq_params,
        input_ids,
        cp_size=mpu.get_context_parallel_world_size(),
        cp_group=mpu.get_context_parallel_group(),
        cp_rank=mpu.get_context_parallel_rank(),
        cp_layout=cp_layout,  # type: ignore[arg-type]
    )


REPLACEMENTS: dict[str, dict[str, Callable[..., Any]]] = {
    PADDING_MODULE: {
        "left_right_2_no_padding": left_right_2_no_padding,
        "no_padding_2_padding": _padding.no_padding_2_padding,  # verl's signature and results already
        "response_from_nested": _padding.response_from_nested,  # verl's signature and results already
        "response_to_nested": _padding.response_to_nested,  # verl's signature and results already
        "build_attention_mask_from_nested": _padding.build_attention_mask_from_nested,
        "embeds_padding_2_no_padding": embeds_padding_2_no_padding,
    },
    MCORE_UTIL_MODULE: {
        "preprocess_thd_engine": preprocess_thd_engine,
        "postprocess_thd_engine": postprocess_thd_engine,
    },
    _rows.TENSORDICT_UTILS: {
        "index_select_tensor_dict": _rows.index_select_tensor_dict,
        "chunk_tensordict": _rows.chunk_tensordict,
        "concat_nested_tensors": _rows.concat_nested_tensors,
        "concat_tensordict": _rows.concat_tensordict,
        "pad_to_divisor": _rows.pad_to_divisor,
        "unpad": _rows.unpad,
    },
    _rows.SEQLEN_BALANCING: {
        "rearrange_micro_batches": _rows.rearrange_micro_batches,
        "restore_dynamic_batch": _rows.restore_dynamic_batch,
        "get_seqlen_balanced_partitions": _rows.get_seqlen_balanced_partitions,
        "karmarkar_karp": _rows.karmarkar_karp,
    },
    _rows.ENGINE_UTILS: {"postprocess_batch_func": _rows.postprocess_batch_func},
    TORCH_FUNCTIONAL_MODULE: {"FusedLinearForPPO": FusedLinearForPPO},
    KERNEL_MODULE: {"linear_cross_entropy": _head.linear_cross_entropy},
    _models.QWEN3_5_MODULE: {
        "_packed_causal_conv1d_fallback": _models.packed_causal_conv1d_fallback,
        "_packed_chunk_gated_delta_rule": _models.packed_chunk_gated_delta_rule,
    },
}
# the verl functions install() routes to nopad, by defining module (Qwen3.5's model fallbacks aside)
ROUTED = {module: tuple(names) for module, names in REPLACEMENTS.items() if module != _models.QWEN3_5_MODULE}


def _verl_thd_shard(plan: Any, values: Tensor, need_roll: bool) -> tuple[Tensor, Tensor]:
    """This rank's (local_len, *) tokens and (local_len,) position ids exactly as verl lays them out.

    Tokens as nopad's plan places them; with ``need_roll`` each slot reads the NEXT slot of the
    padded layout as verl rolls it: within the padded sequence under zigzag CP, across the whole
    buffer without CP, within the real tokens under the contiguous layout. Padding reads 0.
    Position ids: a slot's own position, 0 on padding, except that verl fills the whole first
    zigzag chunk of each rank with positions and keeps them through its roll. No sync.
    """
    seg, off = plan.segment, plan.offset_in_segment  # the plan's one derivation of slot -> sequence
    lengths = plan.lengths.to(seg.device)
    seg_len, seg_padded = lengths[seg], plan.padded_lengths.to(seg.device)[seg]
    zigzag_cp = plan.cp_layout == "zigzag" and plan.cp_size > 1
    if need_roll and plan.cp_layout != "zigzag":
        t_seg, t_off = seg, torch.where(off < seg_len, (off + 1) % seg_len.clamp(min=1), off)
    elif need_roll and not zigzag_cp:  # one rank holds the whole buffer in order: the next slot's
        t_seg, t_off = seg.roll(-1), off.roll(-1)
    elif need_roll:
        t_seg, t_off = seg, (off + 1) % seg_padded
    else:
        t_seg, t_off = seg, off
    real = t_off < lengths[t_seg]
    src = torch.where(real, plan.source_starts.to(seg.device)[t_seg] + t_off, 0)
    out = values.index_select(0, src)
    out = torch.where(real.view(-1, *([1] * (out.dim() - 1))), out, torch.zeros((), dtype=out.dtype))
    if not zigzag_cp:
        positions = torch.where(real, t_off, 0)
    else:
        chunk = seg_padded // (2 * plan.cp_size)
        first = off // chunk == plan.cp_rank  # verl numbers the whole first chunk, padding included

        def pos(x: Tensor) -> Tensor:
            return torch.where((x < seg_len) | first, x, 0)

        positions = pos(off)
        if need_roll:
            chunk_end = (off + 1) % chunk == 0
            positions = torch.where(chunk_end, torch.where(off == seg_padded - 1, 0, positions), pos(off + 1))
    return out, positions


# ---- install / uninstall ---------------------------------------------------------------------------
def _is_verl(name: str) -> bool:
    return name == "verl" or name.startswith("verl.")


def verl_version() -> str | None:
    """The installed verl's version, read from its package metadata (verl is not imported); None if absent."""
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        module = sys.modules.get("verl")
        return getattr(module, "__version__", None) if module is not None else None


class VerlPatch:
    """The handle ``install()`` returns: what was rebound, and ``uninstall()`` to put it back."""

    def __init__(self) -> None:
        self.originals: dict[tuple[str, str], Callable[..., Any]] = {}  # (defining module, name) -> verl's
        self._by_original: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {}
        self._by_replacement: dict[int, Callable[..., Any]] = {}  # id(replacement) -> original
        self._bindings: dict[tuple[str, str], tuple[dict[str, Any], Callable[..., Any]]] = {}
        self._finder: _VerlFinder | None = None
        self.active = False

    @property
    def bindings(self) -> list[tuple[str, str]]:
        """(module, name) of every binding rebound to nopad, sorted."""
        return sorted(self._bindings)

    def _learn(self, module_name: str, namespace: dict[str, Any]) -> None:
        """Record verl's originals from the module that defines them (once)."""
        for name, replacement in REPLACEMENTS.get(module_name, {}).items():
            original = namespace.get(name)
            if original is None or original is replacement or (module_name, name) in self.originals:
                continue
            self.originals[module_name, name] = original
            self._by_original[id(original)] = (original, replacement)
            self._by_replacement[id(replacement)] = original

    def _patch(self, module_name: str, module: Any) -> None:
        if module_name == _shared.ENGINE_MODULE and _shared.enabled():  # install(share_prefixes=True)
            _shared.patch_engine(module)
        try:
            namespace = vars(module)
        except TypeError:
            return
        self._learn(module_name, namespace)
        for name, value in list(namespace.items()):
            pair = self._by_original.get(id(value))
            if pair is not None and pair[0] is value:
                namespace[name] = pair[1]
                self._bindings[module_name, name] = (namespace, value)
            elif id(value) in self._by_replacement and (module_name, name) not in self._bindings:
                # bound after install() by ``from ... import``: already ours, restored on uninstall
                self._bindings[module_name, name] = (namespace, self._by_replacement[id(value)])

    def _patch_loaded(self) -> None:
        verl_modules = [(name, m) for name, m in list(sys.modules.items()) if _is_verl(name) and m is not None]
        for name, module in verl_modules:  # the defining modules first, so every original is known
            if name in ROUTED:
                self._patch(name, module)
        for name, module in verl_modules:
            if name not in ROUTED:
                self._patch(name, module)

    def uninstall(self) -> None:
        """Restore every binding ``install()`` changed (where it still holds nopad's function) and
        remove the import hook. Idempotent."""
        global _ACTIVE
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None
        replacements = {id(f) for names in REPLACEMENTS.values() for f in names.values()}
        for (_, name), (namespace, original) in self._bindings.items():
            if id(namespace.get(name)) in replacements:
                namespace[name] = original
        self._bindings.clear()
        _shared.set_enabled(False)
        self.active = False
        if _ACTIVE is self:
            _ACTIVE = None
            _originals.learn_into(None)

    def __enter__(self) -> VerlPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        return f"VerlPatch(active={self.active}, bindings={len(self._bindings)})"


class _PatchingLoader(importlib.abc.Loader):
    """Runs a verl module with its own loader, then rebinds its names to nopad."""

    def __init__(self, loader: Any, patch: VerlPatch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader  # the module sees its own loader, as without the hook
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        if self._patch.active:
            self._patch._patch(module.__name__, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _VerlFinder(importlib.abc.MetaPathFinder):
    """Finds verl modules with the other finders and wraps their loader in a :class:`_PatchingLoader`."""

    def __init__(self, patch: VerlPatch):
        self._patch = patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not _is_verl(fullname):
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _VerlFinder):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, self._patch)
        return spec


_ACTIVE: VerlPatch | None = None

# A venv with verl's own pins, from a nopad checkout (docs/integrations/verl.md shows these steps; a
# test keeps the two equal). `pip install verl==0.9.1` in nopad's own venv would downgrade it
# (tensordict 0.15 -> 0.10, transformers 5.24 -> 5.10) and still lack what verl's trainer imports.
VERL_VENV_STEPS = (
    "python3 -m venv verl-venv && . verl-venv/bin/activate",
    "pip install torch==2.13.0",
    "pip install verl==0.9.1",
    "pip install cachetools uvicorn fastapi",
    "pip install --no-deps megatron-core==0.16.1",
    "pip install --no-deps -e .",
)


def install(*, check_version: bool = True, head_kernel: str = "auto", share_prefixes: bool = False) -> VerlPatch:
    """Route verl's padding and THD conversions to nopad; returns the handle (also a context manager).

    Idempotent: a second call returns the active handle. Refuses a verl other than
    ``SUPPORTED_VERSIONS`` with a RuntimeError naming the version found (``check_version=False``
    skips the check, at your own risk), and raises ImportError when verl is not installed.
    Touches only modules whose name starts with ``verl``.

    ``head_kernel``: what serves verl's ``linear_cross_entropy`` (the Triton head of
    ``use_fused_kernels``): "auto" keeps verl's kernel where it runs (probed once per device: a small
    forward and backward must run and equal nopad's tiles) and the call is one it takes, and runs
    nopad's tiles everywhere else (a CPU, a GPU its Triton does not support); "nopad" always runs
    the tiles; "verl" always verl's kernel. A second ``install()`` applies its ``head_kernel``.

    ``share_prefixes``: True runs verl's FSDP engine's forward (the actor's and the reference's
    log-probs, the actor's PPO loss) with each group's shared prompt computed once, where the
    shared-prefix layout serves the call exactly, and verl's own forward everywhere else
    (:mod:`nopad.integrations.verl._shared` names each case). Off by default; a second ``install()``
    applies its ``share_prefixes`` too.
    """
    global _ACTIVE
    check_version = check_flag(check_version, "check_version")
    share_prefixes = check_flag(share_prefixes, "share_prefixes")
    _head.use_kernel(head_kernel)
    if _ACTIVE is not None and _ACTIVE.active:
        _shared.set_enabled(share_prefixes)
        return _ACTIVE
    version = verl_version()
    if version is None:
        steps = "\n".join(f"  {step}" for step in VERL_VENV_STEPS)
        raise ImportError(
            "nopad.integrations.verl: verl is not installed. verl 0.9.1 pins tensordict<=0.10 and "
            "transformers<5.11, so installing it into this environment would downgrade both: give it a "
            f"venv of its own, from a nopad checkout (docs/integrations/verl.md, 'A venv for verl'):\n{steps}"
        )
    if check_version and version not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"nopad.integrations.verl: found verl {version}, but these adapters were checked against verl "
            f"{', '.join(SUPPORTED_VERSIONS)} only (its function signatures and TensorDict layout); "
            "install a supported verl or pass check_version=False to try anyway"
        )
    patch = VerlPatch()
    patch.active = True
    _originals.learn_into(patch.originals)
    importlib.import_module(PADDING_MODULE)  # cheap, and its originals are then known for every caller
    patch._patch_loaded()
    patch._finder = _VerlFinder(patch)
    sys.meta_path.insert(0, patch._finder)
    _shared.set_enabled(share_prefixes)  # the engine's class now if verl loaded it, else from the hook
    _ACTIVE = patch
    return patch


def active() -> VerlPatch | None:
    """The installed handle, or None."""
    return _ACTIVE if _ACTIVE is not None and _ACTIVE.active else None


def _mcore_util() -> Any:
    """verl's ``verl.models.mcore.util``, imported when a routed THD function is called before it was
    (its originals are then learned by the import hook); None where it cannot be imported."""
    util = sys.modules.get(MCORE_UTIL_MODULE)
    if util is not None:
        return util
    try:
        return importlib.import_module(MCORE_UTIL_MODULE)
    except ImportError:
        return None
