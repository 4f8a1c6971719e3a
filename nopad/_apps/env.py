"""`nopad env`: what nopad serves on this stack, the first thing a bug report pastes.

Three parts, on stdout (``--json``: one JSON object):

- the versions of python, the platform, torch (with its CUDA or ROCm build) and of every package
  nopad works with, read from the installed distributions' metadata (nothing is imported for it;
  "not installed" where one is absent);
- the kernels usable on each device this machine has (the CPU, and CUDA where torch sees it): the
  attention kernels of ``nopad_varlen``, the state layers' kernels and the output head's, each
  unusable one with why (nopad's own torch forms run wherever a kernel does not);
- for the installed transformers, which causal-LM model families nopad serves packed, which it
  refuses and why, and which could not be built here: each family built tiny from its config class's
  defaults (random weights, nothing downloaded: the Hub is kept out with ``HF_HUB_OFFLINE=1``) and put
  through nopad's guard as :func:`nopad.modeling.use_packed_attention` runs it. No forward runs: a
  served family passes the guard; what is refused at a first forward (a per-score tensor the kernel
  cannot take) is not seen here. Every type of transformers' causal-LM mapping is surveyed (tens of
  milliseconds each), or the ``--families`` given.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import nopad
from nopad._apps.progress import QUIET, Progress, add_quiet_argument
from nopad.core._errors import input_error

# (the name shown, the distributions that install it: the first one installed gives its version)
PACKAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("transformers", ("transformers",)),
    ("kernels", ("kernels",)),
    ("tensordict", ("tensordict",)),
    ("numpy", ("numpy",)),
    ("verl", ("verl",)),
    ("flash-attn", ("flash-attn",)),
    ("flash-linear-attention", ("flash-linear-attention", "fla-core")),
    ("mamba-ssm", ("mamba-ssm",)),
    ("causal-conv1d", ("causal-conv1d",)),
    ("liger-kernel", ("liger-kernel", "liger-kernel-nightly")),
    ("cut-cross-entropy", ("cut-cross-entropy",)),
    ("triton", ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")),
    ("megatron-core", ("megatron-core",)),
)
NOT_INSTALLED = "not installed"
DTYPES = ("bfloat16", "float16", "float32")
WIDTH = 100  # the served list is wrapped at this width


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--families",
        nargs="+",
        metavar="TYPE",
        default=None,
        help="survey only these model types (transformers' model_type names, e.g. qwen3_5 bamba) "
        "(default: every causal-LM type of the installed transformers)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="the dtype the attention kernels are listed for (the flash kernels take half precision only)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the text report")
    add_quiet_argument(parser)


# ---- versions ----------------------------------------------------------------------------------


def distribution_version(names: Iterable[str]) -> str | None:
    """The version of the first of ``names`` that is installed (as its name with the version, when it is
    not the first name), or None."""
    names = list(names)
    for name in names:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if name == names[0] else f"{version} ({name})"
    return None


def versions() -> dict[str, str | None]:
    """python, platform, torch and its GPU build, then every package of :data:`PACKAGES` (None: not installed)."""
    import torch

    found: dict[str, str | None] = {
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": getattr(torch.version, "cuda", None),
        "torch_rocm": getattr(torch.version, "hip", None),
    }
    for name, distributions in PACKAGES:
        found[name] = distribution_version(distributions)
    return found


def torch_build(found: dict[str, str | None]) -> str:
    if found["torch_cuda"]:
        return f"CUDA {found['torch_cuda']} build"
    if found["torch_rocm"]:
        return f"ROCm {found['torch_rocm']} build"
    return "CPU-only build"


# ---- kernels ------------------------------------------------------------------------------------


def devices() -> dict[str, str]:
    """The devices this machine has that torch can use: {type: what it is}."""
    import torch

    threads = torch.get_num_threads()
    cores = f"{os.cpu_count()} logical cores, " if os.cpu_count() else ""
    found = {"cpu": f"{platform.machine() or 'cpu'}, {cores}torch uses {threads} thread{'s' * (threads != 1)}"}
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        found["cuda"] = f"{count} x {', '.join(names)}"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        found["xpu"] = f"{xpu.device_count()} device(s)"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found["mps"] = "Apple GPU"
    return found


@dataclass
class Kernels:
    """The kernels of one kind on one device: the usable ones in the order nopad tries them, the others with why."""

    usable: list[str] = field(default_factory=list)
    unusable: dict[str, str] = field(default_factory=dict)


def attention_kernels(device: str, dtype_name: str) -> Kernels:
    import torch

    from nopad.modeling._attention import available_kernels, unavailable_kernels

    dtype = getattr(torch, dtype_name)
    return Kernels(available_kernels(device, dtype), unavailable_kernels(device, dtype))


def _refused(device: str, forms: Iterable[str], refusal: Callable[[str, Any], str | None]) -> Kernels:
    """The ``forms`` that run on ``device`` and why each other one does not (``refusal``: None where it runs)."""
    import torch

    found = Kernels()
    for form in forms:
        why = refusal(form, torch.device(device))
        if why is None:
            found.usable.append(form)
        else:
            found.unusable[form] = why
    return found


def state_layer_kernels(device: str) -> Kernels:
    from nopad.modeling._layers import KERNELS, kernel_refusal

    return _refused(device, KERNELS, kernel_refusal)


def head_kernels(device: str) -> Kernels:
    from nopad.modeling._logprobs import HEAD_KERNELS, head_kernel_refusal

    return _refused(device, HEAD_KERNELS, head_kernel_refusal)


# ---- model families -----------------------------------------------------------------------------


@dataclass
class Families:
    """The guard's verdict on every model type surveyed: served packed, refused (why), not built (why),
    and errors (the guard itself failed on the model: a bug in nopad, to report)."""

    transformers: str
    served: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    not_built: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def refusal(model: Any) -> str | None:
    """Why nopad's guard refuses ``model`` on one line, or None when it serves it.

    The guard's survey names each refused module: the first is the reason (its class, where it is,
    why), the classes of the others follow it. A model it passes is then switched as
    :func:`nopad.modeling.use_packed_attention` switches it, inside
    :func:`nopad.modeling.packed_attention` (the model is as it was afterwards), whose ValueError is
    the reason if it refuses.
    """
    from nopad.modeling._attention import packed_attention
    from nopad.modeling._routing import survey

    found = survey(model).refused
    if found:
        name, cls, why = found[0]
        first = f"{cls} ({name}) {why}" if name else f"{cls} {why}"
        others = list(dict.fromkeys(c for _, c, _ in found[1:] if c != cls))
        return first + (f" (also refused: {', '.join(others)})" if others else "")
    try:
        with packed_attention(model):
            pass
    except ValueError as exc:
        return " ".join(str(exc).split())
    return None


def family_types(wanted: list[str] | None = None) -> list[str]:
    """``wanted`` (checked: each a type of transformers' causal-LM mapping), or every such type, sorted."""
    import transformers

    from nopad._apps.families import causal_lm_types

    every = causal_lm_types()
    if wanted is None:
        return every
    unknown = [t for t in wanted if t not in every]
    if unknown:
        raise input_error(
            "--families",
            None,
            f"model types of transformers {transformers.__version__}'s causal-LM mapping "
            f"(`nopad env` lists them all; e.g. {', '.join(every[:3])})",
            ", ".join(repr(t) for t in unknown),
        )
    return list(dict.fromkeys(wanted))


def survey_families(types: list[str] | None = None, progress: Progress = QUIET) -> Families:
    """Build each of ``types`` (default: every causal-LM type) tiny and put it through the guard."""
    import torch
    import transformers

    from nopad._apps.families import quiet, reason, tiny_model

    types = family_types(types)
    result = Families(transformers.__version__)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is faster than several on a shared machine
    try:
        for model_type in types:
            with progress.step(model_type):
                try:
                    model = tiny_model(model_type)
                except Exception as exc:  # noqa: BLE001 - a model that does not build is reported, not raised
                    model = f"build: {reason(exc)}"
                if isinstance(model, str):
                    result.not_built[model_type] = model
                    continue
                try:
                    with quiet():
                        why = refusal(model)
                except Exception as exc:  # noqa: BLE001 - the guard must answer; anything else is reported
                    result.errors[model_type] = reason(exc)
                    continue
                if why is None:
                    result.served.append(model_type)
                else:
                    result.refused[model_type] = why
    finally:
        torch.set_num_threads(threads)
    return result


# ---- the report ---------------------------------------------------------------------------------


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``nopad env`` reports, as the JSON object ``--json`` prints."""
    from nopad._apps.families import offline

    offline()  # before transformers (and huggingface_hub) is first imported: no network
    found = versions()
    types = None if found["transformers"] is None else family_types(args.families)  # bad input: before any work
    present = devices()
    steps = 3 * len(present)
    with Progress("nopad env", steps, quiet=args.quiet) as progress:
        report: dict[str, Any] = {"nopad": nopad.__version__, "versions": found, "devices": present}
        report["attention_dtype"] = args.dtype
        kinds = (
            ("attention_kernels", lambda d: attention_kernels(d, args.dtype)),
            ("state_layer_kernels", state_layer_kernels),
            ("head_kernels", head_kernels),
        )
        for key, of in kinds:
            report[key] = {}
            for device in present:
                with progress.step(f"{key.replace('_', ' ')} on {device}"):
                    report[key][device] = asdict(of(device))
        if types is None:
            report["families"] = None
        else:
            progress.add(len(types))
            report["families"] = asdict(survey_families(types, progress))
    return report


def _kernel_lines(title: str, table: dict[str, dict[str, Any]]) -> list[str]:
    lines = [title]
    for device, kernels in table.items():
        usable = ", ".join(kernels["usable"]) or "none"
        lines.append(f"  {device}: {usable}")
        lines += [f"    {name}: {why}" for name, why in kernels["unusable"].items()]
    return lines


def format_report(report: dict[str, Any]) -> str:
    found = report["versions"]
    width = max(len(name) for name in found) + 2
    lines = [f"nopad {report['nopad']}", "", "versions:"]
    for name, version in found.items():
        if name in ("torch_cuda", "torch_rocm"):
            continue
        shown = version if version is not None else NOT_INSTALLED
        if name == "torch":
            shown = f"{version} ({torch_build(found)})"
        lines.append(f"  {name:<{width}}{shown}")
    lines += ["", "devices:"]
    lines += [f"  {device}: {what}" for device, what in report["devices"].items()]
    dtype = report["attention_dtype"]
    kernels = {
        "attention_kernels": f"attention kernels (nopad_varlen at {dtype}; auto takes the first usable):",
        "state_layer_kernels": "state-layer kernels (where none is usable, nopad's torch forms run):",
        "head_kernels": "output-head kernels (where none is usable, nopad's tiles run):",
    }
    for key, title in kernels.items():
        lines += ["", *_kernel_lines(title, report[key])]
    lines.append("")
    families = report["families"]
    if families is None:
        lines.append("model families: none surveyed, transformers is not installed (nopad's hf extra installs it)")
        return "\n".join(lines)
    total = sum(len(families[k]) for k in ("served", "refused", "not_built", "errors"))
    lines.append(f"model families of transformers {families['transformers']} ({total} causal-LM types surveyed:")
    lines.append("each built tiny from its config, random weights, and put through nopad's guard; no forward run)")
    lines.append(f"served packed ({len(families['served'])}):")
    served = ", ".join(families["served"]) or "none"
    lines += textwrap.wrap(served, WIDTH, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)
    groups = (
        ("refused", "refused"),
        ("not_built", "could not build"),
        ("errors", "the guard failed (a bug in nopad: please report it)"),
    )
    for key, title in groups:
        if key == "errors" and not families[key]:
            continue
        lines.append(f"{title} ({len(families[key])}):")
        lines += [f"  {name}: {why}" for name, why in families[key].items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = collect(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    sys.stdout.flush()
    return 0
