"""Imported at start-up by every Python process the test suite starts (tests/conftest.py puts this
folder first on ``PYTHONPATH``), and by the pytest process itself: the suite's start-up cost.

``import lightning`` imports torchmetrics, and torchmetrics imports its optional text metrics'
``transformers`` and its plots' ``matplotlib`` whenever they are installed. The test extra
installs both (the HF-interop tests and ``plan --plot`` need them), so each of the ~200 processes
the suite starts paid ~1.5 s more than a user's process without them does (``import
lightning_disttrain.cli``: 5.2 -> 3.6 s user time on the 2-core machine, 2026-12-04). Nothing here
uses torchmetrics' BERTScore or its plots: its four availability flags are set False as its
``utilities.imports`` module is executed. ``transformers`` and ``matplotlib`` themselves stay
importable as ever (our HF interop and ``plan --plot`` import them directly). Only torchmetrics'
flags change; nothing of lightning_disttrain's is touched. ``LDT_TEST_FULL_IMPORTS=1`` turns it off.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_MODULE = "torchmetrics.utilities.imports"
_FLAGS = ("_TRANSFORMERS_AVAILABLE", "_TRANSFORMERS_GREATER_EQUAL_4_4", "_TRANSFORMERS_GREATER_EQUAL_4_10",
          "_MATPLOTLIB_AVAILABLE")


class _TorchmetricsOptionalImportsOff(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            for flag in _FLAGS:
                if hasattr(module, flag):
                    setattr(module, flag, False)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    # by class name: tests/conftest.py loads this file again under another module name
    if os.environ.get("LDT_TEST_FULL_IMPORTS") != "1" and _MODULE not in sys.modules and not any(
            type(f).__name__ == _TorchmetricsOptionalImportsOff.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchmetricsOptionalImportsOff())


install()
