"""The routing reads transformers' sequence primitives however a release wraps them.

transformers decorates each primitive with ``use_kernel_func_from_hub_with_fallback(name, package)``:
a closure over ``func_name`` without the ``kernels`` package, a kernels function module with it (a
hard dependency since transformers 5.25), and a helper between the layer and the primitive
(``causal_conv1d_forward``) since then. These tests build small layers of their own with this
release's decorators, so they hold on every release of CI's matrix, with and without ``kernels``:
the primitive is found and served, through a helper too, and a primitive nopad does not know is
refused by name with the transformers version, before any forward. transformers 5.10 (verl 0.9.1's
pin) wraps none of them: its state layers keep the primitives as instance attributes (the gated delta
nets) or call them only from a CUDA forward (the Mamba, Mamba2 and LFM2 mixers); layers of both shapes,
built here, are served and exact on every release, their calls that are not packed unchanged. They read
the routing's private survey because the verdict on one layer class is what they test.
"""

from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402

from nopad.modeling import PackedRow, causal_conv1d  # noqa: E402

# private: the routing's wrappers of transformers' primitives are what is tested
from nopad.modeling._routing import callee, route, survey  # noqa: E402

try:  # transformers 5.20 on
    from transformers.integrations import use_kernel_func_from_hub_with_fallback
except ImportError:  # transformers 5.10: its layers reach the primitives another way (tested below)
    use_kernel_func_from_hub_with_fallback = None

wraps_primitives = pytest.mark.skipif(
    use_kernel_func_from_hub_with_fallback is None,
    reason=f"transformers {transformers.__version__} does not wrap its primitives (before 5.20)",
)


def _decorator(name: str, package: str):
    if use_kernel_func_from_hub_with_fallback is None:
        return lambda fn: fn
    return use_kernel_func_from_hub_with_fallback(name, package)


@_decorator("causal_conv1d_fn", "causal_conv1d")
def conv_primitive(hidden_states, weight, bias=None, activation=None, **kwargs):
    L = hidden_states.shape[-1]
    return F.conv1d(hidden_states, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=weight.shape[0])[
        ..., :L
    ]


@_decorator("chunk_mystery_scan", "fla")
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


@wraps_primitives
def test_this_release_s_primitives_are_recognised_by_their_kernel_names():
    primitives = {
        conv_primitive: "causal_conv1d_fn",
        modeling_qwen3_5.causal_conv1d_fn: "causal_conv1d_fn",
        modeling_qwen3_5.torch_chunk_gated_delta_rule: "chunk_gated_delta_rule",
    }
    for obj, name in primitives.items():
        assert (callee(obj).kind, callee(obj).name) == ("primitive", name)
    assert callee(F.conv1d) is None and callee(conv_helper).kind == "helper"
    # the torch function behind the wrapper, whichever wrapper this release has
    assert callee(conv_primitive).function.__name__ == "conv_primitive"
    assert not hasattr(callee(conv_primitive).function, "__wrapped__")


@wraps_primitives
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


@wraps_primitives
def test_a_primitive_nopad_does_not_know_is_refused_by_name_with_the_transformers_version():
    found = survey(MysteryMixer())
    assert len(found.refused) == 1
    name, cls, why = found.refused[0]
    assert cls == "MysteryMixer"
    assert "chunk_mystery_scan" in why and f"transformers {transformers.__version__}" in why
    with pytest.raises(ValueError, match="chunk_mystery_scan"):
        route(MysteryMixer())


# ---- transformers 5.10's shapes ---------------------------------------------------------------------


class AttributeConv(torch.nn.Module):
    """5.10's gated delta net, its conv: the primitive an attribute, None without causal-conv1d."""

    def __init__(self, channels=6, taps=4):
        super().__init__()
        self.conv1d = torch.nn.Conv1d(channels, channels, taps, groups=channels, padding=taps - 1, bias=False)
        self.causal_conv1d_fn = None

    def forward(self, x, **kwargs):  # (B, L, C)
        h = x.transpose(1, 2)
        if self.causal_conv1d_fn is not None:
            weight = self.conv1d.weight.squeeze(1)
            h = self.causal_conv1d_fn(x=h, weight=weight, bias=self.conv1d.bias, activation="silu", seq_idx=None)
        else:
            h = F.silu(self.conv1d(h)[:, :, : h.shape[-1]])
        return h.transpose(1, 2)


class AttributeConvAndAnother(torch.nn.Module):
    def __init__(self, channels=6, taps=4):
        super().__init__()
        self.conv1d = torch.nn.Conv1d(channels, channels, taps, groups=channels, padding=taps - 1, bias=False)
        self.shift = torch.nn.Conv1d(channels, channels, 3, groups=channels, padding=2)
        self.causal_conv1d_fn = None

    def forward(self, x, **kwargs):
        h = self.shift(x.transpose(1, 2))[..., : x.shape[1]]
        if self.causal_conv1d_fn is not None:
            return self.causal_conv1d_fn(x=h, weight=self.conv1d.weight.squeeze(1), activation="silu").transpose(1, 2)
        return F.silu(self.conv1d(h)[:, :, : h.shape[-1]]).transpose(1, 2)


causal_conv1d_fn = None  # as 5.10's mixers' modules hold it without causal-conv1d


def fused_training_kernel(*args, **kwargs):
    raise AssertionError("a packed forward takes the unfused path")


