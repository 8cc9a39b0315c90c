"""The GPU smoke check's V1 image checks (section "v1"): the tiny LLaVA demo model on vLLM's current engine.

Owns the V1 image requests and their checks. On a GPU host: requests with one and two images and a
text-only one, in one batch through the V1 engine process (the images cross its pipe as the stub
sends them, as files), each streamed one output per decoded step and equal (ids and text) to V1's
offline `LLM` in the V1 environment given the same prompt and images; the image changes the answer.
On a CPU host (`--cpu`): the load error saying image models need a GPU on V1 (the V1 environment on CPU
has no torchvision). Must not start Triton.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from triton_vllm_multistep.checks.report import SmokeReport
from triton_vllm_multistep.checks.v1_engine import equal_to_offline, stream_in_one_batch, streamed_per_step

MAX_TOKENS = 12
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
CPU_REFUSAL = "serves it on GPU hosts only"  # engine_v1/process.py refuse_image_models_on_cpu


def image_engine_values(engine_values: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """The V1 engine arguments with the image model in place of the user's, as the multi-step section sets them."""
    from triton_vllm_multistep.checks.images import IMAGE_ENGINE_ARGS

    return {**engine_values, "model": str(model_dir), "tokenizer": str(model_dir), **IMAGE_ENGINE_ARGS}


def run_v1_image_checks(report: SmokeReport, engine_values: dict[str, Any], python: str, on_cpu: bool) -> None:
    """Build the tiny LLaVA model's V1 engine process; on GPU stream the image requests in one batch and
    compare with V1's offline LLM, on CPU check the load error."""
    from triton_vllm_multistep.checks.images import image_requests
    from triton_vllm_multistep.checks.v1_reference import offline_v1_outputs
    from triton_vllm_multistep.demo import models, tiny_llava
    from triton_vllm_multistep.engine.events import EngineBuildError, EngineRequest
    from triton_vllm_multistep.engine.process import EngineProcess, EngineSpec
    from triton_vllm_multistep.interface import image_file

    model_dir = models.build(tiny_llava.NAME)
    values = image_engine_values(engine_values, model_dir)
    prompts = {
        rid: (ids, tuple(image_file(image) for image in images))
        for rid, (ids, images) in image_requests(model_dir).items()
    }
    requests = [
        EngineRequest(rid, tuple(ids), {**GREEDY, "output_kind": "DELTA"}, images=files)
        for rid, (ids, files) in prompts.items()
    ]
    process = EngineProcess(EngineSpec(values, "step"), python=python, v1=True)
    try:
        try:
            process.start_engine()
        except EngineBuildError as error:
            if on_cpu:
                report.check("v1 image model is a load error on CPU", CPU_REFUSAL in str(error), str(error))
            else:
                report.check("v1 image engine process builds", False, str(error))
            return
        if on_cpu:
            report.check("v1 image model is a load error on CPU", False, "it loaded on a CPU host")
            return
        report.check("v1 image engine process builds", True, str(model_dir))
        collector, ended = stream_in_one_batch(process, requests)
    finally:
        process.stop()
    if not streamed_per_step(report, "v1 image", collector, ended):
        return
    fields = {key: value for key, value in values.items() if value is not None}
    offline = offline_v1_outputs(
        Path(python),
        fields,
        [(rid, list(ids), GREEDY) for rid, (ids, _) in prompts.items()],
        images={rid: files for rid, (_, files) in prompts.items()},
    )
    equal_to_offline(report, collector, offline, "V1's offline LLM with its images")
    answers = {tuple(collector.tokens.get(rid, ())) for rid in prompts}
    report.check("v1: the image changes the answer", len(answers) == len(prompts), f"{len(answers)} distinct answers")
