"""Each task format scored against log-likelihoods computed by hand, on tiny models: a bigram
model whose every log-probability a test can write down (multiple choice acc / acc_norm,
WinoGrande's partial scoring, LAMBADA's greedy match and perplexity) and a random GPT with the
GPT-2 tokenizer (batched, right-padded, left-truncated forwards against one forward per request)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_disttrain.data import get_tokenizer
from lightning_disttrain.evals.heldout import heldout_metrics, windows_from_tokens
from lightning_disttrain.evals.parallel_scoring import DataParallel, forwards_per_rank, score_requests, shard
from lightning_disttrain.evals.requests import build_requests, encode_pair, task_metrics
from lightning_disttrain.evals.suite import EvalSuite
from lightning_disttrain.evals.tasks import Task
from lightning_disttrain.models.gpt import GPT, GPTConfig

BYTES = get_tokenizer("bytes")
ONE = DataParallel()
CPU = torch.device("cpu")


class Bigram(torch.nn.Module):
    """logits[t] = table[token t]: the next byte depends on the current one only."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(257, 257, generator=g))

    def forward(self, idx):
        return self.table[idx]

    def ll(self, context: str, continuation: str) -> float:
        """By hand: sum over the continuation's bytes of log softmax(table[previous byte])[byte]."""
        ctx, cont = list(context.encode()), list(continuation.encode())
        seq, total = ctx + cont, 0.0
        for pos in range(len(ctx), len(seq)):
            total += float(F.log_softmax(self.table[seq[pos - 1]].double(), -1)[seq[pos]])
        return total

    def greedy(self, context: str, continuation: str) -> bool:
        seq, n = list((context + continuation).encode()), len(context.encode())
        return all(int(self.table[seq[p - 1]].argmax()) == seq[p] for p in range(n, len(seq)))


def run(task: Task, model, tokenizer=BYTES, batch_size: int = 3, max_length: int = 512):
    per_item = build_requests(task, tokenizer)
    flat = [r for reqs in per_item for r in reqs]
    scores = score_requests(model, flat, ONE, vocab=tokenizer.n_vocab, max_length=max_length,
                            batch_size=batch_size, device=CPU)
    grouped, at = [], 0
    for reqs in per_item:
        grouped.append(scores[at:at + len(reqs)])
        at += len(reqs)
    return grouped, task_metrics(task, grouped)


def argmax(xs):
    return max(range(len(xs)), key=lambda i: (xs[i], -i))


def test_multiple_choice_acc_and_byte_normalised_acc_norm():
    model = Bigram()
    items = [{"query": "Q: pick one", "choices": ["a", "bbbbbbbbbb", "ccé"], "gold": 1},
             {"query": "Which?", "choices": ["xy", "z", "xyzxyz"], "gold": 0},
             {"query": "Last", "choices": ["éé", "ab"], "gold": 0}]
    task = Task("mc", "multiple_choice", items, delimiter="\nAnswer: ")
    grouped, metrics = run(task, model)
    acc = acc_norm = 0
    for item, scores in zip(items, grouped):
        # the trailing space of "\nAnswer: " moves to the continuation (lm-evaluation-harness)
        lls = [model.ll(item["query"] + "\nAnswer:", " " + c) for c in item["choices"]]
        assert [s.logprob for s in scores] == pytest.approx(lls, abs=1e-4)
        acc += argmax(lls) == item["gold"]
        acc_norm += argmax([ll / len(c.encode()) for ll, c in zip(lls, item["choices"])]) == item["gold"]
    assert metrics == pytest.approx({"acc": acc / 3, "acc_norm": acc_norm / 3})


def test_acc_norm_divides_by_bytes_not_characters_or_tokens():
    # Every transition equally likely (log 1/257 = -L): a continuation's log-likelihood is -L per byte
    # token, so only the normalisation decides. " aaa": -4L, " éé": -5L (é is 2 bytes).
    # acc: "aaa". Per byte of the choice: -4L/3 < -5L/4, so "éé" wins; per character (-5L/2) or per
    # token (-L each, a tie going to the first) "aaa" would.
    model = Bigram()
    with torch.no_grad():
        model.table.zero_()
    item = {"query": "q", "choices": ["aaa", "éé"], "gold": 1}
    _, metrics = run(Task("mc", "multiple_choice", [item]), model)
    assert metrics == {"acc": 0.0, "acc_norm": 1.0}


def test_winogrande_partial_scoring_compares_the_shared_continuation():
    model = Bigram(seed=1)
    items = [{"context_options": ["Sarah helped Maria, so Sarah", "Sarah helped Maria, so Maria"],
              "continuation": "was thanked.", "gold": 1},
             {"context_options": ["The cup fell off the table because the cup", "The cup fell off the table because the table"],
              "continuation": "was slippery.", "gold": 0}]
    grouped, metrics = run(Task("wg", "schema", items), model)
    correct = 0
    for item, scores in zip(items, grouped):
        lls = [model.ll(option, " " + item["continuation"]) for option in item["context_options"]]
        assert [s.logprob for s in scores] == pytest.approx(lls, abs=1e-4)
        correct += argmax(lls) == item["gold"]
    assert metrics == pytest.approx({"acc": correct / 2})


