"""TRL's own GRPO / RLOO tests, offline, once alone and once with nopad's ``install()`` active.

    python .ci/trl_own_tests.py TRL_TESTS_DIR [-k EXPR | --all] [--logs DIR]

TRL_TESTS_DIR is a TRL checkout's ``tests`` folder (TRL's sdist ships none). Tiny random-weight
models (MODELS: Qwen2, Qwen3, Llama, Gemma2, Qwen3-MoE, and nopad's tiny Nemotron-H hybrid) and a
byte-level BPE tokenizer trained on the prompts are built here into a temporary Hugging Face cache
under the Hub ids the tests load (``HF_HUB_OFFLINE=1``: transformers finds them there through its
ordinary code path), and ``trl-internal-testing/zen`` is served in memory
(``.ci/nopad_trl_offline.py``). ``tests/test_grpo_trainer.py`` and ``tests/test_rloo_trainer.py``
then run twice, the same selection (``-k``, by default CI_SELECTION; ``--all`` for every test):
alone, and with ``install()`` made before collection (``.ci/nopad_trl_install.py``). The tests that
fail alone cannot run here and are counted, grouped by why. A test that passes alone must pass
installed, or be refused by nopad by name (a ``ValueError`` of ``nopad.integrations.trl``, e.g.
the MoE load-balancing loss: listed); anything else exits 1, as does a run where no packed forward ran.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("test_grpo_trainer.py", "test_rloo_trainer.py")
# the Hub models served locally: (architecture, task)
MODELS = {
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal"),
    "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "classify"),
    "trl-internal-testing/tiny-Qwen3ForCausalLM": ("qwen3", "causal"),
    "trl-internal-testing/tiny-Qwen3ForSequenceClassification": ("qwen3", "classify"),
    "trl-internal-testing/tiny-LlamaForCausalLM-3.2": ("llama", "causal"),
    "trl-internal-testing/tiny-LlamaForSequenceClassification-3.2": ("llama", "classify"),
    "trl-internal-testing/tiny-Gemma2ForCausalLM": ("gemma2", "causal"),
    "trl-internal-testing/tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "causal"),
    # a hybrid (Mamba2, MoE, attention, MLP layers), nopad's own tiny one
    "trl-internal-testing/tiny-NemotronHForCausalLM-nano": ("nemotron_h", "synthetic"),
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tokenizer():
    """A byte-level BPE tokenizer trained here on the zen prompts (Qwen's kind, 320 tokens), with
    Qwen's special tokens and a chat template of their shape."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(HERE))
    from nopad_trl_offline import ZEN

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*ZEN, "system user assistant"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE
    )
    return fast, tok


def build_cache(cache: Path) -> None:
    """Each Hub id of MODELS built here, tiny and random, into the local cache."""
    import torch
    import transformers

    tok, bpe = tokenizer()
    for hub_id, (arch, task) in MODELS.items():
        torch.manual_seed(0)
        if task == "synthetic":
            from nopad.synthetic import tiny_causal_lm

            model = tiny_causal_lm(arch, vocab=len(tok), hidden=32, layers=4, seed=0)
            for settings in (model.config, model.generation_config):
                settings.pad_token_id, settings.eos_token_id = tok.pad_token_id, tok.eos_token_id
            save(cache, hub_id, model, tok, bpe)
            continue
        config = transformers.AutoConfig.for_model(
            arch,
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=512,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=None,
            tie_word_embeddings=True,
            num_labels=1,
            **(MOE if arch == "qwen3_moe" else {}),
        )
        auto = (
            transformers.AutoModelForCausalLM if task == "causal" else transformers.AutoModelForSequenceClassification
        )
        save(cache, hub_id, auto.from_config(config), tok, bpe)


def save(cache: Path, hub_id: str, model, tok, bpe) -> None:
    """The model and tokenizer as the cache's snapshot of hub_id (refs/main -> snapshots/<revision>)."""
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    model.save_pretrained(snapshot)
    tok.save_pretrained(snapshot)
    bpe.model.save(str(snapshot))  # vocab.json, merges.txt: what transformers 5's Qwen2Tokenizer reads
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)


def run_pytest(tests: Path, out: Path, plugins: list[str], select: list[str], env: dict) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, message)} from one pytest run's junit report."""
    xml = out.with_suffix(".xml")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings", "-rN"]
    for plugin in plugins:
        command += ["-p", plugin]
    command += [f"--junitxml={xml}", *select, *(f"tests/{f}" for f in FILES)]
    with out.open("w") as log:
        proc = subprocess.run(command, cwd=tests.parent, env=env, stdout=log, stderr=subprocess.STDOUT)
    print(
        f"   {' '.join(plugins) or 'alone'}: pytest exit {proc.returncode}; {out.read_text().strip().splitlines()[-1]}"
    )
    if proc.returncode not in (0, 1) or not xml.exists():
        sys.exit(f"pytest did not run the tests (exit {proc.returncode}): see {out}")
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = child.tag, (child.get("message") or "").strip()
        results[name] = (outcome, message)
    if not results:
        sys.exit(f"pytest did not run the tests (exit {proc.returncode}): see {out}")
    tail = out.read_text().splitlines()[-3:]
    results["__summary__"] = ("", "\n".join(tail))
    return results


