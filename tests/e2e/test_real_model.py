"""The real model served by default (SmolLM2-135M-Instruct, demo://smollm2-135m-instruct).

On a server of its own serving the shipped repository plus a single-step variant of the LLM
model: served greedy tokens equal Hugging Face transformers' and offline vLLM's, streamed equal
non-streamed, 8 scheduler steps equal 1 (also with stop strings, max_tokens, penalties and
seeded sampling), a chat through the ensemble answers in real text and stops at <|im_end|>;
and a model whose real weights cannot be provided fails to load with a message saying what to run.
"""

from __future__ import annotations

import gc
import json
import queue
import shutil
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from private_servers import make_repository, serving
from served_models import LLM_MODEL, REAL_MODEL, SHIPPED_REPOSITORY
from transformers import AutoModelForCausalLM, AutoTokenizer
from triton_clients import StreamResult, grpc_generate, make_inputs
from tritonclient.utils import InferenceServerException

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.demo import smollm2
from triton_vllm_multistep.testing.local_server import ServerProcess, copy_model, start_server

STEPS1 = "vllm_model_steps1"
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colours.",
    "How many legs does a spider have?",
]
PLAIN = ["The quick brown fox", "Once upon a time, there was a", "def fibonacci(n):", "The three primary colours are"]
MAX_TOKENS = 24
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def real_model_path() -> Path:
    return demo_models.build(smollm2.NAME)


