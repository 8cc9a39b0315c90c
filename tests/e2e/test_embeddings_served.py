"""Embeddings through the real server: the shipped repository's `embedding_model` (all-MiniLM-L6-v2,
vLLM's task "embed" on the multi-step engine's vLLM), served by the README's repository (the session's
SmolLM2 server, conftest.py, with the OpenAI API).

Triton's vLLM backend's contract (`embedding_request` in, one FINAL response with the vector as JSON in
`text_output`, the token counts when asked): over gRPC and HTTP generate, equal to sentence-transformers'
own encode (references.py) for text and token ids, alone and 16 at once; Triton's OpenAI front end's
request form (with and without an empty `text_input`); every bad request failing alone with its
message while the model keeps serving; /v1/embeddings (float and base64, several inputs, usage, the
errors); the README's two commands; the model's metrics. The V1 engine's embeddings are in test_v1_served.py.
"""

from __future__ import annotations

import base64
import json
import subprocess
import threading

import numpy as np
import openai
import pytest
import requests
from private_servers import REPO_ROOT, metric, scrape
from references import EMBEDDING_TEXTS, References
from served_models import LLM_MODEL, OPENAI_API_KEY
from triton_clients import StreamResult, grpc_generate, http_generate

from triton_vllm_multistep.testing.local_server import ServerProcess

EMBEDDING_MODEL = "embedding_model"
# float32 vectors from one fp32 model two ways (vLLM's BERT and pooler; sentence-transformers'):
# measured differences are below 1e-7.
TOLERANCE = 1e-6
COUNTS = {"return_num_input_tokens": True, "return_num_output_tokens": True}


@pytest.fixture(scope="module")
def served(smollm2_lora_server: ServerProcess) -> ServerProcess:
    """The README's repository on the session's SmolLM2 server: its embedding_model, with the OpenAI API."""
    return smollm2_lora_server


def embed(server: ServerProcess, body: dict | str, model: str = EMBEDDING_MODEL, **flags: bool) -> StreamResult:
    return grpc_generate(server.grpc_url, model, embedding_request=body, **flags)


def vector(result: StreamResult) -> np.ndarray:
    """The one response's vector: the FINAL itself carries it (nothing before, nothing after)."""
    assert result.error is None, result.error
    assert result.finals == 1 and len(result.responses) == 1, (result.finals, len(result.responses))
    (text,) = result.responses[0]["text_output"]
    return np.array(json.loads(text), dtype=np.float32)


def test_text_and_token_ids_give_sentence_transformers_embedding_in_one_final_response(
    served: ServerProcess, references: References
) -> None:
    for text, ids, expected in zip(EMBEDDING_TEXTS, references.embedding_ids, references.embeddings, strict=True):
        by_text = embed(served, {"input": text}, **COUNTS)
        found = vector(by_text)
        assert found.shape == (384,)
        np.testing.assert_allclose(found, expected, rtol=0, atol=TOLERANCE)
        counts = by_text.responses[0]
        assert counts["num_input_tokens"].tolist() == [len(ids)] and counts["num_output_tokens"].tolist() == [0]
        # The same prompt as token ids; Triton's OpenAI front end's form (pooling_params, the two counts).
        by_ids = embed(served, {"input": ids, "pooling_params": {}}, **COUNTS)
        assert vector(by_ids).tolist() == found.tolist()


def test_triton_openai_front_ends_request_with_an_empty_text_input_is_served(
    served: ServerProcess, references: References
) -> None:
    """Its requests carry only `embedding_request` and the two counts; some clients of the config's
    required `text_input` send it empty: both served."""
    from tritonclient import grpc as grpcclient

    empty = grpcclient.InferInput("text_input", [1], "BYTES")
    empty.set_data_from_numpy(np.array([b""], dtype=np.object_))
    body = grpcclient.InferInput("embedding_request", [1], "BYTES")
    body.set_data_from_numpy(
        np.array([json.dumps({"input": EMBEDDING_TEXTS[0], "pooling_params": {}}).encode()], dtype=np.object_)
    )
    result = grpc_generate(served.grpc_url, EMBEDDING_MODEL, inputs=[empty, body])
    np.testing.assert_allclose(vector(result), references.embeddings[0], rtol=0, atol=TOLERANCE)


