"""The backend's own settings from config.pbtxt parameters: streaming, limits, metrics, IPEX, the
engine process and its CPUs, checked against the model.json fields that overlap them.

Owns BackendSettings and every parameter's meaning, default and error message; must not read
files (settings/model.py does) or import vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from triton_vllm_multistep.settings.cpus import CpuListError, allowed_cpus, cpu_list_text, parse_cpu_list
from triton_vllm_multistep.settings.parameters import (
    ConfigError,
    as_bool,
    as_int,
    as_seconds,
    parameter_values,
    true_false_or_auto,
)

logger = logging.getLogger("triton_vllm_multistep")
# Metrics switches in config.pbtxt: ours and Triton's vLLM backend's name for the same thing.
METRICS_PARAMETER = "enable_metrics"
THEIR_METRICS_PARAMETER = "REPORT_CUSTOM_METRICS"
# Metrics are on unless switched off: their cost is a few batched calls per finished request
# (Triton's vLLM backend defaults to off because its metrics run vLLM's stat logging per step).
METRICS_DEFAULT = True
THEIR_HEALTH_CHECK_PARAMETER = "ENABLE_VLLM_HEALTH_CHECK"


@dataclass(frozen=True)
class Limits:
    """Per-request limits that protect the server (0 = only the engine's own limit)."""

    max_prompt_tokens: int = 0
    max_tokens: int = 0
    max_n: int = 16
    max_request_bytes: int = 1 << 20  # input tensors other than `image`
    max_image_bytes: int = 10 << 20  # each `image` element, base64 as sent
    max_image_pixels: int = 4096 * 4096  # each image, width x height


# config.pbtxt `stream_mode`: "step" (one response per decoded step: the engine hands out every
# step), "window" (one per scheduling window: the engine hands out once per window) and "merge"
# (the engine hands out every step; the response thread sends several of a stream's steps as one
# response once sending them one by one would cost the engine, see stub/stream_merge.py).
# `stream_interval` k sends every k-th engine output in any mode.
ResponseMode = Literal["step", "window", "merge"]
RESPONSE_MODES: tuple[ResponseMode, ...] = ("step", "window", "merge")
MAX_STREAM_INTERVAL = 1024
# config.pbtxt `vllm_engine`: which vLLM engine serves the model. "multistep": vLLM 0.8.5's V0 engine
# with multi-step scheduling, in the server's own environment (the default); "v1": vLLM's current
# engine, in an environment of its own (its engine process and tokenizer under another Python).
EngineKind = Literal["multistep", "v1"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("multistep", "v1")
ENGINE_PARAMETER = "vllm_engine"
# model.json fields that exist only for multi-step scheduling: on V1 a load error naming both.
MULTI_STEP_ONLY_ENGINE_ARGS = ("num_scheduler_steps", "multi_step_stream_outputs")
# config.pbtxt switches a V1 model cannot honour: the value refused, and why.
V1_REFUSED_SWITCHES: dict[str, tuple[bool, str]] = {
    "engine_process": (False, "a V1 engine always runs in a process of its own, under its environment's Python"),
    "use_ipex": (True, "the V1 environment has no Intel Extension for PyTorch"),
}

# How a multi-step engine hands out tokens: after every decoded step, or once per scheduling
# window. The name and values of the `stream_mode` config.pbtxt parameter (vLLM's own name for
# it is `multi_step_stream_outputs`, True for "step"); the engine takes it from here.
StreamMode = Literal["step", "window"]
STREAM_MODES: tuple[StreamMode, ...] = ("step", "window")


def engine_stream_mode(mode: ResponseMode) -> StreamMode:
    """What the engine is built with for a response mode: merging needs every step's output."""
    return "window" if mode == "window" else "step"


@dataclass(frozen=True)
class BackendSettings:
    """Everything the backend needs besides the engine arguments."""

    # config.pbtxt `vllm_engine`
    vllm_engine: EngineKind = "multistep"
    # config.pbtxt `stream_mode`; model.json's `multi_step_stream_outputs` (vLLM's name) is an alias.
    stream_mode: ResponseMode = "step"
    # config.pbtxt `stream_interval`: engine outputs per streamed response (a request may set its own).
    stream_interval: int = 1
    cpu_kvcache_space_gib: int = 1
    enable_metrics: bool = True
    limits: Limits = dataclasses.field(default_factory=Limits)
    # On engine failure, ask Triton to unload the model (works in explicit model-control mode).
    unload_on_engine_failure: bool = True
    # How long requests in flight may finish once Triton unloads the model or stops; None: derived
    # from the server's --exit-timeout-secs (see lifecycle/drain.py).
    unload_drain_seconds: float | None = None
    # config.pbtxt `use_ipex` resolved (true / false / auto: see use_ipex_setting): false runs vLLM's
    # CPU attention without Intel Extension for PyTorch even where it is installed.
    use_ipex: bool = False
    # config.pbtxt `engine_process` (true / false / auto, the default): the engine runs in a process
    # of its own (engine/process.py), away from the stub's GIL that builds and sends the responses.
    # `auto` is true where a Python to run it is found, else the engine runs in the stub (logged);
    # an explicit true without one is a load error (engine_process_required).
    engine_process: bool = True
    engine_process_required: bool = False
    # config.pbtxt `engine_cpus` (a CPU list; empty: unset): the engine process's CPUs, and the
    # stub's threads kept off them (engine/cpu_placement.py). Needs the engine process.
    engine_cpus: tuple[int, ...] = ()


def vllm_engine_setting(params: dict[str, str], engine_json: dict[str, Any]) -> EngineKind:
    """config.pbtxt `vllm_engine`, checked against the multi-step-only settings it contradicts."""
    text = params.get(ENGINE_PARAMETER, "").strip().lower() or "multistep"
    if text not in ENGINE_KINDS:
        raise ConfigError(
            f"config.pbtxt parameter {ENGINE_PARAMETER!r} must be one of {', '.join(ENGINE_KINDS)}, got {text!r}"
        )
    if text == "v1":
        if "task" in engine_json:
            raise ConfigError(
                f"config.pbtxt parameter {ENGINE_PARAMETER!r}='v1' and model.json 'task'="
                f"{json.dumps(engine_json['task'])} disagree: 'task' is vLLM 0.8.5's engine argument, which "
                "vLLM's V1 engine no longer has (it finds an embedding model by itself; 'runner': 'pooling' "
                f"forces it); remove 'task' or serve the model with {ENGINE_PARAMETER} 'multistep'"
            )
        for name in MULTI_STEP_ONLY_ENGINE_ARGS:
            if name in engine_json:
                raise ConfigError(
                    f"config.pbtxt parameter {ENGINE_PARAMETER!r}='v1' and model.json {name!r}="
                    f"{json.dumps(engine_json[name])} disagree: vLLM's V1 engine has no multi-step scheduling; "
                    f"remove {name!r} or serve the model with {ENGINE_PARAMETER} 'multistep'"
                )
        if params.get("stream_mode", "").strip().lower() == "window":
            raise ConfigError(
                f"config.pbtxt parameters {ENGINE_PARAMETER!r}='v1' and 'stream_mode'='window' disagree: a "
                "scheduling window is multi-step's; V1 streams every step ('step') or merges them ('merge')"
            )
        for name, (refused, why) in V1_REFUSED_SWITCHES.items():
            value = params.get(name, "").strip()
            if value and true_false_or_auto(name, value) is refused:
                raise ConfigError(
                    f"config.pbtxt parameters {ENGINE_PARAMETER!r}='v1' and {name!r}={value!r} disagree: {why}"
                )
    return text  # type: ignore[return-value]  # checked against ENGINE_KINDS above


def stream_mode_setting(params: dict[str, str], engine_json: dict[str, Any]) -> ResponseMode:
    """config.pbtxt `stream_mode` and model.json `multi_step_stream_outputs` (its alias): either, or both agreeing."""
    from_json = engine_json.get("multi_step_stream_outputs")
    if from_json is not None and not isinstance(from_json, bool):
        raise ConfigError(f"model.json: 'multi_step_stream_outputs' must be true or false, got {from_json!r}")
    if "stream_mode" not in params:
        return "window" if from_json is False else "step"
    mode = params["stream_mode"].strip().lower()
    if mode not in RESPONSE_MODES:
        raise ConfigError(
            f"config.pbtxt parameter 'stream_mode' must be one of {', '.join(RESPONSE_MODES)}, got {mode!r}"
        )
    per_step = engine_stream_mode(mode) == "step"  # type: ignore[arg-type]  # checked above
    if from_json is not None and from_json != per_step:
        raise ConfigError(
            f"config.pbtxt parameter 'stream_mode'={mode!r} and model.json 'multi_step_stream_outputs'="
            f"{str(from_json).lower()} disagree: set one of them, or both to the same choice "
            "('step' or 'merge' = true, 'window' = false)"
        )
    return mode  # type: ignore[return-value]  # checked against RESPONSE_MODES above


def stream_interval_setting(params: dict[str, str]) -> int:
    """config.pbtxt `stream_interval`: engine outputs (steps; windows in "window" mode) per response."""
    return as_int("stream_interval", params.get("stream_interval", "1"), minimum=1, maximum=MAX_STREAM_INTERVAL)


def metrics_setting(params: dict[str, str], engine_json: dict[str, Any]) -> bool:
    """Whether metrics are reported: `enable_metrics` or `REPORT_CUSTOM_METRICS`, and model.json's `disable_log_stats`.

    The two switches are the same setting under two names: both given and different is an error.
    As in Triton's vLLM backend, `disable_log_stats: true` in model.json turns metrics off (a
    warning says so when a switch asked for them).
    """
    given = {
        name: as_bool(name, params[name]) for name in (METRICS_PARAMETER, THEIR_METRICS_PARAMETER) if name in params
    }
    if len(set(given.values())) > 1:
        raise ConfigError(
            f"config.pbtxt parameters {METRICS_PARAMETER!r}={params[METRICS_PARAMETER]!r} and "
            f"{THEIR_METRICS_PARAMETER!r}={params[THEIR_METRICS_PARAMETER]!r} disagree: they are the same switch, "
            "set one of them"
        )
    enabled = next(iter(given.values())) if given else METRICS_DEFAULT
    disable_log_stats = engine_json.get("disable_log_stats")
    if disable_log_stats is not None and not isinstance(disable_log_stats, bool):
        raise ConfigError(f"model.json: 'disable_log_stats' must be true or false, got {disable_log_stats!r}")
    if enabled and disable_log_stats:
        if given:
            logger.warning(
                "vllm_multistep: metrics are off: model.json 'disable_log_stats': true wins over config.pbtxt "
                "parameter %s=true (as in Triton's vLLM backend); remove one of them",
                " / ".join(given),
            )
        return False
    return enabled


def use_ipex_setting(model_config: dict[str, Any], engine_json: dict[str, Any]) -> bool:
    """config.pbtxt `use_ipex`: true, false, or auto (the default): IPEX only for a model with
    prefix caching on, which needs it on CPU; without it, IPEX's decode kernels did not pay in the
    served benchmark (docs/prefix-caching.md). Read before vLLM is imported (stub/instance.py)."""
    chosen = true_false_or_auto("use_ipex", parameter_values(model_config).get("use_ipex", "auto"))
    return bool(engine_json.get("enable_prefix_caching")) if chosen is None else chosen


def backend_settings(model_config: dict[str, Any], engine_json: dict[str, Any]) -> BackendSettings:
    """Backend settings from config.pbtxt parameters, checked against the model.json fields that overlap them."""
    params = parameter_values(model_config)
    vllm_engine = vllm_engine_setting(params, engine_json)
    stream_mode = stream_mode_setting(params, engine_json)
    if THEIR_HEALTH_CHECK_PARAMETER in params:
        as_bool(THEIR_HEALTH_CHECK_PARAMETER, params[THEIR_HEALTH_CHECK_PARAMETER])
        logger.info(
            "vllm_multistep: config.pbtxt parameter %s is accepted and has no effect: the engine is always "
            "watched (see unload_on_engine_failure)",
            THEIR_HEALTH_CHECK_PARAMETER,
        )
    defaults = Limits()
    limits = Limits(
        max_prompt_tokens=as_int("max_prompt_tokens", params.get("max_prompt_tokens", "0")),
        max_tokens=as_int("max_tokens_limit", params.get("max_tokens_limit", "0")),
        max_n=as_int("max_n", params.get("max_n", str(defaults.max_n)), minimum=1),
        max_request_bytes=as_int(
            "max_request_bytes", params.get("max_request_bytes", str(defaults.max_request_bytes)), 1
        ),
        max_image_bytes=as_int("max_image_bytes", params.get("max_image_bytes", str(defaults.max_image_bytes)), 1),
        max_image_pixels=as_int("max_image_pixels", params.get("max_image_pixels", str(defaults.max_image_pixels)), 1),
    )
    text = params.get("engine_process", "")
    engine_process = true_false_or_auto("engine_process", text if text.strip() else "auto")  # empty: auto
    engine_cpus = engine_cpus_setting(params)
    if engine_cpus and engine_process is False:
        raise ConfigError(
            f"config.pbtxt parameter 'engine_cpus' ({params['engine_cpus']!r}) places the engine process, but "
            "'engine_process' is false: set engine_process to true or auto, or leave engine_cpus out"
        )
    return BackendSettings(
        vllm_engine=vllm_engine,
        stream_mode=stream_mode,
        stream_interval=stream_interval_setting(params),
        cpu_kvcache_space_gib=as_int("cpu_kvcache_space_gib", params.get("cpu_kvcache_space_gib", "1"), minimum=1),
        enable_metrics=metrics_setting(params, engine_json),
        limits=limits,
        unload_on_engine_failure=as_bool("unload_on_engine_failure", params.get("unload_on_engine_failure", "true")),
        use_ipex=vllm_engine == "multistep" and use_ipex_setting(model_config, engine_json),
        engine_process=engine_process is not False,
        engine_process_required=engine_process is True or bool(engine_cpus),
        engine_cpus=engine_cpus,
        unload_drain_seconds=(
            as_seconds("unload_drain_seconds", params["unload_drain_seconds"])
            if params.get("unload_drain_seconds", "").strip()
            else None
        ),
    )


def engine_cpus_setting(params: dict[str, str], allowed: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """config.pbtxt `engine_cpus`: a Linux CPU list, `last N` (the last N of the CPUs this server
    runs on, `allowed`, by default its affinity: for containers whose CPU numbers are not known in
    advance, such as Kubernetes pods with exclusive CPUs), or empty / absent for no placement."""
    text = params.get("engine_cpus", "")
    if not text.strip():
        return ()
    words = text.split()
    if words[0].lower() == "last":
        available = allowed_cpus() if allowed is None else allowed
        count = as_int("engine_cpus", words[1], minimum=1) if len(words) == 2 else 0
        if not count:
            raise ConfigError(f"config.pbtxt parameter 'engine_cpus' must be a CPU list or 'last N', got {text!r}")
        if count > len(available):
            raise ConfigError(
                f"config.pbtxt parameter 'engine_cpus' asks for the last {count} CPUs, but this server runs on "
                f"{len(available)} ({cpu_list_text(available)})"
            )
        return tuple(sorted(available))[-count:]
    try:
        return parse_cpu_list(text)
    except CpuListError as error:
        raise ConfigError(f"config.pbtxt parameter 'engine_cpus': {error}, or 'last N'") from None


def instance_count(model_config: dict[str, Any], visible_gpus: int) -> int:
    """How many instances of this model version Triton runs (instance_group count × GPUs for KIND_GPU)."""
    total = 0
    for group in model_config.get("instance_group") or [{}]:
        count = int(group.get("count", 1) or 1)
        if group.get("kind", "KIND_GPU" if visible_gpus else "KIND_CPU") == "KIND_GPU":
            count *= len(group.get("gpus") or []) or max(1, visible_gpus)
        total += count
    return max(1, total)
