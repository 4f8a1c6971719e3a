"""HF causal LMs on packed rows, for FSDP-style engines (FSDP2, Ulysses sequence parallelism).

One packed row per micro-batch: :func:`prepare_model_inputs` turns a nested micro-batch into the
model's keyword arguments (no attention mask, ``use_cache=False``, boundaries for varlen kernels),
:func:`prepare_model_outputs` turns the model's output back into nested log-probs and entropy, and
:func:`packed_logprobs` does both around one forward. The output head runs chunked
(:func:`chunked_head`, over :func:`nopad.logprobs.head_log_probs`): log-probs and entropy straight
from the hidden states, never the (T, V) logits. :func:`padded_logprobs` is the padded reference.
A critic's per-token output becomes the nested values of the value loss by
:func:`prepare_value_outputs`.
"""

from nopad.engines._fsdp import (
    chunked_head,
    packed_logprobs,
    padded_logprobs,
    prepare_model_inputs,
    prepare_model_outputs,
    prepare_value_outputs,
)

__all__ = [
    "chunked_head",
    "packed_logprobs",
    "padded_logprobs",
    "prepare_model_inputs",
    "prepare_model_outputs",
    "prepare_value_outputs",
]
