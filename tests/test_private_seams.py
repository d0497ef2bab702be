"""Every use of a Lightning or torch private lives in one module each (issue 23): Lightning's in
``lightning_disttrain/_lightning_compat.py``, torch's in ``lightning_disttrain/_torch_compat.py``.
Elsewhere in the package, this test fails on:

- an import of a private name or from a private module of torch, Lightning, torchao, jsonargparse
  (``from torch.utils._pytree import tree_leaves``, ``from lightning... import _PATH``);
- a private attribute read or written on an object that is not ours (``connector._ckpt_path``,
  ``torch._foreach_mul_``, ``module._modules``), also through ``getattr``/``setattr``/``hasattr``
  with a constant name;
- ``self._x`` in a class when ``_x`` is a private of one of its torch/Lightning base classes
  (``self._precision_plugin`` in a Strategy), or when ``_x`` is defined nowhere in our package;
- a method of ours that overrides a base class's private (``def _configure_launcher``).

What counts as ours: a private name the package defines (a ``def``/``class``, a ``self._x =`` or
``cls._x =`` in one of our classes, a module-level name); on an object other than ``self``, only
where no torch/Lightning base class of ours has that private too; a tag we put on a foreign object starts with ``_ldt_``. Operator names under
``torch.ops``/``aten`` (``aten._scaled_mm``) are ATen schema names, not Python privates, and
``os._exit`` is documented Python: both pass.

The seams themselves are checked by ``tests/test_lightning_compat.py`` and ``tests/test_torch_compat.py``: every private they rely on exists
in the installed versions, and each accessor fails loudly (not silently) when it does not.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest

PKG = "lightning_disttrain"
SEAMS = {"_lightning_compat.py", "_torch_compat.py"}
FOREIGN = ("torch", "lightning", "torchao", "jsonargparse", "lightning_utilities", "torchmetrics")
OUR_TAG = "_ldt_"
DOCUMENTED = {("os", "_exit")}  # os._exit is public, documented Python
OP_NAMESPACES = {"aten", "ops", "prims"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root() -> Path:
    return Path(importlib.import_module(PKG).__file__).parent


_PARSED: dict[tuple[Path, str], ast.Module] = {}


def _parse(path: Path) -> ast.Module:
    """A source file's tree, parsed once per content (each test here scans the whole package; the
    trees are only read)."""
    text = path.read_text()
    if (path, text) not in _PARSED:
        _PARSED[path, text] = ast.parse(text, filename=str(path))
    return _PARSED[path, text]


def _files() -> dict[Path, ast.Module]:
    return {p: _parse(p) for p in sorted(_root().rglob("*.py"))}


def _module_name(path: Path) -> str:
    parts = [PKG, *path.relative_to(_root()).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _self_names(source: str) -> set[str]:
    """Private names a class body touches as ``self._x``/``cls._x`` or defines."""
    out = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            if _private(node.attr):
                out.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
            out.add(node.name)
    return out


_FOREIGN_CACHE: dict[type, set[str]] = {}


def foreign_privates(cls: type) -> set[str]:
    """The private names the torch/Lightning classes in ``cls``'s MRO define or use on self."""
    names: set[str] = set()
    for base in cls.__mro__[1:]:
        if base.__module__.split(".")[0] not in FOREIGN:
            continue
        if base not in _FOREIGN_CACHE:
            found = {n for n in vars(base) if _private(n)}
            try:
                found |= _self_names(inspect.getsource(base))
            except (OSError, TypeError, SyntaxError):
                pass
            _FOREIGN_CACHE[base] = found
        names |= _FOREIGN_CACHE[base]
    return names


def _classes(path: Path, tree: ast.Module) -> dict[ast.ClassDef, type | None]:
    """Our class definitions, with the runtime class (None where it is nested or conditional)."""
    module = importlib.import_module(_module_name(path))
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            cls = getattr(module, node.name, None)
            out[node] = cls if isinstance(cls, type) and cls.__module__ == module.__name__ else None
    return out


def _own_names(trees: dict[Path, ast.Module], classes: dict[ast.ClassDef, type | None]) -> set[str]:
    own = set()
    for path, tree in trees.items():
        if path.name in SEAMS:
            continue  # what the seams touch is the foreign privates themselves
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") and _private(node.attr)):
                own.add(node.attr)
            elif isinstance(node, ast.alias) and node.asname and _private(node.asname):
                own.add(node.asname)
    return own


