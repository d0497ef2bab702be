"""A disk that fills up, for fault-injection tests: files opened for writing whose path contains
``match`` accept ``budget`` bytes in all, then every write fails with ``OSError(ENOSPC)`` after
writing the part that still fitted, as a full filesystem does.

It sits under everything the checkpoint code writes through Python (``io.open``: DCP's shard
files, the RNG files, the manifest); the code under test is unchanged. ``torch.save`` to a path
writes natively and is not covered. Install it in the process that should see the full disk (one
rank of a launch, or the test process) and undo it with the returned function.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
from typing import Any, Callable


class _Budget:
    def __init__(self, budget: int) -> None:
        self.left = budget


class _FillingFile:
    def __init__(self, f: Any, budget: _Budget, name: str) -> None:
        self._f, self._budget, self._name = f, budget, name

    def write(self, data) -> int:
        size = len(memoryview(data).cast("B")) if not isinstance(data, str) else len(data)
        if size <= self._budget.left:
            self._budget.left -= size
            return self._f.write(data)
        part, self._budget.left = self._budget.left, 0
        if part:
            self._f.write(data[:part])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._name)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._f.__exit__(*exc)

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def fill_disk(match: str, budget: int = 0) -> Callable[[], None]:
    """From now on, writes to paths containing ``match`` get ``budget`` bytes, then ENOSPC."""
    original = io.open
    left = _Budget(budget)

    def opener(file, mode="r", *args, **kwargs):
        f = original(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and match in os.fspath(file) and any(c in mode for c in "wax+"):
            return _FillingFile(f, left, os.fspath(file))
        return f

    io.open = builtins.open = opener

    def undo() -> None:
        io.open = builtins.open = original

    return undo
