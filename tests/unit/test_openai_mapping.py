"""frontend/triton_requests.py, frontend/errors.py and host/openai_process.py: the OpenAI server's
pure logic, without a server (the e2e tier runs it through the real tritonserver).

SamplingParams as vLLM's OpenAI serving code builds them become the model's sampling_parameters
with vLLM's names and values (what the backend's codec reads back to the same SamplingParams);
Triton responses become RequestOutputs (n completions split by num_output_tokens, "None" finish
reasons unfinished, logprobs as vLLM's Logprob dicts); the launcher's --openai-* options.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from vllm.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

from triton_vllm_multistep.frontend import errors, server, triton_requests, triton_stream, v1_servers
from triton_vllm_multistep.host import openai_process
from triton_vllm_multistep.interface import UNHEALTHY_ENGINE_MESSAGE
from triton_vllm_multistep.output_tap import tap_failed_message
from triton_vllm_multistep.settings import read_model_settings
from triton_vllm_multistep.stub import codec


def _round_trip(params: SamplingParams) -> SamplingParams:
    """What the backend's codec builds from the sampling_parameters sent for `params`."""
    request = triton_requests.triton_request([1, 2, 3], params, None)
    inputs = dict(request.inputs)
    generation = codec.decode_request(inputs, None, codec.ModelLimits(100, 64), encode=lambda _: [1], decode=str)
    return generation.sampling_params


def test_sampling_parameters_carry_vllm_fields_and_the_codec_reads_back_the_same_params() -> None:
    params = SamplingParams(
        n=1,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=11,
        stop=["\n\n"],
        stop_token_ids=[7],
        max_tokens=12,
        min_tokens=2,
        presence_penalty=0.5,
        logprobs=3,
        logit_bias={4: -2.0},
        output_kind=RequestOutputKind.DELTA,
    )
    sent = triton_requests.sampling_parameters(params)
    assert sent["logit_bias"] == {"4": -2.0} and sent["max_tokens"] == 12 and "truncate_prompt_tokens" not in sent
    back = _round_trip(params)
    for name in ("n", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens"):
        assert getattr(back, name) == getattr(params, name), name
    assert back.presence_penalty == 0.5 and back.logprobs == 3 and back.logit_bias == {4: -2.0}
    assert back.output_kind == RequestOutputKind.DELTA  # streamed: stream input true


def test_n_and_best_of_are_sent_as_the_client_gave_them() -> None:
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=1)  # vLLM moves n to best_of
    sent = triton_requests.sampling_parameters(params)
    assert (sent["n"], sent["best_of"]) == (2, 4)
    assert "best_of" not in triton_requests.sampling_parameters(SamplingParams(n=3, temperature=1.0))


def test_structured_output_and_adapter_go_as_the_backend_takes_them() -> None:
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "object"}), max_tokens=5)
    sent = triton_requests.sampling_parameters(params, lora_name="pirate")
    assert sent["guided_decoding"] == {"json": {"type": "object"}} and sent["lora_name"] == "pirate"


def test_what_the_backend_cannot_run_is_refused_as_a_value_error() -> None:
    with pytest.raises(ValueError, match="logits processors"):
        triton_requests.sampling_parameters(SamplingParams(logits_processors=[lambda ids, logits: logits]))


