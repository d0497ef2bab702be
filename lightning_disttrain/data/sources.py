"""From a `source` string to train/val shard lists, preparing (once, cached) what is not shards yet.

Sources that already are shards are read in place:
- a `.bin` file, a directory (its `*.bin` files, not recursive) or a glob (`data/fineweb_*.bin`).
  Files are split by llm.c's naming: a file whose name has the word "val" (`fineweb_val_000000.bin`,
  `tiny_shakespeare_val.bin`) is validation, one with the word "train" is training; when no name
  has "train", every non-val file is training. A directory written by `prepare` is split by the
  shard lists in its meta.json instead. A source
  without val files leaves validation empty unless `val_source` is given.

Every other source ("embedded", a local text/json/parquet file, a Hugging Face dataset name) is
run through `prepare` once and cached in `<cache root>/<slug>-<key>`, where key hashes the source
(plus, for local files, their size and mtime, so an edited file is re-prepared), the tokenizer,
the `prepare` options and `PREPARE_VERSION`. The cache root is the `cache_dir` argument, else
$LIGHTNING_DISTTRAIN_CACHE, else ~/.cache/lightning_disttrain/tokens.

Safe under several processes and nodes: preparation happens under a file lock, into a temporary
directory renamed into place when complete, and a directory counts as prepared only once it
holds meta.json. Lightning calls `prepare_data` on local rank 0 only; the other ranks reach
`setup` after Lightning's barrier and find the directory done (on a node that does not share the
cache and did not prepare, the first process to take the lock prepares it).

A source that cannot be meant as written fails before any work, without a hub lookup: a path
(`./x`, `/x`, `~/x`, `a/b/c`, `x.txt`, `x.bin`, a glob, or `a/b` when `./a` exists) that does not
exist, and a bare word close to a keyword (`embeded`). Only the rest is a Hugging Face dataset
name, and when loading it fails the error names the source and what else it could have meant.
"""

from __future__ import annotations

import difflib
import glob
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .documents import (
    COMPRESSION_SUFFIXES,
    RECORD_EXTENSIONS,
    TEXT_EXTENSIONS,
    default_name,
    resolve_local_files,
)
from .embedded import embedded_fingerprint
from .prepare import PREPARE_VERSION, prepare
from .tokenizer import canonical_tokenizer_name

CACHE_ENV = "LIGHTNING_DISTTRAIN_CACHE"
_SPEED_OPTIONS = frozenset({"num_proc", "progress"})
KEYWORDS = ("embedded",)
SOURCE_FORMS = (
    "source takes 'embedded', llm.c shards (a .bin file, a directory or a glob of them), a local "
    ".txt/.md/.json/.jsonl/.parquet file or a directory of them, or a Hugging Face dataset name "
    "('org/name', e.g. 'HuggingFaceFW/fineweb-edu')"
)
_LOCAL_SUFFIXES = frozenset({".bin", *TEXT_EXTENSIONS, *RECORD_EXTENSIONS})


@dataclass(frozen=True)
class ShardSet:
    """The shards a datamodule reads."""

    train: tuple[Path, ...]
    val: tuple[Path, ...]
    description: str
    """What the shards came from, for error messages and logs."""
    meta: dict = field(default_factory=dict, compare=False)
    """meta.json of the directory when there is one (tokenizer, counts); {} otherwise."""


def default_cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "lightning_disttrain" / "tokens"


def is_shard_source(source: str) -> bool:
    """True for a .bin path or glob, or a directory that holds .bin files."""
    path = Path(source).expanduser()
    if path.is_dir():
        return any(path.glob("*.bin"))
    if glob.has_magic(source) and not source.endswith(".bin"):
        matches = glob.glob(os.path.expanduser(source))
        return bool(matches) and all(m.endswith(".bin") for m in matches)
    return source.endswith(".bin")


def find_shards(source: str, val_source: str | None = None) -> ShardSet:
    """The shards named by a `.bin` file, directory or glob, split train/val by file name.

    A directory written by `prepare` lists its shards in meta.json, which is used as is.
    """
    path = Path(source).expanduser()
    meta_path = (path if path.is_dir() else path.parent) / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if path.is_dir() and meta.get("train", {}).get("shards"):
        names = [*meta["train"]["shards"], *meta.get("val", {}).get("shards", [])]
        bad = [n for n in names if not isinstance(n, str) or n in ("", ".", "..") or Path(n).name != n]
        if bad:
            raise ValueError(f"{str(path / 'meta.json')!r} lists shards outside its directory ({bad[:3]}); a "
                             f"prepared directory names its shards as plain file names beside meta.json")
        train = [path / n for n in meta["train"]["shards"]]
        val = [path / n for n in meta.get("val", {}).get("shards", [])]
    else:
        files = _match_bin(source)
        val = [f for f in files if "val" in _name_words(f)]
        train = [f for f in files if "train" in _name_words(f) and f not in val]
        train = train or [f for f in files if f not in val]
    if val_source is not None:
        val = _match_bin(val_source)
    if not train:
        raise ValueError(
            f"source {source!r} has only validation shards ({[f.name for f in val][:3]}); "
            "point it at the training shards (llm.c names them *_train_*.bin)."
        )
    return ShardSet(tuple(train), tuple(val), source, meta)


