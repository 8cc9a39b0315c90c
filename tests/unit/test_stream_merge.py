"""Several engine outputs as one response: merged deltas equal the outputs sent one by one, and the
responder holds and releases a stream's outputs by `stream_interval` and the "merge" mode.

Fake pb_utils, the engine boundary's output types (engine/events.py); the same through tritonserver is in tests/e2e.
"""

from __future__ import annotations

import fake_pb_utils as pb

from triton_vllm_multistep.engine.deltas import merge_deltas
from triton_vllm_multistep.engine.events import Completion, EngineDied, EngineOutput, StepOutputs, TokenLogprob
from triton_vllm_multistep.stub.codec import GenerationRequest
from triton_vllm_multistep.stub.responder import EndRequests, RequestState, Responder
from triton_vllm_multistep.stub.stream_merge import AdaptiveInterval
from triton_vllm_multistep.testing.polling import wait_for


def delta(rid: str, *completions: tuple[int, str, list[int]], finished: bool = False) -> EngineOutput:
    outputs = [
        Completion(
            index,
            text,
            ids,
            cumulative_logprob=-float(len(ids)),
            logprobs=[{t: TokenLogprob(-1.0)} for t in ids],
            finish_reason="length" if finished else None,
        )
        for index, text, ids in completions
    ]
    return EngineOutput(rid, outputs, finished, prompt_tokens=2)


def test_merged_deltas_concatenate_text_ids_and_logprobs_per_completion_and_keep_the_latest_state() -> None:
    first = delta("r", (0, "Hel", [5]), (1, "Wo", [7]))
    second = delta("r", (1, "rld", [8, 9]))  # only completion 1 moved
    third = delta("r", (0, "lo", [6]), (1, "!", [10]), finished=True)
    merged = merge_deltas(merge_deltas(first, second), third)
    assert [c.index for c in merged.outputs] == [0, 1]
    assert [c.text for c in merged.outputs] == ["Hello", "World!"]
    assert [list(c.token_ids) for c in merged.outputs] == [[5, 6], [7, 8, 9, 10]]
    assert [len(c.logprobs) for c in merged.outputs] == [2, 4]
    assert merged.outputs[1].cumulative_logprob == -1.0 and merged.outputs[1].finish_reason == "length"
    assert merged.finished
    # The engine's objects are untouched.
    assert first.outputs[0].text == "Hel" and list(first.outputs[1].token_ids) == [7] and not first.finished


class Stream:
    """A responder (not started until asked, so steps can queue up first) and one streamed request."""

    def __init__(self, interval: int = 1, merge: bool = False, request_interval: int | None = None) -> None:
        self.responder = Responder(pb, abort=lambda _rid: None, stream_interval=interval, merge_when_behind=merge)
        self.sender = pb.ResponseSender()
        request = GenerationRequest([1, 2], None, stream=True, stream_interval=request_interval)
        assert self.responder.register("r", RequestState(sender=self.sender, request=request))

    def post_steps(self, count: int, start: int = 0, last: bool = True, step_seconds: float = 0.001) -> None:
        for i in range(start, start + count):
            finished = last and i == start + count - 1
            outputs = [delta("r", (0, f"t{i} ", [10 + i]), finished=finished)]
            self.responder.post(StepOutputs(outputs, step_seconds))

    def texts(self) -> list[str]:
        return [
            b"".join(r.arrays()["text_output"].tolist()).decode() for r in self.sender.responses() if not r.has_error()
        ]

    def run_to_final(self) -> None:
        self.responder.start()
        assert wait_for(lambda: self.sender.finals == 1, 10, interval=0.01)
        self.responder.stop("stopping")


def test_stream_interval_sends_every_kth_output_and_the_final_with_the_rest() -> None:
    stream = Stream(interval=3)
    stream.post_steps(7)
    stream.run_to_final()
    assert stream.texts() == ["t0 ", "t1 t2 t3 ", "t4 t5 t6 "]  # the first token at once
    assert stream.sender.finals == 1 and stream.sender.sent[-1][1] == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def test_a_request_sets_its_own_interval() -> None:
    stream = Stream(interval=1, request_interval=4)
    stream.post_steps(6)
    stream.run_to_final()
    assert stream.texts() == ["t0 ", "t1 t2 t3 t4 ", "t5 "]


