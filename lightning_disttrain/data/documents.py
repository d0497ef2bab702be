"""Where documents come from: the embedded corpus, local text/json/parquet files, hub datasets.

A document is one training text, preceded by EOT when tokenized. By source:
- "embedded": one per standard-library .py file (see `embedded.py`);
- local .txt / .md files: ONE DOCUMENT PER FILE, however large (tinyshakespeare is one
  document); split a corpus into files where it has document boundaries;
- local .json / .jsonl / .parquet (optionally compressed, e.g. .jsonl.gz): one per record;
- anything else: a Hugging Face dataset, one per record of `split`.
Local files are read with `datasets.load_dataset("text" | "json" | "parquet", data_files=...)`.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from .embedded import embedded_files, embedded_fingerprint

TEXT_EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text"}
RECORD_EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
COMPRESSION_SUFFIXES = {".gz", ".bz2", ".xz", ".zst", ".lz4"}


def open_documents(
    source: str | Sequence[str],
    *,
    text_field: str = "text",
    split: str = "train",
    dataset_config: str | None = None,
    streaming: bool = False,
    hf_cache_dir: str | None = None,
) -> tuple[Iterable[tuple[str, str | None]], int | None, str]:
    """(documents, their count if known, a description of the source) for `source`.

    Each document is `(text, split)`, where split is "train"/"val" when the source decides it
    (the embedded corpus) and None when `prepare`'s rule decides.
    """
    if isinstance(source, str) and source == "embedded":
        files = embedded_files()
        return (((f.read_text(), f.split) for f in files), len(files), f"embedded:{embedded_fingerprint()}")

    files = resolve_local_files(source)
    if files is not None:
        builder = _builder_for(files)
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        ds = _load_dataset(builder, data_files=[str(f) for f in files], split="train", cache_dir=hf_cache_dir, **kwargs)
        field = "text" if builder == "text" else text_field
        description = str(files[0]) if len(files) == 1 else f"{len(files)} files: {files[0]} ... {files[-1]}"
        return _iter_texts(ds, field, description), len(ds), description

    # A Hugging Face dataset. Downloads are kept in HF's own cache so a re-run is fast.
    ds = _load_dataset(source, name=dataset_config, split=split, streaming=streaming)
    num_docs = None if streaming else len(ds)
    return _iter_texts(ds, text_field, source), num_docs, source


def resolve_local_files(source: str | Sequence[str]) -> list[Path] | None:
    """The sorted local text files `source` names, or None when it names none (a hub dataset).

    A path that looks local (a glob, an existing path, a known extension) but matches nothing
    is an error, not a hub lookup: a typo should not turn into a download attempt.
    """
    if not isinstance(source, str):
        files = [Path(s) for s in source]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"source files do not exist: {missing[:5]}; check the paths.")
        return files
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p) is not None)
        if not files:
            raise ValueError(
                f"directory {path} holds no .txt/.md/.json/.jsonl/.parquet files; point source at the text files."
            )
        return files
    if path.is_file():
        return [path]
    if glob.has_magic(source):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"source glob {source!r} matches no files; check the pattern (quote it in a shell).")
        return files
    # "org/name" is a hub dataset; "./x", "/x", "~/x", "a/b/c" or "x.txt" can only mean a local path.
    if _kind(path) is not None or source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ValueError(f"source file {source!r} does not exist; check the path.")
    return None


def _kind(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes.pop()
    ext = suffixes[-1] if suffixes else ""
    return TEXT_EXTENSIONS.get(ext) or RECORD_EXTENSIONS.get(ext)


def _builder_for(files: list[Path]) -> str:
    kinds = {_kind(f) for f in files}
    if None in kinds:
        bad = [str(f) for f in files if _kind(f) is None][:3]
        raise ValueError(f"cannot tell the format of {bad}: use .txt/.md (text), .json/.jsonl or .parquet files.")
    if len(kinds) > 1:
        raise ValueError(f"source mixes file formats {sorted(kinds)}; prepare each format separately.")
    return kinds.pop()


def _load_dataset(path: str, **kwargs):
    import datasets  # heavy import (pyarrow, pandas): only when text is really loaded

    return datasets.load_dataset(path, **kwargs)


def _iter_texts(ds, field: str, description: str) -> Iterator[tuple[str, None]]:
    columns = ds.column_names
    if columns is not None and field not in columns:
        raise ValueError(f"{description} has no column {field!r} (columns: {columns}); pass text_field=<column>.")
    for batch in ds.iter(batch_size=1000):
        for text in batch[field]:
            yield (text or ""), None


def default_name(source: str | Sequence[str]) -> str:
    """The shard prefix for `source`: "embedded", a file's stem, a directory's or dataset's name."""
    if not isinstance(source, str):
        source = str(source[0]) if len(source) else "data"
    if source == "embedded":
        return "embedded"
    path = Path(source.rstrip("/"))
    if glob.has_magic(source):  # "data/books_*.txt" -> "books", "data/*.txt" -> "data"
        stem = re.split(r"[*?\[]", path.name)[0].strip("_-.") or path.parent.name
    else:
        stem = path.name
    while Path(stem).suffix.lower() in COMPRESSION_SUFFIXES | set(TEXT_EXTENSIONS) | set(RECORD_EXTENSIONS):
        stem = Path(stem).stem
    return re.sub(r"[^A-Za-z0-9.-]+", "-", stem).strip("-").lower() or "data"
