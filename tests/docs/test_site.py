"""The documentation cannot drift from the code without a test failing (issue 39).

- The site builds with ``mkdocs build --strict`` (no broken link or anchor, every page in the nav,
  every name of the API reference resolves). Skipped where mkdocs is not installed (the test
  extra does not bring it); ``.ci/run`` installs the ``docs`` extra and builds strictly itself.
- Every fenced block of README.md and docs/ is checked without running training:
  ``python`` blocks compile, every ``lightning_disttrain`` name they import or reference exists,
  and the keyword arguments they pass to the package's classes and functions are parameters of
  them; ``yaml`` blocks' ``class_path: lightning_disttrain...`` resolve and their ``init_args``
  are parameters; in ``bash`` blocks (and the ``$`` lines of ``console`` blocks) every
  ``lightning-disttrain`` line is parsed by the command's own parser (LightningCLI's, or the
  tool's argparse parser, stopped before anything runs), ``--config configs/...`` files exist,
  scripts run with ``python``/``torchrun``/``bash`` exist, and ``pip install`` extras are declared.
  No block is run (the quickstart, the configs and the examples run in their own tests). A block
  that needs GPUs (a ``fit`` whose config asks for one; Python with ``devices=`` above 2, ``"cuda"``
  or ``"gpu"``) must be marked ``<!-- gpu -->`` on the line before its fence, so a reader knows
  what runs at CPU size; marked blocks get the same checks, which need no GPU.
  Out of scope: ``docs/design/`` (dated research notes, with commands of the time) and the
  untagged command-and-output logs of ``docs/benchmarks.md``, whose only check is that the
  ``benchmarks/`` scripts they name exist.
- Each troubleshooting heading is still the start of a message the package raises.
- The README is a front page: its set-up commands are the ones CI runs, it links every guide.
"""

from __future__ import annotations

import argparse
import os
import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
QUICKSTART = "pip install torch==2.13.0 && pip install -e . && lightning-disttrain fit --config configs/quickstart.yaml"
TEST_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q'
GPU_MARK = "<!-- gpu -->"
RUN_MARK = "<!-- run -->"
LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    gpu: bool
    run: bool = False

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line} ({self.lang})"


def _pages() -> list[Path]:
    pages = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [p for p in pages if "design" not in p.relative_to(REPO).parts]


def _blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file (indented fences too, e.g. inside a list item)."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,})\s*([\w+-]*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{fence}\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        previous = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        blocks.append(Block(path, start + 1, lang.lower(), "\n".join(body), previous == GPU_MARK,
                            previous == RUN_MARK))
        i += 1
    return blocks


ALL_BLOCKS = [b for page in _pages() for b in _blocks(page)]


def _ids(blocks):
    return [b.where() for b in blocks]


# ---- the site --------------------------------------------------------------------------------------


def test_mkdocs_build_strict(tmp_path):
    # The [test] extra installs the [docs] packages: the README's test command builds the site.
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        assert importlib.util.find_spec(module.split(".")[0]) is not None and (
            "." not in module or importlib.util.find_spec(module) is not None), \
            f"{module} is not installed: pip install -e '.[test]' (it brings the [docs] packages)"
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert (tmp_path / "site" / "api" / "strategies" / "index.html").is_file()
    html = (tmp_path / "site" / "api" / "strategies" / "index.html").read_text()
    assert "dp_shard" in html and "NDParallelStrategy" in html  # the docstrings were rendered
    assert "--gpu-memory" in (tmp_path / "site" / "api" / "cli" / "index.html").read_text()  # plan --help, by the hook


# ---- python blocks ---------------------------------------------------------------------------------


def _public_names() -> dict[str, object]:
    """Names a snippet may use without importing them: the package's public API."""
    import lightning_disttrain as ldt
    from lightning_disttrain import callbacks, strategies
    from lightning_disttrain.fault_tolerance import FaultTolerance

    names = {n: getattr(ldt, n) for n in ldt.__all__}
    names |= {n: getattr(strategies, n) for n in strategies.__all__}
    names |= {n: getattr(callbacks, n) for n in callbacks.__all__}
    names["FaultTolerance"] = FaultTolerance
    return names


