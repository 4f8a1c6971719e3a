"""Synthetic RL batches and tiny random-weight causal LMs, for the demo, benchmarks and examples.

Nothing here downloads anything: models are built from a config with random weights.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from nopad._errors import input_error


def _long_tailed_lengths(n: int, width: int, *, low: int = 1, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n,) int64 lengths in [low, width], exponential with mean width / 4: most short, a few long."""
    draw = -torch.log1p(-torch.rand(n, generator=generator)) * (width / 4)
    return (draw + low).round().long().clamp(low, width)


def synthetic_batch(
    B: int,
    prompt_width: int,
    resp_width: int,
    *,
    seed: int = 0,
    device: str = "cpu",
    vocab: int = 150_000,
    mrope: int = 0,
) -> TensorDict:
    """A padded RL batch: prompts left-padded to ``prompt_width``, responses right-padded to ``resp_width``.

    Keys: input_ids (B, S), attention_mask (B, S), response_mask (B, R), position_ids (B, S) or
    (B, mrope, S), with S = prompt_width + resp_width and long-tailed lengths.
    """
    g = torch.Generator().manual_seed(seed)
    prompt_lens = _long_tailed_lengths(B, prompt_width, generator=g)
    resp_lens = _long_tailed_lengths(B, resp_width, generator=g)
    cols_p, cols_r = torch.arange(prompt_width), torch.arange(resp_width)
    response_mask = (cols_r < resp_lens[:, None]).long()
    attention_mask = torch.cat([(cols_p >= prompt_width - prompt_lens[:, None]).long(), response_mask], 1)
    S = prompt_width + resp_width
    input_ids = torch.randint(1, vocab, (B, S), generator=g) * attention_mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if mrope:
        position_ids = position_ids.unsqueeze(1).expand(B, mrope, S).contiguous()
    fields = dict(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, position_ids=position_ids
    )
    return TensorDict(fields, batch_size=[B]).to(device)


def tiny_causal_lm(
    arch: str = "llama",
    *,
    vocab: int = 1000,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """A random-weight HF causal LM (``llama`` or ``qwen2``), fp32, eval mode. Needs the hf extra.

    ``heads`` query heads and ``kv_heads`` key/value heads (grouped-query attention when fewer);
    MLP width 2 * hidden; positions up to 32k.
    """
    import transformers

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
    if arch not in classes:
        raise input_error("arch", None, f"one of {sorted(classes)}", f"{arch!r}")
    config_cls, model_cls = (getattr(transformers, name) for name in classes[arch])
    config = config_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    model.config._attn_implementation = attn_implementation
    return model.float().eval()


__all__ = ["synthetic_batch", "tiny_causal_lm"]
