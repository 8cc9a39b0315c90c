"""The real model served by default (SmolLM2-135M-Instruct, demo://smollm2-135m-instruct).

On the session's SmolLM2 server (conftest.py `smollm2_lora_server`: the README's LoRA repository,
i.e. the shipped repository with LoRA switched on by the README's sed, plus a single-step copy of
its LLM model; its `vllm_model` has LoRA on, and the requests here carry no adapter): served greedy
tokens equal Hugging Face transformers' and offline vLLM's (references.py, computed before the
server started), streamed equal non-streamed and 8 scheduler steps equal 1; a chat through the
ensemble answers in real text and stops at <|im_end|>; the README's structured-output example
answers through the ensemble; and a model whose real weights cannot be provided fails to load with
a message saying what to run (a tiny server of its own). Owns the checks about that model's answers;
the model-agnostic sampling and structured-output checks are on the tiny model
(test_sampling_exactness.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from private_servers import make_repository
from references import CHATS, REAL_GREEDY, References, real_prompts
from served_models import LLM_MODEL, REAL_MODEL, STEPS1
from transformers import AutoTokenizer
from triton_clients import StreamResult, grpc_generate, make_inputs

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.demo import smollm2
from triton_vllm_multistep.testing.local_server import ServerProcess, start_server


@pytest.fixture(scope="module")
def real_model_path() -> Path:
    return demo_models.build(smollm2.NAME)


@pytest.fixture(scope="module")
def prompts(real_model_path: Path) -> list[list[int]]:
    """Prompt token ids: chats (ChatML template) and plain text (no BOS: the model adds none)."""
    return real_prompts(AutoTokenizer.from_pretrained(real_model_path))


def served(server: ServerProcess, ids: list[int], sampling: dict, model: str = LLM_MODEL, **flags) -> StreamResult:
    result = grpc_generate(server.grpc_url, model, input_ids=ids, sampling=sampling, **flags)
    assert result.error is None and result.finals == 1, (result.error, result.finals)
    return result


def test_greedy_equals_hf_and_offline_vllm_streamed_whole_and_steps_1(
    smollm2_server: ServerProcess, references: References, prompts: list[list[int]]
) -> None:
    """Base requests (no adapter) to the LoRA-enabled models: the same tokens as the plain model's
    references outside Triton."""
    for ids, offline_ids, hf in zip(prompts, references.real_offline, references.real_hf, strict=True):
        streamed = served(smollm2_server, ids, REAL_GREEDY, stream=True)
        whole = served(smollm2_server, ids, REAL_GREEDY, stream=False, exclude_input_in_output=True)
        single_step = served(smollm2_server, ids, REAL_GREEDY, model=STEPS1, stream=True)
        assert streamed.token_ids() == whole.token_ids() == single_step.token_ids() == offline_ids == hf
        assert streamed.text() == whole.text() == single_step.text()


def _chat_inputs(question: str, **sampling) -> list:
    inputs = make_inputs(grpcclient, sampling=sampling, stream=True, return_finish_reason=True)
    messages = grpcclient.InferInput("messages", [1], "BYTES")
    messages.set_data_from_numpy(np.array([json.dumps([{"role": "user", "content": question}]).encode()], np.object_))
    return [*inputs, messages]


def test_chat_through_the_ensemble_answers_paris_and_stops_at_im_end(smollm2_server: ServerProcess) -> None:
    result = grpc_generate(
        smollm2_server.grpc_url, "ensemble", inputs=_chat_inputs(CHATS[0], temperature=0, max_tokens=64)
    )
    assert result.error is None and result.finals == 1, result.error
    text = result.text()
    assert "Paris" in text and "<|im_end|>" not in text, text
    assert len(result.data_responses) > 2  # streamed, not sent in one piece
    assert result.token_ids()[-1] == 2  # <|im_end|>, the model's EOS
    assert len(result.token_ids()) < 64
    assert [r["finish_reason"][0] for r in result.data_responses if "finish_reason" in r][-1] == b"stop"


def test_the_readme_structured_output_example_through_the_ensemble(smollm2_server: ServerProcess) -> None:
    """client_examples/grpc_stream.py --chat --guided-decoding, as the README shows it."""
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "client_examples" / "grpc_stream.py"
    command = [sys.executable, str(example), "Is Paris in France?", "--model", "ensemble", "--chat"]
    command += ["--url", smollm2_server.grpc_url, "--guided-decoding", json.dumps({"choice": ["yes", "no"]})]
    answer = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip() in ("yes", "no"), answer.stdout


def test_a_model_that_cannot_be_provided_is_a_load_error_saying_what_to_run(tmp_path: Path) -> None:
    """No cached conversion and no GGUF file: the model does not load, and Triton's load error
    (log and model status) says why and what to run, listing no frames of the code that found it."""
    cache = tmp_path / "cache" / "demo-models" / demo_models.BUILD_VERSION
    cache.mkdir(parents=True)
    for name in demo_models.DEMO_MODELS:  # the launcher builds the tiny ones first: reuse them
        (cache / name).symlink_to(demo_models.build(name))
    repository = make_repository(tmp_path, {LLM_MODEL: {"engine": {"model": REAL_MODEL}}})
    log = tmp_path / "tritonserver.log"
    env = {"TRITON_VLLM_MULTISTEP_CACHE": str(tmp_path / "cache"), smollm2.GGUF_ENV: str(tmp_path / "no.gguf")}
    server = start_server(repository, log, env=env)
    try:
        with pytest.raises(RuntimeError, match="server exited"):
            server.wait_ready(timeout=300)
    finally:
        server.stop()
    text = log.read_text(errors="replace")
    load_errors = [line for line in text.splitlines() if "failed to load 'vllm_model' version 1" in line]
    assert load_errors and "no.gguf" in load_errors[0] and "run scripts/setup.sh" in load_errors[0], text[-3000:]
    assert "DemoModelError" in text and "smollm2.py(" not in text and "config.py(" not in text, text[-3000:]
