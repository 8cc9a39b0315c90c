"""A model's settings read in one place (settings/model.py): a model folder (model.json,
multi_lora.json) and the config Triton loaded → one ModelSettings, as the stub, the OpenAI front
end, the GPU smoke check and the benchmarks read it; no vLLM or torch on the way.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from triton_vllm_multistep.checks.adapters import write_adapter
from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine.engine_args import engine_args_of
from triton_vllm_multistep.settings import (
    BackendSettings,
    ConfigError,
    config_with_parameters,
    engine_json,
    read_model_settings,
)


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    return demo_models.build("tiny-llama-bpe")


def _model_folder(root: Path, model_json: dict, adapters: dict[str, str] | None = None) -> Path:
    version = root / "llm" / "1"
    version.mkdir(parents=True)
    (version / "model.json").write_text(json.dumps(model_json))
    if adapters is not None:
        (version / "multi_lora.json").write_text(json.dumps(adapters))
    return root / "llm"


def _config(**parameters: str) -> dict:
    return {"name": "llm", "instance_group": [{"kind": "KIND_CPU", "count": 2}], **config_with_parameters(parameters)}


def test_a_model_folder_and_its_config_give_one_value(tmp_path: Path, demo_dir: Path) -> None:
    folder = _model_folder(
        tmp_path,
        {"model": "demo://tiny-llama-bpe", "enable_lora": "true", "max_model_len": 512, "tensor_parallel_size": 2},
        {"doll": "adapters/doll"},
    )
    write_adapter(demo_dir, folder / "1" / "adapters" / "doll", seed=1)
    model = read_model_settings(folder, 1, _config(stream_mode="window", engine_args='{"max_model_len": 256}'))

    assert (model.name, model.version, model.model_dir) == ("llm", "1", folder)
    # model.json, the config's engine_args over it, enable_lora a boolean.
    assert model.engine_json == {
        "model": "demo://tiny-llama-bpe",
        "enable_lora": True,
        "max_model_len": 256,
        "tensor_parallel_size": 2,
    }
    # The engine's arguments: the backend's defaults, the demo model built, the stream mode set.
    assert model.engine_args == {
        **engine_json.ENGINE_DEFAULTS,
        "model": str(demo_dir),
        "enable_lora": True,
        "max_model_len": 256,
        "tensor_parallel_size": 2,
        "multi_step_stream_outputs": False,
    }
    assert model.backend == BackendSettings(stream_mode="window")
    assert [(a.name, a.lora_int_id, a.path) for a in model.adapters or ()] == [
        ("doll", 1, str((folder / "1" / "adapters" / "doll").resolve()))
    ]
    assert model.parallel_size == 2
    assert model.instance_count(visible_gpus=0) == 2


def test_lora_off_means_no_adapters_and_paths_resolve_under_the_model_folder(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path, {"model": "weights", "tokenizer": "org/tokenizer", "num_scheduler_steps": 4})
    (folder / "weights").mkdir()
    model = read_model_settings(folder, "1", {"name": "llm"})
    assert model.adapters is None
    assert model.engine_args["model"] == str((folder / "weights").resolve())
    assert model.engine_args["tokenizer"] == "org/tokenizer"  # a Hugging Face id stays one
    assert model.engine_args["num_scheduler_steps"] == 4 and model.engine_args["multi_step_stream_outputs"] is True


def test_a_tools_overrides_win_over_model_json_and_the_configs_engine_args(tmp_path: Path) -> None:
    """What the GPU smoke check's --model / --engine-args and the benchmarks' step counts do."""
    folder = _model_folder(tmp_path, {"model": "m", "num_scheduler_steps": 8, "dtype": "bfloat16"})
    model = read_model_settings(
        folder, "1", _config(engine_args='{"dtype": "float16"}'), overrides={"model": "n", "dtype": "float32"}
    )
    assert model.engine_json == {"model": "n", "num_scheduler_steps": 8, "dtype": "float32"}


def test_before_model_files_sees_the_backend_settings_before_any_model_is_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stub turns IPEX off there: a demo:// model built afterwards imports torch."""
    order: list[str] = []
    monkeypatch.setattr(engine_json, "resolve_path", lambda value, _folder: order.append(f"resolve {value}") or value)
    folder = _model_folder(tmp_path, {"model": "demo://tiny-llama-bpe", "enable_prefix_caching": True})
    read_model_settings(folder, "1", _config(), before_model_files=lambda s: order.append(f"use_ipex={s.use_ipex}"))
    assert order == ["use_ipex=True", "resolve demo://tiny-llama-bpe"]