def _name_words(path: Path) -> set[str]:
    # "fineweb_val_000000.bin" -> {"fineweb", "val", "000000", "bin"}: whole words, so that a
    # corpus called "eval" or "interval" is not mistaken for validation data.
    return set(re.split(r"[^a-z0-9]+", path.name.lower()))


def _match_bin(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.bin"))
        if not files:
            raise ValueError(f"directory {path} holds no .bin shards; run `prepare` into it or point source elsewhere.")
        return files
    if glob.has_magic(source):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source)) if Path(p).is_file())
        if not files:
            raise ValueError(f"shard glob {source!r} matches no files; check the pattern and the directory.")
        return files
    if not path.is_file():
        raise missing_path_error(source, "or run `prepare` first")
    return [path]


def cache_key(source: str, tokenizer: str, prepare_kwargs: dict) -> str:
    """`<slug>-<16 hex>` naming the prepared form of `source`; changes whenever its shards would.

    Options that change only how fast shards are made (num_proc, progress) are not part of it.
    """
    options = {k: v for k, v in prepare_kwargs.items() if k not in _SPEED_OPTIONS}
    if source == "embedded":
        identity: object = embedded_fingerprint()
    else:
        files = resolve_local_files(source)
        if files is None:  # a hub dataset: its name (and config/split in prepare_kwargs) is its identity
            identity = source
        else:
            # Resolved paths, not the string given: "./a.txt" and "/abs/a.txt" are one source.
            identity = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    blob = json.dumps(
        {"identity": identity, "tokenizer": canonical_tokenizer_name(tokenizer),
         "prepare_version": PREPARE_VERSION, "options": options},
        sort_keys=True, default=str,
    )
    return f"{default_name(source)}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def ensure_prepared(
    source: str, tokenizer: str, cache_dir: str | os.PathLike | None = None, prepare_kwargs: dict | None = None
) -> Path:
    """The cache directory holding `source` prepared with `tokenizer`; prepares it if needed."""
    from filelock import FileLock  # ships with torch and datasets

    prepare_kwargs = dict(prepare_kwargs or {})
    root = default_cache_root(cache_dir)
    key = cache_key(source, tokenizer, prepare_kwargs)
    final = root / key
    if (final / "meta.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{key}.lock")):
        if (final / "meta.json").is_file():  # another process finished while we waited
            return final
        tmp = root / f".{key}.tmp-{os.uname().nodename}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _prepare_naming_hub_failures(source, tmp, tokenizer, prepare_kwargs)
            # Where file locks do not hold (some network filesystems) another node may have
            # finished first: keep its complete directory, only replace an incomplete leftover.
            if final.exists() and not (final / "meta.json").is_file():
                shutil.rmtree(final, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "meta.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_source(
    source: str,
    tokenizer: str,
    *,
    cache_dir: str | os.PathLike | None = None,
    val_source: str | None = None,
    prepare_kwargs: dict | None = None,
) -> ShardSet:
    """The train/val shards for `source`, preparing and caching it first when it is not shards."""
    if check_source(source) == "shards":
        return find_shards(source, val_source)
    directory = ensure_prepared(source, tokenizer, cache_dir, prepare_kwargs)
    shards = find_shards(str(directory), val_source)
    return ShardSet(shards.train, shards.val, f"{source} (prepared in {directory})", shards.meta)


def check_source(source: str) -> str:
    """What `source` names: "embedded", "shards", "local" (text files) or "hub" (a dataset name).

    Raises ValueError, without touching the network, for what can only be a mistake: a path that
    does not exist, or a bare word close to a keyword. Files are not read.
    """
    if not isinstance(source, str) or not source:
        raise ValueError(f"source must be a non-empty string, got {source!r}. {SOURCE_FORMS}.")
    check_source_spelling(source)
    if source in KEYWORDS:
        return source
    path = Path(source).expanduser()
    if not path.exists() and not glob.has_magic(source) and looks_like_path(source):
        raise missing_path_error(source)
    if is_shard_source(source):
        return "shards"
    return "local" if resolve_local_files(source) is not None else "hub"


