"""The packed forms of the state-carrying layers: each sequence of a packed row as if it ran alone.

References: transformers' own torch fallbacks run on each sequence alone (what a model computes
without packing), and a naive per-token recurrence written here from each layer's definition
(what the layer means). Forward and gradients, over a grid and hypothesis-drawn lengths that mix
sequences of length 1, shorter than the conv kernel, shorter than a chunk, exactly a chunk, and
longer than one; then op counts that do not grow with the number of sequences, and the wiring of
the optional CUDA kernels through CPU stand-ins with their exact signatures.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

# private: the torch forms, the kernel probe and the fallbacks behind the packed layers
import nopad.modeling._layers as layers
from nopad.diagnostics import OpCounter
from nopad.modeling import PackedRow, causal_conv1d, gated_delta_rule, ssd_scan
from nopad.modeling._routing import callee

transformers = pytest.importorskip("transformers")
from transformers.models.bamba import modeling_bamba  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402

TOL = 1e-5
# transformers 5.10 (verl 0.9.1's pin) has no torch function for the conv and the SSD scan: its layers
# run them inline (a torch Conv1d; the Mamba2 mixer's torch_forward). Its torch delta rule is a plain function.
WRAPS_PRIMITIVES = modeling_qwen3_5.causal_conv1d_fn is not None and hasattr(modeling_bamba, "mamba2_chunk_scan")


def _conv_as_5_10_layers_run_it(x, weight, bias=None, activation=None, **kwargs):
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., : x.shape[-1]]
    return F.silu(out) if activation == "silu" else out


def _ssd_recurrence(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False, dt_limit=(0, math.inf)):
    """(1, L, H, P) Mamba2's scan one token at a time (as 5.10's Mamba2 mixers' torch_forward, unchunked)."""
    H = x.shape[2]
    B, C = (y[0].repeat_interleave(H // y.shape[2], dim=1) for y in (B, C))  # (L, H, N)
    dt = dt[0] if dt_bias is None else dt[0] + dt_bias
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(*dt_limit)
    state, outs = x.new_zeros(H, x.shape[3], B.shape[2]), []
    for t in range(x.shape[1]):
        state = state * (dt[t] * A).exp()[:, None, None] + (dt[t][:, None] * x[0, t])[:, :, None] * B[t][:, None, :]
        y = torch.einsum("hpn,hn->hp", state, C[t])
        outs.append(y if D is None else y + D[:, None] * x[0, t])
    return torch.stack(outs)[None]


# transformers' reference implementations, one sequence at a time: the torch functions behind its
# primitives, however this release wraps them (the routing's reader of those wrappers, which is private)
HF_CONV = callee(modeling_qwen3_5.causal_conv1d_fn).function if WRAPS_PRIMITIVES else _conv_as_5_10_layers_run_it
HF_GDN = (
    callee(modeling_qwen3_5.torch_chunk_gated_delta_rule).function
    if WRAPS_PRIMITIVES
    else modeling_qwen3_5.torch_chunk_gated_delta_rule
)
HF_SSD = callee(modeling_bamba.mamba2_chunk_scan).function if WRAPS_PRIMITIVES else _ssd_recurrence

# sequences of length 1, < the conv kernel, < a chunk, exactly a chunk (64 and 16), > a chunk
MIXED = [70, 1, 3, 64, 9, 16, 130, 2]
lengths_st = st.lists(st.integers(1, 150), min_size=1, max_size=6)


def _bounds(lengths):
    cu = np.concatenate([[0], np.cumsum(lengths)])
    return list(zip(cu[:-1].tolist(), cu[1:].tolist()))


def _rand(*shape, low=-1.0, high=1.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype).requires_grad_()


def _grads(out, inputs):
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return torch.autograd.grad((out * weights).sum(), inputs)


def _assert_close(a, b, what, tol=TOL):
    """Within ``tol`` of ``b``'s scale (at least 1): fp32 sums of hundreds of terms round differently."""
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if not a.numel():
        return
    diff, scale = (a.double() - b.double()).abs().max().item(), max(1.0, b.abs().max().item())
    assert diff <= tol * scale, f"{what}: max abs diff {diff:.3g} > {tol} x {scale:.3g}"


# ---- the packed row and its chunk layout ---------------------------------------------------------


@given(lengths=lengths_st, chunk=st.sampled_from([1, 4, 16, 64]))
def test_the_chunk_layout_puts_each_sequence_on_whole_chunks_of_its_own_longest_first(lengths, chunk):
    row = PackedRow.from_lengths(lengths)
    layout = row.layout(chunk)
    chunks = [math.ceil(n / chunk) for n in lengths]
    assert layout.num_chunks == sum(chunks)
    counts = [count for _, count in layout.steps]
    assert counts == [sum(c > step for c in chunks) for step in range(max(chunks))]  # a prefix per step
    assert [first for first, _ in layout.steps] == np.cumsum([0, *counts[:-1]]).tolist()
    slots = layout.slots.tolist()
    assert len(set(slots)) == row.total  # every token a slot of its own
    order = sorted(range(len(lengths)), key=lambda i: -chunks[i])  # stable: ties keep their order
    for rank, i in enumerate(order):
        start = sum(lengths[:i])
        for t in range(lengths[i]):
            step, within = divmod(t, chunk)
            assert slots[start + t] == (layout.steps[step][0] + rank) * chunk + within
    x = torch.arange(row.total, dtype=torch.float32)
    assert torch.equal(layout.from_chunks(layout.to_chunks(x)), x)  # an exact inverse pair
    assert float(layout.to_chunks(x).sum()) == float(x.sum())  # zeros elsewhere


def test_a_row_knows_its_boundaries_positions_and_sequence_ids():
    row = PackedRow.from_lengths([3, 1, 2])
    assert row.cu_seqlens.tolist() == [0, 3, 4, 6] and row.total == 6
    assert row.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert row.seq_idx.tolist() == [[0, 0, 0, 1, 2, 2]] and row.seq_idx.dtype == torch.int32
    again = PackedRow.from_cu_seqlens(row.cu_seqlens)  # one read of the boundaries
    assert again.lengths.tolist() == [3, 1, 2]
    assert row.layout(4) is row.layout(4)  # cached: every layer of a forward shares it


# ---- causal depthwise conv ---------------------------------------------------------------------


def _naive_conv(x, weight, bias, lengths, activation):
    """out[:, t] = bias + sum_j w[:, K-1-j] x[:, t-j] over the taps inside t's sequence."""
    C, T = x.shape
    K = weight.shape[1]
    cols = []
    for start, end in _bounds(lengths):
        for t in range(start, end):
            acc = bias.clone() if bias is not None else x.new_zeros(C)
            for j in range(K):
                if t - j >= start:
                    acc = acc + weight[:, K - 1 - j] * x[:, t - j]
            cols.append(acc)
    out = torch.stack(cols, 1)
    return F.silu(out) if activation == "silu" else out


@pytest.mark.parametrize("kernel_size", [2, 3, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_equals_each_sequence_alone_forward_and_backward(kernel_size, activation, bias):
    lengths = MIXED
    T, C = sum(lengths), 6
    x, w = _rand(C, T, seed=1), _rand(C, kernel_size, seed=2)
    b = _rand(C, seed=3) if bias else None
    inputs = [x, w] + ([b] if bias else [])
    out = causal_conv1d(x, w, b, PackedRow.from_lengths(lengths), activation=activation)
    alone = torch.cat([HF_CONV(x[None, :, s:e], w, b, activation=activation)[0] for s, e in _bounds(lengths)], 1)
    _assert_close(out, alone, "conv vs transformers per sequence")
    _assert_close(out, _naive_conv(x, w, b, lengths, activation), "conv vs the naive loop")
    for g_packed, g_alone, name in zip(_grads(out, inputs), _grads(alone, inputs), ("x", "weight", "bias")):
        _assert_close(g_packed, g_alone, f"grad of {name}")


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_st, kernel_size=st.integers(1, 5))
def test_conv_equals_transformers_per_sequence_for_any_lengths(lengths, kernel_size):
    T, C = sum(lengths), 3
    x, w, b = _rand(C, T, seed=4), _rand(C, kernel_size, seed=5), _rand(C, seed=6)
    out = causal_conv1d(x, w, b, PackedRow.from_lengths(lengths), activation="silu")
    alone = torch.cat([HF_CONV(x[None, :, s:e], w, b, activation="silu")[0] for s, e in _bounds(lengths)], 1)
    _assert_close(out, alone, "conv")


def test_conv_reads_the_inputs_before_the_row_from_its_history():
    # sequence parallelism hands a rank the K - 1 inputs before its first token: equal to the whole row
    lengths = [5, 7, 4]
    row = PackedRow.from_lengths(lengths)
    x, w = _rand(4, row.total, seed=7), _rand(4, 4, seed=8)
    whole = layers.torch_causal_conv1d(x, w, None, row.position_ids)
    cut = 7  # inside the second sequence
    tail = layers.torch_causal_conv1d(x[:, cut:], w, None, row.position_ids[cut:], history=x[:, cut - 3 : cut])
    _assert_close(tail, whole[:, cut:], "conv from a history")


# ---- the gated delta rule ----------------------------------------------------------------------


def _naive_gdn(q, k, v, g, beta, lengths, scale=None, l2norm=True):
    """Per token, per head, state S (D_k, D_v) from zero: S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q."""
    H = v.shape[1]
    if k.shape[1] != H:
        q, k = (x.repeat_interleave(H // k.shape[1], dim=1) for x in (q, k))
    if l2norm:
        q, k = layers.l2_normalize(q), layers.l2_normalize(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs = []
    for start, end in _bounds(lengths):
        state = q.new_zeros(H, q.shape[-1], v.shape[-1])
        for t in range(start, end):
            state = state * g[t].exp()[:, None, None]
            delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
            state = state + k[t][:, :, None] * delta[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", state, q[t] * scale))
    return torch.stack(outs)


def _gdn_inputs(T, Hk, H, Dk, Dv, seed=0):
    q, k, v = _rand(T, Hk, Dk, seed=seed), _rand(T, Hk, Dk, seed=seed + 1), _rand(T, H, Dv, seed=seed + 2)
    g, beta = _rand(T, H, low=-1.0, high=0.0, seed=seed + 3), _rand(T, H, low=0.0, high=1.0, seed=seed + 4)
    return [q, k, v, g, beta]


def _hf_gdn(q, k, v, g, beta, lengths, **options):
    # one key head per value head, as the layer hands them to the reference before transformers 5.2x
    # (whose reference takes fewer key heads itself, the same math)
    q, k = (x.repeat_interleave(v.shape[1] // x.shape[1], dim=1) for x in (q, k))
    pieces = [HF_GDN(*(x[None, s:e] for x in (q, k, v, g, beta)), **options)[0][0] for s, e in _bounds(lengths)]
    return torch.cat(pieces)


@pytest.mark.parametrize("heads", [(2, 2), (1, 4), (2, 4)])  # (key heads, value heads)
def test_gated_delta_rule_equals_each_sequence_alone_forward_and_backward(heads):
    Hk, H = heads
    inputs = _gdn_inputs(sum(MIXED), Hk, H, 8, 6)
    out = gated_delta_rule(*inputs, PackedRow.from_lengths(MIXED), use_qk_l2norm=True)
    alone = _hf_gdn(*inputs, MIXED, use_qk_l2norm_in_kernel=True)
    _assert_close(out, alone, "gated delta rule vs transformers per sequence")
    _assert_close(out, _naive_gdn(*inputs, MIXED), "gated delta rule vs the naive recurrence")
    for g_packed, g_alone, name in zip(_grads(out, inputs), _grads(alone, inputs), ("q", "k", "v", "g", "beta")):
        _assert_close(g_packed, g_alone, f"grad of {name}")


@settings(max_examples=20, deadline=None)
@given(lengths=lengths_st, chunk=st.sampled_from([8, 16, 64]), scale=st.sampled_from([None, 0.3]))
def test_gated_delta_rule_equals_transformers_per_sequence_for_any_lengths_and_chunks(lengths, chunk, scale):
    inputs = _gdn_inputs(sum(lengths), 2, 2, 4, 4, seed=9)
    out = gated_delta_rule(*inputs, PackedRow.from_lengths(lengths), chunk_size=chunk, scale=scale)
    if scale is None:
        _assert_close(out, _hf_gdn(*inputs, lengths, chunk_size=chunk), "gated delta rule vs transformers")
    else:  # transformers' fallback always scales by D_k ** -0.5 (fla takes a scale): the naive loop
        _assert_close(out, _naive_gdn(*inputs, lengths, scale=scale, l2norm=False), "gated delta rule vs the loop")


def test_gated_delta_rule_keeps_the_input_dtype():
    inputs = [x.detach().double() for x in _gdn_inputs(20, 2, 2, 4, 4)]
    out = gated_delta_rule(*inputs, PackedRow.from_lengths([12, 8]))
    assert out.dtype == torch.float64 and out.shape == (20, 2, 4)


# ---- Mamba2's chunked scan ---------------------------------------------------------------------


def _ssd_inputs(T, H, P, G, N, seed=0):
    x, dt = _rand(T, H, P, seed=seed), _rand(T, H, seed=seed + 1)
    A = _rand(H, low=-3.0, high=-0.1, seed=seed + 2)
    B, C = _rand(T, G, N, seed=seed + 3), _rand(T, G, N, seed=seed + 4)
    D, dt_bias = _rand(H, seed=seed + 5), _rand(H, seed=seed + 6)
    return [x, dt, A, B, C, D, dt_bias]


def _naive_ssd(x, dt, A, B, C, D, dt_bias, lengths):
    """Per token, per head, state S (P, N) from zero, dt = softplus(dt + bias): S = e^(dt A) S + dt x B^T;
    y = S C + D x."""
    H = x.shape[1]
    B, C = (y.repeat_interleave(H // y.shape[1], dim=1) for y in (B, C))
    dt = F.softplus(dt + dt_bias)
    outs = []
    for start, end in _bounds(lengths):
        state = x.new_zeros(H, x.shape[2], B.shape[2])
        for t in range(start, end):
            state = state * (dt[t] * A).exp()[:, None, None] + (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
            outs.append(torch.einsum("hpn,hn->hp", state, C[t]) + D[:, None] * x[t])
    return torch.stack(outs)


def _hf_ssd(x, dt, A, B, C, D, dt_bias, lengths, chunk):
    pieces = [
        HF_SSD(
            x[None, s:e], dt[None, s:e], A, B[None, s:e], C[None, s:e], chunk, D=D, dt_bias=dt_bias, dt_softplus=True
        )
        for s, e in _bounds(lengths)
    ]
    return torch.cat([p[0] for p in pieces])


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("chunk", [16, 64])
def test_ssd_scan_equals_each_sequence_alone_forward_and_backward(groups, chunk):
    inputs = _ssd_inputs(sum(MIXED), 4, 6, groups, 5)
    x, dt, A, B, C, D, dt_bias = inputs
    row = PackedRow.from_lengths(MIXED)
    out = ssd_scan(x, dt, A, B, C, row, chunk_size=chunk, D=D, dt_bias=dt_bias, dt_softplus=True)
    alone = _hf_ssd(*inputs, MIXED, chunk)
    _assert_close(out, alone, "SSD scan vs transformers per sequence")
    _assert_close(out, _naive_ssd(*inputs, MIXED), "SSD scan vs the naive recurrence", tol=2e-5)
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias")
    for g_packed, g_alone, name in zip(_grads(out, inputs), _grads(alone, inputs), names):
        _assert_close(g_packed, g_alone, f"grad of {name}")


@pytest.mark.parametrize("slack", [0, 20])  # the longest as given, or a bound above it
def test_the_row_a_compiled_forward_builds_computes_what_the_host_lengths_row_does(slack):
    # under torch.compile the state layers run on a BoundedRow (boundaries, token count, a bound on
    # the longest sequence; no host lengths): every sequence over the longest's chunk count, its
    # chunks past its end zeros. Same outputs and gradients as the aligned layout's, an empty
    # sequence and sequences of several chunks included
    lengths = [*MIXED[:4], 0, *MIXED[4:]]
    row = PackedRow.from_lengths(lengths)
    bounded = layers.BoundedRow(row.cu_seqlens, sum(lengths), max(lengths) + slack)
    assert bounded.layout(16).num_chunks == len(lengths) * -(-(max(lengths) + slack) // 16)
    gdn = _gdn_inputs(sum(lengths), 2, 4, 8, 6)
    ssd = _ssd_inputs(sum(lengths), 4, 6, 2, 5)
    x, dt, A, B, C, D, dt_bias = ssd
    conv = [_rand(6, sum(lengths)), _rand(6, 4, seed=1), _rand(6, seed=2)]
    runs = {
        "gated delta rule": (gdn, lambda r: gated_delta_rule(*gdn, r, chunk_size=16, use_qk_l2norm=True)),
        "SSD scan": (ssd, lambda r: ssd_scan(x, dt, A, B, C, r, chunk_size=16, D=D, dt_bias=dt_bias, dt_softplus=True)),
        "conv": (conv, lambda r: causal_conv1d(*conv, r, activation="silu")),
    }
    for name, (inputs, run) in runs.items():
        out, expected = run(bounded), run(row)
        _assert_close(out, expected, f"{name}: bounded row vs host-lengths row")
        for got, want in zip(_grads(out, inputs), _grads(expected, inputs), strict=True):
            _assert_close(got, want, f"{name}: gradients")


@settings(max_examples=20, deadline=None)
@given(lengths=lengths_st, chunk=st.sampled_from([4, 16, 32]))
def test_ssd_scan_equals_transformers_per_sequence_for_any_lengths_and_chunks(lengths, chunk):
    inputs = _ssd_inputs(sum(lengths), 2, 3, 1, 4, seed=11)
    x, dt, A, B, C, D, dt_bias = inputs
    out = ssd_scan(
        x, dt, A, B, C, PackedRow.from_lengths(lengths), chunk_size=chunk, D=D, dt_bias=dt_bias, dt_softplus=True
    )
    _assert_close(out, _hf_ssd(*inputs, lengths, chunk), "SSD scan", tol=2e-5)


def test_ssd_scan_gates_with_z_and_clamps_dt_as_mamba_ssm_does():
    inputs = _ssd_inputs(30, 2, 3, 1, 4)
    x, dt, A, B, C, D, dt_bias = (t.detach() for t in inputs)
    row = PackedRow.from_lengths([20, 10])
    z = _rand(30, 2, 3, seed=20).detach()
    plain = ssd_scan(x, dt, A, B, C, row, chunk_size=8, D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.1, 0.5))
    gated = ssd_scan(
        x, dt, A, B, C, row, chunk_size=8, D=D, z=z, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.1, 0.5)
    )
    _assert_close(gated, plain * F.silu(z), "z gate")
    clamped = F.softplus(dt + dt_bias).clamp(0.1, 0.5)
    reference = ssd_scan(x, clamped, A, B, C, row, chunk_size=8, D=D)  # the clamped dt given directly
    _assert_close(plain, reference, "dt limit")


# ---- no loop over sequences ----------------------------------------------------------------------


def _count(fn, lengths):
    row = PackedRow.from_lengths(lengths)
    with torch.no_grad(), OpCounter() as counter:
        fn(row)
    return counter.ops


@pytest.mark.parametrize("form", ["conv", "gated_delta_rule", "ssd_scan"])
def test_op_counts_are_the_same_for_8_and_512_sequences(form):
    g = np.random.default_rng(0)

    def lengths(n):
        # the same longest length (so as many chunk steps), any others below it; two of the longest, so that
        # no step advances a single sequence (torch's matmul then views where it otherwise copies: one op less)
        return [100, 100] + g.integers(1, 101, n - 2).tolist()

    def run(row):
        T = row.total
        if form == "conv":
            return causal_conv1d(torch.randn(4, T), torch.randn(4, 4), torch.randn(4), row, activation="silu")
        if form == "gated_delta_rule":
            q, k, v = torch.randn(T, 2, 4), torch.randn(T, 2, 4), torch.randn(T, 2, 4)
            return gated_delta_rule(q, k, v, -torch.rand(T, 2), torch.rand(T, 2), row, chunk_size=16)
        x, dt, A, B, C = (
            torch.randn(T, 2, 4),
            torch.randn(T, 2),
            -torch.rand(2),
            torch.randn(T, 1, 4),
            torch.randn(T, 1, 4),
        )
        return ssd_scan(x, dt, A, B, C, row, chunk_size=16, dt_softplus=True)

    few, many = _count(run, lengths(8)), _count(run, lengths(512))
    assert few == many, f"{form}: {few} ops for 8 sequences, {many} for 512"


# ---- the optional CUDA kernels, through CPU stand-ins ---------------------------------------------
# Each stand-in has the real kernel's signature and computes every sequence on its own with
# transformers' reference (a deliberate loop, as a reference should be); a "leaky" one ignores the
# boundaries, as an install that disagrees would.

CALLS: list[tuple[str, dict]] = []


def _segments_of(seq_idx):
    ids = seq_idx[0].tolist()
    starts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]]
    return list(zip(starts, starts[1:] + [len(ids)]))


def standin_causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    assert x.stride(1) == 1, "causal-conv1d reads seq_idx only from a channel-last input"
    CALLS.append(("causal_conv1d", {"seq_idx": seq_idx is not None, "activation": activation}))
    bounds = _segments_of(seq_idx) if seq_idx is not None else [(0, x.shape[-1])]
    return torch.cat([HF_CONV(x[:, :, s:e], weight, bias, activation=activation) for s, e in bounds], -1)


def standin_chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
):
    assert q.shape[0] == 1 and cu_seqlens is not None and q.shape[2] == v.shape[2]
    CALLS.append(
        ("gated_delta_rule", {"cu_seqlens": cu_seqlens.tolist(), "scale": scale, "states": initial_state is not None})
    )
    bounds = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    assert initial_state is None or initial_state.shape[0] == len(bounds)  # one state per sequence, as fla takes them
    runs = [
        HF_GDN(
            *(t[:, s:e] for t in (q, k, v, g, beta)),
            initial_state=None if initial_state is None else initial_state[i : i + 1],
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        for i, (s, e) in enumerate(bounds)
    ]
    out = torch.cat([o for o, _ in runs], 1)
    return out, torch.cat([f for _, f in runs]) if output_final_state else None


def standin_mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    return_varlen_states=False,
):
    CALLS.append(("ssd_scan", {"seq_idx": seq_idx is not None}))
    bounds = _segments_of(seq_idx) if seq_idx is not None else [(0, x.shape[1])]
    options = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    out = torch.cat(
        [
            HF_SSD(*(t[:, s:e] for t in (x, dt)), A, *(t[:, s:e] for t in (B, C)), chunk_size, **options)
            for s, e in bounds
        ],
        1,
    )
    return out if z is None else out * F.silu(z)


def leaky_causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    return standin_causal_conv1d_fn(x, weight, bias, None, activation=activation)


STANDINS = {
    "causal_conv1d": standin_causal_conv1d_fn,
    "gated_delta_rule": standin_chunk_gated_delta_rule,
    "ssd_scan": standin_mamba_chunk_scan_combined,
}


@pytest.fixture
def standins(monkeypatch):
    """The kernels 'installed' on this CPU: stand-ins for the real ones, probed afresh."""
    monkeypatch.setattr(layers, "KERNEL_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(layers, "_LOADED", dict(STANDINS))
    layers._probe.cache_clear()
    CALLS.clear()
    yield monkeypatch
    layers._probe.cache_clear()  # verdicts on stand-ins are not this process's kernels'


def test_auto_runs_each_kernel_with_the_boundaries_and_equals_the_torch_form(standins):
    row = PackedRow.from_lengths(MIXED)
    T = row.total
    x, w, b = _rand(5, T, seed=1).detach(), _rand(5, 4, seed=2).detach(), _rand(5, seed=3).detach()
    _assert_close(
        causal_conv1d(x, w, b, row, activation="silu"),
        causal_conv1d(x, w, b, row, activation="silu", kernel="torch"),
        "conv kernel",
    )
    q, k, v, g, beta = (t.detach() for t in _gdn_inputs(T, 1, 2, 8, 6))  # grouped values: repeated for the kernel
    _assert_close(
        gated_delta_rule(q, k, v, g, beta, row, use_qk_l2norm=True),
        gated_delta_rule(q, k, v, g, beta, row, use_qk_l2norm=True, kernel="torch"),
        "fla kernel",
    )
    x, dt, A, B, C, D, dt_bias = (t.detach() for t in _ssd_inputs(T, 4, 6, 2, 5))
    options = dict(chunk_size=16, D=D, dt_bias=dt_bias, dt_softplus=True)
    _assert_close(
        ssd_scan(x, dt, A, B, C, row, **options),
        ssd_scan(x, dt, A, B, C, row, kernel="torch", **options),
        "mamba-ssm kernel",
    )
    served = [(form, call) for form, call in CALLS]
    assert {form for form, _ in served} == {"causal_conv1d", "gated_delta_rule", "ssd_scan"}
    assert all(call.get("seq_idx", True) for _, call in served)  # every kernel got the boundaries
    assert any(call.get("cu_seqlens") == row.cu_seqlens.tolist() for _, call in served)


def test_a_kernel_that_disagrees_fails_its_probe_once_and_the_torch_form_serves(standins):
    standins.setitem(layers._LOADED, "causal_conv1d", leaky_causal_conv1d_fn)
    row = PackedRow.from_lengths([9, 4])
    x, w = torch.randn(3, 13), torch.randn(3, 4)
    with pytest.warns(RuntimeWarning, match="causal-conv1d failed its probe here"):
        out = causal_conv1d(x, w, None, row, activation="silu")
    _assert_close(out, causal_conv1d(x, w, None, row, activation="silu", kernel="torch"), "the torch form served")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # probed once per process and device: no second warning
        causal_conv1d(x, w, None, row, activation="silu")
    with pytest.raises(
        ValueError,
        match=r"kernel: expected a kernel that runs here .* 'causal-conv1d': causal-conv1d "
        r"failed its probe here",
    ):
        causal_conv1d(x, w, None, row, kernel="causal-conv1d")


def test_a_shared_prefix_row_runs_fla_from_a_state_per_completion_and_refuses_kernels_that_take_none(standins):
    # groups of 2, 3 and 1 rows: prompts of 1, 70 (past the 64-token chunk) and 9 tokens, completions of 0 to 66
    row = layers.SharedPrefixRow(np.array([1, 0, 70, 0, 0, 9]), np.array([4, 2, 3, 66, 0, 5]))
    inputs = _gdn_inputs(row.total, 1, 2, 8, 6)
    out = gated_delta_rule(*inputs, row, use_qk_l2norm=True)
    served = [call for form, call in CALLS if form == "gated_delta_rule"][-2:]
    assert [call["states"] for call in served] == [False, True]  # the prompts, then the completions from theirs
    want = gated_delta_rule(*inputs, row, use_qk_l2norm=True, kernel="torch")
    _assert_close(out, want, "shared-prefix gated delta rule: kernel vs torch")
    for got, expected, name in zip(_grads(out, inputs), _grads(want, inputs), ("q", "k", "v", "g", "beta")):
        _assert_close(got, expected, f"grad of {name}")  # a prompt's: its own and its completions' through its state
    channels, w = _rand(3, row.total, seed=9).detach(), _rand(3, 4, seed=10).detach()
    with pytest.raises(ValueError, match=r"got 'causal-conv1d' \(causal-conv1d takes no initial states with seq_idx"):
        causal_conv1d(channels, w, None, row, kernel="causal-conv1d")
    x, dt, A, B, C, D, dt_bias = (t.detach() for t in _ssd_inputs(row.total, 2, 4, 1, 3))
    options = dict(chunk_size=16, D=D, dt_bias=dt_bias, dt_softplus=True)
    with pytest.raises(ValueError, match=r"got 'mamba-ssm' \(mamba-ssm's .* one initial state per batch row"):
        ssd_scan(x, dt, A, B, C, row, kernel="mamba-ssm", **options)
    CALLS.clear()
    scan = ssd_scan(x, dt, A, B, C, row, **options)
    _assert_close(scan, ssd_scan(x, dt, A, B, C, row, kernel="torch", **options), "ssd")
    conv = causal_conv1d(channels, w, None, row, activation="silu")
    _assert_close(conv, causal_conv1d(channels, w, None, row, activation="silu", kernel="torch"), "conv")
    assert not CALLS  # "auto": the torch forms, neither kernel probed nor called


def test_kernels_are_not_used_off_cuda_or_when_missing_and_forcing_one_says_why():
    row = PackedRow.from_lengths([3, 2])
    x, w = torch.randn(2, 5), torch.randn(2, 3)
    assert layers.kernel_refusal("causal_conv1d", torch.device("cpu")) == "causal-conv1d runs on cuda, not cpu"
    with pytest.raises(ValueError, match="'causal-conv1d': causal-conv1d runs on cuda, not cpu"):
        causal_conv1d(x, w, None, row, kernel="causal-conv1d")
    with pytest.raises(ValueError, match=r"kernel: expected 'auto', 'torch' or 'mamba-ssm', got 'fla'"):
        ssd_scan(
            torch.randn(5, 1, 2),
            torch.randn(5, 1),
            -torch.rand(1),
            torch.randn(5, 1, 2),
            torch.randn(5, 1, 2),
            row,
            chunk_size=4,
            kernel="fla",
        )


# ---- Mamba's selective scan (the torch form for transformers 5.10, which ships none) ---------------


def test_the_selective_scan_of_right_padded_rows_equals_each_sequence_alone_forward_and_backward():
    lengths, channels, state = [7, 1, 3, 5], 4, 3
    longest = max(lengths)
    u, dt, z = (_rand(len(lengths), channels, longest, seed=s) for s in (1, 2, 3))
    B, C = (_rand(len(lengths), state, longest, seed=s) for s in (4, 5))
    A, D, bias = -_rand(channels, state, low=0.1, high=1.0, seed=6), _rand(channels, seed=7), _rand(channels, seed=8)
    options = dict(D=D, delta_bias=bias, delta_softplus=True)
    rows = layers.torch_selective_scan(u, dt, A, B, C, z=z, **options)
    inputs = (u, dt, z, B, C, A, D, bias)

    def alone_of(i: int, n: int, scan=layers.torch_selective_scan) -> torch.Tensor:
        u_, dt_, z_, B_, C_ = (t[i : i + 1, :, :n] for t in (u, dt, z, B, C))
        return scan(u_, dt_, A, B_, C_, z=z_, **options)[0]

    alone = [alone_of(i, n) for i, n in enumerate(lengths)]
    for i, n in enumerate(lengths):
        _assert_close(rows[i, :, :n], alone[i], f"sequence {i}")
    packed_rows = torch.cat([rows[i, :, :n] for i, n in enumerate(lengths)], dim=1)
    names = "u dt z B C A D bias".split()
    for g_rows, g_alone, name in zip(_grads(packed_rows, inputs), _grads(torch.cat(alone, 1), inputs), names):
        _assert_close(g_rows, g_alone, f"grad of {name}")
    if WRAPS_PRIMITIVES:  # the torch function transformers 5.20 on has behind the primitive
        from transformers.models.mamba import modeling_mamba

        hf = alone_of(0, lengths[0], scan=callee(modeling_mamba.mamba_selective_scan).function)
        _assert_close(alone[0], hf, "transformers' torch selective scan")