def test_sixteen_at_once_each_give_their_own_embedding(served: ServerProcess, references: References) -> None:
    results: dict[int, StreamResult] = {}

    def one(index: int) -> None:
        results[index] = embed(served, {"input": EMBEDDING_TEXTS[index % len(EMBEDDING_TEXTS)]})

    threads = [threading.Thread(target=one, args=(index,)) for index in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(results) == list(range(16))
    for index, result in results.items():
        expected = references.embeddings[index % len(EMBEDDING_TEXTS)]
        np.testing.assert_allclose(vector(result), expected, rtol=0, atol=TOLERANCE)


def test_http_generate_serves_the_same_vector(served: ServerProcess, references: References) -> None:
    body = {"embedding_request": json.dumps({"input": EMBEDDING_TEXTS[1]}), "return_num_input_tokens": True}
    (answer,) = http_generate(served.http_url, EMBEDDING_MODEL, body)
    assert answer["_status"] == 200, answer
    np.testing.assert_allclose(json.loads(answer["text_output"]), references.embeddings[1], rtol=0, atol=TOLERANCE)
    assert answer["num_input_tokens"] == len(references.embedding_ids[1])


@pytest.mark.parametrize(
    ("model", "body", "flags", "message"),
    [
        # Triton's vLLM backend's words, whole: the request's kind is not what the model serves.
        (
            LLM_MODEL,
            {"input": "hi"},
            {},
            f"Error generating stream: Model {LLM_MODEL} does not support 'embed' request",
        ),
        (
            EMBEDDING_MODEL,
            None,
            {},
            f"Error generating stream: Model {EMBEDDING_MODEL} does not support 'generate' request",
        ),
        (EMBEDDING_MODEL, "{not json", {}, "input 'embedding_request' is not valid JSON"),
        (EMBEDDING_MODEL, {"text": "hi"}, {}, "embedding_request.text is not a field of an embedding request"),
        (EMBEDDING_MODEL, {"input": ["a", "b"]}, {}, "embedding_request.input must be a string or a list of token ids"),
        (EMBEDDING_MODEL, {"input": [1, 10**6]}, {}, "token id 1000000 is outside the vocabulary"),
        (EMBEDDING_MODEL, {"input": "x " * 300}, {}, "more than this model's limit of 256"),
        (EMBEDDING_MODEL, {"input": "hi"}, {"stream": True}, "input 'stream' does not apply to an embedding request"),
        # vLLM's own check: this model was not trained to shorten its vector (matryoshka).
        (EMBEDDING_MODEL, {"input": "hi", "pooling_params": {"dimensions": [8]}}, {}, "does not support matryoshka"),
    ],
)
def test_a_bad_request_fails_alone_with_its_message_and_the_model_keeps_serving(
    served: ServerProcess, references: References, model: str, body: dict | str | None, flags: dict, message: str
) -> None:
    if body is None:
        result = grpc_generate(served.grpc_url, model, prompt="hi")
    else:
        result = embed(served, body, model=model, **flags)
    assert result.error is not None and message in result.error, result.error
    assert result.finals == 1 and not result.data_responses
    np.testing.assert_allclose(
        vector(embed(served, {"input": EMBEDDING_TEXTS[0]})), references.embeddings[0], rtol=0, atol=TOLERANCE
    )


def test_openai_embeddings_float_base64_and_several_inputs(served: ServerProcess, references: References) -> None:
    client = openai.OpenAI(base_url=f"{served.openai_url}/v1", api_key=OPENAI_API_KEY, max_retries=0, timeout=120)
    assert EMBEDDING_MODEL in {model.id for model in client.models.list()}
    answer = client.embeddings.create(model=EMBEDDING_MODEL, input=EMBEDDING_TEXTS[0])
    (item,) = answer.data
    np.testing.assert_allclose(item.embedding, references.embeddings[0], rtol=0, atol=TOLERANCE)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == len(references.embedding_ids[0])
    # base64: the float32 bytes of the same vector (the official client decodes it; read the raw JSON here).
    raw = requests.post(
        f"{served.openai_url}/v1/embeddings",
        json={"model": EMBEDDING_MODEL, "input": references.embedding_ids[0], "encoding_format": "base64"},
        headers={"Authorization": f"Bearer {OPENAI_API_KEY}"},
        timeout=120,
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype=np.float32)
    assert decoded.tolist() == np.array(item.embedding, dtype=np.float32).tolist()
    several = client.embeddings.create(model=EMBEDDING_MODEL, input=list(EMBEDDING_TEXTS))
    assert [d.index for d in several.data] == list(range(len(EMBEDDING_TEXTS)))
    for found, expected in zip(several.data, references.embeddings, strict=True):
        np.testing.assert_allclose(found.embedding, expected, rtol=0, atol=TOLERANCE)
    assert several.usage.prompt_tokens == sum(len(ids) for ids in references.embedding_ids)


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("embeddings", {"model": EMBEDDING_MODEL, "input": "hi", "dimensions": 8}, "does not support matryoshka"),
        ("embeddings", {"model": LLM_MODEL, "input": "hi"}, "does not support Embeddings API"),
        (
            "chat/completions",
            {"model": EMBEDDING_MODEL, "messages": [{"role": "user", "content": "hi"}]},
            "Chat Completions API",
        ),
        ("completions", {"model": EMBEDDING_MODEL, "prompt": "hi"}, "does not support Completions API"),
    ],
)
def test_openai_requests_a_model_cannot_serve_get_400(
    served: ServerProcess, route: str, body: dict, message: str
) -> None:
    answer = requests.post(
        f"{served.openai_url}/v1/{route}", json=body, headers={"Authorization": f"Bearer {OPENAI_API_KEY}"}, timeout=120
    )
    assert answer.status_code == 400 and message in answer.json()["message"], answer.text


