"""Next-token log-probs and entropy: from (T, V) logits, or straight from the hidden states and the
output layer's weight without ever holding the logits (the chunked head, with Cut Cross-Entropy's
fused kernel where it is installed and serves the call)."""

from nopad._logprobs import head_log_probs, token_log_probs

__all__ = ["head_log_probs", "token_log_probs"]
