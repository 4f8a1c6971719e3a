"""Old import paths and names keep working for one release, each with a DeprecationWarning."""

import importlib
import sys

import pytest

import nopad
from nopad.engines import fsdp, leak
from nopad.parallel import ulysses


@pytest.mark.parametrize(("old", "new"), [("nopad.ulysses", ulysses), ("nopad.leak", leak)])
def test_moved_modules_import_with_a_warning(old, new):
    with pytest.warns(DeprecationWarning, match=new.__name__):
        sys.modules.pop(old, None)
        module = importlib.import_module(old)
    assert module is new


def test_moved_attributes_resolve_with_a_warning():
    with pytest.warns(DeprecationWarning, match="nopad.engines.leak.check_isolation"):
        assert fsdp.check_isolation is leak.check_isolation
    with pytest.raises(AttributeError):
        fsdp.no_such_name  # noqa: B018


def test_parallel_package_reexports_cp():
    from nopad.parallel import cp, cp_alignment

    assert cp_alignment is cp.cp_alignment
    assert nopad.check_isolation is leak.check_isolation


def test_renamed_thd_plan_names_warn_and_agree():
    import torch

    from nopad.parallel.thd import build_thd_plan

    plan = build_thd_plan(torch.tensor([3, 5]), cp_size=2)
    for old, new in (
        ("source_offsets", "source_starts"),
        ("total_padded", "padded_total"),
        ("max_seqlen", "padded_max_seqlen"),
        ("align", "alignment"),
    ):
        with pytest.warns(DeprecationWarning, match=new):
            value = getattr(plan, old)
        assert value is getattr(plan, new) or value == getattr(plan, new)
    with pytest.warns(DeprecationWarning, match="source_starts"):
        old = build_thd_plan(torch.tensor([3, 5]), source_offsets=torch.tensor([0, 3]))
    assert torch.equal(old.source_starts, torch.tensor([0, 3]))
    with pytest.raises(TypeError):
        build_thd_plan(torch.tensor([3]), source_offsets=torch.tensor([0]), source_starts=torch.tensor([0]))


def test_renamed_keywords_warn_and_still_work():
    import torch

    from nopad.bench import bench_thd
    from nopad.packing import pack_online

    ids = torch.nested.nested_tensor_from_jagged(torch.arange(1, 8), torch.tensor([0, 3, 7]))
    with pytest.warns(DeprecationWarning, match="pack_length"):
        old, _ = pack_online(ids, token_budget=8)
    new, _ = pack_online(ids, 8)
    assert torch.equal(old["input_ids"], new["input_ids"])
    with pytest.warns(DeprecationWarning, match="repeats"):
        assert len(bench_thd((2,), max_len=8, repeat=1)) == 1


def test_thd_alignment_is_cp_alignment_with_a_warning():
    import nopad.packing
    from nopad.parallel.cp import cp_alignment

    with pytest.warns(DeprecationWarning, match="cp_alignment"):
        assert nopad.packing.thd_alignment is cp_alignment