def test_prompt_logprobs_are_asked_for_and_read_back_as_vllms() -> None:
    """echo with logprobs (vLLM's serving code sets prompt_logprobs): sent, the model's output asked
    for, and its JSON (null for the first prompt token) read back as vLLM's prompt logprobs."""
    params = SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=1)
    request = triton_requests.triton_request([1, 2, 3], params, None)
    assert json.loads(request.inputs["sampling_parameters"][0])["prompt_logprobs"] == 1
    assert "prompt_logprobs" in request.outputs
    entry = {"logprob": -0.5, "rank": 1, "decoded_token": "b"}
    arrays = {
        "text_output": [b"x"],
        "output_ids": [9],
        "finish_reason": [b"None"],
        "num_output_tokens": [1],
        "prompt_logprobs": [json.dumps([None, {"2": entry}, {"3": {**entry, "rank": 2}, "4": entry}]).encode()],
    }
    output = triton_requests.request_output("r", [1, 2, 3], arrays, 1)
    assert output.prompt_logprobs[0] is None
    assert output.prompt_logprobs[1][2].logprob == -0.5 and output.prompt_logprobs[1][2].decoded_token == "b"
    assert sorted(output.prompt_logprobs[2]) == [3, 4] and output.prompt_logprobs[2][3].rank == 2
    later = {name: value for name, value in arrays.items() if name != "prompt_logprobs"}  # a later response's
    assert triton_requests.request_output("r", [1, 2, 3], later, 1).prompt_logprobs is None


def test_a_response_becomes_a_request_output_with_its_completions() -> None:
    arrays = {
        "text_output": np.array([b" a", b" b c"], dtype=np.object_),
        "output_ids": np.array([5, 6, 7], dtype=np.int32),
        "finish_reason": np.array([b"None", b"length"], dtype=np.object_),
        "num_output_tokens": np.array([1, 2], dtype=np.uint32),
        "logprobs": np.array(
            [json.dumps([{"5": {"logprob": -0.1, "rank": 1, "decoded_token": " a"}}]).encode(), b"null"],
            dtype=np.object_,
        ),
    }
    output = triton_requests.request_output("r", [1, 2], arrays, completions=2)
    first, second = output.outputs
    assert (first.index, first.text, list(first.token_ids), first.finish_reason) == (0, " a", [5], None)
    assert (second.index, second.text, list(second.token_ids), second.finish_reason) == (1, " b c", [6, 7], "length")
    assert first.logprobs[0][5].logprob == -0.1 and first.logprobs[0][5].decoded_token == " a"
    assert second.logprobs is None and not output.finished and output.prompt_token_ids == [1, 2]
    arrays["finish_reason"] = np.array([b"stop", b"length"], dtype=np.object_)
    assert triton_requests.request_output("r", [1, 2], arrays, completions=2).finished
    with pytest.raises(RuntimeError, match="3 asked for"):
        triton_requests.request_output("r", [1, 2], arrays, completions=3)


def test_unavailable_errors_are_told_from_bad_requests_by_the_backends_words() -> None:
    assert errors.is_unavailable(f"{UNHEALTHY_ENGINE_MESSAGE}: vLLM engine failed: boom")
    assert errors.is_unavailable("model is unloading: not taking new requests")
    assert errors.is_unavailable("Request for unknown model: 'x' is not found")
    assert errors.is_unavailable(tap_failed_message("/tmp/tvm-tap-x/outputs.sock"))  # the stub's words for a broken tap
    assert not errors.is_unavailable("sampling_parameters.logprobs must be between 0 and 20, got 50")


def test_the_launchers_openai_options_are_taken_out_of_tritonservers_argv() -> None:
    options, rest = openai_process.split_options(
        ["--model-repository=r", "--openai-port", "9000", "--openai-api-key=k", "--openai-args=--chat-template t.j2"]
    )
    assert rest == ["--model-repository=r"]
    assert options == openai_process.OpenAIOptions(9000, "0.0.0.0", "k", ("--chat-template", "t.j2"))
    assert openai_process.split_options(["--grpc-port=1"]) == (None, ["--grpc-port=1"])
    argv = openai_process.command(options, ["tritonserver", "--model-repository=r", "--grpc-port=7001"], 30)
    assert "--grpc-url=127.0.0.1:7001" in argv and "--model-repository=r" in argv and "--api-key=k" in argv
    assert argv[-2:] == ["--chat-template", "t.j2"]
    for bad, message in (
        (["--openai-api-key=k"], "needs --openai-port"),
        (["--openai-args", "--chat-template t.j2"], "^--openai-args needs --openai-port$"),
        (["--openai-port=x"], "must be a port number"),
        (["--openai-port"], "needs a value"),
    ):
        with pytest.raises(openai_process.OpenAIOptionError, match=message):
            openai_process.split_options(bad)
    with pytest.raises(openai_process.OpenAIOptionError, match="--allow-grpc"):
        openai_process.command(options, ["tritonserver", "--allow-grpc=false"], 30)