@pytest.fixture(scope="module")
def prompts(real_model_path: Path) -> list[list[int]]:
    """Prompt token ids: chats (ChatML template) and plain text (no BOS: the model adds none)."""
    tokenizer = AutoTokenizer.from_pretrained(real_model_path)
    return [chat_ids(tokenizer, q) for q in CHATS] + [tokenizer.encode(p) for p in PLAIN]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shipped repository as is (real model, ensemble) plus a single-step copy of the LLM model."""
    root = tmp_path_factory.mktemp("real-model")
    repository = root / "repository"
    shutil.copytree(SHIPPED_REPOSITORY, repository)
    copy_model(repository / LLM_MODEL, repository / STEPS1, {"num_scheduler_steps": 1})
    with serving(repository, root / "tritonserver.log") as server:
        yield server


def served(server: ServerProcess, ids: list[int], sampling: dict, model: str = LLM_MODEL, **flags) -> StreamResult:
    result = grpc_generate(server.grpc_url, model, input_ids=ids, sampling=sampling, **flags)
    assert result.error is None and result.finals == 1, (result.error, result.finals)
    return result


def test_greedy_equals_hf_and_offline_vllm_streamed_whole_and_steps_1(
    real_server: ServerProcess, real_model_path: Path, prompts: list[list[int]]
) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(str(real_model_path), dtype="float32", max_model_len=2048, seed=0, enforce_eager=True)
    offline = [
        list(o.outputs[0].token_ids)
        for o in llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompts], SamplingParams(**GREEDY), use_tqdm=False
        )
    ]
    del llm
    gc.collect()
    model = AutoModelForCausalLM.from_pretrained(real_model_path, torch_dtype=torch.float32)
    for ids, offline_ids in zip(prompts, offline, strict=True):
        tensor = torch.tensor([ids])
        hf = model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=MAX_TOKENS, do_sample=False)[
            0, len(ids) :
        ].tolist()
        streamed = served(real_server, ids, GREEDY, stream=True)
        whole = served(real_server, ids, GREEDY, stream=False, exclude_input_in_output=True)
        single_step = served(real_server, ids, GREEDY, model=STEPS1, stream=True)
        assert streamed.token_ids() == whole.token_ids() == single_step.token_ids() == offline_ids == hf
        assert streamed.text() == whole.text() == single_step.text()


def _chat_inputs(question: str, **sampling) -> list:
    inputs = make_inputs(grpcclient, sampling=sampling, stream=True, return_finish_reason=True)
    messages = grpcclient.InferInput("messages", [1], "BYTES")
    messages.set_data_from_numpy(np.array([json.dumps([{"role": "user", "content": question}]).encode()], np.object_))
    return [*inputs, messages]


def test_chat_through_the_ensemble_answers_paris_and_stops_at_im_end(real_server: ServerProcess) -> None:
    result = grpc_generate(
        real_server.grpc_url, "ensemble", inputs=_chat_inputs(CHATS[0], temperature=0, max_tokens=64)
    )
    assert result.error is None and result.finals == 1, result.error
    text = result.text()
    assert "Paris" in text and "<|im_end|>" not in text, text
    assert len(result.data_responses) > 2  # streamed, not sent in one piece
    assert result.token_ids()[-1] == 2  # <|im_end|>, the model's EOS
    assert len(result.token_ids()) < 64
    assert [r["finish_reason"][0] for r in result.data_responses if "finish_reason" in r][-1] == b"stop"


SAMPLINGS = {
    "stop string": {"temperature": 0, "max_tokens": 40, "stop": [" the", "."], "ignore_eos": True},
    "max_tokens": {"temperature": 0, "max_tokens": 7, "ignore_eos": True},
    "penalties": {
        "temperature": 0,
        "max_tokens": 32,
        "repetition_penalty": 1.3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.4,
        "ignore_eos": True,
    },
    "seeded sampling": {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1234, "max_tokens": 32},
}


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_sampling_settings_give_the_same_tokens_at_steps_1_and_8(
    real_server: ServerProcess, prompts: list[list[int]], name: str
) -> None:
    sampling = SAMPLINGS[name]
    for ids in (prompts[1], prompts[5]):
        eight = served(real_server, ids, sampling, stream=True)
        one = served(real_server, ids, sampling, model=STEPS1, stream=True)
        assert eight.token_ids() == one.token_ids() and eight.text() == one.text()
        assert eight.token_ids()  # something was generated
        if name == "max_tokens":
            assert len(eight.token_ids()) == 7
        if name == "stop string":
            assert not any(stop in eight.text() for stop in sampling["stop"])


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
STRUCTURED = {
    "choice": ("Is Paris in France? Answer yes or no.", {"choice": ["yes", "no"]}),
    "regex": ("Write a date.", {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}),
    "json schema": ("Describe Paris as JSON.", {"json": SCHEMA}),
    "json_object": ("Give me a JSON object about cats.", {"json_object": True}),
    "grammar": ("Say a colour.", {"grammar": 'root ::= "red" | "green" | "blue"'}),
}


@pytest.mark.parametrize("kind", sorted(STRUCTURED))
def test_structured_output_at_steps_8_equals_steps_1_streamed_and_whole_and_obeys_it(
    real_server: ServerProcess, real_model_path: Path, kind: str
) -> None:
    """Their backend's form: sampling_parameters.guided_decoding as a JSON string."""
    import re

    import jsonschema

    question, constraint = STRUCTURED[kind]
    tokenizer = AutoTokenizer.from_pretrained(real_model_path)
    ids = chat_ids(tokenizer, question)
    sampling = {"temperature": 0, "max_tokens": 128, "guided_decoding": json.dumps(constraint)}
    streamed = served(real_server, ids, sampling, stream=True, return_finish_reason=True)
    whole = served(real_server, ids, sampling)
    one = served(real_server, ids, sampling, model=STEPS1, stream=True)
    assert streamed.token_ids() == whole.token_ids() == one.token_ids(), kind
    assert all(len(r["output_ids"]) == 1 for r in streamed.data_responses)  # one response per step
    text = streamed.text()
    if kind == "choice":
        assert text in constraint["choice"]
    elif kind == "regex":
        assert re.fullmatch(constraint["regex"], text), text
    elif kind == "grammar":
        assert text in ("red", "green", "blue"), text
    elif streamed.data_responses[-1]["finish_reason"][0] == b"length":
        assert text.lstrip().startswith("{"), text  # cut by max_tokens: a JSON object begun
    elif kind == "json schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert isinstance(json.loads(text), dict), text
    if kind in ("choice", "regex", "grammar"):
        unconstrained = served(real_server, ids, {"temperature": 0, "max_tokens": 64}, stream=True)
        assert unconstrained.token_ids() != streamed.token_ids()  # the constraint changed the answer


