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

The suite's own scripts (a main script under ``tests/``: the shared launches' ``multi_worker.py``,
the checkpoint, preemption, fault-tolerance and multi-node scripts, and the ranks Lightning starts
from them) skip the interpreter's last garbage collection: ``gc.freeze()`` runs as their last
``atexit`` handler, after every other. With torch and Lightning imported that collection walks
~330,000 objects and frees them one by one: about 1 s of CPU per process (``python
benchmarks/bench_suite_time.py exits``: 4.63 -> 3.63 s user+sys, docs/benchmarks.md section 26),
over the ~60 such processes a run starts. Everything else at exit still runs (atexit handlers,
module teardown, objects freed by reference count); objects kept alive only by reference cycles
(meshes, process groups) are left to the operating system, so a crash in their finalisation (as
section 25's gloo abort) would not show in these scripts, the shared launches' ranks included. The
package's own processes (``lightning-disttrain``, ``python -m lightning_disttrain``, the examples)
exit exactly as a user's do, finalisation included: the tests of the CLI's exit see everything.
``LDT_TEST_FULL_EXIT=1`` turns it off.
"""

from __future__ import annotations

import atexit
import gc
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

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the suite's tests/ folder


def _skip_the_last_collection_in_test_scripts() -> None:
    argv0 = sys.argv[0] if getattr(sys, "argv", None) else ""
    main = os.path.abspath(argv0) if argv0 not in ("", "-c", "-m") else ""  # -c: no script (-m: runpy set it)
    if os.environ.get("LDT_TEST_FULL_EXIT") != "1" and main.startswith(_TESTS + os.sep) and os.path.isfile(main):
        gc.freeze()


# Registered as this file loads, so it runs after every handler registered later (atexit: last in,
# first out). In the pytest process (tests/conftest.py loads this file too) it does nothing: pytest's
# main script is not under tests/.
atexit.register(_skip_the_last_collection_in_test_scripts)
