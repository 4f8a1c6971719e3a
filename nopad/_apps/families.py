"""Tiny random-weight models of every causal-LM type of the installed transformers, for ``nopad env``
and the architecture sweep (``tests/archs.py``).

Each type's default config (its class's defaults: nothing is downloaded, nothing calls
``from_pretrained``) is shrunk to tiny sizes: hidden 64, 2-4 layers keeping one layer of every kind
a hybrid has, a 256-token vocabulary, windows (sliding, chunked, sparse top-k) of 16 tokens; the
model is built from it with random weights drawn from a fixed seed (fp32, eval, CPU). A type that
cannot be built so (it needs a package, a second model, a config its defaults do not give) yields a
short reason instead of a model.

transformers is imported only when a model is built. With ``kernels`` installed, transformers 5.25
asks the Hugging Face Hub about a flash-attention kernel when some modeling modules are imported:
run with ``HF_HUB_OFFLINE=1`` set before transformers is first imported (:func:`offline`) to keep
the network out.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

VOCAB = 256  # every tiny model's vocabulary
SPECIAL_IDS = 32  # ids >= VOCAB - SPECIAL_IDS are reserved for special / image / audio tokens
TOKENS = VOCAB - SPECIAL_IDS  # input ids for a tiny model are drawn from [0, TOKENS)
WINDOW = 16  # sliding windows, attention chunks, sparse top-k: small enough to bite inside a sequence
INIT_RANGE = 0.1  # every config's initializer_range (at the usual 0.02 a short conv's leak stays small)

# --------------------------------------------------------------------------------------------------
# Shrinking a config
# --------------------------------------------------------------------------------------------------

# (tiny value, attribute names): an int attribute larger than the value is set to it; smaller ones stay
# fmt: off
_CAPS: list[tuple[int, tuple[str, ...]]] = [
    (64, (
        "hidden_size", "d_model", "n_embd", "embed_dim", "emb_dim", "embedding_dim", "embedding_size",
        "word_embed_proj_dim", "input_embedding_size", "output_embedding_size", "lru_width",
        "attention_hidden_size", "router_hidden_size", "backbone_hidden_size", "adapter_in_dim", "adapter_out_dim",
        "adapter_input_size", "hidden_size_global",
    )),
    (128, (
        "intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "dff", "dim_ff", "d_inner",
        "ffn_hidden_size", "feed_forward_size", "intermediate_size_mlp", "n_inner", "dense_intermediate_size",
    )),
    (32, (
        "moe_intermediate_size", "shared_expert_intermediate_size", "shared_experts_intermediate_size",
        "shared_intermediate_size", "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size", "q_lora_rank",
    )),
    (4, (
        "num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "decoder_attention_heads",
        "encoder_attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads",
        "swa_num_attention_heads", "num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts",
        "linear_num_value_heads",
    )),
    (2, (
        "num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "linear_num_key_heads",
        "linear_num_heads", "index_n_heads", "n_mamba_heads", "zero_expert_num",
    )),
    (1, ("n_group", "num_expert_group", "topk_group", "n_shared_experts", "num_shared_experts",
        "moe_num_shared_experts", "num_nextn_predict_layers", "first_k_dense_replace", "num_dense_layers",
        "n_groups", "mamba_n_groups", "mamba_ngroups")),
    (16, (
        "head_dim", "attention_head_dim", "d_head", "dim_head", "swa_head_dim", "kv_channels", "v_head_dim",
        "qk_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "index_head_dim",
        "kv_lora_rank", "o_lora_rank", "state_size", "mamba_d_state", "ssm_state_size", "mamba_d_head",
        "mamba_head_dim", "mamba_headdim", "hidden_size_per_layer_input", "ple_embed_dim", "block_multiple_of",
        "adapter_rank", "laurel_rank", "gated_norm_rank", "loop_gate_rank", "hc_lowrank",
    )),
    (8, ("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim", "time_step_rank", "mamba_dt_rank", "d_rel")),
    (WINDOW, (
        "sliding_window", "sliding_window_size", "attention_window_size", "attention_chunk_size", "window_size",
        "local_attention", "local_attention_window_len", "index_topk",
    )),
]
_CAP = {name: value for value, names in _CAPS for name in names}
# set exactly (raised too): a model that ignores position ids must still index its table at the packed length
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
              "model_max_length", "original_max_position_embeddings")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "num_query_groups")
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers")
_ENCODER_LAYER_COUNTS = ("encoder_layers", "num_encoder_layers")
# lists of layer indices: turned into per-layer membership, compressed with the per-layer lists
_INDEX_LISTS = ("full_attn_idxs", "attn_layer_indices", "hybrid_layer_ids", "mlp_only_layers", "moe_layers",
                "cross_attention_layers")
_FALSE = ("use_pretrained_backbone", "use_timm_backbone", "use_mamba_kernels", "use_kernels")
_TRUE = ("is_decoder",)  # a causal LM head over an encoder (BERT, RoBERTa...) is causal only as a decoder
# fmt: on

# Mamba-2 style heads: (heads, head width, expand); heads = expand * hidden / head width must hold.
_MAMBA_HEADS = (
    ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
    ("mamba_num_heads", "mamba_head_dim", "expand"),
    ("num_heads", "head_dim", "expand"),  # mamba2 (a config with ``state_size``)
    ("n_mamba_heads", "mamba_headdim", "mamba_expand"),
)

# Per-type overrides, applied after the generic shrink to every config dict of that model_type (a
# composite's text_config too). A value of None deletes the key: the class then derives it.
_MIX = ["linear_attention", "full_attention"]  # a hybrid's layers: one recurrent / linear, one attention
# fmt: off
_OVERRIDES: dict[str, dict[str, Any]] = {
    # hybrids whose default config has one kind of layer only, or a pattern the generic shrink cannot see
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1], "num_hidden_layers": 2},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2},
    "bamba": {"attn_layer_indices": [1], "num_hidden_layers": 2},
    "granitemoehybrid": {"layer_types": _MIX, "num_hidden_layers": 2},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # zamba ties one shared transformer across its hybrid layers: it needs two of them
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "hybrid"], "num_hidden_layers": 3,
              "attention_hidden_size": None, "attention_head_dim": None},
    "zamba2": {"n_mamba_heads": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "attention_layers": None},
    "dory": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "num_hidden_layers": 3,
             "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    # the last layers reuse earlier layers' KV: keep one producer of each kind before them
    "gemma3n_text": {"layer_types": ["sliding_attention", "full_attention"] * 2, "num_hidden_layers": 4,
                     "num_kv_shared_layers": 2, "intermediate_size": [128] * 4,
                     "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0]},
    # defaults this transformers cannot build (None experts, a missing rope, an empty rope table)
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},
    "musicgen_decoder": {"num_codebooks": 1},
    "musicgen_melody_decoder": {"num_codebooks": 1},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
                       "indexer_compress_ratio": 4, "ngram_vocab_size_base": 1000},
    "reformer": {"is_decoder": True, "attn_layers": ["local", "lsh"], "axial_pos_shape": [16, 32],
                 "axial_pos_embds_dim": [16, 48], "attention_head_size": 16, "local_attn_chunk_length": WINDOW,
                 "lsh_attn_chunk_length": WINDOW},  # (still fails alone: position ids at a length off its chunks)
}
# fmt: on
# Constructor kwargs for a default config that does not validate as it stands.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
}
# After building: what a model needs before its first forward.
_PREPARE: dict[str, Any] = {
    "xmod": lambda model: model.set_default_language("en_XX"),
}


def _is_config_dict(value: Any) -> bool:
    return isinstance(value, dict) and "model_type" in value


def _layer_count_key(d: dict) -> str | None:
    for key in _LAYER_COUNTS:
        if isinstance(d.get(key), int) and not isinstance(d.get(key), bool):
            return key
    return None


def _compress_layers(d: dict, init_range: float) -> None:
    """Keep few layers, but at least one of each kind of every per-layer list (layer_types, mlp_layer_types...)."""
    key = _layer_count_key(d)
    n = d.get(key) if key else None
    if n is None:
        # a per-layer list may be the only record of the depth (nemotron_h's layers_block_type)
        lists = [v for k, v in d.items() if k in ("layers_block_type", "layer_types") and isinstance(v, list)]
        n = len(lists[0]) if lists else None
    if not n:
        return
    per_layer = {
        k: v
        for k, v in d.items()
        if isinstance(v, list) and len(v) == n and n > 1 and all(isinstance(x, (str, int, bool)) for x in v)
    }
    floats = {k: v for k, v in d.items() if isinstance(v, list) and len(v) == n and k not in per_layer and n > 1}
    members = {
        k: [i in set(v) for i in range(n)]
        for k, v in d.items()
        if k in _INDEX_LISTS and isinstance(v, list) and all(isinstance(i, int) for i in v)
    }
    kinds = {**per_layer, **members}
    sized = {k for k, v in per_layer.items() if "size" in k}  # per-layer widths: shrunk, not kinds
    chosen: list[int] = []
    seen: set[tuple[str, Any]] = set()
    for i in range(n):
        new = {(k, v[i]) for k, v in kinds.items() if k not in sized} - seen
        if new:
            chosen.append(i)
            seen |= new
    while len(chosen) < min(2, n):  # at least two layers where the model has them
        chosen.append(next(i for i in range(n) if i not in chosen))
        chosen.sort()
    for k, v in {**per_layer, **floats}.items():
        d[k] = [v[i] for i in chosen]
        if k in sized:
            d[k] = [min(x, _CAP["intermediate_size"]) if isinstance(x, int) else x for x in d[k]]
    for k, member in members.items():
        d[k] = [j for j, i in enumerate(chosen) if member[i]]
    table = d.get("per_layer_config")
    if isinstance(table, dict) and all(str(i).isdigit() for i in table):  # {layer index: overrides} (Gemma 4)
        old = {int(i): v for i, v in table.items()}
        d["per_layer_config"] = {j: _shrink(old[i], init_range=init_range) for j, i in enumerate(chosen) if i in old}
    elif isinstance(table, dict):  # {layer type: overrides} (Dots3)
        d["per_layer_config"] = {
            k: _shrink(v, init_range=init_range) if isinstance(v, dict) else v for k, v in table.items()
        }
    if key:
        d[key] = len(chosen)


def _shrink(d: dict, vocab: int = VOCAB, init_range: float = INIT_RANGE) -> dict:
    """Tiny sizes over a config's ``to_dict()`` (recursing into sub-configs); returns a new dict."""
    orig, d = d, dict(d)
    for k, v in list(d.items()):
        if _is_config_dict(v):
            d[k] = _shrink(v, vocab, init_range)
    heads = d.get("num_attention_heads") or d.get("n_head") or d.get("n_heads")
    _compress_layers(d, init_range)
    for k, v in list(d.items()):
        if isinstance(v, bool) or not isinstance(v, int):
            if k in _FALSE and v is True:
                d[k] = False
            elif k in _TRUE and v is False:
                d[k] = True
            continue
        if k in _POSITIONS:
            d[k] = 512
        elif k in _CAP and v > _CAP[k]:
            d[k] = _CAP[k]
        elif k in _KV_HEADS and isinstance(heads, int) and v > 1:
            d[k] = _CAP["num_attention_heads"] if v >= heads else 2
        elif k in _LAYER_COUNTS and v > 2 and k != _layer_count_key(d):
            d[k] = 2
        elif k in _ENCODER_LAYER_COUNTS and v > 1:
            d[k] = 1
        elif ("vocab_size" in k or k.endswith("_vocab")) and v > vocab:
            d[k] = vocab
    if "head_dim" in d and d["head_dim"] is None and heads:  # some classes read it as given
        d["head_dim"] = _CAP["head_dim"]
    if isinstance(d.get("qk_rope_head_dim"), int):  # MLA: head_dim is the rope part or the whole q/k head
        d["qk_head_dim"] = d["qk_rope_head_dim"] + (d.get("qk_nope_head_dim") or 0)
        if orig.get("head_dim") == orig.get("qk_rope_head_dim"):
            d["head_dim"] = d["qk_rope_head_dim"]
        elif orig.get("head_dim") == orig["qk_rope_head_dim"] + (orig.get("qk_nope_head_dim") or 0):
            d["head_dim"] = d["qk_head_dim"]
    for k in ("num_experts_per_tok", "num_experts_per_token"):  # a None top-k beside routed experts
        if k in d and d[k] is None and any(isinstance(d.get(e), int) for e in ("n_routed_experts", "num_experts")):
            d[k] = 2
    for k in _KV_HEADS:
        if k in d and d[k] is None and heads:
            d[k] = d.get("num_attention_heads") or heads
    for k, v in list(d.items()):  # token ids past the tiny vocabulary: into the reserved top ids
        if isinstance(v, int) and not isinstance(v, bool) and (k.endswith("_token_id") or k.endswith("_token_index")):
            if v >= vocab:
                d[k] = vocab - SPECIAL_IDS + (v % SPECIAL_IDS)
        elif isinstance(v, list) and k.endswith("_token_id") and all(isinstance(x, int) for x in v):
            d[k] = [x if x < vocab else vocab - SPECIAL_IDS + (x % SPECIAL_IDS) for x in v]
    if isinstance(d.get("initializer_range"), float):
        d["initializer_range"] = init_range
    for n_key, dh_key, exp_key in _MAMBA_HEADS:
        if n_key == "num_heads" and "state_size" not in d:
            continue
        if isinstance(d.get(n_key), int) and isinstance(d.get(dh_key), int) and isinstance(d.get("hidden_size"), int):
            d[n_key] = int(d.get(exp_key) or 2) * d["hidden_size"] // d[dh_key]
            if isinstance(d.get("mamba_d_ssm"), int):
                d["mamba_d_ssm"] = d[n_key] * d[dh_key]
    return _apply_overrides(d, _OVERRIDES.get(d.get("model_type", ""), {}))


