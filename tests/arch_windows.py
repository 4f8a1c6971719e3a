"""The architecture sweep with every window switched on and shrunk below its sequences' lengths.

The sweep's configs keep their defaults where those are off or long (a window of None, Qwen2's
``use_sliding_window=False``, every layer "full_attention"): what the sweep does not vary, it does
not see. This module turns every window, chunk and attention span of a config on, at ``WINDOW``
tokens (``tests/archs.py``'s, which bites inside the sweep's longer sequences): each spelling this
transformers' causal-LM configs use, the flags that switch them on, and a "sliding_attention" layer
where every layer was full. It found PhiMoE and Qwen2-MoE applying their windows only through the
attention mask (silently dropped in a packed row: 2.98 and 0.93 off each sequence alone), now
refused and served. Helpers only; tests/test_arch_sweep.py runs it.
"""

from __future__ import annotations

import contextlib

from nopad._apps import families

W = families.WINDOW
_TOWER = ("vision", "audio", "speech", "image", "video")

# window / chunk / attention-span sizes (int tokens), every spelling found in this transformers' causal-LM configs
WINDOW_SIZES = (
    "sliding_window",  # Mistral, Mixtral, Phi-3, Starcoder2, Qwen2/3(-MoE), Gemma 2/3/3n/4, Cohere2, OLMo3, ...
    "sliding_window_size",  # Inkling
    "attention_window_size",  # RecurrentGemma
    "attention_chunk_size",  # Llama 4 (chunked attention)
    "window_size",  # GPT-Neo local layers
    "local_attention",  # ModernBERT decoder (sliding_window = local_attention // 2)
    "local_attention_window_len",  # BLT local encoder / decoder
    "keep_window_size",  # Doge (dynamic mask keeps this many keys)
    "local_attn_chunk_length",  # Reformer
    "lsh_attn_chunk_length",  # Reformer
)
FLAGS_ON = ("use_sliding_window",)  # Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, SmolLM3 (and VL text towers)
_TOWER = ("vision", "audio", "speech", "image", "video")
ENABLED: dict[str, dict[str, object]] = {}  # model_type -> what was changed, for the report


def _windowed(d: dict, size: int) -> dict:
    """``d`` (one shrunk config dict, sub-configs done by their own call) with its windows on, ``size`` tokens."""
    mt = str(d.get("model_type", ""))
    if any(t in mt for t in _TOWER):
        return d
    changed: dict[str, object] = {}
    has_window = False
    for k in WINDOW_SIZES:
        if k in d:
            has_window = True
            v = d[k]
            small = isinstance(v, int) and not isinstance(v, bool) and 0 < v <= W
            new = v if small and size == W else size
            if new != v:
                d[k] = changed[k] = new
    for k in FLAGS_ON:
        if k in d and d[k] is not True:
            d[k] = changed[k] = True
    if isinstance(d.get("max_window_layers"), int) and d["max_window_layers"] != 1:
        d["max_window_layers"] = changed["max_window_layers"] = 1
    types = d.get("layer_types")
    if has_window and isinstance(types, list) and all(isinstance(t, str) for t in types):
        windowed_kinds = ("sliding_attention", "chunked_attention", "hybrid_sliding", "sliding")
        if not any(t in windowed_kinds for t in types):
            for full, sliding in (("full_attention", "sliding_attention"), ("hybrid", "hybrid_sliding")):
                idx = [i for i, t in enumerate(types) if t == full]
                if len(idx) >= 2 or (len(idx) == 1 and full == "hybrid"):
                    types = list(types)
                    types[idx[-1]] = sliding
                    d["layer_types"] = changed["layer_types"] = types
                    rope = d.get("rope_parameters")  # per-layer-type rope tables need the new type too
                    if isinstance(rope, dict) and full in rope and sliding not in rope:
                        d["rope_parameters"] = changed["rope_parameters"] = {**rope, sliding: rope[full]}
                    break
    for k in ("sliding_window_pattern", "_sliding_window_pattern"):  # every Nth layer full: 2 keeps a mix
        if isinstance(d.get(k), int) and d[k] > 2:
            d[k] = changed[k] = 2
    if changed:
        ENABLED.setdefault(mt, {}).update(changed)
    return d


@contextlib.contextmanager
def windows_on():
    """While inside, every config the sweep shrinks has its windows on at ``W`` tokens (the shrink is
    recursive by its module-level name, so sub-configs are windowed too)."""
    original = families._shrink

    def shrink_windowed(d, *args, **kwargs):
        return _windowed(original(d, *args, **kwargs), W)

    families._shrink = shrink_windowed
    try:
        yield
    finally:
        families._shrink = original
