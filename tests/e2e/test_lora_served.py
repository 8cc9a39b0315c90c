"""Multi-LoRA through the real server, as users of Triton's vLLM backend configure it: `enable_lora` in
model.json, multi_lora.json in the version folder, `lora_name` in sampling_parameters.

The tiny demo model with two adapters constructed in PEFT's format (checks/adapters.py), served at
num_scheduler_steps 8 and 1: every adapter and the base equal steps 1 token for token and
transformers with the adapter merged into the weights; base and adapters mixed in one concurrent
batch each equal their solo runs; streamed == whole; their backend's errors (unknown adapter, LoRA
off) and load errors for bad adapters, each naming it; their multi_lora CI test logic; the
vllm:lora_requests_info series. Owns the served LoRA checks; must not assert on timings.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient
from private_servers import loaded_into, metric, model_ready, scrape
from served_models import LLM_MODEL, TINY_ENGINE
from triton_clients import grpc_generate
from tritonclient.utils import InferenceServerException

from triton_vllm_multistep.checks import adapters as lora
from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.testing.local_server import ServerProcess, copy_model
from triton_vllm_multistep.testing.polling import wait_for

SHIPPED_MODEL = Path(__file__).resolve().parents[2] / "model_repository" / "vllm_model"
STEPS8, STEPS1 = "lora_llm", "lora_llm_steps1"
NO_LORA = LLM_MODEL  # the session server's: LoRA off
LORA_ENGINE = {**TINY_ENGINE, "enable_lora": "true", "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 2}
MAX_TOKENS = 20
PROMPTS = {"base": [1, 5, 9, 12, 40], "doll": [1, 5, 9, 12, 40], "sheep": [3, 8, 2, 44, 17, 9]}
BAD_MODELS = {
    "lora_missing_file": ("no multi_lora.json", "Triton backend cannot find"),
    "lora_missing_folder": ({"ghost": "adapters/ghost"}, "adapter 'ghost': no folder at"),
    "lora_rank_too_high": ({"wide": "adapters/wide"}, "adapter 'wide' has rank 32"),
    "lora_not_linear": ({"odd": "adapters/odd"}, "adapter 'odd' adapts model.layers.0.input_layernorm, which is not a"),
    # Only vLLM's own load of the adapter (at start) finds this one: a bias without bias_enabled.
    "lora_with_bias": ({"biased": "adapters/biased"}, "LoRA adapter 'biased'"),
}


def _lora_model(repository: Path, name: str, engine: dict, entries: dict | None, adapters: dict[str, Path]) -> None:
    """A copy of the shipped LLM model with `engine` in model.json and `entries` as multi_lora.json
    (adapter folders copied into the version folder, referenced relatively as their CI does)."""
    copy_model(SHIPPED_MODEL, repository / name, engine, None)
    version = repository / name / "1"
    for adapter, folder in adapters.items():
        shutil.copytree(folder, version / "adapters" / adapter)
    (version / "multi_lora.json").unlink(missing_ok=True)  # the shipped model names the SmolLM2 demo adapters
    if entries is not None:
        (version / "multi_lora.json").write_text(json.dumps(entries))


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return demo_models.build("tiny-llama-bpe")


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        "doll": lora.write_adapter(model_dir, root / "doll", seed=11),
        "sheep": lora.write_adapter(model_dir, root / "sheep", seed=12, target_modules=(*lora.MLP, "v_proj")),
    }


@pytest.fixture(scope="module")
def lora_server(
    server: ServerProcess,
    model_repository: Path,
    tmp_path_factory: pytest.TempPathFactory,
    model_dir: Path,
    adapters: dict[str, Path],
) -> Iterator[ServerProcess]:
    """The session's tiny server with the two LoRA models loaded (NO_LORA is its vllm_model); the bad
    ones are in its repository for their tests to load."""
    root = tmp_path_factory.mktemp("lora-served")
    entries = {"doll": "adapters/doll", "sheep": "adapters/sheep"}
    _lora_model(model_repository, STEPS8, LORA_ENGINE, entries, adapters)
    _lora_model(model_repository, STEPS1, {**LORA_ENGINE, "num_scheduler_steps": 1}, entries, adapters)
    extra = {
        "wide": lora.write_adapter(model_dir, root / "wide", seed=13, rank=32, alpha=32),
        "odd": _adapter_with_module(model_dir, root / "odd", "input_layernorm"),
        "biased": lora.write_biased_adapter(model_dir, root / "biased", seed=15),
    }
    for name, (entries_or_why, _) in BAD_MODELS.items():
        bad_entries = None if isinstance(entries_or_why, str) else entries_or_why
        _lora_model(model_repository, name, LORA_ENGINE, bad_entries, {k: v for k, v in extra.items()})
    with loaded_into(server, (STEPS8, STEPS1)):
        yield server


def _adapter_with_module(model_dir: Path, out: Path, module: str) -> Path:
    """A PEFT adapter whose target module list and weights name `module` (shapes of q_proj)."""
    lora.write_adapter(model_dir, out, seed=14)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", module]}))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "adapter_model.safetensors"))
    renamed = {k.replace("self_attn.q_proj", module) if ".layers.0." in k else k: v for k, v in tensors.items()}
    save_file(renamed, str(out / "adapter_model.safetensors"))
    return out


def _sampling(name: str) -> dict:
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return {**sampling, "lora_name": name} if name != "base" else sampling


def _generate(server: ServerProcess, model: str, name: str, stream: bool = True):
    result = grpc_generate(server.grpc_url, model, input_ids=PROMPTS[name], sampling=_sampling(name), stream=stream)
    assert result.error is None and result.finals == 1, (model, name, result.error)
    return result


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_each_adapter_and_the_base_at_steps_8_equal_steps_1_and_transformers_with_the_adapter_merged(
    lora_server: ServerProcess, model_dir: Path, adapters: dict[str, Path], name: str
) -> None:
    streamed = _generate(lora_server, STEPS8, name)
    whole = _generate(lora_server, STEPS8, name, stream=False)
    one = _generate(lora_server, STEPS1, name)
    assert streamed.token_ids() == whole.token_ids() == one.token_ids()
    assert all(len(r["output_ids"]) == 1 for r in streamed.data_responses)  # one response per step
    reference = lora.greedy_ids(lora.merged_model(model_dir, adapters.get(name)), PROMPTS[name], MAX_TOKENS)
    assert streamed.token_ids() == reference, name


def test_the_adapters_change_the_answers(lora_server: ServerProcess) -> None:
    answers = {name: tuple(_generate(lora_server, STEPS8, name).token_ids()) for name in ("base", "doll")}
    assert answers["base"] != answers["doll"]  # same prompt, another adapter


def test_base_and_adapters_mixed_in_one_concurrent_batch_each_equal_their_solo_run(lora_server: ServerProcess) -> None:
    solo = {name: _generate(lora_server, STEPS8, name).token_ids() for name in PROMPTS}
    names = [name for name in PROMPTS for _ in range(4)]
    with ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(lambda name: _generate(lora_server, STEPS8, name), names))
    for name, result in zip(names, results, strict=True):
        assert result.token_ids() == solo[name], name


def test_an_unknown_adapter_and_lora_while_off_get_their_backends_messages_and_the_model_goes_on(
    lora_server: ServerProcess,
) -> None:
    unknown = grpc_generate(lora_server.grpc_url, STEPS8, input_ids=[1, 2], sampling={"lora_name": "bactrian"})
    assert unknown.finals == 1 and unknown.error is not None
    assert "LoRA bactrian is not supported, we currently support ['doll', 'sheep']" in unknown.error
    off = grpc_generate(lora_server.grpc_url, NO_LORA, input_ids=[1, 2], sampling={"lora_name": "doll"})
    assert off.finals == 1 and off.error is not None and "LoRA feature is not enabled." in off.error
    assert _generate(lora_server, STEPS8, "doll").token_ids()


@pytest.mark.parametrize("model", sorted(BAD_MODELS))
def test_a_bad_adapter_fails_the_load_naming_it_and_the_server_serves_on(
    lora_server: ServerProcess, model: str
) -> None:
    _, named = BAD_MODELS[model]
    # Closed at once: Triton's gRPC server otherwise waits ~20 s at stop for a channel that saw a failed load.
    with (
        grpcclient.InferenceServerClient(lora_server.grpc_url) as client,
        pytest.raises(InferenceServerException) as raised,
    ):
        client.load_model(model)
    assert named in str(raised.value), str(raised.value)
    assert not model_ready(lora_server, model)
    assert _generate(lora_server, STEPS8, "sheep").token_ids()


def test_their_multi_lora_test_logic_passes(lora_server: ServerProcess) -> None:
    """Triton's vLLM backend's ci/L0_multi_gpu_vllm/multi_lora (r25.05): multi_lora_test.py over gRPC,
    lora_name only inside the sampling_parameters tensor, temperature 0, top_p 1, not streamed, prompt
    excluded; each adapter's answer is the expected one (theirs: fixed strings of their Gemma adapters;
    here: the steps-1 model's answer for the same adapter), an unknown name ("bactrian") gets exactly
    "LoRA bactrian is not supported, we currently support ['doll', 'sheep']"; and their test.sh's curl
    checks on the HTTP generate endpoint, exact text."""
    sampling = {"temperature": 0, "top_p": 1}
    for name in ("doll", "sheep"):
        fields = {**sampling, "lora_name": name, "max_tokens": 16}
        ours = grpc_generate(lora_server.grpc_url, STEPS8, prompt="Instruct: What do you think of", sampling=fields,
                             stream=False, exclude_input_in_output=True)  # fmt: skip
        expected = grpc_generate(lora_server.grpc_url, STEPS1, prompt="Instruct: What do you think of",
                                 sampling=fields, stream=False, exclude_input_in_output=True)  # fmt: skip
        assert ours.error is None and ours.text() == expected.text() and ours.text(), name
        # Their curl body: the flags inside "parameters" too.
        parameters = {"stream": False, **fields, "exclude_input_in_output": True}
        body = {"text_input": "Instruct: What do you think of", "parameters": parameters}
        http = requests.post(f"{lora_server.http_url}/v2/models/{STEPS8}/generate", json=body, timeout=120)
        assert http.status_code == 200 and http.json()["text_output"] == expected.text(), http.text
    body = {"text_input": "hi", "parameters": {"lora_name": "bactrian"}}
    http = requests.post(f"{lora_server.http_url}/v2/models/{STEPS8}/generate", json=body, timeout=120)
    assert http.json()["error"] == "LoRA bactrian is not supported, we currently support ['doll', 'sheep']", http.text
    http = requests.post(f"{lora_server.http_url}/v2/models/{NO_LORA}/generate", json=body, timeout=120)
    assert http.json()["error"] == "LoRA feature is not enabled.", http.text


def test_lora_requests_info_names_the_adapters_as_vllm_does(lora_server: ServerProcess) -> None:
    """Long requests, so that the engine's state (sampled every 0.25 s) sees them running."""

    def long_request(name: str) -> None:
        sampling = {**_sampling(name), "max_tokens": 600}
        result = grpc_generate(lora_server.grpc_url, STEPS8, input_ids=PROMPTS[name], sampling=sampling)
        assert result.error is None, result.error

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(long_request, ["doll", "sheep"]))

    def newest_series() -> dict[str, str] | None:
        text = scrape(lora_server)
        idle = metric(text, "vllm:lora_requests_info", STEPS8, running_lora_adapters="", max_lora="2")
        return {"idle": str(idle)} if idle is not None else None

    assert wait_for(newest_series, timeout=30)
    text = scrape(lora_server)
    assert any(
        metric(text, "vllm:lora_requests_info", STEPS8, running_lora_adapters=running, max_lora="2") is not None
        for running in ("doll", "sheep", "doll,sheep", "sheep,doll")
    ), [line for line in text.splitlines() if "lora_requests_info" in line]
    assert metric(scrape(lora_server), "vllm:lora_requests_info", NO_LORA) is None  # LoRA off: no series
