"""The tokenizer ensemble (preprocessing → vllm_model → postprocessing) and the client examples.

The ensemble's streamed text must equal its non-streamed text and the LLM model's own text
for the same prompt, with both demo tokenizers, through spaces at token boundaries, multi-byte
characters split across tokens and stop strings.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from private_servers import stub_without_torch
from served_models import ENSEMBLES, TOKENIZER_MODELS
from triton_clients import StreamResult, grpc_generate, make_inputs

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello world, the model", "你好 世界 模型", "emoji 🚀 café naïve", "people write code"]
SEEDS = [1, 2, 3]


def sampled(seed: int, **extra) -> dict:
    return {"temperature": 1.0, "seed": seed, "max_tokens": 40, "ignore_eos": True, **extra}


def ensemble_inputs(prompt: str, sampling: dict, stream: bool, **tensors: np.ndarray) -> list:
    inputs = make_inputs(grpcclient, prompt=prompt, sampling=sampling, stream=stream)
    for name, array in tensors.items():
        dtype = {np.dtype(np.int32): "INT32", np.dtype(np.object_): "BYTES"}[array.dtype]
        item = grpcclient.InferInput(name, list(array.shape), dtype)
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


def run_both(server, style: str, prompt: str, sampling: dict) -> tuple[StreamResult, StreamResult, StreamResult]:
    """(LLM streamed, ensemble streamed, ensemble whole) for one prompt."""
    llm = grpc_generate(server.grpc_url, TOKENIZER_MODELS[style], prompt=prompt, sampling=sampling, stream=True)
    streamed = grpc_generate(server.grpc_url, ENSEMBLES[style], inputs=ensemble_inputs(prompt, sampling, stream=True))
    whole = grpc_generate(server.grpc_url, ENSEMBLES[style], inputs=ensemble_inputs(prompt, sampling, stream=False))
    for result in (llm, streamed, whole):
        assert result.error is None, result.error
        assert result.finals == 1
    return llm, streamed, whole


def split_multibyte_seen(result: StreamResult) -> bool:
    """A response whose tokens produced no text, followed by one completing a non-ASCII character."""
    deltas = [(len(r["output_ids"]), r["text_output"][0].decode("utf-8")) for r in result.data_responses]
    for (tokens, text), (_, following) in itertools.pairwise(deltas):
        if tokens and not text and any(ord(ch) > 127 and ch != "\ufffd" for ch in following):
            return True
    return False


@pytest.mark.parametrize("style", sorted(ENSEMBLES))
def test_ensemble_text_equals_llm_text_streamed_and_whole(server, style: str) -> None:
    split_seen = leading_space_seen = False
    for prompt in PROMPTS:
        for seed in SEEDS:
            llm, streamed, whole = run_both(server, style, prompt, sampled(seed))
            assert streamed.text() == whole.text() == llm.text(), (prompt, seed)
            assert streamed.token_ids() == llm.token_ids()
            # One ensemble response per LLM response: nothing buffered to the end.
            assert len(streamed.data_responses) == len(llm.data_responses) == 40
            split_seen |= split_multibyte_seen(streamed)
            leading_space_seen |= any(r["text_output"][0].startswith(b" ") for r in streamed.data_responses[1:])
    assert split_seen, "the prompts no longer exercise multi-byte characters split across tokens"
    assert leading_space_seen, "the prompts no longer exercise spaces at token boundaries"


@pytest.mark.parametrize("style", sorted(ENSEMBLES))
def test_ensemble_honours_stop_strings_like_the_llm(server, style: str) -> None:
    prompt, seed = PROMPTS[0], SEEDS[0]
    free = grpc_generate(server.grpc_url, TOKENIZER_MODELS[style], prompt=prompt, sampling=sampled(seed), stream=True)
    text = free.text()
    stop = next(
        text[i : i + 3] for i in range(8, len(text) - 3) if text[i : i + 3].strip() and "\ufffd" not in text[i : i + 3]
    )
    words = np.array([stop.encode()], dtype=np.object_)
    llm = grpc_generate(
        server.grpc_url, TOKENIZER_MODELS[style], prompt=prompt, sampling=sampled(seed, stop=[stop]), stream=True
    )
    streamed = grpc_generate(
        server.grpc_url, ENSEMBLES[style], inputs=ensemble_inputs(prompt, sampled(seed), True, stop_words=words)
    )
    whole = grpc_generate(
        server.grpc_url, ENSEMBLES[style], inputs=ensemble_inputs(prompt, sampled(seed), False, stop_words=words)
    )
    assert stop not in llm.text() and len(llm.text()) < len(text)
    assert streamed.text() == whole.text() == llm.text()


def test_ensemble_max_tokens_input_and_chat_messages(server) -> None:
    limited = grpc_generate(
        server.grpc_url,
        "ensemble",
        inputs=ensemble_inputs(
            "cats sleep", {"temperature": 0, "ignore_eos": True}, True, max_tokens=np.array([5], np.int32)
        ),
    )
    assert limited.error is None and len(limited.token_ids()) == 5
    messages = json.dumps([{"role": "user", "content": "hello there"}])
    chat_inputs = ensemble_inputs("unused", {"temperature": 0, "max_tokens": 4}, False)
    chat_inputs = [i for i in chat_inputs if i.name() != "text_input"]
    item = grpcclient.InferInput("messages", [1], "BYTES")
    item.set_data_from_numpy(np.array([messages.encode()], dtype=np.object_))
    chat = grpc_generate(server.grpc_url, "ensemble", inputs=[*chat_inputs, item])
    assert chat.error is None and len(chat.token_ids()) >= 1


@pytest.mark.parametrize(
    ("tensors", "drop_text", "message"),
    [
        ({}, True, "input 'text_input' is required"),
        ({"max_tokens": np.array([0], np.int32)}, False, "input 'max_tokens' must be >= 1"),
        ({"max_tokens": np.array([-5], np.int32)}, False, "input 'max_tokens' must be >= 1"),
        ({"messages": np.array([b"not json"], np.object_)}, True, "input 'messages' is not valid JSON"),
    ],
)
def test_bad_ensemble_input_gets_a_clear_error_and_the_next_request_works(
    server, tensors: dict, drop_text: bool, message: str
) -> None:
    inputs = ensemble_inputs("hello", {"temperature": 0}, True, **tensors)
    if drop_text:
        inputs = [i for i in inputs if i.name() != "text_input"]
    bad = grpc_generate(server.grpc_url, "ensemble", inputs=inputs)
    assert bad.error is not None and message in bad.error, bad.error
    good = grpc_generate(
        server.grpc_url, "ensemble", inputs=ensemble_inputs("hello", {"temperature": 0, "max_tokens": 3}, True)
    )
    assert good.error is None and len(good.token_ids()) == 3


CLIENTS = [
    ("grpc_stream.py", "grpc"),
    ("grpc_aio_stream.py", "grpc"),
    ("http_stream.py", "http"),
    ("http_generate.py", "http"),
    ("curl_stream.sh", "curl"),
]


@pytest.mark.parametrize("model", ["vllm_model", "ensemble"])
@pytest.mark.parametrize(("script", "transport"), CLIENTS)
def test_client_examples_run_against_the_server(server, script: str, transport: str, model: str) -> None:
    prompt = "Hello world, the model"
    expected = grpc_generate(
        server.grpc_url, "vllm_model", prompt=prompt, sampling={"temperature": 0, "max_tokens": 12}, stream=True
    ).text()
    path = REPO_ROOT / "client_examples" / script
    if transport == "curl":
        command = ["bash", str(path), prompt, model, "12", server.http_url]
    else:
        url = server.grpc_url if transport == "grpc" else server.http_url
        command = [sys.executable, str(path), prompt, "--model", model, "--max-tokens", "12", "--url", url]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    if transport == "curl":
        events = [json.loads(line[6:]) for line in completed.stdout.splitlines() if line.startswith("data: ")]
        assert len(events) == 12
        printed = "".join(event["text_output"] for event in events)
    else:
        printed = completed.stdout.removesuffix("\n")
    assert printed == expected


def test_the_tokenizer_stages_run_without_torch(server) -> None:
    """A tokenizer stage's stub maps no libtorch, having answered (stub/tokenizer_stages.py
    use_tokenizers_only; postprocessing replays vLLM's detokenizer from its source,
    stub/detokenization.py vllm_detokenizer). Their memory is printed, a figure, not a bound."""
    for style, ensemble in ENSEMBLES.items():
        result = grpc_generate(server.grpc_url, ensemble, inputs=ensemble_inputs(PROMPTS[2], sampled(1), stream=True))
        assert result.error is None and result.finals == 1 and result.text(), style
    stages = [f"{stage}{suffix}" for stage in ("preprocessing", "postprocessing") for suffix in ("", "_spm")]
    for stage in stages:
        print(f"{stage} stub: {stub_without_torch(server, stage):.0f} MB resident")
