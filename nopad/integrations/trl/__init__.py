"""One line to run TRL's GRPO and RLOO log-probs packed, and padding-free SFT exactly on hybrids:
``nopad.integrations.trl.install()``.

TRL 1.16's ``GRPOTrainer`` and ``RLOOTrainer`` score completions with
``_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size,
compute_entropy, compute_aux_loss, <vision inputs>)``: the padded ``(B, P + C)`` batch (prompts
left-padded, completions right-padded), run in row chunks of ``batch_size`` through the model's
forward with TRL's fused LM head (log-probs and entropy of the labels that are not ``-100``, the
logits divided by the trainer's ``temperature``), the last ``C = logits_to_keep`` columns handed back
as ``(B, C)`` log-probs and entropies (0 at padding), and ``None`` for the MoE aux loss unless asked.

``install()`` replaces that method on both classes (where the class defines it) with one that
converts each chunk once with :func:`nopad.left_right_2_no_padding`, runs the model on one packed
row through :func:`nopad.engines.packed_logprobs` (every layer keeps the sequences apart, or a
``ValueError`` naming the one that cannot, before any forward; the chunked head on completion
tokens only, ``tokens="response"``, never the ``(T, V)`` logits; the same ``temperature``) and hands
TRL its padded ``(B, C)`` results back (:func:`nopad.no_padding_2_padding`). Same signature, same
results, same ``accelerator.autocast()``.

Every argument TRL passes is honoured or refused by name with a ``ValueError``, never ignored:
the vision inputs (``pixel_values``, ``image_grid_thw``, ``num_images``, ``pixel_attention_mask``,
``spatial_shapes``, ``num_tiles``, ``image_sizes``, ``image_position_ids``), ``token_type_ids``,
``mm_token_type_ids`` are refused; ``compute_aux_loss=True`` (the MoE load-balancing loss) is
computed as TRL's fused head computes it (transformers' ``load_balancing_loss_func`` over the
backbone's router logits, per row chunk, their mean), over the packed row's tokens without a mask,
and refused on a model that is not a Mixture-of-Experts one;
``cast_lm_head_to_fp32`` is served where the head computes in float32 anyway (float32 head weights,
no mixed precision) and refused elsewhere; with activation checkpointing (``gradient_checkpointing``,
on by default in ``GRPOConfig``) the packed attention stays switched on from the forward until
backward has recomputed every layer (refused where the input embeddings take no gradient, which
marks that point); a model wrapped by accelerate (DDP, FSDP, DeepSpeed) or sharded by FSDP2's
``fully_shard`` is refused: served is the single-process path, where accelerate hands the model
over unwrapped. A PEFT model (``peft_config=`` to the trainer) is served where its adapter wraps
the layers in place (LoRA, DoRA, IA3, ...; TRL's reference, the adapter disabled, likewise);
prompt learning (prompt or prefix tuning: virtual tokens before each row) and an adapter on the
output layer are refused.
``batch_size`` becomes a token budget: the rows, in order, cut into at most as many packed forwards
as TRL's row chunks, the largest holding as few real tokens as such a cut allows (never more than
TRL's largest chunk; the same per-token results), or TRL's own row chunks where the MoE aux loss
(a mean over chunks) is asked.

``install(share_prefixes=True)`` (off by default) computes each group's shared prompt once in those
log-prob calls: rows of a chunk whose prompt tokens are equal (TRL's ``num_generations`` samples of a
prompt) are found from the tokens, whatever their order (TRL shuffles the rows of its loss's call,
so ``num_generations`` consecutive rows are no grouping there), and each distinct prompt runs once,
followed by its rows' completions (:func:`nopad.engines.packed_logprobs` with ``share_prefixes=True``;
the results and gradients equal the flag off). Everything above holds as without it, but a call
that asks the MoE aux loss runs unshared (TRL's loss counts every row's prompt tokens), and a model
whose state layer has no shared-prefix form (Mamba's selective scan) is refused naming it.

The same ``install()`` serves TRL's padding-free SFT on hybrids: ``SFTTrainer`` with ``padding_free``
(``SFTConfig(padding_free=True)``, or ``packing=True`` with a ``bfd`` strategy) hands the model one
row of end-to-end sequences (restarting ``position_ids``, their boundaries as ``cu_seq_lens_q`` and
``seq_idx``, no attention mask), which transformers 5.25's CPU fallbacks of the state layers (a gated
delta net's conv and scan, Mamba2's scan) refuse (or, handed only the position ids, run across the
sequences).
``SFTTrainer.training_step`` and ``prediction_step`` run there within
:func:`nopad.modeling.packed_attention` (backward included: a checkpointed layer recomputes routed):
every layer keeps the sequences apart, or the one that cannot is a ``ValueError`` naming it; the
model is as it was after each step. ``seq_idx`` is checked against ``cu_seq_lens_q`` (refused where
they disagree) and left out of the model's inputs: nopad's layers read the boundaries. A trainer
that is not padding-free runs TRL's steps unchanged, and a model accelerate wrapped is refused.
TRL 1.16's ``DPOTrainer`` has no padding-free mode (it turns ``padding_free=True`` off and pads), so
there is nothing to route.

The handle undoes it (``uninstall()``, or use it as a context manager); ``install()`` is idempotent::

    from nopad.integrations import trl as nopad_trl
    nopad_trl.install()                        # the one line
    with nopad_trl.install(): ...              # or for a block
"""

from nopad.integrations.trl._install import TrlPatch, install, uninstall

__all__ = ["TrlPatch", "install", "uninstall"]
