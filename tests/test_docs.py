"""The docs cannot drift from the code: every command in README.md and docs/*.md is run or checked.

Conventions (written for doc authors in docs/index.md):

* A ```bash block is run, for real, with ``bash -e -o pipefail`` in a temporary working directory
  (one per Markdown file, shared by its blocks in order, with the repository's top-level files
  linked into it), a short timeout, and ``ftkit``/``python3`` resolving to this interpreter.
  It must exit 0. A ``# expect: TEXT`` comment line asserts that TEXT is in the block's output
  (stdout + stderr, whitespace collapsed). ``<!-- requires: EXE ... -->`` right above the block
  skips it where an executable is missing (fails instead for SLURM's with FTKIT_REQUIRE_SLURM=1).
* A ```python block is run the same way after a small prelude (PRELUDE below: ``model``, ``opt``,
  ``state``, ``train_step``, ...). ``<!-- not run: REASON -->`` above it only compiles it and
  checks every ``ftkit`` name it imports or uses exists.
* A ```console block holds commands that are shown but not run; it needs ``<!-- not run: REASON -->``.
* ```text (output, layouts, synopses), ```json (must parse), ```yaml (must parse). No bare fences.
* Everywhere (fenced or inline code): every ``ftkit SUBCOMMAND`` exists, and every flag used with
  it is one of its options; every path under benchmarks/, sbatch_templates/, scripts/, tests/,
  docs/, ftkit/ or .ci/ and every relative link exists.
* ``<!-- generated: dataclass-table MODULE:CLASS -->`` ... ``<!-- end generated -->`` regions are
  the field tables of config dataclasses, built from the field docstrings. This test fails when
  they are out of date; ``FTKIT_UPDATE_DOCS=1 pytest tests/test_docs.py`` rewrites them.
* Every name in ``ftkit.__all__`` is documented in docs/api.md.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LANGUAGES = {"bash", "console", "python", "text", "json", "yaml"}
BLOCK_TIMEOUT = 120  # seconds for one block
SLURM_EXES = {"sbatch", "squeue", "scontrol", "srun", "sinfo", "scancel"}

# Names a ```python block may use without defining them: a tiny model and its training step.
PRELUDE = '''
import torch
from pathlib import Path

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
state = {"model": model, "optimizer": opt}
total = 20
job = jobdir = Path("runs/example")
_x, _y = torch.randn(8, 4), torch.randn(8, 1)

def train_one_step():
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(_x), _y).backward()
    opt.step()

def train_step(step):
    train_one_step()
'''


# ----------------------------------------------------------------------------------------
# parsing


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    directive: str  # the HTML comment right above the fence ("" if none)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def not_run(self) -> str | None:
        m = re.match(r"not run:\s*(\S.*)", self.directive)
        return m.group(1) if m else None

    @property
    def requires(self) -> list[str]:
        m = re.match(r"requires:\s*(.*)", self.directive)
        return m.group(1).split() if m else []

    @property
    def expects(self) -> list[str]:
        return [m.group(1).strip() for m in re.finditer(r"^\s*#\s*expect:\s*(.+)$", self.code, re.M)]


_FENCE = re.compile(r"^ {0,3}```(.*)$")


def parse(path: Path) -> tuple[list[Block], str]:
    """The fenced blocks of a Markdown file, and its text outside them (for inline code)."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    prose: list[str] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        start, lang = i, m.group(1).strip()
        j = i + 1
        while j < len(lines) and not re.match(r"^ {0,3}```\s*$", lines[j]):
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{start + 1}: unclosed ``` fence")
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        d = re.match(r"^\s*<!--\s*(.*?)\s*-->\s*$", lines[k]) if k >= 0 else None
        blocks.append(Block(path, start + 1, lang, "\n".join(lines[start + 1 : j]) + "\n",
                            d.group(1) if d else ""))
        prose.append("")
        i = j + 1
    return blocks, "\n".join(prose)


ALL = {p: parse(p) for p in DOCS}
BLOCKS = [b for blocks, _ in ALL.values() for b in blocks]


def _code_texts() -> list[tuple[str, str]]:
    """(where, text) of every fenced block and every inline code span."""
    out = [(b.where, b.code) for b in BLOCKS]
    for path, (_, prose) in ALL.items():
        for n, line in enumerate(prose.splitlines(), 1):
            for m in re.finditer(r"(`+)(.+?)\1", line):
                out.append((f"{path.relative_to(ROOT)}:{n}", m.group(2)))
    return out


