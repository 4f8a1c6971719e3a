"""Megatron-core: nested batches <-> one CP-sharded THD row plus ``PackedSeqParams``.

Forward::

    tokens, params, position_ids = preprocess_thd(input_ids, cp_size=2, cp_rank=r)   # (1, T/2) each
    output = model(tokens, position_ids, packed_seq_params=params)                   # (1, T/2, *)
    nested = postprocess_thd(output, params, input_ids, cp_size=2, cp_rank=r)        # (B, j, *)

Companion per-token tensors (labels, loss masks, MoE routed_experts) go through the same
:class:`ThdPlan`; :func:`from_parallel_state` reads the sizes and rank from megatron-core.
:func:`thd_logprobs` is the model's output head on that row: nested log-probs and entropy from the
decoder's hidden states and the (vocabulary-parallel) output layer's weight, never the logits.
"""

from nopad.engines._megatron import ParallelDims, from_parallel_state, postprocess_thd, preprocess_thd, thd_logprobs
from nopad.parallel._thd import ThdPlan

__all__ = ["ParallelDims", "ThdPlan", "from_parallel_state", "postprocess_thd", "preprocess_thd", "thd_logprobs"]