class FastPathMixer(torch.nn.Module):
    """5.10's Mamba2 mixer, its conv: the primitive a global, called only from its CUDA forward."""

    def __init__(self, channels=6, taps=4):
        super().__init__()
        self.conv1d = torch.nn.Conv1d(channels, channels, taps, groups=channels, padding=taps - 1)

    def cuda_kernels_forward(self, hidden_states, cache_params=None, attention_mask=None):
        if self.training and cache_params is None:
            return fused_training_kernel(hidden_states)
        weight = self.conv1d.weight.squeeze(1)
        h = causal_conv1d_fn(x=hidden_states.transpose(1, 2), weight=weight, bias=self.conv1d.bias, activation="silu")
        return h.transpose(1, 2)

    def torch_forward(self, hidden_states, cache_params=None, attention_mask=None):
        h = hidden_states.transpose(1, 2)
        return F.silu(self.conv1d(h)[..., : h.shape[-1]]).transpose(1, 2)

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        if causal_conv1d_fn is not None and "cuda" in self.conv1d.weight.device.type:
            return self.cuda_kernels_forward(hidden_states, cache_params, attention_mask)
        return self.torch_forward(hidden_states, cache_params, attention_mask)


LENGTHS = [5, 1, 3, 7]


@pytest.mark.parametrize("layer", [AttributeConv, FastPathMixer])
def test_a_layer_of_5_10_s_shape_is_served_exact_with_gradients_and_unchanged_unpacked(layer):
    torch.manual_seed(0)
    mixer, plain = layer(), layer()
    plain.load_state_dict(mixer.state_dict())
    mixer.train(), plain.train()  # the CUDA forward's fused training kernel is never taken packed
    x = torch.randn(1, sum(LENGTHS), 6)
    rows = torch.randn(2, 9, 6)
    unrouted = mixer(rows)
    found = survey(mixer)
    assert found.rebound == [("", layer.__name__)] and not found.refused
    routed = route(mixer)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packed_x, alone_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    packed = mixer(packed_x, cu_seq_lens_q=cu)
    alone = torch.cat([plain(part) for part in alone_x.split(LENGTHS, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-6, rtol=0)
    weights = torch.randn_like(packed)
    (packed * weights).sum().backward()
    (alone * weights).sum().backward()
    torch.testing.assert_close(packed_x.grad, alone_x.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(mixer.conv1d.weight.grad, plain.conv1d.weight.grad, atol=1e-5, rtol=0)
    assert torch.equal(mixer(rows), unrouted)  # a call that is not packed: the layer's own, bit for bit
    routed.remove()
    assert "forward" not in vars(mixer) and getattr(mixer, "causal_conv1d_fn", None) is None


def test_a_conv_of_5_10_s_shape_nopad_does_not_serve_is_refused_by_name_with_the_transformers_version():
    found = survey(AttributeConvAndAnother())
    assert [(cls, why.split(",")[0]) for _, cls, why in found.refused] == [
        ("AttributeConvAndAnother", "convolves along the sequence through shift")
    ]
    assert f"transformers {transformers.__version__}" in found.refused[0][2]
    with pytest.raises(ValueError, match="AttributeConvAndAnother"):
        route(AttributeConvAndAnother())


# ---- what a routed layer holds -----------------------------------------------------------------------


@wraps_primitives
def test_a_routed_layer_reads_a_named_adapter_with_the_primitive_s_signature():
    mixer = ConvMixer()
    route(mixer)
    helper = mixer.forward.__func__.__globals__["conv_helper"]  # the helper rebound for this layer
    adapter = helper.__globals__["conv_primitive"]
    assert repr(adapter) == "PackedConv(owner='ConvMixer')"
    assert str(inspect.signature(adapter)) == "(hidden_states, weight, bias=None, activation=None, **kwargs)"


def test_a_routed_layer_of_5_10_s_shape_holds_named_objects_that_read_as_functions():
    layer = AttributeConv()
    route(layer)
    assert repr(layer.causal_conv1d_fn) == "PackedConvX(owner='AttributeConv')"
    assert repr(layer.forward) == "CarrierForward(owner='AttributeConv')"
    assert str(inspect.signature(layer.causal_conv1d_fn)) == "(x, weight, bias=None, activation=None, **kwargs)"
    # a wrapper made with functools.wraps (as accelerate's hooks wrap a forward) reads and calls it
    wrapped = functools.wraps(layer.forward)(lambda *args, **kwargs: layer.__dict__["forward"](*args, **kwargs))
    assert inspect.signature(wrapped) == inspect.signature(layer.forward)
    assert list(inspect.signature(wrapped).parameters) == ["args", "kwargs"]
    x, cu = torch.randn(1, 9, 6), torch.tensor([0, 4, 9], dtype=torch.int32)
    assert torch.equal(wrapped(x, cu_seq_lens_q=cu), layer(x, cu_seq_lens_q=cu))
    mixer = FastPathMixer()
    route(mixer)
    assert repr(mixer.forward) == "MixerForward(owner='FastPathMixer')"


@pytest.mark.parametrize("layer", [AttributeConv, FastPathMixer])
def test_a_deep_copy_of_a_routed_layer_of_5_10_s_shape_runs_its_own_weights(layer):
    torch.manual_seed(0)
    mixer = layer()
    route(mixer)
    twin = copy.deepcopy(mixer)
    with torch.no_grad():
        twin.conv1d.weight.mul_(2)
    x, cu = torch.randn(1, 9, 6), torch.tensor([0, 4, 9], dtype=torch.int32)
    plain = layer()
    plain.load_state_dict(twin.state_dict())
    alone = torch.cat([plain(part) for part in x.split([4, 5], dim=1)], dim=1)
    torch.testing.assert_close(twin(x, cu_seq_lens_q=cu), alone, atol=1e-6, rtol=0)
