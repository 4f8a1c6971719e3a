"""The routing reads transformers' sequence primitives however a release wraps them.

transformers decorates each primitive with ``use_kernel_func_from_hub_with_fallback(name, package)``:
a closure over ``func_name`` without the ``kernels`` package, a kernels function module with it (a
hard dependency since transformers 5.25), and a helper between the layer and the primitive
(``causal_conv1d_forward``) since then. These tests build small layers of their own with this
release's decorators, so they hold on every release of CI's matrix, with and without ``kernels``:
the primitive is found and served, through a helper too, and a primitive nopad does not know is
refused by name with the transformers version, before any forward. They read the routing's private
survey because the verdict on one layer class is what they test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers.integrations import use_kernel_func_from_hub_with_fallback  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402

from nopad.modeling import PackedRow, causal_conv1d  # noqa: E402

# private: the routing's wrappers of transformers' primitives are what is tested
from nopad.modeling._routing import callee, primitive_name, route, survey, torch_fallback  # noqa: E402


@use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")
def conv_primitive(hidden_states, weight, bias=None, activation=None, **kwargs):
    L = hidden_states.shape[-1]
    return F.conv1d(hidden_states, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=weight.shape[0])[
        ..., :L
    ]


@use_kernel_func_from_hub_with_fallback("chunk_mystery_scan", "fla")
def mystery_scan(x, **kwargs):
    return x.cumsum(1)


def conv_helper(conv, x, **kwargs):
    """A helper between the layer and the primitive, as transformers 5.25's ``causal_conv1d_forward``."""
    return conv_primitive(x, conv.weight.squeeze(1), conv.bias, **kwargs)


class ConvMixer(torch.nn.Module):
    def __init__(self, channels=6, taps=4):
        super().__init__()
        self.conv = torch.nn.Conv1d(channels, channels, taps, groups=channels, padding=taps - 1)

    def forward(self, x, **kwargs):  # (B, L, C)
        return conv_helper(self.conv, x.transpose(1, 2), **kwargs).transpose(1, 2)


class MysteryMixer(torch.nn.Module):
    def forward(self, x, **kwargs):
        return mystery_scan(x, **kwargs)


def test_this_release_s_primitives_are_recognised_by_their_kernel_names():
    assert primitive_name(conv_primitive) == "causal_conv1d_fn"
    assert primitive_name(modeling_qwen3_5.causal_conv1d_fn) == "causal_conv1d_fn"
    assert primitive_name(modeling_qwen3_5.torch_chunk_gated_delta_rule) == "chunk_gated_delta_rule"
    assert primitive_name(F.conv1d) is None and primitive_name(conv_helper) is None
    assert callee(conv_helper).kind == "helper"
    # the torch function behind the wrapper, whichever wrapper this release has
    assert torch_fallback(conv_primitive).__name__ == "conv_primitive"
    assert not hasattr(torch_fallback(conv_primitive), "__wrapped__")


def test_a_primitive_reached_through_a_helper_is_served_and_exact():
    mixer = ConvMixer()
    found = survey(mixer)
    assert found.rebound == [("", "ConvMixer")] and not found.refused
    route(mixer)
    lengths = [5, 1, 3]
    x = torch.randn(1, sum(lengths), 6)
    cu = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    packed = mixer(x, cu_seq_lens_q=cu)
    weight = mixer.conv.weight.squeeze(1)
    expected = causal_conv1d(x[0].T, weight, mixer.conv.bias, PackedRow.from_lengths(lengths)).T
    torch.testing.assert_close(packed[0], expected, atol=1e-6, rtol=0)
    # a padded call (no boundaries) runs transformers' own primitive, each row whole
    torch.testing.assert_close(mixer(x), conv_primitive(x.transpose(1, 2), weight, mixer.conv.bias).transpose(1, 2))


def test_a_primitive_nopad_does_not_know_is_refused_by_name_with_the_transformers_version():
    found = survey(MysteryMixer())
    assert len(found.refused) == 1
    name, cls, why = found.refused[0]
    assert cls == "MysteryMixer"
    assert "chunk_mystery_scan" in why and f"transformers {transformers.__version__}" in why
    with pytest.raises(ValueError, match="chunk_mystery_scan"):
        route(MysteryMixer())
