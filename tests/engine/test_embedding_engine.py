"""An embedding model on the multi-step engine's vLLM (0.8.5): the served loop (warm-up, admission,
outputs) pools each prompt once and hands the vector over as plain floats; what it refuses, it refuses
at load or for that request alone, in words naming the setting.

Runs vLLM's own one-step pooling engine on the demo embedding model (all-MiniLM-L6-v2); the
sentence-transformers comparison and the server are the e2e tier's (test_embeddings_served.py).
"""

from __future__ import annotations

import os
import threading

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
from vllm import LLM, EngineArgs

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine.events import EngineRequest, RequestFailed, StepOutputs
from triton_vllm_multistep.engine.factory import EngineBuildError, build_engine
from triton_vllm_multistep.engine.loop import engine_facts, serving_loop

PROMPTS = ((101, 1996, 2833, 102), (101, 7592, 2088, 999, 2088, 102), (101, 102))


def _args(**kwargs: object) -> EngineArgs:
    return EngineArgs(model=str(demo_models.build("all-minilm-l6-v2")), dtype="float32", **kwargs)


def _serve(requests: list[EngineRequest], **engine: object) -> dict[str, object]:
    """Every request through a served loop (warmed up as the stub's): request id → its output or failure."""
    answers: dict[str, object] = {}
    done = threading.Event()

    def sink(event: object) -> None:
        if isinstance(event, StepOutputs):
            answers.update((output.request_id, output) for output in event.outputs if output.finished)
        elif isinstance(event, RequestFailed):
            answers[event.request_id] = event
        if len(answers) == len(requests):
            done.set()

    loop = serving_loop(_args(task="embed", **engine), "step", {})
    loop.start_engine()
    try:
        facts = engine_facts(loop.engine)
        assert facts.tasks == ("embed",) and facts.num_scheduler_steps == 1
        loop.serve(sink)
        for request in requests:
            loop.submit(request)
        assert done.wait(60)
    finally:
        loop.shutdown()
    return answers


def test_a_batch_of_embeddings_equals_vllms_offline_embed_and_dimensions_fail_alone() -> None:
    requests = [EngineRequest(f"e{i}", prompt, pooling={}) for i, prompt in enumerate(PROMPTS)]
    requests.append(EngineRequest("shorter", PROMPTS[0], pooling={"dimensions": 8}))
    answers = _serve(requests)
    refused = answers.pop("shorter")
    assert isinstance(refused, RequestFailed) and "does not support matryoshka representation" in refused.message
    offline = LLM(**{**vars(_args(task="embed")), "disable_log_stats": True})
    try:
        expected = [o.outputs.embedding for o in offline.embed([{"prompt_token_ids": list(p)} for p in PROMPTS])]
    finally:
        del offline
    for i, prompt in enumerate(PROMPTS):
        output = answers[f"e{i}"]
        assert output.outputs == [] and output.prompt_tokens == len(prompt) and len(output.embedding) == 384
        assert output.embedding == pytest.approx(expected[i], abs=1e-6)


def test_dimensions_reach_vllms_pooler_for_a_model_trained_for_them() -> None:
    """`dimensions` for a matryoshka model (here the demo model declared one through vLLM's
    hf_overrides): vLLM's pooler keeps the first N values and normalises them again."""
    import math

    answers = _serve(
        [EngineRequest("full", PROMPTS[1], pooling={}), EngineRequest("eight", PROMPTS[1], pooling={"dimensions": 8})],
        hf_overrides={"is_matryoshka": True},
    )
    full, eight = answers["full"].embedding, answers["eight"].embedding
    norm = math.sqrt(sum(value * value for value in full[:8]))
    assert len(eight) == 8 and eight == pytest.approx([value / norm for value in full[:8]], abs=1e-6)


def test_an_embedding_model_without_task_gets_the_multi_step_default_and_is_refused_naming_task() -> None:
    with pytest.raises(EngineBuildError, match='is an embedding model .*num_scheduler_steps=8 .*set "task": "embed"'):
        build_engine(_args(num_scheduler_steps=8))