def test_the_models_metrics_count_its_requests_and_prompt_tokens(served: ServerProcess, references: References) -> None:
    before = scrape(served)
    vector(embed(served, {"input": EMBEDDING_TEXTS[3]}))
    after = scrape(served)
    for name, step in (
        ("vllm:e2e_request_latency_seconds_count", 1),
        ("vllm:prompt_tokens_total", len(references.embedding_ids[3])),
    ):
        assert (metric(after, name, EMBEDDING_MODEL) or 0) - (metric(before, name, EMBEDDING_MODEL) or 0) == step, name
    assert (metric(after, "vllm:generation_tokens_total", EMBEDDING_MODEL) or 0) == 0


def test_the_readmes_two_embedding_commands_answer_with_sentence_transformers_embedding(
    served: ServerProcess, references: References
) -> None:
    """The README's curl lines, as written, on this server's ports (its OpenAI API wants the key)."""
    readme = (REPO_ROOT / "README.md").read_text().splitlines()
    kserve = next(line for line in readme if line.startswith("curl") and "embedding_model/generate" in line)
    openai_line = next(line for line in readme if line.startswith("curl") and "/v1/embeddings" in line)
    kserve = kserve.replace("localhost:8000", served.http_url.removeprefix("http://"))
    openai_line = openai_line.replace("localhost:9000", served.openai_url.removeprefix("http://"))
    openai_line += f" -H 'Authorization: Bearer {OPENAI_API_KEY}'"
    answers = [json.loads(subprocess.run(line, shell=True, check=True, capture_output=True, text=True).stdout)
               for line in (kserve, openai_line)]  # fmt: skip
    assert EMBEDDING_TEXTS[0] in kserve and EMBEDDING_TEXTS[0] in openai_line
    np.testing.assert_allclose(json.loads(answers[0]["text_output"]), references.embeddings[0], rtol=0, atol=TOLERANCE)
    assert answers[0]["num_input_tokens"] == len(references.embedding_ids[0])
    np.testing.assert_allclose(answers[1]["data"][0]["embedding"], references.embeddings[0], rtol=0, atol=TOLERANCE)
