"""Synthetic RL batches and tiny random-weight causal LMs, for the demo, benchmarks and examples.

Nothing here downloads anything: models are built from a config with random weights.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from nopad.core._errors import check_int, input_error


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
    samples_per_prompt: int = 1,
) -> TensorDict:
    """A padded RL batch: prompts left-padded to ``prompt_width``, responses right-padded to ``resp_width``.

    Keys: input_ids (B, S), attention_mask (B, S), response_mask (B, R), position_ids (B, S) or
    (B, mrope, S), with S = prompt_width + resp_width and long-tailed lengths.
    ``samples_per_prompt`` n: rows come in groups of n consecutive rows with the same prompt (GRPO's
    n samples of a prompt; B must be a multiple of n), each with its own response.
    """
    B, seed, mrope = check_int(B, "B", low=0), check_int(seed, "seed", low=0), check_int(mrope, "mrope", low=0)
    n = check_int(samples_per_prompt, "samples_per_prompt", low=1)
    if B % n:
        raise input_error("samples_per_prompt", None, f"a divisor of B = {B} (groups of n rows)", f"{n}")
    prompt_width = check_int(prompt_width, "prompt_width", low=1)
    resp_width = check_int(resp_width, "resp_width", low=1)
    vocab = check_int(vocab, "vocab", low=2)  # ids are drawn from [1, vocab): 0 is the padding
    g = torch.Generator().manual_seed(seed)
    prompt_lens = _long_tailed_lengths(B, prompt_width, generator=g)
    resp_lens = _long_tailed_lengths(B, resp_width, generator=g)
    cols_p, cols_r = torch.arange(prompt_width), torch.arange(resp_width)
    response_mask = (cols_r < resp_lens[:, None]).long()
    attention_mask = torch.cat([(cols_p >= prompt_width - prompt_lens[:, None]).long(), response_mask], 1)
    S = prompt_width + resp_width
    input_ids = torch.randint(1, vocab, (B, S), generator=g) * attention_mask
    if n > 1:  # each group's rows take its first row's prompt (the responses stay their own)
        first = torch.arange(B) // n * n
        attention_mask[:, :prompt_width] = attention_mask[first, :prompt_width]
        input_ids[:, :prompt_width] = input_ids[first, :prompt_width]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if mrope:
        position_ids = position_ids.unsqueeze(1).expand(B, mrope, S).contiguous()
    fields = dict(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, position_ids=position_ids
    )
    return TensorDict(fields, batch_size=[B]).to(device)


def _hybrid(layers: int, kinds: tuple[str, str] = ("linear_attention", "full_attention")) -> list[str]:
    """Layer kinds of a hybrid: every 4th layer attends, and the last one does when there are fewer
    than 4, so a tiny model holds both kinds."""
    state, attention = kinds
    return [attention if i % 4 == 3 or (layers < 4 and i == layers - 1) else state for i in range(layers)]


def _family_config(arch: str, hidden: int, layers: int, heads: int, kv_heads: int) -> dict:
    """The config fields of each family at a tiny size (the ones its defaults would make huge)."""
    head = hidden // heads
    gdn = dict(
        linear_num_value_heads=heads,
        linear_num_key_heads=kv_heads,
        linear_key_head_dim=head,
        linear_value_head_dim=head,
        linear_conv_kernel_dim=4,
        layer_types=_hybrid(layers),
        head_dim=head,
    )
    # Mamba2 mixers: expand 2 (inner width 2 * hidden over `heads` heads), 2 groups, 16 states, and
    # 32-token chunks, so that short test sequences still cross chunks
    mamba = dict(mamba_n_heads=heads, mamba_d_head=2 * hidden // heads, mamba_n_groups=2, mamba_d_state=16)
    mamba.update(mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=32)
    moe = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden
    )
    if arch == "qwen3_5":
        return gdn
    if arch == "qwen3_next":
        return {**gdn, **moe, "decoder_sparse_step": 1}
    if arch == "olmo_hybrid":
        return {**gdn, "pad_token_id": 0, "eos_token_id": 1}  # its defaults index a 100k vocabulary
    if arch == "bamba":
        return {**mamba, "attn_layer_indices": [i for i, k in enumerate(_hybrid(layers)) if k == "full_attention"]}
    if arch == "granitemoehybrid":
        return {
            **mamba,
            "layer_types": _hybrid(layers),
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": hidden,
        }
    if arch == "nemotron_h":
        # the layer kinds as a pattern (Mamba2, MoE, attention, MLP): each release maps it to its own
        # names ("mamba"/"attention" on 5.10, "linear_attention"/"full_attention" on 5.20 on)
        return dict(
            hybrid_override_pattern="".join("ME*-"[i % 4] for i in range(max(layers, 4))),
            mamba_num_heads=heads,
            mamba_head_dim=2 * hidden // heads,
            n_groups=2,
            ssm_state_size=16,
            conv_kernel=4,
            chunk_size=32,
            head_dim=head,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden,
            moe_shared_expert_intermediate_size=hidden,
        )
    if arch == "falcon_h1":  # attention and a Mamba2 mixer side by side in every layer
        return {**mamba, "mamba_d_ssm": 2 * hidden, "head_dim": head}
    if arch == "lfm2":
        return dict(layer_types=_hybrid(layers, ("conv", "full_attention")), block_multiple_of=16, conv_L_cache=3)
    return {}


# arch -> (config class, model class) in transformers; the families past llama and qwen2 carry
# state along the sequence (gated delta nets, Mamba2 scans, short convs)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM"),
    "bamba": ("BambaConfig", "BambaForCausalLM"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM"),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"),
}


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
    """A random-weight HF causal LM of family ``arch`` (one of :data:`ARCHS`), fp32, eval mode. Needs the hf extra.

    ``heads`` query heads and ``kv_heads`` key/value heads (grouped-query attention when fewer;
    the gated delta nets' value and key heads likewise); MLP width 2 * hidden; positions up to 32k.
    Hybrids attend in every 4th layer (and in the last of fewer than 4); their Mamba2 mixers scan
    32-token chunks. Nemotron-H takes at least 4 layers (Mamba2, MoE, attention, MLP).
    """
    import transformers

    if not isinstance(arch, str) or arch not in ARCHS:
        raise input_error("arch", None, f"one of {sorted(ARCHS)}", f"{arch!r}")
    vocab, hidden = check_int(vocab, "vocab", low=1), check_int(hidden, "hidden", low=1)
    layers, seed = check_int(layers, "layers", low=1), check_int(seed, "seed", low=0)
    heads, kv_heads = check_int(heads, "heads", low=1), check_int(kv_heads, "kv_heads", low=1)
    if hidden % heads:
        raise input_error("hidden", None, f"a multiple of heads={heads}", f"{hidden}")
    if heads % kv_heads:
        raise input_error("kv_heads", None, f"a divisor of heads={heads}", f"{kv_heads}")
    config_cls, model_cls = (getattr(transformers, name) for name in ARCHS[arch])
    config = config_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        **_family_config(arch, hidden, layers, heads, kv_heads),
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    model.config._attn_implementation = attn_implementation
    return model.float().eval()


__all__ = ["ARCHS", "synthetic_batch", "tiny_causal_lm"]
