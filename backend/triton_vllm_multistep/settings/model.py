"""One model's settings, read once: its folder and the config Triton loaded → one typed value.

Owns the order of reading (model.json, the config's `engine_args` over it, `enable_lora` as a
boolean, the backend settings, the engine arguments with defaults and resolved paths, the LoRA
adapters of multi_lora.json) for every reader: the stub, the OpenAI front end, the GPU smoke check
and the benchmarks. Must not import vLLM or torch (a demo:// model built on the way imports torch,
in a function): which fields vLLM's EngineArgs has, and building it, are engine/engine_args.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_vllm_multistep.settings import lora
from triton_vllm_multistep.settings.backend import BackendSettings, backend_settings, instance_count
from triton_vllm_multistep.settings.engine_json import apply_config_engine_args, engine_values, load_engine_json
from triton_vllm_multistep.settings.engine_json import parallel_size as parallel_size_of


@dataclass(frozen=True)
class ModelSettings:
    """What one version of a model runs with."""

    name: str  # the config's `name` ("" for a config without one, as tools read them)
    version: str
    model_dir: Path
    model_config: Mapping[str, Any]  # the config as Triton hands it over (JSON)
    # model.json with the config's `engine_args` (and a tool's overrides) over it, `enable_lora` a boolean.
    engine_json: Mapping[str, Any]
    # The engine's keyword arguments, plain JSON: defaults filled, paths resolved (demo:// built), the
    # stream mode set; engine/engine_args.py checks them against vLLM's fields.
    engine_args: Mapping[str, Any]
    backend: BackendSettings
    adapters: tuple[lora.Adapter, ...] | None  # multi_lora.json's, checked; None: LoRA off
    parallel_size: int  # GPUs one engine spans (tensor × pipeline parallel)

    def instance_count(self, visible_gpus: int) -> int:
        """How many instances of this version Triton runs (instance_group count × GPUs for KIND_GPU)."""
        return instance_count(dict(self.model_config), visible_gpus)


def read_model_settings(
    model_dir: Path,
    version: str | int,
    model_config: Mapping[str, Any],
    overrides: Mapping[str, Any] | None = None,
    before_model_files: Callable[[BackendSettings], None] | None = None,
) -> ModelSettings:
    """The settings of `model_dir`'s `version` under `model_config` (the config Triton loaded, as JSON).

    `overrides`: engine arguments a tool sets over model.json and the config's `engine_args` (the
    GPU smoke check's --model and --engine-args, the benchmarks' step counts). `before_model_files`
    is called with the backend settings before any model file is resolved: a demo:// model built
    then imports torch, and the stub must turn IPEX off before that. Raises ConfigError (a bad
    demo:// name: the demo builder's error), each naming the file and field.
    """
    config = dict(model_config)
    version = str(version)
    merged = apply_config_engine_args(load_engine_json(model_dir, version), config)
    merged = lora.normalize_enable_lora({**merged, **(overrides or {})})
    backend = backend_settings(config, merged)
    if before_model_files is not None:
        before_model_files(backend)
    values = engine_values(merged, model_dir, backend.stream_mode, backend.vllm_engine)
    return ModelSettings(
        name=str(config.get("name", "")),
        version=version,
        model_dir=model_dir,
        model_config=config,
        engine_json=merged,
        engine_args=values,
        backend=backend,
        adapters=lora.model_adapters(model_dir, version, merged, str(values["model"])),
        parallel_size=parallel_size_of(merged),
    )