def test_adapters_are_served_as_model_lora_adapter_and_by_their_own_name_where_it_is_unique() -> None:
    names = server.adapter_model_names({"a": ["pirate", "shout"], "b": ["pirate", "b"], "c": []})
    assert names["a"] == {"a_lora_pirate": "pirate", "a_lora_shout": "shout", "shout": "shout"}
    assert names["b"] == {"b_lora_pirate": "pirate", "b_lora_b": "b"}  # "b" names a model
    assert names["c"] == {}


def test_response_values_read_the_raw_outputs_as_tritonclient_does() -> None:
    from tritonclient.grpc import service_pb2
    from tritonclient.grpc._infer_result import InferResult

    response = service_pb2.ModelInferResponse()
    contents = {
        "text_output": ("BYTES", b"".join(len(t).to_bytes(4, "little") + t for t in (b" a", "é".encode(), b""))),
        "output_ids": ("INT32", np.array([5, -1, 70000], dtype=np.int32).tobytes()),
        "num_output_tokens": ("UINT32", np.array([1, 2, 0], dtype=np.uint32).tobytes()),
    }
    for name, (datatype, raw) in contents.items():
        response.outputs.add(name=name, datatype=datatype, shape=[3])
        response.raw_output_contents.append(raw)
    values = triton_stream.response_values(response)
    reference = InferResult(response)
    for name in contents:
        assert values[name] == reference.as_numpy(name).tolist(), name
    assert values["text_output"] == [b" a", "é".encode(), b""]


def test_an_image_request_with_logprobs_asks_for_both_their_outputs() -> None:
    params = SamplingParams(max_tokens=4, logprobs=2)
    request = triton_requests.triton_request([1, 2], params, None, images=[b"aW1n"])
    assert {"num_input_tokens", "logprobs"} <= set(request.outputs)
    assert request.inputs["image"].tolist() == [b"aW1n"]
    assert request.inputs["return_num_input_tokens"].tolist() == [True]


