"""Every constructor argument of the public classes is documented in the docstring mkdocstrings
renders for the class (``merge_init_into_class: true``: the class docstring plus ``__init__``'s),
each under its own ``name:`` entry of an ``Args:`` section, so the API reference answers "what
does this argument do" for every argument (issue 39)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap

import pytest

import lightning_disttrain
from lightning_disttrain import callbacks, cli, strategies
from lightning_disttrain.fault_tolerance import FaultTolerance


def _public_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    for module in (lightning_disttrain, strategies, callbacks):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                found[name] = obj
    # Also on the API pages (docs/api/cli.md, docs/api/strategies.md).
    found["DistTrainCLI"] = cli.DistTrainCLI
    found["FaultTolerance"] = FaultTolerance
    return found


PUBLIC = _public_classes()


def _rendered_doc(cls: type) -> str:
    """The class's own docstring and its own ``__init__``'s (never an inherited one: mkdocstrings
    does not show a base class's docstring for a class that has none)."""
    parts = [cls.__dict__.get("__doc__") or ""]
    init = cls.__dict__.get("__init__")
    if init is not None and init.__doc__:
        parts.append(init.__doc__)
    return "\n".join(inspect.cleandoc(p) for p in parts if p)


def _params(cls: type) -> list[str]:
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in inspect.signature(cls.__init__).parameters.values()
            if p.name != "self" and p.kind not in skip]


def _documented(doc: str, name: str) -> bool:
    """``name`` has an entry of its own: a line ``name: ...`` (or ``name (type): ...``)."""
    return re.search(rf"^[ \t]*{re.escape(name)}(?:[ \t]*\([^)\n]*\))?[ \t]*:", doc, re.MULTILINE) is not None


def test_the_public_classes_are_found():
    for name in ("GPTModule", "TokenDataModule", "NDParallelStrategy", "FSDP2Strategy", "MFUMonitor"):
        assert name in PUBLIC


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_init_argument_is_documented(name: str):
    cls = PUBLIC[name]
    doc = _rendered_doc(cls)
    missing = [p for p in _params(cls) if not _documented(doc, p)]
    assert not missing, (f"{cls.__module__}.{cls.__qualname__}: constructor arguments without their own "
                         f"'name: description' entry in the docstring: {', '.join(missing)}")


@pytest.mark.parametrize("name", sorted(n for n, c in PUBLIC.items() if dataclasses.is_dataclass(c)))
def test_a_dataclass_describes_each_field_once(name: str):
    # Under Args (rendered as its parameters, read by the CLI's --help), not again in an attribute
    # docstring below the field (rendered a second time as an attribute).
    cls = PUBLIC[name]
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    twice = [node.target.id for node, after in zip(body, body[1:])
             if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
             and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)]
    assert not twice, f"{name}: fields described again in attribute docstrings: {', '.join(twice)}"
