"""The smoke check's image section: the tiny LLaVA demo model's image prompts on the multi-step engine.

Owns the image requests and their checks (batch = alone = num_scheduler_steps 1, the image changes
the answer); must not decode images for the engine (EngineRequests carry their files).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from triton_vllm_multistep.checks.collector import EventCollector
from triton_vllm_multistep.checks.engines import greedy, in_engine_process, smoke_loop, submit
from triton_vllm_multistep.checks.report import SmokeReport, Stream

IMAGE_CHECKS = (
    "image batch = num_scheduler_steps 1",
    "image batch = alone",
    "the image changes the answer",
)


# What the image sections set over the config's engine arguments, besides the model (both engines' sections).
IMAGE_ENGINE_ARGS = {"max_model_len": 512, "limit_mm_per_prompt": {"image": 2}, "enable_lora": False}


def image_requests(model_dir: Path) -> dict[str, tuple[list[int], list[Any]]]:
    """request id → (prompt ids with the model's `<image>` placeholders, images)."""
    from transformers import AutoTokenizer

    from triton_vllm_multistep.checks import image_prompts as multimodal

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    red, noise = multimodal.solid_image(), multimodal.noise_image()
    one, two = tokenizer.encode(multimodal.IMAGE_PROMPT), tokenizer.encode(multimodal.TWO_IMAGE_PROMPT)
    return {
        "image-red": (one, [red]),
        "image-noise": (one, [noise]),
        "image-two": (two, [red, noise]),
        "image-text-only": (tokenizer.encode(multimodal.TEXT_PROMPT), []),
    }


def run_image_checks(report: SmokeReport, engine_args: Any, user_threads: dict[str, str | None] | None = None) -> None:
    """The image section: the tiny LLaVA demo model with the config's engine arguments (dtype, steps,
    attention, ...). Checks: requests with one and two images and a text-only one, queued before the
    engine steps, each give the tokens they give alone and those of num_scheduler_steps 1 (an engine
    process, run first: the images cross its pipe as the backend sends them); the image changes the
    answer."""

    from triton_vllm_multistep.demo import models, tiny_llava
    from triton_vllm_multistep.engine.factory import build_engine

    steps1_name, alone_name, changed_name = IMAGE_CHECKS
    model_dir = models.build(tiny_llava.NAME)
    image_args = dataclasses.replace(
        engine_args,
        model=str(model_dir),
        tokenizer=str(model_dir),
        **IMAGE_ENGINE_ARGS,
    )
    requests = image_requests(model_dir)
    max_tokens = engine_args.num_scheduler_steps + 4  # a prefill step, a whole window and a partial one

    def params() -> dict[str, Any]:
        return greedy(max_tokens)

    def submit_all(runner: Any) -> None:
        for request_id, (prompt, images) in requests.items():
            submit(runner, request_id, prompt, params(), images=images)

    print("image:", json.dumps({"model": str(model_dir), "requests": sorted(requests)}), flush=True)
    try:
        reference = in_engine_process(
            image_args,
            lambda runner, collector: collector.collect({request_id: Stream() for request_id in requests}),
            before_serve=submit_all,
            num_scheduler_steps=1,
        )
    except Exception as error:
        failure = f"the num_scheduler_steps 1 engine failed: {type(error).__name__}: {error}"
        reference = {request_id: Stream(failure=failure) for request_id in requests}
    loop = smoke_loop(lambda: build_engine(image_args, stream_mode="step"), user_threads)
    try:
        engine = loop.start_engine()
    except Exception as error:
        for name in IMAGE_CHECKS:
            report.check(name, False, f"the image model's engine failed to build: {type(error).__name__}: {error}")
        return
    try:
        collector = EventCollector(engine)
        submit_all(loop)
        loop.serve(collector.sink)
        batch = collector.collect({request_id: Stream() for request_id in requests})
        alone = {}
        for request_id, (prompt, images) in requests.items():
            submit(loop, request_id, prompt, params(), images=images)
            alone[request_id] = collector.collect({request_id: Stream()})[request_id]
    finally:
        loop.stop()
        engine.model_executor.shutdown()

    for name, others in ((steps1_name, reference), (alone_name, alone)):
        verdicts = {rid: stream.same_tokens(others[rid], max_tokens) for rid, stream in batch.items()}
        report.check(
            name,
            all(verdicts.values()),
            "; ".join(
                f"{request_id}: {stream.outcome()}, equal={verdicts[request_id]}"
                + ("" if verdicts[request_id] else f" (other: {others[request_id].outcome()})")
                for request_id, stream in batch.items()
            ),
        )
    answers = {request_id: tuple(stream.tokens) for request_id, stream in batch.items() if stream.failure is None}
    report.check(
        changed_name,
        len(answers) == len(requests) and len(set(answers.values())) == len(requests),
        "; ".join(f"{request_id}: {list(tokens)}" for request_id, tokens in answers.items()),
    )
