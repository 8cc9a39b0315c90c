"""Folding a stream's consecutive delta outputs into one, and how many the "merge" mode folds.

Owns what "several engine outputs as one response" means: per completion (by index) the text,
token ids and logprobs are concatenated in order, and everything that describes the latest state
(cumulative logprob, finish and stop reason, `finished`, the first token's time) is taken from the
later output. The engine's outputs are never modified: a merge builds new ones (engine/events.py's
EngineOutput and Completion). Also owns AdaptiveInterval, the "merge" mode's choice of steps per
response. Used by the responder for `stream_interval` and the "merge" stream mode.
"""

from __future__ import annotations

import math
from typing import Any

from triton_vllm_multistep.engine.events import Completion, EngineOutput


def merge_deltas(earlier: EngineOutput, later: EngineOutput) -> EngineOutput:
    """One delta output equal to sending `earlier` then `later` (same request, streamed)."""
    by_index: dict[int, Completion] = {c.index: c for c in earlier.outputs}
    for completion in later.outputs:
        before = by_index.get(completion.index)
        by_index[completion.index] = completion if before is None else _merge_completion(before, completion)
    return EngineOutput(
        later.request_id,
        [by_index[index] for index in sorted(by_index)],
        later.finished,
        # A delta carries the prompt's length only in a request's first output; the merge keeps it.
        later.prompt_tokens if later.prompt_tokens is not None else earlier.prompt_tokens,
        later.first_token_time,
        later.times,
        later.prompt_logprobs if later.prompt_logprobs is not None else earlier.prompt_logprobs,
    )


def _merge_completion(earlier: Completion, later: Completion) -> Completion:
    return Completion(
        later.index,
        earlier.text + later.text,
        [*earlier.token_ids, *later.token_ids],
        later.cumulative_logprob,
        _concat(earlier.logprobs, later.logprobs),
        later.finish_reason,
        later.stop_reason,
    )


def _concat(earlier: list[Any] | None, later: list[Any] | None) -> list[Any] | None:
    if earlier is None and later is None:
        return None
    return [*(earlier or []), *(later or [])]


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
