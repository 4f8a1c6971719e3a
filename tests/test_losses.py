"""nopad.losses._losses against straightforward padded computations written here, independently.

The references below use plain tensors and per-row Python: the response log-prob of token k of
row b is the whole-sequence output at column P + k - 1 (the prompt is left-padded to P), masks
select tokens with boolean indexing, and sequence means are taken over the rows that keep at least
one token. Nothing from nopad is used to compute an expected value.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

# private: verl's aggregation modes, listed privately, are run one by one
import nopad.losses._losses as L
from nopad.batches import left_right_2_no_padding
from nopad.diagnostics import OpCounter
from tests.dist_utils import run_distributed

MODES = list(L.AGG_MODES)
KINDS = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]
PLUS_KINDS = [k + "+" for k in KINDS]
TOL = dict(atol=1e-6, rtol=1e-6)


# ---- independent references -----------------------------------------------------------------
def ref_agg(mat, mask, mode, dp_size=1, n_tokens=None, n_seqs=None, scale=None):
    mask = mask.bool()
    rows = [mat[b][mask[b]] for b in range(mat.shape[0])]
    zero = mat[:, :0].sum()  # 0, still attached to the graph
    total = sum((r.sum() for r in rows), zero)
    kept = [r for r in rows if r.numel() > 0]
    if mode == "token-mean":
        return total / (n_tokens if n_tokens is not None else max(sum(r.numel() for r in rows), 1)) * dp_size
    if mode == "token-sum":
        return total * dp_size
    n_seqs = n_seqs if n_seqs is not None else max(len(kept), 1)
    if mode == "seq-mean-token-mean":
        return sum((r.mean() for r in kept), zero) / n_seqs * dp_size
    loss = total / n_seqs * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (scale if scale is not None else mat.shape[-1])
    return loss


def ref_pg_tokens(logp, old, adv, low, high, c, weights=None):
    """PPO written as the objective to maximise: min of the two surrogates, floored at c * A for A < 0."""
    ratio = torch.exp((logp - old).clamp(-20, 20))
    objective = torch.min(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    objective = torch.where(adv < 0, torch.max(objective, c * adv), objective)
    loss = -objective
    return loss if weights is None else loss * weights


def ref_pg_metrics(logp, old, adv, mask, low, high, c):
    mask = mask.bool()
    ratio = torch.exp((logp - old).clamp(-20, 20))
    clipped = (ratio.clamp(1 - low, 1 + high) * adv < ratio * adv)[mask]
    objective = torch.min(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    lower = ((adv < 0) & (objective < c * adv))[mask]
    kl = (old - logp).clamp(-20, 20)[mask]
    mean = lambda x: x.float().mean() if x.numel() else torch.tensor(0.0)
    return {"actor/pg_clipfrac": mean(clipped), "actor/ppo_kl": mean(kl), "actor/pg_clipfrac_lower": mean(lower)}


def ref_kl(logp, ref, kind):
    if kind.endswith("+"):  # the named value, carrying k2's gradient d(d^2/2)/dlogp = logp - ref
        value = ref_kl(logp, ref, kind[:-1]).detach()
        half_sq = (logp - ref) ** 2 / 2
        return value + (half_sq - half_sq.detach())
    d = logp - ref
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("k2", "mse"):
        return d * d / 2
    log_r = (ref - logp).clamp(-20, 20)  # k3 = r - 1 - log r with r = ref / p
    return (log_r.exp() - 1 - log_r).clamp(-10, 10)


def ref_value_tokens(v, returns, old_v, c):
    v_clip = torch.max(torch.min(v, old_v + c), old_v - c)
    return torch.max((v - returns) ** 2, (v_clip - returns) ** 2)


# ---- batches --------------------------------------------------------------------------------
def rollout(prompt_lens, resp_lens, P, R, *, masked_rows=(), seed=0, dtype=torch.float32):
    """A padded verl micro batch plus a whole-sequence model output, padded (B, S) and nested.

    Rows in ``masked_rows`` keep their response tokens but have response_mask all 0.
    Returns (data, full, nested_of): ``full`` (B, S) is a leaf requiring grad; ``nested_of(x)``
    turns any (B, S) tensor into the nested (B, j) output the engine would return.
    """
    g = torch.Generator().manual_seed(seed)
    B, S = len(prompt_lens), P + R
    p = torch.tensor(prompt_lens).unsqueeze(1)
    r = torch.tensor(resp_lens).unsqueeze(1)
    attention = torch.cat([torch.arange(P) >= P - p, torch.arange(R) < r], 1).long()
    response_mask = (torch.arange(R) < r).long()
    for b in masked_rows:
        response_mask[b] = 0
    td = TensorDict(
        {
            "input_ids": torch.randint(1, 100, (B, S), generator=g) * attention,
            "attention_mask": attention,
            "response_mask": response_mask,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "old_log_probs": -torch.rand(B, R, generator=g, dtype=dtype) * 3,
            "advantages": torch.randn(B, R, generator=g, dtype=dtype) * 2,
            "ref_log_prob": -torch.rand(B, R, generator=g, dtype=dtype) * 3,
            "rollout_is_weights": torch.rand(B, R, generator=g, dtype=dtype) + 0.5,
            "values": torch.randn(B, R, generator=g, dtype=dtype),
            "returns": torch.randn(B, R, generator=g, dtype=dtype),
        },
        batch_size=[B],
    )
    data = left_right_2_no_padding(td)
    full = (-torch.rand(B, S, generator=g, dtype=dtype) * 3).requires_grad_()

    def nested_of(x):  # on the batch's own offsets, as an engine's output is
        rows = [x[b][attention[b].bool()] for b in range(B)]
        return torch.nested.nested_tensor_from_jagged(torch.cat(rows), data["input_ids"].offsets())

    return data, full, nested_of


def response_part(full, data, P):
    """Reference slice: response token k of each row comes from whole-sequence column P + k - 1."""
    R = data["response_mask"].shape[1]
    in_response = data["attention_mask"][:, P:].bool()
    return torch.where(in_response, full[:, P - 1 : P - 1 + R], 0.0)


SHAPES = [  # (prompt_lens, resp_lens, P, R, masked_rows)
    ([3, 1, 2, 3], [4, 1, 0, 2], 3, 4, (3,)),  # a length-1 row, an empty response, a masked row
    ([1], [1], 1, 1, ()),  # B=1, all length 1
    ([2, 2, 2], [3, 3, 3], 2, 3, ()),  # all equal, full width
    ([2, 1], [2, 2], 2, 3, (0, 1)),  # every row masked
]


@st.composite
def rollout_shapes(draw):
    B = draw(st.integers(1, 5))
    P, R = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    prompt_lens = draw(st.lists(st.integers(1, P), min_size=B, max_size=B))
    resp_lens = draw(st.lists(st.sampled_from([0, 1, R, *range(R + 1)]), min_size=B, max_size=B))
    masked = draw(st.lists(st.integers(0, B - 1), max_size=2, unique=True))
    return prompt_lens, resp_lens, P, R, tuple(masked)


# ---- agg_loss -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("figures", [{}, dict(dp_size=3, n_tokens=17, n_seqs=5, scale=7.0)])
def test_agg_loss_matches_reference_with_fully_masked_and_length_1_rows(mode, figures):
    g = torch.Generator().manual_seed(0)
    mat = torch.randn(5, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    kw = dict(
        dp_size=figures.get("dp_size", 1),
        batch_num_tokens=figures.get("n_tokens"),
        global_batch_size=figures.get("n_seqs"),
        loss_scale_factor=figures.get("scale"),
    )
    expected = ref_agg(
        mat, mask, mode, figures.get("dp_size", 1), figures.get("n_tokens"), figures.get("n_seqs"), figures.get("scale")
    )
    torch.testing.assert_close(L.agg_loss(mat, mask, mode, **kw), expected, **TOL)
    torch.testing.assert_close(L.agg_loss(mat, mask.bool(), mode, **kw), expected, **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_ignores_nan_and_inf_under_the_mask_in_value_and_gradient(mode):
    mat = torch.tensor([[1.0, 2.0, float("nan")], [float("inf"), 0.5, -1.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    loss = L.agg_loss(mat, mask, mode)
    clean = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.5, -1.0]])
    torch.testing.assert_close(loss, ref_agg(clean, mask, mode))
    loss.backward()
    assert torch.isfinite(mat.grad).all() and (mat.grad[mask == 0] == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_of_an_all_masked_micro_batch_is_zero_not_nan(mode):
    mat = torch.randn(3, 4, requires_grad=True)
    loss = L.agg_loss(mat, torch.zeros(3, 4), mode)
    loss.backward()
    assert loss.item() == 0.0 and (mat.grad == 0).all()


# ---- kl_penalty -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS + PLUS_KINDS)
def test_kl_penalty_value_and_gradient_match_reference(kind):
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(4, 6, generator=g) * 5).requires_grad_()
    ref = -torch.rand(4, 6, generator=g) * 5
    ref[0, 0] = logp[0, 0].item() - 30  # k3 clamps: exp(-30) ratio, and the value at 10
    ref[0, 1] = logp[0, 1].item() + 30
    out = L.kl_penalty(logp, ref, kind)
    torch.testing.assert_close(out, ref_kl(logp, ref, kind), **TOL)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    if kind.endswith("+"):  # straight-through: k2's gradient, d(d^2/2)/dlogp = d
        expected = (logp - ref).detach()
    else:
        (expected,) = torch.autograd.grad(ref_kl(logp, ref, kind).sum(), logp)
    torch.testing.assert_close(grad, expected, **TOL)


def test_k3_is_clamped_and_nonnegative():
    logp = torch.tensor([0.0, -50.0, -1.0])
    ref = torch.tensor([-50.0, 0.0, -1.0])
    out = L.kl_penalty(logp, ref, "low_var_kl")
    assert out.tolist()[2] == 0.0 and out.max().item() == 10.0 and (out >= 0).all()


# ---- compute_policy_loss / compute_value_loss -----------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clips", [(0.2, None, None, 3.0), (0.2, 0.1, 0.28, 1.5), (0.3, 0.0, 10.0, 1.01)])
def test_compute_policy_loss_matches_reference(mode, clips):
    clip, low, high, c = clips
    g = torch.Generator().manual_seed(2)
    B, R = 6, 5
    old = -torch.rand(B, R, generator=g) * 3
    logp = (old + torch.randn(B, R, generator=g) * 1.5).requires_grad_()  # ratios far outside the clip
    logp.data[0, 0] = old[0, 0] + 40  # beyond the log-ratio clamp
    adv = torch.randn(B, R, generator=g) * 2
    weights = torch.rand(B, R, generator=g) + 0.5
    mask = torch.rand(B, R, generator=g) < 0.7
    mask[1] = False
    mask[2] = False
    mask[2, 0] = True
    loss, metrics = L.compute_policy_loss(
        old,
        logp,
        adv,
        mask,
        mode,
        clip_ratio=clip,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=c,
        rollout_is_weights=weights,
    )
    lo, hi = (clip if low is None else low), (clip if high is None else high)
    expected = ref_agg(ref_pg_tokens(logp, old, adv, lo, hi, c, weights), mask, mode)
    torch.testing.assert_close(loss, expected, **TOL)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(expected, logp)[0], **TOL)
    for key, value in ref_pg_metrics(logp, old, adv, mask, lo, hi, c).items():
        torch.testing.assert_close(metrics[key], value, **TOL)
    assert metrics["actor/pg_clipfrac"] > 0 and metrics["actor/pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_compute_value_loss_matches_reference(mode):
    g = torch.Generator().manual_seed(3)
    vpreds = torch.randn(4, 5, generator=g).requires_grad_()
    returns, values = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0] * 5, [1, 0, 0, 0, 0], [1] * 5])
    loss, clipfrac = L.compute_value_loss(vpreds, returns, values, mask, 0.3, mode)
    tokens = ref_value_tokens(vpreds, returns, values, 0.3)
    expected = 0.5 * ref_agg(tokens, mask, mode)
    torch.testing.assert_close(loss, expected, **TOL)
    torch.testing.assert_close(torch.autograd.grad(loss, vpreds)[0], torch.autograd.grad(expected, vpreds)[0], **TOL)
    v_clip = torch.max(torch.min(vpreds, values + 0.3), values - 0.3)
    expected_frac = ((v_clip - returns) ** 2 > (vpreds - returns) ** 2)[mask.bool()].float().mean()
    torch.testing.assert_close(clipfrac, expected_frac)


# ---- ppo_loss / value_loss / sft_loss over nested outputs -----------------------------------
def reference_ppo(cfg, full, entropy_full, data, P, figures):
    mask = data["response_mask"].bool()
    logp = response_part(full, data, P)
    lo = cfg.clip_ratio if cfg.clip_ratio_low is None else cfg.clip_ratio_low
    hi = cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    agg = lambda m: ref_agg(
        m,
        mask,
        cfg.loss_agg_mode,
        figures.get("dp_size", 1),
        figures.get("batch_num_tokens"),
        figures.get("global_batch_size"),
        cfg.loss_scale_factor,
    )
    tokens = ref_pg_tokens(
        logp, data["old_log_probs"], data["advantages"], lo, hi, cfg.clip_ratio_c, data["rollout_is_weights"]
    )
    loss = agg(tokens)
    if entropy_full is not None:
        loss = loss - cfg.entropy_coeff * agg(response_part(entropy_full, data, P))
    if cfg.use_kl_loss:
        loss = loss + cfg.kl_loss_coef * agg(ref_kl(logp, data["ref_log_prob"], cfg.kl_loss_type))
    return loss


def _set_figures(data, figures):
    for key, value in figures.items():
        data.set_non_tensor(key, value)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("global_figures", [False, True])
def test_ppo_loss_matches_padded_reference_for_every_agg_mode(shape, mode, global_figures):
    prompt_lens, resp_lens, P, R, masked = shape
    data, full, nested_of = rollout(prompt_lens, resp_lens, P, R, masked_rows=masked, seed=len(prompt_lens))
    entropy_full = torch.rand_like(full).requires_grad_()
    figures = dict(dp_size=2, batch_num_tokens=11, global_batch_size=3) if global_figures else {}
    _set_figures(data, figures)
    cfg = L.LossConfig(
        loss_agg_mode=mode,
        clip_ratio_low=0.15,
        clip_ratio_high=0.3,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_type="k3+",
        kl_loss_coef=0.05,
        loss_scale_factor=3.0,
    )
    loss, metrics = L.ppo_loss(cfg, {"log_probs": nested_of(full), "entropy": nested_of(entropy_full)}, data)
    expected = reference_ppo(cfg, full, entropy_full, data, P, figures)
    torch.testing.assert_close(loss, expected, **TOL)
    got = torch.autograd.grad(loss, [full, entropy_full], allow_unused=True)
    want = torch.autograd.grad(expected, [full, entropy_full], allow_unused=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(
            a if a is not None else torch.zeros_like(full), b if b is not None else torch.zeros_like(full), **TOL
        )
    lo_hi = ref_pg_metrics(
        response_part(full, data, P), data["old_log_probs"], data["advantages"], data["response_mask"], 0.15, 0.3, 3.0
    )
    for key, value in lo_hi.items():
        torch.testing.assert_close(metrics[key], value, **TOL)
    assert {"actor/pg_loss", "actor/entropy_loss", "kl_loss", "kl_coef"} <= set(metrics)
    assert all(not m.requires_grad for m in metrics.values())


@pytest.mark.parametrize("kind", KINDS + PLUS_KINDS)
def test_ppo_loss_kl_term_matches_reference_for_every_kl_kind(kind):
    prompt_lens, resp_lens, P, R, masked = SHAPES[0]
    data, full, nested_of = rollout(prompt_lens, resp_lens, P, R, masked_rows=masked, seed=7)
    cfg = L.LossConfig(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_type=kind, kl_loss_coef=0.5)
    loss, metrics = L.ppo_loss(cfg, {"log_probs": nested_of(full)}, data)
    expected = reference_ppo(cfg, full, None, data, P, {})
    torch.testing.assert_close(loss, expected, **TOL)
    torch.testing.assert_close(torch.autograd.grad(loss, full)[0], torch.autograd.grad(expected, full)[0], **TOL)
    mask = data["response_mask"].bool()
    kl_ref = ref_agg(ref_kl(response_part(full, data, P), data["ref_log_prob"], kind), mask, "seq-mean-token-mean")
    torch.testing.assert_close(metrics["kl_loss"], kl_ref.detach(), **TOL)


@settings(max_examples=40)
@given(
    shape=rollout_shapes(),
    mode=st.sampled_from(MODES),
    kind=st.sampled_from(KINDS + PLUS_KINDS),
    seed=st.integers(0, 2**16),
)
def test_ppo_loss_property_any_batch_shape(shape, mode, kind, seed):
    prompt_lens, resp_lens, P, R, masked = shape
    data, full, nested_of = rollout(prompt_lens, resp_lens, P, R, masked_rows=masked, seed=seed)
    cfg = L.LossConfig(loss_agg_mode=mode, use_kl_loss=True, kl_loss_type=kind, entropy_coeff=0.1)
    entropy_full = torch.rand_like(full)
    loss, _ = L.ppo_loss(cfg, {"log_probs": nested_of(full), "entropy": nested_of(entropy_full)}, data)
    torch.testing.assert_close(loss, reference_ppo(cfg, full, entropy_full, data, P, {}), **TOL)
    # the flat (total,) form of the same output gives the same loss
    flat, _ = L.ppo_loss(
        cfg, {"log_probs": nested_of(full).values(), "entropy": nested_of(entropy_full).values()}, data
    )
    torch.testing.assert_close(flat, loss, atol=0, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_value_loss_matches_padded_reference(shape, mode):
    prompt_lens, resp_lens, P, R, masked = shape
    data, full, nested_of = rollout(prompt_lens, resp_lens, P, R, masked_rows=masked, seed=11)
    loss, metrics = L.value_loss({"loss_agg_mode": mode, "cliprange_value": 0.2}, {"values": nested_of(full)}, data)
    mask = data["response_mask"].bool()
    vpreds = response_part(full, data, P)
    expected = 0.5 * ref_agg(ref_value_tokens(vpreds, data["returns"], data["values"], 0.2), mask, mode)
    torch.testing.assert_close(loss, expected, **TOL)
    torch.testing.assert_close(torch.autograd.grad(loss, full)[0], torch.autograd.grad(expected, full)[0], **TOL)
    vpred_mean = vpreds[mask].mean() if mask.any() else torch.tensor(0.0)
    torch.testing.assert_close(metrics["critic/vpred_mean"], vpred_mean.detach(), **TOL)
    assert set(metrics) == {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"}


@pytest.mark.parametrize("shape", SHAPES)
def test_sft_loss_padded_layout_matches_reference(shape):
    prompt_lens, resp_lens, P, R, masked = shape
    data, full, nested_of = rollout(prompt_lens, resp_lens, P, R, masked_rows=masked, seed=5)
    loss, metrics = L.sft_loss(None, {"log_probs": nested_of(full)}, data)
    mask = data["response_mask"].bool()
    logp = response_part(full, data, P)
    expected = -logp[mask].sum() / max(int(mask.sum()), 1)
    torch.testing.assert_close(loss, expected, **TOL)
    torch.testing.assert_close(torch.autograd.grad(loss, full)[0], torch.autograd.grad(expected, full)[0], **TOL)
    assert metrics == {}


def test_sft_loss_nested_layout_never_takes_a_label_across_sequences():
    # three sequences; every token is a loss token, including each sequence's first token
    lengths = [3, 1, 4]
    g = torch.Generator().manual_seed(0)
    rows = [-torch.rand(n, generator=g) for n in lengths]
    masks = [torch.ones(n, dtype=torch.long) for n in lengths]
    masks[2][2] = 0
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    values = torch.cat(rows).requires_grad_()
    log_probs = torch.nested.nested_tensor_from_jagged(values, offsets)
    loss_mask = torch.nested.nested_tensor_from_jagged(torch.cat(masks), offsets)
    data = TensorDict({"loss_mask": loss_mask}, batch_size=[3])
    data.set_non_tensor("batch_num_tokens", 4)
    data.set_non_tensor("dp_size", 2)
    loss, _ = L.sft_loss(None, {"log_probs": log_probs}, data)
    # position t predicts token t+1 of the SAME sequence; a sequence's last position predicts nothing
    terms = []
    for lp, m in zip(values.split(lengths), masks):
        terms += [lp[t] for t in range(len(m) - 1) if m[t + 1]]
    expected = -torch.stack(terms).sum() / 4 * 2
    torch.testing.assert_close(loss, expected, **TOL)
    grad = torch.autograd.grad(loss, values)[0]
    last = offsets[1:] - 1
    assert (grad[last] == 0).all()  # the last position of each sequence never enters the loss
    assert len(terms) == 4


def test_loss_config_accepts_dataclass_dict_attribute_and_mapping_objects():
    fields = dict(
        loss_agg_mode="seq-mean-token-sum",
        clip_ratio=0.1,
        clip_ratio_c=2.0,
        entropy_coeff=0.2,
        use_kl_loss=True,
        kl_loss_type="k1",
        kl_loss_coef=0.3,
        unrelated_verl_field=1,
    )

    class MappingConfig:  # omegaconf's DictConfig answers keys()/get()/[]
        def __init__(self, d):
            self._d = d

        def keys(self):
            return self._d.keys()

        def get(self, key, default=None):
            return self._d.get(key, default)

    data, full, nested_of = rollout(*SHAPES[0][:4], masked_rows=SHAPES[0][4])
    out = {"log_probs": nested_of(full), "entropy": nested_of(full.detach().exp())}
    dataclass_fields = {k: v for k, v in fields.items() if k != "unrelated_verl_field"}
    losses = [
        L.ppo_loss(c, out, data)[0]
        for c in (L.LossConfig(**dataclass_fields), fields, SimpleNamespace(**fields), MappingConfig(fields))
    ]
    assert all(torch.equal(losses[0], x) for x in losses[1:])
    default = L.ppo_loss(None, out, data)[0]
    assert not torch.equal(default, losses[0])
    nested_verl_style = {**fields, "policy_loss": {"loss_mode": "vanilla"}}
    assert torch.equal(L.ppo_loss(nested_verl_style, out, data)[0], losses[0])
    with pytest.raises(ValueError, match=r"config.policy_loss.loss_mode: expected 'vanilla'.*got 'gspo'"):
        L.ppo_loss(SimpleNamespace(policy_loss=SimpleNamespace(loss_mode="gspo")), out, data)


# ---- micro-batch and data-parallel invariance -----------------------------------------------
DENSE = (
    "attention_mask",
    "response_mask",
    "old_log_probs",
    "advantages",
    "ref_log_prob",
    "rollout_is_weights",
    "values",
    "returns",
)


def _invariance_batch(B=8, P=4, R=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, P + 1, (B,), generator=g).tolist()
    resp_lens = torch.randint(1, R + 1, (B,), generator=g).tolist()
    resp_lens[2] = 1
    data, _, _ = rollout(prompt_lens, resp_lens, P, R, masked_rows=(5,), seed=seed)
    return data, torch.randn(B, P + R, generator=g)


def _nest(x, attention):
    rows = [x[b][attention[b].bool()] for b in range(x.shape[0])]
    return torch.nested.nested_tensor_from_jagged(torch.cat(rows), torch.tensor([0, *map(len, rows)]).cumsum(0))


def _micro_batch_losses(loss_fn, cfg, data, features, weight, rows, micro_size, figures):
    """Sum of the losses of micro batches of ``micro_size`` rows over ``rows`` of the batch.

    Each micro batch is padded again and goes through left_right_2_no_padding on its own; the model
    is log(sigmoid(features * weight)) per token, so every micro batch's gradient reaches ``weight``.
    """
    total = 0.0
    for start in range(rows.start, rows.stop, micro_size):
        r = slice(start, min(start + micro_size, rows.stop))
        att = data["attention_mask"][r]
        padded = TensorDict({k: data[k][r] for k in DENSE}, batch_size=[att.shape[0]])
        padded["input_ids"] = att.clone()
        padded["position_ids"] = (att.cumsum(-1) - 1).clamp(min=0)
        micro = left_right_2_no_padding(padded)
        _set_figures(micro, figures)
        full = torch.nn.functional.logsigmoid(features[r] * weight)
        out = {"log_probs": _nest(full, att), "entropy": _nest(full.exp(), att), "values": _nest(full, att)}
        total = total + loss_fn(cfg, out, micro)[0]
    return total


@pytest.mark.parametrize("loss_fn", [L.ppo_loss, L.value_loss, L.sft_loss], ids=["ppo", "value", "sft"])
@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_split_gives_the_same_loss_and_gradient(loss_fn, mode):
    data, features = _invariance_batch()
    B, S = features.shape
    cfg = L.LossConfig(
        loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_type="low_var_kl+", loss_scale_factor=4.0
    )
    figures = L.global_batch_info(data["response_mask"])
    assert figures == {
        "dp_size": 1,
        "batch_num_tokens": int(data["response_mask"].sum()),
        "global_batch_size": int(data["response_mask"].any(-1).sum()),
    }
    results = []
    for micro_size in (8, 4, 2):  # 1, 2 and 4 micro batches
        weight = torch.linspace(0.5, 1.5, S).requires_grad_()
        loss = _micro_batch_losses(loss_fn, cfg, data, features, weight, range(B), micro_size, figures)
        (grad,) = torch.autograd.grad(loss, weight)
        results.append((loss.detach(), grad))
    for loss, grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0], **TOL)
        torch.testing.assert_close(grad, results[0][1], **TOL)
    # one micro batch with the global figures is the plain local loss of the whole batch
    local = _micro_batch_losses(loss_fn, cfg, data, features, torch.linspace(0.5, 1.5, S), range(B), B, {})
    torch.testing.assert_close(results[0][0], local, **TOL)
    # without the figures, splitting changes the loss (so the figures are what makes it invariant)
    if mode != "token-sum":
        split = _micro_batch_losses(loss_fn, cfg, data, features, torch.linspace(0.5, 1.5, S), range(B), 2, {})
        assert not torch.allclose(split, local)


def _dp_rank(rank, world_size):
    return [_dp_rank_mode(rank, world_size, mode) for mode in MODES]


def _dp_rank_mode(rank, world_size, mode):
    data, features = _invariance_batch()
    B, S = features.shape
    cfg = L.LossConfig(loss_agg_mode=mode, use_kl_loss=True, kl_loss_type="k2", loss_scale_factor=4.0)
    weight = torch.linspace(0.5, 1.5, S).requires_grad_()
    single = _micro_batch_losses(L.ppo_loss, cfg, data, features, weight, range(B), B, {})
    (single_grad,) = torch.autograd.grad(single, weight)
    # this rank's half of the rows, in two micro batches, normalised by the all-reduced figures
    half = range(rank * B // world_size, (rank + 1) * B // world_size)
    figures = L.global_batch_info(data["response_mask"][half.start : half.stop])
    weight = torch.linspace(0.5, 1.5, S).requires_grad_()
    loss = _micro_batch_losses(L.ppo_loss, cfg, data, features, weight, half, 2, figures)
    (grad,) = torch.autograd.grad(loss, weight)
    torch.distributed.all_reduce(grad)
    grad /= world_size  # what FSDP/DDP do to gradients
    return figures["dp_size"], (grad - single_grad).abs().max().item()


@pytest.mark.slow
def test_data_parallel_gradient_equals_single_process_gradient():
    for per_mode in run_distributed(_dp_rank, 2):
        for dp_size, diff in per_mode:
            assert dp_size == 2 and diff < 1e-6


# ---- speed contract -------------------------------------------------------------------------
@pytest.mark.parametrize("loss_fn", [L.ppo_loss, L.value_loss, L.sft_loss], ids=["ppo", "value", "sft"])
def test_loss_op_count_is_independent_of_batch_size_and_sync_free(loss_fn, device_path):
    counts = []
    for B in (4, 64):
        g = torch.Generator().manual_seed(B)
        prompt = torch.randint(1, 5, (B,), generator=g).tolist()
        resp = torch.randint(0, 6, (B,), generator=g).tolist()
        data, full, nested_of = rollout(prompt, resp, 4, 5, masked_rows=(0,))
        offsets = data["input_ids"].offsets()  # an engine's output shares the batch's offsets tensor
        out = {
            key: torch.nested.nested_tensor_from_jagged(nested_of(x).values(), offsets)
            for key, x in (("log_probs", full), ("entropy", full.detach()), ("values", full))
        }
        cfg = L.LossConfig(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, entropy_coeff=0.1)
        loss_fn(cfg, out, data)
        with OpCounter() as counter:
            loss_fn(cfg, out, data)
        counts.append(counter)
    assert counts[0].by_op == counts[1].by_op
    assert counts[0].syncs == 0


def test_an_output_on_an_equal_copy_of_the_offsets_costs_one_cpu_compare_and_the_same_loss():
    data, full, nested_of = rollout(*SHAPES[0][:4], masked_rows=SHAPES[0][4])
    shared = nested_of(full)  # on the batch's offsets tensor
    copy = torch.nested.nested_tensor_from_jagged(shared.values(), data["input_ids"].offsets().clone())
    assert copy.offsets() is not data["input_ids"].offsets()
    with OpCounter() as counter:
        loss = L.ppo_loss(None, {"log_probs": copy}, data)[0]
    # on the CPU: reads of CPU memory, not device syncs (the loss's own check; the way back then
    # runs on the batch's offsets and does not compare again)
    assert 1 <= counter.by_op["aten.equal.default"] <= 2
    assert torch.equal(loss, L.ppo_loss(None, {"log_probs": shared}, data)[0])


# ---- bad input ------------------------------------------------------------------------------
def test_unknown_agg_mode_names_the_field_and_the_modes():
    with pytest.raises(ValueError, match=r"loss_agg_mode: expected one of \['token-mean'.*got 'seq-mean'"):
        L.agg_loss(torch.zeros(2, 3), torch.ones(2, 3), "seq-mean")
    with pytest.raises(ValueError, match=r"config.loss_agg_mode: expected one of"):
        L.LossConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match=r"config.loss_agg_mode"):
        L.ppo_loss({"loss_agg_mode": "token_mean"}, {}, TensorDict({}, batch_size=[]))


def test_unknown_kl_kind_names_the_field_and_the_kinds():
    with pytest.raises(ValueError, match=r"kind: expected one of \['k1'.*trailing '\+'.*got 'full'"):
        L.kl_penalty(torch.zeros(2), torch.zeros(2), "full")
    with pytest.raises(ValueError, match=r"config.kl_loss_type: expected .*got 'k4'"):
        L.LossConfig(kl_loss_type="k4")


@pytest.mark.parametrize("c", [1.0, 0.5, -3.0])
def test_clip_ratio_c_at_most_one_is_rejected(c):
    with pytest.raises(ValueError, match=rf"clip_ratio_c: expected a finite dual-clip bound > 1, got {c}"):
        L.compute_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), clip_ratio_c=c)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        L.LossConfig(clip_ratio_c=c)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "token-sum"])
def test_dp_size_above_one_without_global_figures_is_rejected(mode):
    needs = "batch_num_tokens" if mode == "token-mean" else "global_batch_size"
    with pytest.raises(ValueError, match=rf"{needs}: expected the global mini-batch figure when dp_size=4"):
        L.agg_loss(torch.zeros(2, 3), torch.ones(2, 3), mode, dp_size=4)
    data, full, nested_of = rollout(*SHAPES[0][:4])
    data.set_non_tensor("dp_size", 4)
    with pytest.raises(ValueError, match=needs):
        L.ppo_loss({"loss_agg_mode": mode}, {"log_probs": nested_of(full)}, data)


@pytest.mark.parametrize("dp_size", [0, -1, 2.0, True, "2", torch.tensor(2)])
def test_bad_dp_size_is_rejected(dp_size):
    """dp_size is an int like every other int nopad takes (a tensor would be read: a sync on a GPU)."""
    with pytest.raises(ValueError, match=rf"dp_size: expected an int >= 1, got {re.escape(repr(dp_size))}"):
        L.agg_loss(torch.zeros(2, 3), torch.ones(2, 3), "token-sum", dp_size=dp_size)
    mat = torch.ones(2, 3)
    assert (
        L.agg_loss(mat, mat, "token-sum", dp_size=2).item()
        == L.agg_loss(mat, mat, "token-sum", dp_size=np.int64(2))
        == 12.0
    )


def test_mismatched_shapes_name_the_field_and_the_expected_shape():
    with pytest.raises(ValueError, match=r"log_prob: expected shape \(2, 3\) like response_mask, got shape \(2, 4\)"):
        L.compute_policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"loss_mask: expected shape \(2, 3\) like loss_mat, got shape \(3, 2\)"):
        L.agg_loss(torch.zeros(2, 3), torch.ones(3, 2), "token-mean")
    with pytest.raises(ValueError, match=r"ref_logprob: expected shape \(4,\) like logprob"):
        L.kl_penalty(torch.zeros(4), torch.zeros(5), "k3")
    with pytest.raises(ValueError, match=r"vpreds: expected shape \(2, 3\)"):
        L.compute_value_loss(torch.zeros(3, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 0.5)

    prompt_lens, resp_lens, P, R, _ = SHAPES[0]
    data, full, nested_of = rollout(prompt_lens, resp_lens, P, R)
    B = len(prompt_lens)
    with pytest.raises(
        ValueError,
        match=rf"model_output\['log_probs'\]: expected shape \({B}, {R}\) like "
        rf"response_mask, got shape \({B}, {R + 1}\)",
    ):
        L.ppo_loss(None, {"log_probs": torch.zeros(B, R + 1)}, data)
    three = torch.nested.nested_tensor_from_jagged(torch.zeros(4), torch.tensor([0, 1, 2, 4]))
    with pytest.raises(ValueError, match=rf"model_output\['log_probs'\]: expected {B} sequences like response_mask"):
        L.ppo_loss(None, {"log_probs": three}, data)
    short = torch.nested.nested_tensor_from_jagged(torch.zeros(5), torch.tensor([0, 1, 2, 3, 5]))
    with pytest.raises(ValueError, match=r"model_output\['log_probs'\]: expected \d+ tokens \(the batch's total\)"):
        L.ppo_loss(None, {"log_probs": short}, data)
    bad = data.clone()
    bad["advantages"] = torch.zeros(B, R - 1)
    with pytest.raises(ValueError, match=rf"data\['advantages'\]: expected shape \({B}, {R}\) like response_mask"):
        L.ppo_loss(None, {"log_probs": nested_of(full)}, bad)
    del bad["advantages"]
    with pytest.raises(ValueError, match=r"data\['advantages'\]: expected a padded .* got missing"):
        L.ppo_loss(None, {"log_probs": nested_of(full)}, bad)
    with pytest.raises(ValueError, match=r"model_output: expected a 'values' entry"):
        L.value_loss(None, {"log_probs": nested_of(full)}, data)


def test_loss_of_garbage_in_rollout_padding_stays_finite():
    prompt_lens, resp_lens, P, R, masked = SHAPES[0]
    data, full, nested_of = rollout(prompt_lens, resp_lens, P, R, masked_rows=masked)
    pad = data["response_mask"] == 0
    for key in ("old_log_probs", "advantages", "ref_log_prob"):
        data[key] = data[key].masked_fill(pad, float("nan"))
    cfg = L.LossConfig(use_kl_loss=True, loss_agg_mode="seq-mean-token-mean")
    loss, metrics = L.ppo_loss(cfg, {"log_probs": nested_of(full)}, data)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(full.grad).all()
    assert all(math.isfinite(m.item()) for m in metrics.values())