@pytest.mark.parametrize(
    ("model_json", "parameters", "adapters", "message"),
    [
        ({"model": "m"}, {"stream_mode": "token"}, None, "parameter 'stream_mode' must be one of step, window, merge"),
        ({"model": "m", "num_scheduler_steps": 0}, {}, None, "'num_scheduler_steps' must be an integer >= 1, got 0"),
        ({"model": "m"}, {"engine_args": "{dtype"}, None, "parameter 'engine_args' is not valid JSON"),
        ({"model": "m", "enable_lora": True}, {}, None, r"Triton backend cannot find .*multi_lora\.json"),
        ({"model": "m", "enable_lora": True}, {}, {"ghost": "ghost"}, "adapter 'ghost': no folder at"),
        # An embedding model has no decode steps: a step count beside "embed" names both.
        (
            {"model": "m", "task": "embed", "num_scheduler_steps": 1},
            {},
            None,
            "'task'=\"embed\" and 'num_scheduler_steps'=1",
        ),
        ({"model": "m", "task": "classify"}, {}, None, "'task' must be one of auto, generate, embed .* got 'classify'"),
        (
            {"model": "m", "task": "embed"},
            {"vllm_engine": "v1"},
            None,
            "'vllm_engine'='v1' and model.json 'task'=\"embed\"",
        ),
    ],
)
def test_each_load_error_is_a_config_error_naming_the_field(
    tmp_path: Path, model_json: dict, parameters: dict[str, str], adapters: dict | None, message: str
) -> None:
    folder = _model_folder(tmp_path, model_json, adapters)
    with pytest.raises(ConfigError, match=message):
        read_model_settings(folder, "1", _config(**parameters))


def test_an_embedding_model_gets_no_multi_step_defaults(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path, {"model": "m", "task": "embed"})
    model = read_model_settings(folder, "1", _config(stream_mode="window"))
    assert "num_scheduler_steps" not in model.engine_args and "multi_step_stream_outputs" not in model.engine_args
    assert engine_args_of(model).num_scheduler_steps == 1  # vLLM's own default
    generative = read_model_settings(_model_folder(tmp_path / "g", {"model": "m", "task": "generate"}), "1", _config())
    assert generative.engine_args["num_scheduler_steps"] == 8


def test_engine_args_of_the_settings_checks_vllms_fields_then_builds(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path, {"model": "m", "disable_log_requests": True, "max_model_len": 128})
    args = engine_args_of(read_model_settings(folder, "1", _config()))
    assert (args.model, args.max_model_len, args.num_scheduler_steps) == ("m", 128, 8)
    (folder / "1" / "model.json").write_text(json.dumps({"model": "m", "tempo": 1}))
    with pytest.raises(ConfigError, match="unknown vLLM engine argument"):
        engine_args_of(read_model_settings(folder, "1", _config()))


def test_reading_settings_loads_no_vllm_torch_or_numpy_and_the_interface_nothing(tmp_path: Path) -> None:
    """Imported, and used on a local model folder: neither settings/ nor interface.py loads a heavy
    framework (the stub reads settings before IPEX is off; the front end and tools share them)."""
    folder = _model_folder(tmp_path, {"model": "weights", "enable_lora": False})
    (folder / "weights").mkdir()
    code = (
        "import json, pathlib, sys\n"
        "import triton_vllm_multistep.interface\n"
        "interface_loaded = sorted(n for n in ('numpy', 'vllm', 'torch') if n in sys.modules)\n"
        "from triton_vllm_multistep.settings import read_model_settings\n"
        f"read_model_settings(pathlib.Path({str(folder)!r}), '1', {{'name': 'llm'}})\n"
        "settings_loaded = sorted(n for n in ('vllm', 'torch', 'transformers') if n in sys.modules)\n"
        "print(json.dumps([interface_loaded, settings_loaded]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[], []]


def test_every_config_parameter_the_settings_read_is_in_the_engine_table_of_the_interface_doc() -> None:
    """docs/interface.md's per-engine table names each config.pbtxt parameter settings/ reads (found in
    its source: `params.get("name"`, `params["name"`, the `*_PARAMETER` names, `use_ipex`)."""
    root = Path(__file__).resolve().parents[2]
    source = "".join(path.read_text() for path in (root / "backend/triton_vllm_multistep/settings").glob("*.py"))
    read = set(re.findall(r'params(?:\.get\(|\[)"([A-Za-z_]+)"', source))
    read |= set(re.findall(r'_PARAMETER = "([A-Za-z_]+)"', source))
    read |= set(re.findall(r'parameter_values\(model_config\)\.get\("([a-z_]+)"', source))
    assert {"vllm_engine", "engine_args", "use_ipex", "unload_drain_seconds"} <= read
    doc = (root / "docs" / "interface.md").read_text()
    table = doc[doc.index("| config.pbtxt parameter | `multistep` | `v1` |") :].split("\n\n", 1)[0]
    named = set(re.findall(r"`([A-Za-z_]+)`", "\n".join(row.split("|")[1] for row in table.splitlines()[2:])))
    assert read - named == set(), sorted(read - named)
