"""`nopad env`: the versions, the kernels usable on each device, and every causal-LM family of the
installed transformers served packed, refused or not built, as nopad's guard finds them.

The families are checked against the guard run here directly (the public
``use_packed_attention`` on each tiny model, a ValueError its refusal). The families part of its
output is shown in docs/integrations/layers.md, written here: the test fails when the page differs
(regenerate with ``NOPAD_WRITE_DOCS=1 python -m pytest tests/test_env.py``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

# private: the route each family takes, which `nopad env` reports
from nopad._apps import env  # noqa: E402
from nopad._apps.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "integrations" / "layers.md"
RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
# every package a bug report needs, by the name the report shows
PACKAGES = (
    "transformers",
    "kernels",
    "tensordict",
    "numpy",
    "verl",
    "flash-attn",
    "flash-linear-attention",
    "mamba-ssm",
    "causal-conv1d",
    "liger-kernel",
    "cut-cross-entropy",
    "triton",
    "megatron-core",
)
SECONDS = 120  # the whole survey on a loaded 2-core runner takes 10 to 20 s


def _nopad_env(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "nopad", "env", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=RUN_ENV,
        timeout=300,
    )
    return done, time.perf_counter() - start


@pytest.fixture(scope="module")
def report():
    done, seconds = _nopad_env("--json", "-q")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not done.stderr.strip(), done.stderr[-3000:]  # -q: nothing on stderr (no progress, no warnings)
    assert seconds < SECONDS, f"nopad env took {seconds:.0f} s"
    return json.loads(done.stdout)


def _guard(model_type: str) -> tuple[str, str | None]:
    """("served", None), ("refused", the guard's message) or ("not built", why): the public guard itself."""
    from nopad._apps.families import tiny_model
    from nopad.modeling import use_packed_attention
    from nopad.modeling._routing import route_of

    model = tiny_model(model_type)
    if isinstance(model, str):
        return "not built", model
    try:
        use_packed_attention(model)
    except ValueError as exc:
        return "refused", str(exc)
    route_of(model).remove()  # forget it: the process's record of routed configs stays as it was
    return "served", None


def _listed(message: str) -> list[str]:
    """The refused modules a guard's ValueError lists: "Class (where) why", each."""
    found = re.search(r", got \w+, whose (.*)\. Run it padded", message, re.S)
    assert found, message
    return [part.replace(" (the model) ", " ") for part in found.group(1).split("; ")]


def test_env_names_every_family_as_the_guard_serves_refuses_or_cannot_build_it(report):
    from nopad._apps.families import causal_lm_types

    families = report["families"]
    assert families["transformers"] == importlib.metadata.version("transformers")
    assert not families["errors"], families["errors"]  # the guard answered for every model
    surveyed = families["served"] + list(families["refused"]) + list(families["not_built"])
    assert sorted(surveyed) == causal_lm_types()  # each type once, every type of the mapping
    torch.set_num_threads(1)
    for model_type in causal_lm_types():
        verdict, why = _guard(model_type)
        if verdict == "served":
            assert model_type in families["served"], f"{model_type}: served by the guard, not listed as served"
        elif verdict == "not built":
            assert families["not_built"].get(model_type) == why, model_type
        else:
            shown = families["refused"].get(model_type)
            assert shown is not None, f"{model_type}: refused by the guard ({why}), not listed as refused"
            listed = _listed(why)
            first, _, others = shown.partition(" (also refused: ")
            assert first == listed[0], (model_type, first, listed)  # the first refused module and why
            classes = {part.split(" ")[0] for part in listed[1:]} - {listed[0].split(" ")[0]}
            assert set(filter(None, others.rstrip(")").split(", "))) == classes, (model_type, shown, listed)


def test_env_lists_every_package_and_torch_s_build(report):
    versions = report["versions"]
    for name in PACKAGES:
        assert name in versions, name
    assert versions["torch"] == torch.__version__
    assert versions["torch_cuda"] == torch.version.cuda
    for name in ("transformers", "tensordict", "numpy"):
        assert versions[name] == importlib.metadata.version(name)
    for name in ("verl", "flash-attn", "mamba-ssm", "causal-conv1d", "cut-cross-entropy"):
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        assert versions[name] == installed, name
    text = env.format_report(report)
    block = text.split("\n\n")[1].splitlines()  # the versions block
    assert block[0] == "versions:"
    shown = {line.split()[0]: " ".join(line.split()[1:]) for line in block[1:]}
    assert set(shown) == {"python", "platform", "torch", *PACKAGES}
    for name in PACKAGES:
        assert shown[name] == (versions[name] or "not installed"), name
    assert shown["torch"].startswith(torch.__version__ + " (")


def test_env_lists_the_kernels_of_each_device_this_machine_has(report):
    from nopad.modeling import KERNELS, available_kernels

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    assert [d for d in report["devices"] if d in ("cpu", "cuda")] == devices
    for device in report["devices"]:
        attention = report["attention_kernels"][device]
        assert attention["usable"] == available_kernels(device, torch.bfloat16)
        assert set(attention["usable"]) | set(attention["unusable"]) == set(KERNELS)
        states = report["state_layer_kernels"][device]
        assert set(states["usable"]) | set(states["unusable"]) == {"causal_conv1d", "gated_delta_rule", "ssd_scan"}
        assert "tiles" in report["head_kernels"][device]["usable"]
    assert "sdpa" in report["attention_kernels"]["cpu"]["usable"]
    assert "causal_conv1d" in report["state_layer_kernels"]["cpu"]["unusable"]  # the kernels are CUDA's


def test_env_surveys_only_the_families_asked_and_refuses_an_unknown_one_before_any_work(capsys, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # nopad env sets them: as they were after the test
        monkeypatch.setenv(name, "1")
    assert main(["env", "--families", "llama", "rwkv", "--dtype", "float32", "-q"]) == 0
    out = capsys.readouterr().out
    assert "attention kernels (nopad_varlen at float32" in out
    assert "served packed (1):\n  llama\nrefused (1):\n  rwkv: RwkvSelfAttention (rwkv.blocks.0.attention) " in out
    assert "could not build (0):" in out
    assert main(["env", "--families", "llama", "no_such_model", "-q"]) == 2
    captured = capsys.readouterr()
    assert not captured.out
    assert "nopad env: error: --families: expected model types of transformers" in captured.err
    assert "got 'no_such_model'" in captured.err


def test_env_without_transformers_lists_the_versions_and_kernels_and_says_why_no_family(capsys, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    found = env.versions()
    monkeypatch.setattr(env, "versions", lambda: {**found, "transformers": None})
    assert main(["env", "-q"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  transformers +not installed$", out, re.M), out
    assert "attention kernels (nopad_varlen at bfloat16" in out and "\n  cpu: sdpa\n" in out
    assert (
        out.rstrip().split("\n")[-1]
        == "model families: none surveyed, transformers is not installed (nopad's hf extra installs it)"
    )


def test_env_shows_its_progress_on_a_terminal():
    from tests.test_cli_help_progress import _run_on_a_terminal

    chunks, out, code = _run_on_a_terminal(["env", "--families", "llama", "bamba"])
    assert code == 0, out[-2000:]
    shown = b"".join(data for _, _, data in chunks).decode(errors="replace")
    assert "nopad env" in shown and "bamba" in shown, shown[-1500:]
    assert out.startswith(b"nopad ") and b"\r" not in out  # the report on stdout, the bar on stderr


# ---- the docs ---------------------------------------------------------------------------------------
HEAD = "model families of transformers"


def test_the_families_shown_in_the_docs_are_what_nopad_env_prints(report):
    """docs/integrations/layers.md shows ``nopad env``'s families part as it prints it (tests/test_docs.py
    also runs the command and compares every line shown)."""
    text = DOCS.read_text()
    start = text.index("$ nopad env -q\n")
    end = text.index("\n```", start)
    block = text[start:end]
    shown = block[block.index(HEAD) :] if HEAD in block else "@@FAMILIES@@"
    printed = env.format_report(report)
    fresh = printed[printed.index(HEAD) :]
    page_version = re.match(rf"{HEAD} (\S+) ", shown)
    writing = os.environ.get("NOPAD_WRITE_DOCS")
    if page_version and page_version.group(1) != report["families"]["transformers"] and not writing:
        pytest.skip(f"the page shows transformers {page_version.group(1)}'s families (this is another release)")
    if writing and shown != fresh:
        DOCS.write_text(text[:start] + block.replace(shown, fresh) + text[end:])
        shown = fresh
    assert shown == fresh, "docs/integrations/layers.md's nopad env output is stale: NOPAD_WRITE_DOCS=1 regenerates it"