def test_a_v1_models_server_gets_its_settings_and_the_apis_vllm_options_not_this_servers_own(tmp_path: Path) -> None:
    """frontend/v1_servers.py: the V1 model's engine arguments and adapters as its stub reads them
    (settings/), each adapter under its served name, vLLM's `serve` options passed on; this server's
    own options (and the names it sets per model) not."""
    folder = tmp_path / "on_v1"
    (folder / "1" / "adapters" / "doll").mkdir(parents=True)
    (folder / "1" / "adapters" / "doll" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    (folder / "1" / "adapters" / "doll" / "adapter_model.safetensors").write_bytes(b"")
    engine = {"model": str(tmp_path), "enforce_eager": True, "enable_lora": True, "max_lora_rank": 8}
    (folder / "1" / "model.json").write_text(json.dumps(engine))
    (folder / "1" / "multi_lora.json").write_text(json.dumps({"doll": "adapters/doll"}))
    loaded = {"name": "on_v1", "backend": "vllm_multistep", "parameters": {"vllm_engine": {"string_value": "v1"}}}
    settings = read_model_settings(folder, "1", loaded)
    assert server.on_v1(settings)
    argv = [
        "--grpc-url=127.0.0.1:8001", "--host", "0.0.0.0", "--port=9000", "--model-repository", str(tmp_path),
        "--triton-model=on_v1", "--api-key=k", "--chat-template", "t.jinja", "--shutdown-timeout=30",
    ]  # fmt: skip
    assert v1_servers.passed_options(argv) == ["--api-key=k", "--chat-template", "t.jinja"]
    adapters = {"on_v1_lora_doll": "doll", "doll": "doll"}
    command = v1_servers.server_argv("/v1/python", argv, "127.0.0.1:8001", settings, adapters, 4321)
    assert command[:3] == ["/v1/python", "-m", "triton_vllm_multistep.frontend_v1"]
    options = dict(arg.split("=", 1) for arg in command[3:] if arg.startswith("--") and "=" in arg)
    assert json.loads(options["--engine-args"]) == {**engine, "model": str(tmp_path)}
    assert json.loads(options["--adapters"]) == adapters
    assert (options["--triton-model"], options["--served-model-name"], options["--port"]) == ("on_v1", "on_v1", "4321")
    assert (options["--host"], options["--grpc-url"]) == ("127.0.0.1", "127.0.0.1:8001")
    doll = str(folder / "1" / "adapters" / "doll")
    lora = command.index("--lora-modules")
    assert command[lora + 1 : lora + 3] == [f"on_v1_lora_doll={doll}", f"doll={doll}"]
    assert command[-3:] == ["--api-key=k", "--chat-template", "t.jinja"]


def test_vllms_request_priority_becomes_the_models_priority_input() -> None:
    params = SamplingParams(max_tokens=3)
    assert "priority" not in triton_requests.triton_request([1, 2], params, None).inputs
    request = triton_requests.triton_request([1, 2], params, None, priority=-4)
    assert request.inputs["priority"].dtype == np.int32 and request.inputs["priority"].tolist() == [-4]
    model = codec.ModelLimits(100, 64, scheduling_policy="priority")
    generation = codec.decode_request(dict(request.inputs), None, model, encode=lambda _: [1], decode=str)
    assert generation.priority == -4


@pytest.mark.parametrize("dimensions", [None, 8])
def test_an_embedding_request_of_either_api_is_one_the_model_reads_back_as_sent(dimensions: int | None) -> None:
    """triton_stream.embedding_request (both OpenAI servers send it): the model's codec reads the same
    token ids, dimensions and priority back; the vector comes back from text_output as sent."""
    request = triton_stream.embedding_request([5, 6, 7], dimensions, priority=3)
    model = codec.ModelLimits(100, 64, scheduling_policy="priority", tasks=("embed",))
    back = codec.decode_request(dict(request.inputs), None, model, encode=None, decode=None)
    assert isinstance(back, codec.EmbeddingRequest)
    assert back.prompt_token_ids == [5, 6, 7] and back.priority == 3 and back.returns.num_input_tokens
    assert back.pooling == ({} if dimensions is None else {"dimensions": dimensions})
    assert triton_stream.embedding_vector({"text_output": ["[0.25, -1.5]"]}) == [0.25, -1.5]


def test_both_engine_clients_take_a_tokenized_prompt_and_refuse_what_they_cannot_serve() -> None:
    """triton_stream.tokenized_prompt (both OpenAI servers' engine clients): the ids, or a 400 saying why."""
    assert triton_stream.tokenized_prompt({"prompt_token_ids": (4, 5)}) == [4, 5]
    assert triton_stream.tokenized_prompt({"prompt_token_ids": [4]}, lora_request=object()) == [4]  # generation
    with pytest.raises(triton_stream.UnsupportedRequest, match="only tokenized prompts"):
        triton_stream.tokenized_prompt({"prompt": "text"})
    with pytest.raises(triton_stream.UnsupportedRequest, match="LoRA adapters are not served for embedding"):
        triton_stream.tokenized_prompt({"prompt_token_ids": [4]}, lora_request=object(), embedding=True)
    assert triton_requests.UnsupportedRequest is triton_stream.UnsupportedRequest  # vLLM answers it with a 400
