"""What nopad knows of a model, a config or a tensor lives on that object (``nopad.core._memo``) and dies
with it: models and configs built, freed and built again in a loop (CPython hands a freed object's
address to the next one of its size) each get their verdicts worked out anew, and no module-level
container grows. Nothing keeps an ``id()`` past the call that took it.
"""

from __future__ import annotations

import ast
import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import nopad  # noqa: E402
from nopad.core import IndexPlan  # noqa: E402
from nopad.modeling import use_packed_attention  # noqa: E402
from nopad.synthetic import tiny_causal_lm  # noqa: E402

LOOPS = 20
VOCAB = 97
PACKED = IndexPlan.from_lengths(torch.tensor([5, 3, 4]))  # three sequences in one row


def _model(arch: str, **kwargs) -> torch.nn.Module:
    return tiny_causal_lm(arch, vocab=VOCAB, hidden=32, layers=4, **kwargs)


def _packed_forward(model: torch.nn.Module) -> None:
    """One packed row through ``model`` (a padding-free collator's batch: restarting position ids)."""
    ids = torch.randint(1, VOCAB, (1, PACKED.total), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, position_ids=PACKED.position_ids[None].clone(), use_cache=False)


def _attention_layers(model: torch.nn.Module) -> int:
    return sum(type(m).__name__.endswith("Attention") and hasattr(m, "config") for m in model.modules())


@pytest.fixture
def checks(monkeypatch):
    """Counts the unrouted-model checks worked out (not recalled). Reaches into nopad.modeling._attention: the
    check is private, and counting it is how a verdict inherited from a freed object would show."""
    # private: the verdicts and routes kept in the memo are counted as they are recomputed
    import nopad.modeling._attention

    counted = []
    check = nopad.modeling._attention._state_layer_kinds
    monkeypatch.setattr(
        nopad.modeling._attention, "_state_layer_kinds", lambda config: counted.append(config) or check(config)
    )
    return counted


def test_each_new_model_and_config_is_checked_anew_though_a_freed_one_passed_at_its_address(checks):
    reused = 0
    seen: set[int] = set()  # addresses of freed configs and layers (the test's own, for the report)
    for _ in range(LOOPS):
        plain = _model("llama", attn_implementation="nopad_varlen")  # no state layers: accepted unrouted
        checks.clear()
        _packed_forward(plain)
        assert len(checks) == _attention_layers(plain) > 0  # every layer worked out its verdict ...
        checks.clear()
        _packed_forward(plain)
        assert checks == []  # ... once: the next forward recalls it from the layer
        seen.update(id(m) for m in plain.modules() if hasattr(m, "config"))
        seen.add(id(plain.config))
        del plain
        gc.collect()

        hybrid = _model("qwen3_5", attn_implementation="nopad_varlen")  # linear-attention layers: refused unrouted
        reused += any(id(m) in seen for m in hybrid.modules() if hasattr(m, "config")) or id(hybrid.config) in seen
        checks.clear()
        with pytest.raises(ValueError, match=r"use_packed_attention\(model\) before its first packed forward"):
            _packed_forward(hybrid)
        assert len(checks) == 1
        del hybrid
        gc.collect()
    print(f"a hybrid's config or layer took a freed one's address in {reused} of {LOOPS} loops")


def test_a_routed_model_freed_leaves_no_route_to_the_next_model_at_its_address(checks):
    from nopad.modeling._routing import route_of

    for _ in range(LOOPS):
        routed = use_packed_attention(_model("llama", attn_implementation="nopad_varlen"))
        checks.clear()
        _packed_forward(routed)
        assert route_of(routed) is not None and checks == []  # a routed model's layers need no check
        del routed  # never unrouted: freed with its route
        gc.collect()
        hybrid = _model("qwen3_5", attn_implementation="nopad_varlen")
        assert route_of(hybrid) is None
        with pytest.raises(ValueError, match=r"use_packed_attention\(model\) before its first packed forward"):
            _packed_forward(hybrid)
        del hybrid
        gc.collect()


