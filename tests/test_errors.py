"""One errors module: every ValueError nopad raises is built by nopad.core._errors, so messages read alike."""

import ast
from pathlib import Path

import pytest

# private: the one error format itself
from nopad.core._errors import in_file, input_error

ROOT = Path(__file__).resolve().parents[1]


def test_no_hand_formatted_value_error_outside_the_errors_module():
    bad = []
    for path in sorted((ROOT / "nopad").rglob("*.py")):
        if path.name == "_errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ValueError":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"build these with nopad.core._errors.input_error: {bad}"


@pytest.mark.parametrize(
    ("row", "want"), [(None, "lengths: expected >= 0, got -1"), (3, "lengths row 3: expected >= 0, got -1")]
)
def test_messages_name_field_row_expected_and_actual(row, want):
    assert str(input_error("lengths", row, ">= 0", "-1")) == want
    assert str(in_file("a.parquet", input_error("lengths", row, ">= 0", "-1"))) == f"a.parquet: {want}"