def test_lambada_greedy_whole_continuation_and_perplexity():
    model = Bigram(seed=2)
    with torch.no_grad():  # make " ab" after "is" the greedy path: "s" -> " " -> "a" -> "b"
        model.table[ord("s"), ord(" ")] = 50.0
        model.table[ord(" "), ord("a")] = 50.0
        model.table[ord("a"), ord("b")] = 50.0
    items = [{"context": "the end is", "continuation": "ab"},       # every token greedy: a hit
             {"context": "the end is", "continuation": "ac"},       # first token greedy, second not: a miss
             {"context": "another one", "continuation": "word"}]
    grouped, metrics = run(Task("lambada", "language_modeling", items), model)
    lls = [model.ll(i["context"], " " + i["continuation"]) for i in items]
    hits = [model.greedy(i["context"], " " + i["continuation"]) for i in items]
    assert hits[:2] == [True, False]
    assert [s.greedy for g in grouped for s in g] == hits
    assert metrics["acc"] == pytest.approx(sum(hits) / 3)
    assert metrics["ppl"] == pytest.approx(math.exp(-sum(lls) / 3), rel=1e-4)


def test_gpt_batched_scores_equal_one_forward_per_request():
    # A real attention model with the GPT-2 tokenizer: padding, the length-sorted order and
    # truncation of long contexts (block_size 24) must not change any score.
    torch.manual_seed(0)
    tok = get_tokenizer("gpt2")
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=24, vocab_size=tok.n_vocab)).eval()
    items = [{"context": "A short one", "continuation": "here"},
             {"context": " ".join(["long context"] * 20), "continuation": "ending words"},
             {"context": "Middle sized context, with a comma", "continuation": "done"}]
    task = Task("lm", "language_modeling", items)
    with torch.no_grad():
        grouped, _ = run(task, model, tokenizer=tok, batch_size=2, max_length=24)
        for item, (score,) in zip(items, grouped):
            ctx = tok.encode(item["context"])
            cont = tok.encode(item["context"] + " " + item["continuation"])[len(ctx):]
            seq = (ctx + cont)[-25:]  # the last block_size + 1 tokens
            logp = F.log_softmax(model(torch.tensor([seq[:-1]]))[0, :, : tok.n_vocab].double(), -1)
            expected = sum(float(logp[p - 1, seq[p]]) for p in range(len(seq) - len(cont), len(seq)))
            assert score.logprob == pytest.approx(expected, abs=1e-3)


def test_encode_pair_moves_trailing_whitespace_and_handles_an_empty_context():
    tok = get_tokenizer("gpt2")
    r = encode_pair(tok, "Question: why?\nAnswer: ", "because")
    assert list(r.context) == tok.encode("Question: why?\nAnswer:")
    assert list(r.continuation) == tok.encode(" because")
    empty = encode_pair(tok, "", "Hello")
    assert empty.context == (tok.eot_token,) and list(empty.continuation) == tok.encode("Hello")


def test_heldout_loss_is_the_mean_token_cross_entropy():
    model = Bigram(seed=3)
    tokens = list(b"held-out text for the loss, long enough for several windows.")
    windows = windows_from_tokens(tokens, seq_len=8, limit=None)
    assert windows.shape == ((len(tokens) - 1) // 8, 9)
    with torch.no_grad():
        metrics = heldout_metrics(model, windows, ONE, vocab=257, batch_size=2, device=CPU)
    nll = [-float(F.log_softmax(model.table[w[i]].double(), -1)[w[i + 1]]) for w in windows.tolist() for i in range(8)]
    assert metrics["loss"] == pytest.approx(sum(nll) / len(nll), rel=1e-6)
    assert metrics["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-6)


def test_split_covers_every_request_once_and_ranks_run_equal_forwards():
    lengths = [5, 9, 1, 7, 7, 3, 2]
    parts = [shard(7, DataParallel(rank=r, size=3), lengths) for r in range(3)]
    assert sorted(i for p in parts for i in p) == list(range(7))
    assert parts[0][0] == 1  # longest first
    assert forwards_per_rank(7, DataParallel(size=3), batch_size=2) == 2  # the busiest rank: 3 requests


def test_suite_refuses_bad_settings_naming_the_fix():
    with pytest.raises(ValueError, match="unknown eval task 'piqq'"):
        EvalSuite(tasks=["piqq"])
    with pytest.raises(ValueError, match="name a task twice"):
        EvalSuite(tasks="piqa,piqa")
    with pytest.raises(ValueError, match="batch_size=0"):
        EvalSuite(tasks=["piqa"], batch_size=0)
