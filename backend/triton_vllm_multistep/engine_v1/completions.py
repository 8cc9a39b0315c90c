"""A streamed V1 request's n completions as one output per step, the shape the stub reads from every engine.

Owns the folding: vLLM V1 streams (output kind DELTA) each of a request's n > 1 completions as a
RequestOutput of its own (the request's id, that one completion with its index, `finished` once all
are), and none for a completion with nothing new or finished before; the stub answers one output per
request per step with all n completions in index order (one array element per completion: index =
position), as the multi-step engine's outputs are. A completion with nothing new in a step is an
empty delta that keeps its last finish and stop reason and cumulative logprob, as V0 sends it. Whole
answers (FINAL_ONLY) come as one output with all n already: passed on as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from triton_vllm_multistep.engine.deltas import merge_deltas
from triton_vllm_multistep.engine.events import Completion, EngineOutput


@dataclass
class _Streamed:
    # Per completion, what it is in a step with nothing new for it: an empty delta keeping its last
    # finish and stop reason and cumulative logprob ([] logprobs when asked for, else None).
    idle: list[Completion]
    # Each completion's first output carries the prompt's length (and prompt logprobs): the stub reads
    # them in the request's first output only.
    prompt_sent: bool = False


class CompletionFold:
    """Per streamed request with n > 1: its completions' idle deltas, and each step's outputs folded."""

    def __init__(self) -> None:
        self._streamed: dict[str, _Streamed] = {}

    def add(self, request_id: str, sampling: dict) -> None:
        """Remember a request taken in (its plain sampling fields) if its outputs need folding."""
        completions = sampling.get("n") or 1
        if completions > 1 and sampling.get("output_kind") == "DELTA":
            logprobs = [] if sampling.get("logprobs") is not None else None
            self._streamed[request_id] = _Streamed([Completion(i, "", [], None, logprobs) for i in range(completions)])

    def forget(self, request_id: str) -> None:
        self._streamed.pop(request_id, None)

    def fold(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """One step's outputs with one per request, in the order of each request's first output."""
        if not self._streamed:
            return outputs
        merged: dict[str, EngineOutput] = {}
        for output in outputs:
            earlier = merged.get(output.request_id)
            merged[output.request_id] = output if earlier is None else merge_deltas(earlier, output)
        return [self._complete(output) if output.request_id in self._streamed else output for output in merged.values()]

    def _complete(self, output: EngineOutput) -> EngineOutput:
        streamed = self._streamed[output.request_id]
        for completion in output.outputs:
            streamed.idle[completion.index] = completion._replace(
                text="", token_ids=[], logprobs=streamed.idle[completion.index].logprobs
            )
        new = {completion.index: completion for completion in output.outputs}
        completions = [new.get(index, idle) for index, idle in enumerate(streamed.idle)]
        if output.finished:
            self.forget(output.request_id)
        if streamed.prompt_sent:
            return output._replace(outputs=completions, prompt_tokens=None, prompt_logprobs=None)
        streamed.prompt_sent = True
        return output._replace(outputs=completions)
