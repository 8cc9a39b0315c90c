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

from dataclasses import dataclass, field

from triton_vllm_multistep.engine.deltas import merge_deltas
from triton_vllm_multistep.engine.events import Completion, EngineOutput


@dataclass
class _Streamed:
    completions: int
    logprobs: bool  # asked for: an empty delta carries [] (no tokens, no logprobs), not None
    last: dict[int, Completion] = field(default_factory=dict)
    # Each completion's first output carries the prompt's length (and prompt logprobs): the stub reads
    # them in the request's first output only.
    prompt_sent: bool = False


class CompletionFold:
    """Per streamed request with n > 1: its completions' last state, and each step's outputs folded."""

    def __init__(self) -> None:
        self._streamed: dict[str, _Streamed] = {}

    def add(self, request_id: str, sampling: dict) -> None:
        """Remember a request taken in (its plain sampling fields) if its outputs need folding."""
        completions = sampling.get("n") or 1
        if completions > 1 and sampling.get("output_kind") == "DELTA":
            self._streamed[request_id] = _Streamed(completions, sampling.get("logprobs") is not None)

    def forget(self, request_id: str) -> None:
        self._streamed.pop(request_id, None)

    def fold(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """One step's outputs with one per request (each folded request where its first output was)."""
        if not self._streamed:
            return outputs
        merged: dict[str, EngineOutput] = {}
        order: list[EngineOutput | str] = []
        for output in outputs:
            if output.request_id not in self._streamed:
                order.append(output)
                continue
            earlier = merged.get(output.request_id)
            merged[output.request_id] = output if earlier is None else merge_deltas(earlier, output)
            if earlier is None:
                order.append(output.request_id)
        return [self._complete(merged[item]) if isinstance(item, str) else item for item in order]

    def _complete(self, output: EngineOutput) -> EngineOutput:
        streamed = self._streamed[output.request_id]
        new = {completion.index: completion for completion in output.outputs}
        completions = []
        for index in range(streamed.completions):
            completion = new.get(index)
            if completion is None:
                last = streamed.last.get(index)
                completion = Completion(
                    index,
                    "",
                    [],
                    None if last is None else last.cumulative_logprob,
                    [] if streamed.logprobs else None,
                    None if last is None else last.finish_reason,
                    None if last is None else last.stop_reason,
                )
            streamed.last[index] = completion
            completions.append(completion)
        if output.finished:
            self.forget(output.request_id)
        if streamed.prompt_sent:
            return output._replace(outputs=completions, prompt_tokens=None, prompt_logprobs=None)
        streamed.prompt_sent = True
        return output._replace(outputs=completions)
