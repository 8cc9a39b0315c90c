"""The OpenAI-compatible API (`serve --openai-port`) through the real server, with the official
`openai` client.

On the session's SmolLM2 LoRA server (conftest.py: the README's LoRA repository, SmolLM2-135M-Instruct
at steps 8 with the demo adapters `pirate` and `shout`, and a single-step copy, started by the
launcher with `--openai-port` and `--openai-api-key`). Chat and completions, whole and streamed,
equal steps 1 and the KServe gRPC path token for token (greedy and seeded), one chunk per step,
usage (also in streams), stop, n, logprobs, response_format, adapters as models, 16 concurrent
streams each equal to its solo answer, a disconnect that frees the engine, the error cases (400
naming the field, 404, 401, 503 for an unloaded model); and the contract
with Triton's own OpenAI frontend: the requests it builds for a vLLM-format model (its README's
tensor names and sampling-parameter JSON) served. The OpenAI server stopping with the server is
checked on the image server (test_image_served.py), whose stop is its own. Owns the OpenAI checks;
must not assert on timings.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import requests
from private_servers import metric, scrape
from served_models import LLM_MODEL, OPENAI_API_KEY, STEPS1
from transformers import AutoTokenizer
from triton_clients import grpc_generate

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.demo import smollm2
from triton_vllm_multistep.stub import tap_writer
from triton_vllm_multistep.testing.local_server import ServerProcess
from triton_vllm_multistep.testing.polling import wait_for

QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def openai_server(smollm2_lora_server: ServerProcess) -> tuple[ServerProcess, str]:
    """The session's SmolLM2 LoRA server (conftest.py) and its OpenAI base URL."""
    return smollm2_lora_server, f"{smollm2_lora_server.openai_url}/v1"


def _status(url: str) -> int | None:
    try:
        return requests.get(url, timeout=5).status_code
    except requests.RequestException:
        return None


@pytest.fixture(scope="module")
def client(openai_server: tuple[ServerProcess, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=openai_server[1], api_key=OPENAI_API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return AutoTokenizer.from_pretrained(demo_models.build(smollm2.NAME))


def _chat(client: openai.OpenAI, model: str = LLM_MODEL, question: str = QUESTION, **extra: object) -> object:
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}], **extra)


def _streamed_chat(client: openai.OpenAI, model: str = LLM_MODEL, **extra: object) -> tuple[str, list, object]:
    """(text, the content chunks, the usage chunk's usage)."""
    chunks = list(_chat(client, model, stream=True, stream_options={"include_usage": True}, **extra))
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is not None  # the last chunk, alone
    return "".join(c.choices[0].delta.content for c in content), content, usage[0]


def test_the_models_are_listed_by_their_triton_names_with_their_adapters(client: openai.OpenAI) -> None:
    listed = {model.id: model for model in client.models.list()}
    adapters = {f"{model}_lora_{adapter}": model for model in (LLM_MODEL, STEPS1) for adapter in ("pirate", "shout")}
    # Both models have `pirate` and `shout`: the adapters' own names are not unique, so not served.
    # The shipped repository's embedding model too (test_embeddings_served.py).
    assert set(listed) == {LLM_MODEL, STEPS1, "embedding_model"} | set(adapters)
    assert all(listed[name].parent == base for name, base in adapters.items())  # vLLM lists an adapter with its base
    with pytest.raises(openai.NotFoundError):
        _chat(client, "pirate", max_tokens=4)


def test_chat_whole_and_streamed_one_chunk_per_step_equal_steps_1_and_kserve(
    client: openai.OpenAI, openai_server: tuple[ServerProcess, str], tokenizer: object
) -> None:
    whole = _chat(client, **GREEDY)
    text = whole.choices[0].message.content
    assert "Paris" in text and whole.choices[0].finish_reason in ("stop", "length")
    assert _chat(client, STEPS1, **GREEDY).choices[0].message.content == text
    streamed, content, usage = _streamed_chat(client, **GREEDY)
    assert streamed == text
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens == whole.usage.prompt_tokens
    # Per-step streaming: one chunk per decoded token (the last, the end of turn, carries no text).
    assert len(content) >= whole.usage.completion_tokens - 1
    # The chat template is the model's own: the prompt is what the tokenizer's template makes of it.
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    assert whole.usage.prompt_tokens == len(ids)
    kserve = grpc_generate(openai_server[0].grpc_url, LLM_MODEL, input_ids=ids, sampling=GREEDY, stream=True)
    assert kserve.error is None and kserve.text() == text
    # The model's stub wrote the OpenAI server's data responses to its output tap (output_tap.py).
    assert tap_writer.CONNECTED_MESSAGE in openai_server[0].log_path.read_text(errors="replace")


