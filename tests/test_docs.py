"""The docs cannot drift: every python block of README.md and docs/**/*.md runs, every output a page
shows is what its block prints now, and every nopad name a page uses is a public one.

Blocks, by their fence:

- ``python``: runs on its own (its own namespace, in a scratch directory). A block whose first line
  is ``# doc-test: processes=N ...`` runs on N gloo processes (it must not assume a process group
  exists: it calls ``init_process_group`` only when none is initialised, as under torchrun). A block
  that uses ``nopad.integrations.verl`` needs verl: it is skipped where verl is absent and runs in
  CI's verl leg; one that uses ``nopad.integrations.trl`` likewise needs trl (CI's trl leg).
- ``text`` right after a python block: what that block prints, compared with what it prints now.
- ``console``: ``$ command`` lines, each followed by what it prints. The commands run (``python``,
  ``nopad`` and ``torchrun`` of this checkout, from its root) and their output is compared; a line
  ``...`` stands for lines left out. Under torchrun the ranks' lines interleave, so there every
  shown line must be printed, in any order. docs/results.md is the exception: its console blocks
  are measurements (times), each from the dated run the page names, and only their commands are
  checked.
- a fence without a language is a picture or a synopsis, never an output: one right after a python
  or console block is refused (it would be an output nobody checks).

Numbers in outputs are compared with a tolerance (1e-5 absolute, 1e-4 relative), so a rounding
difference between machines is not drift; everything else must match exactly. Timings are never
shown in a checked output.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
PROCESSES = re.compile(r"#\s*doc-test:\s*processes=(\d+)")
NEEDS_VERL = re.compile(r"nopad\.integrations(\.verl| import verl)")
HAS_VERL = importlib.util.find_spec("verl") is not None
NEEDS_TRL = re.compile(r"nopad\.integrations(\.trl| import trl)")
HAS_TRL = importlib.util.find_spec("trl") is not None
RESULTS = ROOT / "docs" / "results.md"
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


@dataclass
class Block:
    page: Path
    line: int  # of the block's first line inside the fence
    lang: str
    code: str
    before: str  # the page's text between the previous fence and this one

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def page_blocks(page: Path) -> list[Block]:
    text = page.read_text()
    blocks, end = [], 0
    for match in FENCE.finditer(text):
        line = text[: match.start()].count("\n") + 2
        blocks.append(Block(page, line, match.group(1), match.group(2), text[end : match.start()]))
        end = match.end()
    return blocks


ALL = {page: page_blocks(page) for page in PAGES}


def _output_of(blocks: list[Block], i: int) -> str | None:
    """The ``text`` block that shows what python block ``i`` prints, if the next fence is one."""
    if i + 1 < len(blocks) and blocks[i + 1].lang == "text":
        return blocks[i + 1].code
    return None


def _python_params():
    for blocks in ALL.values():
        for i, block in enumerate(blocks):
            if block.lang != "python":
                continue
            processes = PROCESSES.match(block.code)
            marks = [pytest.mark.slow] if processes else []
            if NEEDS_VERL.search(block.code):
                marks.append(pytest.mark.skipif(not HAS_VERL, reason="needs verl (CI's verl leg runs it)"))
            if NEEDS_TRL.search(block.code):
                marks.append(pytest.mark.skipif(not HAS_TRL, reason="needs trl (CI's trl leg runs it)"))
            shown = _output_of(blocks, i)
            n = int(processes.group(1)) if processes else 1
            yield pytest.param(block.name, block.code, n, shown, id=block.name, marks=marks)


PYTHON = list(_python_params())


# ---- comparing outputs -----------------------------------------------------------------------
RAGGED = re.compile(r"\bj\d+\b")  # a nested tensor's ragged size: j1, j7, ... counts the process's ragged layouts


def _same_line(shown: str, actual: str) -> bool:
    """Equal, numbers within 1e-5 absolute or 1e-4 relative of each other, trailing blanks and the
    number of a ragged size (``torch.Size([3, j1])``) aside."""
    shown, actual = RAGGED.sub("j", shown.rstrip()), RAGGED.sub("j", actual.rstrip())
    if NUMBER.sub("#", shown) != NUMBER.sub("#", actual):
        return False
    for a, b in zip(NUMBER.findall(shown), NUMBER.findall(actual)):
        x, y = float(a), float(b)
        if not math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-5):
            return False
    return True


def assert_shows(shown: str, actual: str, where: str, *, any_order: bool = False) -> None:
    """Every shown line is printed, in order (``...`` standing for lines left out, ``any_order`` for
    the interleaved lines of several ranks); without ``...`` no printed line may be missing."""
    want = shown.rstrip("\n").split("\n")
    got = actual.rstrip("\n").split("\n")
    elided = any(line.strip() == "..." for line in want) or any_order
    want = [line for line in want if line.strip() != "..."]
    if any_order:
        pool = list(got)
        for line in want:
            hit = next((k for k, g in enumerate(pool) if _same_line(line, g)), None)
            assert hit is not None, f"{where}: the page shows a line nothing printed:\n{line}\n\nprinted:\n{actual}"
            pool.pop(hit)
        return
    k = 0
    for line in want:
        while k < len(got) and not _same_line(line, got[k]):
            assert elided, f"{where}: the page shows\n{shown}\n\nthe block prints now\n{actual}"
            k += 1
        assert k < len(got), f"{where}: the page shows\n{shown}\n\nthe block prints now\n{actual}"
        k += 1
    assert elided or k == len(got), f"{where}: the page shows\n{shown}\n\nthe block prints now\n{actual}"


def test_the_comparison_tolerates_rounding_and_nothing_else():
    assert _same_line("max |a - b| = 9.5367431640625e-07", "max |a - b| = 4.76837158203125e-07")
    assert _same_line("loss 0.272142 ['x']", "loss 0.2721421 ['x']")
    assert _same_line("torch.Size([3, j1]) True", "torch.Size([3, j7]) True")
    assert not _same_line("loss 0.272142", "loss 0.273142")
    assert not _same_line("rows 1605", "rows 1606")
    assert not _same_line("LEAK: moved sequences [1, 2]", "isolated: moved sequences [1, 2]")
    with pytest.raises(AssertionError, match="the page shows"):
        assert_shows("a\nb 1", "a\nb 2", "here")
    assert_shows("a\n...\nc", "a\nb\nc", "here")
    with pytest.raises(AssertionError):
        assert_shows("a\nc", "a\nb\nc", "here")  # a printed line the page leaves out without saying so


# ---- python blocks ---------------------------------------------------------------------------
def _exec_block(rank: int, world_size: int, name: str, code: str, cwd: str) -> bool:
    os.chdir(cwd)
    exec(compile(code, name, "exec"), {"__name__": "__doc_block__"})
    return True


def run_block(name: str, code: str, cwd: Path) -> tuple[dict, str]:
    """Run a block in ``cwd``; its namespace and what it printed."""
    namespace: dict = {"__name__": "__doc_block__"}
    printed = io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, name, "exec"), namespace)
    finally:
        os.chdir(old)
    return namespace, printed.getvalue()


def test_the_docs_have_code_blocks_and_outputs():
    assert len(PYTHON) >= 15
    assert sum(1 for p in PYTHON if p.values[3] is not None) >= 10


@pytest.mark.parametrize(("name", "code", "processes", "shown"), PYTHON)
def test_code_block_runs(name, code, processes, shown, tmp_path):
    if processes > 1:
        assert run_distributed(_exec_block, processes, name, code, str(tmp_path)) == [True] * processes
        return
    _, printed = run_block(name, code, tmp_path)
    if shown is not None:
        assert_shows(shown, printed, name)


# ---- console blocks --------------------------------------------------------------------------
def console_commands(block: Block) -> list[tuple[str, str]]:
    """(command, the output shown after it) for each ``$ `` line of a console block."""
    pairs: list[tuple[str, list[str]]] = []
    for line in block.code.rstrip("\n").split("\n"):
        if line.startswith("$ "):
            pairs.append((line[2:].strip(), []))
        else:
            assert pairs, f"{block.name}: a console block starts with a '$ ' command line"
            pairs[-1][1].append(line)
    return [(command, "\n".join(out)) for command, out in pairs]


def _console_params():
    for page, blocks in ALL.items():
        if page == RESULTS:
            continue
        for block in blocks:
            if block.lang == "console":
                commands = console_commands(block)
                slow = any(command.startswith("torchrun") for command, _ in commands)
                yield pytest.param(commands, id=block.name, marks=[pytest.mark.slow] if slow else [])


def _argv(command: str) -> list[str]:
    """The command as this checkout runs it: its python, its nopad, torchrun as torch's module."""
    argv = shlex.split(command.split("  #")[0])
    head = {
        "python": [sys.executable],
        "nopad": [sys.executable, "-m", "nopad"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"],
    }
    assert argv[0] in head, f"{command!r}: expected a python, nopad or torchrun command"
    return head[argv[0]] + argv[1:]


@pytest.fixture(scope="module")
def console_dir(tmp_path_factory):
    """Where the console commands run: a scratch folder (what they write lands there) that sees the
    checkout's docs/ and examples/ as a user in the checkout's root does."""
    folder = tmp_path_factory.mktemp("console")
    for name in ("docs", "examples"):
        (folder / name).symlink_to(ROOT / name)
    return folder


@pytest.mark.parametrize("commands", list(_console_params()))
def test_console_output_is_what_the_command_prints(commands, tmp_path):
    """The block's commands run in turn in a scratch folder (what they write lands there) that sees the
    checkout's docs/ and examples/ as a user in the checkout's root does."""
    for name in ("docs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for command, shown in commands:
        # torchrun: a second try when the first ends abnormally (a gloo rank sometimes aborts while the
        # process group is torn down, after every line was printed: "terminate called without an active
        # exception", seen once in a few dozen runs on a loaded machine)
        for _ in range(2 if command.startswith("torchrun") else 1):
            done = subprocess.run(_argv(command), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
            if done.returncode == 0:
                break
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        if shown.strip():
            assert_shows(shown, done.stdout, command, any_order=command.startswith("torchrun"))


def test_every_output_is_checked_and_every_measured_table_names_its_command():
    for page, blocks in ALL.items():
        for i, block in enumerate(blocks):
            if block.lang == "text":
                assert i > 0 and blocks[i - 1].lang == "python", (
                    f"{block.name}: a text block shows what the python block before it prints; there is none"
                )
            if not block.lang and i > 0 and blocks[i - 1].lang in ("python", "console") and not block.before.strip():
                raise AssertionError(f"{block.name}: an output without a checked fence (text after python)")
            if page == RESULTS and block.lang == "console":
                assert block.code.startswith("$ "), f"{block.name}: a measured table starts with its command"
    dated = re.findall(r"^## .*\(\d{4}-\d{2}-\d{2}", RESULTS.read_text(), re.M)
    assert dated, "docs/results.md: each machine's section names the date of its run"


# ---- names -----------------------------------------------------------------------------------
def _public_modules() -> list[str]:
    from tests.test_api import public_modules

    return list(public_modules())


PUBLIC_MODULES = _public_modules()
# Dotted names that are not Python objects: the Parquet metadata key of a packed file.
NOT_PYTHON = {"nopad.packed"}
# The contributors' page: it describes the private modules a user never calls.
CONTRIBUTORS = {ROOT / "docs" / "architecture.md"}
# Words in backticks that are not calls of nopad's private functions of the same name.
WORDS = {"loss_mask": "a batch field (verl's per-token mask)", "is_nested": "torch.Tensor's attribute"}


def resolve(dotted: str) -> object:
    """``nopad.a.b.C.m`` -> the object, through public names only: each module's ``__all__``, then
    the attributes of what it lists. AssertionError naming the first part that is not public."""
    parts = dotted.split(".")
    module_name = max((m for m in PUBLIC_MODULES if dotted == m or dotted.startswith(m + ".")), key=len, default=None)
    assert module_name is not None, f"{dotted}: no public module of that name"
    obj: object = importlib.import_module(module_name)
    rest = parts[len(module_name.split(".")) :]
    for k, attr in enumerate(rest):
        if k == 0:
            listed = getattr(obj, "__all__", [])
            submodule = f"{module_name}.{attr}" in PUBLIC_MODULES
            assert attr in listed or submodule, f"{dotted}: {module_name} does not list {attr!r} in its __all__"
        assert not attr.startswith("_"), f"{dotted}: {attr!r} is private"
        assert hasattr(obj, attr), f"{dotted}: {attr!r} does not exist"
        obj = getattr(obj, attr)
    return obj


def _names_in_code(code: str) -> list[str]:
    """Every nopad name a block imports or spells out (``from nopad.x import a`` gives nopad.x.a)."""
    names = re.findall(r"\bnopad(?:\.\w+)+", code)
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return names
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nopad":
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "nopad" and "." in a.name]
    return names


def test_every_nopad_name_in_prose_and_code_is_public():
    """A page may show the way to any public name and to nothing else (a private name moves or goes
    without notice). Short forms in prose (`parallel.shard_index`, `layout.IndexPlan`) count too."""
    short = {m.split(".", 1)[1]: m for m in PUBLIC_MODULES if "." in m}
    problems = []
    for page, blocks in ALL.items():
        if page in CONTRIBUTORS:
            continue
        text = page.read_text()
        prose = FENCE.sub("", text)
        found = set(_names_in_code(prose))
        for span in re.findall(r"`([^`\n]+)`", prose):
            for dotted in re.findall(r"(?<![\w./-])([a-z_]\w*(?:\.\w+)+)", span):
                first = dotted.split(".")[0]
                if first in short and not dotted.startswith("nopad."):
                    found.add(f"{short[first]}{dotted[len(first) :]}")
        for block in blocks:
            if block.lang == "python":
                found |= set(_names_in_code(block.code))
        for dotted in sorted(found - NOT_PYTHON):
            try:
                resolve(dotted)
            except AssertionError as e:
                problems.append(f"{page.relative_to(ROOT)}: {e}")
    assert not problems, "\n".join(problems)


def _private_objects() -> set[str]:
    """Functions and classes defined in nopad's private modules and reachable from no public name:
    what a page must not call by name. verl's own names (nopad's integration mirrors them) and the
    applications' are left out."""
    reachable = set()
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for attr in getattr(module, "__all__", []):
            reachable.add(attr)
            obj = getattr(module, attr)
            if isinstance(obj, dict):
                reachable |= {k for k in obj if isinstance(k, str)}  # ALGORITHMS, KERNELS: names you pass
            for hint in _returned_types(obj):
                reachable.add(hint)
    private = set()
    for path in (ROOT / "nopad").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if "/_apps/" in rel or "/integrations/" in rel or not any(p.startswith("_") for p in rel.split("/")[1:]):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                private.add(node.name)
    return private - reachable


def _returned_types(obj: object) -> set[str]:
    """The class names a public function's return annotation names (OutputArgs, IsolationReport, ...):
    a page may speak of what a public function returns."""
    target = obj.__init__ if isinstance(obj, type) else obj
    try:
        annotation = inspect.signature(target).return_annotation
    except (TypeError, ValueError):
        return set()
    if isinstance(obj, type):
        return {obj.__name__}
    return set(re.findall(r"\b[A-Z]\w+", str(annotation)))


def test_no_page_calls_a_private_function_by_name():
    """`spread_over_tokens`, `probe_batch`, `shifted_loss_mask` were named in prose as if a user could
    call them; they are private. A bare name in backticks that is only a private function is refused
    (a public one of the same name, or a name a public function returns, is fine)."""
    private = _private_objects()
    problems = []
    for page in PAGES:
        if page in CONTRIBUTORS:
            continue
        prose = FENCE.sub("", page.read_text())
        for span in re.findall(r"`([^`\n]+)`", prose):
            match = re.match(r"^([A-Za-z_]\w*)(\(|$)", span.strip())
            if match and match.group(1) in private and match.group(1) not in WORDS:
                problems.append(f"{page.relative_to(ROOT)}: `{span}` names a private object")
    assert not problems, "\n".join(problems)


def test_every_signature_shown_in_prose_has_the_functions_parameters_and_defaults():
    """`pack_conversations(conversations, pack_length, *, alignment=1, ...)` in prose is a promise:
    every keyword a call in prose passes is a parameter of the public function of that name, and a
    signature (a span with a bare ``*``) shows each default as the function has it."""
    callables: dict[str, list[object]] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            if callable(obj):
                callables.setdefault(attr, []).append(obj)
    problems = []
    for page in PAGES:
        prose = FENCE.sub("", page.read_text()).replace("\n", " ")
        for name, args in re.findall(r"`(\w+)\(([^`]*)\)`", prose):
            if name in callables and args.strip():
                for problem in _signature_problems(args, callables[name]):
                    problems.append(f"{page.relative_to(ROOT)}: `{name}({args})`: {problem}")
    assert not problems, "\n".join(problems)


def _signature_problems(args: str, candidates: list[object]) -> list[str]:
    """What ``args`` gets wrong about the best matching candidate (a class: its constructor)."""
    parts = [p.strip() for p in args.split(",")]
    signature = "*" in parts
    best: list[str] | None = None
    for obj in candidates:
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            continue
        takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
        found = []
        for part in parts:
            key, eq, default = part.partition("=")
            key = key.strip()
            if not eq or not re.fullmatch(r"[A-Za-z_]\w*", key):
                continue  # a positional placeholder, `*`, `...`
            if key not in params:
                if not takes_kwargs:
                    found.append(f"no parameter {key!r}")
                continue
            if signature and params[key].default is not inspect.Parameter.empty:
                try:
                    shown = ast.literal_eval(default.strip())
                except (ValueError, SyntaxError):
                    continue
                if params[key].default != shown:
                    found.append(f"{key} defaults to {params[key].default!r}, the page shows {shown!r}")
        if best is None or len(found) < len(best):
            best = found
    return best or []


# ---- the pages' promises ---------------------------------------------------------------------
def _block_after(page: str, heading: str) -> Block:
    """The first block of ``page`` after the line that starts with ``heading``."""
    text = (ROOT / page).read_text()
    line = text[: text.index("\n" + heading)].count("\n") + 2
    return next(b for b in ALL[ROOT / page] if b.line > line)


def test_sft_from_a_packed_file_equals_each_conversation_run_alone(tmp_path):
    """The packing page's SFT route (read, batch, packed_to_nested, packed forward, sft_loss) gives the
    loss of each conversation run alone through the model, with the per-token mask shifted here."""
    import torch

    block = _block_after("docs/integrations/packing.md", "## SFT from a packed file")
    namespace, _ = run_block(block.name, block.code, tmp_path)
    model, convs = namespace["model"], namespace["convs"]
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in convs:
            ids, mask = torch.tensor(ids), torch.tensor(mask)
            logits = model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False).logits[0]
            log_probs = logits[:-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
            total += float(log_probs[mask[1:].bool()].sum())
            count += int(mask[1:].sum())
    assert namespace["total"] == pytest.approx(-total / count, rel=1e-5)


def test_the_verl_setup_steps_are_the_ones_install_names_when_verl_is_missing():
    """docs/integrations/verl.md's copy-paste venv and install()'s message when verl is missing say
    the same steps (the ones CI's verl leg runs), and never a bare `pip install verl` into this venv."""
    # private: the setup steps install() prints are compared with the page's
    from nopad.integrations.verl._install import VERL_VENV_STEPS

    block = _block_after("docs/integrations/verl.md", "## A venv for verl")
    assert block.lang == "bash"
    steps = [line.split("  #")[0].strip() for line in block.code.splitlines() if line.strip() and line[0] != "#"]
    assert steps[: len(VERL_VENV_STEPS)] == list(VERL_VENV_STEPS)
    ci = (ROOT / ".ci" / "run").read_text()
    for step in VERL_VENV_STEPS[1:]:  # CI's verl leg runs the same installs (quietly, through python -m pip)
        assert step.replace("pip install", "python -m pip install -q") in ci, step
    if HAS_VERL:
        pytest.skip("verl is installed here: install() does not refuse")
    from nopad.integrations import verl

    with pytest.raises(ImportError) as error:
        verl.install()
    message = str(error.value)
    assert all(step in message for step in VERL_VENV_STEPS) and "would downgrade" in message
