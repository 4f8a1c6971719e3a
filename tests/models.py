"""Tiny random-weight HF causal LMs and padded batches, shared by the engine and loss tests.

Everything is built from a config (no download), fp32, CPU, deterministic for a given seed.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from tensordict import TensorDict

VOCAB = 97


def _tiny_kwargs(vocab: int) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def _finish(model: torch.nn.Module, attn_implementation: str) -> torch.nn.Module:
    model.config._attn_implementation = attn_implementation
    return model.float().eval()


def tiny_llama(seed: int = 0, vocab: int = VOCAB, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A 2-layer LlamaForCausalLM (hidden 32, 4 heads, 2 kv heads) with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return _finish(LlamaForCausalLM(LlamaConfig(**_tiny_kwargs(vocab))), attn_implementation)


def tiny_qwen2(seed: int = 0, vocab: int = VOCAB, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A 2-layer Qwen2ForCausalLM (q/k/v biases, GQA) with random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return _finish(Qwen2ForCausalLM(Qwen2Config(**_tiny_kwargs(vocab))), attn_implementation)


class MropeCausalLM(torch.nn.Module):
    """Qwen2-VL's text decoder (multimodal rope, 4-row position ids) plus an lm_head.

    The vision tower is left out: a text-only batch never reaches it, and this keeps the model tiny.
    ``forward`` takes the same kwargs as a HF causal LM and returns an object with ``.logits``.
    """

    def __init__(self, text_model: torch.nn.Module, vocab: int):
        super().__init__()
        self.model = text_model
        self.config = text_model.config
        self.lm_head = torch.nn.Linear(self.config.hidden_size, vocab, bias=False)

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, use_cache=None, **kwargs):
        out = self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=use_cache, **kwargs
        )
        return SimpleNamespace(logits=self.lm_head(out.last_hidden_state))


def tiny_qwen2_vl_text(seed: int = 0, vocab: int = VOCAB, attn_implementation: str = "sdpa") -> MropeCausalLM:
    """Qwen2-VL text model with mrope sections summing to head_dim / 2 = 4, plus an lm_head."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4}
    config = Qwen2VLTextConfig(**_tiny_kwargs(vocab), bos_token_id=None, eos_token_id=None, rope_parameters=rope)
    config._attn_implementation = attn_implementation
    return _finish(MropeCausalLM(Qwen2VLTextModel(config), vocab), attn_implementation)


def make_padded_batch(
    B: int,
    prompt_len: int,
    resp_len: int,
    vocab: int = VOCAB,
    seed: int = 0,
    *,
    prompt_lens: list[int] | None = None,
    resp_lens: list[int] | None = None,
    mrope: bool = False,
) -> TensorDict:
    """A verl-style padded batch: prompts left-padded to ``prompt_len``, responses right-padded to ``resp_len``.

    Keys: prompts (B, P), responses (B, R), input_ids (B, P+R), attention_mask (B, P+R) int64,
    response_mask (B, R) int64, position_ids (B, P+R) (or (B, 4, P+R) with ``mrope``: row 0 the text
    position, rows 1-3 the same for a text-only batch). Prompt lengths are drawn from [1, P], response
    lengths from [1, R] unless given. Padding slots hold token 0 and position 0.
    """
    gen = torch.Generator().manual_seed(seed)

    def draw(lengths, high):
        return torch.tensor(lengths) if lengths is not None else torch.randint(1, high + 1, (B,), generator=gen)

    p_lens, r_lens = draw(prompt_lens, prompt_len), draw(resp_lens, resp_len)
    if (
        p_lens.shape != (B,)
        or r_lens.shape != (B,)
        or (p_lens < 1).any()
        or (p_lens > prompt_len).any()
        or (r_lens < 0).any()
        or (r_lens > resp_len).any()
    ):
        raise ValueError(
            f"prompt_lens/resp_lens: expected {B} lengths in [1, {prompt_len}] / [0, {resp_len}], "
            f"got {p_lens.tolist()} / {r_lens.tolist()}"
        )
    cols_p, cols_r = torch.arange(prompt_len), torch.arange(resp_len)
    prompt_mask = (cols_p >= prompt_len - p_lens.unsqueeze(1)).long()
    response_mask = (cols_r < r_lens.unsqueeze(1)).long()
    prompts = torch.randint(1, vocab, (B, prompt_len), generator=gen) * prompt_mask
    responses = torch.randint(1, vocab, (B, resp_len), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask
    if mrope:
        position_ids = position_ids.unsqueeze(1).expand(B, 4, -1).contiguous()
    return TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "position_ids": position_ids,
        },
        batch_size=[B],
    )
