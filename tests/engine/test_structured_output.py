"""Structured output (guided decoding) through the engine loop with the CPU multi-step runner.

Each constraint kind, with vLLM 0.8.5's backends on CPU, gives the same tokens at
num_scheduler_steps 8 as at 1 (greedy and seeded), beside unconstrained requests in the same batch,
and obeys its constraint; a constraint the backend cannot build, or one that fails while decoding,
fails its request alone; an abort while a constraint is being built drops it. Real engine, demo model.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import jsonschema
import pytest
from vllm import EngineArgs

from triton_vllm_multistep.checks.collector import EventCollector
from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine.constraints import ConstraintGuard
from triton_vllm_multistep.engine.events import EngineRequest
from triton_vllm_multistep.engine.factory import build_engine
from triton_vllm_multistep.engine.loop import EngineLoop

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "choice": {"choice": ["yes", "no", "maybe"]},
    "regex": {"regex": "[a-c]{3}-[0-9]{2}"},
    "json": {"json": SCHEMA},
    "json_object": {"json_object": True},
    "grammar": {"grammar": 'root ::= "x" ("y" | "z")+ "."'},
}
BACKENDS = ("xgrammar", "guidance", "lm-format-enforcer", "outlines")
PROMPT = [1, 5, 9, 13]


# Sampling fields as the stub sends them (EngineRequest.sampling): vLLM's names, JSON values.
Sampling = dict[str, Any]
DELTA = "DELTA"


def _requests() -> dict[str, tuple[list[int], Sampling]]:
    requests = {}
    for backend in BACKENDS:
        for kind, constraint in CONSTRAINTS.items():
            if backend == "outlines" and kind == "grammar":
                continue  # outlines reads Lark grammars, not this GBNF (its own error, tested below)
            for seed in (None, 7):
                params = {
                    "max_tokens": 48,
                    "temperature": 0.0 if seed is None else 1.0,
                    **({} if seed is None else {"seed": seed}),
                    "guided_decoding": {"backend": backend, **constraint},
                    "output_kind": DELTA,
                }
                requests[f"{backend}:{kind}:{seed}"] = (PROMPT, params)
    for index in range(3):  # unconstrained requests in the same batch
        params = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True, "output_kind": DELTA}
        requests[f"plain:{index}"] = ([1, 2 + index, 3], params)
    return requests


def _serve(steps: int, requests: dict[str, tuple[list[int], Sampling]]) -> EventCollector:
    path = str(demo_models.build("tiny-llama-bpe"))
    args = EngineArgs(model=path, dtype="float32", max_model_len=256, num_scheduler_steps=steps, seed=0)
    loop = EngineLoop(lambda: build_engine(args, stream_mode="step"))
    loop.start_engine()
    collector = EventCollector(expected=len(requests))
    try:
        loop.serve(collector.sink)
        for request_id, (prompt, params) in requests.items():
            loop.submit(EngineRequest(request_id, tuple(prompt), params))
        assert collector.done.wait(600), "not every request ended"
    finally:
        loop.shutdown()
    return collector


@pytest.fixture(scope="module")
def served() -> dict[int, EventCollector]:
    requests = _requests()
    return {steps: _serve(steps, requests) for steps in (8, 1)}


def test_every_constraint_gives_the_tokens_of_single_step_decoding(served: dict[int, EventCollector]) -> None:
    multi, single = served[8], served[1]
    assert multi.failed == {} and single.failed == {}
    assert set(multi.tokens) == set(_requests())
    for request_id in _requests():
        assert multi.tokens[request_id] == single.tokens[request_id], request_id
    assert multi.steps_per_output == {1}  # streamed one token per step


def json_of(request_id: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise AssertionError(f"{request_id}: not JSON ({error}): {text!r}") from None


def test_every_constrained_output_obeys_its_constraint(served: dict[int, EventCollector]) -> None:
    for request_id, text in served[8].texts.items():
        if request_id.startswith("plain:"):
            continue
        backend, kind, _ = request_id.split(":")
        if backend == "lm-format-enforcer" and kind.startswith("json"):
            # It lets a dead-ended JSON stop (EOS) on this random-weight model, at one step as at
            # eight (the tokens are compared above): the backend's behaviour, not the window's.
            continue
        finished = served[8].finish_reasons[request_id] == "stop"  # by the grammar, not max_tokens
        if kind == "choice":
            assert text in CONSTRAINTS["choice"]["choice"], request_id
        elif kind == "regex":
            assert re.fullmatch(CONSTRAINTS["regex"]["regex"], text), (request_id, text)
        elif kind == "grammar":
            assert re.fullmatch(r"x[yz]+\.", text), (request_id, text)
        elif kind == "json" and finished:
            jsonschema.validate(json_of(request_id, text), SCHEMA)
        elif kind == "json_object" and finished:
            assert isinstance(json_of(request_id, text), dict), (request_id, text)


def test_a_constraint_the_backend_cannot_build_fails_its_request_alone() -> None:
    requests = {
        "bad-regex": (PROMPT, {"max_tokens": 8, "guided_decoding": {"regex": "(unclosed"}}),
        "lark-only": (PROMPT, {"max_tokens": 8, "guided_decoding": {"grammar": 'root ::= "x"', "backend": "outlines"}}),
        "fine": (PROMPT, {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "output_kind": DELTA}),
    }
    collector = _serve(8, requests)
    assert set(collector.failed) == {"bad-regex", "lark-only"}
    # Built at admission (outlines) or at the first step (xgrammar compiles a regex lazily): failed alone either way.
    assert collector.failed["lark-only"].startswith("guided_decoding cannot be built: ")
    bad_regex = collector.failed["bad-regex"]
    assert re.match(r"guided_decoding (cannot be built|failed while decoding): .*parenthesis", bad_regex), bad_regex
    assert "bad-regex" not in collector.tokens  # nothing decoded without its constraint reached the client
    assert len(collector.tokens["fine"]) == 8


def test_a_constraint_that_fails_while_decoding_fails_its_request_alone_and_sends_nothing_unconstrained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backend that raises inside the forward step (a lazily compiled grammar it cannot follow)."""
    calls = {"n": 0}
    real_call = ConstraintGuard.__call__

    def failing_on_the_third_step(self: ConstraintGuard, *args: Any) -> Any:
        if self.request_id == "breaks":
            calls["n"] += 1
            if calls["n"] == 3:
                self.processor = lambda *_: (_ for _ in ()).throw(RuntimeError("grammar state lost"))
        return real_call(self, *args)

    monkeypatch.setattr(ConstraintGuard, "__call__", failing_on_the_third_step)
    requests = {
        "breaks": (PROMPT, {"max_tokens": 40, "guided_decoding": {"regex": "[a-z]{30}"}, "output_kind": DELTA}),
        "steady": (PROMPT, {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True, "output_kind": DELTA}),
    }
    collector = _serve(8, requests)
    assert collector.failed == {"breaks": "guided_decoding failed while decoding: RuntimeError: grammar state lost"}
    assert len(collector.tokens.get("breaks", [])) == 2  # the two constrained steps, not the third
    assert re.fullmatch("[a-z]+", collector.texts["breaks"])  # what went out was constrained
    assert len(collector.tokens["steady"]) == 40
