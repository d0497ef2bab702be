"""From task items to log-likelihood requests, and from their scores to task metrics, the way
lm-evaluation-harness does it.

Every format asks for log-likelihoods of a continuation after a context:

- multiple choice: each choice after ``query + delimiter``. ``acc``: the choice with the highest
  summed log-likelihood is the gold one; ``acc_norm``: the same after dividing each by the length
  of the choice in UTF-8 bytes (lm-evaluation-harness divides by its length in characters, the
  same number for ASCII text), which removes the bias towards short choices.
- schema (WinoGrande's "partial evaluation"): the one continuation after each context option;
  the option under which it is most likely wins. ``acc``.
- language modeling (LAMBADA): the continuation after the context. ``acc``: every continuation
  token is the model's argmax (greedy decoding reproduces the whole word); ``ppl``:
  ``exp(-mean over items of the continuation's log-likelihood)`` (lm-evaluation-harness's
  ``perplexity`` aggregation: per word, not per token).

Tokenization (lm-evaluation-harness's ``_encode_pair``): trailing whitespace of the context moves
to the front of the continuation; the pair is encoded whole and the continuation is what follows
the context's own encoding, so the continuation's tokens are those of the running text. An empty
context becomes the end-of-text token. Ties go to the first option (numpy's argmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_disttrain.evals.tasks import Task


@dataclass(frozen=True)
class Request:
    """One log-likelihood to compute: of ``continuation`` after ``context`` (token ids)."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


@dataclass(frozen=True)
class Score:
    """What the model says about one request."""

    logprob: float
    """Summed log-probability of the continuation's tokens."""
    greedy: bool
    """Whether every continuation token is the argmax at its position."""


def encode_pair(tokenizer, context: str, continuation: str) -> Request:
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return Request((tokenizer.eot_token,), tuple(tokenizer.encode(continuation)))
    whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
    cont = whole[len(ctx):] or tokenizer.encode(continuation)  # never an empty target
    if not cont:
        raise ValueError(f"continuation {continuation!r} encodes to no tokens; eval items need a non-empty continuation")
    return Request(tuple(ctx), tuple(cont))


def pairs(task: Task) -> list[list[tuple[str, str]]]:
    """Per item, its (context, continuation) texts."""
    d = task.delimiter
    if task.format == "multiple_choice":
        return [[(item["query"] + d, choice) for choice in item["choices"]] for item in task.items]
    if task.format == "schema":
        return [[(option + d, item["continuation"]) for option in item["context_options"]] for item in task.items]
    if task.format == "language_modeling":
        return [[(item["context"] + d, item["continuation"])] for item in task.items]
    raise ValueError(f"task {task.name!r} has unknown format {task.format!r}")


def build_requests(task: Task, tokenizer) -> list[list[Request]]:
    """Per item, its requests (one per choice / context option; one for language modeling)."""
    return [[encode_pair(tokenizer, c, x) for c, x in item] for item in pairs(task)]


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def item_scores(task: Task, scores: list[list[Score]]) -> list[dict[str, float]]:
    """Per item, its metric values (0/1 accuracies; the log-likelihood for language modeling)."""
    out = []
    for item, item_scores_ in zip(task.items, scores):
        lls = [s.logprob for s in item_scores_]
        if task.format == "multiple_choice":
            lengths = [max(len(c.encode("utf-8")), 1) for c in item["choices"]]
            out.append({"acc": float(_argmax(lls) == item["gold"]),
                        "acc_norm": float(_argmax([ll / n for ll, n in zip(lls, lengths)]) == item["gold"])})
        elif task.format == "schema":
            out.append({"acc": float(_argmax(lls) == item["gold"])})
        else:
            out.append({"acc": float(item_scores_[0].greedy), "logprob": lls[0]})
    return out


def task_metrics(task: Task, scores: list[list[Score]]) -> dict[str, float]:
    """The task's metrics over its items (see the module docstring)."""
    per_item = item_scores(task, scores)
    n = len(per_item)
    if n == 0:
        raise ValueError(f"task {task.name!r} has no items to score")
    metrics = {"acc": sum(p["acc"] for p in per_item) / n}
    if task.format == "multiple_choice":
        metrics["acc_norm"] = sum(p["acc_norm"] for p in per_item) / n
    if task.format == "language_modeling":
        metrics["ppl"] = math.exp(-sum(p["logprob"] for p in per_item) / n)
    return metrics
