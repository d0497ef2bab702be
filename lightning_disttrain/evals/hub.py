"""Eval sets from the dataset hub, through ``datasets`` (an optional dependency).

Known tasks arrive in the layout lm-evaluation-harness reads (``TaskInfo.hub``, passed in as
``known``) and are converted
to the local JSONL layout (``tasks.py``) with the prompts of ``../shared/evals`` (llm-foundry's
files, themselves built from these sets), so a hub run and a local run score the same text. Any
other dataset must already hold one of the three layouts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any


def load_hub_records(name: str, dataset: str, known: tuple[str, str | None, str] | None) -> list[dict[str, Any]]:
    """The items of ``dataset`` (``org/name``, optionally ``org/name:config:split``) as local-layout dicts.

    ``known``: the task's ``TaskInfo.hub`` (dataset, config, split) when ``name`` is a known task,
    else None; its config and split fill in what ``dataset`` leaves out, and its converter applies
    when ``dataset`` is that set. (A tuple, not the ``TaskInfo``: ``tasks.py`` imports this module.)"""
    try:
        import datasets
    except ImportError as err:
        raise ValueError(f"eval task {name!r} reads {dataset!r} from the hub, which needs the `datasets` package: "
                         f"pip install 'lightning-disttrain[evals]' (or pass data_dir= a directory of JSONL files, "
                         f"the layout of ../shared/evals)") from err
    parts = dataset.split(":")
    path = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 else None
    if known is not None and known[0] == path:
        config = config or known[1]
        split = split or known[2]
    rows = datasets.load_dataset(path, config, split=split or "test")
    convert = CONVERTERS.get(name) if known is not None and known[0] == path else None
    return [convert(dict(row)) if convert else dict(row) for row in rows]


def _answer_index(labels: list[str], key: str) -> int:
    return labels.index(str(key))


def lambada(row: dict) -> dict:
    context, _, word = row["text"].rpartition(" ")
    return {"context": context, "continuation": word}


def piqa(row: dict) -> dict:
    return {"query": f"Question: {row['goal']}\n", "choices": [row["sol1"], row["sol2"]], "gold": int(row["label"])}


def arc(row: dict) -> dict:
    labels = list(row["choices"]["label"])
    return {"query": f"Question: {row['question']}", "choices": list(row["choices"]["text"]),
            "gold": _answer_index(labels, row["answerKey"])}


def winogrande(row: dict) -> dict:
    blank = row["sentence"].index("_")
    return {"context_options": [row["sentence"][:blank] + o for o in (row["option1"], row["option2"])],
            "continuation": row["sentence"][blank + 1:].strip(), "gold": int(row["answer"]) - 1}


def copa(row: dict) -> dict:
    connector = {"cause": "because", "effect": "therefore"}[row["question"]]
    lower = [c[0].lower() + c[1:] for c in (row["choice1"], row["choice2"])]
    return {"query": f"{row['premise'].strip()[:-1]}, {connector}", "choices": lower, "gold": int(row["label"])}


def openbookqa(row: dict) -> dict:
    labels = list(row["choices"]["label"])
    return {"query": row["question_stem"], "choices": list(row["choices"]["text"]),
            "gold": _answer_index(labels, row["answerKey"])}


def _hellaswag_text(text: str) -> str:
    # lm-evaluation-harness's preprocessing of the WikiHow-derived items.
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag(row: dict) -> dict:
    ctx = f"{row['ctx_a']} {row['ctx_b'].capitalize()}"
    return {"query": _hellaswag_text(f"{row['activity_label']}: {ctx}"),
            "choices": [_hellaswag_text(e) for e in row["endings"]], "gold": int(row["label"])}


CONVERTERS: dict[str, Callable[[dict], dict]] = {
    "lambada_openai": lambada, "piqa": piqa, "arc_easy": arc, "arc_challenge": arc, "winogrande": winogrande,
    "copa": copa, "openbook_qa": openbookqa, "hellaswag": hellaswag,
}
