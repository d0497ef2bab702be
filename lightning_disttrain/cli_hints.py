"""The "did you mean" of the ``lightning-disttrain`` command's parser errors (``cli._ShortErrorParser``).

jsonargparse reports a misspelt key or class as 8-12 lines ("Does not validate against any of the
Union subtypes", the union's members, the given value); the one line that names the mistake is in
the middle, and nothing suggests the right spelling. Each function here reads one kind of message
and returns the one line: the full key (``model.init_args.lrr``, ``trainer.callbacks[1].init_args.x``,
``trainr``, ``--trainer.max_stpes``), and the closest accepted name (difflib), or None when the
message is not its kind.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import re
from typing import Any

from lightning_disttrain import _lightning_compat as compat


def did_you_mean(word: str, choices) -> str:
    """``; did you mean 'x'?`` for the closest of ``choices`` (difflib's ratio >= 0.6), else ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def class_path_hint(message: str) -> str | None:
    """For a ``class_path`` that does not import: which one, and the closest name that does."""
    paths = re.findall(r"'class_path': '([\w.]+)'", message) + re.findall(r"given class_path '([\w.]+)'", message)
    for path in paths:
        if resolve(path) is not None:
            continue
        module_name, _, name = path.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return f"class_path {path!r}: no module {module_name!r}"
        names = [n for n in dir(module) if not n.startswith("_") and isinstance(getattr(module, n, None), type)]
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        return f"class_path {path!r} does not exist" + (f"; did you mean '{module_name}.{close[0]}'?" if close else
                                                        f" ({module_name} has no {name!r})")
    return None


def class_option_hint(message: str) -> str | None:
    """``Option 'lrr' is not accepted`` by a ``class_path``'s class (an ``init_args`` key, in YAML or as
    ``--model.init_args.lrr``): the full key, and the closest option that class accepts."""
    found = re.search(r"given class_path '([\w.]+)':\s*Option '([^']+)' is not accepted", message)
    if not found:
        return None
    path, option = found.groups()
    parser_key = re.search(r'Parser key "([^"]+)"', message)
    key = parser_key.group(1) if parser_key else ""
    given = re.search(r"^\s*Given value: (.*)$", message, re.MULTILINE)
    try:
        value = literal(ast.parse(given.group(1), mode="eval").body) if given else None
    except (ValueError, SyntaxError):
        value = None
    if isinstance(value, list):  # trainer.callbacks: the entry with this class and key
        index = next((i for i, item in enumerate(value) if isinstance(item, dict) and item.get("class_path") == path
                      and option in (item.get("init_args") or {})), None)
        key = f"{key}[{index}]" if index is not None else key
    prefix = f"{key}.init_args." if key else "init_args."
    cls = resolve(path)
    accepted = class_options(cls) if cls is not None else []
    close = difflib.get_close_matches(option, accepted, n=1, cutoff=0.6)
    name = getattr(cls, "__name__", path)
    return (f"{prefix}{option}: {name} has no option {option!r}"
            + (f"; did you mean '{prefix}{close[0]}'?" if close else f" (it has: {', '.join(accepted)})"))


def literal(node: ast.AST) -> Any:
    """A jsonargparse "Given value" as data: Python literals, and its ``Namespace(k=v)`` /
    ``NestedArg(k=v)`` as dicts (parsed, never evaluated)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Namespace", "NestedArg"):
        return {kw.arg: literal(kw.value) for kw in node.keywords}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {literal(k): literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def class_options(cls: type) -> list[str]:
    """The ``init_args`` keys jsonargparse accepts for ``cls`` (its signature, ``**kwargs`` followed)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    try:
        parser.add_class_arguments(cls)
    except Exception:  # noqa: BLE001  (a hint only: fall back to the plain signature)
        return [n for n in inspect.signature(cls).parameters if n not in ("args", "kwargs")]
    return [n for n in compat.parser_option_names(parser) if n not in ("config", "print_config")]


def unknown_key_hint(message: str, keys: list[str]) -> str | None:
    """``Option 'trainr.logger.init_args.save_dir' is not accepted`` (a YAML section that does not
    exist): the first part of the key that no option has, and the closest one there."""
    found = re.match(r"Option '([^']+)' is not accepted", message)
    if not found or not keys:
        return None
    parts = found.group(1).split(".")
    for depth in range(1, len(parts) + 1):
        known = {".".join(k.split(".")[:depth]) for k in keys if k.count(".") >= depth - 1}
        wrong = ".".join(parts[:depth])
        if wrong not in known:
            return f"{wrong}: no such key{did_you_mean(wrong, known)}"
    return None


def class_name_hint(message: str) -> str | None:
    """``--model GPTModul`` (a class name without its module): the closest class the package exports."""
    found = re.search(r"Expected a dot import path string: (\w+)", message)
    if not found:
        return None
    import lightning.pytorch.callbacks as pl_callbacks

    import lightning_disttrain.callbacks
    import lightning_disttrain.strategies

    names = {f"{module.__name__}.{n}": n for module in (lightning_disttrain, lightning_disttrain.callbacks,
                                                        lightning_disttrain.strategies, pl_callbacks)
             for n in dir(module) if isinstance(getattr(module, n, None), type) and not n.startswith("_")}
    close = difflib.get_close_matches(found.group(1), list(set(names.values())), n=1, cutoff=0.6)
    full = next((path for path, n in names.items() if close and n == close[0]), None)
    return f"class_path {found.group(1)!r} does not exist" + (f"; did you mean {full!r}?" if full else "")


def unrecognized_hint(message: str, parser) -> str | None:
    """``unrecognized arguments: --trainer.max_stpes 4``: the closest option the parser has."""
    found = re.match(r"unrecognized arguments: (--[^\s=]+)", message)
    if not found:
        return None
    options = [f"--{name}" for name in compat.parser_option_names(parser)]
    return f"unrecognized option {found.group(1)}{did_you_mean(found.group(1), options)}"


def resolve(class_path: str) -> Any:
    """The class (or object) at ``class_path``, or None when it does not import."""
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
