"""Eval tasks: which sets exist, what format each has, and reading them (local JSONL or the hub).

Three formats, the layouts of MosaicML llm-foundry's local eval files (``../shared/evals``):

``multiple_choice``   ``{"query", "choices": [...], "gold": i}``: PIQA, ARC-Easy/Challenge, COPA,
                      OpenBookQA, HellaSwag. Scored: the log-likelihood of each choice after the query.
``schema``            ``{"context_options": [...], "continuation", "gold": i}``: WinoGrande (partial
                      evaluation: the shared continuation after each context option).
``language_modeling`` ``{"context", "continuation"}``: LAMBADA (the last word after its passage).

A task is named in one of three ways (``parse_task``):

- ``piqa``: a known task (``KNOWN_TASKS``), read from ``<data_dir>/piqa.jsonl`` when a data
  directory is given, else from the hub through ``datasets`` (``hub.py``);
- ``mytask=path/to/file.jsonl``: any JSONL file in one of the formats (detected from its fields);
- ``hellaswag=hub:Rowan/hellaswag``: a hub dataset; known tasks are converted from their hub
  layout, other names must already have one of the three layouts.

``limit`` keeps the first N items (file order, as lm-evaluation-harness's ``--limit``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_disttrain.evals import hub

FORMATS = ("multiple_choice", "schema", "language_modeling")
_FIELDS = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
           "language_modeling": ("context", "continuation")}
HUB_PREFIX = "hub:"
ENV_DATA_DIR = "LDT_EVAL_DATA"
"""Environment variable naming the default directory of local JSONL sets (when ``data_dir`` is not given)."""


@dataclass(frozen=True)
class TaskInfo:
    """What we know about a named task."""

    format: str
    file: str
    """File name inside a data directory."""
    delimiter: str = " "
    """Between the query (or context) and the continuation: llm-foundry's ``continuation_delimiter``
    for these files (``"\\nAnswer: "`` for PIQA and ARC, whose queries start with "Question:")."""
    hub: tuple[str, str | None, str] | None = None
    """(dataset, config, split) on the hub: the set lm-evaluation-harness reads."""


KNOWN_TASKS: dict[str, TaskInfo] = {
    "lambada_openai": TaskInfo("language_modeling", "lambada_openai.jsonl",
                               hub=("EleutherAI/lambada_openai", "default", "test")),
    "piqa": TaskInfo("multiple_choice", "piqa.jsonl", "\nAnswer: ", ("baber/piqa", None, "validation")),
    "arc_easy": TaskInfo("multiple_choice", "arc_easy.jsonl", "\nAnswer: ", ("allenai/ai2_arc", "ARC-Easy", "test")),
    "arc_challenge": TaskInfo("multiple_choice", "arc_challenge.jsonl", "\nAnswer: ",
                              ("allenai/ai2_arc", "ARC-Challenge", "test")),
    "winogrande": TaskInfo("schema", "winogrande.jsonl", hub=("allenai/winogrande", "winogrande_xl", "validation")),
    "copa": TaskInfo("multiple_choice", "copa.jsonl", hub=("aps/super_glue", "copa", "validation")),
    "openbook_qa": TaskInfo("multiple_choice", "openbook_qa.jsonl", hub=("allenai/openbookqa", "main", "test")),
    "hellaswag": TaskInfo("multiple_choice", "hellaswag.jsonl", hub=("Rowan/hellaswag", None, "validation")),
}
HELDOUT = "heldout"
"""The held-out loss / perplexity "task" (``heldout.py``), named like the others in a task list."""


@dataclass
class Task:
    """A loaded task: its items in one of the three formats."""

    name: str
    format: str
    items: list[dict[str, Any]]
    delimiter: str = " "
    source: str = ""
    """Where the items came from (a file path or ``hub:dataset``), for the results."""
    total: int | None = 0
    """Items in the source before ``limit``; None when reading stopped at ``limit`` (a local JSONL
    file is read only as far as its first ``limit`` items)."""
    extra: dict[str, Any] = field(default_factory=dict)


def parse_task(spec: str) -> tuple[str, str | None]:
    """``"piqa"`` -> ``("piqa", None)``; ``"name=source"`` -> ``("name", "source")``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"task {spec!r}: give a task name ({', '.join(KNOWN_TASKS)}, {HELDOUT}) or NAME=FILE.jsonl")
    name, _, source = spec.partition("=")
    name, source = name.strip(), source.strip() or None
    if not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"task name {name!r} must be letters, digits, '_' or '-' (it becomes eval/{name}/<metric>)")
    if source is None and name not in KNOWN_TASKS and name != HELDOUT:
        raise ValueError(f"unknown eval task {name!r}; use one of {', '.join([*KNOWN_TASKS, HELDOUT])}, or give "
                         f"its data: '{name}=path/to/{name}.jsonl' (or '{name}={HUB_PREFIX}org/dataset')")
    return name, source