def _apply_overrides(d: dict, overrides: dict[str, Any]) -> dict:
    for dotted, value in overrides.items():
        *path, key = dotted.split(".")
        target = d
        for part in path:
            target = target[part]
        if value is None:
            target.pop(key, None)
        else:
            target[key] = copy.deepcopy(value)
    return d


# not dataclass fields, but kwargs the config classes read (and that must follow the compressed layers)
_KWARGS = ("per_layer_config",)


def _changed(default: dict, shrunk: dict, cls: type, forced: dict) -> dict:
    """The constructor kwargs of ``cls`` that ``shrunk`` changes (sub-configs: their changed kwargs).

    Only dataclass fields go in (and ``forced``, the per-type overrides): what the class derives in its
    ``__post_init__`` (attention widths, head widths, index lists) it derives again from the tiny sizes.
    """
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(default)
    subs = getattr(cls, "sub_configs", None) or {}
    # attribute_map {field: stored name}: to_dict writes num_experts, the constructor takes num_local_experts
    field_of = {stored: field for field, stored in (getattr(cls, "attribute_map", None) or {}).items()}
    out = {}
    for k, v in shrunk.items():
        name = field_of[k] if k not in fields and field_of.get(k) in fields else k
        if name not in fields and k not in forced and k not in _KWARGS:
            continue
        if k in default and _is_config_dict(v) and _is_config_dict(default[k]):
            sub_cls = subs.get(k)
            sub = _changed(default[k], v, sub_cls, _sub_overrides(forced, k, v)) if sub_cls else v
            if sub:
                out[name] = sub
        elif k not in default or default[k] != v or k in forced:
            out[name] = v
    return out


