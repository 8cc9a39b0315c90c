"""Streaming modes through the real server: "merge" and `stream_interval` (per model and per request)
change how many responses carry the tokens, never the tokens: each concatenated stream equals the
non-streamed output, with one FINAL, last. Also over HTTP generate_stream.

Owns the served check of the response modes; the holding/merging rules themselves are unit-tested
(tests/unit/test_stream_merge.py). Must not assert on timings.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc.aio as grpcaio
from private_servers import add_models, loaded_into, ready_lines
from served_models import LLM_MODEL
from triton_clients import StreamResult, aio_generate, grpc_generate, http_generate

from triton_vllm_multistep.testing.local_server import ServerProcess

STEP = LLM_MODEL  # the session server's LLM model: per-step streaming, the default
MERGE = "llm_merge"
EVERY_3 = "llm_every_3"
TOKENS = 40
GREEDY = {"temperature": 0, "max_tokens": TOKENS, "ignore_eos": True}
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_tokens": TOKENS, "ignore_eos": True}
PROMPTS = [f"stream number {i} tells a story about {word}" for i, word in enumerate(["cats", "rain", "code", "tea"])]


@pytest.fixture(scope="module")
def modes_server(server: ServerProcess, model_repository: Path) -> Iterator[ServerProcess]:
    """The session's tiny server with this module's two models loaded; STEP is its vllm_model."""
    models = {MERGE: {"parameters": {"stream_mode": "merge"}}, EVERY_3: {"parameters": {"stream_interval": "3"}}}
    add_models(model_repository, models)
    with loaded_into(server, models):
        yield server


def _whole(server: ServerProcess, model: str, prompt: str, sampling: dict) -> list[int]:
    result = grpc_generate(server.grpc_url, model, prompt=prompt, sampling=sampling, stream=False)
    assert result.error is None and result.finals == 1, result.error
    return result.token_ids()


def _stream(server: ServerProcess, model: str, prompt: str, sampling: dict) -> StreamResult:
    result = grpc_generate(server.grpc_url, model, prompt=prompt, sampling=sampling, stream=True)
    assert result.error is None and result.finals == 1, result.error
    return result


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_every_mode_streams_exactly_the_non_streamed_tokens(modes_server: ServerProcess, sampling: dict) -> None:
    for prompt in PROMPTS:
        expected = _whole(modes_server, STEP, prompt, sampling)
        assert len(expected) == TOKENS
        for model in (STEP, MERGE, EVERY_3):
            result = _stream(modes_server, model, prompt, sampling)
            assert result.token_ids() == expected, (model, prompt)
        per_request = _stream(modes_server, STEP, prompt, {**sampling, "stream_interval": 5})
        assert per_request.token_ids() == expected


def test_stream_interval_sets_how_many_steps_a_response_carries(modes_server: ServerProcess) -> None:
    prompt = PROMPTS[0]
    step = _stream(modes_server, STEP, prompt, GREEDY)
    assert [len(r["output_ids"]) for r in step.data_responses] == [1] * TOKENS  # one response per step
    every_3 = _stream(modes_server, EVERY_3, prompt, GREEDY)
    sizes = [len(r["output_ids"]) for r in every_3.data_responses]
    assert sizes == [1] + [3] * 13, sizes  # the first token at once, then 3 steps per response (40 tokens)
    # The request's own interval wins over the model's.
    own = _stream(modes_server, EVERY_3, prompt, {**GREEDY, "stream_interval": 8})
    assert [len(r["output_ids"]) for r in own.data_responses] == [1, 8, 8, 8, 8, 7]
    text = "".join(
        e["text_output"]
        for e in http_generate(
            modes_server.http_url,
            EVERY_3,
            {"text_input": prompt, "stream": True, "parameters": {**GREEDY, "stream_interval": 4}},
            stream=True,
        )
    )
    assert text == step.text()


def test_merge_mode_under_load_keeps_every_stream_exact(modes_server: ServerProcess) -> None:
    """32 streams at once: the response thread falls behind at times and merges; nothing is lost or reordered."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} take {i}" for i in range(32)]
    expected = [_whole(modes_server, STEP, prompt, GREEDY) for prompt in prompts[:4]]

    async def run_all() -> list[StreamResult]:
        async with grpcaio.InferenceServerClient(modes_server.grpc_url) as client:
            jobs = [aio_generate(client, MERGE, prompt=p, sampling=GREEDY, stream=True) for p in prompts]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run_all())
    for result in results:
        assert result.error is None and result.finals == 1, result.error
        assert len(result.token_ids()) == TOKENS
        assert len(result.data_responses) <= TOKENS
    for result, tokens in zip(results[:4], expected, strict=True):
        assert result.token_ids() == tokens


def test_a_bad_stream_interval_fails_that_request_alone(modes_server: ServerProcess) -> None:
    result = grpc_generate(
        modes_server.grpc_url, STEP, prompt="hi", sampling={**GREEDY, "stream_interval": 0}, stream=True
    )
    assert result.finals == 1 and result.error is not None
    assert "sampling_parameters.stream_interval must be an integer between 1 and 1024, got 0" in result.error
    assert _stream(modes_server, STEP, "hi", GREEDY).token_ids()


def test_the_small_demo_model_is_served_with_a_core_left_for_the_response_path(modes_server: ServerProcess) -> None:
    """The thread policy through the real stub (vLLM sets OMP_NUM_THREADS while building: the
    policy must still apply). The demo model is far below FORWARD_BOUND_PARAMETERS."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2 or os.environ.get("OMP_NUM_THREADS") or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        pytest.skip("the policy leaves a core only on 2+ cores without a user thread setting")
    lines = [line for model in (STEP, MERGE, EVERY_3) for line in ready_lines(modes_server, model)]
    assert len(lines) == 3 and all(f"torch threads {cores - 1}," in line for line in lines), lines