# ----------------------------------------------------------------------------------------
# fences


def test_every_fence_has_a_known_language():
    bad = [f"{b.where}: ```{b.lang}" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not bad, f"give every fence one of {sorted(LANGUAGES)}: {bad}"


def test_not_run_blocks_say_why():
    bad = [b.where for b in BLOCKS if b.lang == "console" and not b.not_run]
    assert not bad, f"a ```console block needs <!-- not run: REASON --> right above it: {bad}"
    misplaced = [b.where for b in BLOCKS if b.not_run and b.lang not in ("console", "python")]
    assert not misplaced, f"<!-- not run --> belongs above ```console or ```python only: {misplaced}"


def test_json_and_yaml_blocks_parse():
    for b in BLOCKS:
        if b.lang == "json":
            try:
                json.loads(b.code)
            except ValueError as exc:
                pytest.fail(f"{b.where}: not JSON: {exc}")
        elif b.lang == "yaml":
            yaml = pytest.importorskip("yaml")
            try:
                list(yaml.safe_load_all(b.code))
            except yaml.YAMLError as exc:
                pytest.fail(f"{b.where}: not YAML: {exc}")


# ----------------------------------------------------------------------------------------
# ftkit commands and flags, paths


def _cli():
    from ftkit.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return parser, sub.choices


_STOP = re.compile(r"\s(?:;|&&|\|\||\||#|>|2>)\s|[;`)]|\s#")


# what may stand before a command: nothing, a separator, `python3 -m`, `exec`, `--`, VAR=value
_COMMAND_POSITION = re.compile(r"(?:^|;|&&|\|\||\||\(|\$\(|-m|exec|--|\bthen|\bdo|\w=\S*|^\$)\s*$")


def ftkit_commands(text: str) -> list[list[str]]:
    """Token lists of every ``ftkit ...`` / ``python3 -m ftkit ...`` call in ``text``."""
    calls = []
    for line in text.splitlines():
        for m in re.finditer(r"(?<![\w.\-/\[\"'$])ftkit[ \t]+", line):
            if not _COMMAND_POSITION.search(line[: m.start()]):
                continue  # prose inside a code span or a quoted message: "ftkit must ..."
            rest = _STOP.split(" " + line[m.end():] + " ", maxsplit=1)[0]
            tokens = rest.split()
            if tokens and (re.fullmatch(r"[a-z][a-z-]*", tokens[0]) or tokens[0].startswith("-")):
                calls.append(tokens)
    return calls


def _check_call(tokens: list[str], parser, commands) -> str | None:
    def flags_of(p):
        return {s for a in p._actions for s in a.option_strings}

    if tokens[0].startswith("-"):
        target, args = parser, tokens
    elif tokens[0] in commands:
        target, args = commands[tokens[0]], tokens[1:]
    else:
        return f"`ftkit {tokens[0]}` is not a subcommand (have: {', '.join(commands)})"
    known = flags_of(target)
    for t in args:
        if t == "--":
            break
        flag = t.strip("[]").split("=", 1)[0]
        if flag.startswith("-") and len(flag) > 1 and not flag[1:].isdigit() and flag not in known:
            return f"`ftkit {' '.join(tokens)}`: {flag} is not an option of it (have: {sorted(known)})"
    positionals = [t for t in args if not t.startswith(("-", "[")) and "=" not in t]
    choices = next((a.choices for a in target._actions if not a.option_strings and a.choices), None)
    if choices and positionals and re.fullmatch(r"[a-z{][a-z,{}-]*", positionals[0]):
        for word in positionals[0].strip("{}").split(","):
            if word not in choices:
                return f"`ftkit {' '.join(tokens)}`: {word!r} is not one of {sorted(choices)}"
    if tokens[0] == "template" and positionals and re.fullmatch(r"[a-z]+", positionals[0]):
        from ftkit.slurm.templates import list_templates

        if positionals[0] not in list_templates():
            return f"`ftkit {' '.join(tokens)}`: no template {positionals[0]!r}"
    return None


def test_every_ftkit_command_and_flag_exists():
    parser, commands = _cli()
    problems, seen = [], 0
    for where, text in _code_texts():
        for tokens in ftkit_commands(text):
            seen += 1
            problem = _check_call(tokens, parser, commands)
            if problem:
                problems.append(f"{where}: {problem}")
    assert seen > 20, f"found only {seen} ftkit commands in the docs: is the extraction broken?"
    assert not problems, "\n".join(problems)


def test_the_command_check_catches_drift():
    parser, commands = _cli()
    assert _check_call(["savee", "JOBDIR"], parser, commands)
    assert _check_call(["status", "JOBDIR", "--jsn"], parser, commands)
    assert _check_call(["request", "requeu", "JOBDIR"], parser, commands)
    assert _check_call(["template", "singel"], parser, commands)
    assert _check_call(["requeue", "JOBDIR", "--exit-code", "N", "[--max-requeues", "N]"], parser, commands) is None
    assert ftkit_commands('x; python3 -m ftkit demo --steps 5 && ftkit ls runs/demo # c') == [
        ["demo", "--steps", "5"], ["ls", "runs/demo"]]
    assert ftkit_commands("import ftkit\nftkit.Config(x)\nftkit() { -m ftkit \"$@\"; }\nsignals: ftkit must be") == []
    assert ftkit_commands("X=1 ftkit save J; kubectl exec p -- ftkit kill J") == [["save", "J"], ["kill", "J"]]


_PATH = re.compile(r"(?<![\w$/.\-<>])((?:benchmarks|sbatch_templates|scripts|tests|docs|ftkit|\.ci)/[\w.*/-]*[\w*])")


def test_every_mentioned_path_exists():
    missing = []
    for path in DOCS:
        text = path.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            for m in _PATH.finditer(line):
                if not list(ROOT.glob(m.group(1))):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {m.group(1)}")
            for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line):
                target = m.group(1)
                if "://" not in target and not (path.parent / target).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: link {target}")
    assert not missing, "paths the docs mention that do not exist:\n" + "\n".join(missing)


