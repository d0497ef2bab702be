"""The embedded default corpus: the Python standard library's own `.py` sources.

Every machine that can run this package has this corpus, with no download and no file of ours:
about 730 files / 12 MB of real, varied text (code, docstrings, comments) on CPython 3.11,
enough to train a small GPT on CPU and see the loss fall.

What is in it, and why:
- every `*.py` file under `sysconfig.get_paths()["stdlib"]`, walked recursively without
  following symlinks;
- minus `site-packages` / `dist-packages` (third-party code: differs per machine);
- minus any directory named `test`, `tests` or `idle_test`: the test suite is larger than the
  library itself (19 MB), deliberately contains odd encodings and malformed files, and Linux
  distributions ship it separately (Debian's libpython3-testsuite), so leaving it out is what
  makes the corpus the same on more machines;
- minus `__pycache__`.

Files are listed in sorted order of their POSIX relative path, so the corpus (and hence every
sample drawn from it) is identical on every machine with the same Python build. Each file is one
document. A file goes to the validation split when the sha256 of its relative path is 0 mod
`VAL_EVERY` (about 1 in 50 files): a hash rather than "every 50th file" keeps a file's split
stable when a Python patch release adds or removes other files.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
VAL_EVERY = 50
SPLITS = ("train", "val")


@dataclass(frozen=True)
class EmbeddedFile:
    """One document of the embedded corpus."""

    relpath: str
    """POSIX path relative to the stdlib root: the sort key and the split key."""
    path: Path
    """Absolute path on this machine."""

    @property
    def split(self) -> str:
        return embedded_split(self.relpath)

    def read_text(self) -> str:
        # All of these files are UTF-8 on CPython 3.11; "replace" keeps a patched stdlib from
        # failing the whole corpus on one bad byte.
        return self.path.read_bytes().decode("utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def embedded_split(relpath: str) -> str:
    """"val" for about one file in VAL_EVERY, chosen by a hash of its relative path."""
    digest = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "little")
    return "val" if digest % VAL_EVERY == 0 else "train"


def embedded_files(split: str | None = None, root: Path | None = None) -> list[EmbeddedFile]:
    """The corpus's files in their fixed order; only those of `split` when it is given."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}.")
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"the standard library directory {root} does not exist; the embedded corpus needs it.")
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append(EmbeddedFile(path.relative_to(root).as_posix(), path))
    found.sort(key=lambda f: f.relpath)
    if split is not None:
        found = [f for f in found if f.split == split]
    return found


def embedded_documents(split: str = "train", max_docs: int | None = None) -> Iterator[str]:
    """The texts of the corpus's `split` ("train" or "val"), one per file, in the fixed order."""
    files = embedded_files(split)
    if max_docs is not None:
        files = files[:max_docs]
    for f in files:
        yield f.read_text()


def embedded_fingerprint() -> str:
    """Identifies this machine's corpus: the Python version plus a hash of the file list and sizes.

    Part of the cache key, so a different Python (a different corpus) never reuses shards.
    """
    h = hashlib.sha256(sys.version.encode())
    for f in embedded_files():
        h.update(f"{f.relpath}\0{f.path.stat().st_size}\n".encode())
    return f"python{sys.version_info.major}.{sys.version_info.minor}-{h.hexdigest()[:16]}"
