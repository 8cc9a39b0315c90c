"""A model's vLLM engine arguments as JSON: `<model>/<version>/model.json`, the loaded config's
`engine_args` parameter over it, the backend's defaults filled in and paths resolved.

Owns reading, merging and the checks that need no vLLM (the scheduler steps, the parallel size
read early); must not import vLLM: which fields vLLM's EngineArgs has, and building it, are the
engine's (engine/engine_args.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.interface import EMBED_TASK, SERVED_TASKS
from triton_vllm_multistep.settings.backend import EngineKind, ResponseMode, engine_stream_mode
from triton_vllm_multistep.settings.parameters import ConfigError, parameter_values

logger = logging.getLogger("triton_vllm_multistep")
MODEL_JSON = "model.json"
# Engine arguments that name files or folders: resolved against the model folder when relative.
PATH_ARGS = ("model", "tokenizer", "download_dir")
# Defaults of the shipped backend where vLLM's own differ (multi-step is the point of it).
# `disable_log_stats` here only keeps vLLM's own stat loggers off (their log lines and in-process
# registry cost a pass over the batch per step); this backend's metrics do not come from them.
ENGINE_DEFAULTS: dict[str, Any] = {"num_scheduler_steps": 8, "disable_log_stats": True}
# Fields of vLLM 0.8.5's AsyncEngineArgs that EngineArgs lacks (Triton's vLLM backend builds an
# AsyncLLMEngine from model.json): accepted so its model.json loads, ignored here, and why.
ASYNC_ONLY_ENGINE_ARGS: dict[str, str] = {
    "disable_log_requests": "this backend drives LLMEngine, which logs no requests",
}
ENGINE_ARGS_PARAMETER = "engine_args"
# model.json `task` (vLLM 0.8.5's engine argument) values the multi-step engine serves: a generative
# model, or an embedding model ("embed": one pooling pass per request, so no num_scheduler_steps).
TASK_FIELD = "task"
SERVED_TASK_VALUES = ("auto", *SERVED_TASKS)


def load_engine_json(model_dir: Path, version: str | int) -> dict[str, Any]:
    """Read `<model_dir>/<version>/model.json` (or `<model_dir>/model.json`) as a JSON object."""
    candidates = [model_dir / str(version) / MODEL_JSON, model_dir / MODEL_JSON]
    path = next((p for p in candidates if p.exists()), None)
    if path is None:
        raise ConfigError(f"{candidates[0]} is missing: it holds the vLLM engine arguments")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object of vLLM engine arguments")
    if "model" not in data:
        raise ConfigError(f"{path} must name the model ('model': a folder or demo://NAME)")
    return data


def apply_config_engine_args(engine_json: dict[str, Any], model_config: dict[str, Any]) -> dict[str, Any]:
    """model.json's fields, overridden by the `engine_args` parameter of the config Triton loaded.

    One model folder serves several configs (config.pbtxt for GPUs, configs/cpu.pbtxt without
    one), and some engine settings must differ between them (dtype: vLLM's multi-step runner on
    CUDA needs FlashAttention, hence fp16/bf16). The parameter holds a JSON object of engine
    arguments; each field it sets wins over model.json's for that config, and is logged.
    """
    text = parameter_values(model_config).get(ENGINE_ARGS_PARAMETER, "").strip()
    if not text:
        return engine_json
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"config.pbtxt parameter {ENGINE_ARGS_PARAMETER!r} is not valid JSON: {error}") from None
    if not isinstance(overrides, dict):
        raise ConfigError(f"config.pbtxt parameter {ENGINE_ARGS_PARAMETER!r} must hold a JSON object of engine args")
    for name, value in overrides.items():
        if name in engine_json and engine_json[name] != value:
            logger.info(
                "config.pbtxt %s sets %s=%r for this config (model.json: %r)",
                ENGINE_ARGS_PARAMETER,
                name,
                value,
                engine_json[name],
            )
    return {**engine_json, **overrides}


def parallel_size(engine_json: dict[str, Any]) -> int:
    """GPUs one engine spans (tensor × pipeline parallel), from model.json before EngineArgs checks it:
    the instance's device environment is set before the engine process starts. A value that is not
    a positive integer counts as 1 here; EngineArgs then refuses it in vLLM's words."""

    def size(name: str) -> int:
        value = engine_json.get(name, 1)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    return size("tensor_parallel_size") * size("pipeline_parallel_size")


def engine_values(
    engine_json: dict[str, Any], model_dir: Path, stream_mode: ResponseMode, vllm_engine: EngineKind = "multistep"
) -> dict[str, Any]:
    """The engine's keyword arguments as plain JSON values: the backend's defaults under model.json's
    fields, paths resolved, the engine's stream mode set (multi-step). Which fields vLLM takes is
    checked on the engine's side (engine/engine_args.py engine_fields)."""
    # A V1 model gets none of these: multi-step's fields are a load error there (settings/backend.py),
    # and its engine process decides disable_log_stats (engine_v1/process.py). An embedding model gets
    # no num_scheduler_steps (it has no decode steps).
    defaults = {} if vllm_engine == "v1" else ENGINE_DEFAULTS
    if vllm_engine != "v1" and embedding_task(engine_json):
        defaults = {name: value for name, value in defaults.items() if name != "num_scheduler_steps"}
    values = {**defaults, **engine_json}
    for name in PATH_ARGS:
        value = values.get(name)
        if isinstance(value, str) and value:
            values[name] = resolve_path(value, model_dir)
    if vllm_engine == "v1":
        return values
    if embedding_task(engine_json):
        return values
    values["multi_step_stream_outputs"] = engine_stream_mode(stream_mode) == "step"
    steps = values["num_scheduler_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"model.json: 'num_scheduler_steps' must be an integer >= 1, got {steps!r}")
    return values


def embedding_task(engine_json: dict[str, Any]) -> bool:
    """Whether model.json names an embedding model (`task` "embed"); a `task` the multi-step engine does
    not serve, or num_scheduler_steps beside "embed", is a load error naming both."""
    task = engine_json.get(TASK_FIELD, "auto")
    if task not in SERVED_TASK_VALUES:
        raise ConfigError(
            f"model.json {TASK_FIELD!r} must be one of {', '.join(SERVED_TASK_VALUES)} (the tasks this backend "
            f"serves), got {task!r}"
        )
    if task != EMBED_TASK:
        return False
    for name in ("num_scheduler_steps", "multi_step_stream_outputs"):
        if name in engine_json:
            raise ConfigError(
                f"model.json {TASK_FIELD!r}={json.dumps(task)} and {name!r}={json.dumps(engine_json[name])} "
                f"disagree: an embedding model has no decode steps to schedule; remove {name!r}"
            )
    return True


def resolve_path(value: str, model_dir: Path) -> str:
    """demo://NAME → the built demo model; a relative path that exists → under the model folder."""
    if value.startswith(demo_models.DEMO_SCHEME):
        return demo_models.resolve(value)
    candidate = model_dir / value
    if not Path(value).is_absolute() and candidate.exists():
        return str(candidate.resolve())
    return value  # absolute path or a Hugging Face id (offline hosts need a local folder)
