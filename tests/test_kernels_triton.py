"""The real kernel packages, run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``),
through nopad's routes and against nopad's torch forms, forward and backward, probes included.

- flash-linear-attention's ``chunk_gated_delta_rule(cu_seqlens=...)`` through
  ``nopad.modeling.gated_delta_rule(kernel="flash-linear-attention")``, on a packed row and on a
  shared-prefix row (each completion from its prompt's final state: ``initial_state`` per sequence),
  the latter also against each (prompt + completion) run alone;
- mamba-ssm's Triton SSD scan ``mamba_chunk_scan_combined(seq_idx=...)`` through
  ``nopad.modeling.ssd_scan(kernel="mamba-ssm")``; it takes one initial state per batch row, not per
  sequence, so a shared-prefix row refuses it by name and scans in torch;
- flash-linear-attention's Triton ``causal_conv1d(cu_seqlens=...)`` against
  ``nopad.modeling.causal_conv1d``'s torch form. nopad routes its conv to the causal-conv1d package
  (``seq_idx``), which has no Triton kernel (CUDA C++ only): it cannot run here, and its route stays
  proven by the stand-ins of tests/test_layers.py only;
- Apple's Cut Cross-Entropy through ``nopad.modeling.head_log_probs(kernel="cut_cross_entropy")``;
- Liger-Kernel: its Triton fused linear cross-entropy (``LigerFusedLinearCrossEntropyFunction``,
  which nopad does not route) against nopad's head, and the one route nopad has to Liger, verl's
  ``FusedLinearForPPO(impl_backend="liger")``, whose ``LigerFusedLinearScaledCrossEntropyFunction``
  is CuTe DSL on Hopper and torch elsewhere (no Triton: what runs here is Liger's torch form);
- verl 0.9.1's Triton ``linear_cross_entropy`` through nopad's ``install()`` route
  (``nopad.integrations.verl._head.linear_cross_entropy``), from verl's wheel installed without its
  dependencies (tests/triton_interpreter.py).

The library's rule that these kernels run only on CUDA stays: as the CPU stand-ins do, the tests let
the CPU in (``KERNEL_DEVICES``, ``_on_cuda``), and the interpreter's shims live in
tests/triton_interpreter.py. Without TRITON_INTERPRET=1 or the packages the module skips, saying
why; with ``NOPAD_REQUIRE_KERNELS=1`` (CI's kernels leg, .ci/kernels-leg) it fails instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests import triton_interpreter as interp

if not interp.INTERPRETING:
    interp.unavailable(
        "TRITON_INTERPRET=1 is not set: the real Triton kernels run on a CPU only under Triton's "
        "interpreter, switched on before they are imported (CI's kernels leg: .ci/kernels-leg)"
    )
try:
    import triton  # noqa: F401
except Exception as exc:  # noqa: BLE001
    interp.unavailable(f"triton does not import here ({exc!r}); CI's kernels leg installs it (.ci/kernels-leg)")

# private: the optional kernels' loaders are pointed at Triton's interpreter
import nopad.integrations.verl._head as vh  # noqa: E402
import nopad.modeling._layers as layers  # noqa: E402
import nopad.modeling._logprobs as head  # noqa: E402
from nopad.modeling import (  # noqa: E402
    PackedRow,
    causal_conv1d,
    gated_delta_rule,
    head_log_probs,  # noqa: E402
    ssd_scan,
)

TOL = 1e-5  # float32
# a 1-token sequence, one longer than fla's 64-token chunk, one of exactly a 16-token scan chunk
LENGTHS = [37, 1, 70, 5, 16]
CPU = torch.device("cpu")


def need(load: Callable[[], Any], package: str) -> Any:
    """``load()``, or skip (fail under NOPAD_REQUIRE_KERNELS=1) saying that ``package`` is missing."""
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 - not installed, or installed without what it needs
        message = f"{package} is not usable here ({type(exc).__name__}: {exc}); CI's kernels leg installs it"
        if interp.REQUIRE:
            pytest.fail(f"NOPAD_REQUIRE_KERNELS=1 but {message}", pytrace=False)
        pytest.skip(message)


def _rand(*shape: int, seed: int, low: float = -1.0, high: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g) * (high - low) + low).to(dtype)


def values_and_grads(fn: Callable[..., Any], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``fn``'s outputs and the gradients of ``inputs`` under a fixed weighted sum of every output."""
    given = [x.detach().clone().requires_grad_() for x in inputs]
    outputs = fn(*given)
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    loss = sum((o.float() * _rand(*o.shape, seed=99 + i)).sum() for i, o in enumerate(outputs) if o is not None)
    loss.backward()
    grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in given]
    return [o.detach() for o in outputs if o is not None] + grads