def test_constrained_and_unconstrained_requests_mixed_in_one_concurrent_batch_each_equal_their_solo_run(
    real_server: ServerProcess, real_model_path: Path
) -> None:
    """Every constraint kind (xgrammar, the default backend) and plain requests, greedy and seeded, sent
    at once to the steps-8 model: each gets the tokens it gets alone on the steps-1 model."""
    from concurrent.futures import ThreadPoolExecutor

    tokenizer = AutoTokenizer.from_pretrained(real_model_path)
    jobs = [
        (chat_ids(tokenizer, question), {"temperature": 0, "max_tokens": 48, "guided_decoding": json.dumps(c)})
        for kind, (question, c) in sorted(STRUCTURED.items())
        if kind not in ("json schema",)  # its maxLength makes vLLM fall back to outlines: minutes per engine
    ]
    jobs += [
        (chat_ids(tokenizer, "Name three colours."), {"temperature": 0, "max_tokens": 48}),
        (chat_ids(tokenizer, "Tell me about cats."), {"temperature": 0.8, "seed": 3, "max_tokens": 48}),
        (chat_ids(tokenizer, "Write a date."), {"temperature": 0.8, "seed": 5, "max_tokens": 48,
                                               "guided_decoding": json.dumps(STRUCTURED["regex"][1])}),
    ]  # fmt: skip
    alone = [served(real_server, ids, sampling, model=STEPS1, stream=True).token_ids() for ids, sampling in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: served(real_server, job[0], job[1], stream=True).token_ids(), jobs))
    assert together == alone


def test_their_structured_outputs_test_logic_passes_against_this_backend(
    real_server: ServerProcess, real_model_path: Path
) -> None:
    """Triton's vLLM backend's accuracy_test.test_structured_outputs: structured_outputs (r25.11+ name) as a
    JSON string in sampling_parameters, text prompts, not streamed (the prompt comes back first), the
    answers compared with vLLM without Triton: here the single-step model, and one of the choices."""
    choices = ["Positive", "Negative"]
    prompts = ["Classify this sentiment: vLLM is wonderful!", "Classify this sentiment: the build failed again."]
    sampling = {"temperature": 0, "top_p": 1, "structured_outputs": json.dumps({"choice": choices})}
    for prompt in prompts:
        ours = grpc_generate(real_server.grpc_url, LLM_MODEL, prompt=prompt, sampling=sampling)
        baseline = grpc_generate(real_server.grpc_url, STEPS1, prompt=prompt, sampling=sampling)
        assert ours.error is None and ours.finals == 1, ours.error
        assert ours.text() == baseline.text()
        assert ours.text().removeprefix(prompt) in choices, ours.text()


# Triton's vLLM backend, ci/L0_backend_vllm/accuracy_test/accuracy_test.py (r25.01-r25.10):
# GUIDED_PROMPTS, SAMPLING_PARAMETERS and the guided_decoding it adds, per branch.
THEIR_GUIDED_PROMPTS = ["Classify intent of the sentence: Harry Potter is underrated. "]
THEIR_SAMPLING_PARAMETERS = {"temperature": 0, "top_p": 1}
THEIR_GUIDED_DECODING = {
    "r25.01-r25.09": {"choice": ["Positive", "Negative"], "backend": "outlines"},
    "r25.10": {"choice": ["Positive", "Negative"]},
}


def _their_guided_request(prompt: str, request_id: int, sampling: dict) -> dict:
    """Their ci/common/test_util.py create_vllm_request (stream False, parameters sent as the tensor):
    text_input, stream, sampling_parameters, only text_output asked for, and the same dict again as
    the request's parameters."""
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES")]
    inputs[-1].set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
    inputs.append(grpcclient.InferInput("stream", [1], "BOOL"))
    inputs[-1].set_data_from_numpy(np.array([False], dtype=bool))
    inputs.append(grpcclient.InferInput("sampling_parameters", [1], "BYTES"))
    inputs[-1].set_data_from_numpy(np.array([json.dumps(sampling).encode("utf-8")], dtype=np.object_))
    return {
        "inputs": inputs,
        "outputs": [grpcclient.InferRequestedOutput("text_output")],
        "request_id": str(request_id),
        "parameters": sampling,
    }


def _their_callback(completed: queue.Queue, result, error) -> None:
    """Their test_util.callback: the error, else the result, into the completed-requests queue."""
    completed.put(error if error else result)


