"""pytest plugin for TRL's own GRPO / RLOO tests offline: the Hub ids they name served from here.

``.ci/trl_own_tests.py`` builds tiny random-weight models and a word-level tokenizer into a local
Hugging Face cache (``HF_HUB_CACHE``, under the Hub ids TRL's tests load, with ``HF_HUB_OFFLINE=1``:
transformers resolves them from there through its ordinary code path, nothing patched) and loads
this plugin (``-p nopad_trl_offline``). The plugin serves ``load_dataset("trl-internal-testing/zen",
<config>, split=...)`` from an in-memory copy built here (prompts only: the configs TRL's GRPO and
RLOO tests read) and passes every other ``load_dataset`` call to ``datasets``: offline, those fail
and are counted as tests that cannot run. TRL's test helpers (a checkout newer or older than the
installed TRL) import ``is_<package>_available`` checks from ``trl.import_utils``; one the installed
TRL lacks is added there as the same check (the package importable), before the helpers import it:
they only decide which tests TRL's ``require_*`` marks skip.
"""

from __future__ import annotations

import importlib
import importlib.util

import datasets

ZEN = [  # prompts in the zen dataset's shape: 17 train, 2 test (the first 12 as TRL's tests expect them)
    "Beautiful is better than",
    "Explicit is",
    "Simple is better",
    "Complex",
    "Flat is better than",
    "Sparse is better",
    "Readability",
    "Special cases aren't special",
    "Although practicality beats",
    "Errors should never",
    "Unless explicitly",
    "In the face of ambiguity, refuse",
    "There should be one--",
    "Although that way may not be",
    "Now is better than",
    "Although never is often better than",
    "If the implementation is hard to explain, it's",
    "If the implementation is easy to explain, it",
    "Namespaces are one honking great",
]
CONFIGS = ("standard_prompt_only", "conversational_prompt_only")
_ORIGINAL = datasets.load_dataset


def zen(config: str) -> datasets.DatasetDict:
    def rows(prompts):
        if config == "standard_prompt_only":
            return {"prompt": prompts}
        return {"prompt": [[{"role": "user", "content": p}] for p in prompts]}

    return datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(rows(ZEN[:17])), "test": datasets.Dataset.from_dict(rows(ZEN[17:]))}
    )


def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    if path == "trl-internal-testing/zen" and name in CONFIGS and not args and not kwargs:
        data = zen(name)
        if streaming:
            data = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in data.items()})
        return data if split is None else data[split]
    return _ORIGINAL(path, name, *args, split=split, streaming=streaming, **kwargs)


CHECKS = ("joblib",)  # the is_<package>_available checks TRL's helpers import that TRL 1.16 lacks


def pytest_configure(config) -> None:
    datasets.load_dataset = load_dataset  # before TRL's test modules import it by name
    import_utils = importlib.import_module("trl.import_utils")
    for package in CHECKS:
        name = f"is_{package}_available"
        if not hasattr(import_utils, name):
            setattr(import_utils, name, lambda package=package: importlib.util.find_spec(package) is not None)


def pytest_report_header(config) -> str:
    return "nopad: trl-internal-testing/zen served in memory; Hub models from the local cache"
