"""Engine adapters: HF causal LMs on packed rows (FSDP, Ulysses), Megatron-core THD, the leak probe.

FSDP: :func:`prepare_model_inputs` turns a nested micro-batch into one packed row of keyword
arguments, :func:`prepare_model_outputs` turns the output back into nested log-probs and entropy
through the chunked head (:func:`chunked_head`, never the (T, V) logits), :func:`packed_logprobs`
does both around one forward; :func:`padded_logprobs` is the padded reference, and
:func:`prepare_value_outputs` gives a critic's values. Megatron: :func:`preprocess_thd` makes one
CP-sharded THD row plus ``PackedSeqParams``, :func:`postprocess_thd` takes the output back to nested
(companion tensors through the same :class:`ThdPlan`), :func:`thd_logprobs` is the output head on
that row. :func:`check_isolation` shows whether a packed forward keeps sequences apart and gives
each what it gets run alone. Importing this package imports :mod:`nopad.modeling`, never megatron-core.
"""

from nopad.engines._fsdp import (
    chunked_head,
    packed_logprobs,
    padded_logprobs,
    prepare_model_inputs,
    prepare_model_outputs,
    prepare_value_outputs,
)
from nopad.engines._leak import check_isolation
from nopad.engines._megatron import ParallelDims, from_parallel_state, postprocess_thd, preprocess_thd, thd_logprobs
from nopad.parallel._thd import ThdPlan

__all__ = [
    "ParallelDims",
    "ThdPlan",
    "check_isolation",
    "chunked_head",
    "from_parallel_state",
    "packed_logprobs",
    "padded_logprobs",
    "postprocess_thd",
    "preprocess_thd",
    "prepare_model_inputs",
    "prepare_model_outputs",
    "prepare_value_outputs",
    "thd_logprobs",
]
