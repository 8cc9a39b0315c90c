"""Model configuration: `config.pbtxt` parameters and `<model>/<version>/model.json` engine args.

Owns turning them into validated `BackendSettings` and vLLM `EngineArgs`, with errors that
name the field; must not build the engine or touch Triton objects.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine.events import STREAM_MODES, StreamMode

logger = logging.getLogger("triton_vllm_multistep")
MODEL_JSON = "model.json"
# Engine arguments that name files or folders: resolved against the model folder when relative.
PATH_ARGS = ("model", "tokenizer", "download_dir")
# Defaults of the shipped backend where vLLM's own differ (multi-step is the point of it).
ENGINE_DEFAULTS: dict[str, Any] = {"num_scheduler_steps": 8, "disable_log_stats": True}


class ConfigError(ValueError):
    """The model configuration is invalid; the message names the file and field."""


@dataclass(frozen=True)
class Limits:
    """Per-request limits that protect the server (0 = only the engine's own limit)."""

    max_prompt_tokens: int = 0
    max_tokens: int = 0
    max_n: int = 16
    max_request_bytes: int = 1 << 20


@dataclass(frozen=True)
class BackendSettings:
    """Everything the backend needs besides the engine arguments."""

    # config.pbtxt `stream_mode`; model.json's `multi_step_stream_outputs` (vLLM's name) is an alias.
    stream_mode: StreamMode = "step"
    cpu_kvcache_space_gib: int = 1
    enable_metrics: bool = True
    limits: Limits = dataclasses.field(default_factory=Limits)
    # On engine failure, ask Triton to unload the model (works in explicit model-control mode).
    unload_on_engine_failure: bool = True
    # How long requests in flight may finish once Triton unloads the model or stops; None: derived
    # from the server's --exit-timeout-secs (see lifecycle/drain.py).
    unload_drain_seconds: float | None = None


def parameter_values(model_config: dict[str, Any]) -> dict[str, str]:
    """config.pbtxt `parameters { key: ... value { string_value: ... } }` as a plain dict."""
    return {key: value.get("string_value", "") for key, value in (model_config.get("parameters") or {}).items()}


def _as_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"config.pbtxt parameter {name!r} must be true or false, got {text!r}")


def _as_int(name: str, text: str, minimum: int = 0) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ConfigError(f"config.pbtxt parameter {name!r} must be an integer, got {text!r}") from None
    if value < minimum:
        raise ConfigError(f"config.pbtxt parameter {name!r} must be >= {minimum}, got {value}")
    return value


def _as_seconds(name: str, text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ConfigError(f"config.pbtxt parameter {name!r} must be a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"config.pbtxt parameter {name!r} must be a finite number >= 0, got {text!r}")
    return value


def backend_settings(model_config: dict[str, Any], engine_json: dict[str, Any]) -> BackendSettings:
    """Backend settings from config.pbtxt parameters; `stream_mode` may also follow model.json."""
    params = parameter_values(model_config)
    stream_mode: StreamMode = "step" if engine_json.get("multi_step_stream_outputs", True) else "window"
    if "stream_mode" in params:
        mode = params["stream_mode"].strip().lower()
        if mode not in STREAM_MODES:
            raise ConfigError(f"config.pbtxt parameter 'stream_mode' must be 'step' or 'window', got {mode!r}")
        stream_mode = mode
    defaults = Limits()
    limits = Limits(
        max_prompt_tokens=_as_int("max_prompt_tokens", params.get("max_prompt_tokens", "0")),
        max_tokens=_as_int("max_tokens_limit", params.get("max_tokens_limit", "0")),
        max_n=_as_int("max_n", params.get("max_n", str(defaults.max_n)), minimum=1),
        max_request_bytes=_as_int(
            "max_request_bytes", params.get("max_request_bytes", str(defaults.max_request_bytes)), 1
        ),
    )
    return BackendSettings(
        stream_mode=stream_mode,
        cpu_kvcache_space_gib=_as_int("cpu_kvcache_space_gib", params.get("cpu_kvcache_space_gib", "1"), minimum=1),
        enable_metrics=_as_bool("enable_metrics", params.get("enable_metrics", "true")),
        limits=limits,
        unload_on_engine_failure=_as_bool("unload_on_engine_failure", params.get("unload_on_engine_failure", "true")),
        unload_drain_seconds=(
            _as_seconds("unload_drain_seconds", params["unload_drain_seconds"])
            if params.get("unload_drain_seconds", "").strip()
            else None
        ),
    )


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


ENGINE_ARGS_PARAMETER = "engine_args"


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


def engine_args(engine_json: dict[str, Any], model_dir: Path, settings: BackendSettings):
    """vLLM `EngineArgs` from model.json: unknown fields refused, paths resolved, defaults filled."""
    from vllm.engine.arg_utils import EngineArgs

    known = {field.name for field in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(engine_json) - known)
    if unknown:
        raise ConfigError(f"model.json: unknown vLLM engine argument(s): {', '.join(unknown)}")
    values = {**ENGINE_DEFAULTS, **engine_json}
    for name in PATH_ARGS:
        value = values.get(name)
        if isinstance(value, str) and value:
            values[name] = resolve_path(value, model_dir)
    values["multi_step_stream_outputs"] = settings.stream_mode == "step"
    steps = values["num_scheduler_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"model.json: 'num_scheduler_steps' must be an integer >= 1, got {steps!r}")
    try:
        return EngineArgs(**values)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"model.json: {error}") from None


def resolve_path(value: str, model_dir: Path) -> str:
    """demo://NAME → the built demo model; a relative path that exists → under the model folder."""
    if value.startswith(demo_models.DEMO_SCHEME):
        return demo_models.resolve(value)
    candidate = model_dir / value
    if not Path(value).is_absolute() and candidate.exists():
        return str(candidate.resolve())
    return value  # absolute path or a Hugging Face id (offline hosts need a local folder)