# CI's selection (about 3 minutes on 2 cores for both runs): training runs that reach the log-prob
# method in each of its uses (the policy, old log-probs with num_iterations=2, a reference model with
# beta > 0 or a synced one, entropy filtering, another loss), on Qwen2 and on the Nemotron-H hybrid
CI_SELECTION = (
    "(TestGRPOTrainer and (Qwen2ForCausalLM or NemotronH or test_train_multiple_iterations"
    " or test_train_beta_non_zero or test_train_with_entropy_filter or test_train_with_sync_ref_model"
    " or (test_train_loss_types and dapo)))"
    " or (TestRLOOTrainer and (Qwen2ForCausalLM or NemotronH or test_train_multiple_iterations"
    " or test_train_with_sync_ref_model or test_train_reward_func_conversational))"
)
KNOWN = {  # tests that cannot run on the tiny local models, by name: why
    "test_train_with_mask_truncated_completions": "the Hub model's vocabulary (token ids 151643 / 151645 written "
    "in, or an EOS too rare to be sampled among 151,936 tokens)",
    "test_entropy_bonus_flows_gradients": "TRL's test written for another TRL release (API drift)",
}
REASONS = [  # why a test fails alone here, by its message: the first match names it
    (
        r"huggingface\.co|offline mode|OfflineModeIsEnabled|LocalEntryNotFound|cannot find the requested files|"
        r"Can't load|not a valid model identifier|We couldn't connect|outgoing traffic",
        "a Hub model or data set not served offline",
    ),
    (r"vllm|liger|bitsandbytes|kernels|peft|jmespath|deepspeed", "an optional package not installed"),
    (r"chat template|chat_template|response schema|tool", "the Hub tokenizer's chat template (tools, schemas)"),
    (
        r"unexpected keyword|got an unexpected|has no attribute|cannot import|ImportError|not supported|TypeError",
        "TRL's test written for another TRL release (API drift)",
    ),
]


def why(message: str, test: str = "") -> str:
    for name, reason in KNOWN.items():
        if f"::{name}" in test:
            return reason
    for pattern, reason in REASONS:
        if re.search(pattern, message, re.IGNORECASE):
            return reason
    return "other: " + message.splitlines()[0][:120] if message else "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", type=Path, help="TRL's tests folder")
    parser.add_argument("-k", default=CI_SELECTION, help="pytest -k expression (default: CI's selection)")
    parser.add_argument("--all", action="store_true", help="every test of the two files, no selection")
    parser.add_argument("--logs", type=Path, default=None, help="keep the two pytest logs in this folder")
    args = parser.parse_args()
    tests = args.tests.resolve()
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="trl-own-") as tmp:
        cache = Path(tmp) / "hub"
        build_cache(cache)
        env = {
            **os.environ,
            "HF_HUB_CACHE": str(cache),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        }
        select = [] if args.all else ["-k", args.k]
        print(f"TRL's own tests from {tests} ({', '.join(FILES)}){'' if args.all else ' -k ' + repr(args.k)}")
        logs = args.logs.resolve() if args.logs else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        alone = run_pytest(tests, logs / "alone.log", ["nopad_trl_offline"], select, env)
        installed = run_pytest(tests, logs / "installed.log", ["nopad_trl_offline", "nopad_trl_install"], select, env)
        installed_summary = installed.pop("__summary__")[1]
        alone.pop("__summary__")
        ran = [t for t, (o, _) in alone.items() if o == "passed"]
        cannot = {t: m for t, (o, m) in alone.items() if o in ("failure", "error")}
        skipped = {t: m for t, (o, m) in alone.items() if o == "skipped"}
        failed_installed = {
            t: installed.get(t, ("missing", ""))[1] for t in ran if installed.get(t, ("",))[0] != "passed"
        }
        # refused by name (a ValueError of nopad's, before any forward: documented, e.g. the MoE aux loss)
        refused = {t: m for t, m in failed_installed.items() if "nopad.integrations.trl:" in m}
        broken = [t for t in failed_installed if t not in refused]
        passed_installed = sum(o == "passed" for o, _ in installed.values())
        print(f"collected {len(alone)}: pass alone {len(ran)}, pass with install() {passed_installed}")
        for test, message in refused.items():
            print(f"   refused by nopad with install(), by name: {test}: {message.splitlines()[0][:200]}")
        print(f"cannot run here: {len(cannot)} fail alone, {len(skipped)} skipped by TRL's own markers")
        for reason, count in collections.Counter(why(m, t) for t, m in cannot.items()).most_common():
            print(f"   {count:4d}  {reason}")
        for reason, count in collections.Counter(m.split(":")[0][:80] for m in skipped.values()).most_common():
            print(f"   {count:4d}  skipped: {reason}")
        print(installed_summary.strip().splitlines()[-1] if installed_summary.strip() else "")
        for test in broken:
            print(f"PASSES ALONE, NOT WITH install(): {test}: {installed.get(test, ('missing', ''))[1][:300]}")
        if os.environ.get("NOPAD_TRL_OWN_VERBOSE"):
            for test, message in sorted(cannot.items()):
                print(f"   cannot: {test}: {why(message, test)}: {message.splitlines()[0][:200] if message else ''}")
        nopad_line = [
            line for line in (logs / "installed.log").read_text().splitlines() if line.startswith("nopad: install()")
        ]
        print(*nopad_line, sep="\n")
        print(f"wall time {time.time() - start:.0f} s")
        failed = bool(broken) or not ran or not any("active throughout" in line for line in nopad_line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
