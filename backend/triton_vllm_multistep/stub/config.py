"""Temporary: what testing/gpu_smoke.py still imports from here (it is being moved into a package of
its own in parallel); model settings are settings/'s, EngineArgs engine/engine_args.py's.

Delete with testing/gpu_smoke.py: its `engine_args_from_config` becomes one read_model_settings call
(settings/model.py) and engine_args_of (engine/engine_args.py). Nothing else may import this.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from triton_vllm_multistep.engine.engine_args import engine_values, to_engine_args
from triton_vllm_multistep.settings.backend import BackendSettings, backend_settings
from triton_vllm_multistep.settings.engine_json import apply_config_engine_args, load_engine_json
from triton_vllm_multistep.settings.engine_json import engine_values as settings_engine_values

__all__ = ["apply_config_engine_args", "backend_settings", "engine_args", "load_engine_json"]


def engine_args(engine_json: dict[str, Any], model_dir: Path, settings: BackendSettings) -> Any:
    """vLLM `EngineArgs` from model.json: unknown fields refused, paths resolved, defaults filled."""
    return to_engine_args(engine_values(settings_engine_values(engine_json, model_dir, settings.stream_mode)))
