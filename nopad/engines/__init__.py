"""Engine adapters: Megatron-core THD (``nopad.engines._megatron``) and HF/FSDP (``nopad.engines._fsdp``).

Submodules are imported on demand so ``import nopad`` never pulls in megatron-core or transformers.
"""
