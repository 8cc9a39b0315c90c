"""What the GPU smoke check reports: each check's outcome and what one request streamed.

Owns the report's values (Check, SmokeReport: printed as they are made) and Stream; must not run an
engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Check:
    """One check's outcome; a skipped check (could not run here, `detail` says why) is not passed."""

    name: str
    passed: bool
    detail: str
    skipped: bool = False


@dataclass
class SmokeReport:
    engine: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def ran(self) -> list[Check]:
        return [check for check in self.checks if not check.skipped]

    @property
    def skipped(self) -> list[Check]:
        return [check for check in self.checks if check.skipped]

    @property
    def passed(self) -> bool:
        """At least one check ran, and every check that ran passed (skipped ones are reported as such)."""
        return bool(self.ran) and all(check.passed for check in self.ran)

    def check(self, name: str, passed: bool, detail: str) -> bool:
        self.checks.append(Check(name, bool(passed), detail))
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}", flush=True)
        return passed

    def skip(self, name: str, reason: str) -> None:
        self.checks.append(Check(name, False, reason, skipped=True))
        print(f"SKIP  {name}: {reason}", flush=True)


@dataclass
class Stream:
    """What one request streamed: its per-output token deltas and text, how it ended, and the
    indices of the engine steps (StepOutputs events) that carried an output of it."""

    deltas: list[list[int]] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    failure: str | None = None
    steps: set[int] = field(default_factory=set)
    prompt_tokens: int | None = None  # the prompt as the engine counts it (image placeholders expanded)

    @property
    def tokens(self) -> list[int]:
        return [token for delta in self.deltas for token in delta]

    @property
    def ended(self) -> bool:
        return self.finished or self.failure is not None

    def same_tokens(self, other: Stream, length: int | None = None) -> bool:
        """Both streams ended without failure with equal tokens (and `length` of them, if given)."""
        return (
            self.failure is None
            and other.failure is None
            and self.tokens == other.tokens
            and (length is None or len(self.tokens) == length)
        )

    def outcome(self) -> str:
        if self.failure is not None:
            return f"failed: {self.failure}"
        return f"{len(self.tokens)} tokens, finish {self.finish_reason}, text {self.text!r}"