def assert_close(name: str, labels: list[str], ours: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> None:
    """Each of ``ours`` within ``tol`` (absolute and relative) of ``ref``, compared in float64 (a bf16
    result against a float32 reference); the largest difference printed (``pytest -s``)."""
    assert len(ours) == len(ref) == len(labels)
    for label, a, b in zip(labels, ours, ref):
        assert a.shape == b.shape, (name, label, a.shape, b.shape)
        a, b = a.double(), b.double()
        diff = (a - b).abs().max().item() if a.numel() else 0.0
        print(f"max |diff| {name} {label}: {diff:.2e}")
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, label=label: f"{name} {label}: {m}")


@pytest.fixture
def interpreter(monkeypatch):
    interp.install(monkeypatch)
    return monkeypatch


# ---- the state layers: nopad.modeling with its CUDA kernels let onto the CPU ---------------------------------


@pytest.fixture
def layer_kernels(interpreter):
    """nopad's state-layer kernels taken as runnable on the CPU, none loaded or probed yet, each
    real entry point counted: the calls it gets (keyword arguments)."""
    interpreter.setattr(layers, "KERNEL_DEVICES", ("cpu", "cuda"))
    interpreter.setattr(layers, "_LOADED", {})
    layers._probe.cache_clear()
    calls: dict[str, list[dict]] = {form: [] for form in layers.KERNELS}
    for form, (package, load) in list(layers.KERNELS.items()):

        def counted(form=form, load=load) -> Callable:
            real = load()

            def kernel(*args, **kwargs):
                calls[form].append(kwargs)
                return real(*args, **kwargs)

            return kernel

        interpreter.setitem(layers.KERNELS, form, (package, counted))
    yield calls
    layers._probe.cache_clear()  # verdicts under the interpreter are not this process's CUDA kernels'


def _gdn_inputs(T: int, kv_heads: int, heads: int, dk: int, dv: int) -> list[torch.Tensor]:
    return [
        _rand(T, kv_heads, dk, seed=1),
        _rand(T, kv_heads, dk, seed=2),
        _rand(T, heads, dv, seed=3),
        _rand(T, heads, seed=4, low=-1.0, high=-0.01),  # log decays
        _rand(T, heads, seed=5, low=0.05, high=1.0),  # beta
    ]


@pytest.mark.parametrize(("kv_heads", "scale"), [(2, None), (1, 0.3)])  # 1: each q/k head serves 2 value heads
def test_fla_gated_delta_rule_through_nopad_equals_the_torch_form(layer_kernels, kv_heads, scale):
    need(lambda: importlib.import_module("fla.ops.gated_delta_rule"), "flash-linear-attention")
    row = PackedRow.from_lengths(LENGTHS)
    inputs = _gdn_inputs(row.total, kv_heads, 2, 16, 8)

    def run(kernel):
        return lambda *t: gated_delta_rule(*t, row, scale=scale, use_qk_l2norm=True, kernel=kernel)

    ours = values_and_grads(run("flash-linear-attention"), inputs)
    assert layers.kernel_refusal("gated_delta_rule", CPU) is None  # fla passed nopad's probe
    served = layer_kernels["gated_delta_rule"]
    # the probe's three calls (the packed row, then a shared-prefix row's prompts and completions), then ours
    assert len(served) == 4 and torch.equal(served[-1]["cu_seqlens"], row.cu_seqlens)
    labels = ["out", "d q", "d k", "d v", "d g", "d beta"]
    assert_close("fla gated_delta_rule", labels, ours, values_and_grads(run("torch"), inputs), TOL)