def test_route_is_kept_on_the_model_and_forgotten_by_remove():
    from nopad.modeling._routing import route, route_of

    model = _model("qwen3_5", attn_implementation="nopad_varlen")
    assert route_of(model) is None
    first = route(model)
    assert route(model) is first and route_of(model) is first  # idempotent
    _packed_forward(model)
    first.remove()
    assert route_of(model) is None
    with pytest.raises(ValueError, match=r"use_packed_attention\(model\) before its first packed forward"):
        _packed_forward(model)  # unrouted again: its layers are no longer taken for routed ones
    again = route(model)
    assert again is not first and route_of(model) is again
    _packed_forward(model)
    again.remove()


def _containers() -> dict[str, int]:
    """The size of every module-level container and function cache of nopad's loaded modules."""
    sizes = {}
    for name, module in list(sys.modules.items()):
        if name != "nopad" and not name.startswith("nopad."):
            continue
        for attr, value in vars(module).items():
            if isinstance(value, (dict, set, list, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)):
                sizes[f"{name}.{attr}"] = len(value)
            elif isinstance(value, weakref.WeakSet):
                sizes[f"{name}.{attr}"] = len(value)
            elif callable(getattr(value, "cache_info", None)):
                sizes[f"{name}.{attr}()"] = value.cache_info().currsize
    return sizes


def test_no_module_level_container_grows_as_models_come_and_go():
    def once() -> None:
        for arch in ("llama", "qwen3_5"):
            model = use_packed_attention(_model(arch, attn_implementation="nopad_varlen"))
            _packed_forward(model)
            del model
            unrouted = _model("llama", attn_implementation="nopad_varlen")
            _packed_forward(unrouted)
            del unrouted
            gc.collect()

    once()  # what is kept per class, per kernel, per device is learnt here
    before = _containers()
    for _ in range(LOOPS):
        once()
    grown = {k: (before.get(k, 0), n) for k, n in _containers().items() if n > before.get(k, 0)}
    assert not grown, f"module-level containers grew as models came and went: {grown}"


def test_a_plan_is_known_as_its_own_masks_while_the_mask_is_unedited():
    from nopad import plan_left_right

    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    plan = plan_left_right(mask, mask[:, 2:])
    assert plan.made_from(mask) and plan.to("meta").made_from(mask)  # its copies too
    assert not plan.made_from(mask.clone())
    mask[0, 0] = 0  # edited in place (same values): checked again, never assumed
    assert not plan.made_from(mask)


# ---- the source: no id() kept in a module-level container, no module-level weak dictionaries ----


SOURCES = sorted(Path(nopad.__file__).parent.rglob("*.py"))
GONE = {
    "nopad/modeling/_attention.py": ("_CHECKED_CONFIGS",),
    "nopad/modeling/_routing.py": ("ROUTED_CONFIGS", "_ROUTES"),
    "nopad/engines/_head.py": ("_REFUSED", "_CHECKED"),
    "nopad/batches/_padding.py": ("_source_mask",),
}


def _takes_id(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "id" for n in ast.walk(node))


def test_the_old_homes_of_facts_are_gone():
    root = Path(nopad.__file__).parent.parent
    for path, names in GONE.items():
        text = (root / path).read_text()
        for name in names:
            assert name not in text, f"{path} still holds {name}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(Path(nopad.__file__).parent)))
def test_no_id_is_kept_in_a_module_level_container(path):
    tree = ast.parse(path.read_text())
    module_level = set()
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            if isinstance(target, ast.Name):
                module_level.add(target.id)
                value = node.value
                called = value.func if isinstance(value, ast.Call) else None
                kind = getattr(called, "attr", getattr(called, "id", ""))
                assert kind not in {"WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}, (
                    f"{path}: module-level {target.id} = {kind}(): keep facts on the object (nopad.core._memo)"
                )
    for node in ast.walk(tree):
        held = None
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and _takes_id(node.slice):
            held = node.value.id
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
        ):
            if any(_takes_id(arg) for arg in node.args):
                held = node.func.value.id
        elif isinstance(node, ast.Compare) and _takes_id(node.left):
            held = next((c.id for c in node.comparators if isinstance(c, ast.Name)), None)
        assert held not in module_level, f"{path}:{node.lineno}: id() kept in module-level {held}"