def test_step_mode_sends_one_response_per_step_even_when_behind() -> None:
    stream = Stream()
    stream.post_steps(5)  # all queued before the thread runs: it is behind
    stream.run_to_final()
    assert stream.texts() == [f"t{i} " for i in range(5)]


def test_merge_mode_folds_the_steps_queued_while_behind_into_one_response() -> None:
    stream = Stream(merge=True)
    stream.post_steps(5)
    stream.run_to_final()
    assert stream.texts() == ["t0 ", "t1 t2 t3 t4 "]


def test_merge_mode_sends_per_step_when_it_keeps_up() -> None:
    stream = Stream(merge=True)
    stream.responder.start()
    for i in range(4):
        # A 10 s engine step: responses are cheap next to it however loaded the machine is.
        stream.post_steps(1, start=i, last=i == 3, step_seconds=10.0)
        assert wait_for(lambda i=i: len(stream.texts()) == i + 1, 10, interval=0.01)
    stream.responder.stop("stopping")
    assert stream.texts() == ["t0 ", "t1 ", "t2 ", "t3 "] and stream.sender.finals == 1


def test_merge_mode_never_holds_more_than_the_queue_bound() -> None:
    stream = Stream(merge=True)
    stream.responder = Responder(pb, abort=lambda _rid: None, max_queued_steps=4, merge_when_behind=True)
    request = GenerationRequest([1, 2], None, stream=True)
    assert stream.responder.register("r", RequestState(sender=stream.sender, request=request))
    stream.responder.start()
    stream.post_steps(12)  # the engine side waits at 4 queued steps
    assert wait_for(lambda: stream.sender.finals == 1, 10, interval=0.01)
    stream.responder.stop("stopping")
    assert "".join(stream.texts()) == "".join(f"t{i} " for i in range(12))
    assert all(text.count("t") <= 4 for text in stream.texts())


def test_held_outputs_go_out_before_the_error_of_a_drain_or_engine_failure() -> None:
    for ending in (EndRequests("the server is about to stop"), EngineDied("vLLM engine failed: boom", ["r"])):
        stream = Stream(interval=10)
        stream.post_steps(3, last=False)
        stream.responder.post(ending)
        stream.run_to_final()
        assert stream.texts() == ["t0 ", "t1 t2 "]
        (error,) = [r for r in stream.sender.responses() if r.has_error()]
        assert stream.sender.sent[-1][0] is error and stream.sender.finals == 1


def test_the_adaptive_interval_stays_1_while_responses_are_cheap_next_to_the_step() -> None:
    pace = AdaptiveInterval(budget=0.25, max_interval=16)
    assert pace.interval(32) == 1  # nothing measured yet
    for _ in range(20):
        pace.observe(responses=1, send_seconds=0.0001, step_seconds=0.004)  # 1 stream: 2.5% of the step
    assert pace.interval(1) == 1


def test_the_adaptive_interval_merges_enough_steps_to_bring_the_cost_within_budget() -> None:
    pace = AdaptiveInterval(budget=0.25, max_interval=16)
    for _ in range(50):
        pace.observe(responses=32, send_seconds=32 * 0.0003, step_seconds=0.012)
    # 32 responses x 0.3 ms = 9.6 ms per step against a 3 ms budget (25% of 12 ms): 4 steps each.
    assert pace.interval(32) == 4
    assert pace.interval(64) == 7
    assert pace.interval(10_000) == 16  # never beyond the queue's bound
    assert pace.interval(1) == 1


def test_one_slow_send_does_not_change_the_pace() -> None:
    pace = AdaptiveInterval(budget=0.25, max_interval=16)
    for _ in range(50):
        pace.observe(responses=8, send_seconds=8 * 0.0001, step_seconds=0.01)
    pace.observe(responses=8, send_seconds=0.05, step_seconds=0.01)  # a GC pause
    assert pace.interval(8) <= 2
