"""Architecture sweep: every causal-LM type of the installed transformers, packed against each sequence alone.

nopad's promise is that one packed row (several sequences, position ids restarting at 0, no
attention mask) gives the same per-token log-probs as each sequence run by itself. That holds for
softmax attention that keeps the sequences apart; it is silently false for layers that carry a state
along the row (linear attention, Mamba / SSD scans, short convs, recurrences) and for attention
implementations that run the row as one sequence. This module builds a tiny random-weight model of
every type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` from its default config shrunk to tiny sizes
(hidden 64, 2-4 layers keeping one layer of every kind a hybrid has), runs a micro-batch of mixed
lengths both ways and classifies the outcome:

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

import contextlib
import copy
import dataclasses
import inspect
import io
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from nopad._layout import IndexPlan

# read by huggingface_hub when transformers is first imported (lazily, below): never reach the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EXACT_ATOL = 1e-4
VOCAB = 256  # every tiny model's vocabulary
SPECIAL_IDS = 32  # ids >= VOCAB - SPECIAL_IDS are reserved for special / image / audio tokens
TOKENS = VOCAB - SPECIAL_IDS  # the sweep's input ids are drawn from [0, TOKENS)
WINDOW = 16  # sliding windows, attention chunks, sparse top-k: small enough to bite inside a sequence
INIT_RANGE = float(os.environ.get("ARCHS_INIT", "0.1"))  # every config's initializer_range
LENGTHS = (70, 1, 3, 64, 9)  # > a 64-token chunk, length 1, < a conv kernel, exactly a chunk, short

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


def _compress_layers(d: dict) -> None:
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
        d["per_layer_config"] = {j: _shrink(old[i]) for j, i in enumerate(chosen) if i in old}
    elif isinstance(table, dict):  # {layer type: overrides} (Dots3)
        d["per_layer_config"] = {k: _shrink(v) if isinstance(v, dict) else v for k, v in table.items()}
    if key:
        d[key] = len(chosen)


def _shrink(d: dict, vocab: int = VOCAB) -> dict:
    """Tiny sizes over a config's ``to_dict()`` (recursing into sub-configs); returns a new dict."""
    orig, d = d, dict(d)
    for k, v in list(d.items()):
        if _is_config_dict(v):
            d[k] = _shrink(v, vocab)
    heads = d.get("num_attention_heads") or d.get("n_head") or d.get("n_heads")
    _compress_layers(d)
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
        d["initializer_range"] = INIT_RANGE
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


def _reason(exc: BaseException, limit: int | None = 200) -> str:
    text = " ".join(line.strip() for line in str(exc).strip().splitlines())
    return f"{type(exc).__name__}: {text[:limit]}"


@contextlib.contextmanager
def _quiet():
    """transformers' warnings and prints (config validation, init notes) off for the duration."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def tiny_config(model_type: str):
    """The default config of ``model_type`` shrunk to tiny sizes, or a reason string."""
    from transformers import AutoConfig

    try:
        default = AutoConfig.for_model(model_type, **_DEFAULTS.get(model_type, {}))
    except Exception as exc:
        return f"default config does not build: {_reason(exc)}"
    d = _changed(default.to_dict(), _shrink(default.to_dict()), type(default), _OVERRIDES.get(model_type, {}))
    d = _merge(copy.deepcopy(_DEFAULTS.get(model_type, {})), d)
    try:
        return type(default)(**d)
    except Exception as exc:
        return f"shrunk config does not build: {_reason(exc)}"


def _config_for(cls, config):
    """The (sub-)config ``cls`` is built from: a text-only class of a composite config takes its text config."""
    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if isinstance(sub, wanted):
            return sub
    return config


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module | str:
    """A tiny random-weight ``model_type`` causal LM (fp32, eval, CPU) or a short reason it cannot be built."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with _quiet():
        config = tiny_config(model_type)
        if isinstance(config, str):
            return config
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
        try:
            cls = getattr(transformers, name)
        except Exception as exc:
            return f"class {name} unavailable: {_reason(exc)}"
        config = _config_for(cls, config)
        torch.manual_seed(seed)
        try:
            model = cls._from_config(config)
        except Exception as exc:
            return f"{name}(config) fails: {_reason(exc)}"
        if model_type in _PREPARE:
            _PREPARE[model_type](model)
    return model.float().eval()


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
    from nopad.engines.fsdp import packed_logprobs

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
        return result("skipped", None, f"build: {_reason(exc)}")
    if isinstance(model, str):
        return result("skipped", None, model)
    vocab = min(TOKENS, getattr(_text_config(model.config), "vocab_size", None) or TOKENS)
    micro = sweep_batch(vocab, position_rows=4 if is_mrope(model.config) else 1)
    with _quiet():
        try:
            alone = per_sequence_logprobs(model, micro)
        except Exception as exc:
            return result("skipped", None, f"alone: {_reason(exc)}")
        if not torch.isfinite(alone).all():
            return result("skipped", None, "alone: non-finite log-probs")
        try:
            packed = packed_logprobs_of(model, micro, **packed_kwargs)
        except ValueError as exc:  # the whole message: what a refusal says is part of the result
            return result("refused", None, _reason(exc, None))
        except Exception as exc:
            return result("error", None, _reason(exc))
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
