"""A model's settings, read in one place for every runtime that serves or checks it.

Owns reading a model folder (model.json, multi_lora.json) and the config Triton loaded
(config.pbtxt parameters) into one typed, frozen ModelSettings (settings/model.py), with every
load error a ConfigError naming the file and field; must not import vLLM or torch, nor the stub,
engine, front end, host tools or test tools (import-linter contracts): engine-argument checks
against vLLM's fields run on the engine's side (engine/engine_args.py).

Modules: parameters.py (ConfigError; one parameter's text read as a boolean, integer, seconds),
backend.py (BackendSettings, Limits: the backend's own parameters), cpus.py (CPU lists),
engine_json.py (model.json and the config's engine_args, defaults, paths), lora.py (enable_lora,
multi_lora.json, each adapter checked), model.py (ModelSettings, read_model_settings).
"""

from __future__ import annotations

from triton_vllm_multistep.settings.backend import BackendSettings, Limits
from triton_vllm_multistep.settings.lora import Adapter
from triton_vllm_multistep.settings.model import ModelSettings, read_model_settings
from triton_vllm_multistep.settings.parameters import ConfigError, config_with_parameters, parameter_values

__all__ = [
    "Adapter",
    "BackendSettings",
    "ConfigError",
    "Limits",
    "ModelSettings",
    "config_with_parameters",
    "parameter_values",
    "read_model_settings",
]
