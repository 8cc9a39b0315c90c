"""engine_v1/completions.py: V1's per-completion streamed outputs folded into one output per request
per step with all n completions in index order, as the stub reads every engine's outputs."""

from __future__ import annotations

from triton_vllm_multistep.engine.events import Completion, EngineOutput
from triton_vllm_multistep.engine_v1.completions import CompletionFold

STREAMED = {"n": 2, "output_kind": "DELTA", "logprobs": None}


def child(index: int, ids: list[int], finished: bool = False, reason: str | None = None, **fields) -> EngineOutput:
    completion = Completion(index, "".join(f"<{i}>" for i in ids), ids, -1.0 * len(ids), None, reason)
    return EngineOutput("r", [completion], finished, **fields)


def test_one_output_per_step_with_every_completion_and_the_prompt_once() -> None:
    fold = CompletionFold()
    fold.add("r", STREAMED)
    other = EngineOutput("s", [Completion(0, "x", [9])], False)
    (first, passed) = fold.fold([child(1, [5], prompt_tokens=3), other, child(0, [4], prompt_tokens=3)])
    assert passed is other  # another request's output is left as it is, in its place
    assert [(c.index, c.token_ids, c.text) for c in first.outputs] == [(0, [4], "<4>"), (1, [5], "<5>")]
    assert first.prompt_tokens == 3 and not first.finished
    # A later child's first output carries the prompt's length again: the stub reads it once.
    (second,) = fold.fold([child(1, [6], prompt_tokens=3)])
    assert second.prompt_tokens is None
    assert [(c.index, c.token_ids, c.text, c.cumulative_logprob) for c in second.outputs] == [
        (0, [], "", -1.0),  # nothing new: an empty delta keeping its last state
        (1, [6], "<6>", -1.0),
    ]


def test_a_completion_that_finished_first_keeps_its_finish_in_the_later_steps() -> None:
    fold = CompletionFold()
    fold.add("r", {**STREAMED, "logprobs": 1})
    (step,) = fold.fold([child(0, [4], reason="stop"), child(1, [5])])
    assert [c.finish_reason for c in step.outputs] == ["stop", None] and not step.finished
    (last,) = fold.fold([child(1, [6], finished=True, reason="length")])
    assert [(c.token_ids, c.finish_reason, c.logprobs) for c in last.outputs] == [
        ([], "stop", []),
        ([6], "length", None),
    ]
    assert last.finished
    # Finished: forgotten (a later request of that id is new).
    assert fold.fold([child(0, [1])])[0].outputs == [child(0, [1]).outputs[0]]


def test_whole_answers_single_completions_and_aborted_requests_pass_as_they_are() -> None:
    fold = CompletionFold()
    fold.add("whole", {"n": 2, "output_kind": "FINAL_ONLY"})
    fold.add("single", {"n": 1, "output_kind": "DELTA"})
    fold.add("r", STREAMED)
    fold.forget("r")
    outputs = [child(0, [1]), EngineOutput("whole", [Completion(0, "a", [1]), Completion(1, "b", [2])], True)]
    assert fold.fold(outputs) == outputs
