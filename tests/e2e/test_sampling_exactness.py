"""Sampling settings and structured output through the real server, on the tiny demo model.

On the session's tiny server (conftest.py: `vllm_model` at steps 8, its single-step copy
`vllm_model_steps1`, the `ensemble` on the tiny byte-level tokenizer and its chat template):
stop strings, max_tokens, penalties and seeded sampling give the same tokens at steps 8 as at 1;
every structured-output kind (choice, regex, JSON schema, JSON object, grammar) gives the same
tokens at steps 8 as at 1, streamed as whole, obeys its constraint and changes the answer;
constrained and plain requests mixed in one concurrent batch each equal their solo run; Triton's
vLLM backend's own structured_outputs/guided_decoding test logic passes (baseline: offline vLLM,
references.py); structured output through the ensemble equals the LLM model's; bad constraints
fail their request alone, naming the field. Model-agnostic checks (they were on the real model's
server in test_real_model.py); must not assert on what a model knows.
"""

from __future__ import annotations

import json
import queue
import re
import threading
from functools import partial
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from private_servers import metric, scrape, wait_for
from references import (
    CHATS,
    PLAIN,
    THEIR_GUIDED_DECODING,
    THEIR_GUIDED_PROMPTS,
    THEIR_SAMPLING_PARAMETERS,
    TINY_BPE,
    TINY_PROMPT_LOGPROBS,
    TINY_PROMPTS,
    References,
    chat_ids,
)
from served_models import LLM_MODEL, STEPS1
from transformers import AutoTokenizer
from triton_clients import StreamResult, grpc_generate, make_inputs
from tritonclient.utils import InferenceServerException

from triton_vllm_multistep.testing.local_server import ServerProcess

ENSEMBLE = "ensemble"  # the tiny server's pipeline on the byte-level tokenizer (TINY_BPE)


@pytest.fixture(scope="module")
def tokenizer(demo_model_paths: dict[str, Path]):
    return AutoTokenizer.from_pretrained(demo_model_paths[TINY_BPE])


def served(server: ServerProcess, ids: list[int], sampling: dict, model: str = LLM_MODEL, **flags) -> StreamResult:
    result = grpc_generate(server.grpc_url, model, input_ids=ids, sampling=sampling, **flags)
    assert result.error is None and result.finals == 1, (result.error, result.finals)
    return result


