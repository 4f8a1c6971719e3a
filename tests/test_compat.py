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