def _foreign_all(classes: dict[ast.ClassDef, type | None]) -> set[str]:
    out: set[str] = set()
    for cls in classes.values():
        if cls is not None:
            out |= foreign_privates(cls)
    return out


def _chain_root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _chain_names(node: ast.AST) -> set[str]:
    out = set()
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            out.add(node.attr)
        node = node.func if isinstance(node, ast.Call) else node.value
    if isinstance(node, ast.Name):
        out.add(node.id)
    return out


def violations(extra: dict[str, str] | None = None) -> list[str]:
    """Every forbidden use, as ``path:line: what``; ``extra`` adds sources (name -> text) that are
    scanned but not imported (the probes of ``test_the_scan_catches``)."""
    trees = _files()
    classes: dict[ast.ClassDef, type | None] = {}
    for path, tree in trees.items():
        classes.update(_classes(path, tree))
    for name, text in (extra or {}).items():
        trees[_root() / name] = ast.parse(text)
    own = _own_names(trees, classes)
    # on an object not ``self``: ours only where no torch/Lightning base of ours has the name too
    # (``self._device_mesh`` is ours in the strategy, ``module._device_mesh`` is LightningModule's)
    own_elsewhere = own - _foreign_all(classes)
    found: list[str] = []
    for path, tree in trees.items():
        if path.name in SEAMS:
            continue
        rel = path.relative_to(_root().parent)

        def report(node: ast.AST, what: str) -> None:
            found.append(f"{rel}:{node.lineno}: {what}")

        # which class each node is in (for self._x)
        enclosing: dict[ast.AST, ast.ClassDef] = {}
        for cdef in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            for sub in ast.walk(cdef):
                enclosing.setdefault(sub, cdef) if sub is cdef else enclosing.__setitem__(sub, cdef)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                parts = node.module.split(".")
                if parts[0] in FOREIGN and (any(map(_private, parts)) or any(_private(a.name) for a in node.names)):
                    report(node, f"private import from {node.module}: {[a.name for a in node.names]}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] in FOREIGN and any(map(_private, parts)):
                        report(node, f"private import {alias.name}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                cdef = enclosing.get(node)
                cls = classes.get(cdef) if cdef is not None else None
                if cls is not None and node.name in foreign_privates(cls):
                    report(node, f"{cls.__name__}.{node.name} overrides a private of a torch/Lightning base class")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                check_attribute(node, node.value, node.attr, enclosing, classes, own, own_elsewhere, report)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value)):
                check_attribute(node, node.args[0], node.args[1].value, enclosing, classes, own, own_elsewhere, report)
    return found


def check_attribute(node, value, attr, enclosing, classes, own, own_elsewhere, report) -> None:
    if attr.startswith(OUR_TAG):
        return  # our tag on an object (a module, an optimizer)
    if isinstance(value, ast.Name) and value.id in ("self", "cls"):
        cdef = enclosing.get(node)
        cls = classes.get(cdef) if cdef is not None else None
        if cls is not None and attr in foreign_privates(cls):
            report(node, f"self.{attr}: a private of a torch/Lightning base class of {cls.__name__}")
        elif attr not in own:
            report(node, f"self.{attr}: defined nowhere in {PKG} (a private of a base class?)")
        return
    if _chain_names(value) & OP_NAMESPACES:
        return  # torch.ops.aten._scaled_mm: an operator's schema name
    if isinstance(value, ast.Name) and (value.id, attr) in DOCUMENTED:
        return
    if attr not in own_elsewhere:
        report(node, f"{ast.unparse(value)[:60]}.{attr}: a private of a torch/Lightning object")


def test_privates_live_in_the_seams():
    found = violations()
    assert not found, ("torch/Lightning privates outside lightning_disttrain/_lightning_compat.py and "
                       "_torch_compat.py (move each behind an accessor there, with its why):\n" + "\n".join(found))


@pytest.mark.parametrize("source, expected", [
    ("from torch.utils._pytree import tree_leaves", "private import"),
    ("import torch\ntorch._foreach_mul_([], 1.0)", "torch._foreach_mul_"),
    ("def f(trainer):\n    return trainer._checkpoint_connector", "_checkpoint_connector"),
    ("def f(m):\n    return getattr(m, '_modules')", "._modules"),
    ("class S:\n    def f(self):\n        return self._launcher", "self._launcher"),
])
def test_the_scan_catches(source, expected):
    """The scan is not vacuous: each kind of use it forbids is reported in a probe source."""
    found = [v for v in violations({"probe_module.py": source}) if "probe_module" in v]
    assert any(expected in v for v in found), found