def test_their_guided_decoding_test_logic_passes_against_this_backend(
    real_server: ServerProcess, real_model_path: Path
) -> None:
    """Triton's vLLM backend's `test_guided_decoding` (ci/L0_backend_vllm/accuracy_test/accuracy_test.py,
    r25.01-r25.10), its logic kept: the baseline is vLLM without Triton (their AsyncLLMEngine with
    SamplingParams(temperature=0, top_p=1) and GuidedDecodingParams(choice=["Positive", "Negative"],
    backend="outlines"; no backend from r25.10), each output `prompt + text` as bytes, one per guided
    prompt; then on one gRPC stream one non-streamed request per prompt, sampling_parameters =
    {"temperature": 0, "top_p": 1, "guided_decoding": json.dumps(those params)} sent both as the tensor
    and as the request parameters, only text_output asked for; each result must not be an error,
    text_output must be there, and the outputs must equal the baseline (sorted). Adapted: the model
    (SmolLM2 served by the multi-step `vllm_model`, steps 8, instead of their `vllm_opt`, OPT-125m) and
    the baseline engine (offline vLLM `LLM` on the same model and engine settings). Their final check,
    `assertEqual(baseline.sort(), triton.sort())`, compares None with None (list.sort() returns None)
    and so can never fail; this asserts what it means, and that each answer is the prompt plus one of
    the choices."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import GuidedDecodingParams

    llm = LLM(str(real_model_path), dtype="float32", max_model_len=2048, seed=0, enforce_eager=True)
    baselines = {}
    for branch, guided in THEIR_GUIDED_DECODING.items():
        params = SamplingParams(**THEIR_SAMPLING_PARAMETERS, guided_decoding=GuidedDecodingParams(**guided))
        outputs = llm.generate(THEIR_GUIDED_PROMPTS, params, use_tqdm=False)
        baselines[branch] = [
            (prompt + completion.text).encode("utf-8")
            for prompt, output in zip(THEIR_GUIDED_PROMPTS, outputs, strict=True)
            for completion in output.outputs
        ]
    del llm
    gc.collect()

    for branch, guided in THEIR_GUIDED_DECODING.items():
        baseline = baselines[branch]
        assert baseline != [] and len(baseline) == len(THEIR_GUIDED_PROMPTS), branch
        sampling = {**THEIR_SAMPLING_PARAMETERS, "guided_decoding": json.dumps(guided)}
        completed: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(real_server.grpc_url)
        client.start_stream(callback=partial(_their_callback, completed))
        try:
            for i, prompt in enumerate(THEIR_GUIDED_PROMPTS):
                request = _their_guided_request(prompt, i, sampling)
                client.async_stream_infer(model_name=LLM_MODEL, **request)
            triton_output = []
            for _ in THEIR_GUIDED_PROMPTS:
                result = completed.get(timeout=120)
                assert not isinstance(result, InferenceServerException), (branch, str(result))
                output = result.as_numpy("text_output")
                assert output is not None, "`text_output` should not be None"
                triton_output.extend(output)
        finally:
            client.stop_stream()
            client.close()
        assert sorted(baseline) == sorted(triton_output), branch
        for prompt, answer in zip(THEIR_GUIDED_PROMPTS, triton_output, strict=True):
            assert answer.decode("utf-8").removeprefix(prompt) in guided["choice"], (branch, answer)


def _ensemble_chat_inputs(question: str, sampling: dict, stream: bool) -> list:
    """The ensemble's chat request as client_examples/grpc_stream.py --chat builds it (messages, stream,
    sampling_parameters carrying guided_decoding as a JSON string)."""
    inputs = make_inputs(grpcclient, sampling=sampling, stream=stream)
    messages = grpcclient.InferInput("messages", [1], "BYTES")
    messages.set_data_from_numpy(np.array([json.dumps([{"role": "user", "content": question}]).encode()], np.object_))
    return [*inputs, messages]


# SCHEMA without maxLength, which xgrammar (the default backend) compiles itself; with it vLLM falls
# back to outlines, whose index over SmolLM2's 49k-token vocabulary takes minutes on a loaded 2-core
# host in each engine (that fallback is covered above, on the LLM model).
ENSEMBLE_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
ENSEMBLE_STRUCTURED = {
    "choice": STRUCTURED["choice"],
    "regex": STRUCTURED["regex"],
    "json schema": ("Describe Paris as JSON.", {"json": ENSEMBLE_SCHEMA}),
}
PATIENT = 600.0  # s without a FINAL before a request counts as hung: constraints compile slowly under load


@pytest.mark.parametrize("kind", sorted(ENSEMBLE_STRUCTURED))
def test_structured_output_through_the_ensemble_at_steps_8_equals_the_llm_at_steps_1(
    real_server: ServerProcess, real_model_path: Path, kind: str
) -> None:
    """preprocessing → vllm_model (steps 8) → postprocessing with sampling_parameters.guided_decoding:
    the streamed text (and tokens) equal the single-step LLM model's for the same chat prompt and
    constraint, one ensemble response per LLM response, the whole (non-streamed) ensemble text equals
    the streamed one, and the answer obeys the constraint."""
    import re

    import jsonschema

    question, constraint = ENSEMBLE_STRUCTURED[kind]
    ids = chat_ids(AutoTokenizer.from_pretrained(real_model_path), question)
    sampling = {"temperature": 0, "max_tokens": 128, "guided_decoding": json.dumps(constraint)}
    one = served(real_server, ids, sampling, model=STEPS1, stream=True, return_finish_reason=True, timeout=PATIENT)
    streamed, whole = (
        grpc_generate(
            real_server.grpc_url, "ensemble", inputs=_ensemble_chat_inputs(question, sampling, stream), timeout=PATIENT
        )
        for stream in (True, False)
    )
    for result in (streamed, whole):
        assert result.error is None and result.finals == 1, (kind, result.error)
    text = streamed.text()
    assert text == one.text() == whole.text(), kind
    assert streamed.token_ids() == one.token_ids() == whole.token_ids(), kind
    assert len(streamed.data_responses) == len(one.data_responses) > 1  # streamed per step, not in one piece
    assert len(whole.data_responses) == 1
    if kind == "choice":
        assert text in constraint["choice"], text
    elif kind == "regex":
        assert re.fullmatch(constraint["regex"], text), text
    elif one.data_responses[-1]["finish_reason"][0] == b"length":
        assert text.lstrip().startswith("{"), text  # cut by max_tokens: a JSON object begun
    else:
        jsonschema.validate(json.loads(text), ENSEMBLE_SCHEMA)


def test_the_readme_structured_output_example_through_the_ensemble(real_server: ServerProcess) -> None:
    """client_examples/grpc_stream.py --chat --guided-decoding, as the README shows it."""
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "client_examples" / "grpc_stream.py"
    command = [sys.executable, str(example), "Is Paris in France?", "--model", "ensemble", "--chat"]
    command += ["--url", real_server.grpc_url, "--guided-decoding", json.dumps({"choice": ["yes", "no"]})]
    answer = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip() in ("yes", "no"), answer.stdout


def test_structured_output_errors_name_the_field_and_fail_that_request_alone(real_server: ServerProcess) -> None:
    bad = {
        "not JSON": ("{choice", "guided_decoding is not valid JSON"),
        "two kinds": ({"choice": ["a"], "regex": "b"}, "needs exactly one of"),
        "unknown key": ({"choise": ["a"]}, "guided_decoding.choise is not a field"),
        "bad schema": ({"json": "{not a schema"}, "guided_decoding.json is not a valid JSON schema"),
        "backend not there": ({"regex": "a", "backend": "nonesuch"}, "guided_decoding.backend must be one of"),
        "grammar it cannot read": ({"grammar": "root ::= (", "backend": "xgrammar"}, "guided_decoding "),
    }
    for name, (value, message) in bad.items():
        sampling = {"max_tokens": 8, "guided_decoding": value if isinstance(value, str) else json.dumps(value)}
        result = grpc_generate(real_server.grpc_url, LLM_MODEL, prompt="hi", sampling=sampling, stream=True)
        assert result.finals == 1 and result.error is not None and message in result.error, (name, result.error)
    after = grpc_generate(real_server.grpc_url, LLM_MODEL, prompt="hi", sampling={"max_tokens": 4}, stream=True)
    assert after.error is None and after.finals == 1


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
