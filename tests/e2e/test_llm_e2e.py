"""The LLM model end to end through the real tritonserver: streaming, exactness, errors, cancel.

References come from the same demo models run offline by vLLM (LLM.generate) and by Hugging
Face transformers (references.py, computed before the server started and cached on disk), so
"correct" means token-for-token equal to both.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from private_servers import REPO_ROOT, readme_client_command, readme_repository
from references import TINY_BPE, TINY_GREEDY, TINY_MAX_TOKENS, TINY_PROMPTS, TINY_SPM, References
from served_models import LLM_MODEL, TOKENIZER_MODELS
from transformers import AutoTokenizer
from triton_clients import StreamResult, aio_generate, grpc_generate, http_generate, make_inputs

PROMPTS = list(TINY_PROMPTS)
MAX_TOKENS = TINY_MAX_TOKENS
GREEDY = TINY_GREEDY
DEMO_FOR_STYLE = {"bytelevel": TINY_BPE, "metaspace": TINY_SPM}


def assert_single_final(result: StreamResult) -> None:
    assert result.finals == 1, f"{result.finals} FINAL responses, error={result.error}"


@pytest.mark.parametrize("style", sorted(TOKENIZER_MODELS))
def test_greedy_streamed_equals_whole_equals_offline_vllm_and_hf(server, references: References, style: str) -> None:
    model = TOKENIZER_MODELS[style]
    offline = references.tiny_offline[DEMO_FOR_STYLE[style]]
    for prompt, (ref_ids, ref_text) in zip(PROMPTS, offline, strict=True):
        streamed = grpc_generate(server.grpc_url, model, prompt=prompt, sampling=GREEDY, stream=True)
        whole = grpc_generate(
            server.grpc_url, model, prompt=prompt, sampling=GREEDY, stream=False, exclude_input_in_output=True
        )
        assert_single_final(streamed)
        assert_single_final(whole)
        assert streamed.error is None and whole.error is None
        assert len(whole.data_responses) == 1
        assert streamed.token_ids() == whole.token_ids() == ref_ids
        assert streamed.text() == whole.text() == ref_text
        for response in streamed.data_responses:
            response["text_output"][0].decode("utf-8")  # every delta is valid UTF-8 on its own
    # Hugging Face on one prompt per style (slow-ish): token-for-token the same.
    assert references.tiny_hf_first[DEMO_FOR_STYLE[style]] == offline[0][0]


@pytest.mark.parametrize("model", [LLM_MODEL, "vllm_model_steps1"])
def test_k_tokens_give_k_data_responses_when_streaming_per_step(server, model: str) -> None:
    tokens = 21  # ends mid-window at 8 steps
    result = grpc_generate(
        server.grpc_url, model, prompt="the engine schedules", sampling={**GREEDY, "max_tokens": tokens}, stream=True
    )
    assert_single_final(result)
    assert result.error is None
    assert len(result.data_responses) == tokens
    assert all(len(r["output_ids"]) == 1 for r in result.data_responses)


def test_window_streaming_sends_fewer_bigger_responses_with_the_same_tokens(server) -> None:
    sampling = {**GREEDY, "max_tokens": 21}
    per_step = grpc_generate(server.grpc_url, LLM_MODEL, prompt="rivers run", sampling=sampling, stream=True)
    per_window = grpc_generate(
        server.grpc_url, "vllm_model_window", prompt="rivers run", sampling=sampling, stream=True
    )
    assert_single_final(per_window)
    assert per_window.token_ids() == per_step.token_ids()
    assert per_window.text() == per_step.text()
    assert len(per_window.data_responses) <= 5  # prefill + ceil(20 / 8) windows, not 21 responses


def test_multistep_is_in_effect_on_cpu(server) -> None:
    log = server.log_path.read_text(errors="replace")
    assert re.search(r"ready: num_scheduler_steps=8", log), "the shipped model must run 8 steps per window"


def test_32_concurrent_streams_each_get_their_own_output(server) -> None:
    prompts = [f"{word} {i}" for i, word in enumerate(["cats sleep", "the fox", "people read", "stars"] * 8)]
    lengths = [4 + (i * 7) % 29 for i in range(len(prompts))]

    async def run_all() -> list[StreamResult]:
        async with grpcaio.InferenceServerClient(server.grpc_url) as client:
            return await asyncio.gather(
                *(
                    aio_generate(client, LLM_MODEL, prompt=p, sampling={**GREEDY, "max_tokens": n}, stream=True)
                    for p, n in zip(prompts, lengths, strict=True)
                )
            )

    results = asyncio.run(run_all())
    for prompt, length, result in zip(prompts, lengths, results, strict=True):
        assert_single_final(result)
        assert result.error is None
        alone = grpc_generate(
            server.grpc_url,
            LLM_MODEL,
            prompt=prompt,
            sampling={**GREEDY, "max_tokens": length},
            exclude_input_in_output=True,
        )
        assert result.token_ids() == alone.token_ids()
        assert len(result.token_ids()) == length
        assert result.text() == alone.text()


LONG_IDS = [1] + [5] * 1100
BAD_INPUTS = [
    ({"prompt": "hi", "sampling": "{not json"}, "sampling_parameters' is not valid JSON"),
    ({"prompt": "hi", "sampling": "[1, 2]"}, "must be a JSON object"),
    ({"prompt": "hi", "sampling": {"temprature": 0.5}}, "temprature is not a known vLLM sampling parameter"),
    ({"prompt": "hi", "sampling": {"max_tokens": "ten"}}, "max_tokens: expected an integer"),
    ({"prompt": "hi", "sampling": {"max_tokens": 0}}, "max_tokens must be >= 1"),
    ({"prompt": "hi", "sampling": {"temperature": -1}}, "temperature"),
    ({"prompt": "hi", "sampling": {"top_p": 1.5}}, "top_p"),
    ({"prompt": "hi", "sampling": {"n": 1000}}, "n must be between 1 and"),
    ({"prompt": "hi", "sampling": {"stop_token_ids": [10**6]}}, "stop_token_ids: token id 1000000 is outside"),
    ({"prompt": "hi", "sampling": {"guided_decoding": {"regex": "a+", "json_object": True}}}, "needs exactly one of"),
    ({"prompt": "hi", "sampling": {"logits_processors": ["x"]}}, "logits processors are not supported"),
    ({"prompt": "hi", "sampling": {"lora_name": "x"}}, "LoRA feature is not enabled."),
    ({"prompt": ""}, "'text_input' is empty"),
    ({"input_ids": []}, "the prompt has no tokens"),
    ({"input_ids": LONG_IDS}, "more than this model's limit of 1024"),
    ({"input_ids": [1, 10**6]}, "input 'input_ids': token id 1000000 is outside the vocabulary"),
    ({"prompt": "hi", "input_ids": [1, 5]}, "exactly one of 'text_input' or 'input_ids' is required, not both"),
    ({"sampling": {"max_tokens": 3}}, "exactly one of 'text_input' or 'input_ids' is required"),
    (
        {"prompt": "hi", "stream": True, "exclude_input_in_output": False},
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed.",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_gets_a_clear_error_and_the_next_request_works(server, kwargs: dict, message: str) -> None:
    result = grpc_generate(server.grpc_url, LLM_MODEL, **kwargs)
    assert result.error is not None and message in result.error, result.error
    assert_single_final(result)
    assert "NoneType" not in result.error
    good = grpc_generate(server.grpc_url, LLM_MODEL, prompt="hello", sampling={**GREEDY, "max_tokens": 3}, stream=True)
    assert good.error is None and len(good.token_ids()) == 3


def test_invalid_utf8_text_input_is_refused(server) -> None:
    item = grpcclient.InferInput("text_input", [1], "BYTES")
    item.set_data_from_numpy(np.array([b"\xff\xfe bad"], dtype=np.object_))
    result = grpc_generate(server.grpc_url, LLM_MODEL, inputs=[item])
    assert result.error is not None and "not valid UTF-8" in result.error


def test_request_parameters_are_sampling_fields(server) -> None:
    via_params = grpc_generate(
        server.grpc_url,
        LLM_MODEL,
        inputs=make_inputs(grpcclient, prompt="hello there", stream=True),
        parameters={"max_tokens": 5, "temperature": 0, "ignore_eos": True},
    )
    assert via_params.error is None and len(via_params.token_ids()) == 5
    wrong = grpc_generate(
        server.grpc_url, LLM_MODEL, inputs=make_inputs(grpcclient, prompt="x"), parameters={"max_tokenz": 5}
    )
    assert wrong.error is not None and "max_tokenz is not a known" in wrong.error


def kv_blocks(server) -> tuple[float, float]:
    text = requests.get(server.metrics_url, timeout=5).text

    def value(name: str) -> float:
        match = re.search(rf'^{re.escape(name)}\{{[^}}]*model="{LLM_MODEL}"[^}}]*\}} (\S+)$', text, re.M)
        assert match, f"{name} missing from metrics"
        return float(match.group(1))

    return value("vllm_multistep:kv_cache_free_blocks"), value("vllm_multistep:kv_cache_total_blocks")


def test_cancelled_streams_free_their_kv_blocks(server) -> None:
    sampling = {**GREEDY, "max_tokens": 600}
    results = [
        grpc_generate(
            server.grpc_url, LLM_MODEL, prompt=f"long story {i}", sampling=sampling, stream=True, cancel_after=3
        )
        for i in range(4)
    ]
    assert all(len(r.responses) >= 3 and r.finals == 0 for r in results)
    deadline = time.monotonic() + 20
    free, total = kv_blocks(server)
    while free != total and time.monotonic() < deadline:
        time.sleep(0.25)
        free, total = kv_blocks(server)
    assert total > 0 and free == total
    good = grpc_generate(server.grpc_url, LLM_MODEL, prompt="after", sampling={**GREEDY, "max_tokens": 4}, stream=True)
    assert good.error is None and len(good.token_ids()) == 4


def test_non_streaming_prepends_prompt_and_optional_outputs_only_when_asked(server, demo_model_paths) -> None:
    plain = grpc_generate(server.grpc_url, LLM_MODEL, prompt="Hello world", sampling={**GREEDY, "max_tokens": 5})
    assert plain.text().startswith("Hello world")
    assert set(plain.data_responses[0]) <= {"text_output", "output_ids"}
    full = grpc_generate(
        server.grpc_url,
        LLM_MODEL,
        prompt="Hello world",
        sampling={**GREEDY, "max_tokens": 5, "logprobs": 2},
        exclude_input_in_output=True,
        return_finish_reason=True,
        return_cumulative_logprob=True,
        return_logprobs=True,
        return_num_input_tokens=True,
        return_num_output_tokens=True,
    )
    response = full.data_responses[0]
    assert full.text() == plain.text().removeprefix("Hello world")
    assert response["finish_reason"][0] == b"length"
    assert response["num_output_tokens"].tolist() == [5]
    prompt_ids = AutoTokenizer.from_pretrained(demo_model_paths["tiny-llama-bpe"]).encode("Hello world")
    assert response["num_input_tokens"].tolist() == [len(prompt_ids)]
    assert np.isfinite(response["cumulative_logprob"][0])
    steps = json.loads(response["logprobs"][0])
    assert len(steps) == 5 and all(len(step) >= 1 for step in steps)


def test_a_client_asking_for_some_outputs_gets_those_with_the_same_stream(server) -> None:
    """The backend builds only the outputs asked for (Triton would drop the others): same text and
    ids, one response per step, whatever the selection."""
    sampling = {**GREEDY, "max_tokens": 12}
    everything = grpc_generate(
        server.grpc_url, LLM_MODEL, prompt="the cat", sampling=sampling, stream=True, return_num_output_tokens=True
    )
    text_only = grpc_generate(
        server.grpc_url, LLM_MODEL, prompt="the cat", sampling=sampling, stream=True, outputs=["text_output"]
    )
    counted = grpc_generate(
        server.grpc_url,
        LLM_MODEL,
        prompt="the cat",
        sampling=sampling,
        stream=True,
        return_num_output_tokens=True,
        outputs=["output_ids", "num_output_tokens"],
    )
    for result in (everything, text_only, counted):
        assert_single_final(result)
        assert len(result.data_responses) == len(everything.data_responses) == 12
    assert {name for r in text_only.data_responses for name in r} == {"text_output"}
    assert text_only.text() == everything.text()
    assert {name for r in counted.data_responses for name in r} == {"output_ids", "num_output_tokens"}
    assert counted.token_ids() == everything.token_ids()
    assert sum(int(r["num_output_tokens"][0]) for r in counted.data_responses) == 12


def test_n_greater_than_one_returns_each_completion_at_its_index(server) -> None:
    sampling = {"temperature": 1.0, "seed": 7, "n": 3, "max_tokens": 6, "ignore_eos": True}
    result = grpc_generate(
        server.grpc_url, LLM_MODEL, prompt="cats", sampling=sampling, stream=True, return_num_output_tokens=True
    )
    assert_single_final(result)
    counts = np.sum([r["num_output_tokens"] for r in result.data_responses], axis=0)
    assert counts.tolist() == [6, 6, 6]
    texts = [result.text(i) for i in range(3)]
    assert len(set(texts)) > 1  # three independent samples


def test_http_generate_and_generate_stream(server) -> None:
    body = {
        "text_input": "Hello world, the model",
        "parameters": {"max_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    whole = http_generate(server.http_url, LLM_MODEL, body | {"exclude_input_in_output": True})[0]
    assert whole["_status"] == 200, whole
    events = http_generate(server.http_url, LLM_MODEL, body | {"stream": True}, stream=True)
    assert len(events) == 8
    assert "".join(e["text_output"] for e in events) == whole["text_output"]
    bad = http_generate(server.http_url, LLM_MODEL, {"text_input": "x", "parameters": {"max_tokens": -3}})[0]
    assert bad["_status"] == 400 and "max_tokens must be >= 1" in bad["error"]


def test_the_client_example_prints_the_requests_timings_with_perf_metrics(server) -> None:
    """client_examples/grpc_stream.py --perf-metrics, as the README shows it: the answer, then the
    engine's timings of the request from its FINAL response (return_perf_metrics)."""
    example = Path(__file__).resolve().parents[2] / "client_examples" / "grpc_stream.py"
    command = [sys.executable, str(example), "hello", "--url", server.grpc_url, "--max-tokens", "8", "--perf-metrics"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    pattern = (
        r"scheduled after ([\d.]+) ms, first token after ([\d.]+) ms, last token after ([\d.]+) ms, "
        r"(\d+) prompt tokens from the prefix cache"
    )
    match = re.fullmatch(pattern, summary)
    assert match is not None, done.stdout
    scheduled, first, last = (float(match.group(i)) for i in (1, 2, 3))
    assert 0 <= scheduled <= first <= last < 120_000 and match.group(4) == "0"


def test_the_readmes_priority_example_sends_a_priority_and_prints_the_prompts_logprobs(
    server, demo_model_paths, tmp_path
) -> None:
    """The README's priority example: its repository commands set model.json's scheduling_policy to
    "priority" (made here as written), and its client line, run against the tiny server's model with
    that policy, is served and prints one line of logprobs per prompt token after the first."""
    repository = readme_repository("/tmp/priority_repository", tmp_path / "priority_repository")
    assert json.loads((repository / LLM_MODEL / "1" / "model.json").read_text())["scheduling_policy"] == "priority"
    argv = readme_client_command("--priority -1")
    command = [*argv, "--url", server.grpc_url, "--max-tokens", "4", "--model", "vllm_model_priority"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    prompt_ids = AutoTokenizer.from_pretrained(demo_model_paths["tiny-llama-bpe"]).encode(argv[2])
    lines = [line for line in done.stdout.splitlines() if line.startswith("prompt token ")]
    assert len(lines) == len(prompt_ids) - 1, done.stdout
    assert all(re.fullmatch(r"prompt token \d+: most likely .* \(-?\d+\.\d{3}\)", line) for line in lines), lines