def _shared_plan():
    """Four GRPO groups of 2, 4, 1 and 3 rows; prompts of 1, 70 (past fla's 64-token chunk), 9 and
    64 (exactly one chunk) tokens; completions of 0 to 66 tokens (past a chunk). Returns the plan
    (nopad.batches._prefixes) and the :class:`SharedPrefixRow` the model's layers get."""
    from nopad.batches._prefixes import join_prompts, plan_shared_prefixes
    from nopad.core._torch_internals import wrap_jagged
    from nopad.modeling._prefixes import shared_prefix_row

    def nested(rows: list[list[int]]) -> torch.Tensor:
        offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
        return wrap_jagged(torch.tensor([t for r in rows for t in r], dtype=torch.int64), offsets)

    groups = {1: [3, 1], 70: [5, 0, 2, 1], 9: [66], 64: [1, 2, 3]}
    prompts, completions = [], []
    for g, (prompt, lengths) in enumerate(groups.items()):
        for n in lengths:
            prompts.append([1 + (g + t) % 50 for t in range(prompt)])
            completions.append([2 + t % 40 for t in range(n)])
    plan = plan_shared_prefixes(*join_prompts(nested(prompts), nested(completions)))
    assert plan.groups == 4 and plan.shared
    return plan, shared_prefix_row(plan)


def test_fla_gated_delta_rule_on_a_shared_prefix_row_equals_the_torch_form_and_each_row_alone(layer_kernels):
    """Each completion continues its prompt's final state through fla (``initial_state`` per
    sequence): forward and every gradient, the prompt's included (its rows' shares summed), equal
    nopad's torch shared form and each (prompt + completion) run alone through fla."""
    need(lambda: importlib.import_module("fla.ops.gated_delta_rule"), "flash-linear-attention")
    plan, row = _shared_plan()
    alone = PackedRow.from_cu_seqlens(plan.row_offsets)  # each row alone, its prompt its own copy
    inputs = _gdn_inputs(row.total, 1, 2, 16, 8)  # 1 q/k head serving 2 value heads
    weights = _rand(plan.rows_total, seed=31)  # one per row token: a shared prompt token's output counted once per row

    def shared(kernel):
        def run(*t):
            return plan.unpack(gated_delta_rule(*t, row, use_qk_l2norm=True, kernel=kernel)) * weights[:, None, None]

        return run

    def each_row_alone(*t):
        rows = [x.index_select(0, plan.unpack_index) for x in t]
        out = gated_delta_rule(*rows, alone, use_qk_l2norm=True, kernel="flash-linear-attention")
        return out * weights[:, None, None]

    ours = values_and_grads(shared("flash-linear-attention"), inputs)
    served = layer_kernels["gated_delta_rule"][3:]  # after the probe's three calls
    assert [call["initial_state"] is not None for call in served[:2]] == [False, True]  # prompts, then completions
    assert served[0]["output_final_state"] and served[1]["initial_state"].shape == (plan.rows, 2, 16, 8)
    labels = ["out", "d q", "d k", "d v", "d g", "d beta"]
    assert_close("fla shared gated_delta_rule vs torch", labels, ours, values_and_grads(shared("torch"), inputs), TOL)
    assert_close("fla shared gated_delta_rule vs alone", labels, ours, values_and_grads(each_row_alone, inputs), TOL)


def _ssd_inputs(T: int, heads: int, head_dim: int, groups: int, state: int) -> list[torch.Tensor]:
    return [
        _rand(T, heads, head_dim, seed=11),  # x
        _rand(T, heads, seed=12, low=-3.0, high=1.0),  # dt (before dt_bias and softplus)
        _rand(heads, seed=13, low=-2.0, high=-0.5),  # A
        _rand(T, groups, state, seed=14),  # B
        _rand(T, groups, state, seed=15),  # C
        _rand(heads, seed=16),  # D
        _rand(T, heads, head_dim, seed=17),  # z
        _rand(heads, seed=18, low=-0.5, high=0.5),  # dt_bias
    ]


@pytest.mark.parametrize("groups", [1, 2])
def test_mamba_ssm_scan_through_nopad_equals_the_torch_form(layer_kernels, groups):
    need(interp.import_mamba_ssm, "mamba-ssm")
    row = PackedRow.from_lengths(LENGTHS)
    inputs = _ssd_inputs(row.total, 4, 8, groups, 8)

    def run(kernel):
        def scan(x, dt, A, B, C, D, z, dt_bias):
            return ssd_scan(
                x, dt, A, B, C, row, chunk_size=16, D=D, z=z, dt_bias=dt_bias, dt_softplus=True, kernel=kernel
            )

        return scan

    ours = values_and_grads(run("mamba-ssm"), inputs)
    assert layers.kernel_refusal("ssd_scan", CPU) is None  # mamba-ssm passed nopad's probe
    served = layer_kernels["ssd_scan"]
    assert len(served) == 2 and torch.equal(served[-1]["seq_idx"], row.seq_idx)
    labels = ["out", "d x", "d dt", "d A", "d B", "d C", "d D", "d z", "d dt_bias"]
    assert_close("mamba-ssm ssd_scan", labels, ours, values_and_grads(run("torch"), inputs), TOL)