def _resolve_dotted(dotted: str):
    """``lightning_disttrain.a.b.C`` -> the object; AssertionError naming what is missing."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[:i + 1]))
        except ModuleNotFoundError:
            raise AssertionError(f"{'.'.join(parts[:i + 1])} does not exist") from None
    return obj


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _parameters(obj) -> set[str] | None:
    """The keyword names ``obj(...)`` accepts, None when it takes ``**kwargs`` it does not forward
    to a class of the package."""
    if inspect.isclass(obj):
        names: set[str] = set()
        for cls in obj.__mro__:
            if not cls.__module__.startswith("lightning_disttrain") or "__init__" not in vars(cls):
                continue
            params = inspect.signature(cls.__init__).parameters.values()
            names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
            if not any(p.kind is p.VAR_KEYWORD for p in params):
                return names - {"self"}
        return None  # **kwargs reach a class outside the package (Lightning's): not checked
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is not p.VAR_POSITIONAL}


def _ours(obj) -> bool:
    return getattr(obj, "__module__", "").startswith("lightning_disttrain") and callable(obj)


def _check_python(block: Block) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    tree = compile(block.code, block.where(), "exec", flags=ast.PyCF_ONLY_AST)
    bound: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning_disttrain":
            module = _resolve_dotted(node.module)
            for alias in node.names:
                bound[alias.asname or alias.name] = _resolve_dotted(f"{node.module}.{alias.name}") \
                    if not hasattr(module, alias.name) else getattr(module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lightning_disttrain":
                    _resolve_dotted(alias.name)
    public = _public_names()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (_dotted(node) or "").startswith("lightning_disttrain."):
            _resolve_dotted(_dotted(node))
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg == "strategy" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                assert kw.value.value in StrategyRegistry, f"strategy={kw.value.value!r} is not a registered strategy"
        name = _dotted(node.func)
        if not name:
            continue
        head, _, rest = name.partition(".")
        if head == "lightning_disttrain":
            obj = _resolve_dotted(name)
        elif head in bound or (head in public and head not in _assigned(tree)):
            obj = bound.get(head, public.get(head))
            for attr in filter(None, rest.split(".")):
                assert hasattr(obj, attr), f"{name}: {head} has no attribute {attr!r}"
                obj = getattr(obj, attr)
        else:
            continue
        if not _ours(obj):
            continue
        accepted = _parameters(obj)
        if accepted is None:
            continue
        unknown = [kw.arg for kw in node.keywords if kw.arg is not None and kw.arg not in accepted]
        assert not unknown, f"{name}(...) has no parameter {unknown}; it takes {sorted(accepted)}"


def _assigned(tree: ast.AST) -> set[str]:
    return {t.id for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.ClassDef, ast.FunctionDef))
            for t in (node.targets if isinstance(node, ast.Assign) else [node]) if hasattr(t, "id")} | {
        node.name for node in ast.walk(tree) if isinstance(node, (ast.ClassDef, ast.FunctionDef))}


PYTHON = [b for b in ALL_BLOCKS if b.lang == "python"]


@pytest.mark.parametrize("block", PYTHON, ids=_ids(PYTHON))
def test_python_block(block):
    _check_python(block)
    needs_gpus = re.search(r"\bdevices=([3-9]|\d\d)", block.code) or re.search(r"[\'\"](cuda|gpu)[\'\"]", block.code)
    assert block.gpu or not needs_gpus, f"{block.where()} asks for GPUs: put {GPU_MARK} on the line before the block"


RUNNABLE = [b for b in PYTHON if b.run]


@pytest.mark.parametrize("block", RUNNABLE, ids=_ids(RUNNABLE))
def test_runnable_python_block_runs(block):
    """Blocks marked ``<!-- run -->`` (strategy and callback constructions, a plan class) are
    executed, with ``L`` and the public names bound as a reader's imports would bind them: the
    arguments they show are accepted by the constructors' own validation."""
    import lightning as L

    namespace = {"__name__": "docs_snippet", "L": L, **_public_names()}
    exec(compile(block.code, block.where(), "exec"), namespace)


def test_some_blocks_run():
    assert len(RUNNABLE) >= 5, _ids(RUNNABLE)


# ---- yaml blocks -----------------------------------------------------------------------------------


