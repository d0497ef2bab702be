"""Evals on checkpoints: zero-shot tasks scored like lm-evaluation-harness, held-out loss, and a
regression gate. ``CheckpointEval`` (``lightning_disttrain.callbacks``) runs them during training;
``lightning-disttrain eval`` on saved checkpoints.

    tasks.py            task names, formats, reading local JSONL (``../shared/evals`` layout)
    hub.py              the same sets from the hub through ``datasets`` (optional)
    requests.py         items -> log-likelihood requests -> task metrics (acc, acc_norm, ppl)
    parallel_scoring.py batched scoring, split across data-parallel ranks, gathered
    heldout.py          held-out loss / perplexity on fixed token windows
    suite.py            EvalSuite: a fixed set of tasks run on a LightningModule through its strategy
    gate.py             RegressionGate and its rules
    results.py          evals.json in the checkpoint (listed in its manifest), the results table
    handoff.py          evaluation in a separate process (the eval command), for CheckpointEval
    command.py          ``lightning-disttrain eval``
"""

from lightning_disttrain.evals.gate import GateRule, RegressionGate
from lightning_disttrain.evals.suite import EvalResults, EvalSuite
from lightning_disttrain.evals.tasks import KNOWN_TASKS, Task, load_task

__all__ = ["KNOWN_TASKS", "EvalResults", "EvalSuite", "GateRule", "RegressionGate", "Task", "load_task"]