def _sub_overrides(forced: dict, key: str, sub: dict) -> dict:
    """The overrides that reach sub-config ``key``: those of its model_type and the parent's "key.x" ones."""
    prefix = key + "."
    return {
        **_OVERRIDES.get(sub["model_type"], {}),
        **{k[len(prefix) :]: v for k, v in forced.items() if k.startswith(prefix)},
    }


def _merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        base[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return base


def causal_lm_types() -> list[str]:
    """The model types of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def reason(exc: BaseException, limit: int | None = 200) -> str:
    """``exc`` on one line: its type and (the first ``limit`` characters of) its message."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines())
    return f"{type(exc).__name__}: {text[:limit]}"


def offline() -> None:
    """Keep the Hugging Face Hub out of this process: ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1``,
    read when huggingface_hub is first imported (and its flag set too where it was imported before)."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        setattr(constants, "HF_HUB_OFFLINE", True)  # noqa: B010 - set where it was read at import


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers' and kernels' warnings and prints (config validation, init notes, the Hub kernel
    checks of an offline process) off for the duration."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    kernels_logger = logging.getLogger("kernels")
    kernels_level = kernels_logger.level
    hf_logging.set_verbosity_error()
    kernels_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        kernels_logger.setLevel(kernels_level)


def tiny_config(model_type: str, *, init_range: float = INIT_RANGE) -> Any:
    """The default config of ``model_type`` shrunk to tiny sizes, or a reason string."""
    from transformers import AutoConfig

    try:
        default = AutoConfig.for_model(model_type, **_DEFAULTS.get(model_type, {}))
    except Exception as exc:
        return f"default config does not build: {reason(exc)}"
    shrunk = _shrink(default.to_dict(), init_range=init_range)
    d = _changed(default.to_dict(), shrunk, type(default), _OVERRIDES.get(model_type, {}))
    d = _merge(copy.deepcopy(_DEFAULTS.get(model_type, {})), d)
    try:
        return type(default)(**d)
    except Exception as exc:
        return f"shrunk config does not build: {reason(exc)}"


def _config_for(cls: type, config: Any) -> Any:
    """The (sub-)config ``cls`` is built from: a text-only class of a composite config takes its text config."""
    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if isinstance(sub, wanted):
            return sub
    return config


def tiny_model(model_type: str, seed: int = 0, *, init_range: float = INIT_RANGE) -> torch.nn.Module | str:
    """A tiny random-weight ``model_type`` causal LM (fp32, eval, CPU) or a short reason it cannot be built.

    Its weights are drawn after ``torch.manual_seed(seed)`` (torch's global generator), with
    ``initializer_range`` set to ``init_range`` in every config that has one."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with quiet():
        config = tiny_config(model_type, init_range=init_range)
        if isinstance(config, str):
            return config
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
        try:
            cls = getattr(transformers, name)
        except Exception as exc:
            return f"class {name} unavailable: {reason(exc)}"
        config = _config_for(cls, config)
        torch.manual_seed(seed)
        try:
            model = cls._from_config(config)
        except Exception as exc:
            return f"{name}(config) fails: {reason(exc)}"
        if model_type in _PREPARE:
            _PREPARE[model_type](model)
    return model.float().eval()
