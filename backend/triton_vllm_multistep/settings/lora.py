"""Triton's vLLM backend's multi-LoRA settings: `enable_lora` in model.json, `multi_lora.json` in the
version folder; each adapter checked when the model loads.

Owns reading multi_lora.json, resolving adapter folders, the load-time checks that need no engine
(files, PEFT config, rank against max_lora_rank, tensor shapes against the base checkpoint: an
adapter of another model) and the adapter ids; must not touch the engine (it loads every adapter
once before the model is ready and vLLM checks the target modules then: engine/loop.preload_adapters)
nor import vLLM or torch. The per-request `lora_name` (interface.py) is looked up by the codec
(stub/codec.py).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.settings.parameters import ConfigError

logger = logging.getLogger(__name__)

MULTI_LORA_JSON = "multi_lora.json"
ENABLE_LORA = "enable_lora"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
DEFAULT_MAX_LORA_RANK = 16  # vLLM 0.8.5's EngineArgs.max_lora_rank


@dataclass(frozen=True)
class Adapter:
    """One adapter of multi_lora.json. `lora_int_id` is its position + 1 in the file, as Triton's vLLM
    backend numbers them; vLLM caches and schedules adapters by it."""

    name: str
    lora_int_id: int
    path: str

    def engine_value(self) -> tuple[str, int, str]:
        """The adapter as it crosses to the engine (EngineRequest.adapter, EngineSpec.lora_adapters)."""
        return (self.name, self.lora_int_id, self.path)


def lora_enabled(engine_json: Mapping[str, Any]) -> bool:
    """`enable_lora` as their backend reads it: true or "true" (any case); anything else is off."""
    return str(engine_json.get(ENABLE_LORA, False)).strip().lower() == "true"


def normalize_enable_lora(engine_json: dict[str, Any]) -> dict[str, Any]:
    """model.json with `enable_lora` a real boolean (their backend passes "false" on to vLLM, where
    a non-empty string is true: LoRA would be built while requests are refused)."""
    if ENABLE_LORA in engine_json:
        return {**engine_json, ENABLE_LORA: lora_enabled(engine_json)}
    return engine_json


def _resolve_adapter_folder(name: str, value: Any, version_dir: Path) -> Path:
    """An absolute folder; a relative one under the version folder, else under the server's working
    directory (where vLLM, and so their backend, resolves it); `demo://NAME/ADAPTER`: an adapter of a
    locally built demo set (as model.json's `demo://NAME`)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{version_dir / MULTI_LORA_JSON}: adapter {name!r} must map to a folder path, got {value!r}")
    if value.startswith(demo_models.DEMO_SCHEME):
        demo_set, _, adapter = value.removeprefix(demo_models.DEMO_SCHEME).partition("/")
        try:
            value = str(Path(demo_models.build(demo_set)) / adapter)
        except Exception as error:  # an unknown name, or a set that cannot be built here
            raise ConfigError(f"{MULTI_LORA_JSON}: adapter {name!r}: {value} cannot be built: {error}") from None
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else [version_dir / path, Path.cwd() / path]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate.resolve()
    where = " or ".join(str(c) for c in candidates)
    raise ConfigError(
        f"{MULTI_LORA_JSON}: adapter {name!r}: no folder at {where} (adapters are local PEFT folders; "
        "nothing is downloaded)"
    )


def _adapter_config(name: str, folder: Path) -> dict[str, Any]:
    path = folder / ADAPTER_CONFIG
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{MULTI_LORA_JSON}: adapter {name!r}: {path} is missing (not a PEFT adapter)") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"{MULTI_LORA_JSON}: adapter {name!r}: {path} cannot be read: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{MULTI_LORA_JSON}: adapter {name!r}: {path} must hold a JSON object")
    peft_type = data.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ConfigError(f"{MULTI_LORA_JSON}: adapter {name!r}: peft_type {peft_type!r} is not a LoRA adapter")
    if not any((folder / weights).is_file() for weights in ADAPTER_WEIGHTS):
        raise ConfigError(f"{MULTI_LORA_JSON}: adapter {name!r}: {folder} has no {' or '.join(ADAPTER_WEIGHTS)}")
    return data


def _check_rank(name: str, adapter_config: dict[str, Any], engine_json: Mapping[str, Any]) -> None:
    rank = adapter_config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"{MULTI_LORA_JSON}: adapter {name!r}: adapter_config.json 'r' must be a positive integer")
    maximum = engine_json.get("max_lora_rank", DEFAULT_MAX_LORA_RANK)
    if isinstance(maximum, int) and rank > maximum:
        raise ConfigError(
            f"{MULTI_LORA_JSON}: adapter {name!r} has rank {rank} (adapter_config.json 'r'), above model.json "
            f"'max_lora_rank' {maximum}: raise max_lora_rank to at least {rank} (vLLM allows 8, 16, 32, 64, 128, "
            "256, 320, 512)"
        )