def test_mamba_ssm_takes_no_state_per_sequence_so_a_shared_prefix_row_scans_in_torch(layer_kernels):
    """mamba-ssm's scan takes one initial state per batch row (its seq_idx zeroes the state at each
    later sequence), not one per completion: forced on a shared-prefix row it is refused by name,
    saying so, and "auto" runs nopad's torch form without calling it."""
    ssd = need(interp.import_mamba_ssm, "mamba-ssm")
    _, row = _shared_plan()
    x, dt, A, B, C, D, z, dt_bias = _ssd_inputs(row.total, 2, 4, 1, 4)
    per_completion = torch.zeros(len(row.completion_row.lengths), 2, 4, 4)
    with pytest.raises(AssertionError):  # the package itself: (batch, heads, head dim, state) only
        ssd.mamba_chunk_scan_combined(
            x[None], dt[None], A, B[None], C[None], 16, initial_states=per_completion, seq_idx=row.seq_idx
        )
    options = dict(chunk_size=16, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    with pytest.raises(ValueError, match=r"expected 'auto' or 'torch' for a shared-prefix row, got 'mamba-ssm' \("):
        ssd_scan(x, dt, A, B, C, row, kernel="mamba-ssm", **options)
    out = ssd_scan(x, dt, A, B, C, row, **options)
    assert not layer_kernels["ssd_scan"]  # neither probed nor called
    assert_close("shared ssd_scan auto", ["out"], [out], [ssd_scan(x, dt, A, B, C, row, kernel="torch", **options)], 0)


@pytest.mark.parametrize("activation", ["silu", None])
def test_fla_triton_causal_conv1d_equals_nopads_conv(interpreter, activation):
    conv = need(lambda: importlib.import_module("fla.modules.causal_conv1d").causal_conv1d, "flash-linear-attention")
    row = PackedRow.from_lengths(LENGTHS)
    inputs = [_rand(6, row.total, seed=21), _rand(6, 4, seed=22), _rand(6, seed=23)]  # (C, T), (C, K), (C,)

    def fla(x, weight, bias):  # fla takes (batch 1, T, C) and the boundaries
        y, _ = conv(x.t()[None], weight, bias, activation=activation, backend="triton", cu_seqlens=row.cu_seqlens)
        return y[0].t()

    def nopad(x, weight, bias):
        return causal_conv1d(x, weight, bias, row, activation=activation, kernel="torch")

    ours, ref = values_and_grads(fla, inputs), values_and_grads(nopad, inputs)
    assert_close(f"fla causal_conv1d {activation}", ["out", "d x", "d weight", "d bias"], ours, ref, TOL)


def test_causal_conv1d_has_no_kernel_that_runs_here(layer_kernels):
    """causal-conv1d is CUDA C++ only: nopad says why it cannot serve, and its torch form runs."""
    why = layers.kernel_refusal("causal_conv1d", CPU)
    if importlib.util.find_spec("causal_conv1d") is None:
        assert why == "causal-conv1d is not installed (or cannot load here)"
    else:
        assert why is not None  # installed with a CUDA build that cannot run on a CPU
    assert not layer_kernels["causal_conv1d"]


# ---- the output head: Cut Cross-Entropy through nopad's head ------------------------------------------------


def _head_case(T: int, H: int, V: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[0], labels[-1] = 0, V - 1
    return hidden, weight, labels


@pytest.fixture
def cut_cross_entropy(interpreter):
    """Cut Cross-Entropy taken as runnable on the CPU, not yet loaded nor probed; the calls it gets."""
    need(lambda: importlib.import_module("cut_cross_entropy"), "cut-cross-entropy")
    calls: list[dict] = []
    load = head._LOADERS["cut_cross_entropy"]

    def counted():
        real = load()

        def linear_cross_entropy(*args, **kwargs):
            calls.append({"dtype": args[0].dtype, **{k: v for k, v in kwargs.items() if k != "bias"}})
            return real(*args, **kwargs)

        return linear_cross_entropy

    interpreter.setitem(head._LOADERS, "cut_cross_entropy", counted)
    interpreter.setattr(head, "_on_cuda", lambda device: True)
    head._kernel_function.cache_clear()
    head._probe_failure.cache_clear()
    yield calls
    head._kernel_function.cache_clear()
    head._probe_failure.cache_clear()


def test_cut_cross_entropy_passes_nopads_probe(cut_cross_entropy):
    assert head._probe_failure("cut_cross_entropy", "cpu") is None


@pytest.mark.parametrize("temperature", [1.0, 0.5, "per_token"])
def test_cut_cross_entropy_through_nopads_head_in_bf16_equals_the_tiles(cut_cross_entropy, temperature):
    """Against the tiles on float32 copies of the same bf16 values: the tiles in bf16 round the logits
    to bf16 (as the model's lm_head writes them), the kernel does not."""
    hidden, weight, labels = _head_case(sum(LENGTHS), 32, 200, torch.bfloat16)
    if temperature == "per_token":  # powers of two: the factor folded into hidden stays exact in bf16
        temperature = 2.0 ** torch.randint(-1, 2, (hidden.shape[0],), generator=torch.Generator().manual_seed(3))

    def run(kernel):
        return lambda h, w: head_log_probs(h, w, labels, temperature, kernel=kernel)[0]

    assert head._probe_failure("cut_cross_entropy", "cpu") is None
    probed = len(cut_cross_entropy)
    ours = values_and_grads(run("auto"), [hidden, weight])
    assert len(cut_cross_entropy) == probed + 1  # auto chose it
    assert cut_cross_entropy[-1]["impl"] == "cce" and cut_cross_entropy[-1]["filter_eps"] is None
    assert ours[1].dtype == ours[2].dtype == torch.bfloat16
    ref = values_and_grads(run("tiles"), [hidden.float(), weight.float()])
    # its label logit sums bf16 products (indexed_dot.py: (e * c).to(float32)), and its backward
    # multiplies bf16 logit gradients: bf16 roundings apart
    name = f"cut_cross_entropy bf16 t={'per-token' if isinstance(temperature, torch.Tensor) else temperature}"
    assert_close(name, ["log-probs", "d hidden", "d weight"], ours, ref, 2e-2)


def test_cut_cross_entropy_serves_a_float32_forward_without_gradient(cut_cross_entropy):
    hidden, weight, labels = _head_case(sum(LENGTHS), 32, 200)
    assert head._probe_failure("cut_cross_entropy", "cpu") is None
    probed = len(cut_cross_entropy)
    with torch.no_grad():
        ours = head_log_probs(hidden, weight, labels, 0.7)[0]
    assert len(cut_cross_entropy) == probed + 1 and cut_cross_entropy[-1]["dtype"] == torch.float32
    ref = head_log_probs(hidden, weight, labels, 0.7, kernel="tiles")[0]
    assert_close("cut_cross_entropy fp32", ["log-probs (no grad)"], [ours], [ref], TOL)


def test_a_float32_head_that_needs_gradients_takes_the_tiles(cut_cross_entropy):
    """Cut Cross-Entropy's backward takes bf16 or fp16 only (an assert in the kernel)."""
    hidden, weight, labels = _head_case(9, 32, 50)
    hidden.requires_grad_()
    calls = len(cut_cross_entropy)
    lp, _ = head_log_probs(hidden, weight, labels, 0.7)
    lp.sum().backward()
    assert len(cut_cross_entropy) == calls == 0  # refused before any probe
    with pytest.raises(ValueError, match="backward takes bfloat16 or float16 only, not float32"):
        head_log_probs(hidden, weight, labels, 0.7, kernel="cut_cross_entropy")


# ---- Liger-Kernel -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("bias", "softcap"), [(False, None), (True, 3.0)])
def test_liger_fused_linear_cross_entropy_equals_nopads_head(interpreter, bias, softcap):
    ops = need(lambda: importlib.import_module("liger_kernel.ops.fused_linear_cross_entropy"), "liger-kernel")
    hidden, weight, labels = _head_case(sum(LENGTHS), 32, 200)
    inputs = [hidden, weight] + ([_rand(200, seed=31)] if bias else [])

    def liger(h, w, b=None):
        loss = ops.LigerFusedLinearCrossEntropyFunction.apply(h, w, labels, b, None, -100, 0.0, 0.0, "none", softcap)
        return -loss[0]

    def nopad(h, w, b=None):
        return head_log_probs(h, w, labels, bias=b, softcap=softcap, kernel="tiles")[0]

    labels_ = ["log-probs", "d hidden", "d weight"] + (["d bias"] if bias else [])
    name = f"liger fused_linear_cross_entropy bias={bias} softcap={softcap}"
    assert_close(name, labels_, values_and_grads(liger, inputs), values_and_grads(nopad, inputs), TOL)


def test_verls_liger_backend_through_nopad_equals_nopads_head(interpreter):
    """nopad's one route to Liger: verl's FusedLinearForPPO(impl_backend="liger") under install(),
    called with what verl binds, Liger's scaled cross-entropy (its torch form off Hopper)."""
    ops = need(lambda: importlib.import_module("liger_kernel.ops"), "liger-kernel")
    functional = types.ModuleType(vh.TORCH_FUNCTIONAL_MODULE)
    functional._LIGER_FUSED_LINEAR_SCALED_CROSS_ENTROPY = ops.LigerFusedLinearScaledCrossEntropyFunction  # type: ignore[attr-defined]
    interpreter.setitem(sys.modules, vh.TORCH_FUNCTIONAL_MODULE, functional)
    hidden, weight, labels = _head_case(sum(LENGTHS), 32, 200)

    def run(backend):
        return lambda h, w: vh.FusedLinearForPPO(impl_backend=backend)(h, w, labels, 0.7)

    labels_ = ["log-probs", "entropy", "d hidden", "d weight"]
    ours, ref = values_and_grads(run("liger"), [hidden, weight]), values_and_grads(run("torch"), [hidden, weight])
    assert_close("liger scaled CE via FusedLinearForPPO", labels_, ours, ref, TOL)


# ---- verl's Triton head ---------------------------------------------------------------------------------------


@pytest.fixture
def verl_kernel(interpreter):
    module = need(interp.import_verl_kernel, "verl (its wheel, for verl.utils.kernel)")
    kernels = importlib.import_module("verl.utils.kernel.kernels")
    interp.host_functions_read_cuda(interpreter, kernels, "efficient_entropy_forward", "efficient_entropy_backward")
    vh._verl_probe.cache_clear()
    yield module.linear_cross_entropy
    vh.use_kernel("auto")
    vh._verl_probe.cache_clear()


def test_verls_triton_head_passes_nopads_probe(verl_kernel):
    """It failed at the probe's old temperature of 0.5 (bf16 gradients of 8 held to 2e-2): "auto" never took it."""
    assert vh._verl_probe(verl_kernel, "cpu") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verls_triton_head_through_nopads_route_equals_nopads_head(verl_kernel, dtype):
    """Forced through the route (use_kernel("verl"): "auto" takes verl's kernel on CUDA only), against
    the tiles on float32 copies of the same values (bf16 tiles round the logits to bf16; verl does not)."""
    hidden, weight, labels = _head_case(sum(LENGTHS), 128, 300, dtype)  # verl asks for a hidden size of 128 k

    calls: list[str] = []

    def original(*args):
        calls.append(vh._choice["kernel"])
        return verl_kernel(*args)

    def run(kernel):
        def call(h, w):
            vh.use_kernel(kernel)
            return vh.linear_cross_entropy(h, w, labels, 0.7, "none", None, original=original)

        return call

    ours = values_and_grads(run("verl"), [hidden, weight])
    assert calls == ["verl"] and ours[2].dtype == ours[3].dtype == dtype
    ref = values_and_grads(run("nopad"), [hidden.float(), weight.float()])
    assert calls == ["verl"]  # nopad's tiles served the reference
    name = f"verl linear_cross_entropy {str(dtype).split('.')[-1]}"
    assert_close(name, ["log-probs", "entropy"], ours[:2], ref[:2], TOL)
    grads_tol = TOL if dtype == torch.float32 else 2e-2  # bf16 gradients: bf16 roundings apart
    assert_close(name, ["d hidden", "d weight"], ours[2:], ref[2:], grads_tol)
