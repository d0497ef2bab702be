"""Reading eval sets: the local JSONL layout (../shared/evals), a user's file, the hub layouts
converted (rows written here in each hub dataset's layout; the hub itself is never reached)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_disttrain.evals import hub
from lightning_disttrain.evals.tasks import KNOWN_TASKS, load_task

EVALS = Path(__file__).resolve().parents[3] / "shared" / "evals"
needs_sets = pytest.mark.skipif(not EVALS.is_dir(), reason="../shared/evals not present")


@needs_sets
@pytest.mark.parametrize("name", [n for n in KNOWN_TASKS if n != "hellaswag"])
def test_every_shipped_set_loads_in_its_format(name):
    task = load_task(name, data_dir=EVALS, limit=5)
    assert len(task.items) == 5 and task.total is None  # reading stopped at the limit
    assert task.format == KNOWN_TASKS[name].format
    first = json.loads((EVALS / KNOWN_TASKS[name].file).read_text().splitlines()[0])
    assert task.items[0] == first  # limit keeps the first items, in file order


def test_a_users_file_with_its_format_detected(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"context_options": ["A", "B"], "continuation": "c", "gold": 1}\n\n')
    task = load_task(f"mine={path}")
    assert (task.name, task.format, task.items[0]["gold"]) == ("mine", "schema", 1)


@pytest.mark.parametrize("content, match", [
    ('{"question": "x"}', "none of the eval layouts"),
    ('{"query": "q", "choices": ["a", "b"], "gold": 2}', "gold=2 must index"),
    ('{"query": "q", "choices": ["a"], "gold": 0}', "at least 2 strings"),
    ("not json", "is not JSON"),
])
def test_bad_files_are_refused_naming_the_problem(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content + "\n")
    with pytest.raises(ValueError, match=match):
        load_task(f"bad={path}")


def test_missing_local_set_names_the_fixes(tmp_path):
    with pytest.raises(ValueError, match="does not exist; pass data_dir="):
        load_task("piqa", data_dir=tmp_path)
    with pytest.raises(ValueError, match="limit=0"):
        load_task("piqa", data_dir=tmp_path, limit=0)


def test_hub_layouts_convert_to_the_local_prompts():
    assert hub.lambada({"text": "a passage ending in word"}) == {"context": "a passage ending in", "continuation": "word"}
    assert hub.piqa({"goal": "Open a jar", "sol1": "twist", "sol2": "pull", "label": 0}) == \
        {"query": "Question: Open a jar\n", "choices": ["twist", "pull"], "gold": 0}
    arc = hub.arc({"question": "Why?", "choices": {"text": ["x", "y", "z"], "label": ["A", "B", "C"]}, "answerKey": "C"})
    assert arc == {"query": "Question: Why?", "choices": ["x", "y", "z"], "gold": 2}
    wino = hub.winogrande({"sentence": "Sarah helped Maria so _ was thanked.", "option1": "Sarah",
                           "option2": "Maria", "answer": "2"})
    assert wino == {"context_options": ["Sarah helped Maria so Sarah", "Sarah helped Maria so Maria"],
                    "continuation": "was thanked.", "gold": 1}
    copa = hub.copa({"premise": "The man turned on the faucet.", "choice1": "The toilet filled.",
                     "choice2": "Water flowed.", "question": "effect", "label": 1})
    # the prompt shape of the shipped copa.jsonl
    assert copa == {"query": "The man turned on the faucet, therefore", "choices": ["the toilet filled.", "water flowed."],
                    "gold": 1}
    obqa = hub.openbookqa({"question_stem": "Predators eat", "choices": {"text": ["a", "b"], "label": ["A", "B"]},
                           "answerKey": "B"})
    assert obqa == {"query": "Predators eat", "choices": ["a", "b"], "gold": 1}
    hs = hub.hellaswag({"activity_label": "Baking", "ctx_a": "A man mixes flour.", "ctx_b": "then he",
                        "endings": ["bakes [title] it", "eats  it"], "label": "0"})
    assert hs == {"query": "Baking: A man mixes flour. Then he", "choices": ["bakes. it", "eats it"], "gold": 0}