def _safetensors_shapes(files: Sequence[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape, read from the files' headers only."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def _check_shapes(name: str, folder: Path, model_dir: Path | None) -> None:
    """Each LoRA pair must fit the base weight it adapts: A is (r, in), B is (out, r)."""
    weights = folder / ADAPTER_WEIGHTS[0]
    if model_dir is None or not weights.is_file():
        return  # no local checkpoint (or .bin weights): vLLM's own checks at start still run
    base_files = sorted(model_dir.glob("*.safetensors"))
    if not base_files:
        return
    base = _safetensors_shapes(base_files)
    for key, shape in _safetensors_shapes([weights]).items():
        part = "lora_A" if key.endswith(".lora_A.weight") else "lora_B" if key.endswith(".lora_B.weight") else None
        if part is None:
            continue
        module = key.removesuffix(f".{part}.weight").removeprefix("base_model.model.")
        target = base.get(f"{module}.weight")
        if target is None:
            raise ConfigError(
                f"{MULTI_LORA_JSON}: adapter {name!r} adapts {module}, which the model {model_dir} does not have "
                "(an adapter of another model)"
            )
        if len(target) != 2:
            raise ConfigError(
                f"{MULTI_LORA_JSON}: adapter {name!r} adapts {module}, which is not a linear layer of the model "
                f"{model_dir} (its weight is {target})"
            )
        # A is (r, in) and B is (out, r) against the base weight's (out, in).
        fits = len(shape) == 2 and (shape[1] == target[1] if part == "lora_A" else shape[0] == target[0])
        if not fits:
            layout = "(r, in)" if part == "lora_A" else "(out, r)"
            raise ConfigError(
                f"{MULTI_LORA_JSON}: adapter {name!r} does not fit the model {model_dir}: {module} is {target} "
                f"(out, in) there, its {part} is {shape} {layout} (an adapter of another model)"
            )


def load_adapters(version_dir: Path, engine_json: Mapping[str, Any], model_dir: Path | None) -> tuple[Adapter, ...]:
    """The adapters of `version_dir`/multi_lora.json, each checked; a ConfigError names the first bad one.

    `model_dir` is the base model's local folder (None for a hub id): adapters are checked against its
    checkpoint. Call only with LoRA on.
    """
    path = version_dir / MULTI_LORA_JSON
    if not path.is_file():
        # Their backend's message, and what to do.
        raise ConfigError(
            f"Triton backend cannot find {path}. With 'enable_lora' true in model.json, {MULTI_LORA_JSON} beside "
            'it maps adapter names to PEFT adapter folders: {"name": "/path/to/adapter"}'
        )
    try:
        entries = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(entries, dict):
        raise ConfigError(f"{path} must hold a JSON object mapping adapter names to folders")
    adapters = []
    for index, (name, value) in enumerate(entries.items()):
        folder = _resolve_adapter_folder(name, value, version_dir)
        adapter_config = _adapter_config(name, folder)
        _check_rank(name, adapter_config, engine_json)
        _check_shapes(name, folder, model_dir)
        adapters.append(Adapter(name, index + 1, str(folder)))
    if not adapters:
        logger.warning("%s names no adapter: every request with lora_name will be refused", path)
    return tuple(adapters)


def model_adapters(
    model_dir: Path, version: str, engine_json: Mapping[str, Any], model: str
) -> tuple[Adapter, ...] | None:
    """The checked adapters of a model version's multi_lora.json, beside model.json (the version
    folder, as in Triton's vLLM backend); None with LoRA off. `model`: the engine's resolved `model`."""
    if not lora_enabled(engine_json):
        return None
    version_dir = model_dir / version if (model_dir / version).is_dir() else model_dir
    return load_adapters(version_dir, engine_json, local_model_dir(model))


def local_model_dir(model: str) -> Path | None:
    """The base model's folder when it is local (the engine's resolved `model` argument)."""
    path = Path(os.path.expanduser(model))
    return path if path.is_dir() else None
