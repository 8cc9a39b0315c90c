"""The smoke check's structured-output section: constrained streams beside an unconstrained one.

Owns the constrained requests, streaming them beside a plain stream, the single-step reference
and the verdicts; must not build engines other than through checks/engines.py.
"""

from __future__ import annotations

import json
from typing import Any

from triton_vllm_multistep.checks.collector import EventCollector
from triton_vllm_multistep.checks.engines import in_engine_process, submit
from triton_vllm_multistep.checks.report import SmokeReport, Stream

# Structured output (the README's kinds as clients send them; greedy): bounded so that a small model ends them.
CHOICES = ["yes", "no", "not sure"]
JSON_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "certain": {"type": "boolean"}},
    "required": ["answer", "certain"],
}
CONSTRAINED_MAX_TOKENS = 64


def constrained_requests(max_tokens: int = CONSTRAINED_MAX_TOKENS) -> dict[str, Any]:
    """The structured-output requests (request id → sampling fields), as the stub hands them to the
    engine loop: vLLM's GuidedDecodingParams fields (backend: the engine's default), streamed, greedy."""

    def constrained(**constraint: Any) -> dict[str, Any]:
        return {"max_tokens": max_tokens, "temperature": 0.0, "guided_decoding": constraint, "output_kind": "DELTA"}

    return {"structured-choice": constrained(choice=CHOICES), "structured-json": constrained(json=JSON_SCHEMA)}


def stream_beside_constrained(loop: Any, collector: EventCollector, prompt: list[int], plain: Any) -> dict[str, Stream]:
    """An unconstrained stream (`plain`), then, once it runs, the structured-output requests beside
    it, through `loop.submit` (EngineLoop or EngineProcess: the constraint is built off the engine
    thread, engine/constraints.py); every stream to its end. Keys: request ids, "structured-beside"
    for the unconstrained one.

    The same constraints go through once first with one token each (the builder loads its
    tokenizer, the guided-decoding backend compiles and caches the grammars), so that those beside
    the unconstrained stream join it within a step or two and a short stream outlasts them."""
    warm_up = {f"{request_id}-warm-up": params for request_id, params in constrained_requests(1).items()}
    for request_id, params in warm_up.items():
        submit(loop, request_id, prompt, params)
    collector.collect({request_id: Stream() for request_id in warm_up})
    streams = {"structured-beside": Stream()}
    submit(loop, "structured-beside", prompt, plain)
    collector.collect(streams, until=lambda: bool(streams["structured-beside"].deltas))
    for request_id, params in constrained_requests().items():
        streams[request_id] = Stream()
        submit(loop, request_id, prompt, params)
    return collector.collect(streams)


def single_step_reference(engine_args: Any, prompt: list[int], plain: Any) -> dict[str, Stream]:
    """`stream_beside_constrained` on the same engine with num_scheduler_steps 1, in a process of its
    own (exited on return); an engine that cannot be built or run fails every stream with its error."""
    try:
        return in_engine_process(
            engine_args,
            lambda runner, collector: stream_beside_constrained(runner, collector, prompt, plain),
            num_scheduler_steps=1,
        )
    except Exception as error:
        failure = f"the num_scheduler_steps 1 engine failed: {type(error).__name__}: {error}"
        return {request_id: Stream(failure=failure) for request_id in ("structured-beside", *constrained_requests())}


def obeys_constraint(request_id: str, stream: Stream) -> bool:
    """The request ended by its constraint (not max_tokens) and its text is what the constraint allows."""
    if stream.failure is not None or stream.finish_reason != "stop":
        return False
    if request_id == "structured-choice":
        return stream.text in CHOICES
    try:
        document = json.loads(stream.text)
    except json.JSONDecodeError:
        return False
    return isinstance(document, dict) and set(JSON_SCHEMA["required"]) <= set(document)


def check_structured_output(
    report: SmokeReport,
    streams: dict[str, Stream],
    reference: dict[str, Stream],
    alone: list[list[int]],
) -> None:
    """The structured-output checks: obeyed, the tokens of num_scheduler_steps 1, one output per
    step, and the unconstrained stream beside them unchanged (`alone`: its deltas run alone)."""
    constrained = {request_id: streams[request_id] for request_id in constrained_requests()}
    report.check(
        "structured output obeys its constraint (choice, JSON schema)",
        all(obeys_constraint(request_id, stream) for request_id, stream in constrained.items()),
        "; ".join(f"{request_id}: {stream.outcome()}" for request_id, stream in constrained.items()),
    )
    same = {request_id: stream.same_tokens(reference[request_id]) for request_id, stream in constrained.items()}
    report.check(
        "structured output gives the tokens of num_scheduler_steps 1",
        all(same.values()),
        "; ".join(
            f"{request_id}: "
            + (f"{len(stream.tokens)} tokens" if stream.failure is None else f"failed: {stream.failure}")
            + f", equal={same[request_id]} (steps 1: {reference[request_id].outcome()})"
            for request_id, stream in constrained.items()
        ),
    )
    report.check(
        "structured output streams one output per decoded step",
        all(stream.finished and all(len(d) == 1 for d in stream.deltas) for stream in constrained.values()),
        "; ".join(
            f"{request_id}: {len(stream.deltas)} outputs of sizes {sorted({len(d) for d in stream.deltas})}"
            + (f", failed: {stream.failure}" if stream.failure is not None else "")
            for request_id, stream in constrained.items()
        ),
    )
    beside = streams["structured-beside"]
    shared = {request_id: len(stream.steps & beside.steps) for request_id, stream in constrained.items()}
    report.check(
        "an unconstrained stream beside structured output streams the steps it has alone",
        beside.failure is None and beside.deltas == alone and all(shared.values()),
        f"{len(beside.deltas)} outputs, alone {len(alone)}, equal={beside.deltas == alone}; steps shared with "
        + ", ".join(f"{request_id} {count}" for request_id, count in shared.items())
        + (f"; failed: {beside.failure}" if beside.failure is not None else ""),
    )
