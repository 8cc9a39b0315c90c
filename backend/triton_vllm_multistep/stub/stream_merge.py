"""How many engine outputs the "merge" stream mode folds into one response (AdaptiveInterval).

What folding them means is engine/deltas.py's (merge_deltas). Used by the responder for the
"merge" stream mode.
"""

from __future__ import annotations

import math

# A sample counts for at most this many times the running average.
OUTLIER_FACTOR = 4.0


class AdaptiveInterval:
    """Engine outputs per response in the "merge" stream mode, from what responses cost.

    Sending a response costs host CPU time (encoding, the IPC to tritonserver, gRPC there) on the
    same cores, and under the same GIL, as the engine's scheduling and pythonization (the
    responder measures its own thread's CPU time: waiting for tritonserver's answer costs the
    engine nothing). One
    response per stream per step is kept while that cost stays within `budget` of the engine's
    step time; beyond it, each stream's steps are merged `k` at a time, the smallest `k` that
    brings the cost back within budget (at most `max_interval`). Both figures are moving
    averages, so one slow send does not change the pace, and at low load (a few streams) `k`
    stays 1: per-step latency is untouched where the response path keeps up.
    """

    def __init__(self, budget: float = 0.05, max_interval: int = 16, smoothing: float = 0.2) -> None:
        self.budget = budget
        self.max_interval = max_interval
        self._smoothing = smoothing
        self.seconds_per_response: float | None = None
        self.step_seconds: float | None = None

    def observe(self, responses: int, send_seconds: float, step_seconds: float) -> None:
        """After sending `responses` responses in `send_seconds` for an engine step of `step_seconds`."""
        if responses > 0:
            self.seconds_per_response = self._average(self.seconds_per_response, send_seconds / responses)
        if step_seconds > 0:
            self.step_seconds = self._average(self.step_seconds, step_seconds)

    def interval(self, streams: int) -> int:
        """Steps per response for each of `streams` streams running together."""
        if not self.seconds_per_response or not self.step_seconds or streams <= 0:
            return 1
        per_step = streams * self.seconds_per_response
        needed = math.ceil(per_step / (self.budget * self.step_seconds))
        return max(1, min(self.max_interval, needed))

    def _average(self, previous: float | None, value: float) -> float:
        if previous is None:
            return value
        value = min(value, OUTLIER_FACTOR * previous)  # a GC pause or a slow IPC is one sample, not a trend
        return previous + self._smoothing * (value - previous)