SAMPLINGS = {
    # " the" and "." stopped the real model's answers; "epc" and "riton" are what stops the tiny one's.
    "stop string": {"temperature": 0, "max_tokens": 40, "stop": [" the", ".", "epc", "riton"], "ignore_eos": True},
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
def test_sampling_settings_give_the_same_tokens_at_steps_1_and_8(server: ServerProcess, tokenizer, name: str) -> None:
    """A chat prompt (the tokenizer's template) and a plain one."""
    sampling = SAMPLINGS[name]
    for ids in (chat_ids(tokenizer, CHATS[1]), tokenizer.encode(PLAIN[1])):
        eight = served(server, ids, sampling, stream=True)
        one = served(server, ids, sampling, model=STEPS1, stream=True)
        assert eight.token_ids() == one.token_ids() and eight.text() == one.text()
        assert eight.token_ids()  # something was generated
        if name == "max_tokens":
            assert len(eight.token_ids()) == 7
        if name == "stop string":
            assert not any(stop in eight.text() for stop in sampling["stop"])
            assert len(eight.token_ids()) < sampling["max_tokens"]  # a stop string ended it


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
STRUCTURED = {
    "choice": ("Is Paris in France? Answer yes or no.", {"choice": ["yes", "no"]}),
    "regex": ("Write a date.", {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}),
    "json schema": ("Describe Paris as JSON.", {"json": SCHEMA}),
    # The tiny model's answer ends within max_tokens (a whole JSON object) for this question.
    "json_object": ("Cats as JSON.", {"json_object": True}),
    "grammar": ("Say a colour.", {"grammar": 'root ::= "red" | "green" | "blue"'}),
}


@pytest.mark.parametrize("kind", sorted(STRUCTURED))
def test_structured_output_at_steps_8_equals_steps_1_streamed_and_whole_and_obeys_it(
    server: ServerProcess, tokenizer, kind: str
) -> None:
    """Their backend's form: sampling_parameters.guided_decoding as a JSON string. The JSON schema's
    maxLength makes vLLM fall back to outlines (xgrammar compiles the rest)."""
    question, constraint = STRUCTURED[kind]
    ids = chat_ids(tokenizer, question)
    sampling = {"temperature": 0, "max_tokens": 128, "guided_decoding": json.dumps(constraint)}
    streamed = served(server, ids, sampling, stream=True, return_finish_reason=True)
    whole = served(server, ids, sampling)
    one = served(server, ids, sampling, model=STEPS1, stream=True)
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
        unconstrained = served(server, ids, {"temperature": 0, "max_tokens": 64}, stream=True)
        assert unconstrained.token_ids() != streamed.token_ids()  # the constraint changed the answer


def test_constrained_and_unconstrained_requests_mixed_in_one_concurrent_batch_each_equal_their_solo_run(
    server: ServerProcess, tokenizer
) -> None:
    """Every constraint kind (xgrammar, the default backend) and plain requests, greedy and seeded, sent
    at once to the steps-8 model: each gets the tokens it gets alone on the steps-1 model."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [
        (chat_ids(tokenizer, question), {"temperature": 0, "max_tokens": 48, "guided_decoding": json.dumps(c)})
        for kind, (question, c) in sorted(STRUCTURED.items())
        if kind not in ("json schema",)  # its maxLength makes vLLM fall back to outlines: not xgrammar
    ]
    jobs += [
        (chat_ids(tokenizer, "Name three colours."), {"temperature": 0, "max_tokens": 48}),
        (chat_ids(tokenizer, "Tell me about cats."), {"temperature": 0.8, "seed": 3, "max_tokens": 48}),
        (chat_ids(tokenizer, "Write a date."), {"temperature": 0.8, "seed": 5, "max_tokens": 48,
                                                "guided_decoding": json.dumps(STRUCTURED["regex"][1])}),
    ]  # fmt: skip
    alone = [served(server, ids, sampling, model=STEPS1, stream=True).token_ids() for ids, sampling in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: served(server, job[0], job[1], stream=True).token_ids(), jobs))
    assert together == alone


def test_their_structured_outputs_test_logic_passes_against_this_backend(server: ServerProcess) -> None:
    """Triton's vLLM backend's accuracy_test.test_structured_outputs: structured_outputs (r25.11+ name) as a
    JSON string in sampling_parameters, text prompts, not streamed (the prompt comes back first), the
    answers compared with vLLM without Triton: here the single-step model, and one of the choices."""
    choices = ["Positive", "Negative"]
    prompts = ["Classify this sentiment: vLLM is wonderful!", "Classify this sentiment: the build failed again."]
    sampling = {"temperature": 0, "top_p": 1, "structured_outputs": json.dumps({"choice": choices})}
    for prompt in prompts:
        ours = grpc_generate(server.grpc_url, LLM_MODEL, prompt=prompt, sampling=sampling)
        baseline = grpc_generate(server.grpc_url, STEPS1, prompt=prompt, sampling=sampling)
        assert ours.error is None and ours.finals == 1, ours.error
        assert ours.text() == baseline.text()
        assert ours.text().removeprefix(prompt) in choices, ours.text()


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
    server: ServerProcess, references: References
) -> None:
    """Triton's vLLM backend's `test_guided_decoding` (ci/L0_backend_vllm/accuracy_test/accuracy_test.py,
    r25.01-r25.10), its logic kept: the baseline is vLLM without Triton (their AsyncLLMEngine with
    SamplingParams(temperature=0, top_p=1) and GuidedDecodingParams(choice=["Positive", "Negative"],
    backend="outlines"; no backend from r25.10), each output `prompt + text` as bytes, one per guided
    prompt; then on one gRPC stream one non-streamed request per prompt, sampling_parameters =
    {"temperature": 0, "top_p": 1, "guided_decoding": json.dumps(those params)} sent both as the tensor
    and as the request parameters, only text_output asked for; each result must not be an error,
    text_output must be there, and the outputs must equal the baseline (sorted). Adapted: the model
    (the tiny byte-level demo model served by the multi-step `vllm_model`, steps 8, instead of their
    `vllm_opt`, OPT-125m) and the baseline engine (offline vLLM `LLM` on the same model and engine
    settings, references.py, computed before the server started). Their final check,
    `assertEqual(baseline.sort(), triton.sort())`, compares None with None (list.sort() returns None)
    and so can never fail; this asserts what it means, and that each answer is the prompt plus one of
    the choices."""
    baselines = {
        branch: [text.encode("utf-8") for text in references.their_guided[branch]] for branch in THEIR_GUIDED_DECODING
    }
    for branch, guided in THEIR_GUIDED_DECODING.items():
        baseline = baselines[branch]
        assert baseline != [] and len(baseline) == len(THEIR_GUIDED_PROMPTS), branch
        sampling = {**THEIR_SAMPLING_PARAMETERS, "guided_decoding": json.dumps(guided)}
        completed: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
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


# SCHEMA without maxLength, which xgrammar (the default backend) compiles itself (the outlines
# fallback is covered above, on the LLM model).
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
    server: ServerProcess, tokenizer, kind: str
) -> None:
    """preprocessing → vllm_model (steps 8) → postprocessing with sampling_parameters.guided_decoding:
    the streamed text (and tokens) equal the single-step LLM model's for the same chat prompt and
    constraint, one ensemble response per LLM response, the whole (non-streamed) ensemble text equals
    the streamed one, and the answer obeys the constraint."""
    question, constraint = ENSEMBLE_STRUCTURED[kind]
    ids = chat_ids(tokenizer, question)
    sampling = {"temperature": 0, "max_tokens": 128, "guided_decoding": json.dumps(constraint)}
    one = served(server, ids, sampling, model=STEPS1, stream=True, return_finish_reason=True, timeout=PATIENT)
    streamed, whole = (
        grpc_generate(server.grpc_url, ENSEMBLE, inputs=_ensemble_chat_inputs(question, sampling, stream),
                      timeout=PATIENT)
        for stream in (True, False)
    )  # fmt: skip
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


def test_structured_output_errors_name_the_field_and_fail_that_request_alone(server: ServerProcess) -> None:
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
        result = grpc_generate(server.grpc_url, LLM_MODEL, prompt="hi", sampling=sampling, stream=True)
        assert result.finals == 1 and result.error is not None and message in result.error, (name, result.error)
    after = grpc_generate(server.grpc_url, LLM_MODEL, prompt="hi", sampling={"max_tokens": 4}, stream=True)
    assert after.error is None and after.finals == 1


PRIORITY_MODEL = "vllm_model_priority"  # scheduling_policy "priority", max_num_seqs 2, steps 8


def test_an_urgent_request_preempts_a_full_batch_and_every_answer_stays_exact(server: ServerProcess) -> None:
    """model.json scheduling_policy "priority" on the multi-step engine: two long streams of priority
    5 fill the batch (max_num_seqs 2); a request of priority 0 arriving then preempts one of them at
    the next window's start, runs and finishes first. The urgent and the preempted answers (seeded:
    vLLM 0.8.5 reseeded a recomputed request, engine/preemption.py) are those each gets alone at steps
    1 (the `priority` input and the sampling field)."""
    # The model's whole length (1,024): 160 tokens once both ended before the urgent one came, on a fast host.
    long_requests = {
        "first": ([1, 5, 9, 12], {"temperature": 0.8, "top_p": 0.9, "seed": 3, "max_tokens": 1016, "ignore_eos": True}),
        "second": ([3, 4, 5], {"temperature": 0.8, "top_p": 0.9, "seed": 5, "max_tokens": 1016, "ignore_eos": True}),
    }
    urgent_ids, urgent_sampling = [7, 8, 2, 2, 6], {"temperature": 0.7, "seed": 9, "max_tokens": 12, "priority": 0}
    streaming = {name: threading.Event() for name in long_requests}
    results: dict[str, StreamResult] = {}

    def run_long(name: str) -> None:
        ids, sampling = long_requests[name]
        results[name] = grpc_generate(
            server.grpc_url,
            PRIORITY_MODEL,
            input_ids=ids,
            sampling=sampling,
            stream=True,
            on_response=streaming[name].set,
            priority=5,
            return_perf_metrics=True,
        )

    before = metric(scrape(server), "vllm:num_preemptions_total", PRIORITY_MODEL) or 0
    threads = [threading.Thread(target=run_long, args=(name,)) for name in long_requests]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in streaming.values())
    urgent = grpc_generate(
        server.grpc_url, PRIORITY_MODEL, input_ids=urgent_ids, sampling=urgent_sampling, stream=True,
        return_perf_metrics=True,
    )  # fmt: skip
    for thread in threads:
        thread.join(120)
    assert urgent.error is None and all(r.error is None for r in results.values()), urgent.error
    # Preempted for it: the urgent request finished while both long ones still ran.
    assert urgent.final_ns < min(r.final_ns for r in results.values())
    assert urgent.perf_metrics()["last_token_time_ns"] < min(
        r.perf_metrics()["last_token_time_ns"] for r in results.values()
    )
    assert wait_for(lambda: (metric(scrape(server), "vllm:num_preemptions_total", PRIORITY_MODEL) or 0) > before, 10)
    alone = {name: served(server, ids, sampling, STEPS1).token_ids() for name, (ids, sampling) in long_requests.items()}
    assert {name: result.token_ids() for name, result in results.items()} == alone
    urgent_alone = served(server, urgent_ids, {k: v for k, v in urgent_sampling.items() if k != "priority"}, STEPS1)
    assert urgent.token_ids() == urgent_alone.token_ids() and len(urgent_alone.token_ids()) == 12


def test_a_priority_on_a_first_come_first_served_model_fails_alone_naming_both_settings(server: ServerProcess) -> None:
    result = grpc_generate(server.grpc_url, LLM_MODEL, input_ids=[1, 5], sampling={"max_tokens": 2}, priority=3)
    assert result.error is not None and result.finals == 1
    assert "input 'priority' is 3" in result.error and "'scheduling_policy'" in result.error, result.error
    assert served(server, [1, 5], {"max_tokens": 2}).token_ids()


LOGPROB_TOLERANCE = 5e-3  # the engine tier's, for logprobs computed by different engines or batches


def test_prompt_logprobs_at_steps_8_equal_steps_1_streamed_and_whole_and_offline_vllms(
    server: ServerProcess, references: References
) -> None:
    """`prompt_logprobs` in sampling_parameters: the prompt's logprobs (null for its first token) on the
    first response only, identical at steps 8 and 1, streamed and whole; against offline vLLM (references.py)
    the same candidates per position, values within the tolerance."""
    answers = []
    for model in (LLM_MODEL, STEPS1):
        for stream in (True, False):
            result = grpc_generate(
                server.grpc_url, model, prompt=TINY_PROMPTS[0], sampling=TINY_PROMPT_LOGPROBS, stream=stream
            )
            assert result.error is None and len(result.token_ids()) == TINY_PROMPT_LOGPROBS["max_tokens"]
            carrying = [i for i, response in enumerate(result.responses) if "prompt_logprobs" in response]
            assert carrying == [0], carrying
            answers.append(json.loads(result.responses[0]["prompt_logprobs"][0]))
    assert all(answer == answers[0] for answer in answers[1:])
    served, offline = answers[0], references.tiny_prompt_logprobs
    assert served[0] is None and offline[0] is None and len(served) == len(offline) > 2
    for position, (ours, theirs) in enumerate(zip(served[1:], offline[1:], strict=True), start=1):
        assert set(ours) == set(theirs), position
        for token, entry in ours.items():
            assert entry["logprob"] == pytest.approx(theirs[token], abs=LOGPROB_TOLERANCE), (position, token)
            assert entry["decoded_token"] is not None and entry["rank"] >= 1