def _class_nodes(node):
    if isinstance(node, dict):
        if isinstance(node.get("class_path"), str):
            yield node
        for value in node.values():
            yield from _class_nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _class_nodes(value)


YAML = [b for b in ALL_BLOCKS if b.lang == "yaml"]


@pytest.mark.parametrize("block", YAML, ids=_ids(YAML))
def test_yaml_block(block):
    for node in _class_nodes(yaml.safe_load(block.code)):
        if not node["class_path"].startswith("lightning_disttrain"):
            continue
        obj = _resolve_dotted(node["class_path"])
        accepted = _parameters(obj)
        unknown = sorted(set(node.get("init_args") or {}) - (accepted or set())) if accepted is not None else []
        assert not unknown, f"{node['class_path']} has no parameter {unknown}"


# ---- shell blocks ----------------------------------------------------------------------------------


class _Parsed(BaseException):
    """Raised where a command would start its work: its arguments parsed, nothing run."""


def _commands(block: Block) -> list[list[str]]:
    """The simple commands of a bash block (or of the ``$`` lines of a console block)."""
    lines = block.code.splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    commands = []
    for line in text.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        current: list[str] = []
        for token in lex:
            if token in ("&&", "||", ";", "|", "&"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    cleaned = []
    for words in commands:
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]  # VAR=value before the command
        if words:
            cleaned.append([w[1:-1] if w.startswith("[") and w.endswith("]") else w for w in words])
    return cleaned