# ----------------------------------------------------------------------------------------
# running the blocks


@pytest.fixture(scope="module")
def bindir(tmp_path_factory) -> Path:
    """``ftkit``, ``python3`` and ``python`` as this interpreter, first on PATH."""
    d = tmp_path_factory.mktemp("bin")
    for name in ("python3", "python"):
        (d / name).symlink_to(sys.executable)
    (d / "ftkit").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ftkit "$@"\n')
    (d / "ftkit").chmod(0o755)
    return d


def _env(bindir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("SLURM_") and k != "SLURM_CONF") and not k.startswith(("FTKIT_", "PYTEST_"))}
    if os.environ.get("FTKIT_REQUIRE_SLURM"):
        env["FTKIT_REQUIRE_SLURM"] = os.environ["FTKIT_REQUIRE_SLURM"]
    env.update(PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", COLUMNS="200",
               PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore::DeprecationWarning")
    return env


def _workdir(tmp_path: Path) -> Path:
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in ("runs", "ftkit-jobs"):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def _run(block: Block, argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT} s:\n{out[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever the block left in the background
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        pytest.fail(f"{block.where}: exit {proc.returncode}\n--- block ---\n{block.code}--- output ---\n{out[-4000:]}")
    flat = " ".join(out.split())
    for want in block.expects:
        assert " ".join(want.split()) in flat, f"{block.where}: output lacks {want!r}:\n{out[-4000:]}"
    return out


def _missing(block: Block) -> list[str]:
    missing = [exe for exe in block.requires if shutil.which(exe) is None]
    if missing and os.environ.get("FTKIT_REQUIRE_SLURM") == "1" and SLURM_EXES & set(missing):
        pytest.fail(f"{block.where}: needs {missing} (FTKIT_REQUIRE_SLURM=1)")
    return missing


RUN_FILES = sorted({b.path for b in BLOCKS if b.lang == "bash" or (b.lang == "python" and not b.not_run)})


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_blocks_run(path: Path, tmp_path: Path, bindir: Path):
    """The ```bash and ```python blocks of one file, in order, in one working directory."""
    cwd, env = _workdir(tmp_path), _env(bindir)
    skipped = []
    for block in ALL[path][0]:
        if block.lang == "bash":
            missing = _missing(block)
            if missing:
                skipped.append(f"{block.where} (no {', '.join(missing)})")
                continue
            _run(block, ["bash", "-e", "-o", "pipefail", "-c", block.code], cwd, env)
        elif block.lang == "python" and not block.not_run:
            script = cwd / f"_block_{block.line}.py"
            script.write_text(PRELUDE + "\n# --- " + block.where + "\n" + block.code)
            _run(block, [sys.executable, str(script)], cwd, env)
    if skipped:
        pytest.skip("skipped blocks: " + "; ".join(skipped))


# ----------------------------------------------------------------------------------------
# python blocks that are not run: they must compile and name real things


def _resolve(dotted: str) -> None:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return
    raise ModuleNotFoundError(dotted)


def ftkit_names(code: str) -> set[str]:
    """Dotted ``ftkit`` names a piece of Python imports or uses."""
    names: set[str] = set()
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ftkit":
            names |= {f"{node.module}.{a.name}" for a in node.names if a.name != "*"}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.split(".")[0] == "ftkit"}
        elif isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "ftkit":
                names.add(".".join(["ftkit", *reversed(chain)]))
    return names


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.where)
def test_python_blocks_name_real_things(block: Block):
    try:
        compile(block.code, block.where, "exec")
    except SyntaxError as exc:
        pytest.fail(f"{block.where}: {exc}")
    for name in sorted(ftkit_names(block.code)):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            pytest.fail(f"{block.where}: {name} does not exist ({exc})")


# ----------------------------------------------------------------------------------------
# the API reference


def dataclass_table(spec: str) -> str:
    """A Markdown table of a config dataclass: field, type, default and its docstring."""
    module, _, name = spec.partition(":")
    cls = getattr(importlib.import_module(module), name)
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    docs, types = {}, {}
    for node, nxt in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            types[node.target.id] = ast.unparse(node.annotation)
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f"`{f.default!r}`"
        elif f.default_factory is not dataclasses.MISSING:
            factory = f.default_factory
            default = f"`{factory.__name__}()`" if isinstance(factory, type) else f"`{factory()!r}`"
        else:
            default = "required"
        doc = docs.get(f.name)
        assert doc, f"{spec}.{f.name} has no docstring: add one under the field"
        cells = [f"`{f.name}`", f"`{types[f.name]}`", default, doc]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def _first_paragraph(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def _signature(fn) -> str:
    """``(a: int, *, b: str = 'x')`` without ``self``, annotations as written in the source."""
    parts, star = [], False
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        text = p.name
        if p.annotation is not p.empty:
            text += f": {p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)}"
        if p.default is not p.empty:
            d = p.default
            shown = f"{getattr(d, '__module__', None) or 'time'}.{d.__name__}" if callable(d) else repr(d)
            text += f" = {shown}"
        parts.append(text)
    return f"({', '.join(parts)})"


def methods_table(spec: str) -> str:
    """A Markdown table of a class's public methods and properties with their first doc paragraph."""
    module, _, name = spec.partition(":")
    cls = getattr(importlib.import_module(module), name)
    rows = ["| member | what it does |", "|---|---|"]
    for attr, value in cls.__dict__.items():
        if attr.startswith("_") and attr != "__init__":
            continue
        if isinstance(value, property):
            label = f"`{attr}` (property)"
        elif inspect.isfunction(value):
            label = f"`{name if attr == '__init__' else attr}{_signature(value)}`"
        else:
            continue
        doc = _first_paragraph(value if attr != "__init__" else cls) or "(no docstring)"
        rows.append(f"| {label.replace('|', chr(92) + '|')} | {doc} |")
    return "\n".join(rows)


def errors_table(module: str) -> str:
    """The exception classes of a module: class, parent, CLI exit code, docstring."""
    mod = importlib.import_module(module)
    rows = ["| exception | subclass of | exit code | meaning |", "|---|---|---|---|"]
    for name in mod.__all__:
        cls = getattr(mod, name)
        if not isinstance(cls, type):  # the exit-code constants beside the classes
            continue
        parents = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        rows.append(f"| `ftkit.{name}` | {parents} | {cls.exit_code} | {_first_paragraph(cls)} |")
    return "\n".join(rows)


_KINDS = {"dataclass-table": dataclass_table, "methods": methods_table, "errors": errors_table}
_GENERATED = re.compile(r"(<!-- generated: ([\w-]+) (\S+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def test_generated_tables_are_current():
    stale = []
    for path in DOCS:
        text = path.read_text()

        def fresh(m: re.Match) -> str:
            return f"{m.group(1)}{_KINDS[m.group(2)](m.group(3))}\n{m.group(5)}"

        new = _GENERATED.sub(fresh, text)
        if new != text:
            if os.environ.get("FTKIT_UPDATE_DOCS") == "1":
                path.write_text(new)
            else:
                stale.append(str(path.relative_to(ROOT)))
    assert not stale, f"generated tables out of date in {stale}: run FTKIT_UPDATE_DOCS=1 pytest tests/test_docs.py"


def test_api_reference_covers_the_public_surface():
    import ftkit

    api = (ROOT / "docs" / "api.md").read_text()
    headings = "\n".join(line for line in api.splitlines() if line.startswith("#"))
    documented = set(re.findall(r"`(?:ftkit\.)?(\w+)", headings))
    missing = [n for n in ftkit.__all__ if n != "__version__" and n not in documented]
    assert not missing, f"docs/api.md has no heading for {missing}"
    assert len(_GENERATED.findall(api)) >= 8, "docs/api.md lost its generated tables"


# ----------------------------------------------------------------------------------------
# troubleshooting: quoted messages exist in the code


def _source_text() -> str:
    text = "\n".join(p.read_text() for p in (ROOT / "ftkit").rglob("*.py"))
    # join implicitly concatenated string literals split over lines: "abc "\n    f"def"
    return re.sub(r"(['\"])\s*\n\s*[rbfu]*\1", "", text)


def test_troubleshooting_messages_are_real():
    """Each ```text block in troubleshooting.md quotes a message; <...> marks a variable part.

    Every literal piece between the variable parts must occur in ftkit's source, so a reworded
    message fails here until the page is updated.
    """
    source = _source_text()
    blocks = [b for b in ALL[ROOT / "docs" / "troubleshooting.md"][0] if b.lang == "text"]
    assert len(blocks) >= 5
    problems = []
    for b in blocks:
        for line in b.code.splitlines():
            line = re.sub(r"^(?:<[^>]*>|\S+ \S+) (?:WARNING|INFO|ERROR) [\w.]+: ", "", line.strip())  # log prefix
            line = re.sub(r"^error: ", "", line)
            for piece in re.split(r"<[^>]*>", line):
                piece = piece.strip()
                if len(piece) >= 8 and piece not in source:
                    problems.append(f"{b.where}: {piece!r}")
    assert not problems, "messages not found in ftkit/ (reworded?):\n" + "\n".join(problems)


def test_every_event_kind_is_in_the_concepts_table():
    emitted = set(re.findall(r"""emit\(\s*["']([\w-]+)["']""", _source_text()))
    emitted |= set(re.findall(r"""_emit\(\s*["']([\w-]+)["']""", _source_text()))
    emitted |= {"pin", "unpin"}  # emitted as `"pin" if pin else "unpin"`
    table = (ROOT / "docs" / "concepts.md").read_text().split("## The events log", 1)[1]
    documented = set(re.findall(r"^\| `([\w-]+)`(?:, `([\w-]+)`)?", table, re.M))
    documented = {name for pair in documented for name in pair if name}
    assert emitted - documented == set(), f"events not in docs/concepts.md's table: {emitted - documented}"
    assert documented - emitted == set(), f"docs/concepts.md lists events never emitted: {documented - emitted}"