def test_completions_whole_and_streamed_with_stop_seed_n_and_logprobs_equal_steps_1(client: openai.OpenAI) -> None:
    def complete(model: str, **extra: object) -> object:
        return client.completions.create(model=model, prompt="The three primary colours are", **extra)

    seeded = {"temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 16, "logprobs": 2}
    answers = {model: complete(model, **seeded) for model in (LLM_MODEL, STEPS1)}
    eight, one = (answers[m].choices for m in (LLM_MODEL, STEPS1))
    assert [c.text for c in eight] == [c.text for c in one] and len(eight) == 2
    for a, b in zip(eight, one, strict=True):
        assert a.logprobs.tokens == b.logprobs.tokens and len(a.logprobs.top_logprobs[0]) >= 2
        assert a.logprobs.token_logprobs == pytest.approx(b.logprobs.token_logprobs, abs=1e-3)
    assert answers[LLM_MODEL].usage.completion_tokens == sum(len(c.logprobs.tokens) for c in eight)
    greedy = complete(LLM_MODEL, temperature=0, max_tokens=24)
    text = greedy.choices[0].text
    chunks = list(complete(LLM_MODEL, temperature=0, max_tokens=24, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    stop = text.split()[2]
    stopped = complete(LLM_MODEL, temperature=0, max_tokens=24, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text.split(stop)[0]


def test_echo_with_logprobs_and_prompt_logprobs_answer_as_vllm_with_the_models_prompt_logprobs(
    client: openai.OpenAI, openai_server: tuple[ServerProcess, str], tokenizer: object
) -> None:
    """`echo` with `logprobs` (completions) and `prompt_logprobs` (chat, vLLM's field): vLLM's serving
    code answers them from the model's `prompt_logprobs` output: the prompt's tokens and logprobs
    first (None for the first token), whole and streamed, as the KServe path returns them."""
    prompt, tokens = "The three primary colours are", 4
    ids = tokenizer.encode(prompt)
    sampling = {"temperature": 0, "max_tokens": tokens, "logprobs": 2}
    whole = client.completions.create(model=LLM_MODEL, prompt=prompt, echo=True, **sampling).choices[0]
    assert whole.text.startswith(prompt) and len(whole.logprobs.tokens) == len(ids) + tokens
    assert whole.logprobs.token_logprobs[0] is None and len(whole.logprobs.top_logprobs[1]) >= 2
    kserve = grpc_generate(
        openai_server[0].grpc_url, LLM_MODEL, input_ids=ids, sampling={**sampling, "prompt_logprobs": 2}
    )
    prompt_logprobs = json.loads(kserve.responses[0]["prompt_logprobs"][0])
    expected = [step[str(token)]["logprob"] for step, token in zip(prompt_logprobs[1:], ids[1:], strict=True)]
    assert whole.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-3)
    chunks = [c for c in client.completions.create(model=LLM_MODEL, prompt=prompt, echo=True, stream=True, **sampling)]
    streamed = [token for c in chunks if c.choices and c.choices[0].logprobs for token in c.choices[0].logprobs.tokens]
    assert streamed == whole.logprobs.tokens and "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    chat = _chat(client, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1})
    chat_prompt = chat.model_extra["prompt_logprobs"]
    assert chat_prompt[0] is None and len(chat_prompt) == chat.usage.prompt_tokens and all(chat_prompt[1:])


def test_response_format_json_schema_is_obeyed_and_equals_steps_1(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "is_capital": {"type": "boolean"}},
        "required": ["city", "is_capital"],
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    answers = [
        _chat(client, model, "Describe Paris as JSON.", max_tokens=64, temperature=0, response_format=response_format)
        for model in (LLM_MODEL, STEPS1)
    ]
    text = answers[0].choices[0].message.content
    assert text == answers[1].choices[0].message.content
    value = json.loads(text)
    assert set(value) == {"city", "is_capital"} and isinstance(value["is_capital"], bool)
    streamed, _, _ = _streamed_chat(client, question="Describe Paris as JSON.", max_tokens=64, temperature=0,
                                    response_format=response_format)  # fmt: skip
    assert streamed == text
    free_form = _chat(client, max_tokens=48, temperature=0, response_format={"type": "json_object"}).choices[0]
    assert free_form.message.content.lstrip().startswith("{")  # unconstrained, it answers in prose
    if free_form.finish_reason == "stop":
        json.loads(free_form.message.content)


def test_an_adapter_served_as_a_model_equals_its_kserve_answer_and_changes_it(
    client: openai.OpenAI, openai_server: tuple[ServerProcess, str], tokenizer: object
) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    base = _chat(client, **GREEDY).choices[0].message.content
    for adapter in ("pirate", "shout"):
        # By Triton's OpenAI frontend's name for it (`<model>_lora_<adapter>`); steps 8 = steps 1.
        text = _chat(client, f"{LLM_MODEL}_lora_{adapter}", **GREEDY).choices[0].message.content
        assert _chat(client, f"{STEPS1}_lora_{adapter}", **GREEDY).choices[0].message.content == text
        kserve = grpc_generate(
            openai_server[0].grpc_url, LLM_MODEL, input_ids=ids, sampling={**GREEDY, "lora_name": adapter}
        )
        assert kserve.error is None and kserve.text() == text and text != base, adapter


def test_sixteen_concurrent_streams_each_equal_their_solo_answer(openai_server: tuple[ServerProcess, str]) -> None:
    questions = [f"Name a word that rhymes with {word}." for word in ("cat", "dog", "sun", "tree")] * 4
    seeds = list(range(16))

    async def one(client: openai.AsyncOpenAI, question: str, seed: int) -> str:
        stream = await client.chat.completions.create(
            model=LLM_MODEL,
            messages=[{"role": "user", "content": question}],
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run(concurrent: bool) -> list[str]:
        async with openai.AsyncOpenAI(base_url=openai_server[1], api_key=OPENAI_API_KEY, max_retries=0) as client:
            if concurrent:
                return list(await asyncio.gather(*(one(client, q, s) for q, s in zip(questions, seeds, strict=True))))
            return [await one(client, q, s) for q, s in zip(questions[:4], seeds[:4], strict=True)]

    together = asyncio.run(run(concurrent=True))
    alone = asyncio.run(run(concurrent=False))
    assert together[:4] == alone and all(together)


def test_a_client_that_disconnects_frees_the_engine(openai_server: tuple[ServerProcess, str]) -> None:
    server, base = openai_server
    before = metric(scrape(server), "vllm:generation_tokens_total", LLM_MODEL) or 0.0
    body = {
        "model": LLM_MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST", f"{base}/completions", json=body, headers={"Authorization": f"Bearer {OPENAI_API_KEY}"}
        ) as r:
            lines = r.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert all(line.startswith("data:") or not line for line in received)
        # Leaving the block closes the connection in mid-stream.
    freed = wait_for(lambda: metric(scrape(server), "vllm:num_requests_running", LLM_MODEL) == 0, timeout=30)
    assert freed, "the request still runs in the engine after its client went away"
    time.sleep(1.0)
    generated = (metric(scrape(server), "vllm:generation_tokens_total", LLM_MODEL) or 0.0) - before
    assert 0 < generated < 1500, generated


def test_bad_requests_get_openai_errors_with_their_status(client: openai.OpenAI, openai_server: tuple) -> None:
    with pytest.raises(openai.NotFoundError, match="`nope` does not exist"):
        _chat(client, "nope", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        _chat(client, temperature=-1.0, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="logprobs must be between 0 and 20"):
        _chat(client, max_tokens=4, logprobs=True, top_logprobs=50)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError, match="guided_decoding"):
        _chat(client, max_tokens=4, response_format=bad_schema)
    # vLLM's `priority` goes to the model's `priority` input; this model schedules first come, first served.
    with pytest.raises(openai.BadRequestError, match="is 3, but this model schedules first come, first served"):
        _chat(client, max_tokens=4, extra_body={"priority": 3})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=openai_server[1], api_key="wrong", max_retries=0).models.list()
    assert _chat(client, max_tokens=4).choices[0].message.content  # and it serves on


def test_triton_openai_frontends_requests_for_a_vllm_model_are_served(
    openai_server: tuple[ServerProcess, str], tokenizer: object
) -> None:
    """What Triton's OpenAI frontend (server repo python/openai, r24.11+, `--backend vllm`) sends to
    a vLLM-format model: text_input (chat rendered by the tokenizer's template), stream,
    exclude_input_in_output, and sampling_parameters holding the request's fields with its schema
    defaults (chat: temperature 0.7 and "logprobs": false in r24.11-r25.11; r25.08+ max_tokens and
    return_num_*_tokens)."""
    url = openai_server[0].grpc_url
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
    chat_sampling = {"frequency_penalty": 0.0, "logprobs": False, "max_tokens": 24, "n": 1,
                     "presence_penalty": 0.0, "temperature": 0, "top_p": 1.0}  # fmt: skip
    answer = grpc_generate(url, LLM_MODEL, prompt=prompt, sampling=chat_sampling, stream=False,
                           exclude_input_in_output=True, return_num_input_tokens=True,
                           return_num_output_tokens=True)  # fmt: skip
    assert answer.error is None and answer.finals == 1, answer.error
    assert "Paris" in answer.text()
    streamed = grpc_generate(url, LLM_MODEL, prompt=prompt, sampling=chat_sampling, stream=True,
                             exclude_input_in_output=True)  # fmt: skip
    assert streamed.error is None and streamed.text() == answer.text()
    completion_sampling = {"best_of": 1, "frequency_penalty": 0.0, "ignore_eos": False, "max_tokens": 16, "n": 1,
                           "presence_penalty": 0.0, "temperature": 1.0, "top_p": 1.0, "seed": 3}  # fmt: skip
    completion = grpc_generate(url, LLM_MODEL, prompt="The sky is", sampling=completion_sampling, stream=False,
                               exclude_input_in_output=False)  # fmt: skip
    assert completion.error is None and completion.text().startswith("The sky is")  # echo: prompt prepended
    lora_sampling = {**chat_sampling, "lora_name": "pirate"}  # r25.05+: model "vllm_model_lora_pirate"
    pirate = grpc_generate(url, LLM_MODEL, prompt=prompt, sampling=lora_sampling, stream=False,
                           exclude_input_in_output=True)  # fmt: skip
    assert pirate.error is None and pirate.text() != answer.text()


@pytest.mark.stops_smollm2_model
def test_an_unloaded_model_answers_503_and_health_says_so(
    client: openai.OpenAI, openai_server: tuple[ServerProcess, str]
) -> None:
    """The last user of the session's SmolLM2 server (its marker: conftest.py moves it after the
    other users, test_real_model.py's included): the model stays unloaded (a reload here was seen to
    hold the server's stop for its whole exit timeout); the `smollm2_server` fixture loads it again
    should a user of it run later all the same."""
    server, base = openai_server
    assert requests.post(f"{server.http_url}/v2/repository/models/{STEPS1}/unload", timeout=60).status_code == 200
    assert wait_for(lambda: _status(f"{server.http_url}/v2/models/{STEPS1}/ready") != 200, timeout=120)
    with pytest.raises(openai.APIStatusError) as caught:
        _chat(client, STEPS1, max_tokens=4)
    assert caught.value.status_code == 503
    assert _status(f"{base.removesuffix('/v1')}/health") == 503
    assert _chat(client, max_tokens=4).choices[0].message.content  # the other model serves on
