"""Engine adapters: Megatron-core THD (``nopad.engines.megatron``) and HF/FSDP (``nopad.engines.fsdp``).

Submodules are imported on demand so ``import nopad`` never pulls in megatron-core or transformers.
"""