def _config_arg(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _parse_lightning(args: list[str], monkeypatch) -> None:
    """LightningCLI's parse of ``fit ...`` (the config read, every key and class_path checked),
    stopped before the classes are instantiated."""
    from lightning_disttrain import cli

    def stop(self):
        raise _Parsed()

    monkeypatch.setattr(cli.DistTrainCLI, "instantiate_classes", stop)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli.DistTrainCLI(args=args, run_errors=None, subcommand=args[0])
    except _Parsed:
        return
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"lightning-disttrain {' '.join(args)}: {err.getvalue().strip()[-800:]}"
        return
    raise AssertionError(f"lightning-disttrain {' '.join(args)} was not stopped before instantiation")


def _parse_tool(args: list[str], monkeypatch) -> None:
    """A tool's argparse parse of its arguments (``--help`` included), stopped before it runs."""
    from lightning_disttrain import cli

    module, fn, _ = cli._TOOLS[args[0]]
    parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    inside = []

    def parse_then_stop(self, argv=None, namespace=None):
        inside.append(True)  # parse_args calls parse_known_args, then rejects what is left
        parse_args(self, argv, namespace)
        raise _Parsed()

    def parse_known_then_stop(self, argv=None, namespace=None):
        result = parse_known_args(self, argv, namespace)
        if inside:
            return result
        raise _Parsed()  # a tool that forwards the rest (ft-local passes it on to fit)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_then_stop)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            getattr(importlib.import_module(module), fn)(args[1:])
    except _Parsed:
        return
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"lightning-disttrain {' '.join(args)}: {err.getvalue().strip()[-800:]}"
        return
    raise AssertionError(f"lightning-disttrain {' '.join(args)} ran past its argument parsing")


def _extras(words: list[str]) -> list[str]:
    found = []
    for word in words:
        m = re.search(r"\[([\w,\s-]+)\]$", word)
        if m and (word.startswith(".") or word.startswith("lightning-disttrain")):
            found += [e.strip() for e in m.group(1).split(",")]
    return found


def _check_shell(block: Block, monkeypatch) -> None:
    from lightning_disttrain import cli

    monkeypatch.chdir(REPO)
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for words in _commands(block):
        command, args = words[0], words[1:]
        config = _config_arg(args)
        if config and config.startswith("configs/"):
            assert (REPO / config).is_file(), f"{block.where()}: {config} does not exist"
        if command == "lightning-disttrain":
            assert args, f"{block.where()}: lightning-disttrain without a subcommand"
            sub = args[0]
            if sub in LIGHTHTNING_SUBCOMMANDS_SET:
                if config and config.startswith("configs/"):
                    accelerator = ((yaml.safe_load((REPO / config).read_text()) or {}).get("trainer") or {}).get(
                        "accelerator")
                    assert block.gpu or accelerator != "gpu", (
                        f"{block.where()}: {config} runs on GPUs: put {GPU_MARK} on the line before the block")
                elif config:  # a user's own file (my.yaml, a plan's output): check the options on a real one
                    args = [a if a != config else "configs/quickstart.yaml" for a in args]
                _parse_lightning(args, monkeypatch)
            else:
                assert sub in cli._TOOLS, f"{block.where()}: lightning-disttrain has no subcommand {sub!r}"
                _parse_tool(args, monkeypatch)
        elif command in ("python", "python3", "torchrun", "bash", "srun"):
            if args[:1] == ["-m"]:
                assert importlib.util.find_spec(args[1]) is not None, f"{block.where()}: no module {args[1]}"
                continue
            scripts = [a for a in args if a.endswith((".py", ".sh")) and not a.startswith("-")]
            for script in scripts[:1]:
                assert (REPO / script).is_file(), f"{block.where()}: {script} does not exist"
        elif command == "pip":
            unknown = [e for e in _extras(args) if e not in declared]
            assert not unknown, f"{block.where()}: pip extras {unknown} are not in pyproject.toml ({sorted(declared)})"


LIGHTHTNING_SUBCOMMANDS_SET = set(LIGHTNING_SUBCOMMANDS)
SHELL = [b for b in ALL_BLOCKS if b.lang in ("bash", "console", "sh", "shell")]


@pytest.mark.parametrize("block", SHELL, ids=_ids(SHELL))
def test_shell_block(block, monkeypatch):
    _check_shell(block, monkeypatch)


def test_every_block_is_checked_or_out_of_scope():
    """A block in a language the checks above do not read would drift unnoticed."""
    unchecked = [b.where() for b in ALL_BLOCKS if b.lang not in ("python", "yaml", "bash", "console", "sh", "shell")
                 and b.path != DOCS / "benchmarks.md" and b.path != DOCS / "architecture.md"]
    assert not unchecked, f"tag these blocks python / yaml / bash / console (or text for output): {unchecked}"


def test_benchmark_logs_name_existing_scripts():
    missing = []
    for block in _blocks(DOCS / "benchmarks.md"):
        for line in block.code.splitlines():
            m = re.match(r"^\s*(?:python|bash)\s+(benchmarks/\S+)", line)
            if m and not (REPO / m.group(1)).is_file():
                missing.append(f"{block.where()}: {m.group(1)}")
    assert not missing, missing


# ---- troubleshooting -------------------------------------------------------------------------------


def _package_messages() -> list[str]:
    """Every string literal of the package, f-strings with NUL where a value goes."""
    messages = []
    for path in (REPO / "lightning_disttrain").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                messages.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                messages.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
    return messages


def test_troubleshooting_messages_are_the_package_messages():
    headings = re.findall(r"^### `(.+)`\s*$", (DOCS / "troubleshooting.md").read_text(), flags=re.M)
    assert len(headings) >= 20, headings
    messages = _package_messages()
    stale = []
    for heading in headings:
        parts = re.split(r"<[^>]*>", heading)
        pattern = ".*?".join(re.escape(part) for part in parts)
        longest = max(parts, key=len)
        if not any(re.search(pattern, message, flags=re.S) for message in messages if longest in message):
            stale.append(heading)
    assert not stale, f"no longer a message of the package (update docs/troubleshooting.md): {stale}"


# ---- the README as a front page --------------------------------------------------------------------


def test_readme_set_up_commands_are_the_ones_ci_runs():
    readme = (REPO / "README.md").read_text()
    commands = [b.code.strip() for b in _blocks(REPO / "README.md") if b.lang == "bash"]
    assert QUICKSTART in commands and TEST_COMMAND in commands, commands
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in ci, "the README's test command, verbatim, is a line of .ci/run"
    assert len(readme.splitlines()) <= 220, "the README is a front page: move detail into docs/"


def test_readme_links_resolve_and_reach_every_guide():
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [t.split("#")[0] for t in targets if not re.match(r"^[a-z]+://", t)]
    missing = [t for t in local if not (REPO / t).exists()]
    assert not missing, missing
    guides = {p.relative_to(REPO).as_posix() for p in (DOCS / "guides").glob("*.md")}
    unlinked = sorted(guides - set(local))
    assert not unlinked, f"every guide is one click from the README's feature table: {unlinked}"
