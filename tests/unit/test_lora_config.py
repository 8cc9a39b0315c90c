"""Multi-LoRA as Triton's vLLM backend takes it: `enable_lora`, multi_lora.json in the version folder,
`lora_name` per request (settings/lora.py, stub/codec.py). Every adapter is checked at load, each bad one a
load error naming it; each bad request gets their backend's message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from triton_vllm_multistep.checks.adapters import MLP, write_adapter
from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.settings import lora
from triton_vllm_multistep.settings.parameters import ConfigError
from triton_vllm_multistep.stub import codec

VOCAB = 100


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return demo_models.build("tiny-llama-bpe")


@pytest.fixture()
def version_dir(tmp_path: Path, model_dir: Path) -> Path:
    version = tmp_path / "llm" / "1"
    write_adapter(model_dir, version / "adapters" / "doll", seed=1)
    write_adapter(model_dir, tmp_path / "elsewhere" / "sheep", seed=2, target_modules=MLP)
    return version


def _write(version_dir: Path, entries: object) -> None:
    version_dir.mkdir(parents=True, exist_ok=True)
    (version_dir / lora.MULTI_LORA_JSON).write_text(json.dumps(entries))


def test_enable_lora_is_read_as_their_backend_reads_it_and_handed_to_vllm_as_a_boolean() -> None:
    for value, enabled in ((True, True), ("true", True), ("True", True), (False, False), ("false", False), (1, False)):
        assert lora.lora_enabled({"enable_lora": value}) is enabled, value
        assert lora.normalize_enable_lora({"enable_lora": value})["enable_lora"] is enabled
    assert lora.normalize_enable_lora({"model": "m"}) == {"model": "m"}


def test_adapters_are_numbered_in_file_order_and_relative_paths_resolve_beside_the_file_then_in_the_cwd(
    version_dir: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(version_dir.parent.parent)  # the server's working directory, as vLLM resolves paths
    _write(version_dir, {"doll": "adapters/doll", "sheep": "elsewhere/sheep"})
    adapters = lora.load_adapters(version_dir, {"max_lora_rank": 8}, model_dir)
    assert [(a.name, a.lora_int_id) for a in adapters] == [("doll", 1), ("sheep", 2)]
    assert adapters[0].path == str((version_dir / "adapters" / "doll").resolve())
    assert adapters[1].path == str((version_dir.parent.parent / "elsewhere" / "sheep").resolve())
    assert os.path.isabs(adapters[1].path)


def test_a_missing_multi_lora_json_is_their_load_error(version_dir: Path, model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"Triton backend cannot find .*multi_lora\.json\."):
        lora.load_adapters(version_dir / "nowhere", {}, model_dir)


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ("[1, 2]", "must hold a JSON object"),
        ("{not json", "is not valid JSON"),
        ({"doll": 7}, "adapter 'doll' must map to a folder path"),
        ({"ghost": "adapters/ghost"}, "adapter 'ghost': no folder at .*adapters/ghost or .*adapters/ghost"),
        ({"empty": "."}, r"adapter 'empty': .*adapter_config\.json is missing"),
    ],
)
def test_each_bad_multi_lora_json_is_a_load_error_naming_the_adapter(
    version_dir: Path, model_dir: Path, entries: object, message: str
) -> None:
    if isinstance(entries, str):
        version_dir.mkdir(parents=True, exist_ok=True)
        (version_dir / lora.MULTI_LORA_JSON).write_text(entries)
    else:
        _write(version_dir, entries)
    with pytest.raises(ConfigError, match=message):
        lora.load_adapters(version_dir, {}, model_dir)


def test_an_adapter_of_higher_rank_than_max_lora_rank_names_both(version_dir: Path, model_dir: Path) -> None:
    write_adapter(model_dir, version_dir / "wide", seed=3, rank=32, alpha=32)
    _write(version_dir, {"wide": "wide"})
    with pytest.raises(ConfigError, match=r"'wide' has rank 32 .*above model.json 'max_lora_rank' 16"):
        lora.load_adapters(version_dir, {}, model_dir)
    assert lora.load_adapters(version_dir, {"max_lora_rank": 32}, model_dir)[0].name == "wide"


def test_an_adapter_of_another_model_is_a_load_error(version_dir: Path, model_dir: Path, tmp_path: Path) -> None:
    """An adapter whose lora_A does not fit the base weight (trained for another hidden size)."""
    other = tmp_path / "other-model"
    other.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    write_adapter(other, version_dir / "foreign", seed=4)
    _write(version_dir, {"foreign": "foreign"})
    with pytest.raises(
        ConfigError,
        match=r"'foreign' does not fit the model .*_proj is \(\d+, 256\) \(out, in\) there, its lora_A is \(8, 128\)",
    ):
        lora.load_adapters(version_dir, {}, model_dir)


def test_an_adapter_that_is_not_lora_or_has_no_weights_is_a_load_error(version_dir: Path, model_dir: Path) -> None:
    folder = version_dir / "adapters" / "doll"
    _write(version_dir, {"doll": "adapters/doll"})
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "PREFIX_TUNING"}))
    with pytest.raises(ConfigError, match="peft_type 'PREFIX_TUNING' is not a LoRA adapter"):
        lora.load_adapters(version_dir, {}, model_dir)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(ConfigError, match="has no adapter_model.safetensors or adapter_model.bin"):
        lora.load_adapters(version_dir, {}, model_dir)


ADAPTERS = (lora.Adapter("doll", 1, "/a/doll"), lora.Adapter("sheep", 2, "/a/sheep"))


def _request(
    fields: dict, adapters: tuple[lora.Adapter, ...] | None, parameters: dict | None = None
) -> codec.GenerationRequest:
    inputs = {"input_ids": np.array([1, 2, 3], dtype=np.int32)}
    if fields is not None:
        inputs["sampling_parameters"] = np.array([json.dumps(fields).encode()], dtype=np.object_)
    limits = codec.ModelLimits(VOCAB, 64, adapters=adapters)
    return codec.decode_request(inputs, json.dumps(parameters or {}), limits, lambda t: [1], lambda ids: "x")


def test_lora_name_picks_the_adapter_from_the_tensor_or_the_request_parameters() -> None:
    assert _request({"lora_name": "sheep", "max_tokens": 4}, ADAPTERS).adapter == ADAPTERS[1]
    assert _request({"max_tokens": 4}, ADAPTERS).adapter is None  # the base model
    assert _request(None, ADAPTERS, {"lora_name": "doll"}).adapter == ADAPTERS[0]
    # Their rule: with the tensor present, request parameters are not sampling fields at all.
    assert _request({"max_tokens": 4}, ADAPTERS, {"lora_name": "doll"}).adapter is None


@pytest.mark.parametrize(
    ("fields", "adapters", "message"),
    [
        ({"lora_name": "doll"}, None, "LoRA feature is not enabled."),
        ({"lora_name": "bactrian"}, ADAPTERS, "LoRA bactrian is not supported, we currently support ['doll', 'sheep']"),
        ({"lora_name": 3}, ADAPTERS, "sampling_parameters.lora_name must be a string, got a number"),
    ],
)
def test_a_lora_name_this_model_cannot_serve_gets_their_message(
    fields: dict, adapters: tuple[lora.Adapter, ...] | None, message: str
) -> None:
    with pytest.raises(codec.RequestError) as refused:
        _request(fields, adapters)
    assert str(refused.value) == message
