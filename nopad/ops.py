"""flash-attn's ``bert_padding`` primitives without flash-attn: ``unpad_input`` / ``pad_input`` (an
exact inverse pair) and the autograd gathers ``index_first_axis`` / ``index_put_first_axis``."""

from nopad._ops import index_first_axis, index_put_first_axis, pad_input, unpad_input

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]
