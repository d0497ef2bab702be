"""RegressionGate: rules over eval metrics, checked after every evaluation.

A rule watches one metric (``eval/<task>/<metric>``; the ``eval/`` prefix may be left out) and
has exactly one condition:

``max_increase_pct: x``  the value may be at most x% above the lowest seen so far (losses, perplexities)
``max_drop: y``          at most y below the highest seen so far, in the metric's own units
                         (accuracies are fractions: 0.05 is 5 points)
``min: f`` / ``max: c``  a floor / a ceiling, checked from ``after_step`` on (default 0)

and an ``action`` when it is violated: ``warn`` (a warning), ``fail_checkpoint`` (the
checkpoint's ``evals.json`` records the failure; resume discovery and ``export --latest`` skip
it) or ``stop`` (training stops after this step). Every action also warns. The best values
seen are the gate's state (``state_dict``): a resumed run keeps comparing against the run's best,
not against its first evaluation after the restart.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

ACTIONS = ("warn", "fail_checkpoint", "stop")
_CONDITIONS = ("max_increase_pct", "max_drop", "min", "max")


@dataclass
class GateRule:
    metric: str
    max_increase_pct: float | None = None
    max_drop: float | None = None
    min: float | None = None
    max: float | None = None
    after_step: int = 0
    """Check the rule only from this global step on (all conditions)."""
    action: str = "warn"

    def __post_init__(self) -> None:
        if not self.metric.startswith("eval/"):
            self.metric = f"eval/{self.metric}"
        given = [c for c in _CONDITIONS if getattr(self, c) is not None]
        if len(given) != 1:
            raise ValueError(f"gate rule for {self.metric!r} has conditions {given}; give exactly one of "
                             f"{', '.join(_CONDITIONS)}")
        if self.action not in ACTIONS:
            raise ValueError(f"gate rule for {self.metric!r}: action={self.action!r}; use one of {', '.join(ACTIONS)}")
        if self.max_increase_pct is not None and self.max_increase_pct < 0:
            raise ValueError(f"gate rule for {self.metric!r}: max_increase_pct={self.max_increase_pct} must be >= 0")
        if self.max_drop is not None and self.max_drop < 0:
            raise ValueError(f"gate rule for {self.metric!r}: max_drop={self.max_drop} must be >= 0")

    @classmethod
    def parse(cls, rule: GateRule | dict[str, Any]) -> GateRule:
        if isinstance(rule, GateRule):
            return rule
        if not isinstance(rule, dict):
            raise ValueError(f"gate rule {rule!r}: give a mapping such as {{metric: eval/heldout/loss, "
                             f"max_increase_pct: 10, action: fail_checkpoint}}")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(rule) - known):
            raise ValueError(f"gate rule {rule!r}: unknown keys {unknown}; rules take {sorted(known)}")
        if "metric" not in rule:
            raise ValueError(f"gate rule {rule!r} names no metric; add metric: eval/<task>/<metric>")
        return cls(**rule)

    def describe(self) -> str:
        if self.max_increase_pct is not None:
            cond = f"at most {self.max_increase_pct:g}% above its best"
        elif self.max_drop is not None:
            cond = f"at most {self.max_drop:g} below its best"
        elif self.min is not None:
            cond = f">= {self.min:g}"
        else:
            cond = f"<= {self.max:g}"
        return f"{self.metric} {cond}" + (f" from step {self.after_step}" if self.after_step else "")


@dataclass
class Violation:
    rule: GateRule
    value: float
    reference: float
    """The best value (relative rules) or the bound (min / max) it was compared with."""

    def describe(self) -> str:
        return f"{self.rule.metric} = {self.value:.6g} breaks '{self.rule.describe()}' (reference {self.reference:.6g})"

    def to_dict(self) -> dict[str, Any]:
        return {"rule": asdict(self.rule), "value": self.value, "reference": self.reference,
                "message": self.describe()}


class RegressionGate:
    """Checks metrics against the rules and remembers the best value of each metric."""

    def __init__(self, rules: list[GateRule | dict[str, Any]] | None = None) -> None:
        self.rules = [GateRule.parse(r) for r in (rules or [])]
        self.lowest: dict[str, float] = {}
        self.highest: dict[str, float] = {}
        self.failed: list[dict[str, Any]] = []
        """Every evaluation that broke a rule: step, checkpoint, messages."""

    def check(self, metrics: dict[str, float], step: int) -> list[Violation]:
        """The rules ``metrics`` (``eval/<task>/<metric>`` names) break at ``step``; then the bests move."""
        found = []
        for rule in self.rules:
            value = metrics.get(rule.metric)
            if value is None or step < rule.after_step:
                continue
            if not math.isfinite(value):
                # NaN/inf is never within a bound (a broken model's loss); compare as the worst.
                ref = self.lowest.get(rule.metric, self.highest.get(rule.metric, float("nan")))
                found.append(Violation(rule, value, ref))
                continue
            if rule.max_increase_pct is not None and rule.metric in self.lowest:
                ref = self.lowest[rule.metric]
                if value > ref + abs(ref) * rule.max_increase_pct / 100:
                    found.append(Violation(rule, value, ref))
            elif rule.max_drop is not None and rule.metric in self.highest:
                ref = self.highest[rule.metric]
                if value < ref - rule.max_drop:
                    found.append(Violation(rule, value, ref))
            elif rule.min is not None and value < rule.min:
                found.append(Violation(rule, value, rule.min))
            elif rule.max is not None and value > rule.max:
                found.append(Violation(rule, value, rule.max))
        for name, value in metrics.items():
            if math.isfinite(value):
                self.lowest[name] = min(value, self.lowest.get(name, value))
                self.highest[name] = max(value, self.highest.get(name, value))
        return found

    def state_dict(self) -> dict[str, Any]:
        return {"lowest": dict(self.lowest), "highest": dict(self.highest), "failed": list(self.failed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lowest = dict(state.get("lowest", {}))
        self.highest = dict(state.get("highest", {}))
        self.failed = list(state.get("failed", []))