BUNDLED = "bundled"
"""``data_dir`` value for the samples shipped with the package (``SAMPLES_DIR``)."""
HUB = "hub"
"""``data_dir`` value for the hub (through ``datasets``), whatever ``LDT_EVAL_DATA`` says."""
SAMPLES_DIR = Path(__file__).resolve().parent / "samples"
"""The first 50 items of each known set (``samples/README.md``: source and licences)."""


def default_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """The directory of JSONL sets: ``data_dir``, else ``$LDT_EVAL_DATA``; ``"bundled"``: the
    package's samples; ``"hub"`` or nothing given: None (the hub)."""
    given = data_dir if data_dir is not None else os.environ.get(ENV_DATA_DIR)
    if given == BUNDLED:
        return SAMPLES_DIR
    if given == HUB:
        return None
    return Path(given).expanduser() if given else None


def load_task(spec: str, data_dir: str | os.PathLike | None = None, limit: int | None = None,
              delimiter: str | None = None) -> Task:
    """Read one task (see the module docstring for ``spec``); ``limit``: its first N items."""
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit={limit!r}: give a positive number of items per task, or None for all")
    name, source = parse_task(spec)
    if name == HELDOUT:
        raise ValueError(f"{HELDOUT!r} is not a JSONL task; it is scored by evals.heldout")
    info = KNOWN_TASKS.get(name)
    if source is None:
        root = default_data_dir(data_dir)
        if root is not None:
            source = str(root / info.file)
        else:
            source = HUB_PREFIX + info.hub[0]
    if source.startswith(HUB_PREFIX):
        known = info.hub if info is not None else None
        records, where = hub.load_hub_records(name, source[len(HUB_PREFIX):], known), source
    else:
        records, where = read_jsonl(source, name, limit=limit), str(source)
    fmt = info.format if info is not None else detect_format(records, where)
    items = records[:limit] if limit is not None else records
    for i, record in enumerate(items):
        check_record(record, fmt, where, i)
    total = None if limit is not None and len(records) >= limit and not source.startswith(HUB_PREFIX) \
        else len(records)
    delim = delimiter if delimiter is not None else (info.delimiter if info is not None else " ")
    return Task(name=name, format=fmt, items=items, delimiter=delim, source=where, total=total)


def read_jsonl(path: str | os.PathLike, name: str = "", limit: int | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one per non-empty line; with ``limit``, reading stops after
    the first ``limit`` of them (the rest of the file is never read)."""
    path = Path(path).expanduser()
    if not path.is_file():
        hint = (f"pass data_dir= a directory holding {path.name} (llm-foundry's JSONL layout), 'bundled' (the "
                f"package's small samples) or 'hub', set "
                f"{ENV_DATA_DIR}, or name the file: '{name}=path/to/file.jsonl'")
        raise ValueError(f"eval task {name!r}: {str(path)!r} does not exist; {hint}")
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{str(path)!r} line {line_no} is not JSON ({err}); one JSON object per line") from err
            if not isinstance(record, dict):
                raise ValueError(f"{str(path)!r} line {line_no} is a {type(record).__name__}, not a JSON object")
            records.append(record)
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise ValueError(f"{str(path)!r} holds no items; give a JSONL file with one item per line")
    return records


def detect_format(records: list[dict[str, Any]], where: str) -> str:
    keys = set(records[0])
    for fmt, fields in _FIELDS.items():
        if set(fields) <= keys:
            return fmt
    layouts = "; ".join(f"{fmt}: {', '.join(fields)}" for fmt, fields in _FIELDS.items())
    raise ValueError(f"{where}: items have fields {sorted(keys)}, none of the eval layouts ({layouts}); "
                     f"convert the file to one of them")


def check_record(record: dict[str, Any], fmt: str, where: str, index: int) -> None:
    missing = [k for k in _FIELDS[fmt] if k not in record]
    if missing:
        raise ValueError(f"{where} item {index} lacks {missing} for the {fmt} format (fields: {list(_FIELDS[fmt])})")
    options = record.get("choices", record.get("context_options"))
    if options is not None:
        if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) for o in options):
            raise ValueError(f"{where} item {index}: choices/context_options must be a list of at least 2 strings")
        gold = record["gold"]
        if not isinstance(gold, int) or not 0 <= gold < len(options):
            raise ValueError(f"{where} item {index}: gold={gold!r} must index its {len(options)} options")
