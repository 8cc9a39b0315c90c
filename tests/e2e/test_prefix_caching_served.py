"""Prefix caching and IPEX through the real server: a model with enable_prefix_caching in model.json
streams the same tokens as one without, and its hit-rate gauge shows the shared system prompt was
reused; `use_ipex` (auto by default) runs each model with IPEX only where prefix caching needs it,
and with or without it the greedy tokens are the same.

Owns the served prefix-caching and use_ipex checks; must not assert on timings.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from private_servers import add_models, loaded_into, metric, scrape, wait_for
from served_models import LLM_MODEL
from triton_clients import grpc_generate

from triton_vllm_multistep.testing.local_server import ServerProcess

PLAIN = "llm_plain"
CACHED = "llm_prefix_cached"
WITHOUT_IPEX = LLM_MODEL  # the session server's: use_ipex auto, off without prefix caching
SYSTEM = "system: you are terse; answer in plain words, count like 1 2 3 when asked. user: "
QUESTIONS = ["hello world", "the quick brown fox", "cats sleep near warm windows", "people write code"]
HIT_RATE = "vllm:gpu_prefix_cache_hit_rate"


@pytest.fixture(scope="module")
def prefix_server(server: ServerProcess, model_repository: Path) -> Iterator[ServerProcess]:
    """The session's tiny server with this module's two models loaded; WITHOUT_IPEX is its vllm_model."""
    models = {
        PLAIN: {"parameters": {"use_ipex": "true"}},
        CACHED: {"engine": {"enable_prefix_caching": True}},  # use_ipex auto: on, caching needs it
    }
    add_models(model_repository, models)
    with loaded_into(server, models):
        yield server


def _generate(server: ServerProcess, model: str, question: str, seeded: bool) -> list[int]:
    sampling = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.9, "seed": 7} if seeded else {"max_tokens": 24}
    result = grpc_generate(server.grpc_url, model, prompt=SYSTEM + question, sampling=sampling, stream=True)
    assert result.error is None and result.finals == 1, result.error
    return result.token_ids()


def test_prefix_cached_model_streams_the_same_tokens_and_reports_hits(prefix_server: ServerProcess) -> None:
    for seeded in (False, True):
        for question in QUESTIONS:
            plain = _generate(prefix_server, PLAIN, question, seeded)
            assert plain, question
            assert _generate(prefix_server, CACHED, question, seeded) == plain, (question, seeded)

    def gauges() -> tuple[float | None, float | None]:
        text = scrape(prefix_server)
        return metric(text, HIT_RATE, CACHED), metric(text, HIT_RATE, PLAIN)

    # The gauges are sampled by the engine thread and pushed by the responder: wait for the idle report.
    assert wait_for(lambda: (gauges()[0] or 0) > 0, timeout=30), gauges()
    cached_rate, plain_rate = gauges()
    assert 0 < cached_rate <= 1  # type: ignore[operator]
    assert plain_rate == -1


def test_perf_metrics_give_each_request_its_timings_and_its_prompt_tokens_from_the_cache(
    prefix_server: ServerProcess,
) -> None:
    """return_perf_metrics on the FINAL response, streamed and whole: the engine's timings in order
    within the client's own clock readings, and the prompt tokens taken from the prefix cache (none the
    first time, whole 16-token blocks when the same prompt comes again; none without caching)."""
    prompt = "system: a prompt no other test sends, long enough for several blocks of the cache. user: hi"
    counts = {}
    for model in (CACHED, PLAIN):
        runs = [
            grpc_generate(
                prefix_server.grpc_url,
                model,
                prompt=prompt,
                sampling={"max_tokens": 12, "temperature": 0},
                stream=stream,
                return_perf_metrics=True,
            )
            for stream in (True, False)
        ]
        assert all(run.error is None and run.finals == 1 for run in runs), [run.error for run in runs]
        assert runs[0].token_ids() == runs[1].token_ids() and len(runs[0].token_ids()) == 12
        counts[model] = [run.perf_metrics()["num_cached_tokens"] for run in runs]
    assert counts[CACHED][0] == 0 and counts[CACHED][1] >= 16 and counts[CACHED][1] % 16 == 0, counts
    assert counts[PLAIN] == [0, 0]


def test_use_ipex_auto_serves_without_ipex_unless_prefix_caching_and_the_greedy_tokens_stay(
    prefix_server: ServerProcess,
) -> None:
    log = prefix_server.log_path.read_text(errors="replace")
    found = re.findall(r"model (\S+) \(.*?\) ready: .*?attention kernels (.*?), drains", log)
    kernels = {model: kernel for model, kernel in found if model in (WITHOUT_IPEX, PLAIN, CACHED)}
    # Each model runs in a stub of its own: turning IPEX off in one leaves the others on it.
    assert kernels == {
        WITHOUT_IPEX: "PyTorch SDPA (IPEX off: use_ipex)",
        PLAIN: "IPEX",
        CACHED: "IPEX",
    }, kernels
    for question in QUESTIONS:
        greedy = [
            grpc_generate(
                prefix_server.grpc_url, model, prompt=SYSTEM + question, sampling={"max_tokens": 24, "temperature": 0}
            )
            for model in (WITHOUT_IPEX, PLAIN)
        ]
        assert all(result.error is None and result.finals == 1 for result in greedy), question
        assert greedy[0].token_ids() == greedy[1].token_ids(), question
