"""The package's layers, confirmed by its import graph: no module imports a module of a higher
layer, and no two packages (or modules) import each other. There is no exceptions list.

Layers, low to high (a module may import its own layer and the ones below; ``docs/architecture.md``,
"Layout", says the same in words):

0. foundation: ``comm.py`` (every collective), ``rank_errors.py``, ``startup_signals.py``, ``young_daly.py`` (the
   checkpoint-interval formula the planner and the cadence share), ``peak_flops.py`` (the chip
   table MFU and the planner share), ``_lightning_compat.py`` and ``_torch_compat.py`` (every use
   of a Lightning or torch private, see ``tests/test_private_seams.py``). Plain Python / torch /
   Lightning, importing nothing else of ours but each other.
1. core: ``models/`` (GPT, MoE, layout-independent init) and ``data/``. Plain torch, no Lightning
   in the models; neither imports checkpoint, parallel, planning, callbacks, strategies, evals.
2. building blocks: ``parallel/`` (incl. GPT's TP plan, ``parallel/gpt_tp.py``), ``checkpoint/``
   (DCP IO, manifest, discovery, cadence, the consolidated format and ``gpt_from_exported``),
   ``optim.py``, ``planning/`` (arithmetic), ``fault_tolerance/`` (torchft's Manager and lighthouse for
   replica groups; the Lightning side is in ``strategies/``), and the Hugging Face format mapping
   ``models/hf.py`` + ``models/hf_config.py`` (plain torch over ``models`` and ``data``; it sits
   here, not at the top, because ``GPTModule(init_from=HF_DIR)`` in ``module.py`` uses it).
3. Lightning pieces: ``module.py`` (GPTModule), ``callbacks/``, ``evals/``, ``loggers.py``.
4. strategies: ``strategies/`` (they install callbacks, e.g. the signal-safety
   ``PreemptionCheckpoint``; callbacks recognise a DCP strategy by its
   ``saves_checkpoint_directories`` marker instead of importing it).
5. interop and entry points: ``checkpoint/hf_export.py`` (a checkpoint as a Hugging Face
   directory), the command modules (``*/command.py``), ``cli.py`` and the package's own
   ``__init__.py`` (which re-exports the public API).

Every ``import`` / ``from ... import`` of ``lightning_disttrain`` counts, wherever it is: inside a
function (a lazy import is still a dependency), under ``if TYPE_CHECKING``, relative or absolute.
Importing a module runs its parents' ``__init__.py``: that is Python's package machinery, not a
dependency of the module, so only explicit imports are edges; a subpackage's ``__init__.py`` is a
module of that subpackage's layer like any other.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PKG = "lightning_disttrain"

FOUNDATION, CORE, BLOCKS, LIGHTNING, STRATEGIES, TOP = range(6)
LAYER_NAMES = ("foundation", "core", "building blocks", "Lightning pieces", "strategies", "interop/entry points")

# Most specific entry wins: a module's own name, else its closest listed package.
LAYERS: dict[str, int] = {
    PKG: TOP,  # lightning_disttrain/__init__.py: the public API, re-exported from everywhere
    f"{PKG}.cli": TOP,
    f"{PKG}.cli_hints": TOP,  # the "did you mean" of cli.py's parser errors
    f"{PKG}.comm": FOUNDATION,
    f"{PKG}.rank_errors": FOUNDATION,
    f"{PKG}.startup_signals": FOUNDATION,
    f"{PKG}.young_daly": FOUNDATION,
    f"{PKG}.peak_flops": FOUNDATION,
    f"{PKG}._lightning_compat": FOUNDATION,
    f"{PKG}._torch_compat": FOUNDATION,
    f"{PKG}.models": CORE,
    f"{PKG}.data": CORE,
    f"{PKG}.models.hf": BLOCKS,
    f"{PKG}.models.hf_config": BLOCKS,
    f"{PKG}.parallel": BLOCKS,
    f"{PKG}.checkpoint": BLOCKS,
    f"{PKG}.optim": BLOCKS,
    f"{PKG}.planning": BLOCKS,
    f"{PKG}.fault_tolerance": BLOCKS,
    f"{PKG}.module": LIGHTNING,
    f"{PKG}.callbacks": LIGHTNING,
    f"{PKG}.evals": LIGHTNING,
    f"{PKG}.loggers": LIGHTNING,
    f"{PKG}.strategies": STRATEGIES,
    f"{PKG}.checkpoint.hf_export": TOP,
}
COMMAND_MODULE = "command"  # <subpackage>/command.py: an entry point of the CLI, at the top


def package_root() -> Path:
    spec = importlib.util.find_spec(PKG)  # finds the package without importing it (or Lightning)
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


def module_names(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PKG, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (a ``from pkg import name`` edge goes to the
    submodule ``pkg.name`` when there is one, else to ``pkg``)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name == PKG or a.name.startswith(PKG + "."))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source != PKG and not source.startswith(PKG + "."):
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.add(sub if sub in modules else source)
        unknown = {t for t in targets if t not in modules}
        assert not unknown, f"{name} imports {sorted(unknown)}, which are not modules of {PKG}"
        graph[name] = targets - {name}
    return graph


def layer_of(module: str) -> int:
    if module.rsplit(".", 1)[-1] == COMMAND_MODULE:
        return TOP
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:i])) in LAYERS and (i > 1 or module == PKG):
            return LAYERS[prefix]
    raise AssertionError(f"{module} has no layer: add it (or its package) to LAYERS in {__file__} "
                         f"and to the Layout section of docs/architecture.md")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{src} (layer {layer_of(src)}, {LAYER_NAMES[layer_of(src)]}) imports {dst} "
            f"(layer {layer_of(dst)}, {LAYER_NAMES[layer_of(dst)]})"
            for src, dsts in sorted(graph.items()) for dst in sorted(dsts) if layer_of(dst) > layer_of(src)]


def package_of(module: str) -> str:
    """The unit for cycles between packages: ``lightning_disttrain.<first component>``, except for a
    module placed in another layer than its package (``evals/command.py``, ``models/hf.py``), which
    is a unit of its own: ``evals.command`` importing the strategies, which import the callbacks,
    which import ``evals.suite``, is a chain up the layers, not a cycle."""
    package = ".".join(module.split(".")[:2])
    return package if layer_of(module) == layer_of(package) else module


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        out.setdefault(package_of(src), set()).update(package_of(d) for d in dsts if package_of(d) != package_of(src))
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(module_names(package_root()))


def test_every_module_has_a_layer(graph):
    for module in graph:
        layer_of(module)


def test_no_module_imports_a_higher_layer(graph):
    upward = upward_imports(graph)
    assert not upward, "imports against the layering (see this file's docstring):\n" + "\n".join(upward)


def test_no_import_cycles_between_modules(graph):
    assert not cycles(graph), f"modules that import each other: {cycles(graph)}"


def test_no_import_cycles_between_packages(graph):
    packages = package_graph(graph)
    assert not cycles(packages), f"packages that import each other: {cycles(packages)}"


def test_the_checker_sees_upward_lazy_and_relative_imports(tmp_path):
    """The checks above are only as good as the graph: a lazy import inside a function and a
    relative one are edges, and an upward edge or a cycle is reported."""
    root = tmp_path / PKG
    (root / "models").mkdir(parents=True)
    (root / "checkpoint").mkdir()
    (root / "__init__.py").write_text("")
    (root / "models" / "__init__.py").write_text("")
    (root / "checkpoint" / "__init__.py").write_text("")
    (root / "models" / "gpt.py").write_text("def load():\n    from ..checkpoint import consolidate\n")
    (root / "checkpoint" / "consolidate.py").write_text("from lightning_disttrain.models.gpt import load\n")
    fake = import_graph(module_names(root))
    assert fake[f"{PKG}.models.gpt"] == {f"{PKG}.checkpoint.consolidate"}
    assert upward_imports(fake) == [f"{PKG}.models.gpt (layer 1, core) imports {PKG}.checkpoint.consolidate "
                                    f"(layer 2, building blocks)"]
    assert cycles(fake) == [[f"{PKG}.checkpoint.consolidate", f"{PKG}.models.gpt"]]
    assert cycles(package_graph(fake)) == [[f"{PKG}.checkpoint", f"{PKG}.models"]]