def check_source_spelling(source: str) -> None:
    """A bare word that is no keyword and no existing path but close to a keyword is a typo."""
    if source in KEYWORDS or "/" in source or os.sep in source or Path(source).expanduser().exists():
        return
    close = difflib.get_close_matches(source.lower(), KEYWORDS, n=1, cutoff=0.75)
    if close:
        raise ValueError(
            f"source {source!r} is not a keyword and no file or directory of that name exists here ({os.getcwd()}); "
            f"did you mean source={close[0]!r}? (A Hugging Face dataset name is tried only for names that are "
            f"not that close to a keyword.) {SOURCE_FORMS}."
        )


def looks_like_path(source: str) -> bool:
    """True when `source` can only be meant as a local path (it may still not exist)."""
    if (source.startswith((".", "/", "~")) or (os.sep != "/" and os.sep in source) or source.count("/") > 1
            or glob.has_magic(source)):
        return True
    suffixes = [s.lower() for s in Path(source).suffixes]
    while suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes.pop()
    if suffixes and suffixes[-1] in _LOCAL_SUFFIXES:
        return True
    # "org/name" is a hub dataset, unless ./org is a directory here: then it means a path in it.
    head, sep, _ = source.partition("/")
    return bool(sep) and Path(head).expanduser().is_dir()


def missing_path_error(source: str, remedy: str = "") -> ValueError:
    """ValueError for a local path that does not exist, naming what does exist nearest to it."""
    path = Path(source).expanduser()
    absolute = path if path.is_absolute() else Path.cwd() / path
    parent = absolute.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    shown = str(parent if path.is_absolute() else os.path.relpath(parent)).rstrip("/")
    try:
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in parent.iterdir() if not p.name.startswith("."))
    except OSError:
        entries = []
    missing = absolute.relative_to(parent).parts[0]
    close = difflib.get_close_matches(missing, [e.rstrip("/") for e in entries], n=3, cutoff=0.6)
    if close:
        hint = f"did you mean {' or '.join(repr(os.path.join(shown or '/', c)) for c in close)}?"
    elif entries:
        hint = f"it holds {', '.join(entries[:12])}{', ...' if len(entries) > 12 else ''}"
    else:
        hint = "it is empty"
    return ValueError(
        f"source {source!r} does not exist ({shown or ''}/ has no {missing!r}; {hint}). Relative paths start at "
        f"{os.getcwd()}; check the path{' ' + remedy if remedy else ''}. {SOURCE_FORMS}."
    )


def _hub_offline() -> list[str]:
    return [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(v, "0") not in ("", "0")]


def _probe_hub(source: str) -> None:
    """One quick request for the dataset's card before `datasets` starts: unreachable hub or no such
    dataset fail in about a second, instead of after `datasets`' retries (half a minute offline).
    Only for names that go to the hub anyway, and not in offline mode (the local cache serves then)."""
    if _hub_offline():
        return
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError:
        return
    try:
        HfApi().dataset_info(source, timeout=10)
    except GatedRepoError:
        return  # exists; `datasets` gives the login advice with the token it finds
    except RepositoryNotFoundError as exc:
        raise _hub_error(source, exc, "there is no such dataset on the hub (or it is private)") from exc
    except Exception as exc:  # no network, DNS, proxy, timeout: let the user see which
        raise _hub_error(source, exc, "the hub could not be reached") from exc


def _hub_error(source: str, exc: BaseException, what: str) -> ValueError:
    head = source.partition("/")[0]
    local = (f"no file or directory {source!r} exists here ({os.getcwd()})" if Path(head).exists()
             else f"there is no {head!r} here ({os.getcwd()}) for it to be a local path")
    offline = _hub_offline()
    network = f" ({' and '.join(offline)} set: the hub is not contacted)" if offline else ""
    return ValueError(
        f"source {source!r} was taken for a Hugging Face dataset name ({local}), and {what}: "
        f"{type(exc).__name__}: {exc}. Check the dataset name, the network{network} and, for a gated "
        f"dataset, `huggingface-cli login`; for a local path, give one that exists. {SOURCE_FORMS}.")


def _prepare_naming_hub_failures(source: str, out_dir: Path, tokenizer: str, prepare_kwargs: dict) -> None:
    # `datasets` reports a hub failure without saying why the name went to the hub at all.
    if source not in KEYWORDS and resolve_local_files(source) is None:
        _probe_hub(source)
    try:
        prepare(source, out_dir, tokenizer, **prepare_kwargs)
    except ValueError:
        raise  # ours, already naming what to change (a missing text_field column, ...)
    except Exception as exc:
        if source in KEYWORDS or resolve_local_files(source) is not None:
            raise
        raise _hub_error(source, exc, "loading it from the hub failed") from exc
