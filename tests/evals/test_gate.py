"""RegressionGate rules on metric sequences, their errors, and the state a resume keeps."""

from __future__ import annotations

import math

import pytest

from lightning_disttrain.evals.gate import GateRule, RegressionGate


def test_relative_rules_compare_with_the_best_so_far():
    gate = RegressionGate([{"metric": "heldout/loss", "max_increase_pct": 10},
                           {"metric": "eval/piqa/acc", "max_drop": 0.05, "action": "stop"}])
    assert gate.check({"eval/heldout/loss": 3.0, "eval/piqa/acc": 0.60}, step=10) == []
    assert gate.check({"eval/heldout/loss": 2.5, "eval/piqa/acc": 0.62}, step=20) == []
    assert gate.check({"eval/heldout/loss": 2.74, "eval/piqa/acc": 0.58}, step=30) == []  # within 10% / 0.05
    broken = gate.check({"eval/heldout/loss": 2.76, "eval/piqa/acc": 0.56}, step=40)
    assert [(v.rule.metric, v.reference) for v in broken] == [("eval/heldout/loss", 2.5), ("eval/piqa/acc", 0.62)]
    assert broken[1].rule.action == "stop"
    assert gate.check({"eval/heldout/loss": math.nan}, step=50)[0].value != gate.lowest["eval/heldout/loss"]


def test_floor_applies_from_its_step():
    gate = RegressionGate([{"metric": "eval/lambada_openai/acc", "min": 0.1, "after_step": 100, "action": "fail_checkpoint"}])
    assert gate.check({"eval/lambada_openai/acc": 0.0}, step=50) == []
    (v,) = gate.check({"eval/lambada_openai/acc": 0.05}, step=100)
    assert v.reference == 0.1 and "from step 100" in v.describe()


def test_state_survives_a_round_trip():
    gate = RegressionGate([{"metric": "heldout/loss", "max_increase_pct": 5}])
    gate.check({"eval/heldout/loss": 2.0}, step=1)
    again = RegressionGate([{"metric": "heldout/loss", "max_increase_pct": 5}])
    again.load_state_dict(gate.state_dict())
    assert len(again.check({"eval/heldout/loss": 2.2}, step=2)) == 1  # a fresh gate would take 2.2 as its best


@pytest.mark.parametrize("rule, match", [
    ({"metric": "x/loss"}, "exactly one of"),
    ({"metric": "x/loss", "min": 1, "max": 2}, "exactly one of"),
    ({"metric": "x/loss", "max": 2, "action": "panic"}, "action='panic'"),
    ({"metric": "x/loss", "max_drop": -1}, "must be >= 0"),
    ({"metrc": "x/loss", "max": 1}, "unknown keys"),
    ({"max": 1}, "names no metric"),
])
def test_bad_rules_are_refused(rule, match):
    with pytest.raises(ValueError, match=match):
        GateRule.parse(rule)
