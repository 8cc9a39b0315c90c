"""GPU smoke test of the engine path: the shipped config's engine, streamed, cancelled, idle, reported.

Owns the checks a user runs once on a GPU host (scripts/gpu_smoke.sh; docs/gpu.md): build the
engine exactly as the backend does (model.json + the config's engine_args → settings/ →
engine.factory.build_engine, driven by engine.loop.EngineLoop), then check per-step streaming,
the final output, cancelling mid-window and the first token after an idle period, and report the
attention backend, CUDA graphs and async output processing vLLM uses. First, the same engine in
a process of its own (engine.process, the backend's default) streams one request; its tokens must
be the in-process engine's. Then the engine with num_scheduler_steps 1, also in a process of its
own, streams the structured-output requests (choice and JSON schema) beside an unconstrained stream:
the in-process engine must give the same tokens, obeying the constraint, one output per step, the
unconstrained stream's tokens those it has alone. Last (section "lora", `--only lora` runs it
alone), multi-LoRA: the engine with enable_lora and two adapters (constructed for a Llama-style local
model by checks/adapters.py, or the user's with --lora-adapters) runs the base and the adapters in one
batch: each must give its tokens alone and those of num_scheduler_steps 1, the adapters must change
the answer, and (models small enough for transformers on the host) equal the merged-weights
reference; checks that cannot run are reported skipped, with the reason. Section "image" (`--only
image`): the tiny LLaVA demo model (built locally, demo/tiny_llava.py) with the config's engine
arguments: requests with one and two images and a text request in one batch each give their tokens
alone and those of num_scheduler_steps 1 (engine process: images cross its pipe), and the image
changes the answer. Section "v1" (`--only v1`): the model on vLLM's current engine, as a `vllm_engine:
v1` copy of it runs (checks/v1_engine.py): text prompts streamed one output per step in one batch,
each equal to V1's offline LLM in the V1 environment. `--cpu` runs the same
checks on the CPU engine (what tests/engine/test_gpu_smoke_cpu.py runs; the sections live beside this module in
checks/). Must not start Triton,
and refuses to run without a GPU unless `--cpu` is given. Takes well under 10 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from triton_vllm_multistep.checks.engine_checks import run_engine_checks
from triton_vllm_multistep.checks.engines import engine_args_from_config, release_engine_memory
from triton_vllm_multistep.checks.images import run_image_checks
from triton_vllm_multistep.checks.lora import run_lora_checks
from triton_vllm_multistep.checks.lora_reference import TRANSFORMERS_MAX_PARAMS, parse_lora_adapters
from triton_vllm_multistep.checks.report import SmokeReport
from triton_vllm_multistep.checks.v1_engine import run_v1_checks, v1_engine_values

NO_GPU_MESSAGE = "no CUDA device: this script is for GPU hosts (--cpu runs the same checks on the CPU engine)"
SECTIONS = ("engine", "lora", "image", "v1")  # --only chooses one


def run_smoke(
    engine_args: Any,
    sections: Sequence[str] = SECTIONS,
    lora_adapters: Sequence[tuple[str, Path]] | None = None,
    lora_transformers: str = "auto",
    v1_engine_values: dict[str, Any] | None = None,
) -> SmokeReport:
    """Build the engine as the backend does and run the checks of `sections` ("engine": streaming,
    cancel, idle, engine process, structured output; "lora": multi-LoRA, `run_lora_checks`; "image":
    image prompts, `run_image_checks`); the
    report says what passed and what was skipped, and why."""
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown smoke section(s) {unknown}: choose from {SECTIONS}")
    from triton_vllm_multistep.engine.cpu_placement import thread_choice_of_user

    report = SmokeReport()
    started = time.perf_counter()
    user_threads = thread_choice_of_user()  # before this process builds an engine: vLLM sets OMP_NUM_THREADS
    if "engine" in sections:
        run_engine_checks(report, engine_args, user_threads)
    if "lora" in sections:
        if "engine" in sections:
            release_engine_memory()  # the engine section's in-process engine, before the LoRA one is built
        lora_started = time.perf_counter()
        run_lora_checks(report, engine_args, lora_adapters, lora_transformers, user_threads)
        report.figures["lora_seconds"] = time.perf_counter() - lora_started
    if "image" in sections:
        if set(sections) - {"image"}:
            release_engine_memory()
        image_started = time.perf_counter()
        run_image_checks(report, engine_args, user_threads)
        report.figures["image_seconds"] = time.perf_counter() - image_started
    if "v1" in sections and v1_engine_values is not None:
        if set(sections) - {"v1"}:
            release_engine_memory()
        v1_started = time.perf_counter()
        run_v1_checks(report, v1_engine_values)
        report.figures["v1_seconds"] = time.perf_counter() - v1_started
    report.figures["total_seconds"] = time.perf_counter() - started
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("model_repository/vllm_model"))
    parser.add_argument("--config", type=Path, help="config file (default: config.pbtxt; configs/cpu.pbtxt with --cpu)")
    parser.add_argument("--model", help="model folder or Hugging Face id instead of model.json's")
    parser.add_argument("--engine-args", default="{}", help="JSON object of engine arguments over the config's")
    parser.add_argument("--cpu", action="store_true", help="run the same checks on the CPU engine (no GPU needed)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--only", choices=SECTIONS, help="run one section's checks (default: all)")
    parser.add_argument(
        "--lora-adapters",
        metavar="NAME=PATH,NAME=PATH",
        help="PEFT LoRA adapters of the model for the LoRA checks (default: two constructed for a Llama-style "
        "local model; other models skip them)",
    )
    parser.add_argument(
        "--lora-transformers",
        choices=("auto", "on", "off"),
        default="auto",
        help="compare LoRA tokens with transformers with the adapter merged, on the host "
        f"(auto: models below {TRANSFORMERS_MAX_PARAMS / 1e9:.0f}B parameters)",
    )
    options = parser.parse_args(argv)
    try:
        lora_adapters = parse_lora_adapters(options.lora_adapters) if options.lora_adapters else None
    except ValueError as error:
        parser.error(str(error))

    from triton_vllm_multistep.stub.device import gpu_count

    if not options.cpu and gpu_count() == 0:
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_USE_V1", "0")
    from vllm.platforms import current_platform

    if options.cpu != current_platform.is_cpu():
        print(
            "--cpu needs vLLM's CPU build"
            if options.cpu
            else f"{NO_GPU_MESSAGE} (vLLM's platform: "
            f"{current_platform.device_name}; install vLLM's CUDA build: scripts/setup.sh --gpu)",
            file=sys.stderr,
        )
        return 2
    config_file = options.config or options.model_dir / ("configs/cpu.pbtxt" if options.cpu else "config.pbtxt")
    engine_overrides = json.loads(options.engine_args)
    engine_args, _ = engine_args_from_config(options.model_dir, config_file, options.model, engine_overrides)
    sections = (options.only,) if options.only else SECTIONS
    v1_values = None
    if "v1" in sections:
        v1_values = v1_engine_values(options.model_dir, config_file, options.model, engine_overrides)
    report = run_smoke(engine_args, sections, lora_adapters, options.lora_transformers, v1_values)
    print("figures:", json.dumps({k: round(v, 3) for k, v in report.figures.items()}))
    if options.json:
        options.json.write_text(
            json.dumps(
                {"engine": report.engine, "checks": [vars(c) for c in report.checks], "figures": report.figures},
                indent=2,
            )
        )
    skipped = (
        f" ({len(report.skipped)} of {len(report.checks)} checks skipped, see SKIP above)" if report.skipped else ""
    )
    if not report.ran:
        print(f"GPU smoke test NOT RUN: every check was skipped{skipped}")
        return 2
    print(f"GPU smoke test {'PASSED' if report.passed else 'FAILED'}{skipped}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
