"""MkDocs hook: the CLI reference shows each tool's ``--help`` as the installed command prints it.

A page line ``<!-- cli-help: plan -->`` becomes a text block with ``lightning-disttrain plan
--help``, produced at build time by the tool's own parser (``lightning_disttrain.cli._TOOLS``), so
the reference of every option cannot drift from the code. ``--help`` makes argparse print and exit
before a tool does anything. Needs the package importable (``pip install -e ".[docs]"``).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re

_MARK = re.compile(r"^<!-- cli-help: ([\w-]+) -->$", flags=re.M)


def _help(tool: str) -> str:
    from lightning_disttrain import cli

    if tool not in cli._TOOLS:
        raise ValueError(f"<!-- cli-help: {tool} -->: lightning-disttrain has no tool {tool!r}; "
                         f"choose one of {sorted(cli._TOOLS)}")
    module, fn, _ = cli._TOOLS[tool]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            getattr(importlib.import_module(module), fn)(["--help"])
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                raise
        else:
            raise RuntimeError(f"lightning-disttrain {tool} --help did not stop after printing its help")
    return out.getvalue().rstrip()


def on_page_markdown(markdown: str, page, config, files) -> str:
    return _MARK.sub(lambda m: f"```text\n$ lightning-disttrain {m.group(1)} --help\n{_help(m.group(1))}\n```",
                     markdown)
