"""The GPU smoke check's V1 section (`--only v1`): the model on vLLM's current engine, as a
`vllm_engine: v1` model runs it.

Owns: the model's engine arguments as the README's V1 block makes them (model.json and the
config's engine_args through settings/, multi-step's settings dropped), its V1 engine process under
the V1 environment's Python (TRITON_VLLM_MULTISTEP_V1_PYTHON: the image's /opt/vllm-v1, or
scripts/setup.sh's .venv-v1), and the checks: greedy and seeded text prompts in one batch, each
streamed one output per decoded step, each equal (ids and text) to V1's offline `LLM` in the same
environment; then the image checks (checks/v1_images.py: on GPU the tiny LLaVA model's image
prompts equal to V1's offline LLM, on CPU its load error); it reports what V1 runs (async
scheduling: vLLM's own choice on GPU, off on CPU unless model.json asks). Must not start Triton.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from triton_vllm_multistep.checks.collector import EventCollector
from triton_vllm_multistep.checks.report import SmokeReport

PROMPTS = ("The capital of France is", "Three colours of the rainbow are")
MAX_TOKENS = 16
SAMPLINGS = {
    "greedy": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
    "seeded": {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_tokens": MAX_TOKENS, "ignore_eos": True},
}
WAIT_SECONDS = 600.0  # a first GPU step may compile kernels


def v1_engine_values(
    model_dir: Path, config_file: Path, model: str | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The engine arguments a V1 copy of the model runs (the README's V1 block: model.json without its
    multi-step settings, `vllm_engine: v1`), read as its stub reads them, with --model and
    --engine-args over them."""
    from triton_vllm_multistep.checks.pbtxt import pbtxt_string_parameters
    from triton_vllm_multistep.settings import config_with_parameters
    from triton_vllm_multistep.settings.backend import MULTI_STEP_ONLY_ENGINE_ARGS
    from triton_vllm_multistep.settings.engine_json import apply_config_engine_args, engine_values, load_engine_json

    parameters = {**pbtxt_string_parameters(config_file.read_text()), "vllm_engine": "v1"}
    merged = apply_config_engine_args(load_engine_json(model_dir, "1"), config_with_parameters(parameters))
    merged = {k: v for k, v in merged.items() if k not in MULTI_STEP_ONLY_ENGINE_ARGS}
    merged.update({**({"model": model} if model is not None else {}), **(overrides or {})})
    return engine_values(merged, model_dir, "step", "v1")


def run_v1_checks(report: SmokeReport, engine_values: dict[str, Any], python: str | None = None) -> None:
    """Build the V1 engine process, stream the requests in one batch, compare with V1's offline LLM."""
    from triton_vllm_multistep.checks.v1_reference import offline_v1_outputs
    from triton_vllm_multistep.engine.events import EngineRequest
    from triton_vllm_multistep.engine.process import EngineProcess, EngineSpec
    from triton_vllm_multistep.settings.v1_environment import configured_v1_python, no_v1_environment

    python = python or configured_v1_python()
    if python is None:
        report.skip("v1 engine", no_v1_environment("the V1 checks"))
        return
    requests = [
        EngineRequest(f"{kind}-{i}", (), {**sampling, "output_kind": "DELTA"}, prompt_text=prompt)
        for kind, sampling in SAMPLINGS.items()
        for i, prompt in enumerate(PROMPTS)
    ]
    process = EngineProcess(EngineSpec(engine_values, "step"), python=python, v1=True)
    try:
        process.start_engine()
        facts = process.facts
        report.engine["v1"] = {
            "model": facts.model,
            "max_model_len": facts.max_model_len,
            "async_scheduling": facts.async_scheduling,
            "torch_threads": process.torch_threads,
        }
        report.check("v1 engine process builds", True, f"{facts.model}, async scheduling {facts.async_scheduling}")
        collector, ended = stream_in_one_batch(process, requests)
    finally:
        process.stop()
    if not streamed_per_step(report, "v1", collector, ended):
        return
    fields = {key: value for key, value in engine_values.items() if value is not None}
    offline = offline_v1_outputs(Path(python), fields, [(r.request_id, r.prompt_text, r.sampling) for r in requests])
    equal_to_offline(report, collector, offline, "V1's offline LLM")
    from vllm.platforms import current_platform  # this environment's vLLM: the host's platform

    from triton_vllm_multistep.checks.v1_images import run_v1_image_checks

    run_v1_image_checks(report, engine_values, python, on_cpu=current_platform.is_cpu())


def stream_in_one_batch(process: Any, requests: list[Any]) -> tuple[EventCollector, bool]:
    """`requests` submitted to a built V1 engine process at once; its events, and whether every request ended."""
    collector = EventCollector(expected=len(requests))
    process.serve(collector.sink)
    for request in requests:
        process.submit(request)
    return collector, collector.done.wait(WAIT_SECONDS)


def streamed_per_step(report: SmokeReport, what: str, collector: EventCollector, ended: bool) -> bool:
    """The checks of every V1 batch: each request ended, one output per decoded step; False when they did not end."""
    if not report.check(f"{what} requests end", ended and not collector.failed, f"failed: {collector.failed}"):
        return False
    per_step = collector.steps_per_output
    report.check(
        f"{what} streams one output per decoded step", per_step == {1}, f"tokens per output: {sorted(per_step)}"
    )
    return True


def equal_to_offline(
    report: SmokeReport, collector: EventCollector, offline: dict[str, tuple[list[int], str]], reference: str
) -> None:
    """One check per request: its streamed ids and text equal `offline`'s (request id → V1's offline answer)."""
    for rid, (ids, text) in offline.items():
        same = collector.tokens.get(rid) == ids and collector.texts.get(rid) == text
        report.check(f"v1 {rid} equals {reference}", same, f"{len(ids)} tokens, text {text!r}")
